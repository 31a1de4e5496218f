"""Vision Transformer with sparse MoE blocks (V-MoE layout), dense ViT, SoftMoE ViT.

One encoder serves all three: a dense ViT has no MoE blocks, a V-MoE replaces
the MLP of some blocks by an `MoeLayer` with a token-choice or expert-choice
router, a SoftMoE ViT uses the "soft" router with one image per group. The
encoder threads a `RoutingContext` through the blocks so that routers and
residual streams that look across layers stay pure functions.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from vmoe_ext.errors import require
from vmoe_ext.models.attention import check_attention, flax_attention_fn
from vmoe_ext.models.heads import (ATTENTION_KERNEL_INITS, CLASSIFIERS,
                                   classifier_head, has_class_token)
from vmoe_ext.models.placement import resolve_moe_layers
from vmoe_ext.models.precision import (at_least_float32, cast_params,
                                       float32_state,
                                       resolve_precision_fields)
from vmoe_ext.models.position import (add_fixed_position_emb,
                                      check_position_emb)
from vmoe_ext.models.stack import (Segment, apply_stack, block_builder,
                                    check_remat, check_scan, plan_segments)
from vmoe_ext.models.sublayer import (DEFAULT_STREAM, MOE_DEFAULTS, MlpBlock,
                                      build_moe_layer, check_moe_placement,
                                      check_stream_placement, mlp_sublayer,
                                      moe_config)
from vmoe_ext.moe.contract import RoutingContext
from vmoe_ext.moe.expert_parallel import ExpertParallel
from vmoe_ext.moe.experts import check_activation
from vmoe_ext.streams import STREAMS

Array = jax.Array

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
  attention: str = "plain"
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
        attention_fn=flax_attention_fn(self.attention),
        deterministic=deterministic, dtype=self.dtype, name="Attention")(y, y)
    y = nn.Dropout(self.dropout_rate)(y, deterministic=deterministic)
    x = x + y
    norm = nn.LayerNorm(name="LayerNorm_1", dtype=self.dtype)
    return mlp_sublayer(
        x, ctx, norm, moe=self.moe, stream=self.stream, mlp_dim=self.mlp_dim,
        dropout_rate=self.dropout_rate, activation=self.mlp_activation,
        dtype=self.dtype, expert_parallel=self.expert_parallel,
        deterministic=deterministic, update_state=update_state)


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
    attention: "plain" (flax's attention), "fused" or "cudnn"
      (`jax.nn.dot_product_attention`, `vmoe_ext.models.attention`), for
      the encoder blocks and the "map" head; same parameters, same values.
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
    remat: "none" (keep every activation), "full" (recompute each block's
      activations in the backward pass) or a `jax.checkpoint_policies` name
      of `vmoe_ext.models.stack.REMAT_POLICIES` (e.g. "dots_saveable": keep
      the matmul outputs), per encoder block; same values and gradients.
    scan: apply runs of identical blocks (periods of the MoE placement) with
      one `nn.scan` (`vmoe_ext.models.stack`): params of a run are stacked
      `[n, ...]` under `scan_{start}_{period}x{n}`; same values. Not for
      routers or streams that read the block position (Symphony, ACMoE,
      the first-layer and time-varying momentum streams) nor with
      expert_parallel.
    expert_parallel: None, or the mesh layout of expert parallelism
      (`vmoe_ext.moe.expert_parallel.ExpertParallel`, from the `sharding`
      config section): every MoE layer runs its experts in a `shard_map`
      with two all-to-alls; results equal the single-device model's.
    dtype / param_dtype: the compute and the parameter dtype, "float32" (the
      default) or "bfloat16" (`vmoe_ext.models.precision`: what stays
      float32; the logits are returned in float32).

  Calling it returns `(logits [B, num_classes], metrics)` where `metrics` has
  `auxiliary_loss` (sum over MoE layers, 0 for a dense model) and, per MoE
  block i, `metrics["layer_i"]` with that layer's losses, `expert_load [E]`,
  `expert_usage [E]` and `drop_rate`. Each MoE layer sows its `expert_mask`
  `[B, T, E]`, `selected_experts` `[B, T, K]`, its input `moe_input`
  `[B, T, D]` (after the block's LayerNorm) and its output `moe_output`
  `[B, T, D]` into the "intermediates" collection.
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
  attention: str = "plain"
  mlp_activation: str = "gelu"
  moe: Optional[Mapping[str, Any]] = None
  stream: Optional[Mapping[str, Any]] = None
  state_axis_name: Optional[str] = None
  expert_parallel: Optional[ExpertParallel] = None
  dtype: Any = jnp.float32
  param_dtype: Any = jnp.float32
  remat: str = "none"
  scan: bool = False

  def __post_init__(self):
    resolve_precision_fields(self)  # Names ("bfloat16") -> dtypes.
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
    check_attention(self.attention, dtype=self.dtype,
                    head_dims=(self.hidden_size // self.num_heads,),
                    attention_dropout_rate=self.attention_dropout_rate)
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
    stream = dict(self.stream or DEFAULT_STREAM)
    if moe is not None:
      # Validate everything now, before any tracing: placement, router, layer.
      layers = resolve_moe_layers(self.num_layers, moe["layers"],
                                  moe["every"], moe["last"])
      check_moe_placement(moe, stream, (layers,), self.mlp_dim,
                          self.dropout_rate, self.dtype, self.mlp_activation)
    else:
      check_stream_placement(stream, ((),))
    check_remat(self.remat)
    check_scan(self.scan, moe and build_moe_layer(
        moe, self.mlp_dim, self.dropout_rate, self.dtype,
        self.mlp_activation, parent=None).router,
               STREAMS.build(stream, parent=None),
               expert_parallel=self.expert_parallel)
    object.__setattr__(self, "moe", moe)
    object.__setattr__(self, "stream", stream)
    super().__post_init__()

  def init(self, rngs: Any, *args: Any, **kwargs: Any) -> Any:
    """`nn.Module.init`, the parameters then cast to `param_dtype`."""
    return cast_params(super().init(rngs, *args, **kwargs), self.param_dtype)

  @property
  def moe_layers(self) -> tuple[int, ...]:
    if self.moe is None:
      return ()
    return resolve_moe_layers(self.num_layers, self.moe["layers"],
                              self.moe["every"], self.moe["last"])

  @property
  def scan_segments(self) -> Optional[tuple[Segment, ...]]:
    """The scanned runs and unrolled blocks (None: `scan` off)."""
    if not self.scan:
      return None
    moe_layers = self.moe_layers
    return plan_segments([b in moe_layers for b in range(self.num_layers)])

  def check_image_size(self, image_size: tuple[int, int]) -> None:
    """Raises ConfigError on `patch_size` unless it divides `(H, W)`."""
    h, w = image_size
    ph, pw = self.patch_size
    require(h % ph == 0 and w % pw == 0, "patch_size",
            f"patch {tuple(self.patch_size)} does not divide the {h}x{w} "
            "images (set data.image_size to resize)")

  def token_grid(self, block: int, image_size: tuple[int, int]
                 ) -> tuple[int, int, int]:
    """`(h, w, extra)`: every block sees the `h x w` patch grid
    (row-major) after `extra` leading tokens (1: the class token)."""
    del block
    ph, pw = self.patch_size
    return (image_size[0] // ph, image_size[1] // pw,
            1 if has_class_token(self.classifier) else 0)

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
        stream_state=float32_state(
            STREAMS.build(self.stream, parent=None).init_state(x)),
        axis_name=self.state_axis_name, moe_blocks=moe_layers)
    make_block = block_builder(EncoderBlock, self.remat, 2,
                               prevent_cse=not self.scan)

    def build(block: int, name: str) -> Callable:
      return make_block(
          num_heads=self.num_heads, mlp_dim=self.mlp_dim,
          dropout_rate=self.dropout_rate,
          attention_dropout_rate=self.attention_dropout_rate,
          mlp_activation=self.mlp_activation,
          attention_qk_norm=self.attention_qk_norm,
          attention_kernel_init=self.attention_kernel_init,
          attention_broadcast_dropout=self.attention_broadcast_dropout,
          attention=self.attention,
          moe=self.moe if block in moe_layers else None, stream=self.stream,
          dtype=self.dtype, expert_parallel=self.expert_parallel,
          name=name)

    # Keyed by block: `layer_{block}`.
    x, ctx, metrics = apply_stack(
        build, x, ctx, self.num_layers, self.scan_segments,
        deterministic=deterministic, update_state=update_state)
    x = nn.LayerNorm(name="encoder_norm", dtype=self.dtype)(x)
    logits = classifier_head(
        x, num_classes=self.num_classes, classifier=self.classifier,
        representation_size=self.representation_size,
        head_kernel_zero_init=self.head_kernel_zero_init,
        head_bias_init=self.head_bias_init, num_heads=self.num_heads,
        mlp_dim=self.mlp_dim, attention_qk_norm=self.attention_qk_norm,
        attention_kernel_init=self.attention_kernel_init,
        attention=self.attention,
        activation=self.mlp_activation, dtype=self.dtype)
    metrics["auxiliary_loss"] = sum(
        (m["auxiliary_loss"] for m in metrics.values()),
        jnp.zeros((), jnp.float32))
    return at_least_float32(logits), metrics


# `MOE_DEFAULTS`, `MlpBlock`, `build_moe_layer` and `moe_config` live in
# `vmoe_ext.models.sublayer` (shared with the Swin backbone); they stay
# importable from here.
__all__ = ["DEFAULT_STREAM", "EncoderBlock", "MOE_DEFAULTS", "MlpBlock",
           "VisionTransformerMoe", "build_moe_layer", "moe_config"]
