"""Residual streams: how a block's MoE output `f` updates the token stream x.

A stream is a linen module called as

    x_next, state, aux = stream(x, ffn, state)

where `ffn(z) -> (f, aux)` applies the block's (pre-LayerNorm) MoE to an input
`z` of the stream's choosing (robust momentum evaluates it at an extrapolated
point), and `state` is the stream's own pytree carried across blocks in
`RoutingContext.stream_state` (None before the first block that uses it).
"""

from __future__ import annotations

from typing import Any, Callable

import flax.linen as nn
import jax

Array = jax.Array
Ffn = Callable[[Array], tuple[Array, Any]]


class ResidualStream(nn.Module):
  """Base class: subclasses implement `__call__(x, ffn, state)`."""

  def __call__(self, x: Array, ffn: Ffn, state: Any) -> tuple[Array, Any, Any]:
    raise NotImplementedError
