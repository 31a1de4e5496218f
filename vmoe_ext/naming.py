"""Names of the encoder blocks: the one place that spells them.

"Block i" is the 0-based index of an encoder block, counting dense and MoE
blocks alike (`VisionTransformerMoe` applies blocks 0..num_layers-1; an MoE
placement such as `moe.layers=(1, 3)` lists block indices). It is *not* the
ordinal of the MoE layer among the MoE layers (that is
`RoutingContext.moe_index`). Block i has two names:

* its parameter (and every other collection's) name `encoderblock_{i}`,
  google vmoe's, so vmoe and vit_jax checkpoints map onto ours by name
  (`params/encoderblock_1/Moe/Mlp/Dense_0/kernel`);
* its metric key `layer_{i}`, the prefix of its per-block metrics in the
  model's metrics dict and in `metrics.jsonl` (`layer_1/drop_rate`,
  `layer_1/router_state/adjacency`, `layer_1/load_balance`).

Both spellings are part of the output contract and stay as they are: a
`layer_i` key in `metrics.jsonl` is block i, the block whose parameters are
`encoderblock_i` (docs/models.md, "Block names and metric keys").
`block_index` parses either name back to i.

This module sits at the bottom of the package (beside `errors` and
`registry`) and imports nothing, so every layer that spells or reads these
names can use it: the model, training, evaluation, carving and reporting.
"""

from __future__ import annotations

import re

PARAM_PREFIX = "encoderblock_"
METRIC_PREFIX = "layer_"
# Regular expressions of one name (no anchors, no groups), for patterns over
# "/"-joined paths such as `rf"^({PARAM_PATTERN})/Moe/router/(.+)$"`.
PARAM_PATTERN = r"encoderblock_\d+"
METRIC_PATTERN = r"layer_\d+"
_BLOCK_NAME = re.compile(r"(?:encoderblock|layer)_(\d+)")


def param_name(block: int) -> str:
  """`"encoderblock_{block}"`: the name of block `block` in the params tree."""
  return f"{PARAM_PREFIX}{block}"


def metric_key(block: int) -> str:
  """`"layer_{block}"`: the metrics prefix of block `block`."""
  return f"{METRIC_PREFIX}{block}"


def block_index(name: str) -> int:
  """The block of a param name or a metric key: `"encoderblock_3" -> 3`,
  `"layer_3" -> 3`. Raises ValueError on any other string."""
  match = _BLOCK_NAME.fullmatch(name)
  if match is None:
    raise ValueError(f"{name!r} is neither a block's param name "
                     f"('{PARAM_PREFIX}<i>') nor its metric key "
                     f"('{METRIC_PREFIX}<i>')")
  return int(match.group(1))


def metric_key_of(name: str) -> str:
  """The metric key of the block a param name (or metric key) names:
  `"encoderblock_3" -> "layer_3"`."""
  return metric_key(block_index(name))


__all__ = ["METRIC_PATTERN", "METRIC_PREFIX", "PARAM_PATTERN", "PARAM_PREFIX",
           "block_index", "metric_key", "metric_key_of", "param_name"]
