"""The run's working directory: checked before anything starts, locked while in use.

`check_workdir` raises `ConfigError("--workdir")` for a directory the run
could not use: empty, a file, under a file, not writable (probed by writing,
so it also holds for root on a read-only mount), or in use by another run.
`WorkdirLock` is an advisory `fcntl.flock` on `WORKDIR/.lock`, held for the
whole run; the kernel releases it when the process ends, even by `kill -9`,
so a stale lock never blocks a resume. (flock works on local file systems;
on network file systems that do not support it the lock is a no-op.)

In a multi-process job every process points at the same workdir (a shared
file system); only process 0 takes the lock and checks it, and hands the
outcome to the others (`multihost.agree`), so a workdir in use by another
run stops every process with the same `ConfigError`.
"""

from __future__ import annotations

import errno
import fcntl
import os
import tempfile
from typing import Optional

from vmoe_ext.errors import ConfigError
from vmoe_ext.sharding.multihost import agree, is_main_process

LOCK_FILE = ".lock"
FIELD = "--workdir"


def _existing_ancestor(path: str) -> str:
  """The nearest existing path at or above `path`."""
  path = os.path.abspath(path)
  while not os.path.exists(path):
    parent = os.path.dirname(path)
    if parent == path:
      break
    path = parent
  return path


def _writable(directory: str) -> Optional[str]:
  """None if a file can be created in `directory`, else the OS reason."""
  try:
    fd, name = tempfile.mkstemp(prefix=".write_probe_", dir=directory)
  except OSError as e:
    return e.strerror or str(e)
  os.close(fd)
  os.remove(name)
  return None


def check_workdir(workdir: str) -> None:
  """Raises ConfigError("--workdir") unless the run can use `workdir`.

  Checks, without creating anything: a non-empty path; not an existing file;
  no file among its existing ancestors; the directory (or, when it does not
  exist yet, its nearest existing ancestor) and its `checkpoints/` folder
  writable; not locked by a running job.
  """
  if not workdir:
    raise ConfigError(FIELD, "is empty; give a directory for the run")
  if os.path.exists(workdir) and not os.path.isdir(workdir):
    raise ConfigError(FIELD, f"{workdir!r} exists and is not a directory")
  base = _existing_ancestor(workdir)
  if not os.path.isdir(base):
    raise ConfigError(FIELD, f"{workdir!r} cannot be created: {base!r} is a "
                      "file, not a directory")
  for directory in (base, os.path.join(workdir, "checkpoints")):
    if not os.path.isdir(directory):
      continue
    reason = _writable(directory)
    if reason is not None:
      raise ConfigError(FIELD, f"{directory!r} is not writable ({reason}); "
                        "give a writable directory (a run writes its "
                        "checkpoints, metrics and report there)")
  holder = agree(locked_by(workdir) if is_main_process() else None)
  if holder is not None:
    raise ConfigError(FIELD, f"{workdir!r} is in use by another run "
                      f"({holder}); wait for it to finish or stop it, or "
                      "use another workdir")


def _holder(path: str) -> str:
  try:
    with open(path, encoding="utf-8") as f:
      text = f.read().strip()
  except OSError:
    text = ""
  return f"pid {text}" if text else "lock file " + path


def locked_by(workdir: str) -> Optional[str]:
  """Who holds `workdir`'s lock ("pid 123"), or None if nobody does."""
  path = os.path.join(workdir, LOCK_FILE)
  if not os.path.exists(path):
    return None
  try:
    fd = os.open(path, os.O_RDONLY)
  except OSError:
    return None
  try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
  except OSError as e:
    if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
      return _holder(path)
    return None
  else:
    fcntl.flock(fd, fcntl.LOCK_UN)
    return None
  finally:
    os.close(fd)


class WorkdirLock:
  """Exclusive advisory lock on `WORKDIR/.lock` (the directory is created).

  Use as a context manager; `acquire` raises ConfigError("--workdir") when
  another process holds it. In a multi-process job only process 0 takes it
  (the others hold nothing and raise the same error when it is refused).
  """

  def __init__(self, workdir: str):
    self.workdir = workdir
    self.path = os.path.join(workdir, LOCK_FILE)
    self._fd: Optional[int] = None

  def acquire(self) -> "WorkdirLock":
    refused, error = None, None
    if is_main_process():
      try:
        self._acquire()
      except ConfigError as e:
        refused, error = e.reason, e
      except Exception as e:  # pylint: disable=broad-except
        refused, error = f"process 0 could not lock {self.path!r}: {e}", e
    refused = agree(refused)
    if error is not None:
      raise error
    if refused is not None:
      raise ConfigError(FIELD, refused)
    return self

  def _acquire(self) -> None:
    os.makedirs(self.workdir, exist_ok=True)
    fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
      os.close(fd)
      if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
        raise ConfigError(FIELD, f"{self.workdir!r} is in use by another run "
                          f"({_holder(self.path)}); wait for it to finish or "
                          "stop it, or use another workdir") from e
      raise
    os.ftruncate(fd, 0)
    os.write(fd, str(os.getpid()).encode())
    self._fd = fd

  def release(self) -> None:
    if self._fd is not None:
      fcntl.flock(self._fd, fcntl.LOCK_UN)
      os.close(self._fd)
      self._fd = None

  def __enter__(self) -> "WorkdirLock":
    return self.acquire()

  def __exit__(self, *exc) -> None:
    self.release()


__all__ = ["LOCK_FILE", "WorkdirLock", "check_workdir", "locked_by"]
