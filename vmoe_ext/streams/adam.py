"""AdamSMoE: an AdamW step in the first MoE block, heavy-ball after it (§4.1).

With `g` the layout's gradient (`-u` paper, `+u` vmoe_reference; see
momentum_base) and `p_0 = v_0 = 0`, the first MoE block computes

* `form="paper"` (Eq. 15): `p = mu p + (1-mu)(-g)`, `v = beta v + (1-beta)
  g*g`, `x + gamma p / (sqrt(v) + eps) - kappa x` (kappa defaults to 0: the
  paper gives no value); the later blocks continue the heavy-ball iteration
  from that same `p` (one momentum vector, as the paper's notation reads).
* `form="code"` (the authors' language-model code): the first moment decays
  with `beta1` (0.9, not mu), eps sits inside the root `sqrt(v + eps)`, no
  bias correction, `kappa = 1` exactly (the input cancels; the next
  LayerNorm sees only the Adam step), and the heavy-ball buffer is seeded
  with the block's own heavy-ball step from zero (`m = gamma2 u_0`).

The later MoE blocks take heavy-ball steps with `momentum_mu` (default: mu)
and `momentum_gamma` (default: gamma).
"""

from __future__ import annotations

from typing import Any, Optional

import jax
import jax.numpy as jnp

from vmoe_ext.errors import require
from vmoe_ext.streams.first_layer import FirstLayerThenHeavyBall
from vmoe_ext.streams.momentum_base import check_decay, check_positive

Array = jax.Array
FORMS = ("paper", "code")


class AdamSMoE(FirstLayerThenHeavyBall):
  """AdamSMoE (registered as "adam").

  Attributes:
    form: "paper" (Eq. 15) or "code" (the authors' code; module docstring).
    mu: paper form: first-moment decay and the later heavy-ball mu; code
      form: the later heavy-ball mu only.
    beta: second-moment decay in [0, 1) (the code's beta2).
    gamma: Adam step size > 0 (the code's gamma1).
    eps: > 0; added to sqrt(v) (paper) or to v under the root (code).
    kappa: decoupled weight decay; paper form >= 0 (None: 0), code form 1.
    beta1: code form's first-moment decay in [0, 1) (None: 0.9); the paper
      form has none (its first moment decays with mu).
  """
  form: str = "paper"
  mu: float = 0.7
  beta: float = 0.999
  gamma: float = 1.0
  eps: float = 1e-8
  kappa: Optional[float] = None
  beta1: Optional[float] = None

  def __post_init__(self):
    require(self.form in FORMS, "stream.form",
            f"unknown {self.form!r}; use one of {FORMS}")
    if self.form == "paper":
      check_decay(self.mu, "mu")
      require(self.beta1 is None, "stream.beta1",
              "only form='code' has a separate first-moment decay; the "
              "paper's first moment decays with mu")
      kappa = 0.0 if self.kappa is None else self.kappa
      require(isinstance(kappa, (int, float)) and kappa >= 0, "stream.kappa",
              f"must be >= 0, got {kappa!r}")
    else:
      check_decay(0.9 if self.beta1 is None else self.beta1, "beta1")
      kappa = 1.0 if self.kappa is None else self.kappa
      require(kappa == 1.0, "stream.kappa",
              f"the authors' code form has kappa = 1 exactly (the input "
              f"cancels); use form='paper' for another value, got {kappa!r}")
    object.__setattr__(self, "kappa", float(kappa))
    check_decay(self.beta, "beta")
    check_positive(self.gamma, "gamma")
    check_positive(self.eps, "eps")
    super().__post_init__()

  @property
  def heavy_ball_defaults(self) -> tuple[float, float]:
    return self.mu, self.gamma

  def init_state(self, x: Array) -> Any:
    zeros = jnp.zeros_like(x)
    return {"p": zeros, "v": zeros, "hb": zeros}

  def first_step(self, x: Array, g: Array, state: Any
                 ) -> tuple[Array, Any]:
    code = self.form == "code"
    decay = (0.9 if self.beta1 is None else self.beta1) if code else self.mu
    p = decay * state["p"] + (1 - decay) * (-g)
    v = self.beta * state["v"] + (1 - self.beta) * g * g
    scale = (jnp.sqrt(v + self.eps) if code
             else jnp.sqrt(v) + self.eps)
    x_next = x + self.gamma * p / scale - self.kappa * x
    mu, gamma = self.heavy_ball_coefficients
    if code:  # Seed: the block's own heavy-ball step from zero.
      _, hb = self.heavy_ball(x, g, jnp.zeros_like(x), mu, gamma)
    else:  # Continue from p (in the layout's buffer convention).
      hb = -gamma * p if self.reference else p
    return x_next, {"p": p, "v": v, "hb": hb}
