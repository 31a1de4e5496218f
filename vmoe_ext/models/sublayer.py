"""The MLP sublayer of an encoder block: a dense MLP or an MoE layer, through
the model's residual stream; the `moe` config and its checks.

Shared by every backbone (`vmoe_ext.models.vit`, `vmoe_ext.models.swin`): a
block computes its token mixing (global or window attention), then calls
`mlp_sublayer`, which builds the block's `Mlp` or `Moe` and its `Stream`
in the block's scope, so the parameter names are the same in every
backbone (`encoderblock_i/Moe/...`).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional, Sequence

import flax.linen as nn
import jax

from vmoe_ext.errors import ConfigError, field_scope, require
from vmoe_ext.models.precision import keep_dtypes
from vmoe_ext.moe.contract import RoutingContext
from vmoe_ext.moe.expert_parallel import ExpertParallel
from vmoe_ext.moe.experts import DenseMlp
from vmoe_ext.moe.layer import MoeLayer
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
                                   # | "tutel" (K * int(cf * ceil(S / E)))
    "dispatcher": "indices",    # "indices" | "einsum" | "dropless"
    "dropless_backend": "auto",  # dropless grouped matmul: "auto" (ragged_dot
                                 # on GPU/TPU, padded blocks on CPU) |
                                 # "ragged" | "blocks"
    "dropless_block_size": 128,  # rows per block of the "blocks" backend
    "batch_priority": False,    # BPR
    "dropout_rate": None,       # expert dropout (None: the model's)
    "dropout_output": True,     # also after the experts' output layer
                                # (False: after the activation only, tutel)
    "expert_init": "independent",
    "dispatch_dtype": None,     # None (float32) | "bfloat16"
    "shared_experts": 0,        # N_s always-on experts of width hidden_size
    "output_bias": "experts",   # "experts" (vmoe) | "once" (dense-exact)
                                # | "none" (Swin-MoE's MLP_FC2_BIAS False)
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
      dropless_backend=moe["dropless_backend"],
      dropless_block_size=moe["dropless_block_size"],
      batch_priority=moe["batch_priority"],
      dropout_rate=(dropout_rate if moe["dropout_rate"] is None
                    else moe["dropout_rate"]),
      dropout_output=moe["dropout_output"],
      expert_init=moe["expert_init"],
      dispatch_dtype=moe["dispatch_dtype"],
      shared_experts=moe["shared_experts"], output_bias=moe["output_bias"],
      activation=activation, dtype=dtype, **module_kwargs)


def check_moe_placement(moe: Mapping[str, Any], stream: Mapping[str, Any],
                        stages: Sequence[tuple[int, ...]], mlp_dim: int,
                        dropout_rate: float, dtype: Any, activation: str
                        ) -> None:
  """Checks a filled `moe` config and the stream against the MoE blocks.

  `stages`: the MoE blocks (encoder block indices) of each run of blocks
  that share one token sequence and one routing context: one stage for a
  ViT, one per Swin stage (the context and the stream restart at each).
  Raises ConfigError naming the field, before any tracing.
  """
  require(isinstance(moe["num_experts"], int) and moe["num_experts"] > 0,
          "moe.num_experts",
          f"must be a positive integer, got {moe['num_experts']!r}")
  layer = build_moe_layer(moe, mlp_dim, dropout_rate, dtype, activation,
                          parent=None)
  firsts = tuple(s[0] for s in stages if s)
  require(not layer.router.needs_previous, "moe.router.name",
          f"router {moe['router']['name']!r} reads the previous MoE "
          f"layer's assignment, so it cannot route the first MoE layer "
          f"(block {firsts[0] if len(firsts) == 1 else firsts})")
  with field_scope("moe"):
    layer.router.check_stages(tuple(s for s in stages if s))
  check_stream_placement(stream, stages)


def check_stream_placement(stream: Mapping[str, Any],
                           stages: Sequence[tuple[int, ...]]) -> None:
  """Checks the stream against the MoE blocks of each stage."""
  built = STREAMS.build(stream, parent=None)
  for blocks in stages:
    built.check_placement(tuple(blocks))


def mlp_sublayer(x: Array, ctx: RoutingContext, norm: nn.Module, *,
                 moe: Optional[Mapping[str, Any]], stream: Mapping[str, Any],
                 mlp_dim: int, dropout_rate: float, activation: str,
                 dtype: Any, expert_parallel: Optional[ExpertParallel],
                 deterministic: bool, update_state: bool,
                 mlp_output_bias: bool = True,
                 branch: Optional[Callable[[Array], Array]] = None
                 ) -> tuple[Array, RoutingContext, Optional[dict]]:
  """`x + f(norm(x))` (or the stream's update) of a block: `[B, T, D]`.

  Call it inside a block's compact method: the `Mlp` or `Moe`, and the
  `Stream`, are built in the block's scope. The model's stream
  (`vmoe_ext.streams`) handles MoE blocks, and dense blocks too when its
  `blocks == "all"`; other dense blocks use the plain residual and pass the
  stream state through. The stream's state travels in `ctx.stream_state`;
  an MoE block appends its `LayerRecord` to `ctx`. `branch` maps each
  evaluation `f` before the stream uses it (Swin's stochastic depth);
  `mlp_output_bias=False` drops the dense MLP's output bias (Swin-MoE's
  `mlp_fc2_bias`).

  Returns the new `x`, the context, and the MoE metrics (None when dense).
  """
  branch = branch or (lambda f: f)
  is_moe = moe is not None
  if is_moe:
    layer = build_moe_layer(moe, mlp_dim, dropout_rate, dtype, activation,
                            name="Moe", expert_parallel=expert_parallel)
  else:
    bias = {} if mlp_output_bias else {"output_bias": False}
    layer = MlpBlock(mlp_dim, dropout_rate, dtype, activation, name="Mlp",
                     **bias)
  if not is_moe and STREAMS.build(stream, parent=None).blocks != "all":
    return x + branch(layer(norm(x), deterministic=deterministic)), ctx, None

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
    return branch(f), aux

  built = STREAMS.build(stream, name="Stream")
  # The stream keeps the activations' dtype and its state's (float32 under a
  # bfloat16 `dtype`, `vmoe_ext.models.precision`).
  x_new, state = built(x, ffn, ctx.stream_state, ctx=ctx, is_moe=is_moe)
  x, state = x_new.astype(x.dtype), keep_dtypes(state, ctx.stream_state)
  if len(primary_aux) != 1:
    raise ValueError(
        f"stream {type(built).__name__} made {len(primary_aux)} primary "
        "ffn calls in one block; the contract is exactly one (mark the "
        "others primary=False)")
  ctx = ctx.replace(stream_state=state)
  if not is_moe:
    return x, ctx, None
  metrics, layer_record = primary_aux[0]
  return x, ctx.after_moe(layer_record), metrics


__all__ = ["DEFAULT_STREAM", "MOE_DEFAULTS", "MlpBlock", "build_moe_layer",
           "check_moe_placement", "check_stream_placement", "mlp_sublayer",
           "moe_config"]
