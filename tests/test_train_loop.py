"""The training job: resume equivalence, NaN guard, checkpoint fallback, config
errors, and the binary end to end on digits."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

import chex
import jax
import numpy as np
import pytest

from tiny_configs import tiny_cifar10
from vmoe_ext.app import main as main_module
from vmoe_ext.app import train as loop
from vmoe_ext.app.context import RunContext, resolved
from vmoe_ext.data.source import DataSource
from vmoe_ext.errors import ConfigError
from vmoe_ext.reporting.writers import TIMING_METRICS, read_metrics
from vmoe_ext.train.config_files import CONFIG_DIR, load_config
from vmoe_ext.train import loop as loop_module
from vmoe_ext.train.loop import NonFiniteError
from vmoe_ext.train.steps import make_train_step

ROOT = os.path.dirname(CONFIG_DIR)
STEPS = 12


def tiny_config(**train):
  config = load_config("tiny")
  config.train.total_steps = STEPS
  config.train.log_every = 2
  config.train.eval_every = 0
  config.train.checkpoint_every = 4
  config.train.keep_checkpoints = 3
  for key, value in train.items():
    config.train[key] = value
  return config


def restored_state(config, workdir):
  run = loop.setup(config, workdir)
  step = run.restore()
  run.checkpoints.close()
  return step, run.state


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
  """An uninterrupted run of STEPS steps."""
  workdir = str(tmp_path_factory.mktemp("straight"))
  final = loop.train_and_evaluate(tiny_config(), workdir)
  return workdir, final


def _train_lines(workdir):
  """The train lines by step, without their timings."""
  return {r["step"]: {k: v for k, v in r.items() if k not in TIMING_METRICS}
          for r in read_metrics(workdir) if r["split"] == "train"}


def test_resume_after_preemption_equals_straight_run(straight, tmp_path):
  workdir, final = straight
  resumed_dir = str(tmp_path / "resumed")
  # Killed at step 7: the last checkpoint is step 4; steps 5-7 are redone.
  assert loop.train_and_evaluate(tiny_config(), resumed_dir,
                                 stop_at_step=7) is None
  resumed_final = loop.train_and_evaluate(tiny_config(), resumed_dir)
  assert resumed_final == final
  for step, line in _train_lines(workdir).items():
    assert _train_lines(resumed_dir)[step] == line, step
  step_a, state_a = restored_state(tiny_config(), workdir)
  step_b, state_b = restored_state(tiny_config(), resumed_dir)
  assert step_a == step_b == STEPS
  chex.assert_trees_all_equal(state_a.params, state_b.params)
  chex.assert_trees_all_equal(state_a.opt_state, state_b.opt_state)


class SignalAt(DataSource):
  """The config's data; the batch of step `step` (1-based) sends this
  process `signals` (one after the other, each handled before the next)."""

  def __init__(self, config, step, signals):
    super().__init__(config.data, config.seed)
    self.step, self.signals, self.served = step, signals, 0

  def train_iterator(self):
    iterator, source = super().train_iterator(), self

    class Signalling:
      def __next__(self):
        source.served += 1
        if source.served == source.step:
          for signum in source.signals:
            os.kill(os.getpid(), signum)
            time.sleep(0.01)  # The handler runs at the next bytecode.
        return next(iterator)

      def __getattr__(self, name):
        return getattr(iterator, name)

    return Signalling()


@pytest.mark.parametrize("signum,status", [(signal.SIGINT, 130),
                                           (signal.SIGTERM, 143)])
def test_a_stop_signal_saves_the_step_and_resumes_exactly(
    straight, tmp_path, capfd, signum, status):
  """Ctrl-C (SIGINT) or SIGTERM in step 6: the step ends, its checkpoint is
  saved (not a periodic one: those are 4, 8, 12), `Preempted` names the
  signal (the binary's exit status: 130 or 143), the handlers are given
  back, and the same command resumes to the straight run's state (after
  SIGTERM; both signals leave the same checkpoint of step 6, and the
  binary's Ctrl-C chain is test_reliability's)."""
  workdir = str(tmp_path / "run")
  config = tiny_config()
  handlers = {s: signal.getsignal(s) for s in loop_module.STOP_SIGNALS}
  with pytest.raises(loop_module.Preempted) as stopped:
    loop.train_and_evaluate(config, workdir, handle_sigterm=True,
                            data=SignalAt(resolved(config), 6, [signum]))
  assert stopped.value.signum == signum
  assert {s: signal.getsignal(s) for s in handlers} == handlers
  assert main_module.stop_status(stopped.value) == status
  what = {signal.SIGINT: "interrupted (Ctrl-C)",
          signal.SIGTERM: "SIGTERM received"}[signum]
  assert str(stopped.value).startswith(f"{what}; the checkpoint of step 6 ")
  assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == [
      "4", "6"]
  printed = capfd.readouterr().err
  assert printed.count("Ctrl-C: stopping after saving a checkpoint") == (
      signum == signal.SIGINT)
  if signum == signal.SIGINT:
    return
  assert loop.train_and_evaluate(tiny_config(), workdir) == straight[1]
  _, state = restored_state(tiny_config(), workdir)
  _, reference = restored_state(tiny_config(), straight[0])
  chex.assert_trees_all_equal(state.params, reference.params)


def test_a_second_ctrl_c_stops_at_once(tmp_path):
  """Two Ctrl-Cs in step 6: `KeyboardInterrupt` before the step ends,
  nothing saved after the periodic checkpoint of step 4 (the binary: exit
  130, one line)."""
  workdir = str(tmp_path / "run")
  config = tiny_config()
  handler = signal.getsignal(signal.SIGINT)
  with pytest.raises(KeyboardInterrupt) as stopped:
    loop.train_and_evaluate(config, workdir, handle_sigterm=True,
                            data=SignalAt(resolved(config), 6,
                                          [signal.SIGINT, signal.SIGINT]))
  assert main_module.stop_status(stopped.value) == 130
  assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["4"]
  assert signal.getsignal(signal.SIGINT) == handler  # Given back.


def test_outputs_and_final_line(straight):
  workdir, final = straight
  records = read_metrics(workdir)
  last = records[-1]
  assert last["final"] is True and last["split"] == "test"
  assert last["step"] == STEPS
  assert last["accuracy"] == pytest.approx(final["accuracy"])
  # Evaluation covers every test example exactly once (355 digits).
  assert last["num_examples"] == 355
  assert round(last["accuracy"] * 355, 6) == round(last["accuracy"] * 355)
  for name in ("report.md", "training_curves.png", "expert_load.png"):
    assert os.path.getsize(os.path.join(workdir, name)) > 0
  assert os.listdir(os.path.join(workdir, "tensorboard"))
  assert f"| accuracy | {final['accuracy']:.4f} |" in open(
      os.path.join(workdir, "report.md")).read()
  # Progress on every train line: batches of 32 from the 1,797 - 355 =
  # 1,442 training digits, and a positive throughput.
  train = [r for r in records if r["split"] == "train"]
  assert [r["step"] for r in train] == list(range(2, STEPS + 1, 2))
  for r in train:
    assert r["examples_seen"] == 32 * r["step"]
    assert r["epoch"] == pytest.approx(32 * r["step"] / 1442, rel=1e-12)
    assert r["images_per_second"] > 0


def test_final_accuracy_matches_an_independent_evaluation(straight):
  workdir, final = straight
  config = tiny_config()
  _, state = restored_state(config, workdir)
  run = loop.setup(config, workdir + "_eval")
  correct = total = 0
  apply = jax.jit(run.model.apply)  # One compilation, not op by op.
  for batch in run.eval_batches():
    logits, _ = apply({"params": state.params}, batch["image"])
    pred = np.argmax(np.asarray(logits), -1)
    keep = np.asarray(batch["mask"])
    correct += int(np.sum((pred == batch["label"])[keep]))
    total += int(keep.sum())
  run.checkpoints.close()
  assert total == 355
  assert final["accuracy"] == pytest.approx(correct / total, abs=1e-9)


def test_corrupt_newest_checkpoint_falls_back_with_a_warning(straight,
                                                             tmp_path):
  workdir, final = straight
  copy = str(tmp_path / "copy")
  shutil.copytree(workdir, copy)
  os.remove(os.path.join(copy, "metrics.jsonl"))
  newest = os.path.join(copy, "checkpoints", str(STEPS))
  for root, _, files in os.walk(newest):
    for name in files:
      with open(os.path.join(root, name), "wb") as f:
        f.write(b"corrupt")
  with pytest.warns(UserWarning, match=str(STEPS)):
    resumed_final = loop.train_and_evaluate(tiny_config(), copy)
  # Restored step 8 and re-trained 9..12 to the same result.
  assert resumed_final == final


def test_incompatible_checkpoint_in_workdir_is_an_error(straight, tmp_path):
  workdir, _ = straight
  copy = str(tmp_path / "copy")
  shutil.copytree(workdir, copy)
  config = tiny_config()
  config.model.hidden_size = 24
  with pytest.raises(ConfigError, match="workdir"):
    loop.train_and_evaluate(config, copy)


class _PoisonedBatch:
  """A training iterator whose 6th batch has non-finite images."""

  def __init__(self, inner, value):
    self.inner, self.value = inner, value

  def __next__(self):
    batch = next(self.inner)
    if self.inner.get_state() == {"epoch": 0, "index": 6 * 32}:  # 6th batch
      batch = dict(batch, image=np.full_like(batch["image"], self.value))
    return batch

  def get_state(self):
    return self.inner.get_state()

  def set_state(self, state):
    self.inner.set_state(state)

  @property
  def num_examples(self):
    return self.inner.num_examples


class _PoisonedSource(DataSource):
  """The config's data with `_PoisonedBatch` training batches: injected
  into the run through `train_and_evaluate(data=...)`."""

  def __init__(self, config, value):
    config = resolved(config)
    super().__init__(config.data, config.seed)
    self.value = value
    self._poisoned = None

  def train_iterator(self):
    if self._poisoned is None:
      self._poisoned = _PoisonedBatch(super().train_iterator(), self.value)
    return self._poisoned


def test_nan_guard_stops_naming_the_step_and_keeps_last_good_checkpoint(
    tmp_path):
  workdir = str(tmp_path / "nan")
  with pytest.raises(NonFiniteError, match="at step 6"):
    loop.train_and_evaluate(tiny_config(), workdir,
                            data=_PoisonedSource(tiny_config(), np.nan))
  assert sorted(os.listdir(os.path.join(workdir, "checkpoints")),
                key=lambda s: (len(s), s))[-1] == "4"
  step, state = restored_state(tiny_config(), workdir)
  assert step == 4
  assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(state.params))


def test_nan_between_checks_is_named_at_the_next_checkpoint_step(tmp_path):
  # Bad 6th batch, no log step before 12: the guard (on the device) is read
  # back before the save of step 8, which must not happen.
  workdir = str(tmp_path / "nan")
  with pytest.raises(NonFiniteError, match=r"at step 6\b.*up to 8"):
    loop.train_and_evaluate(
        tiny_config(log_every=12), workdir,
        data=_PoisonedSource(tiny_config(log_every=12), np.inf))
  assert os.listdir(os.path.join(workdir, "checkpoints")) == ["4"]
  assert not [r for r in read_metrics(workdir) if r["step"] > 4]


def test_train_step_skips_a_non_finite_update_on_the_device(tmp_path):
  run = loop.setup(tiny_config(), str(tmp_path))
  run.checkpoints.close()
  step_fn = jax.jit(make_train_step(run.model), donate_argnums=0)
  batch = next(run.data.train_iterator())
  good, _ = step_fn(run.state, batch)
  params = jax.device_get(good.params)
  bad_batch = dict(batch, image=np.full_like(batch["image"], np.nan))
  bad, metrics = step_fn(good, bad_batch)
  assert not np.isfinite(float(metrics["loss"]))
  chex.assert_trees_all_equal(jax.device_get(bad.params), params)
  assert (int(bad.step), int(bad.nonfinite_count),
          int(bad.first_nonfinite_step)) == (2, 1, 2)
  worse, _ = step_fn(bad, bad_batch)
  assert (int(worse.nonfinite_count), int(worse.first_nonfinite_step)) == (
      2, 2)


def test_evaluating_a_checkpoint_builds_no_optimizer_or_train_iterator(
    straight, tmp_path):
  import ml_collections
  from vmoe_ext.app.evaluate import evaluate_checkpoint
  workdir, final = straight
  config = tiny_config()
  config.robustness = ml_collections.ConfigDict(dict(
      checkpoint_dir=workdir, num_examples=8, attacks=(), sweep=None,
      corruptions=None))
  # Through the seam: what the evaluate-only mode opens.
  ctx = RunContext.assemble(config)
  ctx.open_evaluation(workdir)
  assert ctx.state.opt_state is None and ctx.checkpoints is None
  assert not ctx.data.opened_training
  assert int(ctx.state.step) == STEPS
  # The mode itself: the training run's final metrics, exactly.
  out = str(tmp_path / "eval")
  assert evaluate_checkpoint(config, out) == final
  (line,) = [r for r in read_metrics(out) if r.get("final")]
  assert line["step"] == STEPS and line["accuracy"] == final["accuracy"]


def test_layering_train_and_reporting_never_import_evaluate():
  import ast
  package = os.path.join(ROOT, "vmoe_ext")
  forbidden = {"train": ("vmoe_ext.evaluate",),
               "reporting": ("vmoe_ext.evaluate", "vmoe_ext.train")}
  for sub, prefixes in forbidden.items():
    for name in sorted(os.listdir(os.path.join(package, sub))):
      if not name.endswith(".py"):
        continue
      tree = ast.parse(open(os.path.join(package, sub, name)).read())
      for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
          names = [node.module or ""] + [
              f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
          names = [a.name for a in node.names]
        else:
          continue
        bad = [n for n in names if n.startswith(prefixes)]
        assert not bad, f"vmoe_ext/{sub}/{name} imports {bad}"


@pytest.mark.parametrize("override,field", [
    (("data", "batch_size", 0), "data.batch_size"),
    (("data", "name", "imagenet_toy"), "data.name"),
    (("data", "eval_batch_size", 3), "data.eval_batch_size"),
    (("train", "label_smoothing", -0.1), "train.label_smoothing"),
    (("train", "total_steps", 0), "train.total_steps"),
    (("optimizer", "warmup_steps", 10**6), "optimizer.warmup_steps"),
    (("optimizer", "name", "lamb"), "optimizer.name"),
    (("model", "patch_size", (3, 3)), "model.patch_size"),
])
def test_config_errors_name_the_field(override, field, tmp_path):
  config = tiny_config()
  section, key, value = override
  config[section][key] = value
  with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
    loop.setup(config, str(tmp_path))


def test_config_error_for_k_greater_than_e(tmp_path):
  config = tiny_config()
  config.model.moe.router.num_selected = 3
  with pytest.raises(ConfigError, match=r"router\.num_selected"):
    loop.setup(config, str(tmp_path))


def test_binary_reports_config_errors_cleanly(tmp_path):
  proc = subprocess.run(
      [sys.executable, "-m", "vmoe_ext.main", "--config=configs/tiny.py",
       f"--workdir={tmp_path}", "--config.model.moe.num_experts=0"],
      cwd=ROOT, capture_output=True, text=True, timeout=900)
  assert proc.returncode == 2
  assert "config error: model.moe.num_experts" in proc.stderr


@pytest.mark.parametrize("name", sorted(
    f[:-3] for f in os.listdir(CONFIG_DIR) if f.endswith(".py")))
def test_every_config_file_validates(name):
  from vmoe_ext.app.schema import validate_config
  config = load_config(name)
  validate_config(config)
  assert config.optimizer.total_steps == config.train.total_steps


def test_cifar10_tfds_config_trains_on_mock_data(tmp_path):
  import tensorflow_datasets as tfds
  os.makedirs(tmp_path / "tfds")
  config = tiny_cifar10(load_config("cifar10_tfds"), str(tmp_path / "tfds"))
  with tfds.testing.mock_data(num_examples=6):
    final = loop.train_and_evaluate(config, str(tmp_path / "run"))
  assert final["num_examples"] == 6 and final["step"] == 2
  assert read_metrics(str(tmp_path / "run"))[-1]["final"] is True


def test_binary_tfds_config_names_a_missing_data_dir(tmp_path):
  proc = subprocess.run(
      [sys.executable, "-m", "vmoe_ext.main",
       "--config=configs/cifar10_tfds.py", f"--workdir={tmp_path}",
       f"--config.data.data_dir={tmp_path / 'missing'}"],
      cwd=ROOT, capture_output=True, text=True, timeout=900)
  assert proc.returncode == 2, proc.stderr[-2000:]
  assert "config error: data.data_dir" in proc.stderr
  assert "does not exist" in proc.stderr
