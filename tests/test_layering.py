"""Layering: dependencies run one way, read from every module's imports.

Every `import` / `from ... import` statement of every module of `vmoe_ext`
is read with `ast` (function-local ones too), so an upward import hidden in
a function body counts like one at the top. The documented order
(docs/architecture.md, "Layers") is `LAYERS` below: a package may import only
packages of lower layers (and itself). A handful of entry points are also
imported alone in fresh interpreters.
"""

from __future__ import annotations

import ast
import collections
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "vmoe_ext")

# Bottom to top; packages on one line are peers and never import each other.
LAYERS = (
    ("errors", "naming", "classification"),
    ("registry",),
    ("config",),
    ("moe", "interop", "data", "attacks"),
    ("routers", "streams", "sharding"),
    ("models", "reporting"),
    ("carving",),
    ("train",),
    ("evaluate",),
    ("app",),
    ("main",),
)
RANK = {name: i for i, layer in enumerate(LAYERS) for name in layer}
# Packages of algorithms (routing, dispatch, attacks, carving): what the
# training package runs, never what imports it (no exception).
ALGORITHMS = ("moe", "routers", "streams", "attacks", "carving")
ENTRY_POINTS = ("vmoe_ext.config", "vmoe_ext.moe", "vmoe_ext.models",
                "vmoe_ext.app.schema", "vmoe_ext.main")


def _module_name(path: str) -> str:
  parts = os.path.relpath(path, ROOT)[:-3].split(os.sep)
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _package(module: str) -> str:
  """`vmoe_ext.train.loop` -> "train"; the top-level `vmoe_ext.main` ->
  "main"; `vmoe_ext` itself -> ""."""
  parts = module.split(".")
  return parts[1] if len(parts) > 1 else ""


def _read_imports() -> dict[str, list[tuple[str, bool]]]:
  """module -> [(imported vmoe_ext module, inside a function)]."""
  out: dict[str, list[tuple[str, bool]]] = {}
  for folder, _, files in os.walk(PACKAGE):
    for name in files:
      if not name.endswith(".py"):
        continue
      path = os.path.join(folder, name)
      tree = ast.parse(open(path, encoding="utf-8").read(), path)
      local = set()
      for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
          local.update(id(n) for n in ast.walk(node)
                       if isinstance(n, (ast.Import, ast.ImportFrom)))
      found = []
      for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
          names = [node.module]
          # `from vmoe_ext.data import pp` imports the module data.pp.
          names += [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
          names = [a.name for a in node.names]
        else:
          continue
        for m in names:
          if m == "vmoe_ext" or m.startswith("vmoe_ext."):
            found.append((m, id(node) in local))
      out[_module_name(path)] = found
  return out


IMPORTS = _read_imports()


def test_every_package_has_a_layer():
  packages = {_package(m) for m in IMPORTS} - {""}
  assert packages <= set(RANK), sorted(packages - set(RANK))


def test_dependencies_run_one_way():
  offenders = []
  for module, imports in sorted(IMPORTS.items()):
    own = _package(module)
    if not own:
      continue
    for target, local in imports:
      other = _package(target)
      if other in ("", own):
        continue
      if RANK[other] >= RANK[own]:
        where = "inside a function" if local else "at module level"
        offenders.append(f"{module} imports {target} ({where}): layer "
                         f"{RANK[other]} {other!r} is not below layer "
                         f"{RANK[own]} {own!r}")
  assert not offenders, "\n".join(offenders)


def test_algorithm_packages_never_import_train():
  # Implied by LAYERS; checked on its own so that moving a package up the
  # table cannot let an algorithm reach into the training package.
  assert all(RANK[name] < RANK["train"] for name in ALGORITHMS)
  offenders = [f"{module} imports {target}"
               for module, imports in sorted(IMPORTS.items())
               if _package(module) in ALGORITHMS
               for target, _ in imports if _package(target) == "train"]
  assert not offenders, "\n".join(offenders)


def test_the_checkpoint_reader_reads_what_training_writes():
  # The reader moved below `train` (`interop.checkpoint_params`) names the
  # orbax item itself; it must be the one `train.checkpoints` writes, and
  # the old import path must give the same functions.
  from vmoe_ext.interop import checkpoint_params as reader
  from vmoe_ext.train import checkpoint_params as old_path
  from vmoe_ext.train import checkpoints
  assert reader.STATE == checkpoints.STATE == "state"
  for name in old_path.__all__:
    assert getattr(old_path, name) is getattr(reader, name), name


def test_no_package_level_cycle():
  # Implied by the layer order; checked on its own so that a wrong LAYERS
  # table cannot hide a cycle.
  graph = collections.defaultdict(set)
  for module, imports in IMPORTS.items():
    for target, _ in imports:
      a, b = _package(module), _package(target)
      if a and b and a != b:
        graph[a].add(b)
  state: dict[str, int] = {}

  def visit(node, path):
    state[node] = 1
    for nxt in sorted(graph[node]):
      if state.get(nxt) == 1:
        raise AssertionError("package cycle: " + " -> ".join(
            path[path.index(nxt):] + [nxt]))
      if nxt not in state:
        visit(nxt, path + [nxt])
    state[node] = 2

  for node in sorted(graph):
    if node not in state:
      visit(node, [node])


def test_no_module_level_cycle_at_import_time():
  # Module-scope imports only (a function-local import runs later); a
  # cycle here is an import that works or fails depending on import order.
  graph = {m: {t for t, local in imports if not local and t in IMPORTS
               and t != m}
           for m, imports in IMPORTS.items()}
  # A package's __init__ imports its modules; a module importing a sibling
  # through the package is no cycle of the module with itself.
  state: dict[str, int] = {}
  cycles = []

  def visit(node, path):
    state[node] = 1
    for nxt in sorted(graph.get(node, ())):
      if state.get(nxt) == 1 and not nxt.startswith(node + ".") and not (
          node.startswith(nxt + ".")):
        cycles.append(" -> ".join(path[path.index(nxt):] + [nxt]))
      elif nxt not in state:
        visit(nxt, path + [nxt])
    state[node] = 2

  for node in sorted(graph):
    if node not in state:
      visit(node, [node])
  assert not cycles, "\n".join(cycles)


def test_config_is_the_schema_language_only():
  for module, imports in IMPORTS.items():
    if _package(module) != "config":
      continue
    assert not [t for t, local in imports if local], module
    assert {_package(t) for t, _ in imports} <= {"config", "errors",
                                                 "registry"}, module


@pytest.mark.parametrize("module", ENTRY_POINTS)
def test_entry_point_imports_alone(module):
  proc = subprocess.run([sys.executable, "-c", f"import {module}"], cwd=ROOT,
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr.strip().splitlines()[-1:]


def test_the_table_matches_the_documentation():
  text = open(os.path.join(ROOT, "docs", "architecture.md"),
              encoding="utf-8").read()
  block = text.split("<!-- layers -->")[1].split("<!-- /layers -->")[0]
  documented = [tuple(line.split(". ", 1)[1].strip("`").split("`, `"))
                for line in block.splitlines() if line.startswith("1. ")]
  assert tuple(reversed(documented)) == LAYERS
