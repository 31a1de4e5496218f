"""The sparse MoE MLP layer: router -> dispatcher -> experts -> combine.

The layer never branches on the routing form: every form builds its dispatch
plan, its expert mask and its token-major assignment through the same calls
(`vmoe_ext.moe.routing`, `vmoe_ext.moe.dispatch`).
"""

from __future__ import annotations

import warnings
from typing import Any, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from vmoe_ext.errors import require
from vmoe_ext.moe.capacity import ROUNDINGS, compute_capacity
from vmoe_ext.moe.dispatch import DISPATCHERS, DROPLESS, make_dispatch_plan
from vmoe_ext.moe.contract import (TOKEN_CHOICE, Assignment, LayerRecord,
                                   Metrics, Router, RoutingContext,
                                   check_router_output)
from vmoe_ext.moe.dropless import DEFAULT_BLOCK_SIZE, dropless_moe
from vmoe_ext.moe.expert_parallel import ExpertParallel, expert_parallel_moe
from vmoe_ext.moe.experts import (INIT_MODES, DenseMlp, MlpExperts,
                                  check_activation)
from vmoe_ext.moe.grouped import BACKENDS

Array = jax.Array


def group_tokens(x: Array, group_size: Optional[int]) -> Array:
  """`[B, T, D] -> [G, S, D]`: consecutive tokens (whole images first) per group.

  `group_size=None` makes every image its own group (S = T).
  """
  b, t, d = x.shape
  s = t if group_size is None else group_size
  require((b * t) % s == 0, "moe.group_size",
          f"group size S={s} does not divide the B*T={b}*{t}={b * t} tokens "
          "of the batch")
  return x.reshape(b * t // s, s, d)


DISPATCH_DTYPES = {None: None, "float32": jnp.float32,
                   "bfloat16": jnp.bfloat16}
OUTPUT_BIASES = ("experts", "once", "none")


class MoeLayer(nn.Module):
  """Sparse mixture-of-experts MLP on `[B, T, D]` tokens.

  Attributes:
    router: an unbound `Router` (see `vmoe_ext.routers`), E = its num_experts.
    hidden_size: H, the hidden width of each expert MLP.
    group_size: S, tokens per routing group (None: one image per group).
      Capacity and balancing losses are per group.
    capacity_factor: cf in `C = ceil(S*K*cf/E)`.
    eval_capacity_factor: the cf of deterministic calls (evaluation,
      attacks, routing analysis), None: `capacity_factor`; vmoe evaluates
      its from-scratch models at 4.0 (`evaluate.model_overrides`).
    capacity_multiple: round C up to a multiple of this (None: the rounding
      mode's default, 1 for "exact" and "tutel", 4 for "vmoe").
    capacity_rounding: "exact" (ceil of `S*K*cf/E` with float noise rounded
      away, the default), "vmoe" (google's vmoe: ceil of the raw float
      product; at S=800, K=2, E=8, cf=1.1 it gives 224 where "exact" gives
      220) or "tutel" (microsoft/tutel, Swin-MoE: `K * int(cf * ceil(S/E))`);
      see `vmoe_ext.moe.capacity`.
    dispatcher: "indices" (gather/scatter, fast), "einsum" (one-hot masks)
      or "dropless" (token choice only: every choice computed, no capacity,
      drop rate 0; the capacity fields and batch priority have no effect;
      `vmoe_ext.moe.dropless`).
    batch_priority: fill expert buffers by decreasing top-1 gate (or the
      routing's `priority`, which `swin_moe` sets to tutel's max score).
    dropout_rate: dropout inside the experts.
    dropout_output: the experts apply dropout after the activation and
      after their output layer (True, vmoe's and the dense ViT MLP's
      placement) or after the activation only (False: tutel's experts,
      `dropout(act(x W_0 + b_0)) W_1 (+ b_1)`, as Swin-MoE). Shared experts
      follow the same rule.
    expert_init: "independent" or "shared" expert initialisation.
    dispatch_dtype: None (float32 throughout) or "bfloat16": the data is
      rounded to bfloat16 around dispatch and combine (the tokens before
      dispatch, the expert outputs before combine) while the dispatch/combine
      weights and the contractions stay float32, as vmoe's
      `Bfloat16Dispatcher` (its configs ask for it; its SoftMoE always does);
      the gradients as vmoe's too (token and expert choice: each slot's
      cotangent rounded before a token's slots are summed,
      `vmoe_ext.moe.dispatch.RoundedDispatcher`).
    shared_experts: N_s, experts every token goes through with weight 1
      (DeepSeekMoE, CMoE), added to the routed output; held together as one
      dense MLP `SharedMlp` of width `N_s * hidden_size`, outside routing,
      capacity and dropping; it reads the layer's input `x`, not a router's
      transformed `expert_inputs` (ACMoE's scaling is routing). 0: none.
    output_bias: "experts" (vmoe: each expert's output layer has a bias,
      weighted by the expert's gate like the rest of its output) or "once"
      (the experts' output layers, shared ones included, have no bias; the
      layer adds one bias `[D]` to every token's output, dropped tokens
      included, as the dense MLP it replaces does; carving needs it so that
      the carved layer equals the dense one) or "none" (no output bias at
      all, neither per expert nor once: Swin-MoE's `MLP_FC2_BIAS: False`,
      which freezes tutel's zero-initialised expert output bias).
    activation: the experts' MLP activation (`vmoe_ext.moe.experts`), set by
      the model from its `mlp_activation`.
    expert_parallel: None (one device, or left to the compiler), or the
      mesh layout under which dispatch, experts and combine run in a
      `shard_map` with two all-to-alls (`vmoe_ext.moe.expert_parallel`);
      the results equal the single-device layer's.
    dropless_backend: the "dropless" dispatcher's grouped matmul: "auto"
      (`jax.lax.ragged_dot` on GPU/TPU, padded blocks on CPU), "ragged" or
      "blocks" (`vmoe_ext.moe.grouped`).
    dropless_block_size: rows per block of the "blocks" backend.
  """
  router: Router
  hidden_size: int
  group_size: Optional[int] = None
  capacity_factor: float = 1.0
  eval_capacity_factor: Optional[float] = None
  capacity_multiple: Optional[int] = None
  capacity_rounding: str = "exact"
  dispatcher: str = "indices"
  batch_priority: bool = False
  dropout_rate: float = 0.0
  dropout_output: bool = True
  expert_init: str = "independent"
  dispatch_dtype: Optional[str] = None
  shared_experts: int = 0
  output_bias: str = "experts"
  activation: str = "gelu"
  dtype: Any = jnp.float32
  expert_parallel: Optional[ExpertParallel] = None
  dropless_backend: str = "auto"
  dropless_block_size: int = DEFAULT_BLOCK_SIZE

  def __post_init__(self):
    DISPATCHERS.check(self.dispatcher)
    if self.dispatcher == DROPLESS:
      kind = self.router.kind
      require(kind == TOKEN_CHOICE, "moe.dispatcher",
              f"{DROPLESS!r} computes every choice of token-choice routing; "
              f"router {type(self.router).__name__} gives {kind} routing "
              "(no per-token choices to keep): use 'indices' or 'einsum'")
    require(self.dropless_backend in BACKENDS, "moe.dropless_backend",
            f"must be one of {BACKENDS}, got {self.dropless_backend!r}")
    require(isinstance(self.dropless_block_size, int)
            and not isinstance(self.dropless_block_size, bool)
            and self.dropless_block_size > 0, "moe.dropless_block_size",
            f"must be a positive integer, got {self.dropless_block_size!r}")
    require(self.capacity_factor is not None and self.capacity_factor > 0,
            "moe.capacity_factor", f"must be > 0, got {self.capacity_factor}")
    require(self.eval_capacity_factor is None
            or self.eval_capacity_factor > 0, "moe.eval_capacity_factor",
            f"must be > 0 or None, got {self.eval_capacity_factor}")
    require(self.group_size is None or self.group_size > 0, "moe.group_size",
            f"must be positive or None, got {self.group_size}")
    require(self.capacity_rounding in ROUNDINGS, "moe.capacity_rounding",
            f"must be one of {ROUNDINGS}, got {self.capacity_rounding!r}")
    require(self.dispatch_dtype in DISPATCH_DTYPES, "moe.dispatch_dtype",
            f"must be one of {list(DISPATCH_DTYPES)}, got "
            f"{self.dispatch_dtype!r}")
    require(isinstance(self.shared_experts, int)
            and not isinstance(self.shared_experts, bool)
            and self.shared_experts >= 0, "moe.shared_experts",
            f"must be an integer >= 0, got {self.shared_experts!r}")
    require(self.output_bias in OUTPUT_BIASES, "moe.output_bias",
            f"must be one of {OUTPUT_BIASES}, got {self.output_bias!r}")
    require(self.capacity_multiple is None or (
        isinstance(self.capacity_multiple, int)
        and not isinstance(self.capacity_multiple, bool)
        and self.capacity_multiple > 0), "moe.capacity_multiple",
            f"must be None or a positive integer, got "
            f"{self.capacity_multiple!r}")
    require(0.0 <= self.dropout_rate < 1.0, "moe.dropout_rate",
            f"must be in [0, 1), got {self.dropout_rate}")
    require(isinstance(self.dropout_output, bool), "moe.dropout_output",
            f"must be True or False, got {self.dropout_output!r}")
    require(self.expert_init in INIT_MODES, "moe.expert_init",
            f"unknown expert init {self.expert_init!r}; expected one of "
            f"{INIT_MODES}")
    check_activation(self.activation, "mlp_activation")
    super().__post_init__()

  @property
  def num_experts(self) -> int:
    return self.router.num_experts

  @nn.compact
  def __call__(self, x: Array, ctx: RoutingContext, *,
               deterministic: bool = True, update_state: bool = False,
               primary: bool = True, record: Optional[bool] = None
               ) -> tuple[Array, Metrics, LayerRecord]:
    """Applies the layer.

    Args:
      x: `[B, T, D]` tokens (already layer-normalised by the block).
      ctx: the routing context of this block.
      deterministic: no router noise, no dropout.
      update_state: let the router update its persistent state.
      primary: this is the block's primary evaluation (the router sees
        `ctx.primary`): sow the intermediates and allow state updates. A
        residual stream that evaluates the layer more than once marks its
        other calls `primary=False`; they neither sow nor update router state
        (see `vmoe_ext.streams.base`).
      record: deprecated alias of `primary`, kept for one release.

    Returns:
      y: `[B, T, D]` the MoE output (0 for fully dropped tokens).
      metrics: router metrics plus `drop_rate`, `expert_load` `[E]` (share of
        the selections each expert received, before capacity) and
        `expert_usage` `[E]` (fraction of each expert's slots filled; for
        "dropless", its rows over `G*S*K/E`, see `vmoe_ext.moe.dropless`).
      layer_record: the `LayerRecord` (token-major assignment `[B, T, K]`
        and the router's forwarded data) for the later MoE layers' context.
    """
    if record is not None:
      warnings.warn("MoeLayer(..., record=...) is deprecated, kept for one "
                    "release; use primary=...", DeprecationWarning,
                    stacklevel=2)
      primary = record
    b, t, d = x.shape
    e = self.num_experts
    if self.router.needs_image_groups:
      require(self.group_size in (None, t), "moe.group_size",
              f"router {type(self.router).__name__} mixes the tokens of a "
              f"group, so a group must be one image (S = T = {t}); got "
              f"{self.group_size}: set it to {t} or None (one image per "
              "group)")
    if self.router.needs_previous:
      require(ctx.previous is not None, "moe.router.name",
              f"router {type(self.router).__name__} reads the previous MoE "
              "layer's assignment, so it cannot route the first MoE layer")
    xg = group_tokens(x, self.group_size)
    num_groups, s, _ = xg.shape
    factor = self.capacity_factor
    if deterministic and self.eval_capacity_factor is not None:
      factor = self.eval_capacity_factor
    capacity = compute_capacity(s, self.router.slots_per_token, factor, e,
                                self.capacity_multiple,
                                rounding=self.capacity_rounding)
    out = self.router(xg, ctx.replace(primary=primary), capacity=capacity,
                      deterministic=deterministic,
                      update_state=update_state and primary)
    check_router_output(self.router, out)
    routing = out.routing
    dtype = DISPATCH_DTYPES[self.dispatch_dtype]
    tokens = xg if out.expert_inputs is None else out.expert_inputs
    per_expert_bias = self.output_bias == "experts"
    experts = MlpExperts(
        num_experts=e, hidden_size=self.hidden_size,
        activation=self.activation, output_bias=per_expert_bias,
        dropout_rate=self.dropout_rate, dropout_output=self.dropout_output,
        init_mode=self.expert_init, dtype=self.dtype, name="Mlp")
    if self.dispatcher == DROPLESS:
      y, drop_rate, usage = experts(
          tokens, deterministic=deterministic,
          compute=lambda params, tokens, rng: dropless_moe(
              routing, tokens, params, num_experts=e,
              activation=self.activation, dropout_rate=self.dropout_rate,
              dropout_output=self.dropout_output, dropout_rng=rng,
              dispatch_dtype=dtype, dtype=self.dtype,
              backend=self.dropless_backend,
              block_size=self.dropless_block_size,
              expert_parallel=self.expert_parallel))
    elif self.expert_parallel is None:
      plan = make_dispatch_plan(routing, num_experts=e, group_size=s,
                                capacity=capacity, kind=self.dispatcher,
                                batch_priority=self.batch_priority,
                                dtype=dtype)
      expert_outputs = experts(plan.dispatcher.dispatch(
          tokens.astype(self.dtype)), deterministic=deterministic)
      y = plan.dispatcher.combine(expert_outputs.astype(self.dtype))
      drop_rate, usage = plan.drop_rate, plan.expert_usage
    else:
      y, drop_rate, usage = experts(
          tokens, deterministic=deterministic,
          compute=lambda params, tokens, rng: expert_parallel_moe(
              self.expert_parallel, routing, tokens, params, num_experts=e,
              capacity=capacity, dispatcher=self.dispatcher,
              batch_priority=self.batch_priority, dispatch_dtype=dtype,
              activation=self.activation, dropout_rate=self.dropout_rate,
              dropout_output=self.dropout_output, dropout_rng=rng,
              dtype=self.dtype))
    y = y.reshape(b, t, d).astype(x.dtype)
    if self.shared_experts:
      y = y + DenseMlp(self.shared_experts * self.hidden_size,
                       self.dropout_rate, self.dtype, self.activation,
                       output_bias=per_expert_bias,
                       dropout_output=self.dropout_output, name="SharedMlp")(
                           x, deterministic=deterministic).astype(x.dtype)
    if self.output_bias == "once":
      y = y + self.param("bias", nn.initializers.normal(stddev=1e-6),
                         (d,)).astype(x.dtype)

    mask = routing.expert_mask(e)
    mask_f = mask.astype(jnp.float32)
    metrics = dict(out.metrics)
    metrics["drop_rate"] = drop_rate
    metrics["expert_load"] = (jnp.sum(mask_f, axis=(0, 1))
                              / jnp.maximum(jnp.sum(mask_f), 1.0))
    metrics["expert_usage"] = usage
    indices, gates, valid = routing.assignment(e)
    assignment = Assignment(expert_indices=indices.reshape(b, t, -1),
                            gates=gates.reshape(b, t, -1),
                            valid=valid.reshape(b, t, -1))
    if primary:
      self.sow("intermediates", "expert_mask", mask.reshape(b, t, e))
      self.sow("intermediates", "selected_experts", assignment.expert_indices)
      self.sow("intermediates", "moe_input", x)
      self.sow("intermediates", "moe_output", y)
    return (y, metrics,
            LayerRecord(assignment, out.forward, ctx.block,
                        num_experts=e, width=d))
