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


@pytest.fixture
def drawn(monkeypatch):
  """The figures the plot writers make, drawn again after they are saved:
  `[(figure, renderer)]`."""
  from matplotlib.backends.backend_agg import FigureCanvasAgg
  from vmoe_ext.reporting import figures
  made = []
  original = figures.subplots

  def spy(*args, **kwargs):
    fig, axes = original(*args, **kwargs)
    made.append(fig)
    return fig, axes

  monkeypatch.setattr(figures, "subplots", spy)

  def render():
    out = []
    for fig in made:
      canvas = FigureCanvasAgg(fig)
      canvas.draw()
      out.append((fig, canvas.get_renderer()))
    made.clear()
    return out

  return render


def _texts_outside(fig, renderer) -> list[str]:
  """The drawn texts (titles, labels, tick labels, colour-bar labels) that
  leave the figure, by more than a pixel: none where the whole drawing's
  tight box lies inside the figure, else the texts that stick out."""
  from matplotlib.text import Text
  tight = fig.get_tightbbox(renderer).transformed(fig.dpi_scale_trans)
  box = fig.bbox
  if (tight.x0 >= box.x0 - 1 and tight.y0 >= box.y0 - 1
      and tight.x1 <= box.x1 + 1 and tight.y1 <= box.y1 + 1):
    return []
  out = []
  for text in fig.findobj(Text):
    if not text.get_visible() or not text.get_text().strip():
      continue
    e = text.get_window_extent(renderer)
    if (e.x0 < box.x0 - 1 or e.y0 < box.y0 - 1 or e.x1 > box.x1 + 1
        or e.y1 > box.y1 + 1):
      out.append(text.get_text())
  return out or ["(an artist)"]


@pytest.mark.parametrize("steps", [(10,), (10, 20, 30)])
def test_adjacency_heatmap_title_and_colour_bar_fit(tmp_path, drawn, steps):
  records = [{"step": s, "split": "train",
              "layer_1/router_state/base/adjacency": (np.eye(4) * s).tolist(),
              "layer_3/router_state/base/adjacency": (np.eye(4) * s).tolist()}
             for s in steps]
  assert routing_plots.plot_router_state_heatmaps(records,
                                                  str(tmp_path / "a.png"))
  ((fig, renderer),) = drawn()
  assert _texts_outside(fig, renderer) == []
  # The colour bar's tick labels are among the texts checked.
  assert len(fig.axes) == 2 * len(steps) + 1


def test_expert_load_legend_covers_no_bar(tmp_path, drawn):
  metrics = {"layer_1/expert_load": [0.1, 0.6, 0.2, 0.1],
             "layer_3/expert_load": [0.97, 0.01, 0.01, 0.01]}
  assert report.plot_expert_load(metrics, str(tmp_path / "l.png"))
  ((fig, renderer),) = drawn()
  (legend,) = fig.legends
  box = legend.get_window_extent(renderer)
  bars = [p for ax in fig.axes for p in ax.patches]
  assert len(bars) == 8
  for bar in bars:
    assert not box.overlaps(bar.get_window_extent(renderer))
  assert _texts_outside(fig, renderer) == []


def test_training_curves_show_both_losses_and_the_test_loss(tmp_path, drawn):
  train = [{"step": s, "split": "train", "loss": 2.0 / s + 0.01,
            "cross_entropy": 2.0 / s, "accuracy": 0.5} for s in (1, 2, 3)]
  test = [{"step": 3, "split": "test", "loss": 0.8, "accuracy": 0.6}]
  assert report.plot_curves(train + test, str(tmp_path / "c.png"))
  ((fig, renderer),) = drawn()
  loss_ax, aux_ax, acc_ax = fig.axes
  lines = {l.get_label(): l for l in loss_ax.get_lines()}
  assert set(lines) == {"train loss (cross-entropy + auxiliary)",
                        "train cross-entropy", "test loss (cross-entropy)"}
  # Distinct styles: the total is not drawn as the cross-entropy is.
  assert (lines["train cross-entropy"].get_linestyle()
          != lines["train loss (cross-entropy + auxiliary)"].get_linestyle())
  np.testing.assert_allclose(lines["test loss (cross-entropy)"].get_ydata(),
                             [0.8])
  (aux,) = aux_ax.get_lines()
  np.testing.assert_allclose(aux.get_ydata(), [0.01] * 3, atol=1e-12)
  assert [l.get_label() for l in acc_ax.get_lines()] == ["train (batch)",
                                                         "test"]
  assert _texts_outside(fig, renderer) == []
  # Without the test loss (older records): no such curve.
  report.plot_curves(train + [{"step": 3, "split": "test", "accuracy": 0.6}],
                     str(tmp_path / "d.png"))
  ((fig, _),) = drawn()
  assert "test loss (cross-entropy)" not in [
      l.get_label() for l in fig.axes[0].get_lines()]
