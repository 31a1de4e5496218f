"""Grouped matmul: expert-sorted rows, each block times its expert's weights.

`grouped_matmul(x[NB, b, I], w[E, I, O], groups) -> [NB, b, O]` multiplies
block n (b rows) by `w[groups.block_expert[n]]`. The rows arrive sorted by
expert, each expert's rows padded to whole blocks of b rows
(`vmoe_ext.moe.dropless` builds that layout), so expert e owns the
consecutive blocks `groups.group_sizes[e] / b` long; blocks at and past
`groups.used_blocks` hold no row (the layout is sized for the worst case).

Two backends compute the same product:

* "ragged": `jax.lax.ragged_dot` of the `NB*b` rows with the per-expert row
  counts (`group_sizes`); rows past their sum come out 0. On GPU and TPU
  XLA runs it as a grouped GEMM (about the routed FLOPs). On CPU jax lowers
  it to a masked dense product, every row times every expert's weights: E
  times the routed FLOPs.
* "blocks": a loop over the used blocks, each one dense `[b, I] x [I, O]`
  matmul with its expert's weights read in place (no `[NB, I, O]` copy of
  the weights), and a custom VJP that loops the same way and accumulates
  each expert's weight gradient in place. It computes `used_blocks * b`
  rows, the routed rows plus less than one block of padding per expert; the
  CPU path. The custom VJP has no forward-mode rule (`jax.jvp` raises);
  reverse mode, `jit` and `vmap` work.

"auto" is "ragged" where `jax.default_backend()` is a GPU or TPU, else
"blocks".
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from vmoe_ext.errors import require

Array = jax.Array
BACKENDS = ("auto", "blocks", "ragged")


@flax.struct.dataclass
class BlockGroups:
  """Which expert owns each block of expert-sorted rows.

  Attributes:
    block_expert: `[NB]` int32, the expert of each block (for the unused
      blocks past `used_blocks`, the last expert; they hold no row).
    used_blocks: scalar int32, blocks that hold rows (all first).
    group_sizes: `[E]` int32, rows of each expert, padding included (a
      multiple of the block size; they sum to `used_blocks * b`).
  """
  block_expert: Array
  used_blocks: Array
  group_sizes: Array


def resolve_backend(backend: str) -> str:
  """"auto" -> "ragged" on GPU/TPU, "blocks" on CPU; others unchanged."""
  require(backend in BACKENDS, "moe.dropless_backend",
          f"must be one of {BACKENDS}, got {backend!r}")
  if backend != "auto":
    return backend
  return "blocks" if jax.default_backend() == "cpu" else "ragged"


def _zeros(shape: tuple[int, ...], dtype, *like: Array) -> Array:
  """Zeros of the union type of `like`: inside a `shard_map` a loop's carry
  must vary over the mesh axes its body's result varies over (those of any
  operand), and `zeros_like` keeps them."""
  out = jnp.zeros(shape, dtype)
  for a in like:
    out = out + jnp.zeros_like(a, shape=shape, dtype=dtype)
  return out


def block_matmul(x: Array, w: Array, block_expert: Array,
                 used_blocks: Array) -> Array:
  """`[NB, b, I] x [E, I, O] -> [NB, b, O]`: block n times
  `w[block_expert[n]]` for `n < used_blocks`, zeros after.

  Inside a `shard_map`, `x` and `w` are first lifted to the mesh axes either
  varies over (tokens over the data axes, weights over the expert axis), so
  that the custom VJP's gradients have their inputs' types; the lift's own
  transpose sums `w`'s gradient over the axes `w` does not vary over.
  """
  x_lifted = x + _zeros(x.shape, x.dtype, w, block_expert)
  w_lifted = w + _zeros(w.shape, w.dtype, x, block_expert)
  return _block_matmul(x_lifted, w_lifted, block_expert, used_blocks)


@jax.custom_vjp
def _block_matmul(x: Array, w: Array, block_expert: Array,
                  used_blocks: Array) -> Array:
  out = _zeros(x.shape[:2] + w.shape[2:], jnp.result_type(x, w), x, w,
               block_expert)

  def body(n, y):
    return y.at[n].set(jnp.matmul(x[n], w[block_expert[n]]))

  return jax.lax.fori_loop(0, used_blocks, body, out)


def _block_matmul_fwd(x, w, block_expert, used_blocks):
  return (_block_matmul(x, w, block_expert, used_blocks),
          (x, w, block_expert, used_blocks))


def _block_matmul_bwd(residuals, dy):
  x, w, block_expert, used_blocks = residuals

  def body(n, carry):
    dx, dw = carry
    e = block_expert[n]
    dx = dx.at[n].set(jnp.matmul(dy[n], w[e].T).astype(dx.dtype))
    dw = dw.at[e].add(jnp.matmul(x[n].T, dy[n]).astype(dw.dtype))
    return dx, dw

  like = (x, w, dy, block_expert)
  dx, dw = jax.lax.fori_loop(0, used_blocks, body,
                             (_zeros(x.shape, x.dtype, *like),
                              _zeros(w.shape, w.dtype, *like)))
  return dx, dw, None, None


_block_matmul.defvjp(_block_matmul_fwd, _block_matmul_bwd)


def grouped_matmul(x: Array, w: Array, groups: BlockGroups,
                   backend: str) -> Array:
  """`[NB, b, I] x [E, I, O] -> [NB, b, O]`, each block times its expert's
  weights (rows of unused blocks: 0).

  Args:
    x: `[NB, b, I]` expert-sorted rows in blocks.
    w: `[E, I, O]` one weight matrix per expert.
    groups: the blocks' experts (`BlockGroups`).
    backend: "blocks" or "ragged" (see the module docstring; resolve
      "auto" first with `resolve_backend`).
  """
  if backend == "ragged":
    nb, b, _ = x.shape
    out = jax.lax.ragged_dot(x.reshape(nb * b, -1), w, groups.group_sizes)
    return out.reshape(nb, b, -1)
  require(backend == "blocks", "moe.dropless_backend",
          f"must be 'blocks' or 'ragged' here, got {backend!r}")
  return block_matmul(x, w, groups.block_expert, groups.used_blocks)
