"""The notebooks in colab/ (so they cannot rot).

The quickstart runs top to bottom here; the other notebooks are executed in
CI by `python colab/execute.py` (a Jupyter kernel each, their small budgets),
so they do not lengthen the suite. Every notebook is checked to be valid
nbformat 4 with its outputs stripped, and every notebook but the quickstart
to read the small-budget switch that `colab/execute.py` sets.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import pathlib
import warnings

import matplotlib
import matplotlib.pyplot as plt
import nbformat
import numpy as np
import pytest

matplotlib.use("Agg")

COLAB = pathlib.Path(__file__).parent.parent / "colab"
NOTEBOOKS = sorted(COLAB.glob("*.ipynb"))
QUICKSTART = [p for p in NOTEBOOKS if p.name == "quickstart.ipynb"]
SMALL_SWITCH = "VMOE_EXT_NOTEBOOK_SMALL"


@pytest.mark.parametrize("path", QUICKSTART, ids=lambda p: p.name)
def test_notebook_runs(path):
  cells = json.loads(path.read_text())["cells"]
  namespace: dict = {}
  open_before = set(plt.get_fignums())
  try:
    for cell in cells:
      if cell["cell_type"] == "code":
        exec(compile("".join(cell["source"]), f"{path.name}", "exec"),
             namespace)
  finally:  # A notebook shows its figures inline; here nobody closes them.
    for number in set(plt.get_fignums()) - open_before:
      plt.close(number)
  if path.name == "quickstart.ipynb":
    # The routing it shows is the model's: selections cover B*T tokens x K.
    for sel in namespace["selected"].values():
      assert sel.shape == (100, 17, 2)
      assert np.all((np.asarray(sel) >= 0) & (np.asarray(sel) < 4))
    # It routes a trained model: 200 steps, well above chance (0.1) on the
    # 100 test digits.
    assert int(namespace["state"].step) == 200
    logits, labels = namespace["logits"], namespace["batch_labels"]
    assert np.mean(np.argmax(logits, -1) == labels) > 0.6


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
