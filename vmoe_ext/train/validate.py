"""Config validation for the training binary, before anything is compiled.

`validate_config` checks the config against its schema
(`vmoe_ext.config.sections`: unknown fields at any depth, types, NaN/inf,
ranges, the components' own checks) plus what spans sections;
`validate_shapes` checks what depends on the data (patches and routing groups
against the image shape, the classifier against the number of classes) once
the data is loaded, still before tracing the model. Every `ConfigError` names
the full dotted path.
The robustness section's evaluation datasets are checked by
`vmoe_ext.evaluate.robustness.robustness_config` (the binary calls it).
"""

from __future__ import annotations

from typing import Any, Optional

import jax
import ml_collections

from vmoe_ext.config import CONFIG, SECTIONS, validate
from vmoe_ext.errors import field_scope, require
from vmoe_ext.train.optimizer import make_optimizer
from vmoe_ext.train.steps import mixup_options

TRAIN_FIELDS = tuple(CONFIG.fields_of({})["train"].fields)


def validate_config(config: ml_collections.ConfigDict) -> None:
  """Raises ConfigError naming the first invalid field."""
  validate(CONFIG, config)
  with field_scope("optimizer"):
    make_optimizer(config.optimizer)
  train_steps = config.train.total_steps
  total = config.optimizer.get("total_steps")
  require(total in (None, train_steps), "optimizer.total_steps",
          f"{total} differs from train.total_steps={train_steps}; the "
          "schedule would not end with the run")
  robustness = config.get("robustness")
  require(not (robustness is not None and robustness.get("from_init"))
          or config.get("init") is not None, "robustness.from_init",
          "evaluates the params the init section loads, but init is None")
  _validate_mixup(config)


def _validate_mixup(config: ml_collections.ConfigDict) -> None:
  """With mixup on: the batch splits into the mixing groups, and `size`
  examples fit in one group (the groups `make_train_step` resolves)."""
  mixup = config.train.get("mixup")
  with field_scope("train.mixup"):
    options = mixup_options(mixup)
  if options is None:
    return
  batch, groups, size = (config.data.batch_size, options["groups"],
                         options["size"])
  resolved = (f"groups=None resolves to jax.device_count() = "
              f"{jax.device_count()}, vmoe's one group per device")
  require(batch % groups == 0, "train.mixup.groups",
          f"data.batch_size={batch} does not split into {groups} mixing "
          f"groups of equal size ({resolved})")
  require(size <= batch // groups, "train.mixup.size",
          f"{size} examples per mixed example exceed the {batch // groups} "
          f"examples of a mixing group (data.batch_size={batch} / {groups} "
          f"groups; {resolved})")


def num_tokens(model, image_shape: tuple[int, ...]) -> int:
  """Tokens per image T for images `[B, H, W, C]`."""
  _, h, w, _ = image_shape
  ph, pw = model.patch_size
  return (h // ph) * (w // pw) + (1 if model.classifier == "token" else 0)


def validate_shapes(config: ml_collections.ConfigDict, model,
                    image_shape: tuple[int, ...],
                    num_classes: Optional[int] = None,
                    partitioning: Optional[Any] = None) -> None:
  """Checks patches and routing groups against the data's image shape and,
  when given, `model.num_classes` against the dataset's number of classes
  and the batches, routing groups and experts against the mesh of
  `partitioning` (`vmoe_ext.sharding.partitioning.Partitioning`)."""
  if num_classes is not None:
    require(model.num_classes >= num_classes, "model.num_classes",
            f"{model.num_classes} is smaller than the dataset's "
            f"{num_classes} classes (labels would fall outside the logits)")
  _, h, w, _ = image_shape
  ph, pw = model.patch_size
  require(h % ph == 0 and w % pw == 0, "model.patch_size",
          f"patch {tuple(model.patch_size)} does not divide the {h}x{w} "
          "images of the dataset (set data.image_size to resize)")
  ep = None if partitioning is None else partitioning.expert_parallel
  if ep is not None and model.moe is not None:
    ep.check_experts(model.moe["num_experts"])
  if partitioning is not None:
    for field in ("batch_size", "eval_batch_size"):
      partitioning.check_batch_size(config.data[field], f"data.{field}")
  if model.moe is None:
    return
  t = num_tokens(model, image_shape)
  s = model.moe["group_size"] or t
  for field in ("batch_size", "eval_batch_size"):
    b = config.data[field]
    require((b * t) % s == 0, f"data.{field}",
            f"{b} images x {t} tokens = {b * t} tokens do not fill whole "
            f"routing groups of model.moe.group_size={s}")
  if ep is not None:
    for field in ("batch_size", "eval_batch_size"):
      ep.check_groups(config.data[field] * t // s, f"data.{field}")


__all__ = ["SECTIONS", "TRAIN_FIELDS", "num_tokens", "validate_config",
           "validate_shapes"]
