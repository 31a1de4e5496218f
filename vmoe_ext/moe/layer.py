"""The sparse MoE MLP layer: router -> dispatcher -> experts -> combine."""

from __future__ import annotations

from typing import Any, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from vmoe_ext.errors import require
from vmoe_ext.moe.capacity import compute_capacity
from vmoe_ext.moe.dispatch import DISPATCHERS, make_dispatch_plan
from vmoe_ext.moe.experts import MlpExperts
from vmoe_ext.moe.routing import ExpertChoiceRouting, TokenChoiceRouting
from vmoe_ext.routers.base import Metrics, Router, RoutingContext

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


class MoeLayer(nn.Module):
  """Sparse mixture-of-experts MLP on `[B, T, D]` tokens.

  Attributes:
    router: an unbound `Router` (see `vmoe_ext.routers`), E = its num_experts.
    hidden_size: H, the hidden width of each expert MLP.
    group_size: S, tokens per routing group (None: one image per group).
      Capacity and balancing losses are per group.
    capacity_factor: cf in `C = ceil(S*K*cf/E)`.
    capacity_multiple: round C up to a multiple of this (vmoe uses 4).
    dispatcher: "indices" (gather/scatter, fast) or "einsum" (one-hot masks).
    batch_priority: fill expert buffers by decreasing top-1 gate.
    dropout_rate: dropout inside the experts.
    expert_init: "independent" or "shared" expert initialisation.
  """
  router: Router
  hidden_size: int
  group_size: Optional[int] = None
  capacity_factor: float = 1.0
  capacity_multiple: int = 1
  dispatcher: str = "indices"
  batch_priority: bool = False
  dropout_rate: float = 0.0
  expert_init: str = "independent"
  dtype: Any = jnp.float32

  def __post_init__(self):
    require(self.dispatcher in DISPATCHERS, "moe.dispatcher",
            f"unknown dispatcher {self.dispatcher!r}; expected one of "
            f"{DISPATCHERS}")
    require(self.capacity_factor is not None and self.capacity_factor > 0,
            "moe.capacity_factor", f"must be > 0, got {self.capacity_factor}")
    require(self.group_size is None or self.group_size > 0, "moe.group_size",
            f"must be positive or None, got {self.group_size}")
    super().__post_init__()

  @property
  def num_experts(self) -> int:
    return self.router.num_experts

  @nn.compact
  def __call__(self, x: Array, ctx: RoutingContext, *,
               deterministic: bool = True) -> tuple[Array, Metrics, Any]:
    """Applies the layer.

    Args:
      x: `[B, T, D]` tokens (already layer-normalised by the block).
      ctx: the routing context of this block.
      deterministic: no router noise, no dropout.

    Returns:
      y: `[B, T, D]` the MoE output (0 for fully dropped tokens).
      metrics: router metrics plus `drop_rate`, `expert_load` `[E]` (share of
        the selections each expert received, before capacity) and
        `expert_usage` `[E]` (fraction of each expert's slots filled).
      routing: the router's output, for the next layers' context.
    """
    b, t, d = x.shape
    e = self.num_experts
    if self.router.needs_image_groups:
      require(self.group_size in (None, t), "moe.group_size",
              f"router {type(self.router).__name__} mixes the tokens of a "
              f"group, so a group must be one image (S = T = {t}); got "
              f"{self.group_size}")
    xg = group_tokens(x, self.group_size)
    num_groups, s, _ = xg.shape
    capacity = compute_capacity(s, self.router.slots_per_token,
                                self.capacity_factor, e,
                                self.capacity_multiple)
    routing, metrics = self.router(xg, ctx, capacity=capacity,
                                   deterministic=deterministic)
    plan = make_dispatch_plan(routing, num_experts=e, group_size=s,
                              capacity=capacity, kind=self.dispatcher,
                              batch_priority=self.batch_priority)
    expert_inputs = plan.dispatcher.dispatch(xg.astype(self.dtype))
    expert_outputs = MlpExperts(
        num_experts=e, hidden_size=self.hidden_size,
        dropout_rate=self.dropout_rate, init_mode=self.expert_init,
        dtype=self.dtype, name="experts")(expert_inputs,
                                          deterministic=deterministic)
    y = plan.dispatcher.combine(expert_outputs).reshape(b, t, d)

    if isinstance(routing, ExpertChoiceRouting):
      mask = routing.expert_mask(e, s)
    else:
      mask = routing.expert_mask(e)
    mask_f = mask.astype(jnp.float32)
    metrics = dict(metrics)
    metrics["drop_rate"] = plan.drop_rate
    metrics["expert_load"] = (jnp.sum(mask_f, axis=(0, 1))
                              / jnp.maximum(jnp.sum(mask_f), 1.0))
    metrics["expert_usage"] = plan.expert_usage
    self.sow("intermediates", "expert_mask", mask.reshape(b, t, e))
    if isinstance(routing, TokenChoiceRouting):
      selected = jnp.where(routing.valid, routing.expert_indices, -1)
      self.sow("intermediates", "selected_experts",
               selected.reshape(b, t, -1))
    return y.astype(x.dtype), metrics, routing
