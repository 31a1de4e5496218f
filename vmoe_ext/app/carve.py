"""The carve mode: a dense ViT checkpoint in, a V-MoE checkpoint out.

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
from typing import Any, Optional

import flax.serialization
import jax
import ml_collections

from vmoe_ext.app.context import RunContext, resolved
from vmoe_ext.carving.dense_source import (calibration_images, carved_config,
                                           check_dense_checkpoint)
from vmoe_ext.carving.model import CarveResult, carve_vit
from vmoe_ext.carving.spec import CarveSpec
from vmoe_ext.data.source import DataSource
from vmoe_ext.models import build_model
from vmoe_ext.reporting.report import listify, write_report
from vmoe_ext.reporting.writers import (MetricWriter, progress_bar,
                                       progress_line, wall_time)
from vmoe_ext.train.checkpoints import CheckpointManager, config_fingerprint
from vmoe_ext.train.optimizer import make_optimizer
from vmoe_ext.train.state import TrainState
from vmoe_ext.train.workdir import WorkdirLock


def carve_checkpoint(config: Any, workdir: str, *,
                     data: Optional[DataSource] = None) -> dict[str, Any]:
  """Runs the carve mode (module doc); returns the carved model's final
  test metrics."""
  start = time.time()
  ctx = RunContext.assemble(config, data=data)  # The dense model.
  config = ctx.config
  spec = CarveSpec.from_config(config.carve)
  target = resolved(carved_config(config))  # The carved model's config,
  carved_model = build_model(target.model)  # checked before any data.
  check_dense_checkpoint(spec, config.model.num_layers)
  images = calibration_images(ctx.data.train_split(), spec, config.data)
  ctx.open_evaluation(spec.checkpoint_dir, field="carve.checkpoint_dir")
  step = int(ctx.state.step)

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
    result = carve_vit(config.model.to_dict(), ctx.state.params, images, spec,
                       progress=progress,
                       on_batch=lambda: profiling.update(1))
  finally:
    profiling.close()
    carving.close()
  with WorkdirLock(workdir):
    _save(ctx, result, target, workdir)
    return _evaluate_and_report(ctx, spec, carved_model, result, step,
                                workdir, start)


def _save(ctx: RunContext, result: CarveResult,
          target: ml_collections.ConfigDict, workdir: str) -> None:
  """The carved train state at step 0 in `workdir/checkpoints`, with the
  position of a fresh training iterator (the data and seed are the dense
  run's)."""
  variables = {"params": result.params, **result.collections}
  state = TrainState.create(variables, make_optimizer(target.optimizer),
                            jax.random.split(jax.random.key(target.seed))[1])
  try:
    data = ctx.data.train_iterator().get_state()
  finally:
    ctx.data.close()
  manager = CheckpointManager(
      os.path.join(workdir, "checkpoints"), save_every=1,
      keep=target.train.keep_checkpoints,
      config_fingerprint=config_fingerprint(target, result.params))
  try:
    manager.save(0, flax.serialization.to_state_dict(state),
                 {"data": data, "carved": True}, force=True)
  finally:
    manager.close()


def _evaluate_and_report(ctx: RunContext, spec: CarveSpec,
                         carved_model: Any, result: CarveResult, step: int,
                         workdir: str, start: float) -> dict[str, Any]:
  """The dense and the carved model's clean test metrics, `metrics.jsonl`
  and `report.md`."""
  config = ctx.config
  dense = ctx.evaluate()
  final = ctx.evaluate(carved_model, TrainState.for_evaluation(
      result.params, result.collections))
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
  cell = lambda r, key, spec: (format(r[key], spec) if key in r else "-")
  for r in rows:
    table.append(f"| {r['block']} | {r['seconds']:.2f} | "
                 f"{cell(r, 'assignment_cost', '.4g')} | "
                 f"{cell(r, 'shared_mean_rate', '.4f')} | "
                 f"{cell(r, 'routed_mean_rate', '.4f')} |")
  section = "\n".join([
      f"## Carving ({spec.method}, {spec.name()})", "",
      f"Dense checkpoint: step {step} of "
      f"`{os.path.abspath(spec.checkpoint_dir)}`.  ",
      f"Dense test accuracy: {float(dense['accuracy']):.4f}; carved "
      f"(training-free): {float(final['accuracy']):.4f}.  ",
      f"Carving wall time: {wall_time(result.total_seconds)}, "
      f"{spec.num_calibration} calibration images.", "", *table, "",
      "Load it: `--config.robustness.checkpoint_dir=WORKDIR` (evaluation) "
      "or `configs/carve.py:...,finetune` (`init.workdir=WORKDIR`)."])
  write_report(workdir, final_metrics=final, records=[],
               config_summary=config.to_dict(),
               wall_seconds=time.time() - start, extra_sections=[section],
               title="Carving report")
  return final


__all__ = ["carve_checkpoint"]
