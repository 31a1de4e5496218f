"""The plain residual connection `x + f(x)`: stateless."""

from __future__ import annotations

from typing import Any

import jax

from vmoe_ext.moe.contract import RoutingContext
from vmoe_ext.streams.base import Ffn, ResidualStream

Array = jax.Array


class PlainResidual(ResidualStream):
  """`x_{t+1} = x_t + f(x_t)`; the state passes through untouched."""

  def __call__(self, x: Array, ffn: Ffn, state: Any, *,
               ctx: RoutingContext, is_moe: bool) -> tuple[Array, Any]:
    del ctx, is_moe
    f, _ = ffn(x)
    return x + f, state
