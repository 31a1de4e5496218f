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

from vmoe_ext.attacks.autoattack import WHITE_BOX, stages_of
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


def stage_order(config: Mapping[str, Any], m: Mapping[str, Any]
                ) -> list[str]:
  """The attacks of an AutoAttack entry that ran, in the order they ran."""
  ran = [k[len(ROBUST_AFTER):] for k in m if k.startswith(ROBUST_AFTER)]
  try:
    order = stages_of(config.get("version", "standard"),
                      config.get("attacks"))
  except KeyError:  # An unknown version: the metrics' order.
    return ran
  return [s for s in order if s in ran] + [s for s in ran if s not in order]


def robust_before(m: Mapping[str, Any], stages: Sequence[str]
                  ) -> dict[str, float]:
  """`{attack: fraction of the images still robust when it started}`: the
  clean accuracy for the first, then the robust accuracy after the one
  before."""
  before, left = {}, m.get("clean_correct", m["clean_accuracy"])
  for stage in stages:
    before[stage] = float(left)
    left = m[ROBUST_AFTER + stage]
  return before


def _masking_check(m: Mapping[str, Any], stages: Sequence[str],
                   before: Mapping[str, float], n: int) -> str:
  """The gradient-masking line: what Square broke of what the white-box
  attacks left, or why there is no verdict."""
  white = [s for s in stages[:stages.index("square")] if s in WHITE_BOX]
  left = round(before["square"] * n)
  if left == 0:
    return ("- Gradient-masking check: no verdict: no image was left robust "
            f"after {', '.join(white) or 'the clean evaluation'}, so Square "
            "(black-box) had nothing to test.")
  broken = round(m["square_only"] * n)
  return (f"- Gradient-masking check: Square (black-box) broke {broken} of "
          f"the {left} images that every white-box attack failed on ("
          f"{100 * broken / left:.1f}%)" + (
              ": **the gradients of this model mislead white-box attacks "
              "here**." if broken > 0 else ": no sign of gradient masking."))


def autoattack_section(results: Sequence[tuple[Mapping[str, Any],
                                               Mapping[str, Any], int]],
                       workdir: str) -> list[str]:
  """Markdown sections for the AutoAttack / APGD entries of `results`
  (`(attack config, metrics, num_examples)` per configured attack); [] when
  there are none.

  An attack that started with no robust image left (every one broken
  before it) is named as such, draws no loss curve and gives no
  gradient-masking verdict."""
  sections, curves = [], {}
  for i, (config, m, n) in enumerate(results):
    label = f"{config['name']}[{i}] eps={config.get('eps')}"
    stages = stage_order(config, m)
    before = robust_before(m, stages) if stages else {}
    for key, value in m.items():
      if key.startswith(APGD_LOSS):
        stage = key[len(APGD_LOSS):]
        # No attacked image: the mean over none is no curve.
        if before.get(stage, m["clean_accuracy"]) * n >= 0.5:
          curves[f"{label} {stage}"] = np.asarray(value)
    if not stages:
      continue
    rows = [["clean", m["clean_accuracy"]]]
    rows += [[f"after {s}" + (" (no robust image left to attack)"
                              if round(before[s] * n) == 0 else ""),
              m[ROBUST_AFTER + s]] for s in stages]
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
    idle = [s for s in stages if round(before[s] * n) == 0]
    if idle:
      text.append(f"- No image was left robust before {', '.join(idle)}: "
                  "those attacks had nothing to test.")
    if "square_only" in m and "square" in stages:
      text.append(_masking_check(m, stages, before, n))
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
