#!/usr/bin/env python
"""Launches a multi-process job of `python -m vmoe_ext.main` on this machine.

    python scripts/launch_local.py --num_processes=2 [--devices_per_process=4] \\
        -- --config=configs/tiny.py --workdir=/tmp/run --config.FIELD=VALUE

starts `--num_processes` processes of the binary (or of `--module`), each
with `--coordinator_address=localhost:PORT` (a free port) `--num_processes=N
--process_id=i` added to the other arguments, on the CPU (`JAX_PLATFORMS=cpu`
unless set; `--devices_per_process` fake CPU devices each, through
`XLA_FLAGS=--xla_force_host_platform_device_count`). They all get the same
`--workdir`, as the hosts of a cluster share one file system. It is the
local stand-in of a cluster launcher (SLURM, a TPU pod's workers), for tests
and for trying a multi-host config on one machine.

Process 0's output comes through; the others' goes to `--log_dir` (default: a
temporary directory, removed unless a process fails, whose log tail is then
shown). Returns 0 when every process succeeds; else process 0's exit status,
or that of the first process that failed. When one process fails the others
get `--grace` seconds to end on their own (they usually fail the same way),
then are killed: a multi-process job cannot go on without one of them.
SIGTERM / SIGINT to the launcher are passed on to every process (SIGTERM:
the job saves a checkpoint at a step they agree on and exits 143).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Optional, Sequence

DEVICE_FLAG = "--xla_force_host_platform_device_count"


def free_port() -> int:
  """A TCP port nobody listens on now (the OS's pick)."""
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def process_env(devices: Optional[int],
                base: Optional[dict] = None) -> dict[str, str]:
  """The environment of one process: CPU platform, `devices` fake devices."""
  env = dict(os.environ if base is None else base)
  env.setdefault("JAX_PLATFORMS", "cpu")
  if devices is not None:
    flags = re.sub(rf"{DEVICE_FLAG}=\S+", "", env.get("XLA_FLAGS", ""))
    env["XLA_FLAGS"] = f"{flags.strip()} {DEVICE_FLAG}={devices}".strip()
  return env


def commands(num_processes: int, args: Sequence[str], port: int,
             module: str = "vmoe_ext.main",
             python: str = sys.executable) -> list[list[str]]:
  """The command line of each process."""
  return [[python, "-m", module, *args,
           f"--coordinator_address=localhost:{port}",
           f"--num_processes={num_processes}", f"--process_id={i}"]
          for i in range(num_processes)]


def _tail(path: str, lines: int = 40) -> str:
  try:
    with open(path, encoding="utf-8", errors="replace") as f:
      return "".join(f.readlines()[-lines:])
  except OSError:
    return ""


def launch(num_processes: int, args: Sequence[str], *,
           devices_per_process: Optional[int] = None,
           module: str = "vmoe_ext.main", port: Optional[int] = None,
           log_dir: Optional[str] = None, grace: float = 30.0,
           timeout: Optional[float] = None) -> int:
  """Runs the job; returns its exit status (see the module docstring)."""
  if num_processes < 1:
    raise ValueError(f"--num_processes must be >= 1, got {num_processes}")
  port = free_port() if port is None else port
  keep_logs = log_dir is not None
  log_dir = log_dir or tempfile.mkdtemp(prefix="launch_local_")
  os.makedirs(log_dir, exist_ok=True)
  env = process_env(devices_per_process)
  procs, logs, files = [], [], []
  for i, cmd in enumerate(commands(num_processes, args, port, module)):
    if i == 0:
      out = None
    else:
      logs.append(os.path.join(log_dir, f"process_{i}.log"))
      out = open(logs[-1], "w", encoding="utf-8")
      files.append(out)
    procs.append(subprocess.Popen(cmd, env=env, stdout=out,
                                  stderr=None if out is None
                                  else subprocess.STDOUT))

  def forward(signum, _frame):
    for p in procs:
      if p.poll() is None:
        p.send_signal(signum)

  previous = {s: signal.signal(s, forward)
              for s in (signal.SIGTERM, signal.SIGINT)}
  start, failed_at, first_failure = time.time(), None, None
  killed: set[int] = set()
  try:
    while None in [p.poll() for p in procs]:  # Polls every one.
      now = time.time()
      for i, p in enumerate(procs):
        if p.returncode not in (None, 0) and first_failure is None:
          first_failure, failed_at = i, now
      too_late = timeout is not None and now - start > timeout
      if too_late or (failed_at is not None and now - failed_at > grace):
        if too_late and first_failure is None:
          print(f"launch_local: timed out after {timeout:g} s",
                file=sys.stderr)
        for i, p in enumerate(procs):
          if p.poll() is None:
            p.kill()
            killed.add(i)
        for p in procs:
          p.wait()
        break
      time.sleep(0.1)
  finally:
    for s, handler in previous.items():
      signal.signal(s, handler)
    for f in files:
      f.close()
  codes = [p.returncode for p in procs]
  failed = [i for i, c in enumerate(codes) if c and i not in killed]
  if not failed and not killed:
    if not keep_logs:
      shutil.rmtree(log_dir, ignore_errors=True)
    return 0
  for i in range(1, num_processes):
    if codes[i]:
      why = "was killed" if i in killed else f"exited with {codes[i]}"
      print(f"launch_local: process {i} {why}; the end of its log "
            f"({logs[i - 1]}):\n{_tail(logs[i - 1])}", file=sys.stderr)
  if not failed:  # Timed out.
    return 124
  if 0 in failed:
    status = codes[0]
  elif first_failure in failed:
    status = codes[first_failure]
  else:
    status = codes[failed[0]]
  return status if status > 0 else 128 - status  # -N: killed by signal N.


def parse_args(argv: Optional[Sequence[str]] = None
               ) -> tuple[argparse.Namespace, list[str]]:
  """The launcher's own flags, and the arguments for every process."""
  parser = argparse.ArgumentParser(
      allow_abbrev=False,
      description=__doc__.split("\n\n")[0],
      formatter_class=argparse.RawDescriptionHelpFormatter,
      epilog="Other arguments (after `--`, or unknown ones) go to every "
      "process.")
  parser.add_argument("--num_processes", type=int, default=2)
  parser.add_argument("--devices_per_process", type=int, default=None,
                      help="fake CPU devices per process (XLA_FLAGS)")
  parser.add_argument("--module", default="vmoe_ext.main",
                      help="the module each process runs (python -m)")
  parser.add_argument("--port", type=int, default=None,
                      help="coordinator port (default: a free one)")
  parser.add_argument("--log_dir", default=None,
                      help="where the logs of processes 1.. go (kept)")
  parser.add_argument("--grace", type=float, default=30.0,
                      help="seconds the others get after one process fails")
  parser.add_argument("--timeout", type=float, default=None,
                      help="kill the job after this many seconds")
  argv = list(sys.argv[1:] if argv is None else argv)
  after = []
  if "--" in argv:  # Everything after it is the job's, whatever it says.
    argv, after = argv[:argv.index("--")], argv[argv.index("--") + 1:]
  ours, rest = parser.parse_known_args(argv)
  return ours, rest + after


def main(argv: Optional[Sequence[str]] = None) -> int:
  ours, rest = parse_args(argv)
  return launch(ours.num_processes, rest,
                devices_per_process=ours.devices_per_process,
                module=ours.module, port=ours.port, log_dir=ours.log_dir,
                grace=ours.grace, timeout=ours.timeout)


if __name__ == "__main__":
  sys.exit(main())
