"""The notebooks in colab/ (so they cannot rot).

Every notebook, the quickstart too, is executed in CI by `python
colab/execute.py` (a Jupyter kernel each, their small budgets), so it does
not lengthen the suite; the quickstart's last cell asserts what it shows
(checked here to be there). Every notebook is checked to be valid nbformat
4 with its outputs stripped, and every notebook but the quickstart to read
the small-budget switch that `colab/execute.py` sets.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import pathlib
import warnings

import nbformat
import pytest

COLAB = pathlib.Path(__file__).parent.parent / "colab"
NOTEBOOKS = sorted(COLAB.glob("*.ipynb"))
QUICKSTART = [p for p in NOTEBOOKS if p.name == "quickstart.ipynb"]
SMALL_SWITCH = "VMOE_EXT_NOTEBOOK_SMALL"


def test_the_quickstart_checks_what_it_shows():
  """Its last code cell asserts the routing's shape, the 200 steps and an
  accuracy well above chance, so CI's run of it fails when they do not."""
  cells = json.loads(QUICKSTART[0].read_text())["cells"]
  last = "".join([c for c in cells if c["cell_type"] == "code"][-1]["source"])
  asserts = [node for node in ast.walk(ast.parse(last))
             if isinstance(node, ast.Assert)]
  checked = " ".join(ast.unparse(node.test) for node in asserts)
  for expected in ("int(state.step) == 200", "sel.shape == (100, 17, 2)",
                   "> 0.6"):
    assert expected in checked, (expected, checked)


def test_there_is_a_notebook():
  assert NOTEBOOKS
  assert QUICKSTART


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_is_valid_and_stripped(path):
  raw = json.loads(path.read_text())
  assert raw["nbformat"] == 4
  with warnings.catch_warnings():
    # A cell without an id is only a warning in nbformat 5 (an error later).
    warnings.simplefilter("error")
    nbformat.validate(nbformat.from_dict(raw))
  code = [c for c in raw["cells"] if c["cell_type"] == "code"]
  assert code
  for i, cell in enumerate(code):
    assert cell["outputs"] == [], f"code cell {i} has outputs"
    assert cell["execution_count"] is None, f"code cell {i} was executed"
    assert "execution" not in cell["metadata"], f"code cell {i} timing"


def _first_code_cell(path: pathlib.Path) -> ast.Module:
  """The first code cell, IPython magics (`%...`) left out, parsed."""
  cells = json.loads(path.read_text())["cells"]
  source = "".join(next(c for c in cells
                        if c["cell_type"] == "code")["source"])
  return ast.parse("\n".join(line for line in source.splitlines()
                             if not line.lstrip().startswith("%")))


@pytest.mark.parametrize("path", [p for p in NOTEBOOKS
                                  if p not in QUICKSTART],
                         ids=lambda p: p.name)
def test_notebook_reads_the_small_switch(path):
  # The first code cell sets SMALL = os.environ.get(SMALL_SWITCH) == "1"
  # and budgets from it (X = ... if SMALL else ...).
  assigns = [node for node in ast.walk(_first_code_cell(path))
             if isinstance(node, ast.Assign)]
  small = [node for node in assigns
           if any(isinstance(t, ast.Name) and t.id == "SMALL"
                  for t in node.targets)]
  assert small, f"{path.name}: the first code cell does not set SMALL"
  constants = {n.value for n in ast.walk(small[0].value)
               if isinstance(n, ast.Constant)}
  assert SMALL_SWITCH in constants and "1" in constants, ast.unparse(small[0])
  budgets = [node for node in assigns if node not in small and any(
      isinstance(n, ast.Name) and n.id == "SMALL"
      for n in ast.walk(node.value))]
  assert budgets, f"{path.name}: no budget of the first cell depends on SMALL"


def test_execute_sets_the_small_switch():
  spec = importlib.util.spec_from_file_location("colab_execute",
                                                COLAB / "execute.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  assert module.SMALL_SWITCH == SMALL_SWITCH
