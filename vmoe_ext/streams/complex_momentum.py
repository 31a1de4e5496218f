"""Complex-MomentumSMoE (appendix E.4, Eq. 21; Lorraine et al.).

    p_t = -f(x_t) + mu p_{t-1},  mu = |mu| e^{i theta};
    x_{t+1} = x_t + gamma Re(p_t)

with `-f = -g` the layout's negated gradient (see momentum_base). The complex
buffer is kept as two real arrays (`p_re`, `p_im`), so state, checkpoints
and shardings stay real. theta = 0 is heavy-ball; theta = pi is negative
momentum.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from vmoe_ext.errors import require
from vmoe_ext.moe.contract import RoutingContext
from vmoe_ext.streams.base import Ffn
from vmoe_ext.streams.momentum_base import MomentumStream, check_positive

Array = jax.Array


class ComplexMomentum(MomentumStream):
  """Complex momentum (registered as "complex_momentum").

  Attributes:
    mu_abs: |mu| in [0, 1).
    mu_angle: arg(mu) in radians (default pi/8).
    gamma: step size > 0.
  """
  mu_abs: float = 0.7
  mu_angle: float = math.pi / 8
  gamma: float = 1.0

  def __post_init__(self):
    require(isinstance(self.mu_abs, (int, float)) and 0 <= self.mu_abs < 1,
            "stream.mu_abs", f"must be in [0, 1), got {self.mu_abs!r}")
    require(isinstance(self.mu_angle, (int, float))
            and math.isfinite(self.mu_angle), "stream.mu_angle",
            f"must be a finite angle in radians, got {self.mu_angle!r}")
    check_positive(self.gamma, "gamma")
    super().__post_init__()

  def init_state(self, x: Array) -> Any:
    zeros = jnp.zeros_like(x)
    return {"p_re": zeros, "p_im": zeros}

  def moe_step(self, x: Array, ffn: Ffn, state: Any,
               ctx: RoutingContext) -> tuple[Array, Any]:
    del ctx
    mr = self.mu_abs * math.cos(self.mu_angle)
    mi = self.mu_abs * math.sin(self.mu_angle)
    g = self.evaluate(ffn, x, None)
    re, im = state["p_re"], state["p_im"]
    re, im = -g + mr * re - mi * im, mr * im + mi * re
    return x + self.gamma * re, {"p_re": re, "p_im": im}
