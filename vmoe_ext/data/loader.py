"""`load_dataset`: one entry point from a data config to train/test splits."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from vmoe_ext.data import builtin, synthetic, tfds_adapter
from vmoe_ext.data.dataset import ArrayDataset
from vmoe_ext.data.preprocessing import Stat
from vmoe_ext.errors import require

_LOADERS: dict[str, Callable[[Mapping[str, Any]], dict[str, ArrayDataset]]] = {
    "mnist5k": lambda config: builtin.mnist5k_datasets(),
    "digits": lambda config: builtin.digits_datasets(),
    "synthetic_clusters": synthetic.load_synthetic_clusters,
    "tfds": tfds_adapter.load_tfds,
}
# "text": a language-model corpus (`vmoe_ext.data.text_config`), read by
# `load_text_data`, not by `load_dataset`.
DATASET_NAMES = (*_LOADERS, "text")

# Per-channel (mean, std) of the raw [0, 1] training images. mnist5k and
# digits: computed on the fixed train splits (`dataset_stats`);
# synthetic_clusters: its default config (mean 0.5 + 0.35 / num_classes);
# cifar10 and imagenet2012: the usual published train-set values.
DEFAULT_NORMALIZATION: dict[str, tuple[Stat, Stat]] = {
    "mnist5k": (0.1309, 0.3080),
    "digits": (0.3053, 0.3755),
    "synthetic_clusters": (0.5875, 0.2007),
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "imagenet2012": ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)),
}


def load_dataset(config: Mapping[str, Any]) -> dict[str, ArrayDataset]:
  """Loads `{"train": ArrayDataset, "test": ArrayDataset}` for a data config.

  Args:
    config: a `ml_collections.ConfigDict` or mapping with `name` one of
      "mnist5k", "digits" (built-in, fixed seed-independent stratified splits;
      see `vmoe_ext.data.builtin`), "synthetic_clusters" (see
      `vmoe_ext.data.synthetic` for its fields and generative model) or
      "tfds" (see `vmoe_ext.data.tfds_adapter`: `tfds_name`, `data_dir`, ...).

  Raises:
    ConfigError: "data.name" for an unknown name; loader-specific fields
      (e.g. "data.data_dir" for a missing or unreadable directory).
  """
  name = config.get("name", None)
  require(name != "text", "data.name",
          "'text' is a language-model corpus: it is read by "
          "vmoe_ext.data.text_config.load_text_data")
  require(name in _LOADERS, "data.name",
          f"unknown dataset {name!r}; expected one of {DATASET_NAMES}")
  splits = _LOADERS[name](config)
  count = config.get("train_examples", None)
  if count is not None and "train" in splits:
    splits = {**splits, "train": stratified_subset(splits["train"], count)}
  return splits


def stratified_subset(dataset: ArrayDataset, count: int) -> ArrayDataset:
  """The first `count` examples of `dataset`, stratified: class c keeps its
  first `count // C` examples in stored order, and classes 0, 1, ... one
  more each until `count` is reached (a class with fewer examples gives
  what it has and the rest goes to the next classes). The order of the kept
  examples is the stored order; `TrainIterator` shuffles.

  Raises:
    ConfigError: "data.train_examples" above the split's size.
  """
  require(count <= len(dataset), "data.train_examples",
          f"{count} training images asked, {dataset.name} has "
          f"{len(dataset)}")
  by_class = [np.flatnonzero(dataset.labels == c)
              for c in range(dataset.num_classes)]
  quota = [0] * dataset.num_classes
  left = count
  while left:  # Round-robin: even quotas, capped by what each class has.
    for c, members in enumerate(by_class):
      if left and quota[c] < len(members):
        quota[c] += 1
        left -= 1
  keep = np.sort(np.concatenate(
      [m[:q] for m, q in zip(by_class, quota)]).astype(np.int64))
  return ArrayDataset(dataset.images[keep], dataset.labels[keep],
                      dataset.num_classes,
                      f"{dataset.name}[:{count} stratified]")


def default_normalization(config: Mapping[str, Any]) -> tuple[Stat, Stat]:
  """`(mean, std)` for a data config.

  Explicit `mean` / `std` config fields win; otherwise the entry of
  `DEFAULT_NORMALIZATION` for `tfds_name` (name "tfds") or `name`; otherwise
  `(0.0, 1.0)` (no normalisation). A streaming TFDS config
  (`data.streaming`) instead gets the statistics that match its `pp_train`
  scaling (`stream_iterator.pp_normalization`: 0.5, 0.5 for
  `value_range(-1, 1)`), so that the in-memory test split is scaled as the
  streamed train images are (which are not normalised again).
  """
  name = config.get("name", None)
  key = config.get("tfds_name", None) if name == "tfds" else name
  mean, std = DEFAULT_NORMALIZATION.get(key, (0.0, 1.0))
  if (name == "tfds" and config.get("streaming", False)
      and config.get("pp_train", None)):
    from vmoe_ext.data import pp  # pylint: disable=g-import-not-at-top
    from vmoe_ext.data.stream_iterator import pp_normalization
    mean, std = pp_normalization(pp.parse(config["pp_train"],
                                          "data.pp_train"))
  config_mean = config.get("mean", None)
  config_std = config.get("std", None)
  return (mean if config_mean is None else config_mean,
          std if config_std is None else config_std)
