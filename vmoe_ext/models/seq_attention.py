"""Attention over a cache of the previous block plus the current block, with
learned key position embeddings: the attention of the language-model backbone
(`vmoe_ext.models.language`, docs/language_model.md).

Shape letters: B batch rows (contiguous text streams), M tokens of the current
block, L the attention span (= the cache length), D model width, N heads,
Dh = D / N the head width.

Each layer sees the concatenation `[cache (L), block (M)]` of hidden states.
The query at block position i attends to the L positions *before* it, i.e.
positions `i, ..., i + L - 1` of the concatenation (window index
`c = 0 .. L-1`, `c = L - 1` the token right before the query); it does not
attend to itself. The score of window index c is

    (q_i . k_{i+c} + q_i . key_pe[:, c]) / sqrt(Dh)

with `key_pe [Dh, L]` shared by every layer and head, then a softmax over the
L window positions. There is no mask: at the start of a stream the cache is
zeros and those positions are attended like any other (their content score
is 0, their position score is not). After the block, the layer's cache is
the last L rows of `[cache, block input]` (`next_cache`), detached.

`window` / `unwindow` move between the `[M, L+M]` score matrix and the
`[M, L]` window (a diagonal band) with a pad-and-reshape, so no gather is
needed; `cached_attention` is the pure function, `SeqAttention` the thin linen
module with the projections (no biases).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

Array = jax.Array


def torch_linear_init() -> Callable:
  """`U(-1/sqrt(fan_in), 1/sqrt(fan_in))` for a `[in, out]` kernel: torch's
  `nn.Linear` default (`kaiming_uniform_(a=sqrt(5))`)."""
  return nn.initializers.variance_scaling(1.0 / 3.0, "fan_in", "uniform")


def torch_bias_init(fan_in: int) -> Callable:
  """`U(-1/sqrt(fan_in), 1/sqrt(fan_in))`: torch's `nn.Linear` bias."""
  bound = 1.0 / math.sqrt(fan_in)

  def init(key: Array, shape: tuple[int, ...], dtype: Any = jnp.float32
           ) -> Array:
    return jax.random.uniform(key, shape, dtype, -bound, bound)

  return init


def window(scores: Array) -> Array:
  """`[..., M, L+M] -> [..., M, L]`: entry `(i, c)` is `scores[..., i, i+c]`.

  Row i of the flattened `[M * (L+M)]` scores padded by M, read as
  `[M, L+M+1]`, starts at the diagonal element `(i, i)`.
  """
  *lead, m, n = scores.shape
  flat = scores.reshape(*lead, m * n)
  flat = jnp.pad(flat, [(0, 0)] * len(lead) + [(0, m)])
  return flat.reshape(*lead, m, n + 1)[..., :n - m]


def unwindow(weights: Array) -> Array:
  """`[..., M, L] -> [..., M, L+M]`: `out[..., i, i+c] = weights[..., i, c]`,
  zeros elsewhere (the inverse placement of `window`)."""
  *lead, m, l = weights.shape
  n = l + m
  padded = jnp.pad(weights, [(0, 0)] * len(lead) + [(0, 0), (0, m + 1)])
  flat = padded.reshape(*lead, m * (n + 1))[..., :m * n]
  return flat.reshape(*lead, m, n)


def cached_attention(q: Array, k: Array, v: Array, key_pe: Array, *,
                     dropout: Optional[Callable[[Array], Array]] = None
                     ) -> Array:
  """Attention of each query over the L positions before it.

  Args:
    q: `[B, N, M, Dh]` queries of the current block.
    k: `[B, N, L+M, Dh]` keys of `[cache, block]`.
    v: `[B, N, L+M, Dh]` values of `[cache, block]`.
    key_pe: `[Dh, L]` key position embeddings (window index c, c = L - 1
      the position right before the query).
    dropout: applied to the attention weights `[B, N, M, L]` (None: none).

  Returns:
    `[B, N, M, Dh]`.
  """
  dh = q.shape[-1]
  if k.shape[-2] <= q.shape[-2]:
    raise ValueError(f"keys {k.shape} must hold the L > 0 cached positions "
                     f"before the {q.shape[-2]} queries")
  content = window(jnp.einsum("bnmd,bnjd->bnmj", q, k))
  position = jnp.einsum("bnmd,dl->bnml", q, key_pe.astype(q.dtype))
  weights = jax.nn.softmax((content + position) / math.sqrt(dh), axis=-1)
  if dropout is not None:
    weights = dropout(weights)
  return jnp.einsum("bnmj,bnjd->bnmd", unwindow(weights), v)


def next_cache(cache: Array, h: Array) -> Array:
  """The next block's cache `[B, L, D]`: the last L rows of `[cache, h]`
  (`h` `[B, M, D]` the hidden states entering the layer), detached."""
  span = cache.shape[1]
  return jax.lax.stop_gradient(jnp.concatenate([cache, h], axis=1)[:, -span:])


class SeqAttention(nn.Module):
  """Multi-head `cached_attention` with bias-free q/k/v/output projections.

  Parameters `query`, `key`, `value`, `out` (`[D, D]` kernels, torch's
  `nn.Linear` initialisation). Attention-weight dropout at `dropout_rate`.
  """
  num_heads: int
  dropout_rate: float = 0.0
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, h: Array, cache: Array, key_pe: Array, *,
               deterministic: bool = True) -> Array:
    """h: `[B, M, D]`, cache: `[B, L, D]`, key_pe: `[Dh, L]` -> `[B, M, D]`."""
    b, m, d = h.shape
    n = self.num_heads
    context = jnp.concatenate([cache.astype(h.dtype), h], axis=1)

    def project(x: Array, name: str) -> Array:
      y = nn.Dense(d, use_bias=False, kernel_init=torch_linear_init(),
                   dtype=self.dtype, name=name)(x)
      return y.reshape(b, x.shape[1], n, d // n).transpose(0, 2, 1, 3)

    q = project(h, "query")
    k = project(context, "key")
    v = project(context, "value")
    drop = nn.Dropout(self.dropout_rate)
    out = cached_attention(
        q, k, v, key_pe,
        dropout=lambda w: drop(w, deterministic=deterministic))
    out = out.transpose(0, 2, 1, 3).reshape(b, m, d)
    return nn.Dense(d, use_bias=False, kernel_init=torch_linear_init(),
                    dtype=self.dtype, name="out")(out)


__all__ = ["SeqAttention", "cached_attention", "next_cache",
           "torch_bias_init", "torch_linear_init", "unwindow", "window"]
