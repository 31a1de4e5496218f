"""Reads any prepared TFDS image classification dataset from a local `data_dir`.

Nothing is ever downloaded: the builder is opened with `data_dir` and no GCS
look-up, and only already prepared files are read.

* Datasets prepared in the `array_record` file format are read with TFDS's
  random-access data sources (`builder.as_data_source`), which need only
  `tensorflow-datasets` (pip extra `vmoe_ext[tfds]`), *not* TensorFlow.
* Datasets prepared in the default `tfrecord` format can only be read through
  `tf.data`, which needs TensorFlow installed as well
  (`pip install tensorflow-cpu`). Without it a `ConfigError` explains the two
  ways out (install TensorFlow or re-prepare with
  `file_format="array_record"`).

Images are decoded to uint8 [H, W, C] and scaled to float32 [0, 1]; a whole
split is held in memory (use `max_examples` to cap it). Datasets with
variable-size images (e.g. imagenet2012) need `data.image_size`: each image is
then resized to a square of that side when read.

Config fields (under `data`): `tfds_name` (required), `data_dir` (required; an
existing, readable directory), `train_split` ("train"), `test_split`
("test"), `max_examples` (None: all), `image_key` ("image"), `label_key`
("label"), `image_size` (None).
"""

from __future__ import annotations

import importlib
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from vmoe_ext.data import preprocessing
from vmoe_ext.data.dataset import ArrayDataset
from vmoe_ext.errors import ConfigError, require


def check_data_dir(data_dir: Any, field: str = "data.data_dir") -> str:
  """Returns `data_dir` if it is an existing, readable local directory."""
  require(isinstance(data_dir, (str, os.PathLike)) and str(data_dir), field,
          f"required: the directory holding the prepared dataset, got "
          f"{data_dir!r}")
  path = os.fspath(data_dir)
  require(os.path.exists(path), field, f"directory {path!r} does not exist")
  require(os.path.isdir(path), field, f"{path!r} is not a directory")
  require(os.access(path, os.R_OK | os.X_OK), field,
          f"directory {path!r} is not readable")
  return path


def _import_tfds(field: str = "data.name"):
  try:
    import tensorflow_datasets as tfds  # Heavy optional import, only when used.
  except ImportError as e:
    raise ConfigError(
        field, "TFDS datasets need the tensorflow-datasets package: "
        "pip install 'vmoe_ext[tfds]'") from e
  return tfds


def _split_names(split: str) -> list[str]:
  """Base split names of a TFDS split expression, e.g. 'train[:10%]+test'."""
  return [re.split(r"[\[(]", part.strip())[0] for part in split.split("+")]


def _to_unit_float(image: np.ndarray, field: str) -> np.ndarray:
  image = np.asarray(image)
  if image.ndim == 2:
    image = image[..., None]
  require(image.ndim == 3, field,
          f"expected [H, W, C] images, got shape {image.shape}")
  if image.dtype == np.uint8:
    return image.astype(np.float32) / 255.0
  if image.dtype == np.uint16:
    return image.astype(np.float32) / 65535.0
  require(np.issubdtype(image.dtype, np.floating), field,
          f"unsupported image dtype {image.dtype}")
  return image.astype(np.float32)


def _read_with_tensorflow(tfds, builder, split: str, num: int | None,
                          image_key: str, label_key: str, name: str,
                          prefix: str) -> tuple[list[np.ndarray], list[int]]:
  try:
    importlib.import_module("tensorflow")
  except ImportError as e:
    raise ConfigError(
        f"{prefix}.data_dir",
        f"{name} is prepared under the data_dir in the tfrecord format, which "
        "only TensorFlow can read: pip install tensorflow-cpu, or prepare the "
        "dataset with file_format='array_record' (read without TensorFlow)"
    ) from e
  ds = builder.as_dataset(split=split, shuffle_files=False)
  if num is not None:
    ds = ds.take(num)
  images, labels = [], []
  for example in tfds.as_numpy(ds):
    images.append(_to_unit_float(example[image_key], f"{prefix}.image_key"))
    labels.append(int(example[label_key]))
  return images, labels


def _open_builder(config: Mapping[str, Any], prefix: str):
  """`(tfds, builder, image_key, label_key, max_examples)` of a config."""
  name = config.get("tfds_name", None)
  require(isinstance(name, str) and name, f"{prefix}.tfds_name",
          f"required with name='tfds' (e.g. 'cifar10'), got {name!r}")
  data_dir = check_data_dir(config.get("data_dir", None), f"{prefix}.data_dir")
  image_key = config.get("image_key", None) or "image"
  label_key = config.get("label_key", None) or "label"
  max_examples = config.get("max_examples", None)
  require(max_examples is None or (
      isinstance(max_examples, (int, np.integer)) and max_examples > 0),
          f"{prefix}.max_examples",
          f"must be None or a positive integer, got {max_examples!r}")

  tfds = _import_tfds(f"{prefix}.tfds_name" if prefix != "data"
                      else "data.name")
  try:
    builder = tfds.builder(name, data_dir=data_dir, try_gcs=False)
  except tfds.core.DatasetNotFoundError as e:
    raise ConfigError(f"{prefix}.tfds_name",
                      f"TFDS has no dataset named {name!r}") from e
  except ValueError as e:  # e.g. an unknown builder config "name/config".
    raise ConfigError(f"{prefix}.tfds_name", f"{name!r}: {e}") from e
  features = builder.info.features
  require(image_key in features, f"{prefix}.image_key",
          f"{name} has no feature {image_key!r}; features: {list(features)}")
  require(label_key in features and hasattr(features[label_key],
                                            "num_classes"),
          f"{prefix}.label_key",
          f"{name} has no class-label feature {label_key!r}; features: "
          f"{list(features)}")
  return tfds, builder, image_key, label_key, max_examples


class TfdsReader:
  """Random access to one split of a prepared TFDS dataset (`ExampleReader`).

  Array-record data is read example by example from the data source, so a
  split never has to fit in memory; tfrecord data (TensorFlow needed) is read
  whole when opened.
  """

  def __init__(self, config: Mapping[str, Any], split: str, *,
               prefix: str = "data", split_field: str | None = None):
    """Opens `split` of `config.tfds_name` (see `load_tfds_split`)."""
    tfds, builder, image_key, label_key, max_examples = _open_builder(
        config, prefix)
    name = config.get("tfds_name")
    field = split_field or f"{prefix}.split"
    require(isinstance(split, str) and split, field,
            f"must be a TFDS split name, got {split!r}")
    known_splits = list(builder.info.splits)
    if known_splits:  # Empty only for datasets whose info lacks splits.
      for base in _split_names(split):
        require(base in known_splits, field,
                f"{name} has no split {base!r}; splits: {known_splits}")
    self.name = f"tfds:{name}/{split}"
    self.num_classes = int(builder.info.features[label_key].num_classes)
    self._keys = (image_key, label_key)
    self._prefix = prefix
    self._source = self._loaded = None
    try:
      self._source = builder.as_data_source(split=split)
    except Exception as e:  # pylint: disable=broad-except
      if not builder.is_prepared():
        raise ConfigError(
            f"{prefix}.data_dir", f"no prepared copy of {name} under "
            f"{config.get('data_dir')!r} (expected {builder.data_dir}); "
            "nothing is downloaded") from e
      if not isinstance(e, NotImplementedError):
        raise
      self._loaded = _read_with_tensorflow(tfds, builder, split, max_examples,
                                           image_key, label_key, name, prefix)
      self._len = len(self._loaded[1])
    else:
      self._len = (len(self._source) if max_examples is None
                   else min(len(self._source), max_examples))

  def __len__(self) -> int:
    return self._len

  def read(self, indices: np.ndarray, image_size: int | None
           ) -> tuple[np.ndarray, np.ndarray]:
    """`(images [n, S, S, C] float32 in [0, 1], labels [n] int32)`."""
    indices = [int(i) for i in np.asarray(indices).reshape(-1)]
    if self._loaded is not None:
      images = [self._loaded[0][i] for i in indices]
      labels = [self._loaded[1][i] for i in indices]
    else:
      image_key, label_key = self._keys
      images, labels = [], []
      for i in indices:
        example = self._source[i]
        images.append(_to_unit_float(example[image_key],
                                     f"{self._prefix}.image_key"))
        labels.append(int(example[label_key]))
    return (preprocessing.stack_images(images, image_size, self.name,
                                       f"{self._prefix}.image_size"),
            np.asarray(labels, np.int32).reshape(-1))


def load_tfds_split(config: Mapping[str, Any], split: str, *,
                    prefix: str = "data", split_field: str | None = None,
                    image_size: int | None = None) -> ArrayDataset:
  """One split of a prepared TFDS dataset, whole, as an `ArrayDataset`.

  Args:
    config: mapping with `tfds_name`, `data_dir` and optionally `image_key`,
      `label_key`, `max_examples` (the first N; module doc); `tfds_name` may
      name a builder config, e.g. "imagenet2012_corrupted/fog_3".
    split: a TFDS split expression, e.g. "validation" or "test[:10%]".
    prefix: config path named in errors ("data", "robustness.datasets.x").
    split_field: field named in split errors (default `{prefix}.split`).
    image_size: resize every image to this square side when read (None: keep
      the stored size; all images must then share one shape).
  """
  reader = TfdsReader(config, split, prefix=prefix, split_field=split_field)
  images, labels = reader.read(np.arange(len(reader)), image_size)
  return ArrayDataset(images=images, labels=labels,
                      num_classes=reader.num_classes, name=reader.name)


def load_tfds(config: Mapping[str, Any]) -> dict[str, ArrayDataset]:
  """`{"train", "test"}` splits of a prepared TFDS dataset (module doc)."""
  return {key: load_tfds_split(
      config, config.get(f"{key}_split", None) or key,
      split_field=f"data.{key}_split",
      image_size=config.get("image_size", None)) for key in ("train", "test")}
