"""`train_and_evaluate`: the training job behind `python -m vmoe_ext.main`."""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import Any, Callable, Iterator, Optional, Sequence

import flax.linen as nn
import flax.serialization
import jax
import ml_collections
import numpy as np

from vmoe_ext.data import (ArrayDataset, TrainIterator, default_normalization,
                           eval_batches, load_dataset)
from vmoe_ext.models import build_model
from vmoe_ext.reporting.report import listify, write_report
from vmoe_ext.reporting.writers import MetricWriter, progress_bar, read_metrics
from vmoe_ext.train.checkpoints import CheckpointManager, config_fingerprint
from vmoe_ext.train.initialization import check_init, load_init_params
from vmoe_ext.train.optimizer import make_learning_rate, make_optimizer
from vmoe_ext.train.state import TrainState
from vmoe_ext.train.steps import evaluate, make_eval_step, make_train_step
from vmoe_ext.train.validate import validate_config, validate_shapes

log = logging.getLogger(__name__)


class NonFiniteError(FloatingPointError):
  """The loss or a gradient became NaN/Inf; the last good checkpoint is kept."""


@dataclasses.dataclass
class Run:
  """Everything built from a config before training starts.

  Attributes:
    config: the validated config.
    datasets: `{"train", "test"}` raw datasets.
    model: the Flax model.
    state: the train state (initial, or restored by `restore`).
    train_iter: the training batch iterator (positioned by `restore`).
    checkpoints: the workdir's checkpoint manager.
  """
  config: ml_collections.ConfigDict
  datasets: dict[str, ArrayDataset]
  model: nn.Module
  state: TrainState
  train_iter: TrainIterator
  checkpoints: CheckpointManager

  def eval_batches(self, split: str = "test") -> Iterator[dict]:
    """Every example of `split` once, padded + masked, preprocessed."""
    mean, std = default_normalization(self.config.data)
    return eval_batches(self.datasets[split],
                        self.config.data.eval_batch_size,
                        image_size=self.config.data.get("image_size"),
                        mean=mean, std=std)

  def save(self) -> None:
    self.checkpoints.save(int(self.state.step),
                          flax.serialization.to_state_dict(self.state),
                          {"data": self.train_iter.get_state()}, force=True)

  def restore(self) -> Optional[int]:
    """Restores the newest checkpoint (state and data position), if any."""
    restored = self.checkpoints.restore(
        flax.serialization.to_state_dict(self.state))
    if restored is None:
      return None
    state_dict, extra, step = restored
    self.state = flax.serialization.from_state_dict(self.state, state_dict)
    self.train_iter.set_state(extra["data"])
    return step


def setup(config: ml_collections.ConfigDict, workdir: str) -> Run:
  """Validates the config, loads data, builds model, state and checkpoints.

  Everything that can be wrong with a config is reported here, before the
  train step is compiled.
  """
  validate_config(config)
  datasets = load_dataset(config.data)
  mean, std = default_normalization(config.data)
  model = build_model(config.model)
  train_iter = TrainIterator(
      datasets["train"], config.data.batch_size, config.seed,
      image_size=config.data.get("image_size"), mean=mean, std=std,
      augment=config.data.get("augment", False),
      flip=config.data.get("flip", False), pad=config.data.get("pad", None))
  sample = next(TrainIterator(datasets["train"], config.data.batch_size,
                              config.seed,
                              image_size=config.data.get("image_size"),
                              mean=mean, std=std))["image"]
  validate_shapes(config, model, sample.shape,
                  num_classes=datasets["train"].num_classes)
  init_key, state_key = jax.random.split(jax.random.key(config.seed))
  init = config.get("init")
  if init is not None:  # Checked on shapes, before compiling model.init.
    check_init(init, jax.eval_shape(model.init, init_key, sample)["params"])
  variables = jax.jit(model.init)(init_key, sample)
  if init is not None:
    params, report = load_init_params(init, variables["params"])
    log.warning("%s", report.summary())
    variables = {**variables, "params": params}
  state = TrainState.create(variables, make_optimizer(config.optimizer),
                            state_key)
  checkpoints = CheckpointManager(
      os.path.join(workdir, "checkpoints"),
      save_every=config.train.checkpoint_every,
      keep=config.train.keep_checkpoints,
      config_fingerprint=config_fingerprint(config, state.params))
  return Run(config, datasets, model, state, train_iter, checkpoints)


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
  raise NonFiniteError(
      f"non-finite loss or gradient at step {first}{loss}; {count} of the "
      f"steps up to {step} were bad and none was saved. The last good "
      f"checkpoint (step {run.checkpoints.latest_step()}) is kept in "
      f"{run.checkpoints.directory}.")


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str, *,
                       after_training: Optional[Callable[..., Sequence[str]]]
                       = None,
                       stop_at_step: Optional[int] = None
                       ) -> Optional[dict[str, Any]]:
  """Trains, evaluates, checkpoints and reports; returns the final metrics.

  Args:
    config: the run config (see `configs/default.py`).
    workdir: where checkpoints, `metrics.jsonl`, TensorBoard events, plots and
      `report.md` go. An existing checkpoint there is resumed exactly
      (parameters, optimizer and router state, RNG, step, data position).
    after_training: optional hook `(run, writer) -> list of markdown
      sections` run after the final evaluation (e.g. a robustness evaluation);
      its sections are appended to the report.
    stop_at_step: stop abruptly once this step is reached, as a preempted job
      would (no final evaluation, no report; returns None). Used to test that
      resuming gives the same result as an uninterrupted run.
  """
  start = time.time()
  run = setup(config, workdir)  # Bad config or data: nothing written yet.
  os.makedirs(workdir, exist_ok=True)
  resumed = run.restore()
  if resumed is not None:
    log.warning("Resuming from the checkpoint of step %d in %s", resumed,
                workdir)
  step = int(run.state.step)
  total = config.train.total_steps
  eval_every = config.train.get("eval_every", 0)

  writer = MetricWriter(workdir)
  # Lines a killed run wrote after its last checkpoint are written again.
  writer.truncate(step)
  # The state is donated: `run.state` is the only live reference to it, and
  # `history` keeps metrics, never states. No host sync per step: the NaN
  # guard runs on the device (see `make_train_step`) and is read back by
  # `check_finite` before anything is logged, evaluated or saved.
  train_step = jax.jit(make_train_step(
      run.model, label_smoothing=config.train.get("label_smoothing", 0.0),
      learning_rate_fn=make_learning_rate(config.optimizer)),
                       donate_argnums=0)
  eval_step = jax.jit(make_eval_step(run.model))
  run_eval = lambda: evaluate(eval_step, run.state, run.eval_batches())

  history = []
  try:
    with progress_bar(total=total, desc="train", initial=step) as bar:
      while step < total:
        run.state, metrics = train_step(run.state, next(run.train_iter))
        step += 1
        history.append(metrics)
        bar.update(1)
        log_now = step % config.train.log_every == 0 or step == total
        eval_now = bool(eval_every) and step % eval_every == 0 and step < total
        save_now = run.checkpoints.should_save(step)
        if log_now or eval_now or save_now:
          check_finite(run, step, history)
        if log_now:
          writer.write(step, "train", _mean_metrics(history))
          bar.set_postfix(loss=f"{float(metrics['loss']):.3f}")
          history = []
        if eval_now:
          writer.write(step, "test", run_eval())
        if save_now:
          run.save()
        if stop_at_step is not None and step >= stop_at_step:
          writer.close()
          run.checkpoints.close()
          return None
    check_finite(run, step, history)
  except NonFiniteError:
    writer.close()
    run.checkpoints.close()
    raise

  final = run_eval()
  writer.write(step, "test", final, final=True)
  if run.checkpoints.latest_step() != step:
    run.save()
  sections: Sequence[str] = ()
  if after_training is not None:
    sections = after_training(run=run, writer=writer)
  writer.close()
  run.checkpoints.close()
  final = listify(final)
  final["step"] = step
  write_report(workdir, final_metrics=final, records=read_metrics(workdir),
               config_summary=config.to_dict(),
               wall_seconds=time.time() - start, extra_sections=sections)
  return final
