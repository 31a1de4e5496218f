"""Expert-choice routing (Zhou et al. 2022): every expert picks its top-C tokens.

Gates `g = softmax(x W)` over experts; expert e takes the C tokens of the group
with the largest `g[:, e]`, combined with those gate values. `C = ceil(S*cf/E)`
is computed by the MoE layer (cf = average experts per token). Balanced by
construction, so there is no balancing loss; a token may be picked by several
experts or by none (reported as the layer's drop rate). vmoe's expert-choice
router adds training noise `N(0, (noise_std/E)^2)` to the logits before the
softmax; ours adds none by default (`noise_std=0`), set `noise_std=1.0` to
match vmoe.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from vmoe_ext.errors import require
from vmoe_ext.moe.select import partitionable_top_k
from vmoe_ext.moe import losses
from vmoe_ext.moe.routing import ExpertChoiceRouting
from vmoe_ext.moe.contract import (EXPERT_CHOICE, LinearLogits, Metrics,
                                   Router, RouterOutput, RoutingContext)

Array = jax.Array


def expert_choice(logits: Array, capacity: int, *,
                  z_loss_weight: float = 0.0) -> tuple[ExpertChoiceRouting,
                                                       Metrics]:
  """Routing from logits `[G, S, E]`: each expert's top-`capacity` tokens."""
  group_size = logits.shape[1]
  require(capacity <= group_size, "capacity_factor",
          f"expert-choice capacity C={capacity} exceeds the group size "
          f"S={group_size}; lower capacity_factor or enlarge groups")
  gates = jax.nn.softmax(logits, axis=-1)
  weights, token_indices = partitionable_top_k(gates.transpose(0, 2, 1),
                                               capacity)
  z = losses.z_loss(logits)
  metrics = {"z_loss": z, "auxiliary_loss": z_loss_weight * z}
  return ExpertChoiceRouting(token_indices.astype(jnp.int32), weights,
                             group_size), metrics


class ExpertChoiceRouter(Router):
  """Expert-choice router.

  Attributes:
    z_loss_weight: weight of the router z-loss (default 0: no auxiliary loss).
    noise_std: training noise on the logits, std `noise_std / E` drawn from
      the "gating" rng stream (vmoe: 1.0; default 0: none).
    dtype: dtype of the router computation.
  """
  z_loss_weight: float = 0.0
  noise_std: float = 0.0
  dtype: Any = jnp.float32

  kind = EXPERT_CHOICE

  @property
  def assignment_width(self) -> int:
    return self.num_experts  # Up to E experts pick a token.

  def __post_init__(self):
    require(self.z_loss_weight >= 0, "router.z_loss_weight",
            f"must be >= 0, got {self.z_loss_weight}")
    require(self.noise_std >= 0, "router.noise_std",
            f"must be >= 0, got {self.noise_std}")
    super().__post_init__()

  @nn.compact
  def __call__(self, x: Array, ctx: RoutingContext, *, capacity: int,
               deterministic: bool, update_state: bool = False
               ) -> RouterOutput:
    del ctx, update_state
    logits = LinearLogits(self.num_experts, dtype=self.dtype,
                          name="logits")(x).astype(jnp.float32)
    std = self.noise_std / self.num_experts
    if not deterministic and std > 0:
      logits = logits + std * jax.random.normal(self.make_rng("gating"),
                                                logits.shape, logits.dtype)
    return RouterOutput(*expert_choice(logits, capacity,
                                       z_loss_weight=self.z_loss_weight))
