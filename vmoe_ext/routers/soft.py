"""SoftMoE routing (Puigcerver et al. 2023; DESIGN §4.2).

Tokens `x[G, S, D]` and slot parameters `mu[D, E, P]` are L2-normalised over D;
a learnable scalar `scale` (init 1) multiplies the normalised tokens.
`logits[g, s, e, p] = <scale * x_s, mu_{e,p}>`. Dispatch weights are a softmax
over the tokens s (each slot is a convex combination of the group's tokens);
combine weights a softmax over all `E*P` slots (each token's output is a convex
combination of slot outputs). A group is one image; no auxiliary loss.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from vmoe_ext.errors import require
from vmoe_ext.moe.routing import SoftRouting
from vmoe_ext.moe.contract import SOFT, Router, RouterOutput, RoutingContext

Array = jax.Array


def l2_normalize(x: Array, axis: int, eps: float = 1e-6) -> Array:
  return x * jax.lax.rsqrt(jnp.sum(jnp.square(x), axis=axis, keepdims=True)
                           + eps)


def soft_routing(x: Array, mu: Array, scale: Array,
                 normalize: bool = True,
                 assigned_slots: int = 8) -> SoftRouting:
  """Soft dispatch/combine weights; x `[G, S, D]`, mu `[D, E, P]`."""
  if normalize:
    x = l2_normalize(x, axis=-1)
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
  """
  num_slots: int = 1
  normalize: bool = True
  assigned_slots: int = 8

  kind = SOFT
  needs_image_groups = True

  def __post_init__(self):
    require(isinstance(self.num_slots, int) and self.num_slots > 0,
            "router.num_slots", f"must be a positive integer, got "
            f"{self.num_slots}")
    require(isinstance(self.assigned_slots, int) and self.assigned_slots > 0,
            "router.assigned_slots", f"must be a positive integer, got "
            f"{self.assigned_slots}")
    super().__post_init__()

  @nn.compact
  def __call__(self, x: Array, ctx: RoutingContext, *, capacity: int,
               deterministic: bool, update_state: bool = False
               ) -> RouterOutput:
    del ctx, capacity, deterministic, update_state
    d = x.shape[-1]
    mu = self.param("mu", nn.initializers.normal(stddev=d**-0.5),
                    (d, self.num_experts, self.num_slots))
    scale = self.param("scale", nn.initializers.ones, ())
    routing = soft_routing(x.astype(jnp.float32), mu, scale, self.normalize,
                           self.assigned_slots)
    return RouterOutput(routing,
                        {"auxiliary_loss": jnp.zeros((), jnp.float32)})
