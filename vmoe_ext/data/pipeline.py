"""Batching: a resumable shuffled training stream and exhaustive evaluation.

Training (`TrainIterator`): an infinite stream of batches of exactly B
examples. Epoch e visits the examples in the order of a fresh permutation
drawn from `(seed, e)`. Batches *cross epoch boundaries*: when an epoch has
fewer than B examples left, the batch is completed with the first examples of
the next epoch's permutation, so nothing is dropped and every example is seen
equally often (this also works when N < B). Augmentation noise for a batch is
drawn from `(seed, e, i)`, where `(e, i)` is the position of the batch's first
example, so the stream depends only on the seed and the position: the state
`{"epoch": e, "index": i}` (position of the next example) is enough to resume
exactly, even with a different batch size for the remainder.

Evaluation (`eval_batches`): dataset order, fixed batch size; the last batch is
padded with zero images and label 0 and carries `mask = False` there, so every
example is evaluated exactly once and nothing is dropped.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from vmoe_ext.data import preprocessing
from vmoe_ext.data.dataset import ArrayDataset
from vmoe_ext.data.preprocessing import Stat
from vmoe_ext.errors import require

_PERMUTATION_STREAM = 0
_AUGMENT_STREAM = 1


def _check_batch_size(batch_size: int) -> None:
  require(isinstance(batch_size, (int, np.integer)) and batch_size > 0,
          "batch_size", f"must be a positive integer, got {batch_size!r}")


def _seed_word(seed: int) -> int:
  require(isinstance(seed, (int, np.integer)), "seed",
          f"must be an integer, got {seed!r}")
  return int(seed) % 2**64  # SeedSequence entropy must be non-negative.


def epoch_permutation(seed: int, epoch: int, num_examples: int) -> np.ndarray:
  """The visiting order [N] of epoch `epoch` of a `TrainIterator(seed=seed)`."""
  rng = np.random.default_rng([_seed_word(seed), _PERMUTATION_STREAM, epoch])
  return rng.permutation(num_examples)


class TrainIterator:
  """Infinite iterator over shuffled, preprocessed training batches.

  Yields `{"image": [B, H', W', C] float32, "label": [B] int32}` where
  H' = W' = image_size if given (else the dataset's H, W), images resized,
  optionally augmented (random shift with zero padding, optional left-right
  flip), then normalised with `(x - mean) / std`. See the module docstring for
  the exact ordering, epoch-boundary and resume semantics.
  """

  def __init__(self, dataset: ArrayDataset, batch_size: int, seed: int, *,
               image_size: int | None = None, mean: Stat = 0.,
               std: Stat = 1., augment: bool = False, flip: bool = False,
               pad: int | None = None):
    """Builds the iterator at position `{"epoch": 0, "index": 0}`.

    Args:
      dataset: the training split.
      batch_size: B, rows per batch.
      seed: determines every epoch's permutation and all augmentation noise.
      image_size: resize images to this side (None keeps H, W).
      mean: scalar or per-channel normalisation mean.
      std: scalar or per-channel normalisation standard deviation.
      augment: apply random shifts (and flips if `flip`).
      flip: with `augment`, also mirror left-right with probability 1/2; off by
        default since it is wrong for digits.
      pad: maximum shift in pixels; default `max(1, side // 8)`.
    """
    _check_batch_size(batch_size)
    require(len(dataset) > 0, "data", f"training set {dataset.name} is empty")
    self._dataset = dataset
    self._batch_size = int(batch_size)
    self._seed = _seed_word(seed)
    self._image_size = image_size
    self._mean, self._std = mean, std
    self._augment, self._flip = augment, flip
    side = image_size if image_size is not None else dataset.images.shape[1]
    self._pad = preprocessing.default_pad(side) if pad is None else pad
    require(isinstance(self._pad, (int, np.integer)) and self._pad >= 0,
            "data.pad", f"must be a non-negative integer, got {pad!r}")
    # Validate the statistics once, up front, on a dummy image.
    preprocessing.normalize(np.zeros((1, 1, 1, dataset.images.shape[-1]),
                                     np.float32), mean, std)
    self._epoch, self._index = 0, 0
    self._perm_cache: dict[int, np.ndarray] = {}

  @property
  def num_examples(self) -> int:
    return len(self._dataset)

  def _permutation(self, epoch: int) -> np.ndarray:
    if epoch not in self._perm_cache:
      # Keep only the current and the next epoch.
      self._perm_cache = {e: p for e, p in self._perm_cache.items()
                          if e >= epoch - 1}
      self._perm_cache[epoch] = epoch_permutation(self._seed, epoch,
                                                  self.num_examples)
    return self._perm_cache[epoch]

  def __iter__(self) -> TrainIterator:
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    start_epoch, start_index = self._epoch, self._index
    n = self.num_examples
    parts = []
    need = self._batch_size
    while need:
      take = self._permutation(self._epoch)[self._index:self._index + need]
      parts.append(take)
      need -= len(take)
      self._index += len(take)
      if self._index == n:
        self._epoch, self._index = self._epoch + 1, 0
    idx = np.concatenate(parts)
    images = self._dataset.images[idx]
    if self._image_size is not None:
      images = preprocessing.resize(images, self._image_size)
    if self._augment:
      rng = np.random.default_rng(
          [self._seed, _AUGMENT_STREAM, start_epoch, start_index])
      images = preprocessing.random_shift(images, rng, self._pad)
      if self._flip:
        images = preprocessing.random_flip(images, rng)
    return {"image": preprocessing.normalize(images, self._mean, self._std),
            "label": self._dataset.labels[idx]}

  def get_state(self) -> dict[str, int]:
    """Position of the next example: `{"epoch": e, "index": i}` (JSON-able)."""
    return {"epoch": self._epoch, "index": self._index}

  def set_state(self, state: dict[str, int]) -> None:
    """Resumes at a position returned by `get_state`."""
    if set(state) != {"epoch", "index"}:
      raise ValueError(f"state must have keys 'epoch' and 'index', got "
                       f"{sorted(state)}")
    epoch, index = int(state["epoch"]), int(state["index"])
    if epoch < 0 or not 0 <= index < self.num_examples:
      raise ValueError(f"state {state} out of range: need epoch >= 0 and "
                       f"0 <= index < {self.num_examples}")
    self._epoch, self._index = epoch, index


def eval_batches(dataset: ArrayDataset, batch_size: int, *,
                 image_size: int | None = None, mean: Stat = 0.,
                 std: Stat = 1.) -> Iterator[dict[str, np.ndarray]]:
  """Yields every example exactly once, in dataset order, in full batches.

  Each batch is `{"image": [B, H', W', C] float32 (preprocessed), "label": [B]
  int32, "mask": [B] bool}`. All batches have exactly B rows; the last one is
  padded with zero images and label 0, with `mask` False on the padding. There
  are ceil(N / B) batches (none for an empty dataset). Arguments are checked
  when this is called, not at the first batch.
  """
  _check_batch_size(batch_size)
  preprocessing.normalize(np.zeros((1, 1, 1, dataset.images.shape[-1]),
                                   np.float32), mean, std)
  return _eval_batches(dataset, batch_size, image_size, mean, std)


def _eval_batches(dataset: ArrayDataset, batch_size: int,
                  image_size: int | None, mean: Stat, std: Stat
                  ) -> Iterator[dict[str, np.ndarray]]:
  n = len(dataset)
  for start in range(0, n, batch_size):
    stop = min(start + batch_size, n)
    images = preprocessing.preprocess(dataset.images[start:stop],
                                      image_size=image_size, mean=mean,
                                      std=std)
    labels = dataset.labels[start:stop]
    mask = np.ones(stop - start, bool)
    missing = batch_size - (stop - start)
    if missing:
      images = np.concatenate(
          [images, np.zeros((missing,) + images.shape[1:], np.float32)])
      labels = np.concatenate([labels, np.zeros(missing, np.int32)])
      mask = np.concatenate([mask, np.zeros(missing, bool)])
    yield {"image": images, "label": labels, "mask": mask}
