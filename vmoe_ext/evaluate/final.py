"""The binary's after-training evaluation: routing analysis, then robustness.

The train mode (`vmoe_ext.app.train.train_and_evaluate`) takes it as its
`after_training` hook; the evaluate-only mode (`vmoe_ext.app.evaluate`)
runs the same two steps (`final_evaluations`).

In a multi-process job every process runs the hook (its jitted functions
are collectives over the run's mesh: the in-memory test split, the same on
every process, goes in as global arrays, the results come back replicated);
only process 0 writes: `metrics.jsonl` lines (`MetricWriter`), and the PNGs
into the workdir; the other processes draw theirs into a scratch directory
that is removed afterwards.
"""

from __future__ import annotations

import shutil
import tempfile
from typing import Any, Callable, Mapping, Sequence

import ml_collections

from vmoe_ext.data import ArrayDataset
from vmoe_ext.evaluate.robustness import evaluate_robustness
from vmoe_ext.evaluate.routing_report import evaluate_routing
from vmoe_ext.reporting.writers import MetricWriter, read_metrics
from vmoe_ext.sharding.multihost import is_main_process


def final_evaluations(model: Any, variables: Mapping[str, Any],
                      test: ArrayDataset, config: ml_collections.ConfigDict,
                      *, writer: MetricWriter, step: int, workdir: str,
                      records: Sequence[Mapping[str, Any]] = (),
                      partitioning: Any = None) -> list[str]:
  """The routing analysis of the test split (`evaluate_routing`; nothing for
  a dense model), then the robustness evaluation when `config.robustness` is
  set; returns their markdown sections. `records`: the training record, for
  the router-state heatmaps. `partitioning`: the run's mesh, when the
  variables are its (global) arrays."""
  batch_size = config.data.eval_batch_size
  sections = list(evaluate_routing(
      model, variables, test, config.data, batch_size=batch_size,
      writer=writer, step=step, workdir=workdir, records=records,
      partitioning=partitioning))
  if config.get("robustness") is not None:
    sections += evaluate_robustness(
        model, variables, test, config.data, config.robustness,
        batch_size=batch_size, writer=writer, step=step, workdir=workdir,
        partitioning=partitioning)
  return sections


def after_training_hook(config: ml_collections.ConfigDict, workdir: str
                        ) -> Callable[..., list[str]]:
  """The `train_and_evaluate(after_training=...)` hook of every run:
  `hook(run, writer) -> markdown sections`, `run` being the run's context
  (`vmoe_ext.app.context.RunContext`; its resolved config is the one
  evaluated), whose `final_evaluations(writer=, workdir=, records=)` says
  what its model family evaluates after training (an image model:
  `final_evaluations` here)."""

  def hook(run, writer: MetricWriter) -> list[str]:
    main = is_main_process()
    out = workdir if main else tempfile.mkdtemp(prefix="vmoe_ext_plots_")
    try:
      return run.final_evaluations(
          writer=writer, workdir=out,
          records=_records(workdir) if main else [])
    finally:
      if not main:
        shutil.rmtree(out, ignore_errors=True)

  return hook


def _records(workdir: str) -> list[dict]:
  """The run's `metrics.jsonl` so far ([] where there is none: a process
  other than 0 of a multi-process run)."""
  try:
    return read_metrics(workdir)
  except FileNotFoundError:
    return []
