"""Robustness evaluation of a checkpoint, with no training: a training
workdir's (`robustness.checkpoint_dir`) or the params the `init` section
loads (`robustness.from_init`, e.g. an imported vmoe V-MoE).

Builds the model and only what evaluation needs: the test split, abstract
variables (`jax.eval_shape`, nothing initialised), and the checkpoint's params
and non-parameter collections (e.g. "router_state"); no optimizer state, no
train iterator.
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable, Iterator

import flax.linen as nn
import jax
import ml_collections
import numpy as np

from vmoe_ext.data import (ArrayDataset, default_normalization, eval_batches,
                           load_dataset)
from vmoe_ext.data.stream_eval import open_test_split, streams_evaluation
from vmoe_ext.data.tfds_adapter import load_tfds_split
from vmoe_ext.errors import require
from vmoe_ext.evaluate.final import final_evaluations
from vmoe_ext.models import build_model
from vmoe_ext.reporting.report import listify, write_report
from vmoe_ext.reporting.writers import MetricWriter, read_metrics
from vmoe_ext.train.checkpoints import CheckpointManager, config_fingerprint
from vmoe_ext.train.initialization import check_init, load_init_params
from vmoe_ext.train.state import TrainState
from vmoe_ext.train.steps import evaluate, make_eval_step
from vmoe_ext.train.validate import validate_config, validate_shapes
from vmoe_ext.train.workdir import WorkdirLock


def load_test_split(data: ml_collections.ConfigDict) -> ArrayDataset:
  """The test split of a data config (TFDS: only that split is read; with
  `data.pp_eval` its in-memory analysis subset, `test_data`)."""
  if streams_evaluation(data):
    return test_data(data)[0]
  if data.name == "tfds":
    return load_tfds_split(data, data.get("test_split", None) or "test",
                           split_field="data.test_split",
                           image_size=data.get("image_size", None))
  return load_dataset(data)["test"]


def test_data(data: ml_collections.ConfigDict
              ) -> tuple[ArrayDataset, Callable[[], Iterator[dict]]]:
  """`(test, batches)`: the in-memory test images for the routing analysis
  and robustness, and a function returning fresh clean-evaluation batches
  (`eval_batches` layout). With `data.pp_eval` the batches stream the whole
  split and `test` holds `data.analysis_examples` of its images
  (`StreamingEvalSplit`); otherwise both come from the loaded split."""
  if streams_evaluation(data):
    split = open_test_split(data)
    return (split.analysis_dataset(data.get("analysis_examples")),
            lambda: split.batches(data.eval_batch_size))
  test = load_test_split(data)
  mean, std = default_normalization(data)
  return test, lambda: eval_batches(test, data.eval_batch_size,
                                    image_size=data.get("image_size"),
                                    mean=mean, std=std)


def restore_for_eval(config: ml_collections.ConfigDict, model: nn.Module,
                     image_shape: tuple[int, ...], source: str
                     ) -> tuple[TrainState, int]:
  """Params and collections of `source`'s newest checkpoint.

  Args:
    config: the training run's config (its fingerprint is checked).
    model: `build_model(config.model)`.
    image_shape: `[B, H, W, C]` of an input batch.
    source: the training workdir.

  Returns:
    `(state, step)`: a `TrainState` with `params` and `collections` restored
    (no optimizer: `opt_state` is None, `tx` is `optax.identity()`), enough
    for `make_eval_step` and `state.variables()`.
  """
  sample = jax.ShapeDtypeStruct(image_shape, np.float32)
  variables = dict(jax.eval_shape(model.init, jax.random.key(0), sample))
  params = variables.pop("params")
  variables.pop("intermediates", None)
  manager = CheckpointManager(
      os.path.join(source, "checkpoints"), save_every=0,
      keep=config.train.keep_checkpoints,
      config_fingerprint=config_fingerprint(config, params),
      purpose="evaluate")
  try:
    restored = manager.restore_variables({"params": params,
                                          "collections": variables})
  finally:
    manager.close()
  require(restored is not None, "robustness.checkpoint_dir",
          f"no checkpoint could be restored from {manager.directory!r}")
  entries, step = restored
  return TrainState.for_evaluation(entries["params"], entries["collections"],
                                   step), step


def init_for_eval(config: ml_collections.ConfigDict, model: nn.Module,
                  image_shape: tuple[int, ...]) -> tuple[TrainState, str]:
  """The params the `init` section loads (e.g. an imported vmoe checkpoint)
  over a fresh initialisation, with the fresh non-parameter collections.

  Returns `(state, description)`; the `init` section is checked on abstract
  params first, so a bad mapping fails before anything is compiled.
  """
  sample = jax.ShapeDtypeStruct(image_shape, np.float32)
  key = jax.random.key(config.seed)
  check_init(config.init, jax.eval_shape(model.init, key, sample)["params"])
  variables = dict(jax.jit(model.init)(key, np.zeros(image_shape,
                                                     np.float32)))
  params = variables.pop("params")
  variables.pop("intermediates", None)
  params, report = load_init_params(config.init, params)
  return (TrainState.for_evaluation(params, variables, 0),
          report.summary().splitlines()[0])


EVALUATION_DIR = "evaluation"


def output_dir(workdir: str) -> str:
  """Where an evaluation writes: `workdir`, or `workdir/evaluation` when
  `workdir` holds a training run (its checkpoints or training metrics), so
  that evaluation never touches a training record."""
  if not os.path.isdir(workdir):
    return workdir  # Created by the evaluation (or rejected: a file).
  if os.path.isdir(os.path.join(workdir, "checkpoints")):
    return os.path.join(workdir, EVALUATION_DIR)
  try:
    records = read_metrics(workdir)
  except FileNotFoundError:
    return workdir
  except ValueError:  # A malformed record is not ours to overwrite.
    return os.path.join(workdir, EVALUATION_DIR)
  train = any(r.get("split") == "train" for r in records)
  return os.path.join(workdir, EVALUATION_DIR) if train else workdir


def _training_record(source: str, step: int) -> list[dict[str, Any]]:
  """The training run's `metrics.jsonl` up to the evaluated checkpoint's
  step (for the router-state heatmaps); [] when it has none."""
  try:
    records = read_metrics(source)
  except (FileNotFoundError, ValueError):
    return []
  return [r for r in records if r.get("split") == "train"
          and r.get("step", step + 1) <= step]


def evaluate_checkpoint(config: ml_collections.ConfigDict,
                        workdir: str) -> dict[str, Any]:
  """Restores `config.robustness.checkpoint_dir`'s newest checkpoint and writes
  the clean evaluation and `final.final_evaluations` (routing analysis,
  robustness) to `output_dir(workdir)`.

  The config must describe the same model and data as the training run (the
  checkpoint's fingerprint is checked).
  """
  start = time.time()
  from_init = bool(config.robustness.get("from_init"))
  source = config.robustness.get("checkpoint_dir")
  if not from_init:
    require(isinstance(source, str) and source, "robustness.checkpoint_dir",
            "required: the workdir of the training run to evaluate (or "
            "robustness.from_init=True with an init section)")
    ckpt_dir = os.path.join(source, "checkpoints")
    require(os.path.isdir(ckpt_dir) and any(
        name.isdigit() for name in os.listdir(ckpt_dir)),
            "robustness.checkpoint_dir",
            f"no checkpoint found in {ckpt_dir!r}; train into that workdir "
            f"first (python -m vmoe_ext.main --config=TRAINING_CONFIG "
            f"--workdir={source})")
  validate_config(config)
  test, batches = test_data(config.data)
  # Streamed batches have B / P rows (one process's share).
  rows = config.data.eval_batch_size // (
      jax.process_count() if streams_evaluation(config.data) else 1)
  image_shape = (rows,) + test.image_shape
  model = build_model(config.model)
  validate_shapes(config, model, image_shape,
                  num_classes=getattr(test, "num_classes", None))
  if from_init:
    state, imported = init_for_eval(config, model, image_shape)
    step, records, evaluated = 0, [], f"Evaluated the params {imported}."
  else:
    state, step = restore_for_eval(config, model, image_shape, source)
    records = _training_record(source, step)
    evaluated = (f"Evaluated checkpoint: step {step} of "
                 f"`{os.path.abspath(source)}`.")
  out = output_dir(workdir)
  with WorkdirLock(out), MetricWriter(out) as writer:
    # A fresh evaluation: drops earlier evaluation lines (never training
    # lines: a training workdir's evaluation goes to its own folder).
    writer.truncate(keep_lines=0)
    final = evaluate(jax.jit(make_eval_step(
        model, config.train.get("loss", "softmax_xent"))), state, batches())
    writer.write(step, "test", final, final=True)
    sections = final_evaluations(
        model, state.variables(), test, config, writer=writer, step=step,
        workdir=out, records=records)
  final = listify(final)
  final["step"] = step
  write_report(out, final_metrics=final, records=read_metrics(out),
               config_summary=config.to_dict(),
               wall_seconds=time.time() - start,
               extra_sections=[evaluated] + sections,
               title="Robustness evaluation report")
  return final

