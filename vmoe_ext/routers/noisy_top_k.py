"""V-MoE noisy top-k token-choice router (Riquelme et al. 2021;
docs/routers.md, "`noisy_topk` — V-MoE noisy top-k").

The routing math is the pure function `noisy_top_k`; `NoisyTopKRouter` is the
thin linen wrapper that owns `W` and draws the noise. Routers that only change
how logits are computed (XMoE cosine, `vmoe_ext.routers.cosine`) subclass it
and override `compute_logits`; routers that change the selection rule (top-p,
`vmoe_ext.routers.top_p`) override `select`.
"""

from __future__ import annotations

from typing import Any, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from vmoe_ext.errors import require
from vmoe_ext.moe.select import partitionable_top_k
from vmoe_ext.moe import losses
from vmoe_ext.moe.routing import TokenChoiceRouting
from vmoe_ext.moe.contract import (LinearLogits, Metrics, Router, RouterOutput,
                                   RoutingContext)

Array = jax.Array
IMPORTANCE_GATES = ("clean", "noisy")


def noisy_top_k(logits: Array,
                noise: Optional[Array],
                *,
                num_selected: int,
                noise_std: float,
                renormalize_gates: bool = False,
                importance_gates: str = "clean",
                importance_loss_weight: float = 0.005,
                load_loss_weight: float = 0.005,
                gshard_loss_weight: float = 0.0,
                z_loss_weight: float = 0.0,
                balance_loss_weight: float = 0.0,
                balance_temperature: float = 1.0
                ) -> tuple[TokenChoiceRouting, Metrics]:
  """Top-k routing of V-MoE from router logits.

  Args:
    logits: `[G, S, E]` clean router logits `x W`.
    noise: `[G, S, E]` noise already scaled to std `noise_std`, or None for no
      noise (deterministic evaluation).
    num_selected: K.
    noise_std: the effective noise std (vmoe's `noise_std / E`); used by the
      load loss, which is only defined with noise (0 is reported without).
    renormalize_gates: combine with `softmax(topk(logits))` (the K selected
      gates renormalised to sum to 1) instead of V-MoE's raw softmax values.
    importance_gates: "clean" (`softmax(l)`, the default, as google's vmoe
      code: its `NoisyTopExpertsPerItemRouter` takes the importance loss of
      the softmax computed before the noise is added) or "noisy"
      (`softmax(l + eps)`, the V-MoE paper's appendix Eq. 11, "in practice
      noisy") for the importance loss.
    *_loss_weight: weights of the auxiliary losses in `auxiliary_loss`.
    balance_temperature: the MoE language-model gates' balance loss
      (`losses.fastmoe_balance_loss`, weight `balance_loss_weight`) scores
      `softmax(logits / balance_temperature)` (their SMoE gate: 1, their
      XMoE gates: 0.3); computed only when its weight is not 0.

  Returns:
    routing: `TokenChoiceRouting` with `[G, S, K]` indices and gates.
    metrics: `auxiliary_loss` (weighted sum) and each unweighted loss.
  """
  noisy_logits = logits if noise is None else logits + noise
  gates = jax.nn.softmax(noisy_logits, axis=-1)
  top_gates, top_idx = partitionable_top_k(gates, num_selected)
  if renormalize_gates:
    top_gates = top_gates / jnp.sum(top_gates, axis=-1, keepdims=True)

  imp_gates = gates if importance_gates == "noisy" else jax.nn.softmax(logits)
  importance = losses.importance_loss(imp_gates)
  if noise is None or noise_std <= 0:
    load = jnp.zeros((), logits.dtype)
  else:
    load = losses.load_loss(logits, noisy_logits, noise_std, num_selected)
  gshard = losses.gshard_loss(gates, top_idx[..., 0])
  z = losses.z_loss(logits)
  metrics = {
      "importance_loss": importance,
      "load_loss": load,
      "gshard_loss": gshard,
      "z_loss": z,
      "auxiliary_loss": (importance_loss_weight * importance
                         + load_loss_weight * load
                         + gshard_loss_weight * gshard + z_loss_weight * z),
  }
  if balance_loss_weight:
    balance = losses.fastmoe_balance_loss(
        jax.nn.softmax(logits / balance_temperature), top_idx)
    metrics["balance_loss"] = balance
    metrics["auxiliary_loss"] += balance_loss_weight * balance
  return TokenChoiceRouting.create(top_idx, top_gates), metrics


class NoisyTopKRouter(Router):
  """V-MoE router: `top_k(softmax(x W + eps))`, `eps ~ N(0, (noise_std/E)^2)`.

  Attributes:
    num_selected: K, experts per token.
    noise_std: vmoe's convention; the actual std is `noise_std / E`. Noise is
      drawn from the "gating" rng stream in training only.
    renormalize_gates, importance_gates, *_loss_weight,
      balance_temperature: see `noisy_top_k`.
    logits_bias: add a learned bias `[E]` (starting at 0) to the linear
      logits, `x W + b`: the gate of ACMoE's language-model code
      (`--smoe-base`, a torch `Linear` with its bias). Off by default (V-MoE's
      router has none).
    dtype: dtype of the router computation (float32 by default).
  """
  num_selected: int = 1
  noise_std: float = 1.0
  renormalize_gates: bool = False
  importance_gates: str = "clean"
  importance_loss_weight: float = 0.005
  load_loss_weight: float = 0.005
  gshard_loss_weight: float = 0.0
  z_loss_weight: float = 0.0
  balance_loss_weight: float = 0.0
  balance_temperature: float = 1.0
  logits_bias: bool = False
  dtype: Any = jnp.float32

  def __post_init__(self):
    require(isinstance(self.num_experts, int) and self.num_experts > 0,
            "num_experts", f"must be a positive integer, got {self.num_experts}")
    require(isinstance(self.num_selected, int) and self.num_selected > 0,
            "router.num_selected",
            f"must be a positive integer, got {self.num_selected}")
    require(self.num_selected <= self.num_experts, "router.num_selected",
            f"K={self.num_selected} must be <= num_experts E="
            f"{self.num_experts}")
    require(isinstance(self.logits_bias, bool), "router.logits_bias",
            f"must be True or False, got {self.logits_bias!r}")
    require(self.noise_std >= 0, "router.noise_std",
            f"must be >= 0, got {self.noise_std}")
    require(self.importance_gates in IMPORTANCE_GATES,
            "router.importance_gates",
            f"must be one of {IMPORTANCE_GATES}, got {self.importance_gates!r}")
    for field in ("importance_loss_weight", "load_loss_weight",
                  "gshard_loss_weight", "z_loss_weight",
                  "balance_loss_weight"):
      value = getattr(self, field)
      require(value >= 0, f"router.{field}", f"must be >= 0, got {value}")
    require(self.balance_temperature > 0, "router.balance_temperature",
            f"must be > 0, got {self.balance_temperature}")
    super().__post_init__()

  @property
  def slots_per_token(self) -> int:
    return self.num_selected

  def compute_logits(self, x: Array, ctx: RoutingContext) -> Array:
    """`[G, S, D] -> [G, S, E]`; override to change the score function."""
    del ctx
    return LinearLogits(self.num_experts, dtype=self.dtype,
                        use_bias=self.logits_bias, name="logits")(x)

  @nn.compact
  def __call__(self, x: Array, ctx: RoutingContext, *, capacity: int,
               deterministic: bool, update_state: bool = False
               ) -> RouterOutput:
    del capacity, update_state  # Capacity is the dispatcher's; no state.
    logits = self.compute_logits(x, ctx).astype(jnp.float32)
    std = self.noise_std / self.num_experts
    noise = None
    if not deterministic and std > 0:
      noise = std * jax.random.normal(self.make_rng("gating"), logits.shape,
                                      logits.dtype)
    routing, metrics = self.select(logits, noise, std)
    gates = jax.nn.softmax(logits if noise is None else logits + noise)
    return RouterOutput(routing, metrics, gates=gates)

  def select(self, logits: Array, noise: Optional[Array], noise_std: float
             ) -> tuple[TokenChoiceRouting, Metrics]:
    """Routing and metrics from clean logits `[G, S, E]` and the noise.

    Override to change the selection rule (e.g. top-p) while keeping the
    score function (`compute_logits`) and the noise.
    """
    return noisy_top_k(
        logits, noise, num_selected=self.num_selected, noise_std=noise_std,
        renormalize_gates=self.renormalize_gates,
        importance_gates=self.importance_gates,
        importance_loss_weight=self.importance_loss_weight,
        load_loss_weight=self.load_loss_weight,
        gshard_loss_weight=self.gshard_loss_weight,
        z_loss_weight=self.z_loss_weight,
        balance_loss_weight=self.balance_loss_weight,
        balance_temperature=self.balance_temperature)
