"""Claims judged per image (experiments/paired_claims.py): the outcomes read
from runs' per_example.npz, the per-image metrics (corruption error per
image, the severity trend), the claimed direction, and the committed
files re-read."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir,
                                "experiments"))
import paired_claims as pc  # noqa: E402
import paired_stats  # noqa: E402
import study  # noqa: E402
from vmoe_ext.evaluate.per_example import PerExample  # noqa: E402


def _run(path, clean, noise):
  """A run's per_example.npz: `clean` [I] correctness; `noise[s]` [I]
  correctness under Gaussian and impulse noise at severity s (1, 5)."""
  index = np.arange(len(clean))
  record = PerExample(np.zeros(len(clean), int), enabled=True)
  record.add("clean", index, clean, clean)
  for name in pc.TREND_CORRUPTIONS:
    for s, c in noise.items():
      record.add(f"corruption/{name}/s{s}", index, c, c)
  os.makedirs(path)
  record.write(str(path))


def test_per_image_metrics_read_from_the_runs(tmp_path):
  one = np.array([1, 1, 0, 1], bool)
  _run(tmp_path / "a", one, {1: one, 5: np.array([0, 1, 0, 0], bool)})
  index, clean = pc.image_outcomes(str(tmp_path / "a"), "clean", "default")
  assert index.tolist() == [0, 1, 2, 3] and clean.tolist() == [1, 1, 0, 1]
  # Per image: mean error over the 4 conditions (2 corruptions x 2).
  _, mce = pc.image_outcomes(str(tmp_path / "a"), "mce", "default")
  assert mce.tolist() == [0.5, 0.0, 1.0, 0.5]
  # Severity 5 - severity 1 error, averaged over the two noises.
  _, trend = pc.image_outcomes(str(tmp_path / "a"), "noise_trend", "default")
  assert trend.tolist() == [1.0, 0.0, 0.0, 1.0]
  _, gauss = pc.image_outcomes(str(tmp_path / "a"), "corr:gaussian_noise",
                               "default")
  assert gauss.tolist() == [0.5, 0.0, 1.0, 0.5]
  with pytest.raises(KeyError, match="per_example"):
    pc.image_outcomes(str(tmp_path / "a"), "pgd", "default")
  assert pc.eval_names("pgd_mid", "low_data", []) == [
      "adversarial/pgd/eps=0.01"]


def test_seeds_must_share_their_images(tmp_path):
  _run(tmp_path / "s0", np.ones(3, bool), {1: np.ones(3, bool)})
  record = PerExample(np.zeros(3, int), enabled=True)
  record.add("clean", np.array([0, 1, 5]), np.ones(3, bool),
             np.ones(3, bool))
  os.makedirs(tmp_path / "s1")
  record.write(str(tmp_path / "s1"))
  with pytest.raises(ValueError, match="other images"):
    pc.outcomes_matrix([str(tmp_path / "s0"), str(tmp_path / "s1")],
                       "clean", "default")


def test_a_claim_the_paper_finds_worse_is_judged_in_that_direction():
  rng = np.random.default_rng(0)
  a = (rng.random((3, 2000)) < 0.9).astype(float)
  b = a.copy()
  b[:, :300] = 0  # The candidate is clearly worse.
  worse = study.Claim("src", "SAM lowers clean accuracy", "a", "b", "clean",
                      paper=(73.16, 72.84, "accuracy"))
  better = study.Claim("src", "improves", "a", "b", "clean",
                       paper=(73.16, 73.26, "accuracy"))
  _, expected, verdict = pc.claim_stats(a, b, worse, 90.0, +1)
  assert expected < 0 and verdict == "reproduced"
  _, expected, verdict = pc.claim_stats(a, b, better, 90.0, +1)
  assert expected > 0 and verdict == "contradicted"


def test_claim_rows_and_the_committed_files_round_trip(tmp_path):
  rng = np.random.default_rng(1)
  outcomes = {("a", "clean"): (rng.random((3, 50)) < 0.8).astype(float),
              ("b", "clean"): (rng.random((3, 50)) < 0.8).astype(float),
              ("a", "load"): np.array([1.0, 2.0, 3.0]),
              ("b", "load"): np.array([0.5, 1.0, 2.0])}
  claims = [study.Claim("src", "b beats a", "a", "b", "clean",
                        paper=(70.0, 72.0, "accuracy")),
            study.Claim("src", "b balances better", "a", "b", "load")]
  lines, records = pc.claims_rows(outcomes, "default", claims,
                                  {"a": "A", "b": "B"})
  assert len(lines) == 2 + 2
  diff = paired_stats.paired_images(outcomes["a", "clean"],
                                    outcomes["b", "clean"])
  assert records[0]["effect"] == pytest.approx(diff.mean)
  assert records[0]["mdd"] == pytest.approx(diff.mdd)
  seeds = paired_stats.paired_seeds([1, 2, 3], [0.5, 1, 2])
  assert records[1]["effect"] == pytest.approx(seeds.mean)
  assert records[1]["df"] == 2
  path = str(tmp_path / "x_images.npz")
  pc.write_images(path, {"default": outcomes})
  back = pc.read_images(path)["default"]
  assert set(back) == {("a", "clean"), ("b", "clean")}  # Load: in JSON.
  np.testing.assert_array_equal(back["a", "clean"], outcomes["a", "clean"])


@pytest.mark.parametrize("name, regimes", [
    ("momentum_layout", {"default", "low_data"}),
    ("momentum_depth", {"low_data"}),
    ("symphony_paired", {"default", "low_data"}),
    ("acmoe_paired", {"default"}),
    ("momentum_variants", {"default", "low_data"}),
    ("cmoe_ablations", {"default"}),
    ("cmoe_finetuned", {"default"})])
def test_the_committed_per_image_claims_rederive_from_their_outcomes(
    name, regimes):
  # experiments/results/NAME.json and NAME_images.npz: every claim's numbers
  # and verdict recomputed from the committed outcomes and per-seed values.
  import importlib

  import claims_paired
  module = importlib.import_module(name)
  claims = list(module.CLAIMS)
  if name == "acmoe_paired":  # Its SPSA pair's claims, at the default eps.
    claims += module.spsa_claims("default")
  committed = claims_paired.load(name)
  again = claims_paired.rederive(name, claims)
  assert set(again) == set(committed["claims"]) == regimes
  for regime, records in committed["claims"].items():
    # Every claim on the candidates that ran in the regime was judged.
    ran = {k for k, _ in claims_paired.regime_outcomes(name, regime)}
    want = [c for c in claims if pc.claim_keys(c) <= ran]
    assert len(again[regime]) == len(records) == len(want)
    for new, old in zip(again[regime], records):
      assert new["verdict"] == old["verdict"], (regime, old["statement"])
      for field in ("effect", "se", "df", "mdd", "baseline_value"):
        assert new[field] == pytest.approx(old[field], rel=1e-12), field
      assert new["seed_diffs"] == pytest.approx(old["seed_diffs"],
                                                rel=1e-12)


def test_a_contrast_judges_the_difference_of_two_gains():
  rng = np.random.default_rng(3)
  base = (rng.random((3, 400)) < 0.7).astype(float)
  outcomes = {("lo_a", "clean"): base, ("lo_b", "clean"): base.copy(),
              ("hi_a", "clean"): base.copy(), ("hi_b", "clean"): base.copy()}
  outcomes["hi_b", "clean"][:, :100] = 1.0  # A gain only in the high arm.
  contrast = pc.Contrast("src", "the gain grows", ("lo_a", "lo_b"),
                         ("hi_a", "hi_b"), "clean")
  assert pc.claim_keys(contrast) == {"lo_a", "lo_b", "hi_a", "hi_b"}
  lines, records = pc.claims_rows(outcomes, "default", [contrast],
                                  {k: k for k in pc.claim_keys(contrast)})
  gain_lo = outcomes["lo_b", "clean"] - outcomes["lo_a", "clean"]
  gain_hi = outcomes["hi_b", "clean"] - outcomes["hi_a", "clean"]
  diff = paired_stats.paired_images(gain_lo, gain_hi)
  assert records[0]["effect"] == pytest.approx(diff.mean)
  assert records[0]["effect"] == pytest.approx(
      100 * (gain_hi - gain_lo).mean())
  assert records[0]["verdict"] == "reproduced"
  assert "gain of hi_b over hi_a" in lines[-1]


def test_new_metric_names_read_their_evaluations():
  assert pc.eval_names("pgd_small", "default", []) == [
      "adversarial/pgd/eps=0.01"]
  assert pc.eval_names("spsa:0.03", "default", []) == [
      "adversarial/spsa/eps=0.03"]
  assert pc.eval_names("corr5:fog", "default", []) == ["corruption/fog/s5"]
  assert pc.image_metric("corr5:fog").better == +1
  assert pc.is_image_metric("spsa:0.01") and not pc.is_image_metric("load")


def test_a_contrast_across_metrics_is_the_gain_at_one_minus_the_other():
  """Fig. 3's "the gain grows with eps": per seed and image, (b - a) at
  the high metric minus (b - a) at the low one, by hand."""
  a_lo = np.array([[1, 1, 0, 1], [1, 0, 1, 1]], float)
  b_lo = np.array([[1, 1, 1, 1], [1, 1, 1, 1]], float)
  a_hi = np.array([[0, 0, 0, 1], [0, 0, 1, 0]], float)
  b_hi = np.array([[1, 1, 0, 1], [1, 1, 1, 1]], float)
  outcomes = {("a", "lo"): a_lo, ("b", "lo"): b_lo, ("a", "hi"): a_hi,
              ("b", "hi"): b_hi}
  c = pc.Contrast("src", "grows", ("a", "b"), ("a", "b"), "hi",
                  low_metric="lo")
  low, high = pc.claim_arms(outcomes, c)
  np.testing.assert_array_equal(low, b_lo - a_lo)
  np.testing.assert_array_equal(high, b_hi - a_hi)
  assert pc.claim_needs(c) == {("a", "hi"), ("b", "hi"), ("a", "lo"),
                               ("b", "lo")}
  assert c.baseline == "b - a (lo)" and c.candidate == "b - a (hi)"


def test_a_candidate_may_lack_a_metric_no_claim_reads(tmp_path):
  one = np.array([1, 0, 1], bool)
  _run(tmp_path / "a_0", one, {1: one})
  _run(tmp_path / "b_0", one, {1: one})
  paths = {"a": [str(tmp_path / "a_0")], "b": [str(tmp_path / "b_0")]}
  claim = study.Claim("src", "b beats a", "a", "b", "clean")
  got = pc.candidate_outcomes(paths, ["clean", "pgd"], [claim], "default")
  assert set(got) == {("a", "clean"), ("b", "clean")}  # No PGD: skipped.
  needs_pgd = study.Claim("src", "b beats a", "a", "b", "pgd")
  with pytest.raises(KeyError):
    pc.candidate_outcomes(paths, ["clean", "pgd"], [needs_pgd], "default")


def test_a_block_with_claims_only_one_regime_judged(tmp_path):
  """claims_paired.render: one row per claim; the regime that did not
  judge it reads "not run", the others' numbers and verdict stand."""
  import json

  import claims_paired

  def record(statement, verdict):
    return dict(source="src", statement=statement, baseline="a",
                candidate="b", metric="load", seed_diffs=[1.0, 2.0, 3.0],
                effect=2.0, se=0.5, df=2, baseline_value=1.0, mdd=2.7,
                expected=None, verdict=verdict)
  data = {"claims": {"default": [record("x", "reproduced")],
                     "low_data": [record("y", "contradicted"),
                                  record("x", "undecidable here")]}}
  with open(tmp_path / "blk.json", "w") as f:
    json.dump(data, f)
  lines = claims_paired.render("blk", str(tmp_path))
  assert len(lines) == 2 + 2
  assert lines[2].startswith("| src | x |") and lines[2].endswith(
      "| reproduced / undecidable here |")
  assert "| not run |" in lines[3] and lines[3].endswith("| contradicted |")
  assert "over seeds: se 0.50, df 2" in lines[2]  # A model-level value.


def test_the_committed_expert_norm_claims_rederive_from_their_values():
  # momentum_norms.py's claims are model-level values per seed (in the
  # JSON's per_seed); each regime judges the claims on its models.
  import claims_paired
  import momentum_norms
  committed = claims_paired.load("momentum_norms")
  assert set(committed["claims"]) == {"default", "low_data"}
  for regime, records in committed["claims"].items():
    want = (momentum_norms.claims_for(momentum_norms.MODELS[regime])
            + momentum_norms.along_claims(momentum_norms.ALONG.key))
    again = claims_paired.rederive("momentum_norms", want)[regime]
    assert len(again) == len(records) == len(want)
    for new, old in zip(again, records):
      assert new["verdict"] == old["verdict"], (regime, old["statement"])
      assert new["effect"] == pytest.approx(old["effect"], rel=1e-12)
      assert new["se"] == pytest.approx(old["se"], rel=1e-12)
