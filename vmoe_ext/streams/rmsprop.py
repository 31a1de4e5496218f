"""rms-SMoE (appendix E.4): an RMSprop step in the first MoE block.

    v = mu v + (1 - mu) g*g;   x_{t+1} = x_t - gamma g / sqrt(v + eps)

with `g` the layout's gradient (`-u` paper, `+u` vmoe_reference) and
`v_0 = 0`; like AdamSMoE it runs in the first MoE layer only and the later
MoE blocks take heavy-ball steps (`momentum_mu` 0.7, `momentum_gamma`
defaulting to gamma). rms-SMoE keeps no first moment, so the heavy-ball
vector starts at 0 in the second MoE block (the paper's `p_0 = 0`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from vmoe_ext.streams.first_layer import FirstLayerThenHeavyBall
from vmoe_ext.streams.momentum_base import check_decay, check_positive

Array = jax.Array


class RmsPropSMoE(FirstLayerThenHeavyBall):
  """rms-SMoE (registered as "rmsprop").

  Attributes:
    mu: moving-average decay of the squared gradient in [0, 1).
    gamma: step size > 0.
    eps: > 0, added under the root.
  """
  mu: float = 0.9
  gamma: float = 1.0
  eps: float = 1e-8

  def __post_init__(self):
    check_decay(self.mu, "mu")
    check_positive(self.gamma, "gamma")
    check_positive(self.eps, "eps")
    super().__post_init__()

  @property
  def heavy_ball_defaults(self) -> tuple[float, float]:
    return 0.7, self.gamma

  def init_state(self, x: Array) -> Any:
    zeros = jnp.zeros_like(x)
    return {"v": zeros, "hb": zeros}

  def first_step(self, x: Array, g: Array, state: Any
                 ) -> tuple[Array, Any]:
    v = self.mu * state["v"] + (1 - self.mu) * g * g
    return x - self.gamma * g / jnp.sqrt(v + self.eps), dict(state, v=v)
