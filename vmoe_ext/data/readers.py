"""Random-access example readers for evaluation on external datasets.

Evaluation sets such as ImageNet-C (75 splits of 50,000 images) do not fit in
memory as float32 arrays, so robustness evaluation reads them in batches
through an `ExampleReader`: anything with a length, a class count, a name and
`read(indices, image_size)` returning raw [0, 1] images of one square size.

Readers: `ArrayReader` (an in-memory `ArrayDataset`, e.g. the run's own test
split), `vmoe_ext.data.tfds_adapter.TfdsReader` (a prepared TFDS split) and
`vmoe_ext.data.image_folder.ImageFolderReader` (class sub-folders of image
files, the layout ImageNet-A/R/O are released in).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

import numpy as np

from vmoe_ext.data import preprocessing
from vmoe_ext.data.dataset import ArrayDataset
from vmoe_ext.data.pipeline import eval_batches
from vmoe_ext.errors import require


class ExampleReader(Protocol):
  """Random access to a labelled image dataset."""

  name: str
  num_classes: int

  def __len__(self) -> int:
    ...

  def read(self, indices: np.ndarray, image_size: int | None
           ) -> tuple[np.ndarray, np.ndarray]:
    """`(images [n, S, S, C] float32 in [0, 1], labels [n] int32)` of the
    examples `indices [n]`, resized to S = image_size (None: stored size)."""
    ...


class ArrayReader:
  """An in-memory `ArrayDataset` as an `ExampleReader`."""

  def __init__(self, dataset: ArrayDataset):
    self.dataset = dataset
    self.name = dataset.name
    self.num_classes = dataset.num_classes

  def __len__(self) -> int:
    return len(self.dataset)

  def read(self, indices: np.ndarray, image_size: int | None
           ) -> tuple[np.ndarray, np.ndarray]:
    images = self.dataset.images[indices]
    if image_size is not None:
      images = preprocessing.resize(images, image_size)
    return images, self.dataset.labels[indices]


def evenly_spaced(num_examples: int, max_examples: int | None) -> np.ndarray:
  """Indices `[n]` of `min(N, max_examples)` evenly spaced examples of N.

  Stored test splits are often ordered by class, so an evenly spaced subset
  keeps every class represented (the first `max_examples` would not).
  """
  if max_examples is None or max_examples >= num_examples:
    return np.arange(num_examples)
  require(max_examples > 0, "max_examples",
          f"must be a positive integer, got {max_examples}")
  return np.unique(np.linspace(0, num_examples - 1,
                               max_examples).round().astype(int))


def reader_batches(reader: ExampleReader, indices: np.ndarray,
                   batch_size: int, image_size: int | None
                   ) -> Iterator[dict[str, np.ndarray]]:
  """Padded evaluation batches (`eval_batches` layout: raw `image`, `label`,
  `mask`) of the examples `indices` of `reader`, read batch by batch."""
  for start in range(0, len(indices), batch_size):
    images, labels = reader.read(indices[start:start + batch_size],
                                 image_size)
    chunk = ArrayDataset(images.astype(np.float32, copy=False),
                         np.asarray(labels, np.int32), reader.num_classes,
                         reader.name)
    yield next(eval_batches(chunk, batch_size))
