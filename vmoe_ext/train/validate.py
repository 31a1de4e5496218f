"""Checks that need the data: patches, routing groups and the classifier
against the dataset's images and classes, batches and experts against the
mesh; run by the run assembly once the data is opened, before anything is
traced. The config itself is checked once, before, by
`vmoe_ext.app.schema.resolve_config`. Every `ConfigError` names the full
dotted path.
"""

from __future__ import annotations

from typing import Any, Optional

import ml_collections

from vmoe_ext.errors import field_scope, require


def moe_tokens(model, image_shape: tuple[int, ...]) -> dict[int, int]:
  """Tokens per image T that each MoE block sees, for images
  `[B, H, W, C]`: `{block: T}` (a ViT's are all equal; a Swin's shrink
  4x per stage)."""
  _, h, w, _ = image_shape
  out = {}
  for block in model.moe_layers:
    gh, gw, extra = model.token_grid(block, (h, w))
    out[block] = gh * gw + extra
  return out


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
  with field_scope("model"):  # The patches (and a Swin's windows) fit.
    model.check_image_size((h, w))
  ep = None if partitioning is None else partitioning.expert_parallel
  if ep is not None and model.moe is not None:
    ep.check_experts(model.moe["num_experts"])
  if partitioning is not None:
    for field in ("batch_size", "eval_batch_size"):
      partitioning.check_batch_size(config.data[field], f"data.{field}")
  if model.moe is None:
    return
  for block, t in sorted(moe_tokens(model, image_shape).items()):
    s = model.moe["group_size"] or t
    for field in ("batch_size", "eval_batch_size"):
      b = config.data[field]
      require((b * t) % s == 0, f"data.{field}",
              f"{b} images x {t} tokens (block {block}) = {b * t} tokens "
              f"do not fill whole routing groups of model.moe.group_size={s}")
    if ep is not None:
      for field in ("batch_size", "eval_batch_size"):
        ep.check_groups(config.data[field] * t // s, f"data.{field}")


__all__ = ["moe_tokens", "validate_shapes"]
