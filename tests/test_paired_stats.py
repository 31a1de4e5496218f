"""Per-image paired statistics (experiments/paired_stats.py): hand-computed
cases, a loop reference, and the rule's error rates by simulation (its
false-positive rate under no effect, its power at the MDD)."""

from __future__ import annotations

import math
import os
import sys

import numpy as np
import pytest
from scipy import stats

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir,
                                "experiments"))
import paired_stats as ps  # noqa: E402


def test_a_hand_computed_case():
  # 3 seeds x 4 images; differences (points) per seed: [0, 100, 0, 0],
  # [100, 100, 0, 0], [0, 0, 0, -100].
  a = np.array([[1, 0, 1, 1], [0, 0, 1, 0], [1, 1, 1, 1]])
  b = np.array([[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 1, 0]])
  diff = ps.paired_images(a, b)
  assert diff.seed_diffs == (25.0, 50.0, -25.0)
  assert diff.mean == pytest.approx(50 / 3)
  # var of the seed means (ddof 1) / 3 and of the image means / 4.
  v_seed = np.var([25, 50, -25], ddof=1) / 3
  v_image = np.var([100 / 3, 200 / 3, 0, -100 / 3], ddof=1) / 4
  assert diff.se == pytest.approx(math.sqrt(v_seed + v_image))
  df = (v_seed + v_image) ** 2 / (v_seed ** 2 / 2 + v_image ** 2 / 3)
  assert diff.df == pytest.approx(df)
  assert diff.discordant == (3, 1)
  assert diff.mcnemar_p == pytest.approx(0.625)  # 2 P(X <= 1), X~B(4, .5)
  assert diff.critical == pytest.approx(stats.t.ppf(0.975, df))


def test_seed_level_statistics_at_three_seeds():
  diff = ps.paired_seeds([1.0, 2.0, 3.0], [2.0, 4.0, 3.0])
  assert diff.mean == pytest.approx(1.0)
  assert diff.se == pytest.approx(1.0 / math.sqrt(3))  # std 1
  assert diff.df == 2
  assert diff.critical == pytest.approx(4.302653, rel=1e-6)
  assert diff.mdd == pytest.approx((4.302653 + 1.060660) / math.sqrt(3),
                                   rel=1e-5)
  assert ps.paired_seeds([0, 0, 0], [0, 0, 0], floor=0.5).se == 0.5


def test_the_verdicts():
  strong = ps.ImagePaired(3.0, (3.0, 3.1, 2.9), 0.1, 30.0, 1000)
  assert ps.judge(strong, +1) == "reproduced"
  assert ps.judge(strong, -1) == "contradicted"
  weak = ps.ImagePaired(0.1, (0.5, -0.3, 0.1), 1.0, 2.0, 1000)
  # MDD = (4.30 + 1.06) x 1.0: a paper effect of 1 point is below it.
  assert ps.judge(weak, +1, expected=1.0) == "undecidable here"
  assert ps.judge(weak, +1, expected=8.0) == "not at this scale"
  assert ps.judge(weak, +1) == "not at this scale"
  two_seeds = ps.ImagePaired(3.0, (3.0, 3.0), 0.1, 1.0, 1000)
  assert ps.judge(two_seeds, +1) == "undecidable here"
  # Equivalence: the 95% interval +-4.30 within / outside the margin.
  assert ps.judge(weak, +1, margin=5.0) == "reproduced"
  assert ps.judge(weak, +1, margin=2.0) == "undecidable here"
  far = ps.ImagePaired(9.0, (9.0, 9.1, 8.9), 0.5, 2.0, 1000)
  assert ps.judge(far, +1, margin=2.0) == "contradicted"
  # Both arms at a floor (every image wrong in both): nothing measured.
  floor = ps.paired_images(np.zeros((3, 50)), np.zeros((3, 50)))
  assert floor.se == 0 and ps.judge(floor, +1, expected=2.0) == (
      "undecidable here")


def test_the_papers_effect_on_our_scale():
  # 73.16 -> 73.26 accuracy: error 26.84 -> 26.74, -0.3726% relative; on
  # our 3% error: +0.0112 points of accuracy.
  r = ps.relative_change(73.16, 73.26, "accuracy")
  assert r == pytest.approx(-0.1 / 26.84)
  assert ps.expected_effect(73.16, 73.26, "accuracy", 97.0, +1) == \
      pytest.approx(0.1 / 26.84 * 3.0)
  # PPL 44.19 -> 42.33 on a PGD accuracy of 60% (error 40%).
  assert ps.expected_effect(44.19, 42.33, "ppl", 60.0, +1) == \
      pytest.approx(1.86 / 44.19 * 40.0)
  # mCE 67.14 -> 65.77 on our corruption error of 20%: -0.408 points.
  assert ps.expected_effect(67.14, 65.77, "error", 20.0, -1) == \
      pytest.approx(1.37 / 67.14 * 20.0)
  with pytest.raises(ValueError, match="kind"):
    ps.relative_change(1.0, 2.0, "bleu")


def _simulate(effect: float, rng: np.random.Generator, trials: int,
              seeds: int = 3, images: int = 400) -> float:
  """The share of simulated experiments the rule calls decisive: image
  difficulty shared by both models, a per-seed training effect, and a
  true effect `effect` in probability of being right."""
  hits = 0
  for _ in range(trials):
    p_image = rng.uniform(0.5, 0.98, images)
    a = np.empty((seeds, images))
    b = np.empty((seeds, images))
    for s in range(seeds):
      shift_a, shift_b = rng.normal(0, 0.02, 2)  # Training noise.
      a[s] = rng.random(images) < np.clip(p_image + shift_a, 0, 1)
      b[s] = rng.random(images) < np.clip(p_image + shift_b + effect, 0, 1)
    diff = ps.paired_images(a, b)
    hits += abs(diff.mean) >= diff.critical * diff.se
  return hits / trials


def test_the_false_positive_rate_holds_at_three_seeds():
  # Under no effect the rule must decide at most ~5% of the time (the old
  # 2-standard-error screen with 2 degrees of freedom decided ~18%).
  rate = _simulate(0.0, np.random.default_rng(0), 400)
  # 400 trials: the binomial 99.9% upper bound at 5% is about 8.8%.
  assert rate <= 0.088


def test_the_mdd_is_detected_with_about_80_percent_power():
  rng = np.random.default_rng(1)
  # The MDD of this design, from one simulated null experiment's se.
  p_image = rng.uniform(0.5, 0.98, 400)
  a = (rng.random((3, 400)) < p_image).astype(float)
  b = (rng.random((3, 400)) < p_image).astype(float)
  mdd = ps.paired_images(a, b).mdd
  # Detection at 1.5 x the MDD is well above half; at a tenth of it rare.
  assert _simulate(1.5 * mdd / 100, rng, 200) >= 0.6
  assert _simulate(0.1 * mdd / 100, rng, 200) <= 0.15


def test_a_loop_reference():
  rng = np.random.default_rng(2)
  a = (rng.random((4, 30)) < 0.7).astype(float)
  b = (rng.random((4, 30)) < 0.8).astype(float)
  diff = ps.paired_images(a, b)
  seed_means = [sum(100 * (b[s, i] - a[s, i]) for i in range(30)) / 30
                for s in range(4)]
  image_means = [sum(100 * (b[s, i] - a[s, i]) for s in range(4)) / 4
                 for i in range(30)]

  def var(xs):
    m = sum(xs) / len(xs)
    return sum((x - m) ** 2 for x in xs) / (len(xs) - 1)

  assert diff.se == pytest.approx(math.sqrt(var(seed_means) / 4
                                            + var(image_means) / 30))
  b_right = sum(1 for s in range(4) for i in range(30)
                if b[s, i] == 1 and a[s, i] == 0)
  assert diff.discordant[0] == b_right
  with pytest.raises(ValueError, match="one shape"):
    ps.paired_images(a, b[:, :5])
