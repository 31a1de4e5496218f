"""The router contract and the context threaded through the encoder (DESIGN §3).

A router is a Flax linen module called as

    routing, metrics = router(x, ctx, capacity=C, deterministic=...)

with `x` the group-major tokens `[G, S, D]`, `ctx` a `RoutingContext`, and
`capacity` the per-group expert capacity C computed by the MoE layer (used by
expert choice; token-choice routers leave capacity to the dispatcher).
`routing` is one of the forms in `vmoe_ext.moe.routing`; `metrics` is a dict of
scalars that always contains `auxiliary_loss` (already weighted). A router
never touches expert weights.

Persistent non-parameter router state (e.g. Symphony's co-selection graph)
lives in its own Flax variable collection, mutated only in training.
"""

from __future__ import annotations

from typing import Any, ClassVar, Optional

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp

from vmoe_ext.moe.routing import Routing, TokenChoiceRouting

Array = jax.Array
Metrics = dict[str, Array]

TOKEN_CHOICE = "token_choice"
EXPERT_CHOICE = "expert_choice"
SOFT = "soft"


@flax.struct.dataclass
class RoutingContext:
  """State carried from block to block through the encoder.

  Attributes:
    layer_index: index of the encoder block being applied (static).
    moe_index: how many MoE layers came before this block (static); 0 means
      the current MoE layer is the first one.
    previous: the `TokenChoiceRouting` of the previous MoE layer (`[G, S, K]`
      in the same grouping), or None before the first MoE layer. Routers that
      need it (ACMoE) read it; the encoder writes it after every MoE layer.
    stream_state: the residual stream's state (e.g. momentum buffers), a
      pytree owned by the stream, or None.
  """
  layer_index: int = flax.struct.field(pytree_node=False, default=0)
  moe_index: int = flax.struct.field(pytree_node=False, default=0)
  previous: Optional[TokenChoiceRouting] = None
  stream_state: Any = None

  def at_layer(self, layer_index: int) -> "RoutingContext":
    return self.replace(layer_index=layer_index)

  def after_moe(self, routing: Routing) -> "RoutingContext":
    """Context for the blocks after an MoE layer that produced `routing`."""
    previous = routing if isinstance(routing, TokenChoiceRouting) else None
    return self.replace(moe_index=self.moe_index + 1, previous=previous)


class Router(nn.Module):
  """Base class of every router.

  Subclasses set `kind` (one of "token_choice", "expert_choice", "soft") and
  implement `__call__`. Token-choice routers also report `slots_per_token`
  (K), which the MoE layer uses to size expert buffers.

  Attributes:
    num_experts: E.
  """
  num_experts: int

  kind: ClassVar[str] = TOKEN_CHOICE
  # Soft routing mixes tokens of a group, so a group must be one image.
  needs_image_groups: ClassVar[bool] = False

  @property
  def slots_per_token(self) -> int:
    """K in `C = ceil(S*K*cf/E)`; 1 unless the router selects K experts."""
    return 1

  def __call__(self, x: Array, ctx: RoutingContext, *, capacity: int,
               deterministic: bool) -> tuple[Routing, Metrics]:
    raise NotImplementedError


class LinearLogits(nn.Module):
  """Router logits `l = x W`, `W: [D, E]`, no bias; computed in `dtype`."""
  num_experts: int
  dtype: Any = jnp.float32
  kernel_init: Any = nn.initializers.lecun_normal()

  @nn.compact
  def __call__(self, x: Array) -> Array:
    """x: `[G, S, D]` -> logits `[G, S, E]`."""
    return nn.Dense(self.num_experts, use_bias=False, dtype=self.dtype,
                    param_dtype=jnp.float32, kernel_init=self.kernel_init,
                    name="dense")(x.astype(self.dtype))
