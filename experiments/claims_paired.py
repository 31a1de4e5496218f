"""CLAIMS.md's per-image blocks, from the committed results of the
experiments judged per image (`paired_claims.run_paired_experiment`).

A block NAME is rendered from `experiments/results/NAME.json` (every
claim's statistics per regime) and can be re-derived from scratch:
`rederive(NAME, claims)` recomputes each record from the committed
per-image outcomes (`NAME_images.npz`) and run-level per-seed values
(`NAME.json`'s `per_seed`) with `paired_claims.claims_rows`.
`claims_index.py --write` fills the blocks; tests check both.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

import numpy as np

import paired_claims

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
# CLAIMS.md block -> the experiment whose committed results fill it.
PAIRED_BLOCKS = ("acmoe_paired", "symphony_paired", "momentum_layout", "momentum_variants",
                 "momentum_depth", "momentum_norms", "cmoe_ablations",
                 "cmoe_finetuned", "lm_claims")
REGIME_ORDER = ("default", "low_data", "tiny")  # tiny: lm_claims.py's.


def load(name: str, results: str = RESULTS) -> dict:
  with open(os.path.join(results, f"{name}.json")) as f:
    return json.load(f)


def _num(x, sign: bool = False) -> str:
  if x is None:
    return "–"
  x = float(x)
  text = f"{x:+.2f}" if sign else f"{x:.2f}"
  return text.replace("-", "−")


def _ours(r: dict) -> str:
  seeds = r["seed_diffs"]
  std = float(np.std(seeds, ddof=1)) if len(seeds) > 1 else 0.0
  if not paired_claims.is_image_metric(r["metric"]):  # A model's value.
    return (f"{_num(np.mean(seeds), True)} ± {_num(std)} (over seeds: se "
            f"{_num(r['se'])}, df {r['df']:.0f}; baseline "
            f"{_num(r['baseline_value'])})")
  unit = "block" if r["metric"] in paired_claims.BLOCK_METRICS else "image"
  return (f"{_num(np.mean(seeds), True)} ± {_num(std)} (per {unit} "
          f"{_num(r['effect'], True)}, se {_num(r['se'])}, df "
          f"{r['df']:.1f}; baseline {_num(r['baseline_value'])})")


def _both(cells: Sequence[str]) -> str:
  return cells[0] if len(set(cells)) == 1 else " / ".join(cells)


def render(name: str, results: str = RESULTS) -> list[str]:
  """The block's markdown table: one row per claim, default and low-data
  cells side by side (a regime not run reads "not run")."""
  data = load(name, results)
  regimes = [r for r in REGIME_ORDER if r in data["claims"]]
  lines = ["| source | claim | baseline → candidate | metric | "
           + " | ".join(f"ours: {r.replace('_', ' ')}" for r in regimes)
           + " | detects ≥ (MDD) | paper's effect here | verdict |",
           "|---|---|---|---|" + "---|" * len(regimes) + "---|---|---|"]
  # A claim is one row; a regime that did not judge it reads "not run".
  key = lambda r: (r["statement"], r["baseline"], r["candidate"],
                   r["metric"])
  by_regime = {g: {key(r): r for r in data["claims"][g]} for g in regimes}
  order = list(dict.fromkeys(key(r) for g in regimes
                             for r in data["claims"][g]))
  for k in order:
    claim = next(by_regime[g][k] for g in regimes if k in by_regime[g])
    records = [by_regime[g].get(k) for g in regimes]
    ran = [r for r in records if r is not None]
    label, _ = paired_claims.metric_of(claim["metric"])
    lines.append(
        f"| {claim['source']} | {claim['statement']} | "
        f"`{claim['baseline']}` → `{claim['candidate']}` | {label} | "
        + " | ".join("not run" if r is None else _ours(r) for r in records)
        + " | " + _both([_num(r["mdd"]) for r in ran]) + " | "
        + _both([_num(r["expected"], True) for r in ran]) + " | "
        + _both([r["verdict"] for r in ran]) + " |")
  return lines


def regime_outcomes(name: str, regime: str, results: str = RESULTS
                    ) -> dict[tuple[str, str], np.ndarray]:
  """`{(key, metric): outcomes}` of one regime from the committed files:
  `[S, I]` per-image outcomes (NAME_images.npz, when the study has any) and
  `[S]` run-level values (NAME.json's `per_seed`)."""
  data = load(name, results)
  path = os.path.join(results, f"{name}_images.npz")
  outcomes = (dict(paired_claims.read_images(path).get(regime, {}))
              if os.path.exists(path) else {})
  for key_regime, values in data["per_seed"].items():
    r, key = key_regime.split("/")
    if r != regime:
      continue
    for metric, seeds in values.items():
      if (key, metric) not in outcomes:  # Run-level metrics.
        outcomes[key, metric] = np.asarray(seeds, np.float64)
  return outcomes


def rederive(name: str, claims: Sequence, results: str = RESULTS
             ) -> dict[str, list[dict]]:
  """Every regime's claim records recomputed from the committed per-image
  outcomes and per-seed values (the study's `claims`, in its order; those
  whose outcomes the regime has)."""
  out = {}
  for regime in load(name, results)["claims"]:
    outcomes = regime_outcomes(name, regime, results)
    judged = [c for c in claims
              if paired_claims.claim_needs(c) <= set(outcomes)]
    labels = {k: k for c in judged for k in paired_claims.claim_keys(c)}
    _, out[regime] = paired_claims.claims_rows(outcomes, regime, judged,
                                               labels)
  return out
