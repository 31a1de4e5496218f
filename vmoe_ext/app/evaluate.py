"""The evaluate-only mode: a checkpoint's robustness evaluation, no training.

`robustness.checkpoint_dir` names a training workdir whose newest checkpoint
is evaluated; `robustness.from_init` evaluates the params the `init` section
loads (e.g. an imported vmoe V-MoE). Only what evaluation needs is made: the
test split, abstract variables (`jax.eval_shape`, nothing initialised), the
checkpoint's params and non-parameter collections (e.g. "router_state"); no
optimizer state, no train iterator.
"""

from __future__ import annotations

import os
import time
from typing import Any, Optional

from vmoe_ext.app.context import RunContext
from vmoe_ext.data.source import DataSource
from vmoe_ext.errors import require
from vmoe_ext.reporting.report import listify, write_report
from vmoe_ext.reporting.writers import MetricWriter, info_line, read_metrics
from vmoe_ext.train.workdir import WorkdirLock

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


def check_source(source: Any) -> None:
  """`robustness.checkpoint_dir` holds a checkpoint (before any data)."""
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


def evaluate_checkpoint(config: Any, workdir: str, *,
                        data: Optional[DataSource] = None) -> dict[str, Any]:
  """Restores `config.robustness.checkpoint_dir`'s newest checkpoint (or the
  `init` section's params with `robustness.from_init`) and writes the clean
  evaluation and `final_evaluations` (routing analysis, robustness) to
  `output_dir(workdir)`.

  The config must describe the same model and data as the training run (the
  checkpoint's fingerprint is checked).
  """
  start = time.time()
  ctx = RunContext.assemble(config, data=data)
  from_init = ctx.config.robustness.from_init
  source = None if from_init else ctx.config.robustness.checkpoint_dir
  if not from_init:
    check_source(source)
  evaluated = ctx.open_evaluation(source)
  step = int(ctx.state.step)
  # The report's line says what was evaluated; the console says it first.
  info_line(evaluated.replace("`", "").replace("Evaluated", "Evaluating", 1))
  records = [] if from_init else _training_record(source, step)
  out = output_dir(workdir)
  with WorkdirLock(out), MetricWriter(out) as writer:
    # A fresh evaluation: drops earlier evaluation lines (never training
    # lines: a training workdir's evaluation goes to its own folder).
    writer.truncate(keep_lines=0)
    final = ctx.evaluate(final=True)
    writer.write(step, "test", final, final=True)
    # The run's own evaluations after the final one: an image run's routing
    # analysis and robustness section, a language model's per-block losses
    # and routing analysis.
    sections = ctx.final_evaluations(writer=writer, workdir=out,
                                     records=records)
  final = listify(final)
  final["step"] = step
  write_report(out, final_metrics=final, records=read_metrics(out),
               config_summary=ctx.config.to_dict(),
               wall_seconds=time.time() - start,
               extra_sections=sections, summary=[evaluated],
               title="Robustness evaluation report")
  return final


__all__ = ["EVALUATION_DIR", "evaluate_checkpoint", "output_dir"]
