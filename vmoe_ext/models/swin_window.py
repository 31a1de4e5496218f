"""Swin Transformer's windows: partition, reverse, shift mask, relative positions.

Pure functions of static shapes (Liu et al. 2021, Sec. 3.2), used by
`vmoe_ext.models.swin`. Shape letters: B images, H x W tokens of a stage,
M the window side, N = M * M tokens per window, nW = (H / M) * (W / M)
windows per image (row-major over the window grid), C channels.
"""

from __future__ import annotations

import numpy as np
import jax
import jax.numpy as jnp

from vmoe_ext.errors import require

Array = jax.Array
# The additive attention mask between tokens of different shifted regions
# (the reference implementation's -100: exp(-100) is 0 in float32).
MASK_VALUE = -100.0


def stage_window(height: int, width: int, window: int, shift: int
                 ) -> tuple[int, int]:
  """The window side and shift a block of an H x W stage uses.

  As the reference implementation: when the stage is no larger than the
  window (`min(H, W) <= M`), the window shrinks to `min(H, W)` and the block
  does not shift (one window holds the whole stage). Either way the window
  must tile the stage, which the caller checks (`check_window`).
  """
  if min(height, width) <= window:
    return min(height, width), 0
  return window, shift


def check_window(height: int, width: int, window: int, field: str) -> None:
  """Raises ConfigError on `field` unless M windows tile the H x W stage."""
  require(height % window == 0 and width % window == 0, field,
          f"window {window} does not tile the {height}x{width} tokens of "
          f"the stage (the stage's side must be a multiple of the window, "
          f"or no larger than it)")


def window_partition(x: Array, window: int) -> Array:
  """`[B, H, W, C]` -> `[B * nW, N, C]`: the tokens of each M x M window."""
  b, h, w, c = x.shape
  x = x.reshape(b, h // window, window, w // window, window, c)
  x = x.transpose(0, 1, 3, 2, 4, 5)
  return x.reshape(-1, window * window, c)


def window_reverse(windows: Array, window: int, height: int, width: int
                   ) -> Array:
  """`[B * nW, N, C]` -> `[B, H, W, C]`, the inverse of `window_partition`."""
  c = windows.shape[-1]
  gh, gw = height // window, width // window
  x = windows.reshape(-1, gh, gw, window, window, c)
  x = x.transpose(0, 1, 3, 2, 4, 5)
  return x.reshape(-1, height, width, c)


def relative_position_index(window: int) -> np.ndarray:
  """`[N, N]` int32: the row of the bias table `[(2M-1)^2, heads]` for the
  pair (query i, key j) of a window, tokens numbered row-major.

  Entry = `(dh + M - 1) * (2M - 1) + (dw + M - 1)` with `(dh, dw)` the
  offset of i from j.
  """
  coords = np.stack(np.meshgrid(np.arange(window), np.arange(window),
                                indexing="ij")).reshape(2, -1)   # [2, N]
  rel = coords[:, :, None] - coords[:, None, :] + (window - 1)   # [2, N, N]
  return (rel[0] * (2 * window - 1) + rel[1]).astype(np.int32)


def shift_regions(height: int, width: int, window: int, shift: int
                  ) -> np.ndarray:
  """`[H, W]` int32: the region label of each token of the cyclically
  shifted stage (3 x 3 regions: the slices `[0, -M)`, `[-M, -s)`, `[-s, H)`
  per axis), as the reference implementation labels them."""
  labels = np.zeros((height, width), np.int32)
  bounds = ((0, -window), (-window, -shift), (-shift, None))
  count = 0
  for hs in bounds:
    for ws in bounds:
      labels[slice(*hs), slice(*ws)] = count
      count += 1
  return labels


def shift_attention_mask(height: int, width: int, window: int, shift: int
                         ) -> np.ndarray:
  """`[nW, N, N]` float32 additive mask of shifted-window attention: 0
  between tokens of one region, `MASK_VALUE` between regions (after the
  cyclic shift, a window may join tokens that are not neighbours)."""
  labels = shift_regions(height, width, window, shift)
  m = window  # NumPy (static shapes): usable inside a trace.
  windows = labels.reshape(height // m, m, width // m, m).transpose(
      0, 2, 1, 3).reshape(-1, m * m)                            # [nW, N]
  same = windows[:, :, None] == windows[:, None, :]
  return np.where(same, 0.0, MASK_VALUE).astype(np.float32)


def cyclic_shift(x: Array, shift: int) -> Array:
  """`[B, H, W, C]` rolled by `-shift` on H and W (`shift < 0` undoes it)."""
  if shift == 0:
    return x
  return jnp.roll(x, (-shift, -shift), axis=(1, 2))


__all__ = ["MASK_VALUE", "check_window", "cyclic_shift",
           "relative_position_index", "shift_attention_mask", "shift_regions",
           "stage_window", "window_partition", "window_reverse"]
