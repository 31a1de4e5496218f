"""`partitionable_top_k`: top-k over the last axis, as `jax.lax.top_k`, but
split by the compiler.

XLA's SPMD partitioner does not split `jax.lax.top_k` along the batch axes on
CPU: under `jit` over a mesh it all-gathers the whole `[G, S, E]` router
output onto every device first. A stable sort of `(-x, index)` along the last
axis is split like any elementwise op, and gives the same values, the same
indices (ties: lower index first, as `jax.lax.top_k`) and the same gradients.
Every router, the load loss and the eval step's top-5 select through it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array


def partitionable_top_k(x: Array, k: int) -> tuple[Array, Array]:
  """`([..., k] largest values in decreasing order, [..., k] int32 indices)`."""
  n = x.shape[-1]
  if not 0 < k <= n:
    raise ValueError(f"k={k} must be in [1, {n}] (the last axis of "
                     f"{x.shape})")
  index = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
  neg, order = jax.lax.sort((-x, index), dimension=x.ndim - 1,
                            is_stable=True, num_keys=1)
  return -neg[..., :k], order[..., :k]


# Deprecated name, kept for one release; use `partitionable_top_k`.
top_k = partitionable_top_k
