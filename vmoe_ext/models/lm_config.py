"""The language-model backbone's config: its defaults and how the `moe`,
`stream` and `ac_router` fields resolve (docs/language_model.md).

The defaults are the authors' LM code's (rachtsy/MomentumSMoE and the ACMoE
repo's `language-modeling/`): their gates, fastmoe's dropless MoE layer, and
MomentumSMoE's momentum and Adam MoE layers. Every function raises a
`ConfigError` naming the field (relative to the model section) before
anything is traced.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

from vmoe_ext.errors import field_scope, require
from vmoe_ext.models.lm_arch import STREAM_LETTERS, LayerSpec
from vmoe_ext.models.sublayer import DEFAULT_STREAM, moe_config
from vmoe_ext.routers.registry import ROUTERS
from vmoe_ext.streams import STREAMS
from vmoe_ext.streams.first_layer import FirstLayerThenHeavyBall
from vmoe_ext.streams.momentum_base import MomentumStream

# The gate of the authors' code (`CustomNaiveGate_Balance_SMoE`): a linear
# layer with bias, top-2 of the logits, combine weights softmax over the two,
# no noise, no balance loss (the gate is built without its balance switch).
LM_ROUTER: dict[str, Any] = {
    "name": "noisy_topk", "num_selected": 2, "noise_std": 0.0,
    "renormalize_gates": True, "logits_bias": True,
    "importance_loss_weight": 0.0, "load_loss_weight": 0.0}
# The authors' XMoE gate (`CustomNaiveGate_Balance_XMoE`): tokens projected
# to 8 dimensions (not normalised), cosine with the normalised expert
# embeddings (orthogonal, gain 0.32), no temperature, top-2, softmax over the
# two. (Their gate also holds an unused `Linear(D, E)`, not allocated here.)
# Its balance loss, when switched on, scores `softmax(logits / 0.3)`.
LM_XMOE_ROUTER: dict[str, Any] = {
    "name": "cosine", "num_selected": 2, "projection_dim": 8,
    "normalize_tokens": False, "temperature": 1.0,
    "learnable_temperature": False, "renormalize_gates": True,
    "noise_std": 0.0, "importance_loss_weight": 0.0,
    "load_loss_weight": 0.0, "balance_temperature": 0.3}
# The `moe` defaults of the backbone (the other fields: `MOE_DEFAULTS`):
# fastmoe's dropless layer, dropout after the expert activation only.
# capacity_factor None: no drop with a capacity dispatcher either (see
# `LanguageModel.moe`).
LM_MOE_DEFAULTS: dict[str, Any] = {
    "num_experts": 16, "dispatcher": "dropless", "capacity_factor": None,
    "dropout_output": False, "router": LM_ROUTER}
# The router of `c` layers: the ACMoE authors' AC gate (language preset over
# their cosine base, which adds no balance loss: the gate is built without
# its balance switch); its `layers` are the `c` blocks.
LM_AC_ROUTER: dict[str, Any] = {
    "name": "acmoe", "normalization": "language",
    "base": {"name": "cosine_lm", "num_selected": 2,
             "importance_loss_weight": 0.0, "load_loss_weight": 0.0}}
# The stream of `m` and `a` layers when `stream` is unset: MomentumSMoE's
# LM classes (`mu` 0.7, `gamma` 1 as the paper chose; Adam: gamma1 = gamma2
# = 1, beta1 0.9, beta2 0.999, eps 1e-8 under the root).
LM_STREAMS: dict[str, dict[str, Any]] = {
    "m": {"name": "momentum", "mu": 0.7, "gamma": 1.0,
          "layout": "vmoe_reference"},
    "a": {"name": "adam", "form": "code", "mu": 0.7, "gamma": 1.0,
          "momentum_gamma": 1.0, "beta": 0.999, "beta1": 0.9, "eps": 1e-8,
          "layout": "vmoe_reference"}}
PLACEMENT_FIELDS = ("layers", "every", "last")


def lm_moe_config(moe: Optional[Mapping[str, Any]]) -> dict[str, Any]:
  """The backbone's filled `moe` dict: `LM_MOE_DEFAULTS` over
  `MOE_DEFAULTS`, then the user's fields; the placement fields are errors
  (the architecture string places the MoE layers)."""
  moe = dict(moe or {})
  for field in PLACEMENT_FIELDS:
    require(moe.get(field) is None, f"moe.{field}",
            "the language model places its MoE layers by its architecture "
            "string (letters g, m, a, c); leave moe.layers/every/last unset")
  return dict(moe_config({**LM_MOE_DEFAULTS, **moe}) or {})


def layer_moe(moe: Mapping[str, Any], router: Mapping[str, Any]
              ) -> dict[str, Any]:
  """The `moe` dict of one MoE layer with `router`; `capacity_factor` None
  becomes `E / K` (with one token per group slot of every expert, C = S:
  no token can be dropped)."""
  out = {**moe, "router": dict(router)}
  if out["capacity_factor"] is None:
    with field_scope("moe"):
      k = ROUTERS.build(out["router"], num_experts=out["num_experts"],
                        parent=None).slots_per_token
    out["capacity_factor"] = out["num_experts"] / k
  return out


def resolve_stream(stream: Optional[Mapping[str, Any]],
                   specs: Sequence[LayerSpec]) -> dict[str, Any]:
  """The stream of the `m` / `a` layers (`LM_STREAMS` when unset); plain
  when the architecture has neither letter."""
  letters = {s.ffn for s in specs} & set(STREAM_LETTERS)
  if not letters:
    require(stream is None or dict(stream).get("name") == "plain", "stream",
            "applies to the 'm' and 'a' sub-layers, and the architecture "
            "has none; leave it unset or use a momentum letter")
    return dict(DEFAULT_STREAM)
  (letter,) = letters
  config = dict(stream) if stream is not None else dict(LM_STREAMS[letter])
  built = STREAMS.build(config, parent=None)
  adaptive = isinstance(built, FirstLayerThenHeavyBall)
  if letter == "a":
    require(adaptive, "stream.name",
            f"'a' layers take an adaptive first-layer stream (adam, "
            f"rmsprop: an adaptive step in the first MoE layer, heavy-ball "
            f"after it), got {config.get('name')!r}; use 'm' letters")
  else:
    require(isinstance(built, MomentumStream) and not adaptive, "stream.name",
            f"'m' layers take a momentum stream (momentum, robust_momentum, "
            f"nag, time_varying, sam, complex_momentum, ...), got "
            f"{config.get('name')!r}"
            + ("; adaptive first-layer streams take 'a' letters"
               if adaptive else "; use 'g' for the plain MoE layer"))
  return config


def resolve_ac_router(ac_router: Optional[Mapping[str, Any]],
                      c_blocks: tuple[int, ...],
                      group_size: Optional[int] = None
                      ) -> Optional[dict[str, Any]]:
  """The router of the `c` layers, placed on them (None without `c`); a
  causal one needs each routing group to be one row of the block
  (`moe.group_size` None), so that a group's positions are time."""
  if not c_blocks:
    require(ac_router is None, "ac_router",
            "routes the 'c' sub-layers, and the architecture has none")
    return None
  router = dict(ac_router if ac_router is not None else LM_AC_ROUTER)
  require("name" in router, "ac_router.name", "is required")
  cls = ROUTERS.get(router["name"])
  if "layers" in getattr(cls, "__dataclass_fields__", {}):
    layers = router.get("layers", "preset")
    require(layers == "preset" or tuple(layers) == c_blocks,
            "ac_router.layers", f"the 'c' letters place the AC layers at "
                                f"blocks {c_blocks}; leave it unset (got "
                                f"{layers!r})")
    router["layers"] = c_blocks
  require(not router.get("causal") or group_size is None, "moe.group_size",
          f"ac_router.causal needs one row of the block per routing group "
          f"(the positions of a group are time); leave it None, got "
          f"{group_size}")
  return router


__all__ = ["LM_AC_ROUTER", "LM_MOE_DEFAULTS", "LM_ROUTER", "LM_STREAMS",
           "LM_XMOE_ROUTER", "PLACEMENT_FIELDS", "layer_moe",
           "lm_moe_config", "resolve_ac_router", "resolve_stream"]
