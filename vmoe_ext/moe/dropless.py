"""Dropless experts: every (token, choice) of token-choice routing is computed.

`moe.dispatcher = "dropless"` (fastmoe's behaviour, the MoE layer of the
ACMoE / Symphony / MomentumSMoE language models): no capacity, nothing
dropped; each token's output is `sum_k gate_k * expert_{e_k}(x)` over its
valid choices, the same as token choice with unlimited capacity. The layout
has no `[E, G*C, D]` buffers:

    rows = the G*S*K choices sorted by expert (invalid choices last),
           each expert's rows padded to whole blocks of b rows    [NB, b, D]
    h    = act(grouped_matmul(rows, Dense_0) + bias of the row's expert)
    out  = grouped_matmul(h, Dense_1) (+ bias)                    [NB, b, D]
    y    = sum over a token's choices of gate * out[its row]      [G, S, D]

`NB = min((M + E*(b-1)) // b, M)` blocks for `M = G*S*K` choices is enough
for any routing (each expert wastes less than one block); the grouped matmul
(`vmoe_ext.moe.grouped`) computes only the used blocks on CPU ("blocks"
backend, b = `block_size`) or the exact rows with `jax.lax.ragged_dot` on
GPU/TPU ("ragged", b = 1: no padding). The gather in and the weighted gather
out are the `indices` dispatcher's (`TokenGatherDispatcher`, one "expert"
per block), so `dispatch_dtype="bfloat16"` rounds as it does there.

Groups do not matter here: the choices of the whole batch share the rows
(the router still sees `[G, S, D]` groups). Capacity fields
(`capacity_factor`, `eval_capacity_factor`, `capacity_multiple`,
`capacity_rounding`) and batch priority have no effect: nothing competes for
room.

Expert dropout, as the other dispatchers (after the activation, and after
the output layer unless `dropout_output=False`), with keep masks drawn per
choice, `[G, S, K, H]` and `[G, S, K, D]`: a choice's mask does not depend
on where its row lands, so the backends and the expert-parallel layout draw
the same masks.

Metrics: `drop_rate` is 0. `expert_usage[e]` is the rows expert e computed
(its valid choices) over `G*S*K/E`, its share of all choice slots: 1 under
perfect balance, above 1 for an expert a cf = 1 capacity buffer would have
overflowed. Where nothing drops it equals the capacity dispatchers' usage at
cf = 1 with `C = S*K/E` exactly.

Expert parallel (`ExpertParallel`, the mesh layout of the capacity
dispatchers, `vmoe_ext.moe.expert_parallel`): row counts are not static, so
no fixed-size all-to-all carries them. Instead each device reads the tokens
and routing of its whole data slice (the `ne` batch shards along the expert
axis; the compiler all-gathers them), computes the choices that go to its
own `E/ne` experts (the others are invalid there), and a `psum_scatter` over
the expert axis sums the experts' contributions and hands each device its
own groups. Traffic: one all-gather and one reduce-scatter of `[Gl*S, D]`
tokens per device; buffers are sized for the worst case (every choice of the
slice on one device), compute follows the actual rows.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import flax.struct
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from vmoe_ext.errors import require
from vmoe_ext.moe.dispatch import (DROPLESS, RoundedDispatcher,
                                   TokenGatherDispatcher)
from vmoe_ext.moe.expert_parallel import ExpertParallel
from vmoe_ext.moe.experts import (GATED, _dropout, expert_dropout_keep,
                                  hidden_activation)
from vmoe_ext.moe.grouped import BlockGroups, grouped_matmul, resolve_backend
from vmoe_ext.moe.routing import Routing, TokenChoiceRouting

Array = jax.Array
DEFAULT_BLOCK_SIZE = 128


@flax.struct.dataclass
class DroplessPlan:
  """Where every choice's row lives in the expert-sorted blocks.

  Attributes:
    dispatcher: `TokenGatherDispatcher` with `source [NB*b]` (flat token
      `g*S + s` of each row; `G*S`, read as zeros, for padding rows),
      `slot [G, S, K]` (row of each choice; `NB*b` for invalid ones, read
      as zeros), `weights [G, S, K]` (gates, 0 where invalid) and one
      "expert" per block: dispatch gives `[NB, b, D]`.
    groups: the blocks' experts (`vmoe_ext.moe.grouped.BlockGroups`).
    choice: `[NB*b]` int32, flat choice `(g*S + s)*K + k` of each row;
      `G*S*K` for padding rows.
    block_size: b.
  """
  dispatcher: TokenGatherDispatcher
  groups: BlockGroups
  choice: Array
  block_size: int = flax.struct.field(pytree_node=False)


def num_blocks(num_choices: int, num_experts: int, block_size: int) -> int:
  """NB: blocks of b rows that hold M choices sorted by expert, each
  expert's rows padded to whole blocks, for any split of M over E."""
  return min((num_choices + num_experts * (block_size - 1)) // block_size,
             num_choices)


def make_dropless_plan(routing: TokenChoiceRouting, num_experts: int,
                       block_size: int = DEFAULT_BLOCK_SIZE,
                       expert_offset: Any = 0) -> DroplessPlan:
  """Sorts the `[G, S, K]` choices of `routing` by expert into blocks.

  Args:
    routing: token-choice routing.
    num_experts: E, the experts laid out (an expert-parallel shard's own).
    block_size: b, rows per block (capped at `G*S*K`).
    expert_offset: the first expert laid out; choices of experts outside
      `[offset, offset + E)` get no row (as invalid choices).
  """
  idx = routing.expert_indices - expert_offset
  valid = routing.valid & (idx >= 0) & (idx < num_experts)
  g, s, k = idx.shape
  m = g * s * k
  b = max(1, min(block_size, m))
  nb = num_blocks(m, num_experts, b)
  rows = nb * b
  expert = jnp.where(valid, idx, num_experts).reshape(m).astype(jnp.int32)
  counts = jnp.bincount(expert, length=num_experts + 1)[:num_experts]
  blocks = (counts + b - 1) // b
  block_end = jnp.cumsum(blocks)
  block_start = block_end - blocks
  row_start = jnp.cumsum(counts) - counts
  order = jnp.argsort(expert, stable=True)
  sorted_expert = expert[order]
  own = jnp.minimum(sorted_expert, num_experts - 1)
  rank = jnp.arange(m, dtype=jnp.int32) - row_start[own]
  row = jnp.where(sorted_expert < num_experts, block_start[own] * b + rank,
                  rows).astype(jnp.int32)
  slot = jnp.zeros((m,), jnp.int32).at[order].set(row)
  choice = jnp.arange(m, dtype=jnp.int32)
  source = jnp.full((rows,), g * s, jnp.int32).at[slot].set(
      choice // k, mode="drop")
  row_choice = jnp.full((rows,), m, jnp.int32).at[slot].set(choice,
                                                            mode="drop")
  block_expert = jnp.minimum(
      jnp.searchsorted(block_end, jnp.arange(nb), side="right"),
      num_experts - 1).astype(jnp.int32)
  groups = BlockGroups(block_expert=block_expert,
                       used_blocks=block_end[-1].astype(jnp.int32),
                       group_sizes=(blocks * b).astype(jnp.int32))
  weights = jnp.where(valid, routing.gates, 0)
  dispatcher = TokenGatherDispatcher(source, slot.reshape(g, s, k), weights,
                                     nb)
  return DroplessPlan(dispatcher, groups, row_choice, b)


def dropless_usage(routing: TokenChoiceRouting, num_experts: int) -> Array:
  """`[E]`: valid choices of each expert over `G*S*K/E` (1 = balanced)."""
  g, s, k = routing.expert_indices.shape
  one_hot = jax.nn.one_hot(routing.expert_indices, num_experts,
                           dtype=jnp.float32)
  rows = jnp.einsum("gske,gsk->e", one_hot,
                    routing.valid.astype(jnp.float32))
  return rows * num_experts / (g * s * k)


def grouped_experts(params: Mapping[str, Mapping[str, Array]], x: Array,
                    groups: BlockGroups, *, backend: str,
                    activation: str = "gelu", dropout_rate: float = 0.0,
                    dropout_output: bool = True,
                    dropout_keep: Optional[tuple[Array, Array]] = None,
                    dtype: Any = jnp.float32) -> Array:
  """The experts' MLPs on expert-sorted rows `[NB, b, D] -> [NB, b, D]`.

  Args:
    params: as `vmoe_ext.moe.experts.mlp_experts` (`[E, ...]` leaves).
    x: rows in blocks, block n belonging to `groups.block_expert[n]`.
    groups: the blocks' experts.
    backend: "blocks" or "ragged" (`vmoe_ext.moe.grouped`).
    activation / dropout_rate / dropout_output / dtype: as `mlp_experts`.
    dropout_keep: keep masks `[NB, b, H]` and `[NB, b, D]` of the rows, or
      None (no dropout).
  """
  keep = dropout_keep if dropout_rate > 0 and dropout_keep else (None, None)
  x = x.astype(dtype)

  def dense(name: str, v: Array) -> Array:
    layer = params[name]
    out = grouped_matmul(v, layer["kernel"].astype(dtype), groups, backend)
    if "bias" in layer:
      out = out + layer["bias"].astype(dtype)[groups.block_expert][:, None]
    return out

  up = dense("Dense_up", x) if activation in GATED else None
  h = hidden_activation(activation, dense("Dense_0", x), up)
  h = _dropout(h, dropout_rate, keep[0])
  y = dense("Dense_1", h)
  if not dropout_output:
    return y
  return _dropout(y, dropout_rate, keep[1])


def _local_moe(tokens: Array, routing: TokenChoiceRouting,
               params: Mapping[str, Any],
               keep: Optional[tuple[Array, Array]], *, num_experts: int,
               expert_offset: Any, block_size: int, backend: str,
               dispatch_dtype: Any, dtype: Any, **mlp: Any) -> Array:
  """`[G, S, D]`: the contributions of experts `[offset, offset + E)`."""
  plan = make_dropless_plan(routing, num_experts,
                            1 if backend == "ragged" else block_size,
                            expert_offset)
  dispatcher = plan.dispatcher
  if dispatch_dtype is not None and jnp.dtype(dispatch_dtype) != jnp.float32:
    dispatcher = RoundedDispatcher(dispatcher, dispatch_dtype,
                                   copies_tokens=True)
  x = dispatcher.dispatch(tokens.astype(dtype))  # [NB, b, D]
  rows_keep = None
  if keep is not None:
    nb, b, _ = x.shape
    rows_keep = tuple(
        jnp.take(m.reshape(-1, m.shape[-1]), plan.choice, axis=0,
                 mode="fill", fill_value=False).reshape(nb, b, -1)
        for m in keep)
  y = grouped_experts(params, x, plan.groups, backend=backend,
                      dropout_keep=rows_keep, dtype=dtype, **mlp)
  return dispatcher.combine(y.astype(dtype))


def dropless_moe(routing: Routing, tokens: Array, params: Mapping[str, Any],
                 *, num_experts: int, activation: str = "gelu",
                 dropout_rate: float = 0.0, dropout_output: bool = True,
                 dropout_rng: Optional[Array] = None,
                 dispatch_dtype: Any = None, dtype: Any = jnp.float32,
                 backend: str = "auto",
                 block_size: int = DEFAULT_BLOCK_SIZE,
                 expert_parallel: Optional[ExpertParallel] = None
                 ) -> tuple[Array, Array, Array]:
  """Dropless MoE: every valid choice computed, on one device or a mesh.

  Args:
    routing: token-choice routing `[G, S, K]` (others are a ConfigError on
      `moe.dispatcher`).
    tokens: `[G, S, D]` what the experts read.
    params: the experts' weights (`vmoe_ext.moe.experts.mlp_experts`).
    num_experts: E.
    activation / dropout_rate / dropout_output / dtype: of the experts.
    dropout_rng: the experts' dropout key, None when deterministic.
    dispatch_dtype: None, or the dtype the data is rounded to around
      dispatch and combine (as the `indices` dispatcher).
    backend: "auto", "blocks" or "ragged" (`vmoe_ext.moe.grouped`).
    block_size: b of the "blocks" backend (rows per block).
    expert_parallel: None, or the mesh layout (module docstring).

  Returns:
    `[G, S, D]` the combined expert outputs, the drop rate (0) and the
    expert usage `[E]` (module docstring).
  """
  require(isinstance(routing, TokenChoiceRouting), "moe.dispatcher",
          f"{DROPLESS!r} computes every choice of token-choice routing; got "
          f"{type(routing).__name__}: use 'indices' or 'einsum'")
  require(isinstance(block_size, int) and not isinstance(block_size, bool)
          and block_size > 0, "moe.dropless_block_size",
          f"must be a positive integer, got {block_size!r}")
  backend = resolve_backend(backend)
  g, s, width = tokens.shape
  k = routing.num_selected
  keep = None
  if dropout_rng is not None and dropout_rate > 0:
    hidden = params["Dense_0"]["kernel"].shape[-1]
    keep = tuple(m.reshape(g, s, k, -1) for m in expert_dropout_keep(
        dropout_rng, dropout_rate, g * s, k, hidden, width))
  local = lambda tokens, routing, params, keep, experts, offset: _local_moe(
      tokens, routing, params, keep, num_experts=experts,
      expert_offset=offset, block_size=block_size, backend=backend,
      dispatch_dtype=dispatch_dtype, dtype=dtype, activation=activation,
      dropout_rate=dropout_rate, dropout_output=dropout_output)
  usage = dropless_usage(routing, num_experts)
  zero = jnp.zeros((), jnp.float32)
  if expert_parallel is None:
    return local(tokens, routing, params, keep, num_experts, 0), zero, usage

  ep = expert_parallel
  ep.check_experts(num_experts)
  ep.check_groups(g)
  own = num_experts // ep.expert_size

  def shard(tokens, routing, params, keep):
    offset = jax.lax.axis_index(ep.expert_axis) * own
    y = local(tokens, routing, params, keep, own, offset)  # [G/nd, S, D]
    return jax.lax.psum_scatter(y, ep.expert_axis, scatter_dimension=0,
                                tiled=True)

  data = PartitionSpec(ep.data_axes)
  keep_spec = None if keep is None else (data, data)
  y = jax.shard_map(
      shard, mesh=ep.mesh,
      in_specs=(data, data, PartitionSpec(ep.expert_axis), keep_spec),
      out_specs=PartitionSpec(ep.batch_axes))(tokens, routing, params, keep)
  return y, zero, usage
