"""The report section of AutoAttack and APGD evaluations: robust accuracy
after each attack of the ensemble, the gap to PGD at the same eps, the
gradient-masking check and APGD's loss trajectories (a PNG).

Reads the metrics `attack_metrics` returns (the attacks' diagnostics,
`vmoe_ext.attacks.registry` `details`); writes nothing but the plot.
"""

from __future__ import annotations

import os
from typing import Any, Mapping, Sequence

import numpy as np

from vmoe_ext.reporting import figures
from vmoe_ext.reporting.report_parts import markdown_table

ROBUST_AFTER = "robust_after/"
APGD_LOSS = "apgd_loss/"
PLOT = "autoattack_apgd_loss.png"


def _same_threat(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
  return (a.get("eps") == b.get("eps")
          and a.get("norm", "linf") == b.get("norm", "linf"))


def _plot(curves: dict[str, np.ndarray], path: str) -> None:
  fig, ax = figures.subplots(figsize=(6, 3.5))
  for label, curve in curves.items():
    ax.plot(np.arange(len(curve)), curve, label=label)
  ax.set(xlabel="iteration", ylabel="best loss (mean over attacked points)",
         title="APGD loss trajectories")
  ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=100)


def autoattack_section(results: Sequence[tuple[Mapping[str, Any],
                                               Mapping[str, Any], int]],
                       workdir: str) -> list[str]:
  """Markdown sections for the AutoAttack / APGD entries of `results`
  (`(attack config, metrics, num_examples)` per configured attack); [] when
  there are none."""
  sections, curves = [], {}
  for i, (config, m, n) in enumerate(results):
    label = f"{config['name']}[{i}] eps={config.get('eps')}"
    for key, value in m.items():
      if key.startswith(APGD_LOSS):
        curves[f"{label} {key[len(APGD_LOSS):]}"] = np.asarray(value)
    stages = [k[len(ROBUST_AFTER):] for k in m if k.startswith(ROBUST_AFTER)]
    if not stages:
      continue
    rows = [["clean", m["clean_accuracy"]]]
    rows += [[f"after {s}", m[ROBUST_AFTER + s]] for s in stages]
    robust = m[ROBUST_AFTER + stages[-1]]
    text = [f"### AutoAttack, {config.get('version', 'standard')} version, "
            f"{config.get('norm', 'linf')} eps={config.get('eps')} "
            f"({n} test images)\n",
            markdown_table(["attacks run", "robust accuracy"], rows), ""]
    for j, (other, om, on) in enumerate(results):
      if other["name"] == "pgd" and _same_threat(other, config) and on == n:
        gap = om["accuracy"] - robust
        verdict = ("PGD overestimated robust accuracy by "
                   f"{100 * gap:.1f} points" if gap > 0 else
                   "PGD did not overestimate it")
        text.append(f"- PGD-{other.get('steps')} (attack {j}) at the same "
                    f"threat: accuracy {om['accuracy']:.4f} vs "
                    f"{robust:.4f} under AutoAttack: {verdict}.")
    if "square_only" in m:
      rate = m["square_only"]
      text.append(
          f"- Gradient-masking check: Square (black-box) broke "
          f"{100 * rate:.1f}% of the images that every white-box attack "
          "failed on" + (": **the gradients of this model mislead "
                         "white-box attacks here**." if rate > 0 else
                         ": no sign of gradient masking."))
    sections.append("\n".join(text))
  if curves:
    _plot(curves, os.path.join(workdir, PLOT))
    sections.append(f"![APGD loss trajectories]({PLOT})")
  if not sections:
    return []
  return ["## AutoAttack and APGD\n\nRobust accuracy = correct at the clean "
          "image and under every attack run so far (each attack runs on the "
          "points still robust; deterministic evaluation in the attack's "
          "batches).\n\n" + "\n\n".join(sections)]


__all__ = ["autoattack_section"]
