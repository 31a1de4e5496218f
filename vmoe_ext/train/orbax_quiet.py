"""Orbax's failures, reported once and in our words.

Orbax runs each restore in a fresh event loop and closes it as soon as one
read fails; tensorstore then completes the other reads from its own threads
and calls `loop.call_soon_threadsafe` on the closed loop, which Python reports
as unraisable: one "Event loop is closed" traceback per array (hundreds of
lines), possibly after the failed call returned. A failed save also logs the
traceback of each failing orbax thread (through absl) and asyncio's
"Task exception was never retrieved" for the writes left behind, and the
coroutines of a failed restore that never ran are reported, when garbage
collected, as "RuntimeWarning: coroutine '...' was never awaited".
`quiet_orbax` filters exactly those out around orbax calls whose failures
`vmoe_ext.train.checkpoints` reports itself; `short_reason` and `os_errno`
turn an orbax/tensorstore exception into one line and an OS error number.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import gc
import logging
import os
import re
import sys
import threading
import time
import traceback
import warnings
from typing import Any, Callable, Iterator

import orbax.checkpoint as ocp

_ORBAX_DIR = os.path.dirname(os.path.abspath(ocp.__file__))


class _ClosedLoopNoiseFilter:
  """A `sys.unraisablehook` that drops "Event loop is closed" errors.

  Orbax runs each restore in a fresh event loop and closes it as soon as one
  read fails; tensorstore then completes the other reads of that restore and
  calls `loop.call_soon_threadsafe` on the closed loop from its own threads,
  which Python reports as unraisable (one traceback per array, hundreds of
  lines, at any time shortly after). Everything else goes to the hook that
  was installed before.
  """

  def __init__(self, previous: Callable[[Any], None]):
    self.previous = previous

  def __call__(self, unraisable: Any) -> None:
    if not _is_closed_loop_noise(unraisable):
      self.previous(unraisable)


def _is_closed_loop_noise(unraisable: Any) -> bool:
  exc = unraisable.exc_value
  if not (isinstance(exc, RuntimeError)
          and str(exc) == "Event loop is closed"):
    return False
  tb = unraisable.exc_traceback
  while tb is not None:
    if tb.tb_frame.f_code.co_name == "call_soon_threadsafe":
      return True
    tb = tb.tb_next
  return False


class _OrbaxErrorLogFilter(logging.Filter):
  """Drops logged tracebacks of exceptions raised in orbax code: orbax logs
  those of its threads (through absl), asyncio those of orbax tasks nobody
  awaited once another part of the same save failed (and of orbax tasks
  destroyed while pending)."""

  def filter(self, record: logging.LogRecord) -> bool:
    if record.levelno < logging.ERROR:
      return True
    if record.name == "asyncio" and _ORBAX_DIR in record.getMessage():
      return False  # "Task was destroyed but it is pending!" and the like.
    if not record.exc_info:
      return True
    if record.pathname.startswith(_ORBAX_DIR):
      return False
    tb = record.exc_info[2]
    while tb is not None:
      if tb.tb_frame.f_code.co_filename.startswith(_ORBAX_DIR):
        return False
      tb = tb.tb_next
    return True


class _AbandonedReadFilter(logging.Filter):
  """Drops asyncio's "Future exception was never retrieved" for tensorstore
  futures (the reads of a corrupt checkpoint that we reported and fell back
  from): they are logged when the future is garbage-collected, which may be
  after `quiet_orbax` exited, so this filter stays installed."""

  def filter(self, record: logging.LogRecord) -> bool:
    if record.name != "asyncio" or "never retrieved" not in str(record.msg):
      return True
    return "tensorstore_spec" not in record.getMessage() + str(
        record.exc_info[1] if record.exc_info else "")


@functools.lru_cache(maxsize=1)
def _orbax_coroutines() -> str:
  """A regex of the "never awaited" warning of orbax's coroutines only: the
  names of every `async def` in orbax's sources (read once, ~20 ms)."""
  names = set()
  for root, _, files in os.walk(_ORBAX_DIR):
    for name in files:
      if name.endswith(".py"):
        with open(os.path.join(root, name), encoding="utf-8") as f:
          names.update(re.findall(r"async def (\w+)", f.read()))
  return (r"coroutine '(?:[\w<>]+\.)*(?:%s)' was never awaited"
          % "|".join(sorted(names)))


@contextlib.contextmanager
def quiet_orbax() -> Iterator[None]:
  """Around orbax calls whose failures we report ourselves.

  Orbax logs (through absl) the traceback of an exception raised in one of
  its threads before handing the exception to the caller, and asyncio those
  of orbax tasks left unawaited; those records are dropped while inside.
  The closed-event-loop filter, the abandoned-read filter and the warnings
  filter for orbax's never-awaited coroutines are installed for good (at the
  front of the filters, so also inside a caller's `catch_warnings`): what
  they drop may arrive after the failed call returned.
  """
  warnings.filterwarnings("ignore", message=_orbax_coroutines(),
                          category=RuntimeWarning)
  if not isinstance(sys.unraisablehook, _ClosedLoopNoiseFilter):
    sys.unraisablehook = _ClosedLoopNoiseFilter(sys.unraisablehook)
  asyncio_logger = logging.getLogger("asyncio")
  if not any(isinstance(f, _AbandonedReadFilter)
             for f in asyncio_logger.filters):
    asyncio_logger.addFilter(_AbandonedReadFilter())
  log_filter = _OrbaxErrorLogFilter()
  loggers = [logging.getLogger(name) for name in ("absl", "asyncio")]
  for logger in loggers:
    logger.addFilter(log_filter)
  try:
    yield
  finally:
    for logger in loggers:
      logger.removeFilter(log_filter)


def orbax_threads() -> set[threading.Thread]:
  return {t for t in threading.enumerate()
          if type(t).__module__.startswith("orbax.")}


def join_threads(threads: set[threading.Thread], timeout: float) -> None:
  """Waits (at most `timeout` seconds in all) for `threads` to end."""
  deadline = time.monotonic() + timeout
  for thread in threads:
    # Not `thread.join`: orbax's threads re-raise their exception there.
    threading.Thread.join(thread, max(0.0, deadline - time.monotonic()))


def chained(error: BaseException) -> Iterator[BaseException]:
  """`error` and every exception reachable from it (causes, contexts, the
  members of exception groups), each once."""
  seen, stack = set(), [error]
  while stack:
    e = stack.pop()
    if e is None or id(e) in seen:
      continue
    seen.add(id(e))
    yield e
    stack += [e.__cause__, e.__context__, *getattr(e, "exceptions", ())]


def release_abandoned_tasks(error: BaseException) -> None:
  """Finalises the asyncio tasks of a failed orbax save now, inside
  `quiet_orbax`, rather than at exit (where each would print a traceback).

  They are kept alive by the frames in `error`'s tracebacks; clearing those
  frames' locals (the tracebacks still print) lets `gc` collect them.
  """
  for e in chained(error):
    traceback.clear_frames(e.__traceback__)
  gc.collect()


def short_reason(error: BaseException, directory: str,
                 limit: int = 200) -> str:
  """One line about `error`: tensorstore's specs and paths left out."""
  while "TensorStore details" in str(error) and error.__cause__ is not None:
    error = error.__cause__  # Orbax's wrapper only prints the spec.
  text = str(error).split(" [tensorstore_spec", 1)[0]
  text = text.replace(directory + os.sep, "").strip()
  text = text.splitlines()[0] if text else ""
  status = re.match(r"([A-Z][A-Z_]+): (.*)", text)
  if status:  # Tensorstore: "CODE: Error opening ...: ...: what happened".
    code, rest = status.groups()
    array = re.search(r'Error (?:reading|writing) "([^"]+)"', rest)
    where = f" {array.group(1)!r}" if array else ""
    text = f"{code}{where}: {rest.split(': ')[-1]}"
  else:
    text = f"{type(error).__name__}: {text}"
  return text if len(text) <= limit else text[:limit - 3] + "..."


def os_errno(error: BaseException) -> int | None:
  """The OS error number behind `error` (its causes, contexts, groups and
  tensorstore's `[os_error_code='28']` included), or None."""
  for e in chained(error):
    if isinstance(e, OSError) and e.errno:
      return e.errno
    code = re.search(r"os_error_code='?(\d+)", str(e))
    if code:
      return int(code.group(1))
    if "No space left on device" in str(e):
      return errno.ENOSPC
  return None


def is_io_failure(error: BaseException) -> bool:
  return os_errno(error) is not None or bool(
      re.match(r"[A-Z][A-Z_]+: ", str(error)))  # A tensorstore status.


__all__ = ["chained", "is_io_failure", "join_threads", "orbax_threads", "os_errno",
           "quiet_orbax", "release_abandoned_tasks", "short_reason"]
