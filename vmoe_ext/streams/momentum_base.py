"""Shared machinery of the MomentumSMoE family (docs/streams.md, "Layouts"):
layouts, signs.

Every momentum stream reads the stack of MoE blocks as an optimiser: block t
applies one step to the iterate `x_t` (`[B, T, D]`, the stream after the
attention residual) with a "gradient" built from the block's MoE output
`u = F(LN(z) + shift)`. Two layouts (config field `layout`):

* `paper`: the equations as written, on MoE blocks only (dense blocks keep
  the plain residual and pass the state through). The paper defines
  `-f(x_t)` as the SMoE output (§2.3, Eq. 9), so the gradient is
  `g = -u`; heavy-ball with `mu = 0, gamma = 1` is exactly the plain residual
  `x + u`. Extrapolated points (robust momentum, NAG, SAM) are added to `x`
  before the block's pre-LayerNorm.
* `vmoe_reference` (the default; the authors' V-MoE code, which produced the
  paper's vision numbers): every block, dense ones included, ends with a
  post-LayerNorm `LayerNorm_2`; the MoE output is subtracted (`g = +u`,
  heavy-ball `m = mu m + gamma u; LN_2(x - m)`); extrapolations are added
  after the pre-LayerNorm (`F(LN_1(x) + shift)`); the state travels through
  dense blocks unchanged (`LN_2(x + Mlp(LN_1(x)))`), and only robust momentum
  shifts the dense blocks' MLP input as well.

Subclasses implement `moe_step` (one MoE block) and, where the state is not
`{"p": zeros}`, `init_state`; `__call__` handles dense blocks and the
post-LayerNorm. Coefficient checks live here so every stream reports bad
values the same way (`model.stream.<field>`).
"""

from __future__ import annotations

from typing import Any, ClassVar, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from vmoe_ext.errors import require
from vmoe_ext.moe.contract import RoutingContext
from vmoe_ext.streams.base import Ffn, ResidualStream

Array = jax.Array
LAYOUTS = ("paper", "vmoe_reference")
DEFAULT_LAYOUT = "vmoe_reference"
LAYOUT_BLOCKS = {"paper": "moe", "vmoe_reference": "all"}


def check_open_unit(value: float, field: str, low: float = -1.0) -> None:
  """Requires `low < value < 1` (a fixed momentum coefficient)."""
  require(isinstance(value, (int, float)) and low < value < 1.0,
          f"stream.{field}",
          f"must be in ({low:g}, 1), got {value!r}")


def check_decay(value: float, field: str) -> None:
  """Requires `0 <= value < 1` (an exponential-moving-average decay)."""
  require(isinstance(value, (int, float)) and 0.0 <= value < 1.0,
          f"stream.{field}",
          f"must be in [0, 1), got {value!r}")


def check_positive(value: float, field: str) -> None:
  """Requires `value > 0`; `field` is the stream's field (named
  "stream.{field}", as every stream names its fields)."""
  require(isinstance(value, (int, float)) and value > 0, f"stream.{field}",
          f"must be > 0, got {value!r}")


class MomentumStream(ResidualStream):
  """Base of the momentum streams.

  Attributes:
    layout: "paper" or "vmoe_reference" (see the module docstring).
    blocks: derived from the layout ("moe" for paper, "all" for
      vmoe_reference); setting the other value is an error.
  """
  blocks: Optional[str] = None  # type: ignore[assignment]
  layout: str = DEFAULT_LAYOUT

  # Whether dense blocks (vmoe_reference) evaluate their MLP at the shifted
  # point `dense_shift(state)` (robust momentum in the authors' code).
  shifts_dense_blocks: ClassVar[bool] = False

  def __post_init__(self):
    require(self.layout in LAYOUTS, "stream.layout",
            f"unknown layout {self.layout!r}; use one of {LAYOUTS}")
    blocks = LAYOUT_BLOCKS[self.layout]
    require(self.blocks in (None, blocks), "stream.blocks",
            f"the {self.layout!r} layout applies the stream to "
            f"blocks={blocks!r}; leave blocks unset (got {self.blocks!r})")
    object.__setattr__(self, "blocks", blocks)
    super().__post_init__()

  @property
  def reference(self) -> bool:
    return self.layout == "vmoe_reference"

  def gradient(self, u: Array) -> Array:
    """The optimiser's gradient for the MoE output `u` (sign by layout)."""
    return u if self.reference else -u

  def evaluate(self, ffn: Ffn, x: Array, shift: Optional[Array], *,
               primary: bool = True) -> Array:
    """`g` at the point `x` moved by `shift` (before or after the pre-LN)."""
    if shift is None:
      u, _ = ffn(x, primary=primary)
    elif self.reference:
      u, _ = ffn(x, shift=shift, primary=primary)
    else:
      u, _ = ffn(x + shift, primary=primary)
    return self.gradient(u)

  def heavy_ball(self, x: Array, g: Array, buffer: Array, mu: Any,
                 gamma: Any) -> tuple[Array, Array]:
    """One heavy-ball step; returns `(x_next before post-LN, buffer)`.

    paper: `p = -g + mu p; x + gamma p` (Eq. 10). vmoe_reference: the
    authors' `m = mu m + gamma g; x - m` (the same iteration for a constant
    gamma, with `m = -gamma p`; gamma sits inside the buffer).
    """
    if self.reference:
      buffer = mu * buffer + gamma * g
      return x - buffer, buffer
    buffer = -g + mu * buffer
    return x + gamma * buffer, buffer

  def init_state(self, x: Array) -> Any:
    return {"p": jnp.zeros_like(x)}

  def dense_shift(self, state: Any) -> Optional[Array]:
    del state
    return None

  def moe_step(self, x: Array, ffn: Ffn, state: Any,
               ctx: RoutingContext) -> tuple[Array, Any]:
    raise NotImplementedError

  @nn.compact
  def __call__(self, x: Array, ffn: Ffn, state: Any, *,
               ctx: RoutingContext, is_moe: bool) -> tuple[Array, Any]:
    if is_moe:
      x, state = self.moe_step(x, ffn, state, ctx)
    else:  # Only vmoe_reference applies to dense blocks.
      shift = self.dense_shift(state) if self.shifts_dense_blocks else None
      f, _ = ffn(x, shift=shift)
      x = x + f
    if self.reference:
      x = nn.LayerNorm(name="LayerNorm_2")(x)
    return x, state
