"""Progress on the console: tqdm bars on a terminal, plain lines elsewhere.

A long loop shows a bar where stderr is a terminal (or a notebook) and, off
a terminal (nohup, a pipe, CI), prints its progress as lines instead
(`progress_line`), e.g. the training loop's `train step 50/2500: ...`
lines and evaluations' `BatchProgress` lines with an estimate of the time
left. `info_line` prints what a run did that is no warning.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any, Callable, Optional

from tqdm.auto import tqdm

from vmoe_ext.sharding.multihost import is_main_process


def _in_ci() -> bool:
  return os.environ.get("CI", "").strip().lower() not in ("", "0", "false",
                                                          "no")


def _interactive() -> bool:
  """True on a terminal (stderr is a tty) or in a Jupyter/Colab kernel."""
  if "ipykernel" in sys.modules:
    return True
  try:
    return sys.stderr.isatty()
  except (AttributeError, ValueError):
    return False


def progress_bar(total: int, desc: str, **kw):
  """A tqdm progress bar on stderr, quiet off a terminal.

  The bar is disabled when stderr is not a terminal (a Jupyter/Colab kernel
  counts as one) or the `CI` environment variable is set (to anything but
  "", "0", "false", "no"), unless the caller passes `disable=` explicitly.
  A disabled bar accepts `update`, `set_postfix`, iteration and `close` as
  no-ops. Always disabled on the processes other than 0 of a multi-process
  job: one process reports.

  Args:
    total: expected number of iterations.
    desc: label shown before the bar.
    **kw: further `tqdm.tqdm` arguments.
  """
  if not is_main_process():
    kw["disable"] = True
  elif kw.get("disable") is None:
    kw["disable"] = bars_disabled()
  kw.setdefault("file", sys.stderr)
  kw.setdefault("dynamic_ncols", True)
  return tqdm(total=total, desc=desc, **kw)


def bars_disabled() -> bool:
  """True where `progress_bar` is quiet: off a terminal or under CI."""
  return _in_ci() or not _interactive()


def progress_line(bar, text: str) -> None:
  """Prints `text` as one line on stderr when `bar` is disabled (or, for
  `bar=None`, where bars are: `bars_disabled()`), so runs under nohup, a pipe
  or CI show progress. Nothing on the processes other than 0 of a
  multi-process job."""
  if not is_main_process():
    return
  if (bars_disabled() if bar is None else getattr(bar, "disable", False)):
    print(text, file=sys.stderr, flush=True)


def info_line(text: str) -> None:
  """Prints an informational line `info: text` on stderr (process 0 only),
  like the binary's `note:` lines: what a run did that is no warning
  (resuming, loading initial params, the checkpoint evaluated)."""
  if is_main_process():
    print(f"info: {text}", file=sys.stderr, flush=True)


def wall_time(seconds: float) -> str:
  """One figure for a wall time: `"10.6 s"` under a minute, else
  `duration(seconds)` (`"1m05s"`)."""
  return f"{seconds:.1f} s" if seconds < 59.95 else duration(seconds)


class BatchProgress:
  """Progress lines with an estimate for a long loop, as the training loop
  prints them: `"{label} 2/5 batches, 1m40s elapsed, ~2m30s left"` through
  `progress_line` (so only off a terminal: on one, the bar shows it).

  A line after the first batch, the last, and any other at least
  `min_interval` seconds after the previous line. The estimate is timed from
  the end of the first batch (which compiles) once two are done. `clock`:
  `time.monotonic` unless a test gives another.
  """

  def __init__(self, bar: Any, total: int, label: str, *,
               unit: str = "batches", min_interval: float = 10.0,
               clock: Callable[[], float] = time.monotonic):
    self.bar, self.total, self.label, self.unit = bar, total, label, unit
    self.min_interval = min_interval
    self.clock = clock
    self.start = clock()
    self.first: Optional[float] = None  # When the first batch ended.
    self.printed: Optional[float] = None  # When the last line was printed.
    self.done = 0

  def update(self, n: int = 1) -> None:
    """`n` more done: advances the bar and prints the line when due."""
    self.done += n
    now = self.clock()
    if self.first is None:
      self.first = now
    self.bar.update(n)
    left = self.total - self.done
    if (self.printed is not None and left > 0
        and now - self.printed < self.min_interval):
      return
    self.printed = now
    progress_line(self.bar, self.line(now))

  def note(self, text: str) -> None:
    """An event inside the batch under way (an attack's stage): the bar's
    postfix on a terminal; off one, a line with the elapsed time
    (`"{label} batch 1/2: apgd-ce done, ..., 1m02s elapsed"`)."""
    if not getattr(self.bar, "disable", True):
      self.bar.set_postfix_str(text)
    progress_line(self.bar, f"{self.label} batch {self.done + 1}/"
                  f"{self.total}: {text}, "
                  f"{duration(self.clock() - self.start)} elapsed")

  def line(self, now: float) -> str:
    """The progress line at time `now`."""
    left = max(self.total - self.done, 0)
    text = (f"{self.label} {self.done}/{self.total} {self.unit}, "
            f"{duration(now - self.start)} elapsed")
    if left:
      per = ((now - self.first) / (self.done - 1) if self.done > 1
             else now - self.start)
      text += f", ~{duration(per * left)} left"
    return text


def duration(seconds: float) -> str:
  """`duration(3725) == "1h02m05s"`, `duration(65) == "1m05s"`."""
  seconds = max(int(round(seconds)), 0)
  h, rest = divmod(seconds, 3600)
  m, s = divmod(rest, 60)
  if h:
    return f"{h}h{m:02d}m{s:02d}s"
  return f"{m}m{s:02d}s" if m else f"{s}s"


__all__ = ["BatchProgress", "bars_disabled", "duration", "info_line",
           "progress_bar", "progress_line", "wall_time"]
