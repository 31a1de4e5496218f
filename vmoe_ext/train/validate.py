"""Config validation for the training binary, before anything is compiled.

`validate_config` checks the config's own values; `validate_shapes` checks what
depends on the data's image shape (patches, routing groups of train and eval
batches) once the data is loaded, still before tracing the model.
"""

from __future__ import annotations

import numbers
from typing import Any

import ml_collections

from vmoe_ext.errors import ConfigError, require
from vmoe_ext.models import build_model
from vmoe_ext.train.optimizer import make_optimizer

SECTIONS = ("seed", "data", "model", "optimizer", "train", "robustness")
TRAIN_FIELDS = ("total_steps", "log_every", "eval_every", "checkpoint_every",
                "keep_checkpoints", "label_smoothing")


def _positive_int(value: Any, field: str) -> None:
  require(isinstance(value, numbers.Integral) and not isinstance(value, bool)
          and value > 0, field, f"must be a positive integer, got {value!r}")


def validate_config(config: ml_collections.ConfigDict) -> None:
  """Raises ConfigError naming the first invalid field."""
  unknown = sorted(set(config.keys()) - set(SECTIONS))
  if unknown:
    raise ConfigError(unknown[0], f"unknown config section; known: "
                      f"{list(SECTIONS)}")
  for section in ("data", "model", "optimizer", "train"):
    require(section in config, section, "missing config section")
  require(isinstance(config.get("seed", 0), numbers.Integral), "seed",
          f"must be an integer, got {config.get('seed')!r}")
  _positive_int(config.data.get("batch_size"), "data.batch_size")
  _positive_int(config.data.get("eval_batch_size"), "data.eval_batch_size")
  train = config.train
  unknown = sorted(set(train.keys()) - set(TRAIN_FIELDS))
  if unknown:
    raise ConfigError(f"train.{unknown[0]}",
                      f"unknown field; known: {list(TRAIN_FIELDS)}")
  _positive_int(train.get("total_steps"), "train.total_steps")
  _positive_int(train.get("log_every"), "train.log_every")
  _positive_int(train.get("checkpoint_every"), "train.checkpoint_every")
  _positive_int(train.get("keep_checkpoints"), "train.keep_checkpoints")
  eval_every = train.get("eval_every", 0)
  require(isinstance(eval_every, numbers.Integral) and eval_every >= 0,
          "train.eval_every", f"must be an integer >= 0, got {eval_every!r}")
  smoothing = train.get("label_smoothing", 0.0)
  require(0.0 <= smoothing < 1.0, "train.label_smoothing",
          f"must be in [0, 1), got {smoothing!r}")
  total = config.optimizer.get("total_steps")
  require(total in (None, train.total_steps), "optimizer.total_steps",
          f"{total} differs from train.total_steps={train.total_steps}; the "
          "schedule would not end with the run")
  make_optimizer(config.optimizer)
  build_model(config.model)
  if config.get("robustness") is not None:
    from vmoe_ext.evaluate.robustness import robustness_config
    robustness_config(config.robustness)


def num_tokens(model, image_shape: tuple[int, ...]) -> int:
  """Tokens per image T for images `[B, H, W, C]`."""
  _, h, w, _ = image_shape
  ph, pw = model.patch_size
  return (h // ph) * (w // pw) + (1 if model.classifier == "token" else 0)


def validate_shapes(config: ml_collections.ConfigDict, model,
                    image_shape: tuple[int, ...]) -> None:
  """Checks patches and routing groups against the data's image shape."""
  _, h, w, _ = image_shape
  ph, pw = model.patch_size
  require(h % ph == 0 and w % pw == 0, "model.patch_size",
          f"patch {tuple(model.patch_size)} does not divide the {h}x{w} "
          "images of the dataset (set data.image_size to resize)")
  if model.moe is None or model.moe["group_size"] is None:
    return
  t = num_tokens(model, image_shape)
  s = model.moe["group_size"]
  for field in ("batch_size", "eval_batch_size"):
    b = config.data[field]
    require((b * t) % s == 0, f"data.{field}",
            f"{b} images x {t} tokens = {b * t} tokens do not fill whole "
            f"routing groups of model.moe.group_size={s}")
