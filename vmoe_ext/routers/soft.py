"""SoftMoE routing (Puigcerver et al. 2023; docs/routers.md,
"`soft` — SoftMoE").

Tokens `x[G, S, D]` and slot parameters `mu[D, E, P]` are L2-normalised over D;
a learnable scalar `scale` (init 1) multiplies the normalised tokens.
`logits[g, s, e, p] = <scale * x_s, mu_{e,p}>`. Dispatch weights are a softmax
over the tokens s (each slot is a convex combination of the group's tokens);
combine weights a softmax over all `E*P` slots (each token's output is a convex
combination of slot outputs). A group is one image; no auxiliary loss.
"""

from __future__ import annotations

from typing import Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from vmoe_ext.errors import require
from vmoe_ext.moe.routing import SoftRouting
from vmoe_ext.moe.contract import (SOFT, Router, RouterOutput, RoutingContext,
                                   at_least_float32)

Array = jax.Array


def l2_normalize(x: Array, axis: int, eps: float = 1e-6) -> Array:
  return x * jax.lax.rsqrt(jnp.sum(jnp.square(x), axis=axis, keepdims=True)
                           + eps)


def soft_routing(x: Array, mu: Array, scale: Array,
                 normalize: bool = True,
                 assigned_slots: int = 8,
                 normalize_tokens: Optional[bool] = None) -> SoftRouting:
  """Soft dispatch/combine weights; x `[G, S, D]`, mu `[D, E, P]`.

  `normalize` L2-normalises the slot parameters and (unless
  `normalize_tokens` says otherwise) the tokens.
  """
  if normalize if normalize_tokens is None else normalize_tokens:
    x = l2_normalize(x, axis=-1)
  if normalize:
    mu = l2_normalize(mu, axis=0)
  logits = jnp.einsum("gsd,dep->gsep", scale * x, mu)
  g, s, e, p = logits.shape
  dispatch = jax.nn.softmax(logits, axis=1)
  combine = jax.nn.softmax(logits.reshape(g, s, e * p), axis=-1)
  return SoftRouting(dispatch, combine.reshape(g, s, e, p), assigned_slots)


class SoftRouter(Router):
  """SoftMoE router.

  Attributes:
    num_slots: P, slots per expert.
    normalize: L2-normalise tokens and slot parameters (the paper's default,
      needed for stability at scale); False gives plain dot products.
    assigned_slots: how many of a token's largest-combine-weight slots its
      `Assignment` lists for later layers (ACMoE's SoftMoE variant mixes over
      the top 8); capped at E*P.
    dispatch_normalized: the slots mix the L2-normalised tokens (the torch
      SoftMoE the ACMoE authors built on) instead of the raw tokens (vmoe:
      normalisation only inside the router); docs/routers.md, "`soft`".
    normalize_tokens: L2-normalise the tokens inside the router (None: as
      `normalize`). ACMoE's SoftMoE variant sets it False: it hands the
      router tokens it has already normalised and scaled.
  """
  num_slots: int = 1
  normalize: bool = True
  assigned_slots: int = 8
  dispatch_normalized: bool = False
  normalize_tokens: Optional[bool] = None

  kind = SOFT
  needs_image_groups = True

  def __post_init__(self):
    require(isinstance(self.num_slots, int) and self.num_slots > 0,
            "router.num_slots", f"must be a positive integer, got "
            f"{self.num_slots}")
    require(isinstance(self.assigned_slots, int) and self.assigned_slots > 0,
            "router.assigned_slots", f"must be a positive integer, got "
            f"{self.assigned_slots}")
    require(not (self.dispatch_normalized and self.normalize_tokens is False),
            "router.dispatch_normalized", "dispatching normalised tokens "
            "needs normalize_tokens (None or True)")
    super().__post_init__()

  @property
  def assignment_width(self) -> int:
    return self.assigned_slots  # Capped at E*P by `SoftRouting.assignment`.

  @nn.compact
  def __call__(self, x: Array, ctx: RoutingContext, *, capacity: int,
               deterministic: bool, update_state: bool = False
               ) -> RouterOutput:
    del ctx, capacity, deterministic, update_state
    d = x.shape[-1]
    # In float32 whatever the parameters' dtype (`model.param_dtype`).
    mu = at_least_float32(self.param(
        "mu", nn.initializers.normal(stddev=d**-0.5),
        (d, self.num_experts, self.num_slots)))
    scale = at_least_float32(self.param("scale", nn.initializers.ones, ()))
    x = x.astype(jnp.float32)
    routing = soft_routing(x, mu, scale, self.normalize, self.assigned_slots,
                           self.normalize_tokens)
    return RouterOutput(routing,
                        {"auxiliary_loss": jnp.zeros((), jnp.float32)},
                        expert_inputs=(l2_normalize(x, axis=-1)
                                       if self.dispatch_normalized else None))
