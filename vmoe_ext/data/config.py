"""The `data` config section: dataset name, batching, dataset-specific fields.

Its fields depend on `name`: every image dataset has `DATA_COMMON`; "tfds"
adds `DATA_TFDS` (and the streaming fields, checked by
`stream_iterator.check_streaming_config`); "synthetic_clusters" adds the
fields of `synthetic.DEFAULTS`. "text" (a language-model corpus) has
`text_config.TEXT_DATA` instead, checked by `text_config.check_text_data`.
"""

from __future__ import annotations

from typing import Any, Mapping

from vmoe_ext.config.schema import (REQUIRED, Field, OneOf, Section, Seq,
                                    Spec, default_fields)
from vmoe_ext.data.loader import DATASET_NAMES
from vmoe_ext.data.stream_iterator import check_streaming_config
from vmoe_ext.data.synthetic import DEFAULTS as SYNTHETIC_DEFAULTS
from vmoe_ext.data.text_config import (TEXT_DATA, TEXT_DATASET_NAME,
                                       check_text_data)
from vmoe_ext.errors import require

_STAT = OneOf((Field("float"), Seq(Field("float"), min_length=1)),
              "a number or a list of per-channel numbers", nullable=True)
DATA_COMMON: dict[str, Spec] = {
    "name": Field("str", REQUIRED, choices=DATASET_NAMES),
    "batch_size": Field("int", REQUIRED, low=1),
    "eval_batch_size": Field("int", REQUIRED, low=1),
    "image_size": Field("int", None, nullable=True, low=1,
                        doc="resize to this side (None: native)"),
    "train_examples": Field("int", None, nullable=True, low=1,
                            doc="keep only this many training images, "
                                "stratified: per class in stored order, "
                                "classes as even as N allows (None: all)"),
    "augment": Field("bool", False),
    "flip": Field("bool", False),
    "pad": Field("int", None, nullable=True, low=0),
    "mean": _STAT,
    "std": _STAT,
    "analysis_tsne_tokens": Field("int", 1000, low=0,
                                  doc="MoE-input tokens per layer in the "
                                      "routing analysis's t-SNE figure "
                                      "(fewer than 10: no figure)"),
}
DATA_TFDS: dict[str, Spec] = {
    "tfds_name": Field("str", REQUIRED),
    "data_dir": Field("str", None, nullable=True,
                      doc="required to load; checked when loading"),
    "train_split": Field("str", "train"),
    "test_split": Field("str", "test"),
    "max_examples": Field("int", None, nullable=True, low=1),
    "image_key": Field("str", None, nullable=True),
    "label_key": Field("str", None, nullable=True),
    "streaming": Field("bool", False,
                       doc="stream the train split (Grain), not in memory"),
    "pp_train": Field("str", None, nullable=True,
                      doc="train preprocessing string; streaming only"),
    "worker_count": Field("int", 0, low=0,
                          doc="streaming: preprocessing processes (0: none)"),
    "device_normalize": Field("bool", False,
                              doc="streaming: uint8 batches, pp_train's "
                                  "(pp_eval's) trailing value_range applied "
                                  "in the step (bit-identical)"),
    "pp_eval": Field("str", None, nullable=True,
                     doc="streaming: eval preprocessing string; set: the "
                         "test split streams too"),
    "analysis_examples": Field("int", 1024, low=1,
                               doc="with pp_eval: test examples held in "
                                   "memory for routing analysis/robustness"),
}


def _data_fields(value: Mapping[str, Any]) -> dict[str, Spec]:
  name = value.get("name")
  if name == TEXT_DATASET_NAME:  # No image fields.
    return {"name": DATA_COMMON["name"], **TEXT_DATA}
  fields = dict(DATA_COMMON)
  if name == "tfds":
    fields.update(DATA_TFDS)
  elif name == "synthetic_clusters":
    extra = default_fields(SYNTHETIC_DEFAULTS, {"features_per_class": Field("int")})
    fields.update({k: v for k, v in extra.items() if k not in fields})
  return fields


def _check_data(value: dict[str, Any]) -> None:
  """Streaming fields (`vmoe_ext.data.stream_iterator`) and text corpora
  (`check_text_data`): checked here, once."""
  if value.get("name") == TEXT_DATASET_NAME:
    check_text_data(value)
    return
  if value.get("name") != "tfds":
    return
  if value.get("streaming"):
    require(value.get("train_examples") is None, "train_examples",
            "not with data.streaming=True (a streamed split is not held "
            "in memory; data.max_examples bounds what is read)")
    check_streaming_config(value)
  else:
    require(not value.get("device_normalize"), "device_normalize",
            "only with data.streaming=True (it moves data.pp_train's "
            "trailing value_range into the train step)")
    for key in ("pp_train", "pp_eval"):
      require(value.get(key) is None, key,
              "only used with data.streaming=True (the in-memory path "
              "preprocesses with data.image_size / augment / flip / pad)")


DATA = Section(_data_fields, check=_check_data)

__all__ = ["DATA", "DATA_COMMON", "DATA_TFDS"]
