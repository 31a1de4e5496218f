"""The test sample's share of a per-seed paired difference's error.

Runs of one seed share the data order and, where the shapes agree, the
initial weights, so a per-seed comparison of a candidate B with a
baseline A is paired: d_s = metric(B) - metric(A). The spread of the d_s
shows the training noise only: every seed is measured on the same test
images, so a different test sample would move every d_s alike. Where the
runs recorded only accuracies (not each image's outcome), `sampling_se`
bounds that share from below by the binomial error of the evaluation set;
`paired_stats.paired_seeds` takes it as the floor of the standard error and
`paired_stats.judge` gives the verdict (where each image's outcome is
recorded, `paired_stats.paired_images` measures the share instead).
"""

from __future__ import annotations

import math


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
