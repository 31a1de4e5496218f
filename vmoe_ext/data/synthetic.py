"""Synthetic Gaussian-mixture clusters on feature subsets (the ACMoE setting).

Generative model (ACMoE, Lemma 1-2: a Gaussian mixture whose components are
well separated along the features on which they cluster tightly). Let
D = image_size * image_size * channels pixels ("features") and K classes.

1. Structure (from `seed` only): a random permutation of the D features is cut
   into K disjoint subsets S_0, ..., S_{K-1} of `features_per_class` features
   each (default floor(D / K)); features in no subset are shared noise.
2. Class c is the Gaussian N(mu_c, diag(sigma_c^2)) with
     mu_c[q]    = base + separation * [q in S_c]
     sigma_c[q] = tight_std if q in S_c else loose_std.
   So the class means differ only on the class-specific subsets, and each
   class is tight exactly where it differs from the others.
3. Each split has exactly balanced labels (example i has label i mod K before
   a shuffle) and draws x = clip(mu_y + sigma_y * z, 0, 1), z ~ N(0, I),
   reshaped to [image_size, image_size, channels]. The clip keeps the
   [0, 1] image contract; with the defaults (base 0.5, separation 0.35,
   stds 0.05 / 0.15) it touches about 0.1% of the values.

Train and test are independent draws from the same mixture (different random
streams of the same seed), so the whole dataset is a function of the config.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np

from vmoe_ext.data.dataset import ArrayDataset
from vmoe_ext.errors import require

DEFAULTS = {
    "num_classes": 4,
    "image_size": 8,
    "channels": 1,
    "num_train": 1024,
    "num_test": 256,
    "seed": 0,
    "features_per_class": None,  # None: floor(D / num_classes).
    "base": 0.5,
    "separation": 0.35,
    "tight_std": 0.05,
    "loose_std": 0.15,
}

_STRUCTURE_STREAM, _TRAIN_STREAM, _TEST_STREAM = 0, 1, 2


@dataclasses.dataclass(frozen=True)
class ClusterSpec:
  """The mixture behind a synthetic-clusters dataset.

  Attributes:
    means: [K, D] class means mu_c.
    stds: [K, D] per-feature standard deviations sigma_c.
    subsets: [K, M] the feature indices S_c (disjoint across classes).
    image_shape: (H, W, C) with H * W * C = D.
  """
  means: np.ndarray
  stds: np.ndarray
  subsets: np.ndarray
  image_shape: tuple[int, int, int]

  @property
  def num_classes(self) -> int:
    return self.means.shape[0]


def _get(config: Mapping[str, Any], key: str) -> Any:
  value = config.get(key, None)
  return DEFAULTS[key] if value is None else value


def _positive_int(config: Mapping[str, Any], key: str, minimum: int = 1
                  ) -> int:
  value = _get(config, key)
  require(isinstance(value, (int, np.integer)) and not isinstance(value, bool)
          and value >= minimum, f"data.{key}",
          f"must be an integer >= {minimum}, got {value!r}")
  return int(value)


def _float(config: Mapping[str, Any], key: str, positive: bool) -> float:
  value = _get(config, key)
  require(isinstance(value, (int, float, np.floating, np.integer))
          and (value > 0 if positive else True), f"data.{key}",
          f"must be a {'positive ' if positive else ''}number, got {value!r}")
  return float(value)


def cluster_spec(config: Mapping[str, Any]) -> ClusterSpec:
  """The `ClusterSpec` of a synthetic-clusters data config (see module doc)."""
  k = _positive_int(config, "num_classes", minimum=2)
  side = _positive_int(config, "image_size")
  channels = _positive_int(config, "channels")
  seed = _get(config, "seed")
  require(isinstance(seed, (int, np.integer)) and seed >= 0, "data.seed",
          f"must be a non-negative integer, got {seed!r}")
  d = side * side * channels
  m = config.get("features_per_class", None)
  m = d // k if m is None else _positive_int(config, "features_per_class")
  require(m >= 1 and m * k <= d, "data.features_per_class",
          f"needs 1 <= features_per_class * num_classes <= D = {d} "
          f"(disjoint subsets), got {m} * {k}")
  base = _float(config, "base", positive=False)
  separation = _float(config, "separation", positive=False)
  tight = _float(config, "tight_std", positive=True)
  loose = _float(config, "loose_std", positive=True)

  rng = np.random.default_rng([int(seed), _STRUCTURE_STREAM])
  subsets = rng.permutation(d)[:m * k].reshape(k, m)
  in_subset = np.zeros((k, d), bool)
  in_subset[np.arange(k)[:, None], subsets] = True
  means = base + separation * in_subset
  stds = np.where(in_subset, tight, loose)
  return ClusterSpec(means=means, stds=stds, subsets=subsets,
                     image_shape=(side, side, channels))


def sample_clusters(spec: ClusterSpec, num_examples: int,
                    rng: np.random.Generator
                    ) -> tuple[np.ndarray, np.ndarray]:
  """Draws `num_examples` balanced examples from the mixture.

  Returns:
    `(images [N, H, W, C] float32 in [0, 1], labels [N] int32)`.
  """
  labels = rng.permutation(np.arange(num_examples) % spec.num_classes)
  z = rng.standard_normal((num_examples, spec.means.shape[1]))
  x = spec.means[labels] + spec.stds[labels] * z
  x = np.clip(x, 0.0, 1.0).astype(np.float32)
  return x.reshape((num_examples,) + spec.image_shape), labels.astype(np.int32)


def load_synthetic_clusters(config: Mapping[str, Any]
                            ) -> dict[str, ArrayDataset]:
  """`{"train", "test"}` splits of the synthetic mixture described by config."""
  spec = cluster_spec(config)
  seed = int(_get(config, "seed"))
  out = {}
  for split, stream in (("train", _TRAIN_STREAM), ("test", _TEST_STREAM)):
    n = _positive_int(config, f"num_{split}")
    images, labels = sample_clusters(spec, n,
                                     np.random.default_rng([seed, stream]))
    out[split] = ArrayDataset(images, labels, num_classes=spec.num_classes,
                              name=f"synthetic_clusters/{split}")
  return out
