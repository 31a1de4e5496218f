"""Data: built-in offline datasets, synthetic clusters, TFDS adapter, batching,
random-access readers for evaluation datasets (`readers`, `image_folder`).

Nothing here downloads. Loaders return `{"train", "test"}` `ArrayDataset`s of
raw [0, 1] images; `TrainIterator` / `eval_batches` resize, augment and
normalise per batch.
"""

from vmoe_ext.data.builtin import load_digits, load_mnist5k
from vmoe_ext.data.dataset import ArrayDataset, dataset_stats
from vmoe_ext.data.loader import (DATASET_NAMES, DEFAULT_NORMALIZATION,
                                  default_normalization, load_dataset)
from vmoe_ext.data.pipeline import TrainIterator, eval_batches
from vmoe_ext.data.preprocessing import preprocess, resize
from vmoe_ext.data.synthetic import ClusterSpec, cluster_spec

__all__ = [
    "ArrayDataset",
    "ClusterSpec",
    "DATASET_NAMES",
    "DEFAULT_NORMALIZATION",
    "TrainIterator",
    "cluster_spec",
    "dataset_stats",
    "default_normalization",
    "eval_batches",
    "load_dataset",
    "load_digits",
    "load_mnist5k",
    "preprocess",
    "resize",
]
