"""Verdicts on a paper's claim from a paired multi-seed difference.

Runs of one seed share the data order and, where the shapes agree, the
initial weights, so the comparison of a candidate B with a baseline A is
paired: per seed the difference d_s = metric(B) - metric(A); over n seeds
its mean m, sample std s and standard error se = s / sqrt(n). Verdict:

* "reproduced": m has the claimed sign and |m| >= 2 se;
* "contradicted": m has the other sign and |m| >= 2 se;
* "not at this scale": |m| < 2 se (within noise), or fewer than 3 seeds
  (`MIN_SEEDS`: with two, a discrete metric ties often enough to give
  std 0).

A claim of no effect ("robust to the choice of mu") names a `margin` M
fixed before the runs, and is judged as an equivalence test: reproduced
when the whole interval m ± 2 se lies within ±M; contradicted when it lies
wholly outside (|m| - 2 se > M); otherwise not at this scale.

(2 se is a screening threshold, not a significance test: with 3 seeds a
two-sided 95% t-interval needs 4.3 se. The report prints m, s and se, so a
reader can apply a stricter rule.)

The standard error has a floor: the sampling error of the evaluation set
(`sampling_se`: a percentage on n test images cannot resolve differences
much below 100 sqrt(p (1 - p) / n)), so that a difference of a few images
that happens to repeat on every seed does not count.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Optional

from common import mean_std

VERDICTS = ("reproduced", "not at this scale", "contradicted")
MIN_SEEDS = 3  # Fewer seeds give no decisive verdict.


@dataclasses.dataclass(frozen=True)
class Paired:
  """The paired difference candidate - baseline over seeds; `floor`: the
  least standard error the evaluation set allows (`sampling_se`)."""
  mean: float
  std: float
  n: int
  floor: float = 0.0

  @property
  def se(self) -> float:
    if self.n < 2:
      return float("inf")
    return max(self.std / math.sqrt(self.n), self.floor)


def paired(baseline: Sequence[float], candidate: Sequence[float],
           floor: float = 0.0) -> Paired:
  diffs = [c - b for b, c in zip(baseline, candidate, strict=True)]
  m, s = mean_std(diffs)
  return Paired(m, s, len(diffs), floor)


def sampling_se(percent: float, examples: float, seeds: int) -> float:
  """The standard error that measuring on a finite image set alone gives a
  mean paired difference: a percentage p on n images has the binomial
  std 100 sqrt(p (1 - p) / n) (p as a fraction); the difference of two,
  averaged over `seeds` seeds, sqrt(2 / seeds) times that. With 3 seeds a
  discrete metric can give the same difference on every seed (sample std
  0, e.g. one image of 500 at 1% accuracy); this floor keeps such a
  difference from counting as decisive."""
  if not examples or math.isnan(examples) or math.isnan(percent):
    return 0.0
  p = min(max(percent / 100, 0.0), 1.0)
  return 100 * math.sqrt(p * (1 - p) / examples) * math.sqrt(2 / seeds)


def verdict(diff: Paired, better: int, margin: Optional[float] = None
            ) -> str:
  """The rule of the module docstring; `better` = +1 / -1 is the claimed
  sign of the difference; with `margin`, the equivalence rule."""
  if diff.n < MIN_SEEDS or math.isnan(diff.mean):
    return "not at this scale"
  if margin is not None:
    if abs(diff.mean) + 2 * diff.se <= margin:
      return "reproduced"
    if abs(diff.mean) - 2 * diff.se > margin:
      return "contradicted"
    return "not at this scale"
  if diff.se == 0.0:
    strong = diff.mean != 0.0
  else:
    strong = abs(diff.mean) >= 2 * diff.se
  if not strong:
    return "not at this scale"
  return "reproduced" if diff.mean * better > 0 else "contradicted"
