"""The Adaptive Clustering router (ACMoE) over any base router
(docs/routers.md, "`acmoe` — Adaptive Clustering router").

`ACMoERouter` wraps a base router given by its config (`base`: "noisy_topk",
"cosine", "cosine_lm", "top_p", "soft", ...). On an AC layer it scales each
token by the AC transform of the previous MoE layer's clusters
(`vmoe_ext.routers.adaptive_clustering`, stop-gradient), routes the scaled
tokens with the base router — `h^T M_k* e_j` for a linear base, the authors'
`(x*W) . normalize(e_j)` for "cosine_lm" — and sends the scaled tokens on
according to `scaled_to`: to the router only, to the router and the experts
(Swin code), or to the router and SoftMoE's dispatch (SoftMoE code). On the
other MoE layers (the first one, and those the `layers` placement leaves
out) it is the base router unchanged, with the same parameters.

Placement (`layers`), over the model's MoE layers m = 0..n-1 (block indices
in `RoutingContext.moe_blocks`; the paper's appendix C.5.2):
"full" m >= 1, "skip1" m >= 2, "skip2" m >= 3, "alternating" odd m,
"back_half" m >= n // 2, or an explicit list of block indices; "preset"
(the default) is where the authors' runs put it (`PRESET_LAYERS`). An AC layer
needs an MoE layer before it: placing one on the first MoE block is a config
error naming `router.layers`.

Statistics are over the whole batch the layer sees (one statistic, not one
per group) and, with a data-parallel `axis_name`, over the global batch; the
authors' code computes them per device batch.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Mapping, Optional, Sequence, Union

import flax.linen as nn
import jax
import jax.numpy as jnp

from vmoe_ext.errors import require
from vmoe_ext.moe.contract import (SOFT, TOKEN_CHOICE, RouterOutput,
                                   RoutingContext)
from vmoe_ext.routers import adaptive_clustering as ac
from vmoe_ext.routers.registry import ROUTERS
from vmoe_ext.routers.soft import l2_normalize
from vmoe_ext.routers.wrapper import WrapperRouter

Array = jax.Array
LAYER_PRESETS = ("full", "skip1", "skip2", "alternating", "back_half")
# `layers="preset"`: where the authors' runs put the first AC layer
# (docs/routers.md, "`acmoe`", the `layers` field): LM code on MoE layers 3-6 of 6 (skip-1), Swin from the 2nd MoE
# block of the stage and SoftMoE from the 2nd MoE layer (full); the paper's
# Definition 2 from the 2nd MoE layer on (full).
PRESET_LAYERS = {"paper": "full", "language": "skip1", "swin": "full",
                 "softmoe": "full"}
TRANSFORMS = ("adaptive", "random")
_OPTION_FIELDS = ("eps", "clamp", "mean", "l2_normalize", "scaled_to",
                  "mix_k", "mix_weights")


def _stage_ac_layers(layers: Union[str, Sequence[int]],
                     blocks: tuple[int, ...]) -> tuple[int, ...]:
  """The AC layers among one stage's MoE blocks (possibly none)."""
  if isinstance(layers, str):
    n = len(blocks)
    first = {"full": 1, "skip1": 2, "skip2": 3, "back_half": n // 2,
             "alternating": 1}[layers]
    step = 2 if layers == "alternating" else 1
    return tuple(blocks[m] for m in range(max(first, 1), n, step))
  return tuple(sorted(b for b in layers if b in blocks))


def resolve_ac_stages(layers: Union[str, Sequence[int]],
                      stages: Sequence[Sequence[int]]) -> tuple[int, ...]:
  """The block indices of the AC layers of a model whose MoE blocks form
  `stages`: runs of MoE blocks over one token sequence (a ViT has one; a
  Swin stage is one, and the previous assignments restart with it, since
  patch merging changes the tokens). A preset applies within each stage;
  an explicit list names blocks that are not the first of their stage.

  Raises:
    ConfigError on `router.layers` for an unknown preset, a block that is
    not an MoE block, the first MoE block of a stage, or an empty selection.
  """
  stages = tuple(tuple(s) for s in stages if len(s))
  every = tuple(b for s in stages for b in s)
  several = len(stages) > 1
  if isinstance(layers, str):
    require(layers in LAYER_PRESETS, "router.layers",
            f"unknown placement preset {layers!r}; presets: {LAYER_PRESETS} "
            "or a list of MoE block indices")
  else:
    require(isinstance(layers, (list, tuple)) and layers, "router.layers",
            f"must be a preset {LAYER_PRESETS} or a non-empty list of MoE "
            f"block indices, got {layers!r}")
    for b in layers:
      require(b in every, "router.layers",
              f"block {b!r} is not an MoE block (MoE blocks: {every})")
  for s in stages:
    if not isinstance(layers, str):
      where = "of its stage " if several else ""
      require(s[0] not in layers, "router.layers",
              f"block {s[0]} is the first MoE layer {where}: an AC layer "
              "needs an MoE layer before it (its assignment defines the "
              "clusters)".replace(" :", ":"))
  chosen = tuple(b for s in stages for b in _stage_ac_layers(layers, s))
  if several:
    require(chosen, "router.layers",
            f"placement {layers!r} selects no AC layer in any stage (MoE "
            f"blocks per stage: {stages}); an AC layer needs an MoE layer "
            "before it in its stage")
  else:
    n = len(every)
    require(chosen, "router.layers",
            f"placement {layers!r} selects no AC layer among the {n} MoE "
            f"layers (blocks {every}); an AC layer needs an MoE layer "
            "before it")
  return tuple(sorted(chosen))


def resolve_ac_layers(layers: Union[str, Sequence[int]],
                      moe_blocks: Sequence[int]) -> tuple[int, ...]:
  """The block indices of the AC layers among the MoE blocks `moe_blocks`
  (one stage; `resolve_ac_stages`)."""
  return resolve_ac_stages(layers, (tuple(moe_blocks),))


class ACMoERouter(WrapperRouter):
  """ACMoE: route `M_k* h` with a base router (see the module docstring).

  Attributes:
    base: the base router's config `{"name": ..., **fields}` (E is this
      router's).
    normalization: preset "paper", "language", "swin" or "softmoe".
    dispersion: "mad" or "variance".
    eps, clamp, mean, l2_normalize, scaled_to, mix_k, mix_weights: the
      `adaptive_clustering.ACOptions` fields; "preset" takes the preset's.
    layers: placement preset or explicit list of MoE block indices;
      "preset": the normalization preset's (`PRESET_LAYERS`).
    transform: "adaptive" (the AC transform) or "random" (the ablation:
      one diagonal `max(N(1, 0.5), 0)` per layer, fixed by `random_seed`).
    random_seed: seed of the random-diagonal ablation.
    causal: False (the authors' code, and the paper): the cluster
      statistics pool every token the layer sees, so in a language model a
      token's routing depends on later tokens of the block. True: the token
      at position s of its group is scaled by statistics of positions <= s
      of every group only (`adaptive_clustering.causal_adaptive_scales`);
      for the language model, whose groups are its rows (one row of a block
      per group), this makes the AC layer causal.
  """
  scan_safe: ClassVar[bool] = False  # Reads the block's position.
  base: Mapping[str, Any] = dataclasses.field(
      default_factory=lambda: {"name": "noisy_topk", "num_selected": 2})
  normalization: str = "paper"
  dispersion: str = "mad"
  eps: Any = ac.PRESET
  clamp: Optional[Any] = ac.PRESET  # None: no clamp.
  mean: Any = ac.PRESET
  l2_normalize: Any = ac.PRESET
  scaled_to: Any = ac.PRESET
  mix_k: Any = ac.PRESET
  mix_weights: Any = ac.PRESET
  layers: Union[str, tuple[int, ...]] = ac.PRESET
  transform: str = "adaptive"
  random_seed: int = 0
  causal: bool = False

  def __post_init__(self):
    opts = self.options
    require(self.transform in TRANSFORMS, "router.transform",
            f"must be one of {TRANSFORMS}, got {self.transform!r}")
    require(isinstance(self.random_seed, int) and self.random_seed >= 0,
            "router.random_seed", f"must be an integer >= 0, got "
            f"{self.random_seed!r}")
    require(isinstance(self.causal, bool), "router.causal",
            f"must be True or False, got {self.causal!r}")
    if isinstance(self.placement, str):  # Checks the name only.
      resolve_ac_layers(self.placement, tuple(range(8)))
    base = self.base_prototype()
    soft = base.kind == SOFT
    require(soft or opts.scaled_to != "dispatch", "router.scaled_to",
            f"'dispatch' sends the scaled tokens through SoftMoE's dispatch; "
            f"the base router {self.base.get('name')!r} is not soft (use "
            "'router' or 'experts')")
    require(not soft or opts.scaled_to != "experts", "router.scaled_to",
            "a soft base router mixes tokens into slots: use 'dispatch' "
            "(or 'router')")
    require(opts.mix_weights != "slot_softmax" or soft, "router.mix_weights",
            "'slot_softmax' mixes over the previous layer's top slots, which "
            f"only a soft layer has (base {self.base.get('name')!r})")
    if opts.mix_k > 1 and opts.mix_weights == "raw":
      require(base.kind == TOKEN_CHOICE
              and not getattr(base, "renormalize_gates", False),
              "router.mix_weights", "'raw' mixes with the previous layer's "
              "raw softmax gates; the previous layer (base "
              f"{self.base.get('name')!r}) does not provide them (use "
              "'renormalized')")
    require(opts.mix_k <= base.assignment_width, "router.mix_k",
            f"Mix-{opts.mix_k} needs the previous layer's top-{opts.mix_k}; "
            f"the previous layer (base {self.base.get('name')!r}) provides "
            f"{base.assignment_width}")
    super().__post_init__()

  @property
  def placement(self) -> Union[str, tuple[int, ...]]:
    """`layers`, with "preset" resolved to the normalization preset's."""
    if isinstance(self.layers, str) and self.layers == ac.PRESET:
      return PRESET_LAYERS.get(self.normalization, "full")
    return self.layers

  @property
  def options(self) -> ac.ACOptions:
    return ac.resolve_options(
        self.normalization, self.dispersion,
        **{k: getattr(self, k) for k in _OPTION_FIELDS})

  def _base_is_soft(self) -> bool:
    name = self.base.get("name") if isinstance(self.base, Mapping) else None
    return name in ROUTERS and ROUTERS.get(name).kind == SOFT

  def base_config(self, ac_layer: bool = False) -> dict[str, Any]:
    """The base router's config; on AC layers of a soft base whose tokens
    arrive L2-normalised and scaled, it must not normalise them again."""
    config = super().base_config()
    require(config["name"] != "acmoe", "router.base.name",
            "the base of an ACMoE router cannot be ACMoE")
    if ac_layer and self._base_is_soft() and self.options.l2_normalize:
      config.update(normalize_tokens=False, dispatch_normalized=False)
    return config

  def check_placement(self, moe_blocks: tuple[int, ...]) -> None:
    self.check_stages((tuple(moe_blocks),))

  def check_stages(self, stages: tuple[tuple[int, ...], ...]) -> None:
    super().check_stages(stages)
    resolve_ac_stages(self.placement, stages)

  def is_ac_layer(self, ctx: RoutingContext) -> bool:
    if not ctx.moe_blocks:  # Used outside a model: AC wherever possible.
      return ctx.previous is not None
    return ctx.block in _stage_ac_layers(self.placement, ctx.moe_blocks)

  def scale_tokens(self, tokens: Array, ctx: RoutingContext,
                   groups: Optional[tuple[int, int]] = None) -> Array:
    """`[N, D]` statistic tokens -> `[N, D]` scaled tokens (this layer's);
    `groups`: `(G, S)` with N = G * S row-major, for `causal`."""
    prev = ctx.records[-1] if ctx.records else None
    require(prev is not None, "router.layers",
            f"block {ctx.block} has no MoE layer before it: an AC "
            "layer needs the previous layer's assignment")
    n, d = tokens.shape
    a = prev.assignment
    require(a.expert_indices.shape[0] * a.expert_indices.shape[1] == n
            and prev.width in (-1, d), "router.layers",
            f"the AC layer at block {ctx.block} ({n} tokens of width "
            f"{d}) follows the MoE layer at block {prev.block} of another "
            f"shape ({a.expert_indices.shape[:2]} tokens of width "
            f"{prev.width}); the clusters must be of the same tokens")
    opts = self.options
    require(opts.mix_k <= a.num_selected, "router.mix_k",
            f"Mix-{opts.mix_k} needs the previous layer's top-{opts.mix_k}; "
            f"the MoE layer at block {prev.block} provides {a.num_selected}")
    if self.transform == "random":
      return tokens * ac.random_diagonal(self.random_seed, ctx.block,
                                         d)[None, :]
    k = a.num_selected
    e = prev.num_experts if prev.num_experts > 0 else self.num_experts
    if self.causal:
      g, s = groups
      m = ac.causal_adaptive_scales(
          tokens.reshape(g, s, d), a.expert_indices.reshape(g, s, k),
          a.gates.reshape(g, s, k), a.valid.reshape(g, s, k),
          num_clusters=e, opts=opts, reduce=ctx.reduce_mean).reshape(n, d)
    else:
      m = ac.adaptive_scales(
          tokens, a.expert_indices.reshape(n, k), a.gates.reshape(n, k),
          a.valid.reshape(n, k), num_clusters=e, opts=opts,
          reduce=ctx.reduce_mean)
    return tokens * m

  @nn.compact
  def __call__(self, x: Array, ctx: RoutingContext, *, capacity: int,
               deterministic: bool, update_state: bool = False
               ) -> RouterOutput:
    """x: `[G, S, D]` -> the base router's output on the scaled tokens."""
    ac_layer = self.is_ac_layer(ctx)
    base = self.build_base(self.base_config(ac_layer), name="base")
    kwargs = dict(capacity=capacity, deterministic=deterministic,
                  update_state=update_state)
    if not ac_layer:
      return base(x, ctx, **kwargs)
    opts = self.options
    g, s, d = x.shape
    tokens = x.reshape(g * s, d).astype(jnp.float32)
    if opts.l2_normalize:
      tokens = l2_normalize(tokens, axis=-1)
    scaled = self.scale_tokens(tokens, ctx, (g, s)).reshape(g, s, d)
    out = base(scaled.astype(x.dtype), ctx, **kwargs)
    if opts.scaled_to == "router":  # What the base alone would dispatch.
      raw = (l2_normalize(x.astype(jnp.float32), axis=-1)
             if self._base_is_soft() and self.base.get("dispatch_normalized")
             else None)
      return out.replace(expert_inputs=raw)
    return out.replace(expert_inputs=scaled)
