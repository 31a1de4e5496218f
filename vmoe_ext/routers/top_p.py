"""Top-p dynamic routing (Guo et al. 2024; ACMoE appendix C.10; docs/routers.md,
"`top_p` — dynamic routing").

Each token goes to every expert whose gate `g = softmax(l + noise)` exceeds a
threshold `p` (fixed, or the learnable parameter "threshold" initialised at
0.05), at most `num_selected` of them (a static cap, so shapes stay static;
the largest gates first) and always at least its top-1 (so no token is left
without an expert when `p >= 1/E`). Choices below `p` are invalid: they take
no capacity and contribute nothing.

A learnable `p` gets its gradient through a straight-through estimator as in
DynMoE's top-any gating: the selection mask is `1[g > p]` in the forward pass
and has derivative -1 with respect to `p` in the backward pass, so
`dL/dp = -sum over selected e of g_e dL/dw_e` (w the combine weights).

Auxiliary losses: the importance loss (of the clean softmax, or of the noisy
gates with `importance_gates="noisy"`), and optionally GShard
and z-loss, as the top-k router. The noisy-top-k load loss is defined through
the K-th largest logit and has no top-p counterpart: its weight must be 0.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from vmoe_ext.errors import require
from vmoe_ext.moe.select import partitionable_top_k
from vmoe_ext.moe import losses
from vmoe_ext.moe.contract import Metrics, at_least_float32
from vmoe_ext.moe.routing import TokenChoiceRouting
from vmoe_ext.routers.noisy_top_k import NoisyTopKRouter

Array = jax.Array


def top_p(logits: Array, noise: Optional[Array], threshold: Array | float, *,
          max_experts: int, renormalize_gates: bool = False,
          importance_gates: str = "clean",
          importance_loss_weight: float = 0.005,
          gshard_loss_weight: float = 0.0,
          z_loss_weight: float = 0.0) -> tuple[TokenChoiceRouting, Metrics]:
  """Threshold routing from router logits.

  Args:
    logits: `[G, S, E]` clean logits.
    noise: `[G, S, E]` noise (or None).
    threshold: p, a float or a scalar array (learnable: gradient by the
      straight-through estimator of the module doc).
    max_experts: the static cap K on experts per token.
    renormalize_gates: combine with the selected gates divided by their sum.
    importance_gates: the importance loss of `softmax(l)` ("clean") or of
      the noisy gates ("noisy"), as `noisy_top_k`.
    *_loss_weight: weights of the auxiliary losses.

  Returns:
    routing: `[G, S, K]` choices, best first; `valid` marks those above p
      (choice 0 always valid).
    metrics: `auxiliary_loss`, the unweighted losses, `experts_per_token`
      (mean number of valid choices) and `threshold`.
  """
  noisy_logits = logits if noise is None else logits + noise
  gates = jax.nn.softmax(noisy_logits, axis=-1)
  top_gates, top_idx = partitionable_top_k(gates, max_experts)
  p = jnp.asarray(threshold, jnp.float32)
  valid = top_gates > jax.lax.stop_gradient(p)
  valid = valid.at[..., 0].set(True)
  # Forward: the 0/1 mask; backward: d mask / d p = -1 (straight-through).
  mask = valid.astype(top_gates.dtype) - (p - jax.lax.stop_gradient(p))
  weights = top_gates * mask
  if renormalize_gates:
    total = jnp.sum(jnp.where(valid, weights, 0), axis=-1, keepdims=True)
    weights = weights / total
  weights = jnp.where(valid, weights, 0)

  importance = losses.importance_loss(
      gates if importance_gates == "noisy" else jax.nn.softmax(logits))
  gshard = losses.gshard_loss(gates, top_idx[..., 0])
  z = losses.z_loss(logits)
  metrics = {
      "importance_loss": importance,
      "load_loss": jnp.zeros((), jnp.float32),
      "gshard_loss": gshard,
      "z_loss": z,
      "auxiliary_loss": (importance_loss_weight * importance
                         + gshard_loss_weight * gshard + z_loss_weight * z),
      "experts_per_token": jnp.mean(jnp.sum(valid, axis=-1,
                                            dtype=jnp.float32)),
      "threshold": jax.lax.stop_gradient(p),
  }
  return TokenChoiceRouting.create(top_idx, weights, valid), metrics


class TopPRouter(NoisyTopKRouter):
  """Top-p router on linear logits `x W` (with V-MoE's training noise).

  Attributes (besides `NoisyTopKRouter`'s):
    num_selected: the static cap on experts per token (<= E).
    threshold: p in (0, 1) (the initial value when learnable).
    learnable_threshold: p is the parameter "threshold".
    load_loss_weight: must be 0 (no load loss for threshold routing).
  """
  num_selected: int = 4
  threshold: float = 0.05
  learnable_threshold: bool = False
  load_loss_weight: float = 0.0

  fixed_top_k = False

  def __post_init__(self):
    require(isinstance(self.threshold, (int, float))
            and not isinstance(self.threshold, bool)
            and 0.0 < self.threshold < 1.0, "router.threshold",
            f"p must be in (0, 1), got {self.threshold!r}")
    require(isinstance(self.num_experts, int) and isinstance(
        self.num_selected, int) and self.num_selected <= self.num_experts,
            "router.num_selected", f"the top-p cap ({self.num_selected}) "
            f"must be <= num_experts E={self.num_experts}")
    require(self.load_loss_weight == 0, "router.load_loss_weight",
            "the noisy-top-k load loss is not defined for top-p routing; "
            f"set it to 0 (got {self.load_loss_weight})")
    super().__post_init__()

  def select(self, logits: Array, noise: Optional[Array], noise_std: float
             ) -> tuple[TokenChoiceRouting, Metrics]:
    del noise_std
    p: Array | float = float(self.threshold)
    if self.learnable_threshold:
      p = at_least_float32(self.param(  # Whatever `model.param_dtype`.
          "threshold", lambda *_: jnp.float32(self.threshold)))
    return top_p(logits, noise, p, max_experts=self.num_selected,
                 renormalize_gates=self.renormalize_gates,
                 importance_gates=self.importance_gates,
                 importance_loss_weight=self.importance_loss_weight,
                 gshard_loss_weight=self.gshard_loss_weight,
                 z_loss_weight=self.z_loss_weight)
