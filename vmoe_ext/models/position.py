"""Position embeddings of the ViT encoder: learned, 2-D sin-cos, or none.

`model.position_emb` selects one (vmoe's `encoder.position_emb.name`):
  * "learned" (default): a parameter `pos_embedding` `[1, N, D]` added to
    every token, the class token included (ViT / vmoe's `AddPositionEmbs`,
    initialised N(0, 0.02) as in BERT);
  * "sincos2d": the fixed 2-D sin-cos embedding of MoCo v3, added to the
    patch tokens only (a class token gets none), as vmoe computes it;
  * "none": nothing is added.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from vmoe_ext.errors import require

Array = jax.Array
POSITION_EMBEDDINGS = ("learned", "sincos2d", "none")


def check_position_emb(name: str, hidden_size: int) -> None:
  """Raises ConfigError("position_emb" / "hidden_size") for a bad choice."""
  require(name in POSITION_EMBEDDINGS, "position_emb",
          f"must be one of {POSITION_EMBEDDINGS}, got {name!r}")
  if name == "sincos2d":
    require(hidden_size % 4 == 0 and hidden_size >= 8, "hidden_size",
            f"the sincos2d position embedding needs a hidden_size that is a "
            f"multiple of 4 and at least 8, got {hidden_size}")


def sincos2d(height: int, width: int, hidden_size: int,
             temperature: float = 10_000.0, dtype=jnp.float32) -> Array:
  """The `[height * width, D]` 2-D sin-cos embedding of a patch grid.

  With `q = D // 4` frequencies `w_i = temperature ** (-i / (q - 1))`,
  the patch at row `r`, column `c` (row-major order) gets
  `[sin(c w), cos(c w), sin(r w), cos(r w)]`.
  """
  q = hidden_size // 4
  rows, cols = jnp.meshgrid(jnp.arange(height, dtype=dtype),
                            jnp.arange(width, dtype=dtype), indexing="ij")
  omega = 1.0 / temperature ** (jnp.arange(q, dtype=dtype) / (q - 1))
  x = cols.reshape(-1)[:, None] * omega[None, :]
  y = rows.reshape(-1)[:, None] * omega[None, :]
  return jnp.concatenate([jnp.sin(x), jnp.cos(x), jnp.sin(y), jnp.cos(y)],
                         axis=-1)


def add_fixed_position_emb(x: Array, name: str, grid: tuple[int, int],
                           temperature: float) -> Array:
  """x `[B, P + N, D]` (P prefix tokens before the `N = gh * gw` patches)
  with the fixed embedding `name` ("sincos2d" or "none") added."""
  if name == "none":
    return x
  gh, gw = grid
  emb = sincos2d(gh, gw, x.shape[-1], temperature, x.dtype)
  prefix = x.shape[1] - gh * gw
  return x.at[:, prefix:].add(emb[None])


__all__ = ["POSITION_EMBEDDINGS", "add_fixed_position_emb",
           "check_position_emb", "sincos2d"]
