"""`train_and_evaluate`: the training job behind `python -m vmoe_ext.main`."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import threading
import time
from typing import Any, Callable, Iterator, Optional, Sequence

import flax.linen as nn
import flax.serialization
import jax
import ml_collections
import numpy as np

from vmoe_ext.data import (ArrayDataset, TrainIterator, default_normalization,
                           eval_batches, load_dataset)
from vmoe_ext.data.stream_eval import (StreamingEvalSplit, open_test_split,
                                       streams_evaluation)
from vmoe_ext.data.stream_iterator import StreamingTrainIterator
from vmoe_ext.data.tfds_adapter import load_tfds_split
from vmoe_ext.errors import require
from vmoe_ext.models import build_model
from vmoe_ext.reporting.report import listify, write_report
from vmoe_ext.reporting.writers import (MetricWriter, duration, progress_bar,
                                       progress_line, read_metrics)
from vmoe_ext.sharding.multihost import is_main_process, process_rows
from vmoe_ext.sharding.partitioning import Partitioning
from vmoe_ext.train.checkpoints import CheckpointManager, config_fingerprint
from vmoe_ext.train.initialization import check_init, load_init_params
from vmoe_ext.train.optimizer import make_learning_rate, make_optimizer
from vmoe_ext.train.state import TrainState
from vmoe_ext.train.steps import (evaluate, make_eval_step, make_train_step,
                                  router_state_metrics)
from vmoe_ext.train.validate import validate_config, validate_shapes
from vmoe_ext.train.workdir import WorkdirLock

log = logging.getLogger(__name__)


class NonFiniteError(FloatingPointError):
  """The loss or a gradient became NaN/Inf; the last good checkpoint is kept."""


@dataclasses.dataclass
class Run:
  """Everything built from a config before training starts.

  Attributes:
    config: the validated config.
    datasets: `{"train", "test"}` raw datasets (only "test" when
      `data.streaming`: the train split is streamed, never loaded; with
      `data.pp_eval` "test" is the in-memory analysis subset of
      `data.analysis_examples` images, and `evaluate` streams the split).
    model: the Flax model.
    state: the train state (initial, or restored by `restore`).
    train_iter: the training batch iterator (positioned by `restore`).
    checkpoints: the workdir's checkpoint manager.
    eval_split: the streamed test split (`data.pp_eval`), else None.
    partitioning: the mesh and shardings (`sharding` section): the state
      lives split by its rules, batches are global arrays assembled from
      every process's rows, the steps are jitted with these shardings.
  """
  config: ml_collections.ConfigDict
  datasets: dict[str, ArrayDataset]
  model: nn.Module
  state: TrainState
  train_iter: TrainIterator | StreamingTrainIterator
  checkpoints: CheckpointManager
  resumed_extra: dict[str, Any] = dataclasses.field(default_factory=dict)
  eval_split: Optional[StreamingEvalSplit] = None
  partitioning: Optional[Partitioning] = None
  _eval_step: Optional[Callable] = None

  def evaluate(self, split: str = "test") -> dict[str, Any]:
    """Accuracy, top-5, loss and routing metrics of `split` (jitted once)."""
    if self._eval_step is None:
      self._eval_step = self.partitioning.jit_eval_step(make_eval_step(
          self.model, self.config.train.get("loss", "softmax_xent")),
                                                        self.state)
    streamed = split == "test" and self.eval_split is not None
    return evaluate(self._eval_step, self.state,
                    (self.global_batch(b, local=streamed)
                     for b in self.eval_batches(split)))

  def global_batch(self, batch: dict, local: bool) -> dict:
    """The global batch from a process's rows (`local`: the streaming
    loaders' per-process share) or from a batch every process drew whole
    (the in-memory loaders)."""
    return self.partitioning.global_batch(batch if local
                                          else process_rows(batch))

  def next_batch(self) -> dict:
    """The next training batch, a global array split over the mesh."""
    return self.global_batch(
        next(self.train_iter),
        local=isinstance(self.train_iter, StreamingTrainIterator))

  def eval_batches(self, split: str = "test") -> Iterator[dict]:
    """Every example of `split` once, padded + masked, preprocessed."""
    if split == "test" and self.eval_split is not None:
      return self.eval_split.batches(self.config.data.eval_batch_size)
    mean, std = default_normalization(self.config.data)
    return eval_batches(self.datasets[split],
                        self.config.data.eval_batch_size,
                        image_size=self.config.data.get("image_size"),
                        mean=mean, std=std)

  def save(self, **extra: Any) -> None:
    """Checkpoints the state and data position (and JSON `extra`)."""
    self.checkpoints.save(int(self.state.step),
                          flax.serialization.to_state_dict(self.state),
                          {"data": self.train_iter.get_state(), **extra},
                          force=True)

  def restore(self) -> Optional[int]:
    """Restores the newest checkpoint (state and data position), if any."""
    restored = self.checkpoints.restore(
        flax.serialization.to_state_dict(self.state))
    if restored is None:
      return None
    state_dict, extra, step = restored
    self.state = flax.serialization.from_state_dict(self.state, state_dict)
    self.train_iter.set_state(extra["data"])
    self.resumed_extra = dict(extra)
    return step


def setup(config: ml_collections.ConfigDict, workdir: str) -> Run:
  """Validates the config, loads data, builds model, state and checkpoints.

  Everything that can be wrong with a config is reported here, before the
  train step is compiled.
  """
  validate_config(config)
  partitioning = Partitioning.from_config(config.get("sharding"))
  eval_split = None
  if config.data.get("streaming", False):
    datasets, train_iter, sample, num_classes, eval_split = _streaming_data(
        config)
  else:
    datasets, train_iter, sample, num_classes = _in_memory_data(config)
  model = build_model(config.model, partitioning.expert_parallel)
  validate_shapes(config, model, sample.shape, num_classes=num_classes,
                  partitioning=partitioning)
  init_key, state_key = jax.random.split(jax.random.key(config.seed))
  # The parameters do not depend on the layout: initialise the unsplit
  # model (on this process's rows), straight into the state's shardings.
  init_model = build_model(config.model)
  shapes = jax.eval_shape(lambda x: init_model.init(init_key, x), sample)
  init = config.get("init")
  if init is not None:  # Checked on shapes, before compiling model.init.
    check_init(init, shapes["params"])
  variables = jax.jit(lambda x: init_model.init(init_key, x),
                      out_shardings=partitioning.shardings(shapes))(sample)
  if init is not None:
    params, report = load_init_params(init, variables["params"])
    log.warning("%s", report.summary())
    variables = {**variables, "params": params}
  state = partitioning.shard(TrainState.create(
      variables, make_optimizer(config.optimizer), state_key))
  checkpoints = CheckpointManager(
      os.path.join(workdir, "checkpoints"),
      save_every=config.train.checkpoint_every,
      keep=config.train.keep_checkpoints,
      config_fingerprint=config_fingerprint(config, state.params))
  return Run(config, datasets, model, state, train_iter, checkpoints,
             eval_split=eval_split, partitioning=partitioning)


def _in_memory_data(config: ml_collections.ConfigDict):
  """`(datasets, train_iter, sample batch, num_classes)`, all in memory."""
  datasets = load_dataset(config.data)
  mean, std = default_normalization(config.data)
  train_iter = TrainIterator(
      datasets["train"], config.data.batch_size, config.seed,
      image_size=config.data.get("image_size"), mean=mean, std=std,
      augment=config.data.get("augment", False),
      flip=config.data.get("flip", False), pad=config.data.get("pad", None))
  sample = next(TrainIterator(datasets["train"], config.data.batch_size,
                              config.seed,
                              image_size=config.data.get("image_size"),
                              mean=mean, std=std))["image"]
  return datasets, train_iter, sample, datasets["train"].num_classes


def _streaming_data(config: ml_collections.ConfigDict):
  """The same for `data.streaming` (plus the streamed test split or None):
  the train split is streamed (images scaled by `data.pp_train`, not
  normalised again). With `data.pp_eval` the test split streams too, and
  `data.analysis_examples` of its images are held in memory as [0, 1]
  images; without it the test split is loaded in memory, resized to
  `data.image_size` (both normalised by `default_normalization` to match)."""
  data = config.data
  train_iter = StreamingTrainIterator(data, config.seed)
  sample = train_iter.sample_batch()
  eval_split = None
  if streams_evaluation(data):
    eval_split = open_test_split(data)
    test = eval_split.analysis_dataset(data.get("analysis_examples"))
  else:
    test = load_tfds_split(data, data.get("test_split") or "test",
                           split_field="data.test_split",
                           image_size=data.get("image_size"))
  require(test.images.shape[-1] == sample.shape[-1], "data.pp_train",
          f"gives {sample.shape[-1]}-channel images; the test split has "
          f"{test.images.shape[-1]}")
  return ({"test": test}, train_iter, sample, train_iter.num_classes,
          eval_split)


def _mean_metrics(history: Sequence[dict]) -> dict[str, Any]:
  host = jax.device_get(list(history))
  return {k: np.mean(np.stack([np.asarray(h[k]) for h in host]), axis=0)
          for k in host[0]}


def check_finite(run: Run, step: int, history: Sequence[dict]) -> None:
  """Reads the state's non-finite counter (a host sync); raises
  `NonFiniteError` naming the first bad step if there was one.

  Called only at log, evaluation and checkpoint steps and at the end, so a
  checkpoint is never written after a bad step. `history` holds the metrics
  of the steps since the last log line (`step` is the latest).
  """
  count, first = (int(x) for x in jax.device_get(
      (run.state.nonfinite_count, run.state.first_nonfinite_step)))
  if not count:
    return
  index = first - (step - len(history)) - 1
  loss = (f" (loss={float(history[index]['loss'])})"
          if 0 <= index < len(history) else "")
  last = run.checkpoints.latest_step()
  kept = ("no checkpoint has been saved yet" if last is None else
          f"the last good checkpoint (step {last}) is kept in "
          f"{run.checkpoints.directory}")
  raise NonFiniteError(
      f"training diverged: non-finite loss, gradient or updated weights at "
      f"step {first}{loss}; {count} of the steps up to {step} were bad and "
      f"their updates were rejected, none was saved; {kept}. Lower "
      "optimizer.learning_rate or clip gradients "
      "(optimizer.clip_global_norm).")


class Preempted(Exception):
  """SIGTERM stopped training; a checkpoint of the current step was saved."""


def _reached_preemption(step: int) -> bool:
  """Whether every process of a multi-process job stops at `step`: jax's
  preemption service (started by `jax.distributed.initialize`) caught a
  SIGTERM in one of them and the processes agreed on this step."""
  from jax.experimental import multihost_utils
  try:
    return multihost_utils.reached_preemption_sync_point(step)
  except RuntimeError:  # The preemption service is off.
    return False


@contextlib.contextmanager
def sigterm_flag(enabled: bool = True) -> Iterator[list]:
  """A list that gets an item when SIGTERM arrives (checked by the loop at
  each step boundary). Only in the main thread; elsewhere never set."""
  received: list = []
  if not enabled or threading.current_thread() is not threading.main_thread():
    yield received
    return
  previous = signal.signal(signal.SIGTERM,
                           lambda *_: received.append(time.time()))
  try:
    yield received
  finally:
    signal.signal(signal.SIGTERM, previous)


def _history_to_json(history: Sequence[dict]) -> list[dict[str, Any]]:
  return [listify(h) for h in jax.device_get(list(history))]


def _history_from_json(history: Sequence[dict]) -> list[dict[str, Any]]:
  """Train metrics are float32 on the device; so they are again here."""
  return [{k: np.asarray(v, np.float32) for k, v in h.items()}
          for h in history]


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str, *,
                       after_training: Optional[Callable[..., Sequence[str]]]
                       = None,
                       stop_at_step: Optional[int] = None,
                       handle_sigterm: bool = False
                       ) -> Optional[dict[str, Any]]:
  """Trains, evaluates, checkpoints and reports; returns the final metrics.

  Args:
    config: the run config (see `configs/default.py`).
    workdir: where checkpoints, `metrics.jsonl`, TensorBoard events, plots and
      `report.md` go. An existing checkpoint there is resumed exactly
      (parameters, optimizer and router state, RNG, step, data position, the
      metrics record as it was at that checkpoint). The workdir is locked
      (`WorkdirLock`) while the run holds it.
    after_training: optional hook `(run, writer) -> list of markdown
      sections` run after the final evaluation (the binary passes
      `vmoe_ext.evaluate.final.after_training_hook`: routing analysis, then
      robustness); its sections are appended to the report.
    stop_at_step: stop abruptly once this step is reached, as a preempted job
      would (no final evaluation, no report; returns None). Used to test that
      resuming gives the same result as an uninterrupted run.
    handle_sigterm: on SIGTERM, save a checkpoint at the next step boundary
      and raise `Preempted` (the binary exits with 143). In a multi-process
      job the processes agree on that step through jax's preemption sync
      point (`multihost_utils.reached_preemption_sync_point`; SIGTERM to any
      one of them stops them all at the same step).

  Multi-process jobs (`jax.process_count() > 1`, every process given the
  same `workdir` on a shared file system): every process trains, evaluates
  and takes part in the checkpoint saves and restores; only process 0 holds
  the workdir lock, writes `metrics.jsonl`, TensorBoard events, plots and
  `report.md`, and prints progress. Every process returns the final metrics.
  """
  start = time.time()
  run = setup(config, workdir)  # Bad config or data: nothing written yet.
  with WorkdirLock(workdir), contextlib.ExitStack() as stack:
    resumed = run.restore()
    if resumed is not None and is_main_process():
      log.warning("Resuming from the checkpoint of step %d in %s", resumed,
                  workdir)
    stack.callback(run.checkpoints.close)
    writer = stack.enter_context(MetricWriter(workdir))
    # The record is cut back to what it was at the checkpoint: what a killed
    # run wrote after it is written again (older checkpoints: by step).
    if "metrics_lines" in run.resumed_extra:
      writer.truncate(keep_lines=run.resumed_extra["metrics_lines"])
    else:
      writer.truncate(after_step=int(run.state.step))
    history = _history_from_json(run.resumed_extra.get("history", []))
    multi = jax.process_count() > 1
    with sigterm_flag(handle_sigterm and not multi) as sigterm:
      step = _train(run, writer, history, sigterm, stop_at_step,
                    sync_preemption=handle_sigterm and multi)
    if step is None:
      return None
    # The last checkpoint comes before the final evaluation: a run killed
    # after it re-does the evaluation only, and writes its lines once.
    if run.checkpoints.latest_step() != step:
      run.save(metrics_lines=writer.num_lines())
    final = run.evaluate()
    writer.write(step, "test", final, final=True)
    progress_line(None, f"final eval step {step}: accuracy "
                  f"{final['accuracy']:.4f}, loss {final['loss']:.4f}")
    sections: Sequence[str] = ()
    if after_training is not None:
      sections = after_training(run=run, writer=writer)
  final = listify(final)
  final["step"] = step
  if not is_main_process():
    return final
  write_report(workdir, final_metrics=final, records=read_metrics(workdir),
               config_summary=config.to_dict(),
               wall_seconds=time.time() - start, extra_sections=sections)
  return final


def _train(run: Run, writer: MetricWriter, history: list, sigterm: list,
           stop_at_step: Optional[int], sync_preemption: bool = False
           ) -> Optional[int]:
  """The training loop from `run.state.step` to `train.total_steps`.

  Returns the last step, or None when stopped at `stop_at_step`. Raises
  `NonFiniteError` (nothing saved after the first bad step) or `Preempted`
  (after saving the current step) when SIGTERM arrived (`sigterm` got an
  item or, with `sync_preemption`, jax's preemption sync point of the
  processes is reached).
  """
  config = run.config
  step = int(run.state.step)
  total = config.train.total_steps
  eval_every = config.train.get("eval_every", 0)
  # The state is donated: `run.state` is the only live reference to it, and
  # `history` keeps metrics, never states. No host sync per step: the NaN
  # guard runs on the device (see `make_train_step`) and is read back by
  # `check_finite` before anything is logged, evaluated or saved.
  train_step = run.partitioning.jit_train_step(make_train_step(
      run.model, label_smoothing=config.train.get("label_smoothing", 0.0),
      learning_rate_fn=make_learning_rate(config.optimizer),
      mixup=config.train.get("mixup"),
      loss_type=config.train.get("loss", "softmax_xent")), run.state)
  save = lambda: run.save(metrics_lines=writer.num_lines(),
                          history=_history_to_json(history))
  # Throughput from the end of the first step on (it includes compiling).
  timed_from, since = step + 1, time.time()
  with progress_bar(total=total, desc="train", initial=step) as bar:
    while step < total:
      run.state, metrics = train_step(run.state, run.next_batch())
      step += 1
      if step == timed_from:
        since = time.time()
      history.append(metrics)
      bar.update(1)
      if sync_preemption and _reached_preemption(step):
        sigterm.append(time.time())
      log_now = step % config.train.log_every == 0 or step == total
      eval_now = bool(eval_every) and step % eval_every == 0 and step < total
      save_now = run.checkpoints.should_save(step)
      if log_now or eval_now or save_now or sigterm:
        check_finite(run, step, history)
      if log_now:
        mean = _mean_metrics(history)
        # Persistent router state (Symphony's expert graph) as it is now.
        writer.write(step, "train",
                     {**mean, **router_state_metrics(run.state.collections)})
        bar.set_postfix(loss=f"{float(metrics['loss']):.3f}")
        rate = (step - timed_from) / max(time.time() - since, 1e-9)
        speed = (f"{rate:.2f} steps/s, ETA "
                 f"{duration((total - step) / rate)}" if rate > 0
                 else "compiled")
        progress_line(bar, f"train step {step}/{total}: loss "
                      f"{float(mean['loss']):.4f}, accuracy "
                      f"{float(mean['accuracy']):.4f}, {speed}")
        history = []
      if eval_now:
        result = run.evaluate()
        writer.write(step, "test", result)
        progress_line(bar, f"eval step {step}: accuracy "
                      f"{result['accuracy']:.4f}, loss {result['loss']:.4f}")
      if save_now or sigterm:
        save()
      if sigterm:
        raise Preempted(
            f"SIGTERM received; the checkpoint of step {step} is saved in "
            f"{run.checkpoints.directory}. Re-run the same command to "
            "resume.")
      if stop_at_step is not None and step >= stop_at_step:
        return None
  check_finite(run, step, history)
  return step
