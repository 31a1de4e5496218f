"""PNG figures of the routing analysis (`routing_analysis`).

  * `plot_expert_maps`: images next to their patch grids coloured by top-1
    expert, one row per MoE layer (ACMoE Fig. 1).
  * `plot_tsne`: t-SNE of MoE-input tokens coloured by top-1 expert, one
    panel per MoE layer (ACMoE Fig. 4).
  * `plot_router_state_heatmaps`: a router's `[E, E]` state matrix (Symphony's
    expert co-selection graph `adjacency`) per MoE layer at a few logged
    training steps, read from the `metrics.jsonl` records.
"""

from __future__ import annotations

import re
from typing import Any, Mapping, Sequence

import numpy as np

from vmoe_ext.naming import METRIC_PATTERN, block_index
from vmoe_ext.reporting import figures

NO_EXPERT = (1.0, 1.0, 1.0, 0.0)  # Tokens without an expert: blank.


def expert_colors(num_experts: int) -> np.ndarray:
  """`[E, 4]` RGBA, one distinct colour per expert (tab10 / tab20 / hsv)."""
  from matplotlib import colormaps
  if num_experts <= 10:
    return colormaps["tab10"](np.arange(num_experts))
  if num_experts <= 20:
    return colormaps["tab20"](np.arange(num_experts))
  return colormaps["hsv"](np.arange(num_experts) / num_experts)


def _colour(experts: np.ndarray, colors: np.ndarray) -> np.ndarray:
  """int array (-1: none) -> RGBA array of shape `experts.shape + (4,)`."""
  table = np.concatenate([colors, [NO_EXPERT]])
  return table[np.where(experts < 0, len(colors), experts)]


def _legend(fig, num_experts: int, colors: np.ndarray, **kw) -> None:
  from matplotlib.patches import Patch
  handles = [Patch(color=colors[e], label=f"expert {e}")
             for e in range(num_experts)]
  fig.legend(handles=handles, ncol=min(num_experts, 8), frameon=False,
             fontsize="small", **kw)


def plot_expert_maps(images: np.ndarray, maps: Mapping[str, np.ndarray],
                     num_experts: Mapping[str, int], path: str) -> bool:
  """Top row: the images `[n, H, W, C]` in [0, 1]; below, one row per MoE
  layer, each image in grey under its patch grid `maps[layer]`
  `[n, gh, gw]` coloured by top-1 expert (blank: no expert). False (and no
  file) when there is nothing to draw."""
  layers = sorted(maps, key=block_index)
  n = len(images)
  if not layers or n == 0:
    return False
  colors = expert_colors(max(num_experts[l] for l in layers))
  gray = images.mean(axis=-1)
  fig, axes = figures.subplots(
      1 + len(layers), n, squeeze=False,
      figsize=(1.3 * n + 1.0, 1.3 * (1 + len(layers)) + 0.6))
  for i in range(n):
    image = images[i]
    axes[0, i].imshow(image[..., 0] if image.shape[-1] == 1 else image,
                      cmap="gray", vmin=0, vmax=1, interpolation="nearest")
    for row, layer in enumerate(layers, start=1):
      ax = axes[row, i]
      ax.imshow(gray[i], cmap="gray", vmin=0, vmax=1,
                interpolation="nearest")
      ax.imshow(_colour(maps[layer][i], colors), alpha=0.6,
                interpolation="nearest",
                extent=(-0.5, image.shape[1] - 0.5, image.shape[0] - 0.5,
                        -0.5))
  for row, name in enumerate(["image"] + layers):
    axes[row, 0].set_ylabel(name, fontsize="small")
  for ax in axes.ravel():
    ax.set_xticks([])
    ax.set_yticks([])
  fig.suptitle("Top-1 expert of each patch (blank: no expert)",
               fontsize="medium")
  _save_with_legend(fig, colors, path)
  return True


def _save_with_legend(fig, colors, path: str) -> None:
  """The expert-colour legend under the panels, then the PNG."""
  _legend(fig, len(colors), colors, loc="lower center")
  fig.tight_layout(rect=(0, 0.07, 1, 1))
  fig.savefig(path, dpi=100)


def plot_tsne(embeddings: Mapping[str, np.ndarray],
              experts: Mapping[str, np.ndarray],
              num_experts: Mapping[str, int], path: str) -> bool:
  """One scatter panel per MoE layer: 2-D t-SNE points `[m, 2]` coloured by
  top-1 expert `[m]` (grey: none). False (no file) without any panel."""
  layers = sorted(embeddings, key=block_index)
  if not layers:
    return False
  colors = expert_colors(max(num_experts[l] for l in layers))
  fig, axes = figures.subplots(1, len(layers), squeeze=False,
                             figsize=(4 * len(layers), 4.4))
  for ax, layer in zip(axes[0], layers):
    points, e = embeddings[layer], experts[layer]
    none = e < 0
    if none.any():
      ax.scatter(*points[none].T, s=5, c="lightgray", label="no expert")
    ax.scatter(*points[~none].T, s=5, c=colors[e[~none]])
    ax.set(title=f"{layer}: {len(points)} MoE-input tokens", xticks=[],
           yticks=[])
  fig.suptitle("t-SNE of MoE inputs, coloured by top-1 expert",
               fontsize="medium")
  _save_with_legend(fig, colors, path)
  return True


# `layer_i/router_state/[PATH/]LEAF`: group 1 the block's metric key.
STATE_KEY = re.compile(rf"^({METRIC_PATTERN})/router_state/(?:(.+)/)?(\w+)$")


def router_state_series(records: Sequence[Mapping[str, Any]],
                        leaf: str = "adjacency"
                        ) -> dict[str, dict[int, np.ndarray]]:
  """`{metric key: {step: [E, E] array}}` for every 2-D router-state leaf
  named `leaf` in the records (`layer_i/router_state/.../adjacency`, written
  by the training loop at log steps); the last record of a step wins."""
  series: dict[str, dict[int, np.ndarray]] = {}
  for record in records:
    for key, value in record.items():
      match = STATE_KEY.match(key)
      if match and match.group(3) == leaf and isinstance(value, list):
        array = np.asarray(value, np.float64)
        if array.ndim == 2:
          series.setdefault(key, {})[int(record["step"])] = array
  return series


def plot_router_state_heatmaps(records: Sequence[Mapping[str, Any]],
                               path: str, leaf: str = "adjacency",
                               max_steps: int = 5) -> bool:
  """Heatmaps of a router-state matrix over training: one row per MoE layer
  holding `leaf`, columns = up to `max_steps` logged steps evenly spaced from
  the first to the last, one shared colour scale. False (no file) when no
  record has such a leaf."""
  series = router_state_series(records, leaf)
  if not series:
    return False
  keys = sorted(series,
                key=lambda k: (block_index(STATE_KEY.match(k).group(1)), k))
  steps = sorted({s for v in series.values() for s in v})
  picks = np.unique(np.linspace(0, len(steps) - 1, min(max_steps, len(steps)))
                    .round().astype(int))
  steps = [steps[i] for i in picks]
  values = [a for v in series.values() for a in v.values()]
  vmin = min(0.0, min(float(a.min()) for a in values))
  vmax = max(max(float(a.max()) for a in values), vmin + 1e-12)
  # At least 4.8 inches wide: the title and the colour bar's labels fit
  # even with one logged step (one column).
  fig, axes = figures.subplots(len(keys), len(steps), squeeze=False,
                               figsize=(max(2.4 * len(steps) + 1.6, 4.8),
                                        2.3 * len(keys) + 1.0),
                               layout="constrained")
  image = None
  for row, key in enumerate(keys):
    match = STATE_KEY.match(key)
    name = match.group(1) + (f" {match.group(2)}" if match.group(2) else "")
    size = len(next(iter(series[key].values())))
    ticks = np.arange(size) if size <= 16 else []
    for col, step in enumerate(steps):
      ax = axes[row, col]
      ax.set_xticks(ticks)
      ax.set_yticks(ticks)
      ax.tick_params(labelsize="x-small", length=0)
      if step in series[key]:
        image = ax.imshow(series[key][step], cmap="viridis", vmin=vmin,
                          vmax=vmax, interpolation="nearest")
      if row == 0:
        ax.set_title(f"step {step}", fontsize="small")
      if col == 0:
        ax.set_ylabel(name, fontsize="small")
  fig.suptitle(f"Router state '{leaf}' [E, E] over training\n(row: from "
               "expert, column: to expert)", fontsize="medium")
  if image is not None:
    fig.colorbar(image, ax=axes.ravel().tolist(), shrink=0.8)
  fig.savefig(path, dpi=100)
  return True
