"""The binary's after-training evaluation: routing analysis, then robustness.

`train_and_evaluate` takes it as its `after_training` hook (training never
imports evaluation); `evaluate_checkpoint` runs the same two steps.
"""

from __future__ import annotations

from typing import Callable, Sequence

import ml_collections

from vmoe_ext.evaluate.robustness import evaluate_robustness
from vmoe_ext.evaluate.routing_report import evaluate_routing
from vmoe_ext.reporting.writers import MetricWriter, read_metrics


def after_training_hook(config: ml_collections.ConfigDict, workdir: str
                        ) -> Callable[..., list[str]]:
  """The `train_and_evaluate(after_training=...)` hook of every run.

  `hook(run, writer) -> markdown sections`: the routing analysis of the test
  split (`evaluate_routing`; nothing for a dense model), then the robustness
  evaluation when `config.robustness` is set.
  """

  def hook(run, writer: MetricWriter) -> list[str]:
    step = int(run.state.step)
    variables = run.state.variables()
    test = run.datasets["test"]
    batch_size = config.data.eval_batch_size
    sections: Sequence[str] = evaluate_routing(
        run.model, variables, test, config.data, batch_size=batch_size,
        writer=writer, step=step, workdir=workdir,
        records=_records(workdir))
    if config.get("robustness") is not None:
      sections = list(sections) + evaluate_robustness(
          run.model, variables, test, config.data, config.robustness,
          batch_size=batch_size, writer=writer, step=step, workdir=workdir)
    return list(sections)

  return hook


def _records(workdir: str) -> list[dict]:
  """The run's `metrics.jsonl` so far ([] where there is none: a process
  other than 0 of a multi-process run)."""
  try:
    return read_metrics(workdir)
  except FileNotFoundError:
    return []
