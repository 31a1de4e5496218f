"""An independent NumPy (float64) reference of the Swin Transformer.

Written from the semantics of microsoft/Swin-Transformer's
`models/swin_transformer.py` (Liu et al. 2021) and the Swin-MoE release's
log-spaced continuous position bias, with explicit Python loops where the
layout matters (windows, relative positions, shift regions, patch merging,
patch embedding). It never calls `vmoe_ext`: it only reads a Flax params
tree (Dense kernels `[in, out]`, conv kernels `[ph, pw, Cin, Cout]`).

Shape letters: B images, H x W tokens of a stage, M the window side,
N = M * M tokens per window, C channels, h heads.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Optional, Sequence

import numpy as np
import scipy.special

MASK_VALUE = -100.0


def f64(a) -> np.ndarray:
  return np.asarray(a, np.float64)


# ---------------------------------------------------------------- windows ---

def window_partition(x: np.ndarray, m: int) -> np.ndarray:
  """`[B, H, W, C]` -> `[B * nW, N, C]`: window (image b, row wi, column wj)
  is number `(b * gh + wi) * gw + wj`; its token (r, c) is number
  `r * M + c`."""
  b, h, w, c = x.shape
  gh, gw = h // m, w // m
  out = np.zeros((b * gh * gw, m * m, c), x.dtype)
  for img in range(b):
    for wi in range(gh):
      for wj in range(gw):
        index = (img * gh + wi) * gw + wj
        for r in range(m):
          for col in range(m):
            out[index, r * m + col] = x[img, wi * m + r, wj * m + col]
  return out


def window_reverse(windows: np.ndarray, m: int, h: int, w: int
                   ) -> np.ndarray:
  """`[B * nW, N, C]` -> `[B, H, W, C]`, token by token."""
  gh, gw = h // m, w // m
  c = windows.shape[-1]
  b = windows.shape[0] // (gh * gw)
  out = np.zeros((b, h, w, c), windows.dtype)
  for img in range(b):
    for wi in range(gh):
      for wj in range(gw):
        index = (img * gh + wi) * gw + wj
        for r in range(m):
          for col in range(m):
            out[img, wi * m + r, wj * m + col] = windows[index, r * m + col]
  return out


def relative_position_index(m: int) -> np.ndarray:
  """`[N, N]`: for query token i = (hi, wi) and key token j = (hj, wj) of a
  window, `(hi - hj + M - 1) * (2M - 1) + (wi - wj + M - 1)`."""
  n = m * m
  index = np.zeros((n, n), np.int64)
  for i in range(n):
    hi, wi = divmod(i, m)
    for j in range(n):
      hj, wj = divmod(j, m)
      index[i, j] = (hi - hj + m - 1) * (2 * m - 1) + (wi - wj + m - 1)
  return index


def _axis_region(pos: int, size: int, m: int, s: int) -> int:
  """Which of the slices `[0, -M)`, `[-M, -s)`, `[-s, size)` holds `pos`."""
  if pos < size - m:
    return 0
  if pos < size - s:
    return 1
  return 2


def shift_labels(h: int, w: int, m: int, s: int) -> np.ndarray:
  """`[H, W]`: the region label `3 * row_region + col_region` of each token
  (h-slices outer, w-slices inner, as the reference counts them)."""
  labels = np.zeros((h, w), np.int64)
  for r in range(h):
    for c in range(w):
      labels[r, c] = 3 * _axis_region(r, h, m, s) + _axis_region(c, w, m, s)
  return labels


def shift_attention_mask(h: int, w: int, m: int, s: int) -> np.ndarray:
  """`[nW, N, N]`: 0 between tokens of one region, -100 otherwise."""
  labels = shift_labels(h, w, m, s)
  gh, gw = h // m, w // m
  mask = np.zeros((gh * gw, m * m, m * m))
  for wi in range(gh):
    for wj in range(gw):
      for i in range(m * m):
        ri, ci = divmod(i, m)
        li = labels[wi * m + ri, wj * m + ci]
        for j in range(m * m):
          rj, cj = divmod(j, m)
          lj = labels[wi * m + rj, wj * m + cj]
          mask[wi * gw + wj, i, j] = 0.0 if li == lj else MASK_VALUE
  return mask


def cyclic_shift(x: np.ndarray, s: int) -> np.ndarray:
  """`[B, H, W, C]` rolled by `-s` on H and W: `out[r, c] = x[r+s, c+s]`
  (indices mod H, W); a negative `s` undoes it."""
  _, h, w, _ = x.shape
  out = np.zeros_like(x)
  for r in range(h):
    for c in range(w):
      out[:, r, c] = x[:, (r + s) % h, (c + s) % w]
  return out


def stage_window(h: int, w: int, m: int, shift: int) -> tuple[int, int]:
  """The reference's rule: a stage no larger than M uses one window of side
  `min(H, W)` and no shift."""
  if min(h, w) <= m:
    return min(h, w), 0
  return m, shift


# ------------------------------------------------------------ layers ---

def layer_norm(x: np.ndarray, p: Mapping[str, Any], eps: float = 1e-5
               ) -> np.ndarray:
  x = f64(x)
  mean = x.mean(-1, keepdims=True)
  var = ((x - mean) ** 2).mean(-1, keepdims=True)
  return (x - mean) / np.sqrt(var + eps) * f64(p["scale"]) + f64(p["bias"])


def dense(x: np.ndarray, p: Mapping[str, Any]) -> np.ndarray:
  y = f64(x) @ f64(p["kernel"])
  if "bias" in p:
    y = y + f64(p["bias"])
  return y


def gelu_exact(x):
  return 0.5 * x * (1.0 + scipy.special.erf(x / math.sqrt(2.0)))


def gelu_tanh(x):
  return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi)
                                  * (x + 0.044715 * x ** 3)))


ACTIVATIONS = {"gelu_exact": gelu_exact, "gelu": gelu_tanh,
               "relu": lambda x: np.maximum(x, 0.0)}


def log_spaced_offsets(m: int) -> np.ndarray:
  """`[(2M-1)^2, 2]`: the offsets `(dh, dw)` (dh outer, dw inner), scaled by
  `8 / (M - 1)` and mapped by `sign(t) log2(|t| + 1) / log2(8)` (a 1 x 1
  window: the single offset 0)."""
  rows = []
  for dh in range(-(m - 1), m):
    for dw in range(-(m - 1), m):
      row = []
      for d in (dh, dw):
        t = d / (m - 1) * 8.0 if m > 1 else 0.0
        sign = (t > 0) - (t < 0)
        row.append(sign * math.log2(abs(t) + 1.0) / math.log2(8.0))
      rows.append(row)
  return np.array(rows, np.float64)


def log_cpb_table(p: Mapping[str, Any], m: int) -> np.ndarray:
  """`[(2M-1)^2, h]`: Dense(512) -> ReLU -> Dense(h, no bias) of the
  log-spaced offsets (`p`: the `Attention` params, `cpb_mlp_0/1`)."""
  hidden = np.maximum(dense(log_spaced_offsets(m), p["cpb_mlp_0"]), 0.0)
  return dense(hidden, p["cpb_mlp_1"])


def position_table(p: Mapping[str, Any], m: int, kind: str) -> np.ndarray:
  if kind == "table":
    return f64(p["relative_position_bias_table"])
  return log_cpb_table(p, m)


def softmax(z: np.ndarray) -> np.ndarray:
  z = z - z.max(-1, keepdims=True)
  e = np.exp(z)
  return e / e.sum(-1, keepdims=True)


def window_attention(p: Mapping[str, Any], xw: np.ndarray, num_heads: int,
                     m: int, mask: Optional[np.ndarray], kind: str = "table"
                     ) -> np.ndarray:
  """One window's attention, head by head: xw `[N, C]`, mask `[N, N]` or
  None; `p` the `Attention` params."""
  n, c = xw.shape
  d = c // num_heads
  qkv = dense(xw, p["qkv"])                       # [N, 3C] = [q | k | v]
  table = position_table(p, m, kind)
  index = relative_position_index(m)
  out = np.zeros((n, c))
  for head in range(num_heads):
    q = qkv[:, head * d:(head + 1) * d] * d ** -0.5
    k = qkv[:, c + head * d:c + (head + 1) * d]
    v = qkv[:, 2 * c + head * d:2 * c + (head + 1) * d]
    logits = q @ k.T
    for i in range(n):
      for j in range(n):
        logits[i, j] += table[index[i, j], head]
        if mask is not None:
          logits[i, j] += mask[i, j]
    out[:, head * d:(head + 1) * d] = softmax(logits) @ v
  return dense(out, p["proj"])


def swin_block(p: Mapping[str, Any], x: np.ndarray, grid: tuple[int, int],
               window: int, shift: int, num_heads: int, *,
               kind: str = "table", activation: str = "gelu_exact",
               eps: float = 1e-5, use_mask: bool = True,
               branch_scales: Optional[Sequence[tuple[float, float]]] = None
               ) -> np.ndarray:
  """A dense Swin block on `x [B, H*W, C]` (row-major tokens).

  `branch_scales[b] = (a, m)` multiplies image b's attention and MLP
  branches (stochastic depth: 0 or 1 / keep); None: both 1.
  `use_mask=False` drops the shifted-window mask (a deliberately wrong
  variant, to show a test can tell the difference).
  """
  x = f64(x)
  b, t, c = x.shape
  h, w = grid
  m, s = window, shift
  y = layer_norm(x, p["LayerNorm_0"], eps).reshape(b, h, w, c)
  if s:
    y = cyclic_shift(y, s)
  windows = window_partition(y, m)
  mask = shift_attention_mask(h, w, m, s) if (s and use_mask) else None
  nw = (h // m) * (w // m)
  out = np.stack([
      window_attention(p["Attention"], windows[k], num_heads, m,
                       None if mask is None else mask[k % nw], kind)
      for k in range(windows.shape[0])])
  y = window_reverse(out, m, h, w)
  if s:
    y = cyclic_shift(y, -s)
  scales = branch_scales or [(1.0, 1.0)] * b
  attn_scale = np.array([a for a, _ in scales])[:, None, None]
  mlp_scale = np.array([s2 for _, s2 in scales])[:, None, None]
  x = x + attn_scale * y.reshape(b, t, c)
  z = layer_norm(x, p["LayerNorm_1"], eps)
  z = dense(ACTIVATIONS[activation](dense(z, p["Mlp"]["Dense_0"])),
            p["Mlp"]["Dense_1"])
  return x + mlp_scale * z


def patch_merging(p: Mapping[str, Any], x: np.ndarray, grid: tuple[int, int],
                  eps: float = 1e-5) -> np.ndarray:
  """`[B, H*W, C]` -> `[B, H/2 * W/2, 2C]`: per 2 x 2 neighbourhood
  `[x(2i, 2j), x(2i+1, 2j), x(2i, 2j+1), x(2i+1, 2j+1)]`, LayerNorm(4C),
  Dense(2C, no bias)."""
  x = f64(x)
  b, _, c = x.shape
  h, w = grid
  x = x.reshape(b, h, w, c)
  out = np.zeros((b, (h // 2) * (w // 2), 4 * c))
  for i in range(h // 2):
    for j in range(w // 2):
      out[:, i * (w // 2) + j] = np.concatenate(
          [x[:, 2 * i, 2 * j], x[:, 2 * i + 1, 2 * j],
           x[:, 2 * i, 2 * j + 1], x[:, 2 * i + 1, 2 * j + 1]], axis=-1)
  return dense(layer_norm(out, p["norm"], eps), p["reduction"])


def patch_embedding(p: Mapping[str, Any], images: np.ndarray,
                    patch: tuple[int, int]) -> np.ndarray:
  """`[B, H, W, Cin]` -> `[B, (H/ph) * (W/pw), C]`, patch by patch."""
  images = f64(images)
  kernel, bias = f64(p["kernel"]), f64(p["bias"])
  b, height, width, _ = images.shape
  ph, pw = patch
  gh, gw = height // ph, width // pw
  out = np.zeros((b, gh * gw, kernel.shape[-1]))
  for i in range(gh):
    for j in range(gw):
      piece = images[:, i * ph:(i + 1) * ph, j * pw:(j + 1) * pw]
      out[:, i * gw + j] = np.einsum("bxyc,xyco->bo", piece, kernel) + bias
  return out


def swin_forward(params: Mapping[str, Any], images: np.ndarray, *,
                 patch_size: tuple[int, int], embed_dim: int,
                 depths: Sequence[int], num_heads: Sequence[int],
                 window_size: int, relative_position_bias: str = "table",
                 patch_norm: bool = True, mlp_activation: str = "gelu_exact",
                 eps: float = 1e-5) -> np.ndarray:
  """Logits `[B, classes]` of a dense Swin (`params`: `variables["params"]`),
  deterministic (no dropout, no stochastic depth)."""
  x = patch_embedding(params["embedding"], images, patch_size)
  if patch_norm:
    x = layer_norm(x, params["embedding_norm"], eps)
  grid = (images.shape[1] // patch_size[0], images.shape[2] // patch_size[1])
  block = 0
  for s, (depth, heads) in enumerate(zip(depths, num_heads)):
    if s:
      x = patch_merging(params[f"merging_{s}"], x, grid, eps)
      grid = (grid[0] // 2, grid[1] // 2)
    window, shift = stage_window(*grid, window_size, window_size // 2)
    for i in range(depth):
      x = swin_block(params[f"encoderblock_{block}"], x, grid, window,
                     shift if i % 2 == 1 else 0, heads,
                     kind=relative_position_bias, activation=mlp_activation,
                     eps=eps)
      block += 1
  x = layer_norm(x, params["encoder_norm"], eps)
  return dense(x.mean(axis=1), params["head"])


def drop_path_rates(rate: float, depths: Sequence[int]) -> list[float]:
  """Block i of n: `rate * i / (n - 1)` (torch.linspace(0, rate, n))."""
  n = sum(depths)
  return [rate * i / (n - 1) if n > 1 else 0.0 for i in range(n)]
