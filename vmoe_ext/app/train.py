"""The train mode: assemble the run, train, evaluate, report.

`train_and_evaluate(config, workdir)` is the job behind `python -m
vmoe_ext.main` for a training config.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, Optional, Sequence

import jax

from vmoe_ext.app.context import RunContext
from vmoe_ext.data.source import DataSource
from vmoe_ext.reporting.report import listify, write_report
from vmoe_ext.reporting.writers import (MetricWriter, info_line,
                                       progress_line, read_metrics)
from vmoe_ext.sharding.multihost import is_main_process
from vmoe_ext.train.loop import history_from_json, stop_flag, train_loop
from vmoe_ext.train.workdir import WorkdirLock


def setup(config: Any, workdir: str, *,
          data: Optional[DataSource] = None) -> RunContext:
  """The run context of a training run: config resolved, model built, data
  opened, the initial state and `workdir`'s checkpoint manager (nothing is
  restored yet: `restore()`). Every config error is raised here, before
  the train step is compiled."""
  ctx = RunContext.assemble(config, data=data)
  ctx.open_training(workdir)
  return ctx


def train_and_evaluate(config: Any, workdir: str, *,
                       after_training: Optional[Callable[..., Sequence[str]]]
                       = None,
                       stop_at_step: Optional[int] = None,
                       handle_sigterm: bool = False,
                       data: Optional[DataSource] = None,
                       preflight: Optional[Callable[[RunContext], None]]
                       = None) -> Optional[dict[str, Any]]:
  """Trains, evaluates, checkpoints and reports; returns the final metrics.

  Args:
    config: the run config (see `configs/default.py`), resolved here unless
      it already is.
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
    handle_sigterm: on SIGTERM or a first Ctrl-C (SIGINT), save a checkpoint
      at the next step boundary and raise `Preempted` (the binary exits with
      143 or 130); a second Ctrl-C raises `KeyboardInterrupt` at once. In a
      multi-process job the processes agree on the step through jax's
      preemption sync point (SIGTERM to any one of them stops them all at
      the same step), and Ctrl-C stops at once.
    data: the run's data instead of the one the config describes (tests).
    preflight: optional check of the assembled run before anything is
      written or trained (the binary passes
      `vmoe_ext.app.memory.check_attack_memory`).

  Multi-process jobs (`jax.process_count() > 1`, every process given the
  same `workdir` on a shared file system): every process trains, evaluates
  and takes part in the checkpoint saves and restores; only process 0 holds
  the workdir lock, writes `metrics.jsonl`, TensorBoard events, plots and
  `report.md`, and prints progress. Every process returns the final metrics.
  """
  start = time.time()
  run = setup(config, workdir, data=data)  # Nothing written yet.
  if preflight is not None:
    preflight(run)
  with WorkdirLock(workdir), contextlib.ExitStack() as stack:
    resumed = run.restore()
    if resumed is not None and is_main_process():
      info_line(f"resuming from the checkpoint of step {resumed} in "
                f"{workdir}")
    stack.callback(run.checkpoints.close)
    writer = stack.enter_context(MetricWriter(workdir))
    # The record is cut back to what it was at the checkpoint: what a killed
    # run wrote after it is written again (older checkpoints: by step).
    if "metrics_lines" in run.resumed_extra:
      writer.truncate(keep_lines=run.resumed_extra["metrics_lines"])
    else:
      writer.truncate(after_step=int(run.state.step))
    history = history_from_json(run.resumed_extra.get("history", []))
    multi = jax.process_count() > 1
    with stop_flag(handle_sigterm and not multi) as sigterm:
      step = train_loop(run, writer, history, sigterm, stop_at_step,
                        sync_preemption=handle_sigterm and multi)
    if step is None:
      return None
    # The last checkpoint comes before the final evaluation: a run killed
    # after it re-does the evaluation only, and writes its lines once.
    if run.checkpoints.latest_step() != step:
      run.save(metrics_lines=writer.num_lines())
    final = run.evaluate(final=True)
    writer.write(step, "test", final, final=True)
    progress_line(None, f"final eval step {step}: {run.summary(final)}")
    sections: Sequence[str] = ()
    if after_training is not None:
      sections = after_training(run=run, writer=writer)
  final = listify(final)
  final["step"] = step
  if not is_main_process():
    return final
  write_report(workdir, final_metrics=final, records=read_metrics(workdir),
               config_summary=run.config.to_dict(),
               wall_seconds=time.time() - start, extra_sections=sections)
  return final


__all__ = ["setup", "train_and_evaluate"]
