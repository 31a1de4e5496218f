r"""Parameter layouts of google's vmoe and vit_jax, as rules onto ours.

An imported checkpoint is read through the `init` section's mapping rules
(`vmoe_ext.train.initialization`): for every parameter of our model, the
first rule whose target regex matches names the source leaf. A layout is
such a rule list plus a structural comparison of the two trees that turns a
mismatch into an error naming the model field to change.

Layouts (`init.layout`):
  * "vmoe": google-research/vmoe's `VisionTransformerMoe` tree (its released
    V-MoE checkpoints): `embedding`, `cls`, `Encoder/posembed_input/
    pos_embedding`, `Encoder/encoderblock_i/{LayerNorm_0, SelfAttention,
    LayerNorm_1, Mlp/Dense_{0,1}}` or `.../Moe/{Router/dense/kernel,
    Mlp/Dense_{0,1}}` (experts stacked on a leading `[E]` axis),
    `Encoder/encoder_norm`, `MapHead`, `pre_logits`, `head`.
  * "vit_jax": google-research/vision_transformer's ViT tree (its `.npz`
    checkpoints): `Transformer/encoderblock_i/{LayerNorm_0,
    MultiHeadDotProductAttention_1, LayerNorm_2, MlpBlock_3/Dense_{0,1}}`,
    `Transformer/posembed_input/pos_embedding`, `Transformer/encoder_norm`,
    `embedding`, `cls`, `pre_logits`, `head`. With `upcycle=True` every
    expert of a V-MoE block starts as that block's dense MLP and the router
    keeps its fresh initialisation.
Both rename and never transform values: the attention kernels
(`[D, heads, head_dim]`, `[heads, head_dim, D]`), the MLPs, the router
kernel `[D, E]` and the expert stacks have the same shapes and semantics on
both sides.
"""

from __future__ import annotations

import re
from typing import Any, Mapping, Optional

from vmoe_ext.errors import ConfigError

Rule = tuple[str, Optional[str]]
Shape = tuple[int, ...]
LAYOUTS = ("vmoe", "vit_jax")

# Our own tree, the common target of every layout.
_OURS = dict(block=r"encoderblock_(\d+)/", encoder="", attention="Attention",
             mlp="Mlp", moe="Moe/Mlp", posemb="pos_embedding")
_SOURCES = {
    "vmoe": dict(block=r"Encoder/encoderblock_(\d+)/", encoder="Encoder/",
                 attention="SelfAttention", mlp="Mlp", moe="Moe/Mlp",
                 posemb="Encoder/posembed_input/pos_embedding"),
    "vit_jax": dict(block=r"Transformer/encoderblock_(\d+)/",
                    encoder="Transformer/",
                    attention="MultiHeadDotProductAttention_1",
                    mlp="MlpBlock_3", moe=None,
                    posemb="Transformer/posembed_input/pos_embedding"),
}


def vmoe_rules() -> list[Rule]:
  """Rules from a vmoe V-MoE / ViT tree to ours (names only)."""
  return [
      (r"pos_embedding", "Encoder/posembed_input/pos_embedding"),
      (r"encoder_norm/(.+)", r"Encoder/encoder_norm/\1"),
      (r"(encoderblock_\d+)/Attention/(.+)", r"Encoder/\1/SelfAttention/\2"),
      (r"(encoderblock_\d+)/Moe/router/logits/dense/kernel",
       r"Encoder/\1/Moe/Router/dense/kernel"),
      (r"(encoderblock_\d+)/(LayerNorm_[01]|Mlp|Moe/Mlp)/(.+)",
       r"Encoder/\1/\2/\3"),
      (r"(embedding|head|pre_logits|MapHead)/(.+)", r"\1/\2"),
      (r"cls", "cls"),
  ]


def vit_jax_rules(upcycle: bool = False) -> list[Rule]:
  """Rules from a vit_jax ViT tree to ours; `upcycle`: V-MoE experts from
  the dense MLPs (tiled over E), routers fresh."""
  moe = [(r"(encoderblock_\d+)/Moe/Mlp/(.+)",
          r"Transformer/\1/MlpBlock_3/\2"),
         (r"encoderblock_\d+/Moe/.+", None)] if upcycle else []
  return moe + [
      (r"pos_embedding", "Transformer/posembed_input/pos_embedding"),
      (r"encoder_norm/(.+)", r"Transformer/encoder_norm/\1"),
      (r"(encoderblock_\d+)/Attention/(.+)",
       r"Transformer/\1/MultiHeadDotProductAttention_1/\2"),
      (r"(encoderblock_\d+)/LayerNorm_0/(.+)", r"Transformer/\1/LayerNorm_0/\2"),
      (r"(encoderblock_\d+)/LayerNorm_1/(.+)", r"Transformer/\1/LayerNorm_2/\2"),
      (r"(encoderblock_\d+)/Mlp/(.+)", r"Transformer/\1/MlpBlock_3/\2"),
      (r"(embedding|head|pre_logits)/(.+)", r"\1/\2"),
      (r"cls", "cls"),
  ]


def layout_rules(layout: str, upcycle: bool = False) -> list[Rule]:
  """The rules of `init.layout`."""
  if layout == "vmoe":
    return vmoe_rules()
  if layout == "vit_jax":
    return vit_jax_rules(upcycle)
  raise ConfigError("init.layout", f"must be one of {LAYOUTS} or None, got "
                    f"{layout!r}")


def _facts(shapes: Mapping[str, Shape], names: Mapping[str, Any]
           ) -> dict[str, tuple[Any, Optional[str]]]:
  """Structural facts of a tree: `{fact: (value, the leaf it comes from)}`."""
  block = re.compile(names["block"] + "(.+)")
  blocks: dict[int, dict[str, Shape]] = {}
  for path, shape in shapes.items():
    m = block.fullmatch(path)
    if m:
      blocks.setdefault(int(m.group(1)), {})[m.group(2)] = tuple(shape)
  facts: dict[str, tuple[Any, Optional[str]]] = {}

  def leaf(path: str) -> tuple[Optional[Shape], Optional[str]]:
    return (tuple(shapes[path]), path) if path in shapes else (None, None)

  kernel, where = leaf("embedding/kernel")
  if kernel is not None:
    facts["model.patch_size"] = (kernel[:2], where)
    facts["model.hidden_size"] = (kernel[-1], where)
  facts["model.num_layers"] = (len(blocks), names["block"])
  moe_kernel = f"{names['moe']}/Dense_0/kernel" if names["moe"] else None
  moe_blocks = tuple(sorted(i for i, b in blocks.items() if moe_kernel in b))
  prefix = names["block"].replace(r"(\d+)", "{}")
  if moe_blocks:
    first = prefix.format(moe_blocks[0]) + moe_kernel
    facts["model.moe.layers"] = (moe_blocks, first)
    facts["model.moe.num_experts"] = (shapes[first][0], first)
    facts["model.moe.hidden_size"] = (shapes[first][-1], first)
  else:
    facts["model.moe.layers"] = ((), names["block"])
  dense = [i for i in sorted(blocks) if f"{names['mlp']}/Dense_0/kernel"
           in blocks[i]]
  if dense:
    path = prefix.format(dense[0]) + f"{names['mlp']}/Dense_0/kernel"
    facts["model.mlp_dim"] = (shapes[path][-1], path)
  if blocks:
    first = min(blocks)
    query = f"{names['attention']}/query/kernel"
    if query in blocks[first]:
      path = prefix.format(first) + query
      facts["model.num_heads"] = (shapes[path][1], path)
    qk = prefix.format(first) + f"{names['attention']}/query_ln/scale"
    facts["model.attention_qk_norm"] = (qk in shapes, qk)
  classifier = ("map" if "MapHead/probe" in shapes else
                "token" if "cls" in shapes else "gap or 0")
  facts["model.classifier"] = (classifier, "cls / MapHead/probe")
  facts["model.position_emb"] = ("learned" if names["posemb"] in shapes
                                 else "sincos2d or none", names["posemb"])
  size, where = leaf("pre_logits/kernel")
  facts["model.representation_size"] = (None if size is None else size[-1],
                                        "pre_logits/kernel")
  size, where = leaf("head/kernel")
  if size is not None:
    facts["model.num_classes"] = (size[-1], where)
  return facts


def check_layout(layout: str, targets: Mapping[str, Shape],
                 sources: Mapping[str, Shape], upcycle: bool = False) -> None:
  """Compares the model's tree with a checkpoint's in `layout`.

  Raises:
    ConfigError naming the model field that differs (`model.moe.num_experts`,
    `model.moe.layers`, `model.num_layers`, `model.hidden_size`, ...), with
    the checkpoint's value and the leaf it was read from. Facts only one
    side has (a dense checkpoint has no expert count) are skipped; the
    mapping plan then checks every leaf.
  """
  ours = _facts(targets, _OURS)
  theirs = _facts(sources, _SOURCES[layout])
  skip: set[str] = set()
  if upcycle:  # A dense source: experts come from the dense MLPs.
    skip = {"model.moe.layers", "model.moe.num_experts",
            "model.moe.hidden_size", "model.mlp_dim"}
  for field, (value, leaf) in theirs.items():
    if field in skip or field not in ours:
      continue
    mine = ours[field][0]
    # "gap or 0" / "sincos2d or none": the tree cannot tell which.
    if (isinstance(value, str) and " or " in value
        and str(mine) in value.split(" or ")):
      continue
    if mine != value:
      raise ConfigError(field, f"the {layout} checkpoint has {value!r} "
                        f"(from {leaf}) but the model config gives "
                        f"{mine!r}; set {field} to match the checkpoint")


__all__ = ["LAYOUTS", "check_layout", "layout_rules", "vit_jax_rules",
           "vmoe_rules"]
