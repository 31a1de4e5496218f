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


def _import_tfds():
  try:
    import tensorflow_datasets as tfds  # Heavy optional import, only when used.
  except ImportError as e:
    raise ConfigError(
        "data.name", "name='tfds' needs the tensorflow-datasets package: "
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


def _stack_images(images: Sequence[np.ndarray], image_size: int | None,
                  name: str) -> np.ndarray:
  if image_size is not None:
    return np.concatenate([preprocessing.resize(x[None], image_size)
                           for x in images]) if images else np.zeros(
                               (0, image_size, image_size, 1), np.float32)
  shapes = {x.shape for x in images}
  require(len(shapes) <= 1, "data.image_size",
          f"{name} has images of different shapes (e.g. {sorted(shapes)[:2]}); "
          "set data.image_size to resize them when reading")
  return np.stack(images) if images else np.zeros((0, 1, 1, 1), np.float32)


def _read_array_record(source, num: int, image_key: str, label_key: str
                       ) -> tuple[list[np.ndarray], list[int]]:
  images, labels = [], []
  for i in range(num):
    example = source[i]
    images.append(_to_unit_float(example[image_key], "data.image_key"))
    labels.append(int(example[label_key]))
  return images, labels


def _read_with_tensorflow(tfds, builder, split: str, num: int | None,
                          image_key: str, label_key: str, name: str
                          ) -> tuple[list[np.ndarray], list[int]]:
  try:
    importlib.import_module("tensorflow")
  except ImportError as e:
    raise ConfigError(
        "data.data_dir",
        f"{name} is prepared under the data_dir in the tfrecord format, which "
        "only TensorFlow can read: pip install tensorflow-cpu, or prepare the "
        "dataset with file_format='array_record' (read without TensorFlow)"
    ) from e
  ds = builder.as_dataset(split=split, shuffle_files=False)
  if num is not None:
    ds = ds.take(num)
  images, labels = [], []
  for example in tfds.as_numpy(ds):
    images.append(_to_unit_float(example[image_key], "data.image_key"))
    labels.append(int(example[label_key]))
  return images, labels


def load_tfds(config: Mapping[str, Any]) -> dict[str, ArrayDataset]:
  """`{"train", "test"}` splits of a prepared TFDS dataset (module doc)."""
  name = config.get("tfds_name", None)
  require(isinstance(name, str) and name, "data.tfds_name",
          f"required with name='tfds' (e.g. 'cifar10'), got {name!r}")
  data_dir = check_data_dir(config.get("data_dir", None))
  image_key = config.get("image_key", None) or "image"
  label_key = config.get("label_key", None) or "label"
  image_size = config.get("image_size", None)
  max_examples = config.get("max_examples", None)
  require(max_examples is None or (
      isinstance(max_examples, (int, np.integer)) and max_examples > 0),
          "data.max_examples",
          f"must be None or a positive integer, got {max_examples!r}")

  tfds = _import_tfds()
  try:
    builder = tfds.builder(name, data_dir=data_dir, try_gcs=False)
  except tfds.core.DatasetNotFoundError as e:
    raise ConfigError("data.tfds_name",
                      f"TFDS has no dataset named {name!r}") from e
  features = builder.info.features
  require(image_key in features, "data.image_key",
          f"{name} has no feature {image_key!r}; features: {list(features)}")
  require(label_key in features and hasattr(features[label_key],
                                            "num_classes"),
          "data.label_key",
          f"{name} has no class-label feature {label_key!r}; features: "
          f"{list(features)}")
  num_classes = int(features[label_key].num_classes)
  known_splits = list(builder.info.splits)

  out = {}
  for key in ("train", "test"):
    field = f"data.{key}_split"
    split = config.get(f"{key}_split", None) or key
    if known_splits:  # Empty only for datasets whose info lacks splits.
      for base in _split_names(split):
        require(base in known_splits, field,
                f"{name} has no split {base!r}; splits: {known_splits}")
    try:
      source = builder.as_data_source(split=split)
    except Exception as e:  # pylint: disable=broad-except
      if not builder.is_prepared():
        raise ConfigError(
            "data.data_dir", f"no prepared copy of {name} under {data_dir!r} "
            f"(expected {builder.data_dir}); nothing is downloaded") from e
      if not isinstance(e, NotImplementedError):
        raise
      images, labels = _read_with_tensorflow(tfds, builder, split,
                                             max_examples, image_key,
                                             label_key, name)
    else:
      num = len(source) if max_examples is None else min(len(source),
                                                          max_examples)
      images, labels = _read_array_record(source, num, image_key, label_key)
    out[key] = ArrayDataset(
        images=_stack_images(images, image_size, f"{name}/{split}"),
        labels=np.asarray(labels, np.int32).reshape(-1),
        num_classes=num_classes, name=f"tfds:{name}/{split}")
  return out
