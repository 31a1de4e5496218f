"""The training loop: steps, logging, evaluation and checkpoint cadence,
NaN guard, preemption. The train mode (`vmoe_ext.app.train`) assembles the
run and calls `train_loop`."""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
import time
from typing import Any, Iterator, Optional, Sequence

import jax
import numpy as np

from vmoe_ext.reporting.report import listify
from vmoe_ext.reporting.writers import (MetricWriter, duration, progress_bar,
                                       progress_line)
from vmoe_ext.train.steps import router_state_metrics



class NonFiniteError(FloatingPointError):
  """The loss or a gradient became NaN/Inf; the last good checkpoint is kept."""


def _mean_metrics(history: Sequence[dict]) -> dict[str, Any]:
  host = jax.device_get(list(history))
  return {k: np.mean(np.stack([np.asarray(h[k]) for h in host]), axis=0)
          for k in host[0]}


def check_finite(run: Any, step: int, history: Sequence[dict]) -> None:
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
  """A stop signal (SIGTERM: preemption; SIGINT: Ctrl-C) stopped training; a
  checkpoint of the current step was saved. `signum` is the signal."""

  def __init__(self, message: str, signum: int = signal.SIGTERM):
    super().__init__(message)
    self.signum = signum


def _reached_preemption(step: int) -> bool:
  """Whether every process of a multi-process job stops at `step`: jax's
  preemption service (started by `jax.distributed.initialize`) caught a
  SIGTERM in one of them and the processes agreed on this step."""
  from jax.experimental import multihost_utils
  try:
    return multihost_utils.reached_preemption_sync_point(step)
  except RuntimeError:  # The preemption service is off.
    return False


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


@contextlib.contextmanager
def stop_flag(enabled: bool = True) -> Iterator[list]:
  """A list that gets the signal number when SIGTERM or SIGINT (Ctrl-C)
  arrives; the loop checks it at each step boundary, saves and stops.

  A second Ctrl-C does not wait for the step: it raises `KeyboardInterrupt`
  at once (nothing saved after the last checkpoint). Only in the main
  thread; elsewhere, or when not `enabled`, the list is never set and the
  signals keep their handlers.
  """
  received: list = []
  if not enabled or threading.current_thread() is not threading.main_thread():
    yield received
    return

  def on_signal(signum, frame):
    del frame
    if signum == signal.SIGINT:
      if signal.SIGINT in received:  # The second Ctrl-C: stop now.
        raise KeyboardInterrupt
      print("\nCtrl-C: stopping after saving a checkpoint at the end of "
            "this step (Ctrl-C again to stop at once)", file=sys.stderr,
            flush=True)
    received.append(signum)

  previous = {s: signal.signal(s, on_signal) for s in STOP_SIGNALS}
  try:
    yield received
  finally:
    for s, handler in previous.items():
      signal.signal(s, handler)


def history_to_json(history: Sequence[dict]) -> list[dict[str, Any]]:
  return [listify(h) for h in jax.device_get(list(history))]


def history_from_json(history: Sequence[dict]) -> list[dict[str, Any]]:
  """Train metrics are float32 on the device; so they are again here."""
  return [{k: np.asarray(v, np.float32) for k, v in h.items()}
          for h in history]


def train_loop(run: Any, writer: MetricWriter, history: list, sigterm: list,
               stop_at_step: Optional[int], sync_preemption: bool = False
               ) -> Optional[int]:
  """The training loop from `run.state.step` to `train.total_steps`.

  `run` is the run's context (`vmoe_ext.app.context.RunContext`): its
  resolved `config`, `state` (replaced step by step), `checkpoints`,
  `make_train_step()`, `next_batch()`, `evaluate()`, `save(**extra)`, and
  for the log lines `progress_metrics(step, rate)` and `summary(metrics)`.

  Returns the last step, or None when stopped at `stop_at_step`. Raises
  `NonFiniteError` (nothing saved after the first bad step) or `Preempted`
  (after saving the current step) when a stop signal arrived (`sigterm`
  got a signal number from `stop_flag` or, with `sync_preemption`, jax's
  preemption sync point of the processes is reached).
  """
  config = run.config
  step = int(run.state.step)
  total = config.train.total_steps
  eval_every = config.train.eval_every
  # The state is donated: `run.state` is the only live reference to it, and
  # `history` keeps metrics, never states. No host sync per step: the NaN
  # guard runs on the device (see `make_train_step`) and is read back by
  # `check_finite` before anything is logged, evaluated or saved.
  train_step = run.make_train_step()
  save = lambda: run.save(metrics_lines=writer.num_lines(),
                          history=history_to_json(history))
  # Throughput from the end of the first step on (it includes compiling).
  timed_from, since = step + 1, time.time()
  with progress_bar(total=total, desc="train", initial=step) as bar:
    if step < total:  # The first step compiles: tens of seconds on a CPU.
      progress_line(bar, f"compiling the train step (step {step + 1}/"
                    f"{total})...")
    while step < total:
      run.state, metrics = train_step(run.state, run.next_batch())
      step += 1
      if step == timed_from:
        since = time.time()
      history.append(metrics)
      bar.update(1)
      if sync_preemption and _reached_preemption(step):
        sigterm.append(signal.SIGTERM)
      log_now = step % config.train.log_every == 0 or step == total
      eval_now = bool(eval_every) and step % eval_every == 0 and step < total
      save_now = run.checkpoints.should_save(step)
      if log_now or eval_now or save_now or sigterm:
        check_finite(run, step, history)
      if log_now:
        mean = _mean_metrics(history)
        rate = (step - timed_from) / max(time.time() - since, 1e-9)
        # Persistent router state (Symphony's expert graph) as it is now;
        # progress: examples seen, epochs, and the throughput since the
        # first step (a timing: it differs between runs, see
        # TIMING_METRICS; None when only the first step, compiling, ran
        # since the start or the resume: nothing timed yet).
        writer.write(step, "train", {
            **mean, **router_state_metrics(run.state.collections),
            **run.progress_metrics(step, rate)})
        bar.set_postfix(loss=f"{float(metrics['loss']):.3f}")
        speed = (f"{rate:.2f} steps/s, ETA "
                 f"{duration((total - step) / rate)}" if rate > 0
                 else "compiled")
        progress_line(bar, f"train step {step}/{total}: "
                      f"{run.summary(mean, training=True)}, {speed}")
        history = []
      if eval_now:
        result = run.evaluate()
        writer.write(step, "test", result)
        progress_line(bar, f"eval step {step}: {run.summary(result)}")
      if save_now or sigterm:
        save()
      if sigterm:
        signum = sigterm[0]
        what = ("SIGTERM received" if signum == signal.SIGTERM
                else "interrupted (Ctrl-C)")
        raise Preempted(
            f"{what}; the checkpoint of step {step} is saved in "
            f"{run.checkpoints.directory}. Re-run the same command to "
            "resume.", signum=signum)
      if stop_at_step is not None and step >= stop_at_step:
        return None
  check_finite(run, step, history)
  return step
