"""Every notebook in colab/ runs top to bottom (so they cannot rot)."""

from __future__ import annotations

import json
import pathlib

import matplotlib
import numpy as np
import pytest

matplotlib.use("Agg")

NOTEBOOKS = sorted((pathlib.Path(__file__).parent.parent / "colab")
                   .glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs(path):
  cells = json.loads(path.read_text())["cells"]
  namespace: dict = {}
  for cell in cells:
    if cell["cell_type"] == "code":
      exec(compile("".join(cell["source"]), f"{path.name}", "exec"), namespace)
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
