"""Robustness evaluation of a training workdir's checkpoint (no training)."""

from __future__ import annotations

import os
import time
from typing import Any

import jax
import ml_collections

from vmoe_ext.errors import require
from vmoe_ext.evaluate.robustness import evaluate_robustness
from vmoe_ext.train import loop
from vmoe_ext.train.report import write_report
from vmoe_ext.train.steps import evaluate, make_eval_step
from vmoe_ext.train.writers import MetricWriter, read_metrics


def evaluate_checkpoint(config: ml_collections.ConfigDict,
                        workdir: str) -> dict[str, Any]:
  """Restores `config.robustness.checkpoint_dir`'s newest checkpoint and writes
  the clean and robustness evaluations to `workdir`.

  The config must describe the same model and data as the training run (the
  checkpoint's fingerprint is checked).
  """
  start = time.time()
  source = config.robustness.get("checkpoint_dir")
  require(isinstance(source, str) and source, "robustness.checkpoint_dir",
          "required: the workdir of the training run to evaluate")
  ckpt_dir = os.path.join(source, "checkpoints")
  require(os.path.isdir(ckpt_dir) and any(
      name.isdigit() for name in os.listdir(ckpt_dir)),
          "robustness.checkpoint_dir",
          f"no checkpoint found in {ckpt_dir!r}; train into that workdir "
          f"first (python -m vmoe_ext.main --config=TRAINING_CONFIG "
          f"--workdir={source})")
  run = loop.setup(config, source)
  step = run.restore()
  run.checkpoints.close()
  require(step is not None, "robustness.checkpoint_dir",
          f"no checkpoint could be restored from {ckpt_dir!r}")
  os.makedirs(workdir, exist_ok=True)
  writer = MetricWriter(workdir)
  writer.truncate(-1)  # A fresh evaluation: drop any earlier lines here.
  final = evaluate(jax.jit(make_eval_step(run.model)), run.state,
                   run.eval_batches())
  writer.write(step, "test", final, final=True)
  sections = evaluate_robustness(
      run.model, run.state.variables(), run.datasets["test"], config.data,
      config.robustness, batch_size=config.data.eval_batch_size,
      writer=writer, step=step, workdir=workdir)
  writer.close()
  final = loop.listify(final)
  final["step"] = step
  write_report(workdir, final_metrics=final, records=read_metrics(workdir),
               config_summary=config.to_dict(),
               wall_seconds=time.time() - start,
               extra_sections=[f"Evaluated checkpoint: step {step} of "
                               f"`{os.path.abspath(source)}`."] + sections,
               title="Robustness evaluation report")
  return final
