"""MomentumSMoE: heavy-ball momentum across MoE blocks (Eq. 10), fixed or learnable.

    paper:           p_t = -f(x_t) + mu p_{t-1};   x_{t+1} = x_t + gamma p_t
    vmoe_reference:  m_t = mu m_{t-1} + gamma u_t; x_{t+1} = LN_2(x_t - m_t)

with `-f = u` the MoE output (paper) and `p_0 = m_0 = 0` before block 0.
A negative `mu` in (-1, 0) is the paper's Negative-MomentumSMoE (E.4).

Learnable variants (appendix E.1), one set of parameters per MoE block:

* `learn="both"`: `mu = tanh(mu_raw)` in (-1, 1) (Proposition 1's range) and
  `gamma = softplus(gamma_raw)` > 0, initialised at the fields' values;
* `learn="gamma"`: `mu` fixed, `gamma = softplus(gamma_raw)` > 0;
* `learn="gamma_linear"`: `mu` fixed, a per-token step
  `gamma = sigmoid(Dense_1(x_t))` in (0, 1) (kernel 0, bias
  `logit(gamma)`; `gamma` defaults to 0.5 here).
"""

from __future__ import annotations

import math
from typing import Any, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from vmoe_ext.errors import require
from vmoe_ext.moe.contract import RoutingContext, at_least_float32
from vmoe_ext.streams.base import Ffn
from vmoe_ext.streams.momentum_base import (MomentumStream, check_open_unit,
                                            check_positive)

Array = jax.Array
LEARN = ("none", "both", "gamma", "gamma_linear")


def inverse_softplus(y: float) -> float:
  return y + math.log(-math.expm1(-y))


class HeavyBall(MomentumStream):
  """Heavy-ball momentum (registered as "momentum").

  Attributes:
    mu: momentum coefficient (fixed: in (-1, 1); learnable: its initial
      value). The paper uses 0.7 (language), the authors' V-MoE config 0.8.
    gamma: step size > 0 (learnable: its initial value; None: 1.0, or 0.5
      for `learn="gamma_linear"`, whose sigmoid step lies in (0, 1)).
    learn: "none", "both", "gamma" or "gamma_linear" (module docstring).
  """
  mu: float = 0.7
  gamma: Optional[float] = None
  learn: str = "none"

  def __post_init__(self):
    require(self.learn in LEARN, "stream.learn",
            f"unknown {self.learn!r}; use one of {LEARN}")
    check_open_unit(self.mu, "mu")
    if self.learn == "gamma_linear":
      gamma = 0.5 if self.gamma is None else self.gamma
      require(isinstance(gamma, (int, float)) and 0 < gamma < 1, "stream.gamma",
              f"the sigmoid step of learn='gamma_linear' starts in (0, 1), "
              f"got {gamma!r}")
    else:
      gamma = 1.0 if self.gamma is None else self.gamma
      check_positive(gamma, "gamma")
    object.__setattr__(self, "gamma", float(gamma))
    super().__post_init__()

  def coefficients(self, x: Array) -> tuple[Any, Any]:
    """`(mu, gamma)` of this block: floats, scalars or `gamma [B, T, 1]`."""
    mu, gamma = self.mu, self.gamma
    # In float32, as the state, whatever `model.param_dtype` stores them in.
    f32 = lambda name, value: at_least_float32(self.param(
        name, nn.initializers.constant(value), ()))
    if self.learn == "both":
      mu = jnp.tanh(f32("mu_raw", math.atanh(self.mu)))
    if self.learn in ("both", "gamma"):
      gamma = jax.nn.softplus(f32("gamma_raw", inverse_softplus(gamma)))
    elif self.learn == "gamma_linear":
      logit = math.log(gamma / (1.0 - gamma))
      gamma = jax.nn.sigmoid(nn.Dense(
          1, dtype=jnp.promote_types(x.dtype, jnp.float32),
          kernel_init=nn.initializers.zeros,
          bias_init=nn.initializers.constant(logit), name="Dense_1")(x))
    return mu, gamma

  def moe_step(self, x: Array, ffn: Ffn, state: Any,
               ctx: RoutingContext) -> tuple[Array, Any]:
    del ctx
    mu, gamma = self.coefficients(x)
    g = self.evaluate(ffn, x, None)
    x, p = self.heavy_ball(x, g, state["p"], mu, gamma)
    return x, {"p": p}
