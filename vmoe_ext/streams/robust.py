"""Robust MomentumSMoE (Cyrus et al.'s robust momentum, Eqs. 16-18).

    y_t = x_t + alpha gamma p_{t-1};  p_t = -f(y_t) + mu p_{t-1};
    x_{t+1} = x_t + gamma p_t

(the paper's momentum form of Eq. 18; `x_t - x_{t-1} = gamma p_{t-1}` is
the previous MoE block's step), with the coefficients of Eq. 17 from the
condition ratio `k = L/m` and `p in [1 - 1/sqrt(k), 1 - 1/k]`:

    gamma = k (1-p)^2 (1+p) / L,  mu = k p^3 / (k-1),
    alpha = p^3 / ((k-1) (1-p)^2 (1+p)).

The MoE of a block is evaluated once, at the extrapolated point, and that
call is the block's primary one (`primary=True`): its routing is what the
block records, sows and passes on (ACMoE reads it). Layouts (see momentum_base):
paper extrapolates before the pre-LayerNorm, `F(LN(x + alpha gamma p))`;
vmoe_reference after it in every block, `F(LN_1(x) + alpha gamma m)`, with
MoE blocks `m = -u + mu m; LN_2(x + gamma m)` and dense blocks
`LN_2(x + Mlp(LN_1(x) + alpha gamma m))` (m unchanged).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple, Optional

import jax

from vmoe_ext.errors import ConfigError, require
from vmoe_ext.moe.contract import RoutingContext
from vmoe_ext.streams.base import Ffn
from vmoe_ext.streams.momentum_base import MomentumStream, check_positive

Array = jax.Array
# Relative slack on the ends of p's valid range: 1 - 1/1.25 is 0.1999...96 in
# floating point, and the V-MoE reference's p = 0.2 sits exactly on that end.
RANGE_SLACK = 1e-9


class RobustCoefficients(NamedTuple):
  gamma: float
  mu: float
  alpha: float


def p_range(k: float) -> tuple[float, float]:
  """The valid `[low, high]` of p for the condition ratio `k > 1`."""
  return 1.0 - 1.0 / math.sqrt(k), 1.0 - 1.0 / k


def robust_coefficients(p: float, k: float, lipschitz: float = 1.0
                        ) -> RobustCoefficients:
  """Eq. 17. Raises ConfigError for `k <= 1` or p outside its range."""
  require(isinstance(k, (int, float)) and k > 1, "kappa",
          f"the condition ratio k = L/m must be > 1 (k = 1 divides by "
          f"zero), got {k!r}")
  check_positive(lipschitz, "L")
  low, high = p_range(k)
  require(isinstance(p, (int, float))
          and low - RANGE_SLACK <= p <= high + RANGE_SLACK, "p",
          f"must be in [1 - 1/sqrt(k), 1 - 1/k] = [{low:.6g}, {high:.6g}] "
          f"for k = {k:g}, got {p!r}")
  gamma = k * (1 - p) ** 2 * (1 + p) / lipschitz
  mu = k * p ** 3 / (k - 1)
  alpha = p ** 3 / ((k - 1) * (1 - p) ** 2 * (1 + p))
  return RobustCoefficients(gamma, mu, alpha)


class RobustMomentum(MomentumStream):
  """Robust momentum (registered as "robust_momentum").

  Set p by `p` (the paper) or `rho` (the authors' code), and k by `L`/`m`
  (the paper) or `kappa` (the code); unset, p = 0.2 and k = 1.25 with L = 1,
  the V-MoE reference (gamma 0.96, mu 0.04, alpha 0.041667).

  Attributes:
    p / rho: the robustness hyper-parameter (one of them).
    L: smoothness constant (> 0).
    m / kappa: strong convexity (k = L/m) or the condition ratio k itself.
  """
  p: Optional[float] = None
  rho: Optional[float] = None
  L: float = 1.0
  m: Optional[float] = None
  kappa: Optional[float] = None

  shifts_dense_blocks = True

  def __post_init__(self):
    self.coefficients  # Validates.
    super().__post_init__()

  @property
  def coefficients(self) -> RobustCoefficients:
    require(self.p is None or self.rho is None, "stream.rho",
            "p and rho are the same hyper-parameter (paper / code name); "
            "set one")
    require(self.m is None or self.kappa is None, "stream.kappa",
            "k is given either as L/m or as kappa; set one")
    p = 0.2 if self.p is None and self.rho is None else (
        self.p if self.p is not None else self.rho)
    p_field = "p" if self.p is not None else "rho"
    if self.m is not None:
      check_positive(self.m, "m")
      check_positive(self.L, "L")
      k, k_field = self.L / self.m, "m"
    else:
      k, k_field = (1.25 if self.kappa is None else self.kappa), "kappa"
    try:
      return robust_coefficients(p, k, self.L)
    except ConfigError as e:
      field = {"p": p_field, "kappa": k_field}.get(e.field, e.field)
      if not field.startswith("stream."):
        field = f"stream.{field}"
      raise ConfigError(field, e.reason) from None

  def dense_shift(self, state: Any) -> Array:
    c = self.coefficients
    return c.alpha * c.gamma * state["p"]

  def moe_step(self, x: Array, ffn: Ffn, state: Any,
               ctx: RoutingContext) -> tuple[Array, Any]:
    del ctx
    c = self.coefficients
    p = state["p"]
    g = self.evaluate(ffn, x, c.alpha * c.gamma * p)
    p = -g + c.mu * p
    return x + c.gamma * p, {"p": p}
