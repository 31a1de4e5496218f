"""Each test image's outcome under every evaluation, for paired statistics.

With `robustness.per_example=True` the robustness evaluation also writes
`per_example.npz` into the workdir: for every evaluation it ran (clean,
each attack, each sweep point, each corruption and severity) the test-split
indices of the images it saw and, per image, whether the top-1 and the
top-5 predictions were correct. Two runs evaluated on the same images can
then be compared image by image (McNemar's test, a paired bootstrap over
images) instead of only by their accuracies.

Keys of the file, for an evaluation named EVAL (`clean`,
`adversarial/pgd/eps=0.05`, `sweep/pgd/eps=0.01`,
`corruption/gaussian_noise/s3`): `EVAL/index` `[n]` int, `EVAL/correct`
`[n]` bool, `EVAL/top5` `[n]` bool; and `label` `[N]`, the labels of the
whole test split.
"""

from __future__ import annotations

import os
from typing import Optional

import numpy as np

FILENAME = "per_example.npz"


def subset_index(size: int, n: Optional[int]) -> np.ndarray:
  """`[min(n, size)]` int: the evenly spaced indices of the evaluation
  subset of `n` images of a split of `size` (the test splits are stored
  class by class, so every class is represented); all for `n` None."""
  if n is None or n >= size:
    return np.arange(size)
  return np.linspace(0, size - 1, n).round().astype(int)


def eval_name(kind: str, name: str, eps: Optional[float] = None) -> str:
  """`adversarial/pgd/eps=0.05`, `corruption/fog/s3`, ...: the key of one
  evaluation in the file."""
  return f"{kind}/{name}" + ("" if eps is None else f"/eps={eps:g}")


class PerExample:
  """Collects the per-image outcomes of one robustness evaluation; does
  nothing when `enabled` is False (the default evaluation's cost stays)."""

  def __init__(self, labels: np.ndarray, enabled: bool):
    self.enabled = enabled
    self.arrays: dict[str, np.ndarray] = {"label": np.asarray(labels)}

  def add(self, name: str, index: np.ndarray, correct: np.ndarray,
          top5: np.ndarray) -> None:
    """Records evaluation `name`: test-split `index` `[n]` and its images'
    top-1 / top-5 `[n]` correctness. A name already recorded (the same
    attack and eps listed twice) gets a suffix `#2`, `#3`."""
    if not self.enabled:
      return
    key, k = name, 1
    while f"{key}/index" in self.arrays:
      k += 1
      key = f"{name}#{k}"
    index, correct, top5 = (np.asarray(a) for a in (index, correct, top5))
    if not index.shape == correct.shape == top5.shape:
      raise ValueError(f"{name}: index {index.shape}, correct "
                       f"{correct.shape} and top5 {top5.shape} differ")
    self.arrays[f"{key}/index"] = index.astype(np.int32)
    self.arrays[f"{key}/correct"] = correct.astype(bool)
    self.arrays[f"{key}/top5"] = top5.astype(bool)

  def write(self, workdir: str) -> Optional[str]:
    """Writes WORKDIR/per_example.npz (when enabled); returns its path."""
    if not self.enabled:
      return None
    path = os.path.join(workdir, FILENAME)
    np.savez_compressed(path, **self.arrays)
    return path


def load(workdir: str) -> dict[str, dict[str, np.ndarray]]:
  """`{EVAL: {"index", "correct", "top5"}}` and `{"label": {"label"}}` from
  WORKDIR/per_example.npz (FileNotFoundError where the run wrote none)."""
  with np.load(os.path.join(workdir, FILENAME)) as data:
    out: dict[str, dict[str, np.ndarray]] = {}
    for key in data.files:
      name, _, field = key.rpartition("/")
      if not name:
        name, field = key, key
      out.setdefault(name, {})[field] = data[key]
  return out
