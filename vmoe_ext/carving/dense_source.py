"""The binary's carve mode: a dense ViT checkpoint in, a V-MoE checkpoint out.

    python -m vmoe_ext.main --config=configs/carve.py:S1A1E8 \
        --config.carve.checkpoint_dir=runs/vit_dense --workdir=runs/carve

reads the newest checkpoint of the dense ViT run (its fingerprint must match
the config's `model`, `data` and `optimizer`, as for evaluation), takes
`carve.num_calibration` images of the training split (a `carve.seed`ed
sample, preprocessed as for evaluation), carves the blocks of
`carve.layers/every/last` (`vmoe_ext.carving.model`) and writes to WORKDIR:

* `checkpoints/0/`: the carved V-MoE's full train state at step 0 (params,
  router state, a fresh optimizer state, the data position), fingerprinted
  with `carved_config(config)`, so the evaluation/robustness mode
  (`robustness.checkpoint_dir=WORKDIR`) restores it as is, a fine-tune loads
  it through `init` (or resumes it, training into WORKDIR itself);
* `metrics.jsonl`: one `split: "carve"` line per block (assignment cost,
  rates, seconds), then the clean test evaluation of the dense model
  (`split: "dense_test"`) and of the carved one (`split: "test"`,
  `final: true`), which also carries `carve_seconds`;
* `report.md`: both accuracies, the carving wall time, per-block table.
"""

from __future__ import annotations

import os
import time
from typing import Any

import flax.serialization
import jax
import ml_collections
import numpy as np

from vmoe_ext.carving.model import CarveResult, carve_vit
from vmoe_ext.carving.spec import CarveSpec, carved_model_config
from vmoe_ext.data import (TrainIterator, default_normalization, eval_batches,
                           load_dataset)
from vmoe_ext.data.dataset import ArrayDataset
from vmoe_ext.data.stream_eval import StreamingEvalSplit, streams_evaluation
from vmoe_ext.data.stream_iterator import StreamingTrainIterator
from vmoe_ext.errors import ConfigError, require
from vmoe_ext.evaluate.from_checkpoint import restore_for_eval, test_data
from vmoe_ext.models import build_model
from vmoe_ext.reporting.report import listify, write_report
from vmoe_ext.reporting.writers import (MetricWriter, duration, progress_bar,
                                       progress_line)
from vmoe_ext.train import checkpoint_params as ckpt_params
from vmoe_ext.train.checkpoints import CheckpointManager, config_fingerprint
from vmoe_ext.train.optimizer import make_optimizer
from vmoe_ext.train.state import TrainState
from vmoe_ext.train.steps import evaluate, make_eval_step
from vmoe_ext.train.validate import validate_config
from vmoe_ext.train.workdir import WorkdirLock


def carved_config(config: ml_collections.ConfigDict
                  ) -> ml_collections.ConfigDict:
  """`config` with `model` the carved V-MoE and no `carve` section: what
  the carved checkpoint is fingerprinted with."""
  spec = CarveSpec.from_config(config.carve)
  out = ml_collections.ConfigDict(config.to_dict())
  del out["carve"]
  out.model = carved_model_config(config.model.to_dict(), spec)
  return out


def check_dense_checkpoint(spec: CarveSpec, num_layers: int) -> int:
  """The newest step of `spec.checkpoint_dir`, checked to hold a dense ViT
  with an MLP in every carved block (from metadata; no data is read)."""
  source = spec.checkpoint_dir
  steps = ckpt_params.checkpoint_steps(os.path.join(source, "checkpoints"))
  require(steps, "carve.checkpoint_dir",
          f"no checkpoint in {os.path.join(source, 'checkpoints')!r}; train "
          f"the dense ViT there first (python -m vmoe_ext.main "
          f"--config=configs/vit_dense.py:plain --workdir={source})")
  shapes = ckpt_params.param_shapes(
      ckpt_params.state_directory(os.path.join(source, "checkpoints"),
                                  steps[-1]))
  moe = sorted(p for p in shapes if "/Moe/" in p)
  require(not moe, "carve.checkpoint_dir",
          f"{source!r} holds a V-MoE checkpoint ({moe[0] if moe else ''}), "
          "not a dense ViT; carving reads a dense ViT trained with "
          "configs/vit_dense.py:plain")
  for block in spec.blocks(num_layers):
    path = f"encoderblock_{block}/Mlp/Dense_0/kernel"
    require(path in shapes, "carve.checkpoint_dir",
            f"{source!r} is not a dense ViT with an MLP in block {block} "
            f"(no {path})")
  return steps[-1]


def calibration_images(train: ArrayDataset | StreamingEvalSplit,
                       spec: CarveSpec, data: ml_collections.ConfigDict
                       ) -> np.ndarray:
  """`spec.num_calibration` training images (a seeded sample, in sample
  order), preprocessed as for evaluation (a streamed train split: read
  record by record through `data.pp_eval`)."""
  require(len(train) > 0, "carve.num_calibration",
          f"the training split {train.name!r} is empty: no calibration data")
  require(spec.num_calibration <= len(train), "carve.num_calibration",
          f"asks for {spec.num_calibration} calibration images; the "
          f"training split {train.name!r} has {len(train)}")
  pick = np.random.default_rng(spec.seed).permutation(
      len(train))[:spec.num_calibration]
  if isinstance(train, StreamingEvalSplit):
    subset, image_size = train.analysis_dataset(None, indices=pick), None
  else:
    subset = ArrayDataset(train.images[pick], train.labels[pick],
                          train.num_classes, f"{train.name}[calibration]")
    image_size = data.get("image_size")
  mean, std = default_normalization(data)
  batches = eval_batches(subset, len(subset), image_size=image_size,
                         mean=mean, std=std)
  return next(batches)["image"]


def _train_split(data: ml_collections.ConfigDict
                 ) -> ArrayDataset | StreamingEvalSplit:
  """The train split: in memory, or streamed through `data.pp_eval` (a
  streaming config; the train split is never loaded whole)."""
  if not data.get("streaming"):
    return load_dataset(data)["train"]
  require(streams_evaluation(data), "data.pp_eval",
          "required by the carve mode with data.streaming=True: the "
          "calibration images of the train split are preprocessed as for "
          "evaluation, e.g. 'decode|resize_small(256)|central_crop(224)|"
          "value_range(-1, 1)'")
  return StreamingEvalSplit(data, split=data.get("train_split") or "train",
                            split_field="data.train_split")


def carve_checkpoint(config: ml_collections.ConfigDict,
                     workdir: str) -> dict[str, Any]:
  """Runs the carve mode (module doc); returns the carved model's final
  test metrics."""
  start = time.time()
  spec = CarveSpec.from_config(config.carve)
  spec.check(config.model.to_dict())
  validate_config(config)
  target = carved_config(config)
  validate_config(target)  # The carved model config, before any data.
  check_dense_checkpoint(spec, config.model.num_layers)
  train = _train_split(config.data)
  images = calibration_images(train, spec, config.data)
  dense = build_model(config.model)
  try:
    source, step = restore_for_eval(config, dense, images[:1].shape,
                                    spec.checkpoint_dir)
  except ConfigError as e:
    if e.field != "robustness.checkpoint_dir":
      raise
    raise ConfigError("carve.checkpoint_dir", e.reason) from e

  blocks = spec.blocks(config.model.num_layers)
  batches = -(-len(images) // spec.batch_size)
  profiling = progress_bar(
      0 if spec.method == "random" else len(blocks) * batches,
      "profiling", position=0)
  carving = progress_bar(len(blocks), f"carving {spec.name()}", position=1)

  def progress(block: int, layer: Any, seconds: float) -> None:
    carving.update(1)
    cost = "" if layer.cost is None else f", assignment cost {layer.cost:.4g}"
    progress_line(carving, f"carved block {block} in {seconds:.2f} s{cost}")

  try:
    result = carve_vit(config.model.to_dict(), source.params, images, spec,
                       progress=progress,
                       on_batch=lambda: profiling.update(1))
  finally:
    profiling.close()
    carving.close()
  with WorkdirLock(workdir):
    _save(result, target, workdir, train)
    return _evaluate_and_report(config, spec, dense, target, result, source,
                                step, workdir, start)


def _fresh_data_state(target: ml_collections.ConfigDict,
                      train: ArrayDataset | StreamingEvalSplit) -> Any:
  """The data position of a fresh training iterator of `target`."""
  if isinstance(train, ArrayDataset):
    return TrainIterator(train, target.data.batch_size,
                         target.seed).get_state()
  stream = StreamingTrainIterator(target.data, target.seed)
  try:
    return stream.get_state()
  finally:
    stream.close()


def _save(result: CarveResult, target: ml_collections.ConfigDict,
          workdir: str, train: ArrayDataset | StreamingEvalSplit) -> None:
  """The carved train state at step 0 in `workdir/checkpoints`, with the
  position of a fresh training iterator over `train`."""
  variables = {"params": result.params, **result.collections}
  state = TrainState.create(variables, make_optimizer(target.optimizer),
                            jax.random.split(jax.random.key(target.seed))[1])
  data = _fresh_data_state(target, train)
  manager = CheckpointManager(
      os.path.join(workdir, "checkpoints"), save_every=1,
      keep=target.train.keep_checkpoints,
      config_fingerprint=config_fingerprint(target, result.params))
  try:
    manager.save(0, flax.serialization.to_state_dict(state),
                 {"data": data, "carved": True}, force=True)
  finally:
    manager.close()


def _evaluate_and_report(config, spec: CarveSpec, dense_model, target,
                         result: CarveResult, source, step, workdir,
                         start) -> dict[str, Any]:
  batches = test_data(config.data)[1]
  loss = config.train.get("loss", "softmax_xent")
  dense = evaluate(jax.jit(make_eval_step(dense_model, loss)), source,
                   batches())
  carved_model = build_model(target.model)
  final = evaluate(jax.jit(make_eval_step(carved_model, loss)),
                   TrainState.for_evaluation(result.params,
                                             result.collections), batches())
  final = listify(final)
  final["carve_seconds"] = result.total_seconds
  rows = []
  with MetricWriter(workdir) as writer:
    writer.truncate(keep_lines=0)
    for block, layer in result.layers.items():
      line = {"block": block, "seconds": result.seconds[block],
              "iterations": layer.iterations}
      if layer.cost is not None:
        line["assignment_cost"] = layer.cost
        shared_rate = float(layer.rates[layer.shared].mean()) if (
            layer.shared.size) else float("nan")
        line["shared_mean_rate"] = shared_rate
        line["routed_mean_rate"] = float(layer.rates[layer.experts].mean())
      writer.write(0, "carve", line)
      rows.append(line)
    writer.write(0, "dense_test", listify(dense))
    writer.write(0, "test", final, final=True)
  table = ["| block | seconds | assignment cost | shared mean rate | "
           "routed mean rate |", "|---|---|---|---|---|"]
  for r in rows:
    table.append(f"| {r['block']} | {r['seconds']:.2f} | "
                 f"{r.get('assignment_cost', '-')} | "
                 f"{r.get('shared_mean_rate', '-')} | "
                 f"{r.get('routed_mean_rate', '-')} |")
  section = "\n".join([
      f"## Carving ({spec.method}, {spec.name()})", "",
      f"Dense checkpoint: step {step} of "
      f"`{os.path.abspath(spec.checkpoint_dir)}`.  ",
      f"Dense test accuracy: {float(dense['accuracy']):.4f}; carved "
      f"(training-free): {float(final['accuracy']):.4f}.  ",
      f"Carving wall time: {result.total_seconds:.2f} s "
      f"({duration(result.total_seconds)}), "
      f"{spec.num_calibration} calibration images.", "", *table, "",
      "Load it: `--config.robustness.checkpoint_dir=WORKDIR` (evaluation) "
      "or `configs/carve.py:...,finetune` (`init.workdir=WORKDIR`)."])
  write_report(workdir, final_metrics=final, records=[],
               config_summary=config.to_dict(),
               wall_seconds=time.time() - start, extra_sections=[section],
               title="Carving report")
  return final
