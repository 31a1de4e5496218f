"""`DataSource`: a run's data, in memory or streamed, behind one interface.

The run assembly (`vmoe_ext.app.context`) asks every mode's data of one
object and never branches on how it is stored:

    source = DataSource(config.data, config.seed)
    source.train_iterator()   # the training batches (made once)
    source.sample_batch()     # images [B or B/P, H, W, C] for shapes and init
    source.train_input_map()  # None, or the train step's uint8 -> float32
                              # first op (`data.device_normalize`)
    source.eval_input_map()   # the same for the eval step and eval_batches()
    source.num_classes
    source.test               # the test images held in memory: the whole
                              # split, or with `data.pp_eval` its analysis
                              # subset of `data.analysis_examples` images
    source.eval_batches()     # a fresh pass over the whole test split
    source.train_split()      # the train split for carving's calibration
    source.local_train / local_eval
                              # whether those batches are this process's
                              # share (streamed) or the whole batch

In memory (`data.streaming` False or a non-TFDS dataset): the splits are
loaded once (`load_dataset`; an evaluation that needs no training data reads
only the test split), batches come from `TrainIterator` / `eval_batches`,
normalised by `default_normalization`. Streamed (`data.streaming`): the
train split is read record by record by `StreamingTrainIterator`; the test
split streams too with `data.pp_eval` (`StreamingEvalSplit`), else it is
loaded in memory resized to `data.image_size`.
"""

from __future__ import annotations

from typing import Any, Iterator, Mapping, Optional

import numpy as np

from vmoe_ext.data.dataset import ArrayDataset
from vmoe_ext.data.loader import default_normalization, load_dataset
from vmoe_ext.data.pipeline import TrainIterator, eval_batches
from vmoe_ext.data.stream_eval import (StreamingEvalSplit, open_test_split,
                                       streams_evaluation)
from vmoe_ext.data.stream_iterator import StreamingTrainIterator
from vmoe_ext.data.tfds_adapter import load_tfds_split
from vmoe_ext.errors import require


class DataSource:
  """The data of a run (module docstring); every part is made on first use.

  Args:
    data: the resolved `data` config section.
    seed: the run's seed (data order, augmentation).
  """

  def __init__(self, data: Mapping[str, Any], seed: int):
    self.config = data
    self.seed = seed
    self.local_train = bool(data["name"] == "tfds" and data.get("streaming"))
    self.local_eval = streams_evaluation(data)
    self._splits: Optional[dict[str, ArrayDataset]] = None
    self._train_iter: Any = None
    self._eval_split: Optional[StreamingEvalSplit] = None
    self._test: Optional[ArrayDataset] = None

  # ------------------------------------------------------------- training

  @property
  def in_memory(self) -> bool:
    """Whether the splits were loaded in memory (`load_dataset`)."""
    return self._splits is not None

  @property
  def opened_training(self) -> bool:
    """Whether a training iterator was made (an evaluation makes none; the
    built-in datasets load both splits whenever one is read)."""
    return self._train_iter is not None

  def _in_memory(self) -> dict[str, ArrayDataset]:
    if self._splits is None:
      self._splits = load_dataset(self.config)
    return self._splits

  def train_iterator(self) -> TrainIterator | StreamingTrainIterator:
    """The training batch iterator (one per source; its state is the data
    position a checkpoint stores)."""
    if self._train_iter is None:
      data = self.config
      if self.local_train:
        self._train_iter = StreamingTrainIterator(data, self.seed)
      else:
        mean, std = default_normalization(data)
        self._train_iter = TrainIterator(
            self._in_memory()["train"], data["batch_size"], self.seed,
            image_size=data["image_size"], mean=mean, std=std,
            augment=data["augment"], flip=data["flip"], pad=data["pad"])
    return self._train_iter

  def sample_batch(self) -> np.ndarray:
    """Training images as the train step sees them (no augmentation)."""
    if self.local_train:
      return self.train_iterator().sample_batch()
    data = self.config
    mean, std = default_normalization(data)
    return next(TrainIterator(self._in_memory()["train"], data["batch_size"],
                              self.seed, image_size=data["image_size"],
                              mean=mean, std=std))["image"]

  def train_input_map(self):
    """The train step's first op on the images of a training batch: with
    `data.device_normalize`, uint8 -> float32 by `data.pp_train`'s trailing
    pixel map (`StreamingTrainIterator.device_map`); else None."""
    if not (self.local_train and self.config.get("device_normalize")):
      return None
    channels = self.sample_batch().shape[-1]
    return self.train_iterator().device_map(channels)

  @property
  def num_classes(self) -> int:
    if self.local_train:
      return self.train_iterator().num_classes
    return self._in_memory()["train"].num_classes

  def train_split(self) -> ArrayDataset | StreamingEvalSplit:
    """The train split, in memory or streamed through `data.pp_eval` (read
    record by record, preprocessed as for evaluation)."""
    if not self.local_train:
      return self._in_memory()["train"]
    return StreamingEvalSplit(self.config,
                              split=self.config["train_split"],
                              split_field="data.train_split")

  # ----------------------------------------------------------- evaluation

  @property
  def test(self) -> ArrayDataset:
    """The test images held in memory (see the module docstring)."""
    if self._test is None:
      data = self.config
      if self.local_eval:
        self._test = self._streamed_test().analysis_dataset(
            data["analysis_examples"])
      elif self._splits is not None:  # Loaded with the train split.
        self._test = self._splits["test"]
      elif data["name"] == "tfds":  # Only the test split is read.
        self._test = load_tfds_split(data, data["test_split"],
                                     split_field="data.test_split",
                                     image_size=data["image_size"])
      else:
        self._test = self._in_memory()["test"]
    return self._test

  def _streamed_test(self) -> StreamingEvalSplit:
    if self._eval_split is None:
      self._eval_split = open_test_split(self.config)
    return self._eval_split

  def eval_batches(self) -> Iterator[dict]:
    """Every test example once, padded + masked, preprocessed (streamed:
    this process's share of each batch)."""
    data = self.config
    if self.local_eval:
      return self._streamed_test().batches(data["eval_batch_size"])
    mean, std = default_normalization(data)
    return eval_batches(self.test, data["eval_batch_size"],
                        image_size=data["image_size"], mean=mean, std=std)

  def eval_input_map(self):
    """The evaluation step's first op on `eval_batches()` images: with
    `data.device_normalize` and a streamed test split, uint8 -> float32 by
    `data.pp_eval`'s trailing pixel map; else None."""
    if not (self.local_eval and self.config.get("device_normalize")):
      return None
    return self._streamed_test().device_map()

  def check_channels(self, sample: np.ndarray) -> None:
    """A streamed train split's preprocessing gives the test split's
    channels."""
    require(self.test.images.shape[-1] == sample.shape[-1], "data.pp_train",
            f"gives {sample.shape[-1]}-channel images; the test split has "
            f"{self.test.images.shape[-1]}")

  def close(self) -> None:
    """Stops a streaming iterator's workers (no-op in memory)."""
    close = getattr(self._train_iter, "close", None)
    if close is not None:
      close()


__all__ = ["DataSource"]
