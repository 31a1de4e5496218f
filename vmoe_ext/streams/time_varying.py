"""Time-varying heavy-ball momentum, with scheduled restart (appendix E.1, E.4).

Heavy-ball (Eq. 10, layout rules of momentum_base) whose coefficient at the
t-th MoE block (t = 1, 2, ...) is Nesterov's `mu_t = (t - 1) / (t + 2)`
(MomentumSMoE (TV)). With `restart_every = R` the schedule restarts every R
MoE blocks, `mu_t = (tau - 1) / (tau + 2)` with `tau = ((t - 1) mod R) + 1`:
for R = 3 this is the paper's SR-SMoE `(t mod 3) / (t mod 3 + 3)` with
0-based t (0, 1/4, 2/5, 0, 1/4, 2/5 over six layers), and a restart block
(mu = 0) drops the accumulated momentum.
"""

from __future__ import annotations

from typing import Any, ClassVar, Optional

import jax

from vmoe_ext.errors import require
from vmoe_ext.moe.contract import RoutingContext
from vmoe_ext.streams.base import Ffn
from vmoe_ext.streams.momentum_base import MomentumStream, check_positive

Array = jax.Array


def time_varying_mu(t: int, restart_every: Optional[int] = None) -> float:
  """`mu_t` of the t-th MoE block (1-based)."""
  tau = t if restart_every is None else (t - 1) % restart_every + 1
  return (tau - 1) / (tau + 2)


class TimeVaryingMomentum(MomentumStream):
  """MomentumSMoE (TV) / SR-SMoE (registered as "time_varying").

  Attributes:
    gamma: step size > 0 (the paper keeps 1.0).
    restart_every: restart period R in MoE blocks (None: never; the paper's
      SR-SMoE restarts after 3 of 6 layers).
  """
  scan_safe: ClassVar[bool] = False  # Reads the block's position.
  gamma: float = 1.0
  restart_every: Optional[int] = None

  def __post_init__(self):
    check_positive(self.gamma, "gamma")
    require(self.restart_every is None or (
        isinstance(self.restart_every, int) and self.restart_every >= 1),
            "stream.restart_every",
            f"must be None or a positive integer, got {self.restart_every!r}")
    super().__post_init__()

  def moe_step(self, x: Array, ffn: Ffn, state: Any,
               ctx: RoutingContext) -> tuple[Array, Any]:
    mu = time_varying_mu(ctx.moe_index + 1, self.restart_every)
    g = self.evaluate(ffn, x, None)
    x, p = self.heavy_ball(x, g, state["p"], mu, self.gamma)
    return x, {"p": p}
