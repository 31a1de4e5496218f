"""Per-image paired statistics of a claim: candidate B vs baseline A, both
trained on S seeds and evaluated on the same I test images.

Per seed s and image i the outcome difference d_si = b_si - a_si (top-1
correctness 0/1, or an image's error averaged over the corruption
conditions). The effect is the mean D over seeds and images. Its standard
error has two parts, both estimated here:

* training noise: the seed means d_s = mean_i d_si vary from seed to seed,
  var(d_s) / S;
* the test sample: the same I images serve every seed, so the image means
  dbar_i = mean_s d_si vary from image to image, var(dbar_i) / I (a
  different test sample would move every seed's difference alike; the
  spread of the d_s alone cannot show this).

se = sqrt(var(d_s) / S + var(dbar_i) / I) (each variance also holds the
seed x image interaction, so se is slightly conservative), with
Welch-Satterthwaite degrees of freedom: about S - 1 = 2 when training noise
dominates (the critical value is then t_2 = 4.30, not 2), many when the
test sample does (about 1.96). A claim is decided at two-sided alpha 0.05:
|D| / se >= t_{0.975, df}.

What the design can detect: the minimum detectable difference
MDD = (t_{0.975, df} + t_{0.80, df}) se, the true effect that such a test
finds with 80% power (at the se these runs measured). A row whose
expected effect (the paper's, converted to our scale by `expected_effect`)
is below its MDD is "undecidable here": a null result says nothing.

McNemar's exact test on the discordant images pooled over seeds (A right
and B wrong, or the reverse) is reported beside it; it conditions on
these trained models (it asks whether *these* models differ, not whether
the method does), so it does not decide the verdict.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import numpy as np
from scipy import stats

ALPHA = 0.05
POWER = 0.80
MIN_SEEDS = 3
VERDICTS = ("reproduced", "not at this scale", "undecidable here",
            "contradicted")


@dataclasses.dataclass(frozen=True)
class ImagePaired:
  """The paired difference B - A in points (x `scale`); `seed_diffs`: the
  per-seed mean differences d_s (points)."""
  mean: float
  seed_diffs: tuple[float, ...]
  se: float
  df: float
  images: int
  discordant: Optional[tuple[int, int]] = None  # (B right, A right)

  @property
  def seeds(self) -> int:
    return len(self.seed_diffs)

  @property
  def seed_std(self) -> float:
    return (float(np.std(self.seed_diffs, ddof=1)) if self.seeds > 1
            else 0.0)

  @property
  def t(self) -> float:
    return self.mean / self.se if self.se > 0 else math.copysign(
        math.inf, self.mean) if self.mean else 0.0

  @property
  def critical(self) -> float:
    return float(stats.t.ppf(1 - ALPHA / 2, self.df))

  @property
  def p(self) -> float:
    return float(2 * stats.t.sf(abs(self.t), self.df))

  @property
  def mdd(self) -> float:
    """The minimum detectable difference (points) at ALPHA and POWER."""
    return (self.critical + float(stats.t.ppf(POWER, self.df))) * self.se

  @property
  def mcnemar_p(self) -> Optional[float]:
    if self.discordant is None:
      return None
    b, c = self.discordant
    if b + c == 0:
      return 1.0
    return float(stats.binomtest(b, b + c, 0.5).pvalue)


def paired_images(a: np.ndarray, b: np.ndarray, scale: float = 100.0
                  ) -> ImagePaired:
  """`a`, `b`: `[S, I]` per-seed, per-image outcomes (0/1 correctness, or
  per-image errors in [0, 1]) of the baseline and the candidate on the same
  images; the difference in points (`scale` 100: percentage points)."""
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  if a.shape != b.shape or a.ndim != 2:
    raise ValueError(f"per-image outcomes must be [seeds, images] of one "
                     f"shape; got {a.shape} and {b.shape}")
  seeds, images = a.shape
  d = scale * (b - a)
  seed_means = d.mean(1)
  image_means = d.mean(0)
  v_seed = seed_means.var(ddof=1) / seeds if seeds > 1 else math.inf
  v_image = image_means.var(ddof=1) / images if images > 1 else 0.0
  se = math.sqrt(v_seed + v_image)
  if seeds > 1 and se > 0:
    denom = v_seed ** 2 / (seeds - 1) + (
        v_image ** 2 / (images - 1) if images > 1 else 0.0)
    df = (v_seed + v_image) ** 2 / denom
  else:
    df = max(seeds - 1, 1)
  discordant = None
  if set(np.unique(a)) <= {0.0, 1.0} and set(np.unique(b)) <= {0.0, 1.0}:
    discordant = (int(((b == 1) & (a == 0)).sum()),
                  int(((a == 1) & (b == 0)).sum()))
  return ImagePaired(float(d.mean()), tuple(float(x) for x in seed_means),
                     se, float(df), images, discordant)


def paired_seeds(baseline, candidate, floor: float = 0.0) -> ImagePaired:
  """The seed-level version, for a metric with no per-image outcome (load
  imbalance, training loss) or a run whose images were not recorded:
  d_s = candidate_s - baseline_s, se = max(std(d_s) / sqrt(S), `floor`),
  df = S - 1. `floor` stands in for the test sample's share of the error
  that the seeds cannot show (e.g. `verdicts.sampling_se`; 0 for a metric
  of the model itself)."""
  b = np.asarray(baseline, np.float64)
  c = np.asarray(candidate, np.float64)
  if b.shape != c.shape or b.ndim != 1:
    raise ValueError(f"per-seed values must be [seeds] of one shape; got "
                     f"{b.shape} and {c.shape}")
  d = c - b
  seeds = len(d)
  std = float(np.std(d, ddof=1)) if seeds > 1 else math.inf
  se = max(std / math.sqrt(seeds), floor)
  return ImagePaired(float(d.mean()), tuple(float(x) for x in d), se,
                     float(max(seeds - 1, 1)), 0)


def judge(diff: ImagePaired, better: int,
          expected: Optional[float] = None,
          margin: Optional[float] = None) -> str:
  """The verdict on a claim that B beats A in direction `better` (+1 / -1)
  given `diff`; `expected`: the paper's effect on our scale (points, in the
  claimed direction; `expected_effect`), which makes a null result
  "undecidable here" when it is below the MDD. With `margin` M, a claim of
  no effect: reproduced when the 95% interval lies within +-M, contradicted
  when it lies wholly outside, else undecidable here. Two arms that score
  every image alike in every seed (a floor or ceiling of a per-image
  metric: se 0, no difference) measure nothing: undecidable here."""
  if diff.seeds < MIN_SEEDS or math.isnan(diff.mean):
    return "undecidable here"
  if margin is None and diff.images and diff.se == 0 and diff.mean == 0:
    return "undecidable here"
  half = diff.critical * diff.se
  if margin is not None:
    if abs(diff.mean) + half <= margin:
      return "reproduced"
    if abs(diff.mean) - half > margin:
      return "contradicted"
    return "undecidable here"
  if abs(diff.mean) >= half and diff.mean != 0:
    return "reproduced" if diff.mean * better > 0 else "contradicted"
  if expected is not None and abs(expected) < diff.mdd:
    return "undecidable here"
  return "not at this scale"


def judge_claim(diff: ImagePaired, better: int,
                paper: Optional[tuple[float, float, str]], our_base: float,
                margin: Optional[float] = None
                ) -> tuple[Optional[float], str]:
  """`(expected, verdict)` of a claim with the paper's `(baseline,
  candidate, kind)` numbers (or None): the paper's effect on our scale
  (`expected_effect`, from our baseline's value `our_base`) and `judge`'s
  verdict in the claimed direction — the metric's `better`, or the
  opposite where the paper's numbers show the candidate worse (e.g. SAM's
  clean accuracy)."""
  expected, claimed = None, better
  if paper is not None:
    expected = expected_effect(*paper, our_base, better)
    if expected < 0:
      claimed = -better
  return expected, judge(diff, claimed, expected, margin)


# How a paper's number reads as an error (lower is better): accuracies are
# 100 - accuracy; perplexities and error rates are errors already.
# "ppl_as_nll": perplexities, compared with our metric 100 x a mean token NLL
# (100 ln PPL, lower is better): the effect there is 100 ln(PPL_B / PPL_A)
# at any level of ours (about the relative PPL change, in %).
PAPER_KINDS = ("accuracy", "error", "ppl", "ppl_as_nll")


def relative_change(paper_base: float, paper_candidate: float,
                    kind: str) -> float:
  """The paper's relative change of the error, (e_B - e_A) / e_A: the fair
  reading of an effect across scales (a 0.2-point gain at 76% accuracy is
  a 0.8% relative error reduction; PPL 35.55 -> 35.08 is -1.3%)."""
  if kind not in PAPER_KINDS:
    raise ValueError(f"kind {kind!r}: one of {PAPER_KINDS}")
  if kind == "accuracy":
    ea, eb = 100 - paper_base, 100 - paper_candidate
  else:
    ea, eb = paper_base, paper_candidate
  return (eb - ea) / ea


def expected_effect(paper_base: float, paper_candidate: float, kind: str,
                    our_base: float, our_better: int) -> float:
  """The paper's effect on our scale, in our metric's points: the paper's
  relative error change applied to our baseline's error (`our_base` is the
  baseline's value of our metric; `our_better` +1 for an accuracy, whose
  error is 100 - value, -1 for an error; kind "ppl_as_nll": our metric is
  100 x a mean NLL, the effect 100 ln(PPL_B / PPL_A) whatever `our_base`).
  Positive when it is in the direction our metric calls better."""
  r = relative_change(paper_base, paper_candidate, kind)
  if kind == "ppl_as_nll":  # Our metric is 100 ln PPL, lower is better.
    if our_better != -1:
      raise ValueError("kind 'ppl_as_nll' compares with a metric whose lower "
                       "values are better (100 x a mean NLL)")
    return -100 * math.log1p(r)
  our_error = 100 - our_base if our_better > 0 else our_base
  return -r * our_error
