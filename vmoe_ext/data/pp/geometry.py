"""Per-example geometry ops: decode, Inception crop, flip, resize, crops, range.

Each op is built by a factory from the (validated) arguments of a
preprocessing string and is a plain function `op(image, rng) -> image` on a
numpy array `[H, W, C]` (uint8 unless stated), using numpy and PIL only, so it
runs in data-loader worker processes. The semantics are big_vision's
(`big_vision/pp/ops_image.py`), which vmoe's `vmoe/data/pp_ops.py` shares:

- `decode(channels=3)`: encoded bytes -> uint8 `[H, W, 3]` via PIL's
  `convert("RGB")` (grey replicated, alpha dropped, as TF's
  `decode_image(channels=3)`); arrays pass through, converted the same way.
  TF's JPEG decoder defaults to libjpeg's fast integer DCT, PIL uses the
  accurate one (big_vision's `decode(precise=True)`): pixels can differ by a
  few levels.
- `inception_crop(size=None, area_min=5, area_max=100, ratio_min=0.75,
  ratio_max=1.33, method="bilinear", antialias=False)`: a box drawn by TF's
  `sample_distorted_bounding_box` rules (`sample_distorted_box` below) with
  `area_range = (area_min/100, area_max/100)`, `min_object_covered=0`, no
  boxes, then resized to `size x size`. The aspect range is TF's default
  (0.75, 1.33) -- not 4/3 -- as in big_vision.
- `decode_jpeg_and_inception_crop(...)`: exactly `decode` then
  `inception_crop` (TF decodes only the window; the pixels are the same).
- `flip_lr()`: mirrors left-right when a uniform draw is < 0.5
  (`tf.image.random_flip_left_right`).
- `resize(size, method="bilinear", antialias=False)`: see `resize_image`.
- `resize_small(size, method="area", antialias=False)`: the shorter side to
  `size`, aspect kept: with `f = size / min(H, W)` (float32), the new sides
  are `round(H * f)`, `round(W * f)`, rounding half to even (`tf.round`).
- `central_crop(crop_size=None)`: offsets `((H - h) // 2, (W - w) // 2)`
  (floor: an odd margin leaves the extra pixel at the bottom/right); no size
  gives the largest central square.
- `value_range(vmin, vmax, in_min=0, in_max=255, clip_values=False)`:
  `vmin + (x - in_min) / (in_max - in_min) * (vmax - vmin)`, float32 (the
  only op whose output is float).

Random ops: `inception_crop`, `decode_jpeg_and_inception_crop`, `flip_lr`.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from PIL import Image

from vmoe_ext.data.pp.resample import resample
from vmoe_ext.errors import check, require

Op = Callable[[Any, np.random.Generator], np.ndarray]
METHODS = ("bilinear", "area")
_F32 = np.float32


# --------------------------------------------------------------------------
# Argument checks (raise ConfigError on the argument's name; the parser
# prefixes the preprocessing field and the op).


def _size2(size: Any, name: str) -> tuple[int, int]:
  pair = (size, size) if isinstance(size, (int, np.integer)) else size
  ok = (isinstance(pair, (tuple, list)) and len(pair) == 2 and all(
      isinstance(s, (int, np.integer)) and not isinstance(s, bool) and s > 0
      for s in pair))
  require(ok, name, f"must be a positive integer or [height, width], "
          f"got {size!r}")
  return int(pair[0]), int(pair[1])


def _number(value: Any, name: str) -> float:
  require(isinstance(value, (int, float, np.number))
          and not isinstance(value, bool) and np.isfinite(value), name,
          f"must be a finite number, got {value!r}")
  return float(value)


def _method(method: Any, antialias: Any) -> None:
  require(method in METHODS, "method",
          f"must be one of {list(METHODS)}, got {method!r}")
  require(isinstance(antialias, bool), "antialias",
          f"must be True or False, got {antialias!r}")


def _decoded(image: Any, op: str, uint8: bool = True) -> np.ndarray:
  check(isinstance(image, np.ndarray) and image.ndim == 3, "image",
        f"{op} needs a decoded [H, W, C] image array, got "
        f"{type(image).__name__} (start the pipeline with decode)")
  check(image.dtype == np.uint8 or not uint8, "image",
        f"{op} needs a uint8 image, got {image.dtype} (value_range must "
        "come last)")
  return image


# --------------------------------------------------------------------------
# Functions on arrays.


def decode_image(data: Any, channels: int = 3) -> np.ndarray:
  """Encoded bytes (or an array) -> uint8 `[H, W, channels]`."""
  if isinstance(data, np.ndarray):
    check(data.dtype == np.uint8 and (data.ndim == 2 or (
        data.ndim == 3 and data.shape[-1] in (1, 3, 4))), "image",
          f"decode needs bytes or a uint8 [H, W(, 1|3|4)] array, got "
          f"{data.dtype} {data.shape}")
    if data.ndim == 3 and data.shape[-1] == channels:
      return data
    img = Image.fromarray(data[..., 0] if data.ndim == 3 else data)
  else:
    check(isinstance(data, (bytes, bytearray, memoryview)), "image",
          f"decode needs encoded bytes or an array, got "
          f"{type(data).__name__}")
    img = Image.open(io.BytesIO(bytes(data)))
  out = np.asarray(img.convert("RGB" if channels == 3 else "L"))
  return out if out.ndim == 3 else out[:, :, None]


def _lrint(x: Any) -> int:
  """C's lrintf: round half to even."""
  return int(np.rint(x))


def _random_crop(width: int, height: int, min_rel: float, max_rel: float,
                 aspect: np.float32, rng: np.random.Generator
                 ) -> tuple[int, int, int, int] | None:
  """One attempt of TF's `GenerateRandomCrop`; (y, x, h, w) or None."""
  min_area = _F32(_F32(min_rel) * _F32(width)) * _F32(height)
  max_area = _F32(_F32(max_rel) * _F32(width)) * _F32(height)
  h = _lrint(np.sqrt(_F32(min_area / aspect)))
  max_h = _lrint(np.sqrt(_F32(max_area / aspect)))
  if _lrint(_F32(max_h) * aspect) > width:
    # The largest height whose rounded width still fits.
    max_h = int((width + 0.5 - float(_F32(1e-7))) / float(aspect))
    if _lrint(_F32(max_h) * aspect) > width:
      max_h -= 1
  max_h = min(max_h, height)
  h = min(h, max_h)
  if h < max_h:
    h += int(rng.integers(0, max_h - h + 1))  # Closed range [h, max_h].
  w = _lrint(_F32(h) * aspect)
  area = _F32(w * h)
  if area < min_area:  # Rounding made it too small: one row taller.
    h += 1
    w = _lrint(_F32(h) * aspect)
    area = _F32(w * h)
  if area > max_area:  # Too large: one row shorter.
    h -= 1
    w = _lrint(_F32(h) * aspect)
    area = _F32(w * h)
  if (area < min_area or area > max_area or w > width or h > height
      or w <= 0 or h <= 0):
    return None
  # TF's Uniform(n) draws from [0, n): the last offset is never drawn.
  y = int(rng.integers(0, height - h)) if h < height else 0
  x = int(rng.integers(0, width - w)) if w < width else 0
  return y, x, h, w


def sample_distorted_box(height: int, width: int, rng: np.random.Generator,
                         area_range: Sequence[float] = (0.05, 1.0),
                         aspect_ratio_range: Sequence[float] = (0.75, 1.33),
                         max_attempts: int = 100) -> tuple[int, int, int, int]:
  """TF's `sample_distorted_bounding_box` with no boxes: `(y, x, h, w)`.

  Each attempt draws an aspect ratio `w / h` uniformly (float32) from
  `aspect_ratio_range`, then an integer height uniformly from
  `[round(sqrt(min_area / ar)), max_height]` (max_height: the largest height
  whose area is <= the maximum and whose width `round(h * ar)` fits, capped
  at the image height), `w = round(h * ar)`, nudges `h` by one row if
  rounding left the area outside `area_range * H * W`, and rejects the
  attempt if it still is (or does not fit). Offsets are uniform in
  `[0, H - h)` and `[0, W - w)` -- TF never draws the last offset, so a crop
  smaller than the image never touches its bottom/right edge. After
  `max_attempts` rejections the whole image is returned. The draws come
  from `rng` (TF's Philox stream cannot be reproduced); everything else,
  float32 arithmetic and half-to-even rounding included, follows
  `sample_distorted_bounding_box_op.cc`.
  """
  lo, hi = (_F32(r) for r in aspect_ratio_range)
  for _ in range(max_attempts):
    aspect = _F32(_F32(rng.random()) * (hi - lo) + lo)
    box = _random_crop(width, height, area_range[0], area_range[1], aspect,
                       rng)
    if box is not None:
      return box
  return 0, 0, height, width


def resize_image(image: np.ndarray, size: Sequence[int],
                 method: str = "bilinear", antialias: bool = False
                 ) -> np.ndarray:
  """Resizes uint8 `[H, W, C]` to `[h, w, C]` uint8, as `tf.image.resize`.

  - bilinear, antialias=False (big_vision's and vmoe's default): TF's
    half-pixel-centre bilinear interpolation (two taps per axis, edge
    clamped, no low-pass filter when shrinking), in float32 with TF's order
    of operations (along x, then y).
  - bilinear, antialias=True: TF's antialiased bilinear (a triangle kernel
    widened by the shrink factor, rows normalised), the definition of
    `vmoe_ext.data.preprocessing.resize_weights`. PIL's `BILINEAR` is the
    same filter but rounds to the nearest integer, so it is up to 1 above.
  - area: TF's `resize_area` (each output pixel the exact average over the
    input area it covers); `antialias` is ignored, as in TF.

  The float result is clipped to [0, 255] and truncated to uint8, as
  big_vision's `tf.cast` does (so values are on average 0.5 below the
  rounded ones). Area and antialiased bilinear are computed in float64 and
  truncated after a 1e-6 nudge, so that an exact average such as 100 is not
  truncated to 99 by round-off; TF's float32 may differ by 1 on rare pixels.
  """
  _method(method, antialias)
  out_h, out_w = _size2(tuple(size), "size")
  if (out_h, out_w) == image.shape[:2]:
    return image.copy()
  return resample(image, out_h, out_w, method, antialias)


def resize_small_shape(height: int, width: int, size: int) -> tuple[int, int]:
  """`(round(H * f), round(W * f))`, f = size / min(H, W) in float32."""
  f = _F32(size) / _F32(min(height, width))
  return _lrint(_F32(height) * f), _lrint(_F32(width) * f)


def central_crop_box(height: int, width: int, crop: tuple[int, int] | None
                     ) -> tuple[int, int, int, int]:
  """`(dy, dx, h, w)` of big_vision's central crop (floor offsets)."""
  h, w = crop if crop else (min(height, width),) * 2
  check(h <= height and w <= width, "image",
        f"central_crop({h}, {w}) is larger than the image "
        f"({height}x{width}); resize it first")
  return (height - h) // 2, (width - w) // 2, h, w


# --------------------------------------------------------------------------
# Op factories (registered by name in vmoe_ext.data.pp).


def decode(channels: int = 3) -> Op:
  """Decodes JPEG/PNG/... bytes with PIL; arrays pass through."""
  require(channels in (1, 3), "channels",
          f"must be 1 or 3, got {channels!r}")
  return lambda image, rng: decode_image(image, channels)


def _crop_args(size, area_min, area_max, ratio_min, ratio_max, method,
               antialias) -> tuple[tuple[int, int] | None, tuple, tuple]:
  out = None if size is None else _size2(size, "size")
  area = (_number(area_min, "area_min"), _number(area_max, "area_max"))
  require(0 < area[0] <= area[1] <= 100, "area_min",
          f"need 0 < area_min <= area_max <= 100 (percent of the image), got "
          f"{area_min!r}, {area_max!r}")
  ratio = (_number(ratio_min, "ratio_min"), _number(ratio_max, "ratio_max"))
  require(0 < ratio[0] <= ratio[1], "ratio_min",
          f"need 0 < ratio_min <= ratio_max, got {ratio_min!r}, "
          f"{ratio_max!r}")
  _method(method, antialias)
  return out, (area[0] / 100, area[1] / 100), ratio


def inception_crop(size: Any = None, area_min: float = 5,
                   area_max: float = 100, ratio_min: float = 0.75,
                   ratio_max: float = 1.33, method: str = "bilinear",
                   antialias: bool = False) -> Op:
  """Random Inception-style crop (see `sample_distorted_box`), resized."""
  out, area, ratio = _crop_args(size, area_min, area_max, ratio_min,
                                ratio_max, method, antialias)

  def op(image, rng):
    image = _decoded(image, "inception_crop")
    y, x, h, w = sample_distorted_box(image.shape[0], image.shape[1], rng,
                                      area, ratio)
    crop = image[y:y + h, x:x + w]
    if out is None:
      return np.ascontiguousarray(crop)
    return resize_image(crop, out, method, antialias)

  return op


def decode_jpeg_and_inception_crop(size: Any = None, area_min: float = 5,
                                   area_max: float = 100,
                                   ratio_min: float = 0.75,
                                   ratio_max: float = 1.33,
                                   method: str = "bilinear",
                                   antialias: bool = False) -> Op:
  """`decode` then `inception_crop` with the same arguments and draws."""
  crop = inception_crop(size, area_min, area_max, ratio_min, ratio_max,
                        method, antialias)
  return lambda image, rng: crop(decode_image(image), rng)


def flip_lr() -> Op:
  """Mirrors left-right with probability 1/2 (one uniform draw)."""

  def op(image, rng):
    image = _decoded(image, "flip_lr", uint8=False)
    if rng.random() < 0.5:
      return np.ascontiguousarray(image[:, ::-1])
    return image

  return op


def resize(size: Any, method: str = "bilinear", antialias: bool = False
           ) -> Op:
  """Resizes to `size` (int: square; [h, w])."""
  out = _size2(size, "size")
  _method(method, antialias)
  return lambda image, rng: resize_image(_decoded(image, "resize"), out,
                                         method, antialias)


def resize_small(size: int, method: str = "area", antialias: bool = False
                 ) -> Op:
  """Resizes the shorter side to `size`, keeping the aspect ratio."""
  require(isinstance(size, (int, np.integer)) and not isinstance(size, bool)
          and size > 0, "size",
          f"must be one positive integer (the shorter side), got {size!r}")
  side = int(size)
  _method(method, antialias)

  def op(image, rng):
    image = _decoded(image, "resize_small")
    shape = resize_small_shape(image.shape[0], image.shape[1], side)
    return resize_image(image, shape, method, antialias)

  return op


def central_crop(crop_size: Any = None) -> Op:
  """Central crop of `crop_size` (int or [h, w]; None: largest square)."""
  crop = None if crop_size is None else _size2(crop_size, "crop_size")

  def op(image, rng):
    image = _decoded(image, "central_crop", uint8=False)
    dy, dx, h, w = central_crop_box(image.shape[0], image.shape[1], crop)
    return np.ascontiguousarray(image[dy:dy + h, dx:dx + w])

  return op


def value_range(vmin: float, vmax: float, in_min: Any = 0,
                in_max: Any = 255.0, clip_values: bool = False) -> Op:
  """Maps [in_min, in_max] (scalars or one per channel) to [vmin, vmax]."""
  lo, hi = _number(vmin, "vmin"), _number(vmax, "vmax")
  in_lo = np.asarray(in_min, _F32)
  in_hi = np.asarray(in_max, _F32)
  require(in_lo.ndim <= 1 and in_hi.ndim <= 1
          and np.all(np.isfinite(in_lo)) and np.all(np.isfinite(in_hi))
          and np.all(in_hi != in_lo), "in_min",
          f"in_min and in_max must be finite scalars or per-channel lists "
          f"with in_min != in_max, got {in_min!r}, {in_max!r}")
  require(isinstance(clip_values, bool), "clip_values",
          f"must be True or False, got {clip_values!r}")

  def op(image, rng):
    image = _decoded(image, "value_range", uint8=False)
    x = (image.astype(_F32) - in_lo) / (in_hi - in_lo)
    x = _F32(lo) + x * _F32(hi - lo)
    if clip_values:
      x = np.clip(x, min(lo, hi), max(lo, hi))
    return x.astype(_F32)

  return op
