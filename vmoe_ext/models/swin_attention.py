"""Swin's window attention with a relative position bias, and stochastic depth.

Shape letters: W windows (all images' windows, `B * nW`), N = M * M tokens
of an M x M window, C channels, h heads.
"""

from __future__ import annotations

from typing import Any, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from vmoe_ext.models.attention import dot_product_attention
from vmoe_ext.models.swin_window import relative_position_index

Array = jax.Array
# `model.relative_position_bias`: the Swin paper's learned table, or the
# log-spaced continuous bias of the Swin-MoE release (an MLP of the offsets).
POSITION_BIASES = ("table", "log_cpb")
# The hidden width of the continuous position bias MLP of the release.
CPB_HIDDEN = 512
SWIN_INIT = nn.initializers.normal(stddev=0.02)


def log_spaced_offsets(window: int) -> np.ndarray:
  """`[(2M-1)^2, 2]` float32: the offsets `(dh, dw)` of the table's rows,
  scaled to [-8, 8] by `8 / (M - 1)` and mapped by
  `sign(t) * log2(|t| + 1) / log2(8)` (the Swin-MoE release's input of its
  position-bias MLP; a 1 x 1 window has the single offset 0)."""
  r = np.arange(-(window - 1), window, dtype=np.float32)
  grid = np.stack(np.meshgrid(r, r, indexing="ij"), axis=-1).reshape(-1, 2)
  t = grid / max(window - 1, 1) * 8.0
  return (np.sign(t) * np.log2(np.abs(t) + 1.0) / np.log2(8.0)
          ).astype(np.float32)


class WindowAttention(nn.Module):
  """Multi-head self-attention inside each window, `[W, N, C] -> [W, N, C]`.

  `softmax(q k^T / sqrt(C/h) + bias + mask) v`, then the output projection;
  `bias [h, N, N]` is looked up by `relative_position_index` in a table
  `[(2M-1)^2, h]`: a parameter (`relative_position_bias="table"`, the
  paper) or the output of a 2 -> 512 -> h MLP (ReLU, no bias in its second
  layer) of `log_spaced_offsets` ("log_cpb", the Swin-MoE release).
  `qkv` is one Dense to 3C laid out `[q | k | v]`, each `[h, C/h]`, as
  the reference's `qkv` Linear, so its weights port directly.

  Attributes:
    num_heads: h (divides C).
    window: M, the window's side.
    qkv_bias: biases of q, k, v.
    position_bias: "table" or "log_cpb".
    attention_dropout_rate: dropout on the attention weights.
    dropout_rate: dropout after the output projection.
    attention: "plain" (the einsums below) or "fused" / "cudnn"
      (`jax.nn.dot_product_attention` with the position bias and the shift
      mask summed into its `bias`, `vmoe_ext.models.attention`).
  """
  num_heads: int
  window: int
  qkv_bias: bool = True
  position_bias: str = "table"
  attention_dropout_rate: float = 0.0
  dropout_rate: float = 0.0
  dtype: Any = jnp.float32
  attention: str = "plain"

  def bias(self) -> Array:
    """`[h, N, N]` float32 relative position bias."""
    m = self.window
    if self.position_bias == "table":
      table = self.param("relative_position_bias_table", SWIN_INIT,
                         ((2 * m - 1) ** 2, self.num_heads))
    else:
      hidden = nn.Dense(CPB_HIDDEN, kernel_init=SWIN_INIT, name="cpb_mlp_0")(
          jnp.asarray(log_spaced_offsets(m)))
      table = nn.Dense(self.num_heads, use_bias=False, kernel_init=SWIN_INIT,
                       name="cpb_mlp_1")(
          nn.relu(hidden))
    index = relative_position_index(m).reshape(-1)
    n = m * m
    return table[index].reshape(n, n, self.num_heads).transpose(2, 0, 1)

  @nn.compact
  def __call__(self, x: Array, mask: Optional[Array] = None, *,
               deterministic: bool = True) -> Array:
    """x: `[W, N, C]`; mask: None or `[nW, N, N]` additive (W = B * nW,
    windows image-major) -> `[W, N, C]`."""
    w, n, c = x.shape
    h = self.num_heads
    qkv = nn.Dense(3 * c, use_bias=self.qkv_bias, kernel_init=SWIN_INIT,
                   dtype=self.dtype, name="qkv")(x)
    if self.attention != "plain":
      y = self.fused(qkv, mask)
    else:
      qkv = qkv.reshape(w, n, 3, h, c // h).transpose(2, 0, 3, 1, 4)
      q, k, v = qkv[0], qkv[1], qkv[2]                    # [W, h, N, C/h]
      q = q * (c // h) ** -0.5
      logits = jnp.einsum("whnd,whmd->whnm", q, k).astype(jnp.float32)
      logits = logits + self.bias()[None]
      if mask is not None:
        nw = mask.shape[0]
        logits = (logits.reshape(w // nw, nw, h, n, n)
                  + jnp.asarray(mask)[None, :, None]).reshape(w, h, n, n)
      weights = jax.nn.softmax(logits, axis=-1).astype(x.dtype)
      weights = nn.Dropout(self.attention_dropout_rate)(
          weights, deterministic=deterministic)
      y = jnp.einsum("whnm,whmd->wnhd", weights, v).reshape(w, n, c)
    y = nn.Dense(c, kernel_init=SWIN_INIT, dtype=self.dtype, name="proj")(y)
    return nn.Dropout(self.dropout_rate)(y, deterministic=deterministic)

  def fused(self, qkv: Array, mask: Optional[Array]) -> Array:
    """`[W, N, 3C]` -> `[W, N, C]` by `jax.nn.dot_product_attention`.

    The bias is the position bias `[1, h, N, N]`; with a mask `[nW, N, N]`
    it becomes `[W, h, N, N]`, a broadcast over the images that XLA fuses
    into the softmax (cuDNN receives it materialised, the size of the
    logits).
    """
    w, n, c3 = qkv.shape
    h, c = self.num_heads, c3 // 3
    q, k, v = qkv.reshape(w, n, 3, h, c // h).transpose(2, 0, 1, 3, 4)
    bias = self.bias()[None]                               # [1, h, N, N]
    if mask is not None:
      nw = mask.shape[0]
      bias = bias + jnp.asarray(mask)[:, None]             # [nW, h, N, N]
      bias = jnp.broadcast_to(bias[None], (w // nw, nw, h, n, n)
                              ).reshape(w, h, n, n)
    y = dot_product_attention(q, k, v, bias, attention=self.attention)
    return y.reshape(w, n, c)


def keep_probability(rate: float) -> np.float32:
  """`1 - rate` computed in float64 on the host, then cast once to float32:
  the value `DropPath` uses for a Python `rate` (which JAX casts the same
  way), so a scanned block's traced keep probability equals it bit for
  bit."""
  return np.float32(1.0 - float(rate))


class DropPath(nn.Module):
  """Stochastic depth: zero a residual branch `[B, ...]` per example with
  probability `rate` (training only), scaling the kept ones by
  `1 / (1 - rate)`; draws from the "dropout" rng stream.

  `keep`, when given, replaces `1 - rate`: the keep probability as a traced
  float32 scalar `[]` (a scanned Swin block's per-step value, from
  `keep_probability`), so one compiled block serves blocks of different
  rates; a keep of 1 leaves the branch unchanged.
  """
  rate: float = 0.0

  @nn.compact
  def __call__(self, x: Array, *, deterministic: bool = True,
               keep: Optional[Array] = None) -> Array:
    """x: `[B, ...]` -> `[B, ...]`."""
    if deterministic or (keep is None and self.rate <= 0.0):
      return x
    if keep is None:
      keep = scale = 1.0 - self.rate
    else:
      scale = keep.astype(x.dtype)
    mask = jax.random.bernoulli(self.make_rng("dropout"), keep,
                                (x.shape[0],) + (1,) * (x.ndim - 1))
    return jnp.where(mask, x / scale, jnp.zeros_like(x))


__all__ = ["CPB_HIDDEN", "DropPath", "POSITION_BIASES", "SWIN_INIT",
           "WindowAttention", "keep_probability", "log_spaced_offsets"]
