"""The resampling kernels behind the `resize` ops (TF's definitions, numpy).

`resample(image, h, w, method, antialias)`: uint8 `[H, W, C]` -> uint8
`[h, w, C]`; `vmoe_ext.data.pp.geometry.resize_image` documents the
semantics and validates the arguments.
"""

from __future__ import annotations

import numpy as np

from vmoe_ext.data.preprocessing import resize_weights

_F32 = np.float32


def _bilinear(image: np.ndarray, out_h: int, out_w: int) -> np.ndarray:
  """TF's `resize_bilinear(half_pixel_centers=True)`, float32."""

  def taps(n_in: int, n_out: int):
    scale = _F32(n_in) / _F32(n_out)
    pos = (np.arange(n_out, dtype=_F32) + _F32(0.5)) * scale - _F32(0.5)
    floor = np.floor(pos)
    lower = np.maximum(floor, 0).astype(np.intp)
    upper = np.minimum(np.ceil(pos), n_in - 1).astype(np.intp)
    return lower, upper, (pos - floor).astype(_F32)

  ly, uy, fy = taps(image.shape[0], out_h)
  lx, ux, fx = taps(image.shape[1], out_w)
  x = image.astype(_F32)
  fx = fx[None, :, None]

  def along_x(rows: np.ndarray) -> np.ndarray:
    left, right = rows[:, lx], rows[:, ux]
    return left + (right - left) * fx

  top, bottom = along_x(x[ly]), along_x(x[uy])
  return top + (bottom - top) * fy[:, None, None]


def _area_weights(n_in: int, n_out: int) -> np.ndarray:
  """`[n_out, n_in]`: the share of each input pixel in output pixel o's box
  `[o * s, (o + 1) * s)`, s = n_in / n_out (TF's `resize_area`)."""
  s = n_in / n_out
  starts = np.arange(n_out)[:, None] * s
  pix = np.arange(n_in)[None, :]
  overlap = (np.minimum(starts + s, pix + 1) - np.maximum(starts, pix))
  return np.maximum(overlap, 0.0) / s


def _resample_axis(x: np.ndarray, weights: np.ndarray, axis: int
                   ) -> np.ndarray:
  """`out[o] = sum_i weights[o, i] * x[i]` along `axis`, using only each
  row's band of non-zero weights (a few taps), in float64."""
  n_out, n_in = weights.shape
  nonzero = weights != 0
  start = np.argmax(nonzero, axis=1)
  stop = n_in - np.argmax(nonzero[:, ::-1], axis=1)
  taps = start[:, None] + np.arange(int((stop - start).max()))[None, :]
  valid = taps < stop[:, None]
  taps = np.minimum(taps, n_in - 1)
  w = np.where(valid, np.take_along_axis(weights, taps, axis=1), 0.0)
  shape = [1] * x.ndim
  shape[axis] = n_out
  out = np.zeros(x.shape[:axis] + (n_out,) + x.shape[axis + 1:])
  for k in range(taps.shape[1]):
    out += w[:, k].reshape(shape) * np.take(x, taps[:, k], axis=axis)
  return out


def _to_uint8(x: np.ndarray, eps: float = 0.0) -> np.ndarray:
  """big_vision's `cast(clip(x, 0, 255), uint8)`: clip, then truncate."""
  return np.floor(np.clip(x + eps, 0, 255)).astype(np.uint8)


def resample(image: np.ndarray, out_h: int, out_w: int, method: str,
             antialias: bool) -> np.ndarray:
  """uint8 `[H, W, C]` -> uint8 `[out_h, out_w, C]` (see `resize_image`)."""
  if method == "bilinear" and not antialias:
    return _to_uint8(_bilinear(image, out_h, out_w))
  if method == "area":
    wh = _area_weights(image.shape[0], out_h)
    ww = _area_weights(image.shape[1], out_w)
  else:
    wh = resize_weights(image.shape[0], out_h)
    ww = resize_weights(image.shape[1], out_w)
  out = _resample_axis(image.astype(np.float64), wh, axis=0)
  return _to_uint8(_resample_axis(out, ww, axis=1), eps=1e-6)


__all__ = ["resample"]
