"""Dispatchers: move tokens `[G, S, D]` into expert buffers `[E, G*C, D]` and back.

Two implementations of token-choice and expert-choice dispatch agree to float
tolerance:

* `einsum` — the vmoe reference: one-hot masks `[G, S, E, C]` contracted with
  the tokens. Simple and sharding friendly, but it costs `O(G*S*E*C*D)` FLOPs,
  which for one big group exceeds the experts' own compute.
* `indices` — gather/scatter of token rows into fixed-capacity buffers: costs
  memory traffic only (`O(E*G*C*D)` moves). The fast path on CPU/GPU.

Soft routing (SoftMoE) is dense by construction: every slot is a weighted sum
of all tokens, so both dispatcher names use the same weighted contraction.

A third name, `dropless`, has no capacity and no `[E, G*C, D]` buffers: every
choice of token-choice routing is computed, on expert-sorted rows
(`vmoe_ext.moe.dropless`; the MoE layer runs it instead of a plan here).

Plans and dispatchers are pytrees (static sizes are not leaves), so a
`shard_map` or `jit` can take them as arguments. `dtype=jnp.bfloat16` rounds
the *data* (the tokens before dispatch, the expert outputs before combine) to
bfloat16, as google's vmoe `Bfloat16Dispatcher` does (its configs ask for it;
its SoftMoE router always does): the dispatch/combine weights stay float32
and the contractions accumulate in float32, so the result is the exact
float32 dispatch/combine of bfloat16-rounded data (`RoundedDispatcher`). The
gradients follow vmoe's too: where vmoe dispatches with a boolean tensor
(token and expert choice) its dispatch einsum runs in bfloat16, so each
slot's cotangent is rounded to bfloat16 before a token's slots are summed.

Capacity rules for token choice (as vmoe): buffers are filled choice-major —
every token's first choice before any token's second choice — and, within one
choice rank, in token order, or, with batch-priority routing (BPR), in order of
decreasing top-1 gate (or of the routing's `priority`, where given; tutel's
`extract_critical` orders the same way). A choice that finds its expert's
buffer full is dropped: it contributes 0 to the token's output (the residual
stream still carries it).
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Protocol

import flax.struct
import jax
import jax.numpy as jnp

from vmoe_ext.errors import require
from vmoe_ext.registry import Registry
from vmoe_ext.moe.routing import (ExpertChoiceRouting, Routing, SoftRouting,
                                  TokenChoiceRouting)

Array = jax.Array
DROPLESS = "dropless"
# Config name (`moe.dispatcher`) -> the token-choice dispatcher it selects
# (expert-choice routing has its own gather form; soft routing is dense under
# both names; "dropless" is token choice only, without a plan here).
DISPATCHERS = Registry("dispatcher", {
    "einsum": "vmoe_ext.moe.dispatch:EinsumDispatcher",
    "indices": "vmoe_ext.moe.dispatch:TokenGatherDispatcher",
    DROPLESS: "vmoe_ext.moe.dropless:dropless_moe",
}, field="moe.dispatcher")


class Dispatcher(Protocol):
  """Moves tokens to expert buffers and expert outputs back to tokens."""

  def dispatch(self, x: Array) -> Array:
    """`[G, S, D] -> [E, G*C, D]`."""

  def combine(self, y: Array) -> Array:
    """`[E, G*C, D] -> [G, S, D]`, weighting each slot by its combine weight."""


@flax.struct.dataclass
class DispatchPlan:
  """A dispatcher plus what it decided.

  Attributes:
    dispatcher: the `Dispatcher` to apply to tokens and expert outputs.
    capacity: C, slots per expert per group (P for soft routing).
    drop_rate: scalar, fraction of requested (token, expert) assignments that
      found no room (token choice); fraction of tokens picked by no expert
      (expert choice); 0 for soft routing.
    expert_usage: `[E]`, fraction of each expert's `G*C` buffer slots filled.
    dropped / requested: scalars, the counts behind `drop_rate` (dropped
      over requested, with at least 1 requested), so that shards of a batch
      give the whole batch's drop rate (`vmoe_ext.moe.expert_parallel`).
    copies_tokens: every buffer slot holds one token or zeros (token and
      expert choice), so dispatched data is exact in the dtype the tokens
      were rounded to; False where slots mix tokens (soft routing).
  """
  dispatcher: Dispatcher
  drop_rate: Array
  expert_usage: Array
  dropped: Array
  requested: Array
  capacity: int = flax.struct.field(pytree_node=False)
  copies_tokens: bool = flax.struct.field(pytree_node=False, default=True)


# ----------------------------------------------------------------------------
# Dispatcher implementations.
# ----------------------------------------------------------------------------


@flax.struct.dataclass
class EinsumDispatcher:
  """Dense dispatch/combine tensors `[G, S, E, C]` (vmoe's reference form)."""
  dispatch_weights: Array
  combine_weights: Array

  def dispatch(self, x: Array) -> Array:
    _, _, num_experts, capacity = self.dispatch_weights.shape
    w = self.dispatch_weights.astype(x.dtype)
    out = jnp.einsum("gsec,gsd->egcd", w, x)
    return out.reshape(num_experts, -1, x.shape[-1])

  def combine(self, y: Array) -> Array:
    num_groups, _, num_experts, capacity = self.combine_weights.shape
    y = y.reshape(num_experts, num_groups, capacity, y.shape[-1])
    w = self.combine_weights.astype(y.dtype)
    return jnp.einsum("gsec,egcd->gsd", w, y)


@flax.struct.dataclass
class TokenGatherDispatcher:
  """Token choice by gathers: each buffer slot knows its source token.

  Attributes:
    source: `[E*G*C]` int32, flat token id (`g*S + s`) filling each slot;
      `G*S` (out of range, read as zeros) for empty slots.
    slot: `[G, S, K]` int32, flat buffer slot (`e*G*C + g*C + c`) of each
      choice; `E*G*C` (out of range, read as zeros) for dropped choices.
    weights: `[G, S, K]`, combine weight of each choice (0 when dropped).
    num_experts: E.
  """
  source: Array
  slot: Array
  weights: Array
  num_experts: int = flax.struct.field(pytree_node=False)

  def dispatch(self, x: Array) -> Array:
    x_flat = x.reshape(-1, x.shape[-1])
    out = jnp.take(x_flat, self.source, axis=0, mode="fill", fill_value=0)
    return out.reshape(self.num_experts, -1, x.shape[-1])

  def combine(self, y: Array) -> Array:
    y_flat = y.reshape(-1, y.shape[-1])
    picked = jnp.take(y_flat, self.slot, axis=0, mode="fill", fill_value=0)
    return jnp.einsum("gsk,gskd->gsd", self.weights.astype(y.dtype), picked)


@flax.struct.dataclass
class ExpertGatherDispatcher:
  """Expert choice by gather (dispatch) and scatter-add (combine).

  Attributes:
    source: `[E, G*C]` int32, flat token id (`g*S + s`) picked by each slot.
    weights: `[E, G*C]`, combine weight of each slot.
    num_groups: G.
    group_size: S.
  """
  source: Array
  weights: Array
  num_groups: int = flax.struct.field(pytree_node=False)
  group_size: int = flax.struct.field(pytree_node=False)

  def dispatch(self, x: Array) -> Array:
    x_flat = x.reshape(-1, x.shape[-1])
    return jnp.take(x_flat, self.source, axis=0)

  def combine(self, y: Array) -> Array:
    d = y.shape[-1]
    contrib = (self.weights[..., None].astype(y.dtype) * y).reshape(-1, d)
    out = jnp.zeros((self.num_groups * self.group_size, d), y.dtype)
    out = out.at[self.source.reshape(-1)].add(contrib)
    return out.reshape(self.num_groups, self.group_size, d)


def round_to(x: Array, dtype: Any) -> Array:
  """`x` rounded to `dtype` (round to nearest even) and cast back."""
  return x.astype(dtype).astype(x.dtype)


@flax.struct.dataclass
class RoundedDispatcher:
  """Rounds the data, not the weights, to `dtype` around a dispatcher.

  vmoe's `Bfloat16Dispatcher`: `dispatch(x)` is the wrapped dispatch of
  `x` rounded to `dtype`, `combine(y)` the wrapped combine of `y` rounded;
  the wrapped dispatcher's weights and accumulation stay in `x`'s dtype.

  `copies_tokens` (token and expert choice: every slot holds one token or
  zeros) also rounds the dispatched buffers `[E, G*C, D]`: a no-op forward
  (they hold rounded tokens), but in the backward pass each slot's
  cotangent is rounded to `dtype` before the slots of a token are summed
  (in `x`'s dtype, then rounded once more by the input's rounding). That is
  vmoe's dispatch `einsum("GSEC,GSD->GECD", bool_weights, bf16_data)`,
  which runs in bfloat16 (accumulating in float32, rounding its output),
  its output cast back to float32. vmoe's SoftMoE dispatch weights are
  float32, its dispatch einsum float32: no slot rounding there.
  """
  dispatcher: Dispatcher
  dtype: Any = flax.struct.field(pytree_node=False)
  copies_tokens: bool = flax.struct.field(pytree_node=False, default=False)

  def dispatch(self, x: Array) -> Array:
    """`[G, S, D] -> [E, G*C, D]` of `x` rounded (see the class docstring)."""
    out = self.dispatcher.dispatch(round_to(x, self.dtype))
    return round_to(out, self.dtype) if self.copies_tokens else out

  def combine(self, y: Array) -> Array:
    return self.dispatcher.combine(round_to(y, self.dtype))


# ----------------------------------------------------------------------------
# Token-choice capacity assignment (shared by both dispatchers).
# ----------------------------------------------------------------------------


def token_choice_positions(routing: TokenChoiceRouting, num_experts: int,
                           capacity: int,
                           batch_priority: bool = False) -> tuple[Array, Array]:
  """Position of every choice in its expert's buffer, and whether it fits.

  Args:
    routing: token-choice routing with `[G, S, K]` fields.
    num_experts: E.
    capacity: C.
    batch_priority: fill buffers in order of decreasing priority (the
      routing's `priority` where the router gives one, else the largest
      valid gate of each token; ties keep token order) instead of token
      order.

  Returns:
    position: `[G, S, K]` int32, 0-based rank of the choice among those sent
      to the same expert of the same group (meaningless where not valid).
    kept: `[G, S, K]` bool, valid and `position < C`.
  """
  idx, valid = routing.expert_indices, routing.valid
  num_groups, group_size, k = idx.shape
  if batch_priority:
    priority = routing.priority
    if priority is None:
      priority = jnp.max(jnp.where(valid, routing.gates, -jnp.inf), axis=-1)
    order = jnp.argsort(-priority, axis=-1, stable=True)  # [G, S]
    idx = jnp.take_along_axis(idx, order[..., None], axis=1)
    valid = jnp.take_along_axis(valid, order[..., None], axis=1)
  one_hot = jax.nn.one_hot(idx, num_experts, dtype=jnp.int32)
  one_hot = one_hot * valid[..., None].astype(jnp.int32)  # [G, S, K, E]
  # Choice-major order: rank 0 of all tokens, then rank 1, ...
  one_hot = one_hot.transpose(0, 2, 1, 3).reshape(num_groups, k * group_size,
                                                  num_experts)
  ranks = jnp.cumsum(one_hot, axis=1) - 1
  position = jnp.sum(ranks * one_hot, axis=-1)
  position = position.reshape(num_groups, k, group_size).transpose(0, 2, 1)
  if batch_priority:
    inverse = jnp.argsort(order, axis=-1)
    position = jnp.take_along_axis(position, inverse[..., None], axis=1)
  kept = routing.valid & (position < capacity)
  return position.astype(jnp.int32), kept


def _token_choice_plan(routing: TokenChoiceRouting, num_experts: int,
                       capacity: int, kind: str, batch_priority: bool
                       ) -> DispatchPlan:
  require(capacity is not None and capacity > 0, "capacity",
          f"token-choice dispatch needs a positive capacity, got {capacity}")
  position, kept = token_choice_positions(routing, num_experts, capacity,
                                          batch_priority)
  num_groups, group_size, _ = position.shape
  weights = jnp.where(kept, routing.gates, 0)
  expert_one_hot = jax.nn.one_hot(routing.expert_indices, num_experts,
                                  dtype=jnp.float32)  # [G, S, K, E]
  kept_f = kept.astype(jnp.float32)
  kept_per_expert = jnp.einsum("gske,gsk->e", expert_one_hot, kept_f)
  num_valid = jnp.sum(routing.valid.astype(jnp.float32))
  # Counts are exact in float32: no drop gives exactly 0 (not 1 - 1 + eps).
  dropped = num_valid - jnp.sum(kept_f)
  drop_rate = dropped / jnp.maximum(num_valid, 1.0)
  usage = kept_per_expert / (num_groups * capacity)

  if kind == "einsum":
    position_one_hot = jax.nn.one_hot(position, capacity, dtype=jnp.float32)
    where_kept = expert_one_hot * kept_f[..., None]
    dispatch_w = jnp.einsum("gske,gskc->gsec", where_kept, position_one_hot)
    combine_w = jnp.einsum("gske,gskc,gsk->gsec", where_kept, position_one_hot,
                           routing.gates.astype(jnp.float32))
    dispatcher = EinsumDispatcher(dispatch_w, combine_w)
  else:
    num_slots = num_experts * num_groups * capacity
    group = jnp.arange(num_groups, dtype=jnp.int32)[:, None, None]
    slot = (routing.expert_indices * (num_groups * capacity) + group * capacity
            + position)
    slot = jnp.where(kept, slot, num_slots)
    token = (group * group_size
             + jnp.arange(group_size, dtype=jnp.int32)[None, :, None])
    token = jnp.broadcast_to(token, slot.shape)
    source = jnp.full((num_slots,), num_groups * group_size, jnp.int32)
    source = source.at[slot.reshape(-1)].set(token.reshape(-1), mode="drop")
    dispatcher = TokenGatherDispatcher(source, slot, weights, num_experts)
  return DispatchPlan(dispatcher, drop_rate, usage, dropped, num_valid,
                      capacity)


def _expert_choice_plan(routing: ExpertChoiceRouting, num_experts: int,
                        capacity: int, kind: str, batch_priority: bool
                        ) -> DispatchPlan:
  del num_experts, capacity, batch_priority  # Fixed by the routing's shape.
  num_groups, num_experts, capacity = routing.token_indices.shape
  group_size = routing.group_size
  weights = routing.weights
  picked = jax.nn.one_hot(routing.token_indices, group_size,
                          dtype=jnp.float32)  # [G, E, C, S]
  routed = jnp.any(picked > 0, axis=(1, 2))  # [G, S]
  drop_rate = 1.0 - jnp.mean(routed.astype(jnp.float32))
  dropped = jnp.sum(1.0 - routed.astype(jnp.float32))
  usage = jnp.ones((num_experts,), jnp.float32)
  if kind == "einsum":
    dispatch_w = picked.transpose(0, 3, 1, 2)  # [G, S, E, C]
    combine_w = dispatch_w * routing.weights[:, None].astype(jnp.float32)
    dispatcher = EinsumDispatcher(dispatch_w, combine_w)
  else:
    group = jnp.arange(num_groups, dtype=jnp.int32)[:, None, None]
    source = (routing.token_indices + group * group_size).transpose(1, 0, 2)
    weights = weights.transpose(1, 0, 2)
    dispatcher = ExpertGatherDispatcher(
        source.reshape(num_experts, num_groups * capacity),
        weights.reshape(num_experts, num_groups * capacity), num_groups,
        group_size)
  return DispatchPlan(dispatcher, drop_rate, usage, dropped,
                      jnp.asarray(routed.size, jnp.float32), capacity)


def _soft_plan(routing: SoftRouting, num_experts: int, capacity: int,
               kind: str, batch_priority: bool) -> DispatchPlan:
  del num_experts, capacity, kind, batch_priority  # Dense by construction.
  _, _, num_experts, slots = routing.dispatch_weights.shape
  dispatcher = EinsumDispatcher(routing.dispatch_weights,
                                routing.combine_weights)
  zero = jnp.zeros((), jnp.float32)
  return DispatchPlan(dispatcher, zero, jnp.ones((num_experts,), jnp.float32),
                      zero, jnp.ones((), jnp.float32), slots,
                      copies_tokens=False)


# One planner per routing form: `(routing, E, C, kind, bpr) -> plan`.
PLANNERS: dict[type, Callable[..., DispatchPlan]] = {
    TokenChoiceRouting: _token_choice_plan,
    ExpertChoiceRouting: _expert_choice_plan,
    SoftRouting: _soft_plan,
}


def make_dispatch_plan(routing: Routing,
                       *,
                       num_experts: int,
                       group_size: int,
                       capacity: Optional[int],
                       kind: str = "indices",
                       batch_priority: bool = False,
                       dtype: Any = None) -> DispatchPlan:
  """Builds the dispatcher for `routing`.

  Args:
    routing: any routing form (see `vmoe_ext.moe.routing`).
    num_experts: E.
    group_size: S (expert-choice and soft routings carry it in their shapes).
    capacity: C for token choice (ignored by expert-choice and soft routing,
      whose capacity is fixed by the router's output shape).
    kind: "einsum" or "indices" ("dropless" is an error: it has no plan).
    batch_priority: batch-priority routing (token choice only).
    dtype: None, or the dtype the data is rounded to around dispatch and
      combine (`RoundedDispatcher`; the weights stay float32). None and
      float32 return the plain plan.
  """
  del group_size
  DISPATCHERS.check(kind, field="dispatcher")
  require(kind != DROPLESS, "dispatcher",
          f"{DROPLESS!r} has no fixed-capacity plan: run it with "
          "vmoe_ext.moe.dropless.dropless_moe (the MoE layer does)")
  planner = PLANNERS.get(type(routing))
  if planner is None:
    raise TypeError(f"unsupported routing type {type(routing).__name__}")
  plan = planner(routing, num_experts, capacity, kind, batch_priority)
  if dtype is None or jnp.dtype(dtype) == jnp.float32:
    return plan
  return plan.replace(dispatcher=RoundedDispatcher(
      plan.dispatcher, dtype, copies_tokens=plan.copies_tokens))
