"""Layering: every module imports on its own, and dependencies run one way.

Each import runs in a fresh interpreter, so an import cycle hidden by the
order in which other tests import the package shows up here.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "vmoe_ext")


def _modules() -> list[str]:
  names = []
  for folder, _, files in os.walk(PACKAGE):
    for name in files:
      if name.endswith(".py"):
        rel = os.path.relpath(os.path.join(folder, name), ROOT)[:-3]
        parts = rel.split(os.sep)
        if parts[-1] == "__init__":
          parts = parts[:-1]
        names.append(".".join(parts))
  return sorted(names)


def _imports(path: str) -> set[str]:
  """Every `vmoe_ext...` module a source file imports (at any depth)."""
  tree = ast.parse(open(path).read())
  found = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.ImportFrom) and node.module:
      found.add(node.module)
    elif isinstance(node, ast.Import):
      found.update(alias.name for alias in node.names)
  return {m for m in found if m.startswith("vmoe_ext")}


def test_every_module_imports_alone_in_a_fresh_interpreter():
  # A fresh `python -c "import M"` per module, four at a time.
  modules = _modules()
  script = "import importlib, sys; importlib.import_module(sys.argv[1])"
  failures = []
  for i in range(0, len(modules), 4):
    batch = {m: subprocess.Popen([sys.executable, "-c", script, m], cwd=ROOT,
                                 stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True)
             for m in modules[i:i + 4]}
    for m, proc in batch.items():
      _, err = proc.communicate(timeout=300)
      if proc.returncode:
        failures.append(f"{m}: {err.strip().splitlines()[-1]}")
  assert not failures, "\n".join(failures)


@pytest.mark.parametrize("lower,upper", [
    ("vmoe_ext/moe", "vmoe_ext.routers"),
    ("vmoe_ext/moe", "vmoe_ext.models"),
    ("vmoe_ext/routers", "vmoe_ext.models"),
    ("vmoe_ext/streams", "vmoe_ext.models"),
    ("vmoe_ext/train", "vmoe_ext.evaluate"),
    ("vmoe_ext/reporting", "vmoe_ext.train"),
    ("vmoe_ext/reporting", "vmoe_ext.evaluate"),
    # Foreign checkpoint readers and layouts know nothing of the model,
    # training or evaluation code that uses them.
    ("vmoe_ext/interop", "vmoe_ext.models"),
    ("vmoe_ext/interop", "vmoe_ext.train"),
    ("vmoe_ext/interop", "vmoe_ext.evaluate"),
    # The mesh and partition rules know the MoE layer's layout, not the
    # models, training or evaluation that use them; the MoE core knows no
    # mesh configs.
    ("vmoe_ext/sharding", "vmoe_ext.models"),
    ("vmoe_ext/sharding", "vmoe_ext.train"),
    ("vmoe_ext/sharding", "vmoe_ext.evaluate"),
    ("vmoe_ext/moe", "vmoe_ext.sharding"),
])
def test_dependencies_run_one_way(lower, upper):
  offenders = []
  for folder, _, files in os.walk(os.path.join(ROOT, lower)):
    for name in files:
      if name.endswith(".py"):
        path = os.path.join(folder, name)
        bad = sorted(m for m in _imports(path)
                     if m == upper or m.startswith(upper + "."))
        if bad:
          offenders.append(f"{os.path.relpath(path, ROOT)} imports {bad}")
  assert not offenders, "\n".join(offenders)
