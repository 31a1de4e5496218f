"""SAM-SMoE (appendix E.4): a sharpness-aware step per MoE block.

    eps_t = rho g(x_t) / ||g(x_t)||_2;   p_t = g(x_t + eps_t);
    x_{t+1} = x_t - gamma p_t

with `g` the layout's gradient (`-u` paper, `+u` vmoe_reference; see
momentum_base), the norm taken per token over D (each token is its own
iterate; a zero gradient gives no perturbation). The MoE runs twice: at x_t
(`primary=False`: no sows, no state updates, no loss) and at the perturbed
point, whose call is the block's primary one. Stateless; gradients
flow through both calls (no stop-gradient on eps_t). `rho = 0, gamma = 1` in
the paper layout is the plain residual.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from vmoe_ext.errors import require
from vmoe_ext.moe.contract import RoutingContext
from vmoe_ext.streams.base import Ffn
from vmoe_ext.streams.momentum_base import MomentumStream, check_positive

Array = jax.Array


class SharpnessAwareSMoE(MomentumStream):
  """SAM-SMoE (registered as "sam").

  Attributes:
    rho: neighbourhood radius >= 0.
    gamma: step size > 0.
  """
  rho: float = 0.05
  gamma: float = 1.0

  def __post_init__(self):
    require(isinstance(self.rho, (int, float)) and self.rho >= 0, "stream.rho",
            f"must be >= 0, got {self.rho!r}")
    check_positive(self.gamma, "gamma")
    super().__post_init__()

  def init_state(self, x: Array) -> Any:
    del x
    return ()

  def moe_step(self, x: Array, ffn: Ffn, state: Any,
               ctx: RoutingContext) -> tuple[Array, Any]:
    del ctx
    g = self.evaluate(ffn, x, None, primary=False)
    norm = jnp.sqrt(jnp.sum(g * g, axis=-1, keepdims=True))
    eps = self.rho * g / jnp.where(norm > 0, norm, 1.0)
    return x - self.gamma * self.evaluate(ffn, x, eps), state
