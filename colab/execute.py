"""Executes the notebooks of colab/ top to bottom, as CI does.

    python colab/execute.py                          # every colab/*.ipynb
    python colab/execute.py colab/routing.ipynb      # some of them
    python colab/execute.py --full                   # their default budgets

Each notebook runs in a fresh Python kernel of this interpreter (the
`python3` kernel ipykernel provides for `sys.executable`, whatever
kernelspecs the machine has installed), in a temporary working directory
that is also its TMPDIR (removed afterwards, with the runs the notebook
wrote), with `VMOE_EXT_NOTEBOOK_SMALL=1` in its environment: the notebooks read it in
their first code cell and shrink their budgets (training steps, test images,
eps values) to a smoke run. The notebook files are never written. Prints each
notebook's wall time; exits 1 if a cell of any notebook fails (its traceback
is printed), 0 otherwise.

In the small mode the kernels also share a temporary persistent XLA
compilation cache and compile at LLVM optimisation level 0 with the CPU
backend's elemental emitters (as the test suite does, `tests/conftest.py`):
compiling is most of a smoke run's time. `--full` keeps XLA's defaults and
the notebooks' default budgets (a few minutes each on a 2-core CPU).
"""

from __future__ import annotations

import argparse
import datetime
import os
import pathlib
import shutil
import sys
import tempfile
import time
from typing import Optional, Sequence

import nbformat
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import KernelManager
from nbclient import NotebookClient
from nbclient.exceptions import (CellExecutionError, CellTimeoutError,
                                 DeadKernelError)

COLAB = pathlib.Path(__file__).resolve().parent
SMALL_SWITCH = "VMOE_EXT_NOTEBOOK_SMALL"
FAST_COMPILE = ("--xla_backend_optimization_level=0",
                "--xla_llvm_disable_expensive_passes=true",
                "--xla_cpu_use_fusion_emitters=false")


def kernel_manager() -> KernelManager:
  """A manager of the `python3` kernel run by this interpreter.

  The spec manager searches no kernel directory, so a `python3` kernelspec
  installed elsewhere (another environment's, a user's) cannot be picked:
  jupyter_client falls back to ipykernel's own spec, whose command is
  `sys.executable -m ipykernel_launcher`. Works in a fresh virtual
  environment where nothing was registered with `ipykernel install`.
  """
  specs = KernelSpecManager(kernel_dirs=[], ensure_native_kernel=True)
  return KernelManager(kernel_name="python3", kernel_spec_manager=specs)


def cell_seconds(cell: nbformat.NotebookNode) -> Optional[float]:
  """Wall time of an executed code cell (nbclient's timing metadata)."""
  timing = cell.get("metadata", {}).get("execution", {})
  try:
    start = datetime.datetime.fromisoformat(
        timing["iopub.execute_input"].replace("Z", "+00:00"))
    end = datetime.datetime.fromisoformat(
        timing["shell.execute_reply"].replace("Z", "+00:00"))
  except (KeyError, ValueError):
    return None
  return (end - start).total_seconds()


def execute(path: pathlib.Path, cell_timeout: int,
            output_dir: Optional[pathlib.Path] = None,
            verbose: bool = False) -> Optional[str]:
  """Runs one notebook in a temporary directory; None, or the error.
  `output_dir`: where the executed copy goes (never over the source)."""
  notebook = nbformat.read(path, as_version=4)
  workdir = tempfile.mkdtemp(prefix=f"vmoe_ext_{path.stem}_")
  client = NotebookClient(
      notebook, km=kernel_manager(), timeout=cell_timeout,
      resources={"metadata": {"path": workdir}})
  # The kernel's temporary files (the notebooks' tempfile.mkdtemp() run
  # directories) go into the working directory, removed afterwards.
  tmpdir = os.environ.get("TMPDIR")
  os.environ["TMPDIR"] = workdir
  try:
    client.execute()
  except (CellExecutionError, CellTimeoutError) as e:
    return str(e)
  except (DeadKernelError, RuntimeError) as e:  # The kernel died or never
    return f"{type(e).__name__}: {e}"            # started.
  finally:
    if tmpdir is None:
      os.environ.pop("TMPDIR", None)
    else:
      os.environ["TMPDIR"] = tmpdir
    shutil.rmtree(workdir, ignore_errors=True)
    if output_dir is not None:
      output_dir.mkdir(parents=True, exist_ok=True)
      nbformat.write(notebook, output_dir / path.name)
    if verbose:
      for i, cell in enumerate(notebook.cells):
        seconds = cell_seconds(cell) if cell.cell_type == "code" else None
        if seconds is not None:
          print(f"  cell {i}: {seconds:.1f} s", flush=True)
  return None


def main(argv: Optional[Sequence[str]] = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("notebooks", nargs="*", type=pathlib.Path,
                      help="notebooks to run (default: every colab/*.ipynb)")
  parser.add_argument("--full", action="store_true",
                      help="the notebooks' default budgets and XLA's default "
                      "compilation (no small switch)")
  parser.add_argument("--cell-timeout", type=int, default=600,
                      help="seconds one cell may run (default 600)")
  parser.add_argument("--output-dir", type=pathlib.Path, default=None,
                      help="write the executed notebooks (with outputs) "
                      "there; default: nowhere")
  parser.add_argument("--xla-defaults", action="store_true",
                      help="small budgets, but XLA's default compilation "
                      "(not the fast-compiling flags)")
  parser.add_argument("-v", "--verbose", action="store_true",
                      help="print each code cell's wall time")
  args = parser.parse_args(argv)
  notebooks = args.notebooks or sorted(COLAB.glob("*.ipynb"))
  missing = [str(p) for p in notebooks if not p.is_file()]
  if missing:
    parser.error(f"no such notebook: {', '.join(missing)}")
  if args.output_dir is not None and (
      args.output_dir.resolve() in {p.resolve().parent for p in notebooks}):
    parser.error("--output-dir must not be the notebooks' own directory")

  # The kernels inherit this process's environment.
  cache = None
  if args.full:
    os.environ.pop(SMALL_SWITCH, None)
  else:
    os.environ[SMALL_SWITCH] = "1"
    if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
      cache = tempfile.mkdtemp(prefix="vmoe_ext_notebook_jax_cache_")
      os.environ["JAX_COMPILATION_CACHE_DIR"] = cache
    if not args.xla_defaults:
      flags = os.environ.get("XLA_FLAGS", "")
      os.environ["XLA_FLAGS"] = " ".join(
          [flags] + [f for f in FAST_COMPILE if f not in flags]).strip()
  mode = "full budgets" if args.full else f"{SMALL_SWITCH}=1"
  failures = []
  start = time.time()
  try:
    for path in notebooks:
      t0 = time.time()
      error = execute(path, args.cell_timeout, args.output_dir,
                      args.verbose)
      status = "ok" if error is None else "FAILED"
      print(f"{path.name}: {status} in {time.time() - t0:.1f} s ({mode})",
            flush=True)
      if error is not None:
        failures.append(path.name)
        print(error, file=sys.stderr, flush=True)
  finally:
    if cache is not None:
      shutil.rmtree(cache, ignore_errors=True)
  print(f"{len(notebooks) - len(failures)} of {len(notebooks)} notebooks ran "
        f"in {time.time() - start:.1f} s"
        + (f"; failed: {', '.join(failures)}" if failures else ""))
  return 1 if failures else 0


if __name__ == "__main__":
  sys.exit(main())
