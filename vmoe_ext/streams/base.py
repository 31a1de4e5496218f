"""Residual streams (contract v2): how a block's MLP/MoE output updates x.

The stream is chosen once per model (`model.stream` in configs) and built as
a child module ("Stream") of every block it applies to: MoE blocks only
(`blocks="moe"`, the default; dense blocks keep the plain residual and pass the
state through untouched) or every block (`blocks="all"`: dense MLP blocks too,
as robust momentum in the authors' V-MoE code). It is called as

    x_next, state = stream(x, ffn, state, ctx=ctx, is_moe=...)

* `x`: `[B, T, D]`, the block's stream after the attention residual.
* `state`: the stream's pytree carried across blocks in
  `RoutingContext.stream_state`. It is created before block 0 by
  `init_state(x)` and keeps the same structure (shapes, dtypes) in every block,
  so the block stack can be scanned or rematerialised.
* `ffn(z, *, shift=None, primary=True) -> (f, aux)` evaluates the block's
  MLP/MoE at a point of the stream's choosing: `f = F(LN(z) + shift)` with the
  block's pre-LayerNorm `LN` (`shift`, `[B, T, D]` or None, is added after it,
  as robust momentum's extrapolation in the vmoe layout).

How often `ffn` may be called: any number of times per block (NAG, SAM and
robust momentum evaluate F at shifted points), with exactly ONE call marked
`primary=True` (the default; routers see it as `ctx.primary`, the MoE layer
takes it as `MoeLayer(..., primary=...)`). The primary call is the block's
evaluation: only it sows intermediates (`expert_mask`, `selected_experts`),
only it may update persistent router state, and its `LayerRecord` and metrics
are the block's (what later MoE layers read, what the losses sum). Calls with
`primary=False` share the parameters and add no auxiliary loss, sow nothing
and update no state. A block raises if a stream makes no primary call or more
than one. `aux` is for the stream's own use (None for dense blocks).
"""

from __future__ import annotations

from typing import Any, ClassVar, Optional, Protocol

import flax.linen as nn
import jax

from vmoe_ext.errors import require
from vmoe_ext.moe.contract import RoutingContext

Array = jax.Array
BLOCKS = ("moe", "all")


class Ffn(Protocol):
  """The block's MLP/MoE as the stream sees it (see the module docstring)."""

  def __call__(self, z: Array, *, shift: Optional[Array] = None,
               primary: bool = True) -> tuple[Array, Any]:
    ...


class ResidualStream(nn.Module):
  """Base class of every stream.

  Attributes:
    blocks: "moe" (apply to MoE blocks only) or "all" (dense blocks too).
  """
  blocks: str = "moe"
  # Whether the stream may run inside a scan over blocks (`model.scan`):
  # False when its update reads the block's position (`ctx.moe_index`).
  scan_safe: ClassVar[bool] = True

  def __post_init__(self):
    require(self.blocks in BLOCKS, "stream.blocks",
            f"must be one of {BLOCKS}, got {self.blocks!r}")
    super().__post_init__()

  def init_state(self, x: Array) -> Any:
    """The state before block 0 for a stream `x: [B, T, D]` (no parameters).

    Must return the same structure every block returns; `()` if stateless.
    """
    del x
    return ()

  def check_placement(self, moe_blocks: tuple[int, ...]) -> None:
    """Raises ConfigError if the stream cannot serve MoE blocks
    `moe_blocks` (encoder block indices); called before anything traces."""
    del moe_blocks

  def __call__(self, x: Array, ffn: Ffn, state: Any, *,
               ctx: RoutingContext, is_moe: bool) -> tuple[Array, Any]:
    raise NotImplementedError

