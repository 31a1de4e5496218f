"""Expert parallelism: experts split over a mesh axis, tokens moved by two all-to-alls.

Layout (vmoe's): the mesh has `data_axes + (expert_axis,)` (any other axes
replicate). The G routing groups are split over the batch axes
`data_axes + (expert_axis,)` together: shard `(i, j)` (data index i, expert
index j, data-major) holds `Gl = G / n` consecutive groups. The E experts'
weights are split over `expert_axis` (E / ne experts a device), replicated
over the data axes.

The router runs outside, on the global `[G, S, D]` array (the compiler splits
it over the groups; its batch statistics, losses and state are those of the
whole batch). Then, in one `jax.shard_map` taking the expert weights as
arguments, every shard does:

    plan = make_dispatch_plan(local routing)     # group-local, no traffic
    x = plan.dispatcher.dispatch(tokens)         # [E, Gl*C, D]
    x = all_to_all(x, expert_axis, 0 -> 1)       # [E/ne, ne*Gl*C, D]
    y = mlp_experts(local weights, x)            # [E/ne, ne*Gl*C, D]
    y = all_to_all(y, expert_axis, 1 -> 0)       # [E, Gl*C, D]
    out = plan.dispatcher.combine(y)             # [Gl, S, D]

The buffer device `(i, j)` holds between the two all-to-alls is the block
(experts of j, groups of data slice i) of the single-device buffer
`[E, G*C, D]`: that buffer sharded `P(expert_axis, data_axes)`. The experts'
dropout masks are drawn on the global buffer shape and passed in with that
sharding, so dropout too equals the single-device layer's. Drop rate and
expert usage are reduced over all shards (counts summed, not rates
averaged). Token choice, expert choice and soft routing take this same path:
their routings are all group-major pytrees. The dropless layer has no
fixed-size buffers and runs its own `shard_map` on this layout (an
all-gather of its data slice and one reduce-scatter,
`vmoe_ext.moe.dropless`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Optional

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from vmoe_ext.errors import require
from vmoe_ext.moe.dispatch import make_dispatch_plan
from vmoe_ext.moe.experts import expert_dropout_keep, mlp_experts
from vmoe_ext.moe.routing import Routing

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class ExpertParallel:
  """Where an MoE layer's experts and groups live on a mesh.

  Attributes:
    mesh: the device mesh (`vmoe_ext.sharding.mesh.make_mesh`).
    expert_axis: the axis the experts are split over (and the all-to-alls
      run over).
    data_axes: the other axes the batch is split over.
  """
  mesh: Mesh
  expert_axis: str = "expert"
  data_axes: tuple[str, ...] = ("data",)

  def __post_init__(self):
    names = tuple(self.mesh.axis_names)
    for axis in (self.expert_axis, *self.data_axes):
      require(axis in names, "sharding.axes",
              f"axis {axis!r} is not an axis of the mesh {names}")

  @property
  def batch_axes(self) -> tuple[str, ...]:
    """The axes the batch (and the routing groups) are split over."""
    return tuple(self.data_axes) + (self.expert_axis,)

  @property
  def num_shards(self) -> int:
    """n: the number of batch shards."""
    return math.prod(self.mesh.shape[a] for a in self.batch_axes)

  @property
  def expert_size(self) -> int:
    """ne: the size of the expert axis."""
    return self.mesh.shape[self.expert_axis]

  def check_experts(self, num_experts: int) -> None:
    """An error naming the field unless E splits over the expert axis."""
    require(num_experts % self.expert_size == 0, "model.moe.num_experts",
            f"E={num_experts} experts do not split over the "
            f"{self.expert_axis!r} mesh axis of size {self.expert_size} "
            "(sharding.shape)")

  def check_groups(self, num_groups: int,
                   batch_field: str = "data.batch_size") -> None:
    """An error naming `batch_field` unless G splits over the batch shards
    (a shard must hold whole routing groups)."""
    require(num_groups % self.num_shards == 0, batch_field,
            f"the batch has G={num_groups} routing groups, which do not "
            f"split over the {self.num_shards} batch shards of the mesh "
            f"axes {self.batch_axes} (sharding.shape); make the batch size "
            "(or model.moe.group_size) give a multiple of "
            f"{self.num_shards} groups")


def expert_parallel_moe(ep: ExpertParallel, routing: Routing, tokens: Array,
                        params: Mapping[str, Any], *, num_experts: int,
                        capacity: Optional[int], dispatcher: str,
                        batch_priority: bool, dispatch_dtype: Any,
                        activation: str, dropout_rate: float,
                        dropout_rng: Optional[Array], dtype: Any,
                        dropout_output: bool = True
                        ) -> tuple[Array, Array, Array]:
  """Dispatch, experts and combine of one MoE layer, expert-parallel.

  Args:
    ep: the layout.
    routing: the router's output for the global `[G, S, ...]` groups.
    tokens: `[G, S, D]` what the experts read (the router's expert inputs).
    params: the experts' weights (`mlp_experts`), `[E, ...]` leaves.
    num_experts: E.
    capacity: C for token choice (the routing's own for the others).
    dispatcher: "indices" or "einsum".
    batch_priority: batch-priority routing.
    dispatch_dtype: None, or the dtype the data is rounded to around
      dispatch and combine (the weights stay float32); the all-to-alls then
      move the data in that dtype wherever that is exact.
    activation / dropout_rate / dropout_output / dtype: of the experts.
    dropout_rng: the experts' dropout key, None when deterministic.

  Returns:
    `[G, S, D]` the combined expert outputs, the drop rate and the expert
    usage `[E]` of the whole batch.
  """
  num_groups, group_size, width = tokens.shape
  ep.check_experts(num_experts)
  ep.check_groups(num_groups)
  plan_of = lambda r: make_dispatch_plan(
      r, num_experts=num_experts, group_size=group_size, capacity=capacity,
      kind=dispatcher, batch_priority=batch_priority, dtype=dispatch_dtype)
  shape = jax.eval_shape(plan_of, routing)
  slots = shape.capacity
  keep = None
  if dropout_rng is not None and dropout_rate > 0:
    hidden = params["Dense_0"]["kernel"].shape[-1]
    keep = expert_dropout_keep(dropout_rng, dropout_rate, num_experts,
                               num_groups * slots, hidden, width)
  batch = PartitionSpec(ep.batch_axes)
  buffer = PartitionSpec(ep.expert_axis, ep.data_axes)
  # Rounded dispatch: the expert outputs travel back in the rounded dtype
  # (combine rounds them first, so this is exact); the dispatched buffers
  # too where the plan copies rounded tokens (not SoftMoE's weighted sums).
  back = dispatch_dtype or dtype
  send = back if shape.copies_tokens else dtype

  def shard(tokens: Array, routing: Routing, params: Mapping[str, Any],
            keep: Optional[tuple[Array, Array]]):
    plan = plan_of(routing)
    x = plan.dispatcher.dispatch(tokens.astype(dtype))  # [E, Gl*C, D]
    x = jax.lax.all_to_all(x.astype(send), ep.expert_axis, 0, 1, tiled=True)
    y = mlp_experts(params, x.astype(dtype), activation=activation,
                    dropout_rate=dropout_rate, dropout_output=dropout_output,
                    dropout_keep=keep, dtype=dtype)
    y = jax.lax.all_to_all(y.astype(back), ep.expert_axis, 1, 0, tiled=True)
    out = plan.dispatcher.combine(y.astype(dtype))  # [Gl, S, D]
    axes = ep.batch_axes
    drop = (jax.lax.psum(plan.dropped, axes)
            / jnp.maximum(jax.lax.psum(plan.requested, axes), 1.0))
    usage = jax.lax.pmean(plan.expert_usage, axes)
    return out, drop, usage

  keep_spec = None if keep is None else (buffer, buffer)
  return jax.shard_map(
      shard, mesh=ep.mesh,
      in_specs=(batch, batch, PartitionSpec(ep.expert_axis), keep_spec),
      out_specs=(batch, PartitionSpec(), PartitionSpec()))(
          tokens, routing, params, keep)
