"""The library's figures leave pyplot alone: every plot writer, called in a
process whose matplotlib backend is not Agg (a notebook's inline backend,
here the file backend `pdf`), writes its PNG without switching the backend
or opening a pyplot figure."""

from __future__ import annotations

import matplotlib
import matplotlib.pyplot as plt
import numpy as np
import pytest

from vmoe_ext.evaluate import autoattack_report, robustness, routing_plots
from vmoe_ext.reporting import report, report_parts

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def pdf_backend():
  before = matplotlib.get_backend()
  plt.switch_backend("pdf")
  yield
  plt.switch_backend(before)


def _writers(tmp_path):
  images = np.linspace(0, 1, 2 * 4 * 4).reshape(2, 4, 4, 1)
  maps = {"layer_1": np.array([[[0, 1], [1, -1]], [[1, 1], [0, 0]]])}
  state = [{"step": s, "split": "train",
            "layer_1/router_state/base/adjacency": (np.eye(2) * s).tolist()}
           for s in (10, 20)]
  train = [{"step": s, "split": "train", "loss": 1.0 / s,
            "cross_entropy": 1.0 / s, "accuracy": 0.5} for s in (1, 2)]
  return {
      "curves": lambda p: report.plot_curves(train, p),
      "load": lambda p: report.plot_expert_load(
          {"layer_1/expert_load": [0.25, 0.75]}, p),
      "bars": lambda p: report_parts.bar_chart({"a": 1.0, "b": 2.0}, p,
                                               ylabel="y", title="t"),
      # pylint: disable=protected-access
      "apgd": lambda p: autoattack_report._plot(
          {"apgd-ce": np.array([1.0, 0.5])}, p),
      "sweep": lambda p: robustness._plot_sweep(
          [0.0, 0.1], [0.9, 0.1], {"layer_1": [0.0, 0.3]}, "PGD", p),
      # pylint: enable=protected-access
      "maps": lambda p: routing_plots.plot_expert_maps(
          images, maps, {"layer_1": 2}, p),
      "tsne": lambda p: routing_plots.plot_tsne(
          {"layer_1": np.array([[0.0, 1.0], [1.0, 0.0]])},
          {"layer_1": np.array([0, 1])}, {"layer_1": 2}, p),
      "state": lambda p: routing_plots.plot_router_state_heatmaps(state, p),
  }


def test_every_plot_writer_leaves_the_backend_and_no_figure(tmp_path,
                                                            pdf_backend):
  del pdf_backend
  open_before = plt.get_fignums()  # Another test in this worker may leave one.
  for name, write in _writers(tmp_path).items():
    path = str(tmp_path / f"{name}.png")
    write(path)
    with open(path, "rb") as f:
      assert f.read(8) == PNG, name
    assert matplotlib.get_backend() == "pdf", name
    assert plt.get_fignums() == open_before, name
