"""NAG-SMoE (appendix E.4): Nesterov's accelerated gradient across MoE blocks.

    p_t = mu p_{t-1} - gamma g(x_t + s mu p_{t-1});   x_{t+1} = x_t + p_t

with `g` the layout's gradient (`-u` paper, `+u` vmoe_reference; see
momentum_base) and `p_0 = 0`. The MoE is evaluated once per block, at the
look-ahead point, and that call is the block's primary one.
`lookahead="nesterov"` (s = +1, the default) looks where the momentum is
carrying the iterate, as Nesterov's method does; `lookahead="as_printed"`
(s = -1) evaluates at `x_t - mu p_{t-1}` exactly as appendix E.4 prints it.
"""

from __future__ import annotations

from typing import Any

import jax

from vmoe_ext.errors import require
from vmoe_ext.moe.contract import RoutingContext
from vmoe_ext.streams.base import Ffn
from vmoe_ext.streams.momentum_base import (MomentumStream, check_decay,
                                            check_positive)

Array = jax.Array
LOOKAHEADS = {"nesterov": 1.0, "as_printed": -1.0}


class NesterovSMoE(MomentumStream):
  """NAG-SMoE (registered as "nag").

  Attributes:
    mu: momentum coefficient in [0, 1) (the paper: (0, 1)).
    gamma: step size > 0.
    lookahead: "nesterov" or "as_printed" (module docstring).
  """
  mu: float = 0.7
  gamma: float = 1.0
  lookahead: str = "nesterov"

  def __post_init__(self):
    check_decay(self.mu, "mu")
    check_positive(self.gamma, "gamma")
    require(self.lookahead in LOOKAHEADS, "stream.lookahead",
            f"unknown {self.lookahead!r}; use one of {sorted(LOOKAHEADS)}")
    super().__post_init__()

  def moe_step(self, x: Array, ffn: Ffn, state: Any,
               ctx: RoutingContext) -> tuple[Array, Any]:
    del ctx
    p = state["p"]
    g = self.evaluate(ffn, x, LOOKAHEADS[self.lookahead] * self.mu * p)
    p = self.mu * p - self.gamma * g
    return x + p, {"p": p}
