"""An adaptive step in the first MoE block, heavy-ball in the later ones.

AdamSMoE and rms-SMoE are unstable in every layer, so the paper uses them in
the first MoE layer only and MomentumSMoE afterwards (appendix D.1, E.4,
following Keskar & Socher's switch from Adam to SGD). This base class owns
that placement: `first_step` is the subclass's update at the first MoE block
(`ctx.moe_index == 0`); every later MoE block takes a heavy-ball step with
`momentum_mu` / `momentum_gamma` on the state's `"hb"` buffer (layout rules
of `MomentumStream.heavy_ball`).
"""

from __future__ import annotations

from typing import Any, ClassVar, Optional

import jax

from vmoe_ext.errors import require
from vmoe_ext.moe.contract import RoutingContext
from vmoe_ext.streams.base import Ffn
from vmoe_ext.streams.momentum_base import (MomentumStream, check_open_unit,
                                            check_positive)

Array = jax.Array


class FirstLayerThenHeavyBall(MomentumStream):
  """Base of AdamSMoE and rms-SMoE.

  Attributes:
    block: the encoder block of the adaptive step; None means the first MoE
      block, and any other block is a config error (the paper's placement).
    momentum_mu / momentum_gamma: heavy-ball coefficients of the later MoE
      blocks (None: the subclass's default).
  """
  scan_safe: ClassVar[bool] = False  # Reads the block's position.
  block: Optional[int] = None
  momentum_mu: Optional[float] = None
  momentum_gamma: Optional[float] = None

  def __post_init__(self):
    mu, gamma = self.heavy_ball_coefficients
    check_open_unit(mu, "momentum_mu")
    check_positive(gamma, "momentum_gamma")
    super().__post_init__()

  @property
  def heavy_ball_defaults(self) -> tuple[float, float]:
    """`(mu, gamma)` of the later blocks when the fields are unset."""
    return 0.7, 1.0

  @property
  def heavy_ball_coefficients(self) -> tuple[float, float]:
    """`(mu, gamma)` of the later blocks."""
    mu, gamma = self.heavy_ball_defaults
    return (mu if self.momentum_mu is None else self.momentum_mu,
            gamma if self.momentum_gamma is None else self.momentum_gamma)

  def check_placement(self, moe_blocks: tuple[int, ...]) -> None:
    if self.block is None:
      return
    first = moe_blocks[0] if moe_blocks else None
    require(self.block == first, "stream.block",
            f"{type(self).__name__} runs in the first MoE layer only (block "
            f"{first}) and heavy-ball after it (paper D.1); got block "
            f"{self.block!r}")

  def first_step(self, x: Array, g: Array, state: Any
                 ) -> tuple[Array, Any]:
    raise NotImplementedError

  def moe_step(self, x: Array, ffn: Ffn, state: Any,
               ctx: RoutingContext) -> tuple[Array, Any]:
    g = self.evaluate(ffn, x, None)
    if ctx.moe_index == 0:
      return self.first_step(x, g, state)
    mu, gamma = self.heavy_ball_coefficients
    x, hb = self.heavy_ball(x, g, state["hb"], mu, gamma)
    return x, dict(state, hb=hb)
