"""Reliability of the binary: overrides of every documented field, workdir
checks and locking, the weight NaN guard, and an exact metrics record under
kill -9, Ctrl-C, re-runs and evaluation into a training workdir.

The end-to-end tests share one uninterrupted run of `configs/tiny.py` with a
short after-training evaluation (`tests/fast_tiny_config.py`; the
reference): every interrupted or repeated run must end with exactly its
`metrics.jsonl` records and TensorBoard points.
"""

from __future__ import annotations

import collections
import os
import re
import signal
import subprocess
import sys
import time
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from test_train_utils import _read_records
from tensorboardX.proto import event_pb2
from vmoe_ext.app.schema import CONFIG
from vmoe_ext.config import Field, validate
from vmoe_ext.app.context import resolved
from vmoe_ext.config.overrides import prepare_overrides
from vmoe_ext.errors import ConfigError
from vmoe_ext.models import build_model
from vmoe_ext.reporting.writers import TIMING_METRICS, read_metrics
from vmoe_ext.train import loop
from vmoe_ext.train.config_files import CONFIG_DIR, load_config
from vmoe_ext.train.state import TrainState
from vmoe_ext.train.steps import make_train_step
from vmoe_ext.train.workdir import WorkdirLock, check_workdir

ROOT = os.path.dirname(CONFIG_DIR)
ENV = {**os.environ, "CI": "1", "JAX_PLATFORMS": "cpu"}


# configs/tiny.py with a short after-training evaluation (one attack, one
# corruption): long enough to be killed in, cheap to run six times.
FAST = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                    "fast_tiny_config.py")


def binary(workdir, *args, config=FAST):
  return [sys.executable, "-m", "vmoe_ext.main", f"--config={config}",
          *args, f"--workdir={workdir}"]


def run_binary(workdir, *args, **kw):
  return subprocess.run(binary(workdir, *args, **kw), cwd=ROOT, env=ENV,
                        capture_output=True, text=True, timeout=600)


def tensorboard_points(workdir, kind="simple_value"):
  """Every (tag, step) point of the event files, with repetitions: the
  scalars, or with kind="image" the images."""
  logdir = os.path.join(workdir, "tensorboard")
  points = collections.Counter()
  for name in os.listdir(logdir):
    if name.startswith("events.out.tfevents"):
      for record in _read_records(os.path.join(logdir, name)):
        event = event_pb2.Event.FromString(record)
        for value in event.summary.value:
          if value.WhichOneof("value") == kind:
            points[(value.tag, event.step)] += 1
  return points


def wait_for(predicate, proc, timeout=300.0):
  end = time.time() + timeout
  while time.time() < end:
    if predicate():
      return
    assert proc.poll() is None, proc.communicate()
    time.sleep(0.02)
  raise AssertionError("timed out")


def records_or_empty(workdir):
  try:
    return read_metrics(workdir)
  except FileNotFoundError:
    return []


# ------------------------------------------------------------ overrides


def test_overrides_reach_fields_the_config_lacks_or_holds_as_none():
  config = load_config("tiny")
  assert "noise_std" not in config.model.moe.router
  prepare_overrides(config, [
      "prog", "--config.robustness.checkpoint_dir=x",
      "--config.model.moe.router.noise_std=0.5",
      "--config.model.moe.dispatcher=einsum",
      "--config.model.stream.name=plain",
      "--config.data.image_size=8"], CONFIG)
  # Typed placeholders (None until the flag parser sets them).
  assert config.model.moe.router.get_ref("noise_std").get_type() is float
  assert config.model.moe.get_ref("dispatcher").get_type() is str
  assert config.data.get_ref("image_size").get_type() is int
  assert config.model.stream.get_ref("name").get_type() is str
  # Untouched fields keep their values.
  assert config.model.moe.router.num_selected == 1


def test_overrides_reject_unknown_fields_with_their_full_path():
  for flag, field in [("--config.model.moe.foo=1", "model.moe.foo"),
                      ("--config.foo=1", "foo"),
                      ("--config.data.batchsize=16", "data.batchsize"),
                      ("--config.model.moe.router.nois_std=1",
                       "model.moe.router.nois_std")]:
    with pytest.raises(ConfigError) as e:
      prepare_overrides(load_config("tiny"), ["prog", flag], CONFIG)
    assert e.value.field == field
  with pytest.raises(ConfigError, match="did you mean 'noise_std'"):
    prepare_overrides(load_config("tiny"),
                      ["prog", "--config.model.moe.router.nois_std=1"], CONFIG)


def test_overrides_look_fields_up_with_the_overridden_selector():
  # expert_choice has no num_selected: known only once `name` is read, even
  # from a flag that comes after.
  with pytest.raises(ConfigError) as e:
    prepare_overrides(load_config("tiny"), [
        "prog", "--config.model.moe.router.num_selected=2",
        "--config.model.moe.router.name=expert_choice"], CONFIG)
  assert e.value.field == "model.moe.router.num_selected"


def _through_the_flags(name, argv):
  """The config the binary resolves from `configs/NAME.py` and `argv`
  (`parse_config_flags`, the binary's path), and its notes."""
  from absl import flags as absl_flags
  from vmoe_ext.app.main import parse_config_flags
  notes = []
  values = absl_flags.FlagValues()
  parse_config_flags([argv[0], f"--config=configs/{name}.py", *argv[1:]],
                     values, notes)
  return resolved(values.config), notes


def test_a_quick_run_needs_two_overrides():
  """The README's quick try: 30 steps (the default config's warm-up, 4% of
  the run, follows: 1 step; 100 of the full 2,500) and no robustness."""
  config, notes = _through_the_flags("default", [
      "prog", "--config.train.total_steps=30", "--config.robustness=None"])
  assert (config.train.total_steps, config.optimizer.total_steps,
          config.optimizer.warmup_steps) == (30, 30, 1)
  assert config.robustness is None and not notes
  full, _ = _through_the_flags("default", ["prog"])
  assert full.optimizer.warmup_steps == 100
  # An explicit warm-up still wins over the default's share.
  config, _ = _through_the_flags("default", [
      "prog", "--config.train.total_steps=30",
      "--config.optimizer.warmup_steps=7"])
  assert config.optimizer.warmup_steps == 7


def test_a_router_switched_from_the_command_line_drops_its_own_fields():
  """noisy top-k's fields that expert choice lacks are dropped, and those it
  defaults differently take its default, with one note each; the fields
  both default alike keep the file's values."""
  config, notes = _through_the_flags("default", [
      "prog", "--config.model.moe.router.name=expert_choice"])
  was = "the config file's {} (for noisy_topk) is "
  assert notes == [
      "model.moe.router.importance_loss_weight: " + was.format(0.005) +
      "dropped: expert_choice has no such field",
      "model.moe.router.load_loss_weight: " + was.format(0.005) +
      "dropped: expert_choice has no such field",
      "model.moe.router.noise_std: " + was.format(1.0) + "not carried over "
      "to expert_choice; it takes expert_choice's default 0.0",
      "model.moe.router.num_selected: " + was.format(2) +
      "dropped: expert_choice has no such field"]
  router = config.model.moe.router
  assert router.name == "expert_choice" and router.noise_std == 0.0
  assert "num_selected" not in router
  # A field the new router knows, set with the switch, is kept; top-p's cap
  # and load loss are its own.
  config, notes = _through_the_flags("default", [
      "prog", "--config.model.moe.router.name=top_p",
      "--config.model.moe.router.threshold=0.2"])
  assert len(notes) == 2
  router = config.model.moe.router
  assert (router.threshold, router.importance_loss_weight,
          router.num_selected, router.load_loss_weight) == (0.2, 0.005, 4, 0.0)


def test_floats_beyond_float32_are_config_errors():
  validate(Field("float"), 3.4e38, "x")
  for value in (1e39, -1e39):
    with pytest.raises(ConfigError, match="overflows float32") as e:
      validate(Field("float"), value, "optimizer.learning_rate")
    assert e.value.field == "optimizer.learning_rate"
  config = load_config("tiny")
  config.optimizer.learning_rate = 1e39
  with pytest.raises(ConfigError) as e:
    validate(CONFIG, config)
  assert e.value.field == "optimizer.learning_rate"


def test_empty_checkpoint_dir_is_a_config_error():
  config = load_config("tiny")
  config.robustness.checkpoint_dir = ""
  with pytest.raises(ConfigError, match="is empty") as e:
    validate(CONFIG, config)
  assert e.value.field == "robustness.checkpoint_dir"


# -------------------------------------------------------------- workdir


def _read_only(path, monkeypatch):
  """Makes directory `path` unwritable (for root too: a read-only bind
  mount; where mounting is not allowed, the write probe reports EROFS)."""
  if os.geteuid() != 0:
    os.chmod(path, 0o555)
    return lambda: os.chmod(path, 0o755)
  mount = subprocess.run(["mount", "--bind", path, path], capture_output=True)
  if mount.returncode == 0:
    subprocess.run(["mount", "-o", "remount,ro,bind", path], check=True)
    return lambda: subprocess.run(["umount", path], check=True)
  from vmoe_ext.train import workdir as workdir_lib
  real = workdir_lib._writable
  monkeypatch.setattr(workdir_lib, "_writable", lambda d: (
      "Read-only file system" if d.startswith(str(path)) else real(d)))
  return lambda: None


def test_check_workdir(tmp_path, monkeypatch):
  for bad, message in [("", "is empty"), (tmp_path / "file", "not a dir"),
                       (tmp_path / "file" / "sub", "is a file")]:
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match=message) as e:
      check_workdir(str(bad))
    assert e.value.field == "--workdir"
  check_workdir(str(tmp_path / "new" / "run"))  # Created later.
  assert not (tmp_path / "new").exists()
  for holds_checkpoint in (False, True):
    ro = tmp_path / f"ro{holds_checkpoint}"
    (ro / "checkpoints" / "10").mkdir(parents=True) if holds_checkpoint \
        else ro.mkdir()
    undo = _read_only(ro, monkeypatch)
    try:
      with pytest.raises(ConfigError, match="not writable") as e:
        check_workdir(str(ro))
      with pytest.raises(ConfigError, match="not writable"):
        check_workdir(str(ro / "sub"))
    finally:
      undo()
    assert e.value.field == "--workdir"


def test_workdir_lock_refuses_a_second_holder(tmp_path):
  workdir = str(tmp_path / "run")
  with WorkdirLock(workdir):
    with pytest.raises(ConfigError, match=f"in use by another run \\(pid "
                       f"{os.getpid()}\\)"):
      WorkdirLock(workdir).acquire()
    with pytest.raises(ConfigError, match="in use"):
      check_workdir(workdir)
  check_workdir(workdir)  # Released.
  with WorkdirLock(workdir):
    pass


# ------------------------------------------------------ weight NaN guard


def test_update_that_overflows_the_weights_is_rejected():
  config = load_config("tiny")
  model = build_model(config.model)
  image = jnp.ones((2, 8, 8, 1))
  variables = jax.jit(model.init)(jax.random.key(0), image)
  # Each factor finite; their product overflows every nonzero update.
  tx = optax.chain(optax.scale(-1e30), optax.scale(1e30))
  state = TrainState.create(variables, tx, jax.random.key(1))
  step = jax.jit(make_train_step(model))
  new, metrics = step(state, {"image": image, "label": jnp.array([0, 1])})
  # Loss and gradient finite, the updated weights not: nothing committed.
  assert np.isfinite(metrics["loss"]) and np.isfinite(metrics["grad_norm"])
  assert float(metrics["grad_norm"]) > 0
  assert int(new.nonfinite_count) == 1 and int(new.first_nonfinite_step) == 1
  jax.tree.map(np.testing.assert_array_equal, new.params, state.params)
  assert int(new.step) == 1


def test_divergence_message_names_the_step_and_the_last_checkpoint():
  def run(latest, count=2):
    return types.SimpleNamespace(
        state=types.SimpleNamespace(nonfinite_count=np.int32(count),
                                    first_nonfinite_step=np.int32(7)),
        checkpoints=types.SimpleNamespace(latest_step=lambda: latest,
                                          directory="/w/checkpoints"))

  history = [{"loss": np.float32(1.0)}, {"loss": np.float32(np.nan)},
             {"loss": np.float32(np.inf)}]  # Steps 6, 7, 8.
  loop.check_finite(run(None, count=0), 8, history[:1])  # All finite.
  with pytest.raises(loop.NonFiniteError) as e:
    loop.check_finite(run(None), 8, history)
  assert "weights at step 7 (loss=nan); 2 of the steps up to 8" in str(e.value)
  assert "no checkpoint has been saved yet" in str(e.value)
  with pytest.raises(loop.NonFiniteError,
                     match=r"last good checkpoint \(step 4\) is kept in "
                     "/w/checkpoints"):
    loop.check_finite(run(4), 8, history)


# ------------------------------------------------------------ end to end


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  """An uninterrupted run of FAST: (workdir, completed process)."""
  workdir = str(tmp_path_factory.mktemp("reference") / "run")
  done = run_binary(workdir)
  assert done.returncode == 0, done.stderr
  return workdir, done


def expected_points(records):
  """(TensorBoard tag, step) -> how many points the records imply."""
  expected = collections.Counter()
  for r in records:
    for key, value in r.items():
      if key not in ("step", "split", "final") and value is not None \
          and not isinstance(value, str):
        for i, _ in np.ndenumerate(np.asarray(value, float)):
          tag = "/".join([r["split"], key, *map(str, i)])
          expected[(tag, r["step"])] += 1
  return expected


def assert_same_record(workdir, reference_dir):
  """Same metrics.jsonl records (but the timings) and TensorBoard points,
  none twice; each PNG plot once as a TensorBoard image at the last step."""
  records = read_metrics(workdir)
  untimed = lambda rs: [{k: v for k, v in r.items()
                         if k not in TIMING_METRICS} for r in rs]
  assert untimed(records) == untimed(read_metrics(reference_dir))
  # A throughput once something was timed (None at a log step reached by
  # the first, compiling, step after a resume); the uninterrupted reference
  # has one at every log step.
  speeds = lambda rs: [r["images_per_second"] for r in rs
                       if r["split"] == "train"]
  assert all(s is None or s > 0 for s in speeds(records))
  assert all(s > 0 for s in speeds(read_metrics(reference_dir)))
  # One TensorBoard point per number in each run's own records (the eps
  # sweep writes several lines at one step, so some (tag, step) pairs repeat
  # there too); the two runs differ only in the timings (a resumed run has no
  # throughput at the log step its first, compiling, step reaches).
  points = tensorboard_points(workdir)
  reference_points = tensorboard_points(reference_dir)
  assert points == expected_points(records)
  assert reference_points == expected_points(read_metrics(reference_dir))
  untimed_points = lambda ps: {k: n for k, n in ps.items()
                               if k[0].split("/")[1] not in TIMING_METRICS}
  assert untimed_points(points) == untimed_points(reference_points)
  last = max(r["step"] for r in records)
  plots = sorted(n[:-4] for n in os.listdir(workdir) if n.endswith(".png"))
  assert "training_curves" in plots
  assert tensorboard_points(workdir, "image") == collections.Counter(
      {(f"plots/{name}", last): 1 for name in plots})


def test_binary_outputs_and_progress_lines_off_a_terminal(reference):
  workdir, done = reference
  assert "# Run report" in done.stdout
  records = read_metrics(workdir)
  (final,) = [r for r in records if r.get("final")]
  assert final["split"] == "test" and final["step"] == 20
  assert 0.0 <= final["accuracy"] <= 1.0
  # The routing analysis, then the robustness evaluation, ran after the
  # final evaluation.
  assert [r["split"] for r in records[records.index(final) + 1:]] == [
      "routing", "adversarial/fgsm", "corruption"]
  assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == [
      "10", "20"]
  lines = done.stderr.splitlines()
  train = [l for l in lines if l.startswith("train step ")]
  # Before the first step's compilation, one line says so.
  compiling = lines.index("compiling the train step (step 1/20)...")
  assert compiling < lines.index(train[0])
  assert [l.split(":")[0] for l in train] == [
      f"train step {s}/20" for s in (5, 10, 15, 20)]
  assert all(re.search(r"loss \d\.\d{4}, accuracy \d\.\d{4}, [\d.]+ "
                       r"steps/s, ETA (\d+m)?\d+s$", l) for l in train)
  assert any(l.startswith("eval step 10: accuracy ") for l in lines)
  assert any(l.startswith("final eval step 20: accuracy ") for l in lines)
  assert any(l.startswith("fgsm: accuracy ") for l in lines)
  assert any(l.startswith("corruption contrast: ") for l in lines)
  assert "Traceback" not in done.stderr


def test_ctrl_c_then_kill_in_final_evaluation_then_rerun(reference,
                                                         tmp_path):
  """One workdir through every interruption; after each resume the record
  is exactly the reference's."""
  ref_dir, _ = reference
  workdir = str(tmp_path / "run")
  # 1. Ctrl-C (SIGINT) during training: a checkpoint, exit 130, no
  # traceback. (SIGTERM takes the same path with exit 143:
  # test_train_loop.py's stop-signal tests.)
  proc = subprocess.Popen(binary(workdir), cwd=ROOT, env=ENV,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                          text=True)
  wait_for(lambda: any(r["split"] == "train"
                       for r in records_or_empty(workdir)), proc)
  proc.send_signal(signal.SIGINT)
  _, stderr = proc.communicate(timeout=300)
  assert proc.returncode == 130, stderr
  assert "stopped: interrupted (Ctrl-C); the checkpoint of step" in stderr
  assert "Traceback" not in stderr
  step = int(re.search(r"checkpoint of step (\d+)", stderr).group(1))
  assert 5 <= step < 20
  assert str(step) in os.listdir(os.path.join(workdir, "checkpoints"))
  assert not any(r.get("final") for r in read_metrics(workdir))
  # 2. The resumed run killed (-9) in the after-training evaluation, once
  # the final line is out.
  proc = subprocess.Popen(binary(workdir), cwd=ROOT, env=ENV,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
  wait_for(lambda: any(r.get("final") for r in records_or_empty(workdir)),
           proc)
  proc.kill()
  proc.wait()
  assert len(read_metrics(workdir)) < len(read_metrics(ref_dir))
  # 3. Resumed to the end: the reference's record exactly.
  done = run_binary(workdir)
  assert done.returncode == 0, done.stderr
  assert_same_record(workdir, ref_dir)
  # 4. A finished workdir run again: the same record, nothing twice.
  done = run_binary(workdir)
  assert done.returncode == 0, done.stderr
  assert_same_record(workdir, ref_dir)
  assert sum(bool(r.get("final")) for r in read_metrics(workdir)) == 1


def test_out_of_memory_is_not_called_a_bug(capsys):
  """XLA's RESOURCE_EXHAUSTED (the eval batch of 1,024 at 224 px on a 24 GB
  host): exit 1 naming the batch fields to lower, no "bug"."""
  from vmoe_ext.app import main as main_module
  error = RuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating "
                       "44038672472 bytes.")
  assert main_module.out_of_memory(error)
  assert not main_module.out_of_memory(RuntimeError("INTERNAL: oops"))
  with pytest.raises(SystemExit) as e:
    main_module._out_of_memory(error)  # pylint: disable=protected-access
  assert e.value.code == 1
  err = capsys.readouterr().err
  assert err.startswith("error: out of memory (RESOURCE_EXHAUSTED: Out of "
                        "memory allocating 44038672472 bytes.)")
  assert "data.eval_batch_size" in err and "bug" not in err


def test_binary_refuses_a_workdir_in_use(tmp_path):
  workdir = str(tmp_path / "run")
  holder = subprocess.Popen(
      [sys.executable, "-c", "import sys, time\n"
       "from vmoe_ext.train.workdir import WorkdirLock\n"
       f"with WorkdirLock({workdir!r}):\n"
       "  print('locked', flush=True); time.sleep(600)"],
      cwd=ROOT, env=ENV, stdout=subprocess.PIPE, text=True)
  try:
    assert holder.stdout.readline().strip() == "locked"
    done = run_binary(workdir)
  finally:
    holder.kill()
    holder.wait()
  assert done.returncode == 2
  assert done.stderr.startswith("config error: --workdir:")
  assert f"in use by another run (pid {holder.pid})" in done.stderr
  assert "Traceback" not in done.stderr


EVAL_CONFIG = (
    "from vmoe_ext.train.config_files import load_config\n"
    "def get_config(arg=None):\n"
    "  c = load_config('tiny')\n"
    "  c.robustness.checkpoint_dir = arg\n"
    "  c.robustness.attacks = (dict(name='fgsm', eps=0.1),)\n"
    "  c.robustness.sweep = None\n"
    "  c.robustness.corruptions = None\n"
    # Fields the training config left out, at their defaults: still the
    # same config (fingerprints are compared after filling defaults).
    "  c.model.moe.dispatcher = 'indices'\n"
    "  c.model.moe.router.noise_std = 1.0\n"
    "  return c\n")


@pytest.mark.parametrize("into_training_workdir", [True, False])
def test_evaluation_binary_restores_the_training_run(reference, tmp_path,
                                                     into_training_workdir):
  ref_dir, _ = reference
  before = read_metrics(ref_dir)
  config = tmp_path / "eval.py"
  config.write_text(EVAL_CONFIG)
  workdir = ref_dir if into_training_workdir else str(tmp_path / "eval")
  done = run_binary(workdir, config=f"{config}:{ref_dir}")
  assert done.returncode == 0, done.stderr
  assert "# Robustness evaluation report" in done.stdout
  assert read_metrics(ref_dir) == before  # The training record untouched.
  out = os.path.join(ref_dir, "evaluation") if into_training_workdir \
      else workdir
  evaluation = read_metrics(out)
  assert not os.path.exists(os.path.join(out, "checkpoints"))
  # Nothing trained here: no (empty) training-curves plot.
  assert not os.path.exists(os.path.join(out, "training_curves.png"))
  assert "training_curves.png" not in open(
      os.path.join(out, "report.md")).read()
  # Same checkpoint, same data: the same clean and adversarial numbers.
  trained = {r["split"]: r for r in before[before.index(
      [r for r in before if r.get("final")][0]):]}
  assert [r["split"] for r in evaluation] == ["test", "routing",
                                              "adversarial/fgsm"]
  assert evaluation[0]["final"]
  for record in evaluation:
    if record["split"] == "routing":
      assert record == trained["routing"]
    else:
      assert record["accuracy"] == trained[record["split"]]["accuracy"]
