"""Vision Transformer with sparse MoE blocks (V-MoE layout), dense ViT, SoftMoE ViT.

One encoder serves all three: a dense ViT has no MoE blocks, a V-MoE replaces
the MLP of some blocks by an `MoeLayer` with a token-choice or expert-choice
router, a SoftMoE ViT uses the "soft" router with one image per group. The
encoder threads a `RoutingContext` through the blocks so that routers and
residual streams that look across layers stay pure functions.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from vmoe_ext.errors import ConfigError, field_scope, require
from vmoe_ext.models.heads import (ATTENTION_KERNEL_INITS, CLASSIFIERS,
                                   classifier_head, has_class_token)
from vmoe_ext.models.placement import resolve_moe_layers
from vmoe_ext.models.position import (add_fixed_position_emb,
                                      check_position_emb)
from vmoe_ext.moe.contract import RoutingContext
from vmoe_ext.moe.expert_parallel import ExpertParallel
from vmoe_ext.moe.experts import DenseMlp, check_activation
from vmoe_ext.moe.layer import MoeLayer
from vmoe_ext.naming import metric_key, param_name
from vmoe_ext.routers.registry import ROUTERS
from vmoe_ext.streams import STREAMS

Array = jax.Array

# Settable fields of the `moe` config dict and their defaults.
MOE_DEFAULTS: dict[str, Any] = {
    "layers": None,             # explicit 0-based block indices, or
    "every": None,              # every N-th block (N-1, 2N-1, ...), and/or
    "last": None,               # the last N candidates
    "num_experts": 8,           # E
    "hidden_size": None,        # H of each expert (None: the model's mlp_dim)
    "group_size": None,         # S (None: one image per group)
    "capacity_factor": 1.0,     # cf
    "eval_capacity_factor": None,  # cf of deterministic calls (None: cf)
    "capacity_multiple": None,  # round C up to this multiple (None: 1 for
                                # "exact" rounding, 4 for "vmoe")
    "capacity_rounding": "exact",  # "exact" | "vmoe" (ceil of the raw float)
    "dispatcher": "indices",    # "indices" | "einsum"
    "batch_priority": False,    # BPR
    "dropout_rate": None,       # expert dropout (None: the model's)
    "expert_init": "independent",
    "dispatch_dtype": None,     # None (float32) | "bfloat16"
    "shared_experts": 0,        # N_s always-on experts of width hidden_size
    "output_bias": "experts",   # "experts" (vmoe) | "once" (dense-exact)
    "router": {"name": "noisy_topk", "num_selected": 1},
}
DEFAULT_STREAM = {"name": "plain"}


def moe_config(moe: Optional[Mapping[str, Any]]) -> Optional[dict[str, Any]]:
  """Fills defaults into an `moe` config dict; unknown keys are errors."""
  if moe is None:
    return None
  moe = {k: (dict(v) if isinstance(v, Mapping) else v)
         for k, v in dict(moe).items()}
  require("stream" not in moe, "moe.stream",
          "the residual stream is chosen for the whole model: set "
          "model.stream (e.g. {'name': 'plain'}) instead of model.moe.stream")
  unknown = sorted(set(moe) - set(MOE_DEFAULTS))
  if unknown:
    raise ConfigError(f"moe.{unknown[0]}", f"unknown field; known fields: "
                      f"{sorted(MOE_DEFAULTS)}")
  return {**MOE_DEFAULTS, **moe}


# The dense MLP (`Mlp/Dense_0`, `Mlp/Dense_1`; `Mlp/Dense_up` when gated).
MlpBlock = DenseMlp


class EncoderBlock(nn.Module):
  """Pre-LN block: `x + Attn(LN(x))`, then the MLP or MoE through the stream.

  The model's stream (`vmoe_ext.streams`) handles MoE blocks, and dense blocks
  too when its `blocks == "all"`; other dense blocks use the plain residual
  and pass the stream state through. The stream's state travels in
  `ctx.stream_state`; each MoE block appends its `LayerRecord` to `ctx`.
  """
  num_heads: int
  mlp_dim: int
  dropout_rate: float = 0.0
  attention_dropout_rate: float = 0.0
  mlp_activation: str = "gelu"
  attention_qk_norm: bool = False
  attention_kernel_init: str = "xavier_uniform"
  attention_broadcast_dropout: bool = False
  moe: Optional[Mapping[str, Any]] = None  # filled by `moe_config`
  stream: Mapping[str, Any] = dataclasses.field(
      default_factory=lambda: dict(DEFAULT_STREAM))
  dtype: Any = jnp.float32
  expert_parallel: Optional[ExpertParallel] = None

  @nn.compact
  def __call__(self, x: Array, ctx: RoutingContext, *,
               deterministic: bool = True, update_state: bool = False
               ) -> tuple[Array, RoutingContext, Optional[dict]]:
    """x: `[B, T, D]` -> `[B, T, D]`, the updated context, MoE metrics."""
    y = nn.LayerNorm(name="LayerNorm_0", dtype=self.dtype)(x)
    y = nn.MultiHeadDotProductAttention(
        num_heads=self.num_heads, dropout_rate=self.attention_dropout_rate,
        broadcast_dropout=self.attention_broadcast_dropout,
        kernel_init=ATTENTION_KERNEL_INITS[self.attention_kernel_init],
        normalize_qk=self.attention_qk_norm,
        deterministic=deterministic, dtype=self.dtype, name="Attention")(y, y)
    y = nn.Dropout(self.dropout_rate)(y, deterministic=deterministic)
    x = x + y
    norm = nn.LayerNorm(name="LayerNorm_1", dtype=self.dtype)
    is_moe = self.moe is not None
    if is_moe:
      layer = build_moe_layer(self.moe, self.mlp_dim, self.dropout_rate,
                              self.dtype, self.mlp_activation, name="Moe",
                              expert_parallel=self.expert_parallel)
    else:
      layer = MlpBlock(self.mlp_dim, self.dropout_rate, self.dtype,
                       self.mlp_activation, name="Mlp")
    if not is_moe and STREAMS.build(self.stream,
                                    parent=None).blocks != "all":
      return x + layer(norm(x), deterministic=deterministic), ctx, None

    primary_aux = []

    def ffn(z: Array, *, shift: Optional[Array] = None,
            primary: bool = True) -> tuple[Array, Any]:
      h = norm(z)
      if shift is not None:
        h = h + shift
      if not is_moe:
        f, aux = layer(h, deterministic=deterministic), None
      else:
        f, metrics, layer_record = layer(
            h, ctx, deterministic=deterministic, update_state=update_state,
            primary=primary)
        aux = (metrics, layer_record)
      if primary:
        primary_aux.append(aux)
      return f, aux

    stream = STREAMS.build(self.stream, name="Stream")
    x, state = stream(x, ffn, ctx.stream_state, ctx=ctx, is_moe=is_moe)
    if len(primary_aux) != 1:
      raise ValueError(
          f"stream {type(stream).__name__} made {len(primary_aux)} primary "
          "ffn calls in one block; the contract is exactly one (mark the "
          "others primary=False)")
    ctx = ctx.replace(stream_state=state)
    if not is_moe:
      return x, ctx, None
    metrics, layer_record = primary_aux[0]
    return x, ctx.after_moe(layer_record), metrics


def build_moe_layer(moe: Mapping[str, Any], mlp_dim: int, dropout_rate: float,
                    dtype: Any, activation: str = "gelu",
                    **module_kwargs: Any) -> MoeLayer:
  """The `MoeLayer` described by a filled `moe` config dict."""
  with field_scope("moe"):  # Routers name their fields "router.*".
    router = ROUTERS.build(moe["router"], num_experts=moe["num_experts"],
                           parent=None)
  return MoeLayer(
      router=router,
      hidden_size=moe["hidden_size"] or mlp_dim,
      group_size=moe["group_size"],
      capacity_factor=moe["capacity_factor"],
      eval_capacity_factor=moe["eval_capacity_factor"],
      capacity_multiple=moe["capacity_multiple"],
      capacity_rounding=moe["capacity_rounding"],
      dispatcher=moe["dispatcher"],
      batch_priority=moe["batch_priority"],
      dropout_rate=(dropout_rate if moe["dropout_rate"] is None
                    else moe["dropout_rate"]),
      expert_init=moe["expert_init"],
      dispatch_dtype=moe["dispatch_dtype"],
      shared_experts=moe["shared_experts"], output_bias=moe["output_bias"],
      activation=activation, dtype=dtype, **module_kwargs)


class VisionTransformerMoe(nn.Module):
  """ViT / V-MoE / SoftMoE-ViT classifier on `[B, H, W, C]` images.

  Attributes:
    num_classes: output classes.
    patch_size: `(ph, pw)` patch size; must divide the image size.
    hidden_size: D.
    num_layers: encoder blocks.
    num_heads: attention heads (must divide D).
    mlp_dim: H of the dense MLPs (and of the experts unless moe.hidden_size).
    classifier: "token" (class token), "0" (first token, no class token),
      "gap" (global average pooling) or "map" (attention pooling,
      `vmoe_ext.models.heads`).
    representation_size: None, or the width of a `pre_logits` Dense + tanh
      before the head.
    head_kernel_zero_init / head_bias_init: the head's kernel starts at 0
      (vmoe's default; False: LeCun normal), its bias at this constant.
    position_emb: "learned" (`pos_embedding`), "sincos2d" (fixed, patches
      only) or "none"; `position_emb_temperature` for sincos2d
      (`vmoe_ext.models.position`).
    dropout_rate / attention_dropout_rate: dropout rates.
    attention_broadcast_dropout: False (vmoe, ViT): an independent attention
      dropout mask per example and head; True (flax's default): one mask
      shared across the batch and the heads.
    attention_kernel_init: "xavier_uniform" (vmoe, ViT) or "lecun_normal"
      (flax's default) for the q/k/v/out kernels.
    attention_qk_norm: LayerNorm (no bias) on queries and keys per head
      (flax's `normalize_qk`, vmoe's `attention_qk_norm`).
    mlp_activation: "gelu" (ViT's tanh approximation, the default),
      "gelu_exact" (the erf form, torch's `nn.GELU()`), "relu", or "swiglu"
      (gated: `silu(x W_0) * (x W_up)`, a third kernel `Dense_up`), for the
      dense MLPs and the experts alike (`vmoe_ext.moe.experts`).
    moe: None for a dense ViT, else a dict of `MOE_DEFAULTS` fields.
    stream: the residual stream `{"name": ..., **fields}` (`vmoe_ext.streams`;
      default plain), for the MoE blocks or, with `blocks="all"`, every block.
    state_axis_name: the data-parallel axis name over which persistent router
      state updates are averaged (None: no reduction), like BatchNorm's
      `axis_name`, for a model applied inside a data-parallel `shard_map`
      or `pmap`; under `jit` over a mesh the arrays are global and the
      statistics are the whole batch's without it.
    expert_parallel: None, or the mesh layout of expert parallelism
      (`vmoe_ext.moe.expert_parallel.ExpertParallel`, from the `sharding`
      config section): every MoE layer runs its experts in a `shard_map`
      with two all-to-alls; results equal the single-device model's.

  Calling it returns `(logits [B, num_classes], metrics)` where `metrics` has
  `auxiliary_loss` (sum over MoE layers, 0 for a dense model) and, per MoE
  block i, `metrics["layer_i"]` with that layer's losses, `expert_load [E]`,
  `expert_usage [E]` and `drop_rate`. Each MoE layer sows its `expert_mask`
  `[B, T, E]`, `selected_experts` `[B, T, K]` and its input `moe_input`
  `[B, T, D]` (after the block's LayerNorm) into the "intermediates"
  collection.
  """
  num_classes: int
  patch_size: tuple[int, int] = (4, 4)
  hidden_size: int = 64
  num_layers: int = 4
  num_heads: int = 4
  mlp_dim: int = 128
  classifier: str = "token"
  representation_size: Optional[int] = None
  head_kernel_zero_init: bool = True
  head_bias_init: float = 0.0
  position_emb: str = "learned"
  position_emb_temperature: float = 10_000.0
  dropout_rate: float = 0.0
  attention_dropout_rate: float = 0.0
  attention_broadcast_dropout: bool = False
  attention_kernel_init: str = "xavier_uniform"
  attention_qk_norm: bool = False
  mlp_activation: str = "gelu"
  moe: Optional[Mapping[str, Any]] = None
  stream: Optional[Mapping[str, Any]] = None
  state_axis_name: Optional[str] = None
  expert_parallel: Optional[ExpertParallel] = None
  dtype: Any = jnp.float32

  def __post_init__(self):
    require(self.num_classes > 0, "num_classes",
            f"must be positive, got {self.num_classes}")
    require(self.classifier in CLASSIFIERS, "classifier",
            f"must be one of {CLASSIFIERS}, got {self.classifier!r}")
    for field in ("hidden_size", "num_layers", "num_heads", "mlp_dim"):
      value = getattr(self, field)
      require(isinstance(value, int) and value > 0, field,
              f"must be a positive integer, got {value!r}")
    patch = tuple(self.patch_size) if isinstance(
        self.patch_size, (tuple, list)) else None
    require(patch is not None and len(patch) == 2
            and all(isinstance(p, int) and p > 0 for p in patch),
            "patch_size", f"must be two positive integers (ph, pw), got "
            f"{self.patch_size!r}")
    require(self.hidden_size % self.num_heads == 0, "num_heads",
            f"{self.num_heads} heads do not divide hidden_size "
            f"{self.hidden_size}")
    for field in ("dropout_rate", "attention_dropout_rate"):
      rate = getattr(self, field)
      require(0.0 <= rate < 1.0, field, f"must be in [0, 1), got {rate}")
    check_activation(self.mlp_activation)
    require(self.representation_size is None
            or (isinstance(self.representation_size, int)
                and self.representation_size > 0), "representation_size",
            f"must be None or a positive integer, got "
            f"{self.representation_size!r}")
    check_position_emb(self.position_emb, self.hidden_size)
    require(self.position_emb_temperature > 0, "position_emb_temperature",
            f"must be positive, got {self.position_emb_temperature}")
    require(self.attention_kernel_init in ATTENTION_KERNEL_INITS,
            "attention_kernel_init", f"must be one of "
            f"{tuple(ATTENTION_KERNEL_INITS)}, got "
            f"{self.attention_kernel_init!r}")
    moe = moe_config(self.moe)
    layers: tuple[int, ...] = ()
    if moe is not None:
      # Validate everything now, before any tracing: placement, router, layer.
      layers = resolve_moe_layers(self.num_layers, moe["layers"],
                                  moe["every"], moe["last"])
      require(isinstance(moe["num_experts"], int) and moe["num_experts"] > 0,
              "moe.num_experts",
              f"must be a positive integer, got {moe['num_experts']!r}")
      layer = build_moe_layer(moe, self.mlp_dim, self.dropout_rate,
                              self.dtype, self.mlp_activation, parent=None)
      require(not layer.router.needs_previous, "moe.router.name",
              f"router {moe['router']['name']!r} reads the previous MoE "
              f"layer's assignment, so it cannot route the first MoE layer "
              f"(block {layers[0]})")
      with field_scope("moe"):
        layer.router.check_placement(layers)
    stream = dict(self.stream or DEFAULT_STREAM)
    STREAMS.build(stream, parent=None).check_placement(layers)
    object.__setattr__(self, "moe", moe)
    object.__setattr__(self, "stream", stream)
    super().__post_init__()

  @property
  def moe_layers(self) -> tuple[int, ...]:
    if self.moe is None:
      return ()
    return resolve_moe_layers(self.num_layers, self.moe["layers"],
                              self.moe["every"], self.moe["last"])

  @nn.compact
  def __call__(self, images: Array, *, deterministic: bool = True,
               update_state: bool = False) -> tuple[Array, dict[str, Any]]:
    """Logits `[B, classes]` and metrics of images `[B, H, W, C]`.

    `deterministic`: no router noise, no dropout. `update_state`: let routers
    update their persistent state (collection "router_state", which must then
    be mutable); training steps set it, evaluation and attacks do not.
    """
    b, h, w, _ = images.shape
    ph, pw = self.patch_size
    require(h % ph == 0 and w % pw == 0, "patch_size",
            f"patch {self.patch_size} does not divide the image size "
            f"{(h, w)}")
    x = nn.Conv(self.hidden_size, (ph, pw), strides=(ph, pw), padding="VALID",
                dtype=self.dtype, name="embedding")(images)
    x = x.reshape(b, -1, self.hidden_size)
    if has_class_token(self.classifier):
      cls = self.param("cls", nn.initializers.zeros, (1, 1, self.hidden_size))
      x = jnp.concatenate([jnp.broadcast_to(cls, (b, 1, self.hidden_size))
                           .astype(x.dtype), x], axis=1)
    if self.position_emb == "learned":
      posemb = self.param("pos_embedding",
                          nn.initializers.normal(stddev=0.02),
                          (1,) + x.shape[1:])
      x = x + posemb.astype(x.dtype)
    else:
      x = add_fixed_position_emb(x, self.position_emb, (h // ph, w // pw),
                                 self.position_emb_temperature)
    x = nn.Dropout(self.dropout_rate)(x, deterministic=deterministic)

    moe_layers = self.moe_layers
    ctx = RoutingContext(
        stream_state=STREAMS.build(self.stream, parent=None).init_state(x),
        axis_name=self.state_axis_name, moe_blocks=moe_layers)
    metrics: dict[str, Any] = {}
    for block in range(self.num_layers):
      x, ctx, layer_metrics = EncoderBlock(
          num_heads=self.num_heads, mlp_dim=self.mlp_dim,
          dropout_rate=self.dropout_rate,
          attention_dropout_rate=self.attention_dropout_rate,
          mlp_activation=self.mlp_activation,
          attention_qk_norm=self.attention_qk_norm,
          attention_kernel_init=self.attention_kernel_init,
          attention_broadcast_dropout=self.attention_broadcast_dropout,
          moe=self.moe if block in moe_layers else None, stream=self.stream,
          dtype=self.dtype, expert_parallel=self.expert_parallel,
          name=param_name(block))(
              x, ctx.at_block(block), deterministic=deterministic,
              update_state=update_state)
      if layer_metrics is not None:  # Keyed by block: `layer_{block}`.
        metrics[metric_key(block)] = layer_metrics
    x = nn.LayerNorm(name="encoder_norm", dtype=self.dtype)(x)
    logits = classifier_head(
        x, num_classes=self.num_classes, classifier=self.classifier,
        representation_size=self.representation_size,
        head_kernel_zero_init=self.head_kernel_zero_init,
        head_bias_init=self.head_bias_init, num_heads=self.num_heads,
        mlp_dim=self.mlp_dim, attention_qk_norm=self.attention_qk_norm,
        attention_kernel_init=self.attention_kernel_init,
        activation=self.mlp_activation, dtype=self.dtype)
    metrics["auxiliary_loss"] = sum(
        (m["auxiliary_loss"] for m in metrics.values()),
        jnp.zeros((), jnp.float32))
    return logits, metrics
