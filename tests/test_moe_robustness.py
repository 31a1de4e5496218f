"""experiments/moe_robustness.py without training: the per-eps metrics read
from hand-written metrics records, the candidates' configs, their computed
parameter / FLOP relations, and the baseline it is evaluated from."""

from __future__ import annotations

import math
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir,
                                "experiments"))
import moe_robustness as mr  # noqa: E402  pylint: disable=g-import-not-at-top
import study  # noqa: E402  pylint: disable=g-import-not-at-top

from vmoe_ext.app.schema import validate_config  # noqa: E402
from vmoe_ext.attacks.projected_gradient import (  # noqa: E402
    DEFAULT_STEP_FACTOR)


def _records(acc: dict[float, float], rc1: dict[float, float],
             rc3: dict[float, float], clean: float = 0.9) -> list[dict]:
  """A run's lines: training, the final test, the sweep (eps < 0.05), the
  eps 0.05 attack, FGSM and the Gaussian-noise corruption."""
  lines = [{"step": 10, "split": "train", "loss": 0.5},
           {"step": 10, "split": "test", "accuracy": 0.95, "final": True,
            "num_examples": 1000.0}]
  for eps in mr.SWEEP_EPS:
    lines.append({"step": 10, "split": "sweep/pgd", "eps": eps,
                  "clean_accuracy": clean, "accuracy": acc[eps],
                  "layer_1/routing_change_rate": rc1[eps],
                  "layer_3/routing_change_rate": rc3[eps]})
  lines.append({"step": 10, "split": "adversarial/fgsm", "eps": 0.05,
                "clean_accuracy": clean, "accuracy": 0.5,
                "layer_1/routing_change_rate": 0.9,
                "layer_3/routing_change_rate": 0.9, "num_examples": 500.0})
  lines.append({"step": 10, "split": "adversarial/pgd", "eps": 0.05,
                "clean_accuracy": clean, "accuracy": acc[0.05],
                "layer_1/routing_change_rate": rc1[0.05],
                "layer_3/routing_change_rate": rc3[0.05],
                "num_examples": 500.0})
  lines.append({"step": 10, "split": "corruption",
                "gaussian_noise/accuracy": 0.8,
                "mean_corruption_error": 0.2, "num_examples": 500.0})
  return lines


ACC = {0.005: 0.8, 0.01: 0.7, 0.02: 0.5, 0.03: 0.3, 0.05: 0.1}
RC1 = {0.005: 0.01, 0.01: 0.02, 0.02: 0.04, 0.03: 0.06, 0.05: 0.1}
RC3 = {0.005: 0.03, 0.01: 0.04, 0.02: 0.08, 0.03: 0.12, 0.05: 0.2}


def test_per_eps_metrics_from_hand_records():
  records = _records(ACC, RC1, RC3)
  assert sorted(mr.pgd_points(records)) == list(mr.EPS)
  assert mr.accuracy_at(records, 0.0) == pytest.approx(90.0)  # clean
  for eps, acc in ACC.items():  # FGSM's eps 0.05 line is not PGD's.
    assert mr.accuracy_at(records, eps) == pytest.approx(100 * acc)
    assert study.METRICS[f"pgd@{eps:g}"].extract(records) == pytest.approx(
        100 * acc)
  assert mr.routing_at(records, 0.0) == 0.0
  assert mr.routing_at(records, 0.02) == pytest.approx(6.0)  # (4 + 8) / 2
  assert mr.routing_at(records, 0.05, "layer_3") == pytest.approx(20.0)
  assert study.METRICS["routing@0.05"].extract(records) == pytest.approx(15.0)
  assert mr.moe_layers(records) == ["layer_1", "layer_3"]
  # Trapezoids over eps 0, .005, .01, .02, .03, .05 of 90, 80, 70, 50, 30,
  # 10: 0.425 + 0.375 + 0.6 + 0.4 + 0.4 = 2.2, / 0.05 = 44.
  assert mr.accuracy_area(records) == pytest.approx(44.0)
  assert study.METRICS["pgd_area"].extract(records) == pytest.approx(44.0)
  assert study.METRICS["noise"].extract(records) == pytest.approx(80.0)
  assert study.METRICS["pgd@0.05"].examples_split == "adversarial/pgd"


def test_last_line_per_eps_wins_and_missing_eps_is_nan():
  records = _records(ACC, RC1, RC3)
  records.append({"step": 20, "split": "sweep/pgd", "eps": 0.01,
                  "clean_accuracy": 0.9, "accuracy": 0.6,
                  "layer_1/routing_change_rate": 0.0,
                  "layer_3/routing_change_rate": 0.0})
  assert mr.accuracy_at(records, 0.01) == pytest.approx(60.0)
  without = [r for r in records if r.get("eps") != 0.02]
  assert math.isnan(mr.accuracy_at(without, 0.02))
  assert math.isnan(mr.accuracy_area(without))
  assert math.isnan(mr.accuracy_at([], 0.0))
  assert math.isnan(mr.routing_at([], 0.05))


def test_routing_growth_verdict_and_plot(tmp_path):
  seeds = (0, 1, 2)
  runs = {}
  for s in seeds:
    grow = {e: v * (1 + 0.1 * s) for e, v in RC1.items()}
    runs["default", "vmoe_k2", s] = _records(ACC, grow, RC3)
    runs["default", "dense", s] = _records(ACC, dict.fromkeys(RC1, 0.0),
                                           dict.fromkeys(RC3, 0.0))
  candidates = [c for c in mr.CANDIDATES if c.key in ("dense", "vmoe_k2")]
  png = mr.plot_eps(runs, "default", candidates, ["vmoe_k2"], seeds,
                    str(tmp_path / "eps.png"))
  assert os.path.getsize(png) > 0
  lines = mr.eps_section(runs, "default", candidates, ["vmoe_k2"], seeds, png)
  rows = [l for l in lines if "routing changes more as eps grows" in l]
  assert len(rows) == 1 and rows[0].endswith("| reproduced |")
  # Per MoE layer of the V-MoE only; the dense model has no routing rows.
  assert sum("V-MoE E=4, K=2 (default), layer_" in l for l in lines) == 2
  assert not any(l.startswith("| dense ViT (width 256, equal FLOPs), layer")
                 for l in lines)


@pytest.mark.parametrize("pgd_steps", [10, mr.QUICK_PGD_STEPS])
def test_every_candidate_config_validates(pgd_steps):
  for c in mr.make_candidates(pgd_steps):
    for regime, quick in ((study.REGIMES["default"], False),
                          (study.REGIMES["low_data"], False),
                          (study.QUICK_REGIMES["low_data"], True)):
      config = study.build_config(c, 0, regime, quick)
      validate_config(config)
      sweep = config.robustness.sweep
      assert sweep.attack.steps == pgd_steps
      assert sweep.attack.get("step_size") is None
      assert tuple(sweep.eps) == mr.SWEEP_EPS
  # The sweep's default step is eps / 4 at 10 steps, as the eps 0.05
  # attack's explicit 0.0125.
  config = study.build_config(mr.CANDIDATES[0], 0, study.REGIMES["default"],
                              False)
  pgd = [a for a in config.robustness.attacks if a["name"] == "pgd"][0]
  assert pgd["eps"] == mr.ATTACK_EPS and pgd["steps"] == 10
  assert pgd["step_size"] == pytest.approx(mr.ATTACK_EPS / 4)
  for eps in mr.SWEEP_EPS:
    assert DEFAULT_STEP_FACTOR * eps / 10 == pytest.approx(eps / 4)


def test_claimed_flops_and_parameter_relations():
  costs = {c.key: mr.model_cost(study.build_config(
      c, 0, study.REGIMES["default"], False)) for c in mr.CANDIDATES}
  dense, k1, k2 = costs["dense"], costs["vmoe_k1"], costs["vmoe_k2"]
  e8, wide = costs["vmoe_e8"], costs["dense_wide"]
  # Equal parameters: the wide dense model vs the V-MoE's total.
  assert abs(wide["params"] / k2["params"] - 1) < 0.10
  # Equal FLOPs (up to router and capacity padding): K=2 vs the dense.
  assert abs(k2["mflops"] / dense["mflops"] - 1) < 0.15
  assert abs(k2["active_params"] / dense["params"] - 1) < 0.01
  # K=1 halves the expert FLOPs; E=8 keeps K=2's FLOPs with 2x the experts.
  assert k1["mflops"] < dense["mflops"] < k2["mflops"] < wide["mflops"]
  assert abs(e8["mflops"] / k2["mflops"] - 1) < 0.05
  assert e8["expert_params"] == 2 * k2["expert_params"]
  assert k1["params"] == k2["params"]
  # The wide MLPs hold the experts' weights (E x H = 512 per block).
  assert wide["expert_params"] == pytest.approx(k2["expert_params"],
                                                rel=0.01)
  assert wide["mflops"] > 1.3 * dense["mflops"]


def test_claims_and_metrics_are_registered():
  keys = {c.key for c in mr.CANDIDATES}
  assert set(mr.QUICK) <= keys and len(mr.CANDIDATES) <= 6
  for claim in mr.CLAIMS:
    assert {claim.baseline, claim.candidate} <= keys
    assert claim.metric in study.METRICS
  assert all(m in study.METRICS for m in mr.METRICS)
  assert mr.EPS[0] == 0.0 and mr.EPS[-1] == mr.ATTACK_EPS


def test_vmoe_k2_is_noisy_topk_evaluated_again():
  """`vmoe_k2` has the training config of acmoe_vmoe.py's `noisy_topk`."""
  import acmoe_vmoe  # pylint: disable=g-import-not-at-top
  (k2,) = [c for c in mr.CANDIDATES if c.key == "vmoe_k2"]
  (base,) = [c for c in acmoe_vmoe.CANDIDATES if c.key == "noisy_topk"]
  assert k2.trained_as == base
  assert all(c.trained_as is None for c in mr.CANDIDATES if c is not k2)
  for regime in study.REGIMES.values():
    study.evaluate_only.check_same_training(
        k2.key, study.build_config(k2, 1, regime, False), base.key,
        study.build_config(base, 1, regime, False))
