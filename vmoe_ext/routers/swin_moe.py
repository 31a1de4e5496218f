"""The Swin-MoE router: microsoft/tutel's "top" gate as Swin-MoE runs it
(docs/routers.md, "`swin_moe` — the Swin-MoE (tutel) router").

tutel's `LinearTopKGate` with `fp32_gate=True` and the routing of its
`moe_layer`, per routing group `x [G, S, D]`:

    l       = x W                        float32, no bias ("router/logits")
    l_noisy = l + gate_noise * n / E,    n ~ N(0, 1), training only
    scores  = softmax(l_noisy)           [G, S, E]
    experts = top_K(scores),  combine weights = the K selected scores
              (divided by their sum, clamped at float32 eps, with
              `normalize_gate` and K > 1)

and the balancing loss of Swin-MoE's configs, tutel's
`load_importance_loss(softmax(l), l_noisy[top-K], E, gate_noise)`
(`losses.tutel_importance_loss`, `losses.tutel_load_loss`: unbiased
variance over the experts, `+ 1e-10` in the denominator, the load loss's
probability-minus-logit threshold), or with `balance_loss="gshard"` tutel's
`gshard_loss` of the noisy scores. The pure function `tutel_top_k` is the
math; `SwinMoeRouter` owns `W` and draws the noise. Capacity and dispatch
order are the MoE layer's: tutel's are `moe.capacity_rounding="tutel"` and
`moe.batch_priority=True` (Swin-MoE's `USE_BPR`), which orders the tokens by
`max_e scores` (the routing's `priority`) as tutel's
`compute_sorted_location`.
"""

from __future__ import annotations

from typing import Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from vmoe_ext.errors import require
from vmoe_ext.moe import losses
from vmoe_ext.moe.contract import (LinearLogits, Metrics, Router, RouterOutput,
                                   RoutingContext)
from vmoe_ext.moe.routing import TokenChoiceRouting
from vmoe_ext.moe.select import partitionable_top_k

Array = jax.Array
BALANCE_LOSSES = ("importance_load", "gshard")


def tutel_top_k(logits: Array,
                noise: Optional[Array],
                *,
                num_selected: int,
                gate_noise: float,
                normalize_gate: bool = False,
                balance_loss: str = "importance_load",
                aux_loss_weight: float = 0.01
                ) -> tuple[TokenChoiceRouting, Metrics]:
  """tutel's top-K routing from router logits.

  Args:
    logits: `[G, S, E]` clean float32 router logits `x W`.
    noise: `[G, S, E]` noise already scaled to std `gate_noise / E`, or None
      (deterministic calls: no noise, as tutel outside training).
    num_selected: K.
    gate_noise: tutel's `gate_noise` (the std of the noise is
      `gate_noise / E`); the load loss's normal CDF uses that std.
    normalize_gate: with K > 1, divide the K combine weights by their sum
      (clamped at float32 eps); K = 1 is never normalised (as tutel).
    balance_loss: "importance_load" (`(l_imp + l_load) / 2`, Swin-MoE's
      `IS_GSHARD_LOSS: False`) or "gshard" (`E sum_e mean_s(scores)[e]
      frac_top1[e]`).
    aux_loss_weight: the model's weight of the balancing loss (Swin-MoE's
      `AUX_LOSS_WEIGHT`, 0.01).

  Returns:
    routing: `TokenChoiceRouting` with `[G, S, K]` indices and combine
      weights, and `priority` `[G, S]` = `max_e scores` (tutel's
      batch-prioritized routing order).
    metrics: `auxiliary_loss` (`aux_loss_weight` times the chosen balancing
      loss), `balance_loss` (that loss unweighted), and `importance_loss`,
      `load_loss`, `gshard_loss` (each unweighted). The load loss needs the
      noise: it is 0 when `noise` is None or `gate_noise` is 0, so at
      evaluation `(l_imp + l_load) / 2` is `l_imp / 2` (tutel would take
      the clean logits as the noisy ones there; nothing trains on it).
  """
  num_experts = logits.shape[-1]
  noisy_logits = logits if noise is None else logits + noise
  scores = jax.nn.softmax(noisy_logits, axis=-1)
  top_scores, top_idx = partitionable_top_k(scores, num_selected)
  gates = top_scores
  if normalize_gate and num_selected > 1:
    eps = jnp.finfo(gates.dtype).eps
    gates = gates / jnp.maximum(jnp.sum(gates, axis=-1, keepdims=True), eps)

  probs = jax.nn.softmax(logits, axis=-1)
  importance = losses.tutel_importance_loss(probs)
  std = gate_noise / num_experts
  if noise is None or std <= 0:
    load = jnp.zeros((), logits.dtype)
  else:
    load = losses.tutel_load_loss(probs, noisy_logits, std, num_selected)
  gshard = losses.gshard_loss(scores, top_idx[..., 0])
  balance = gshard if balance_loss == "gshard" else (importance + load) / 2
  metrics = {
      "importance_loss": importance,
      "load_loss": load,
      "gshard_loss": gshard,
      "balance_loss": balance,
      "auxiliary_loss": aux_loss_weight * balance,
  }
  routing = TokenChoiceRouting.create(top_idx, gates,
                                      priority=top_scores[..., 0])
  return routing, metrics


class SwinMoeRouter(Router):
  """Swin-MoE's router: tutel's top-K gate (module doc).

  Attributes:
    num_selected: K, experts per token (Swin-MoE's `TOP_VALUE`).
    gate_noise: the noise std is `gate_noise / E` (tutel's convention, as
      `noisy_topk`'s `noise_std`); drawn from the "gating" rng stream in
      training only. Must be > 0 with the "importance_load" loss, whose
      load part divides by it (tutel asserts the same).
    normalize_gate: combine with the K scores divided by their sum (K > 1).
    balance_loss: "importance_load" (default; Swin-MoE's configs) or
      "gshard".
    aux_loss_weight: weight of the balancing loss in `auxiliary_loss`.
  """
  num_selected: int = 1
  gate_noise: float = 1.0
  normalize_gate: bool = False
  balance_loss: str = "importance_load"
  aux_loss_weight: float = 0.01

  def __post_init__(self):
    require(isinstance(self.num_experts, int) and self.num_experts > 0,
            "num_experts",
            f"must be a positive integer, got {self.num_experts}")
    require(isinstance(self.num_selected, int)
            and not isinstance(self.num_selected, bool)
            and 0 < self.num_selected <= self.num_experts,
            "router.num_selected", f"must be an integer in [1, E="
            f"{self.num_experts}], got {self.num_selected!r}")
    require(isinstance(self.normalize_gate, bool), "router.normalize_gate",
            f"must be True or False, got {self.normalize_gate!r}")
    require(self.balance_loss in BALANCE_LOSSES, "router.balance_loss",
            f"must be one of {BALANCE_LOSSES}, got {self.balance_loss!r}")
    require(isinstance(self.gate_noise, (int, float))
            and not isinstance(self.gate_noise, bool)
            and self.gate_noise >= 0, "router.gate_noise",
            f"must be a number >= 0, got {self.gate_noise!r}")
    require(self.balance_loss != "importance_load" or self.gate_noise > 0,
            "router.gate_noise", "the 'importance_load' balance loss divides "
            "by the noise std gate_noise / E, so gate_noise must be > 0 "
            "(or use balance_loss='gshard')")
    require(isinstance(self.aux_loss_weight, (int, float))
            and not isinstance(self.aux_loss_weight, bool)
            and self.aux_loss_weight >= 0, "router.aux_loss_weight",
            f"must be a number >= 0, got {self.aux_loss_weight!r}")
    super().__post_init__()

  @property
  def slots_per_token(self) -> int:
    return self.num_selected

  @property
  def renormalize_gates(self) -> bool:
    """Whether the combine weights are renormalised gates (ACMoE's Mix-k
    `raw` weights need the raw softmax ones)."""
    return self.normalize_gate and self.num_selected > 1

  @nn.compact
  def __call__(self, x: Array, ctx: RoutingContext, *, capacity: int,
               deterministic: bool, update_state: bool = False
               ) -> RouterOutput:
    """x: `[G, S, D]` -> tutel's top-K routing (module doc)."""
    del ctx, capacity, update_state  # Capacity is the dispatcher's.
    logits = LinearLogits(self.num_experts, dtype=jnp.float32,
                          name="logits")(x).astype(jnp.float32)
    std = self.gate_noise / self.num_experts
    noise = None
    if not deterministic and std > 0:
      noise = std * jax.random.normal(self.make_rng("gating"), logits.shape,
                                      logits.dtype)
    routing, metrics = tutel_top_k(
        logits, noise, num_selected=self.num_selected,
        gate_noise=self.gate_noise, normalize_gate=self.normalize_gate,
        balance_loss=self.balance_loss, aux_loss_weight=self.aux_loss_weight)
    gates = jax.nn.softmax(logits if noise is None else logits + noise)
    return RouterOutput(routing, metrics, gates=gates)
