"""The run report: `WORKDIR/report.md` and PNG plots from `metrics.jsonl`."""

from __future__ import annotations

import json
import numbers
import os
from typing import Any, Mapping, Sequence

import numpy as np

from vmoe_ext.naming import block_index
from vmoe_ext.reporting import figures
from vmoe_ext.reporting.writers import write_plot_images


def listify(metrics: Mapping[str, Any]) -> dict[str, Any]:
  """Arrays to lists (vectors) or Python numbers (scalars), for reports."""
  return {k: (np.asarray(v).tolist() if np.ndim(v) else
              (np.asarray(v).item() if hasattr(v, "dtype") else v))
          for k, v in metrics.items()}


def config_value(value: Any) -> str:
  """A config value JSON cannot hold, as text: a dtype (`jnp.float32`,
  `np.dtype("bfloat16")`) by its name, `float32`; anything else `str`."""
  if isinstance(value, (type, np.dtype)):
    try:
      dtype = np.dtype(value)
    except TypeError:
      return str(value)
    if dtype.kind != "O":
      return dtype.name
  return str(value)


def _scalar_rows(metrics: Mapping[str, Any]) -> list[tuple[str, str]]:
  rows = []
  for key in sorted(metrics):
    value = metrics[key]
    if key in ("step", "split", "final"):
      continue
    if isinstance(value, (list, tuple)):
      rows.append((key, "[" + ", ".join(f"{v:.3f}" for v in value) + "]"))
    elif isinstance(value, numbers.Integral):
      rows.append((key, str(int(value))))
    elif isinstance(value, numbers.Real):
      rows.append((key, f"{float(value):.4f}"))
    else:
      rows.append((key, str(value)))
  return rows


def plot_curves(records: Sequence[Mapping[str, Any]], path: str) -> bool:
  """Losses and accuracies against step; False (no file) when the records
  have no training line (an evaluation-only or carve run).

  Left: the train loss (cross-entropy + auxiliary losses, solid), the train
  cross-entropy (dashed) and the test loss (the test split's cross-entropy,
  markers) when the test lines have it; middle (when the lines have the
  cross-entropy): the auxiliary part, train loss - cross-entropy, which is
  too small to tell the two curves apart on the left; right: accuracies.
  """
  train = [r for r in records if r.get("split") == "train" and "loss" in r]
  if not train:
    return False
  test = [r for r in records if r.get("split") == "test"]
  with_ce = [r for r in train if "cross_entropy" in r]
  fig, axes = figures.subplots(1, 3 if with_ce else 2,
                               figsize=(15 if with_ce else 10, 3.5))
  ax1, ax3 = axes[0], axes[-1]
  steps = [r["step"] for r in train]
  marker = "o" if len(train) < 3 else None  # A lone point shows too.
  ax1.plot(steps, [r["loss"] for r in train], lw=3, alpha=0.5, marker=marker,
           label="train loss (cross-entropy + auxiliary)")
  if with_ce:
    ax1.plot([r["step"] for r in with_ce],
             [r["cross_entropy"] for r in with_ce], "--", marker=marker,
             label="train cross-entropy")
    ax2 = axes[1]
    ax2.plot([r["step"] for r in with_ce],
             [r["loss"] - r["cross_entropy"] for r in with_ce], marker=marker)
    ax2.set(xlabel="step", ylabel="loss - cross-entropy",
            title="Train auxiliary loss (in the train loss)")
  test_loss = [r for r in test if "loss" in r]
  if test_loss:
    ax1.plot([r["step"] for r in test_loss], [r["loss"] for r in test_loss],
             "o-", label="test loss (cross-entropy)")
  ax1.set(xlabel="step", ylabel="loss", title="Loss")
  ax1.legend()
  ax3.plot(steps, [r["accuracy"] for r in train], marker=marker,
           label="train (batch)")
  test_acc = [r for r in test if "accuracy" in r]
  if test_acc:
    ax3.plot([r["step"] for r in test_acc], [r["accuracy"] for r in test_acc],
             "o-", label="test")
  ax3.set(xlabel="step", ylabel="accuracy", title="Accuracy", ylim=(0, 1))
  ax3.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  return True


def plot_expert_load(metrics: Mapping[str, Any], path: str) -> bool:
  """Bar chart of each MoE layer's per-expert load; False if no MoE layer."""
  loads = {k.split("/")[0]: np.asarray(v) for k, v in metrics.items()
           if k.endswith("/expert_load")}
  if not loads:
    return False
  layers = sorted(loads, key=block_index)  # `layer_i` keys, by block i.
  fig, axes = figures.subplots(1, len(layers), figsize=(4 * len(layers), 3.3),
                               squeeze=False)
  line = None
  for ax, layer in zip(axes[0], layers):
    load = loads[layer]
    ax.bar(np.arange(len(load)), 100 * load)
    line = ax.axhline(100 / len(load), color="k", ls="--", lw=1)
    ax.set(title=f"{layer} expert load", xlabel="expert",
           ylabel="% of selections", xticks=np.arange(len(load)))
  # One legend above the panels, where it covers no bar.
  fig.legend([line], ["balanced (100% / experts)"], loc="upper center",
             frameon=False, fontsize="small")
  fig.tight_layout(rect=(0, 0, 1, 0.92))
  fig.savefig(path, dpi=100)
  return True


def write_report(workdir: str, *, final_metrics: Mapping[str, Any],
                 records: Sequence[Mapping[str, Any]],
                 config_summary: Mapping[str, Any], wall_seconds: float,
                 extra_sections: Sequence[str] = (),
                 title: str = "Run report",
                 summary: Sequence[str] = ()) -> str:
  """Writes `report.md` and the PNG plots; returns the report text.

  `summary`: lines under the title (e.g. the checkpoint evaluated).

  Every PNG plot of the workdir (these and those the extra sections' stages
  wrote) also goes to TensorBoard as an image (`plots/<name>`) at the last
  step of `records`."""
  curves = os.path.join(workdir, "training_curves.png")
  has_curves = plot_curves(records, curves)
  if not has_curves and os.path.exists(curves):
    os.remove(curves)  # Left by an earlier run of this workdir's config.
  has_load = plot_expert_load(final_metrics,
                              os.path.join(workdir, "expert_load.png"))
  lines = [f"# {title}", "",
           f"Workdir: `{os.path.abspath(workdir)}`  ",
           f"Wall time: {wall_seconds:.1f} s" + ("  " if summary else ""),
           *[f"{line}  " for line in summary[:-1]], *summary[-1:], "",
           "## Final evaluation (test split)", "",
           "| metric | value |", "|---|---|"]
  lines += [f"| {k} | {v} |" for k, v in _scalar_rows(final_metrics)]
  lines += ["", "## Config", "", "```json",
            json.dumps(config_summary, indent=1, sort_keys=True,
                       default=config_value),
            "```", "", "## Plots", ""]
  if has_curves:
    lines.append("![training curves](training_curves.png)")
  if has_load:
    lines.append("![expert load](expert_load.png)")
  for section in extra_sections:
    lines += ["", section]
  text = "\n".join(lines) + "\n"
  with open(os.path.join(workdir, "report.md"), "w") as f:
    f.write(text)
  step = max((int(r["step"]) for r in records if "step" in r), default=0)
  write_plot_images(workdir, step)
  return text
