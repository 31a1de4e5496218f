"""In-memory image classification datasets.

Every loader in `vmoe_ext.data` returns `ArrayDataset`s: whole splits held as
numpy arrays in their raw range [0, 1]; normalisation, resizing and
augmentation happen later, per batch (`vmoe_ext.data.pipeline`).
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class ArrayDataset:
  """One split of an image classification dataset, held in memory.

  Attributes:
    images: [N, H, W, C] float32 in the raw range [0, 1] (not normalised).
    labels: [N] int32 in [0, num_classes).
    num_classes: number of classes K.
    name: a human-readable name, e.g. "mnist5k/train".
  """
  images: np.ndarray
  labels: np.ndarray
  num_classes: int
  name: str

  def __post_init__(self):
    if self.images.ndim != 4:
      raise ValueError(f"{self.name}: images must be [N, H, W, C], got shape "
                       f"{self.images.shape}")
    if self.images.dtype != np.float32:
      raise ValueError(f"{self.name}: images must be float32, got "
                       f"{self.images.dtype}")
    if self.labels.shape != self.images.shape[:1]:
      raise ValueError(f"{self.name}: labels must be [N] with N = "
                       f"{self.images.shape[0]}, got shape {self.labels.shape}")
    if self.labels.dtype != np.int32:
      raise ValueError(f"{self.name}: labels must be int32, got "
                       f"{self.labels.dtype}")
    if len(self.labels) and (self.labels.min() < 0
                             or self.labels.max() >= self.num_classes):
      raise ValueError(f"{self.name}: labels must lie in [0, "
                       f"{self.num_classes}), got [{self.labels.min()}, "
                       f"{self.labels.max()}]")

  def __len__(self) -> int:
    return self.images.shape[0]

  @property
  def image_shape(self) -> tuple[int, int, int]:
    """`(H, W, C)` of one image."""
    return tuple(self.images.shape[1:])


def dataset_stats(dataset: ArrayDataset
                  ) -> tuple[tuple[float, ...], tuple[float, ...]]:
  """Per-channel mean and standard deviation over all pixels of `dataset`.

  Returns:
    `(mean, std)`, each a tuple of C floats, computed in float64 over the
    [N, H, W] axes of the raw images.
  """
  x = dataset.images.astype(np.float64)
  mean = x.mean(axis=(0, 1, 2))
  std = x.std(axis=(0, 1, 2))
  return tuple(float(m) for m in mean), tuple(float(s) for s in std)
