"""RandAugment on uint8 `[H, W, 3]` arrays, as big_vision and vmoe run it.

`randaug(num_layers, magnitude)` follows `distort_image_with_randaugment` of
big_vision's `big_vision/pp/autoaugment.py` (a fork of the TPU EfficientNet
`autoaugment.py` that vmoe's `randaug` op calls): each of the `num_layers`
layers picks one of the 16 ops in `OPS` uniformly and *always* applies it
(the per-op probability drawn there is never used by RandAugment) at
`level = magnitude`, with `_MAX_LEVEL = 10`. Magnitudes above 10 (vmoe's
medium 15 and strong 20) extrapolate the same linear maps. The level ->
argument maps (`level_args`), with m = level / 10:

  Rotate       30 m degrees, sign random      AutoContrast, Equalize, Invert
  ShearX/Y     0.3 m, sign random               take no argument
  TranslateX/Y 100 m pixels, sign random      Posterize    int(4 m) bits
  Cutout       int(40 m): a 2x that square    Solarize     int(256 m)
  SolarizeAdd  int(110 m), below 128          Color, Contrast, Brightness,
                                              Sharpness    1.8 m + 0.1

Fill value for pixels a geometric op uncovers and for Cutout: 128.

The ops reproduce TF's arithmetic, quirks included, because that is what the
papers trained with:
- `blend` (Color, Contrast, Brightness, Sharpness) is float32
  `a + f * (b - a)`, clipped when extrapolating, then *truncated* to uint8.
- The grey image of Color/Contrast is `tf.image.rgb_to_grayscale`:
  `trunc(255.5 * (0.2989 r + 0.587 g + 0.114 b) / 255)`.
- Contrast blends towards `min(H * W / 256, 255)`, not the mean intensity:
  TF sums the 256-bin histogram (the pixel count) and divides by 256.
- Solarize's threshold is converted to uint8 by TF, i.e. taken modulo 256
  (big_vision issue #110): 256 (magnitude 10) and 512 (20) invert every
  pixel, 384 (15) solarizes at 128.
- Posterize shifts by `8 - bits` with TF's shift clamped to [0, 7]: 0 bits
  (magnitude 0) keeps the top bit, 8 bits (magnitude 20) is the identity.
- Geometric ops are TF's projective transform with nearest-neighbour
  sampling in pixel-index coordinates: output (x, y) reads input
  `round(A (x, y) + t)` (half away from zero), 128 outside. Rotation is
  about ((W-1)/2, (H-1)/2), counter-clockwise for positive degrees, as
  `PIL.Image.rotate`; ShearX reads x + level * y, TranslateX reads
  x + pixels (the content moves left). Translations are absolute pixels,
  whatever the image size.
- Sharpness blurs with PIL's SMOOTH kernel [[1,1,1],[1,5,1],[1,1,1]]/13
  (valid positions, truncated; the 1-pixel border keeps the original).

Magnitude 0 is *not* the identity: Rotate, Shear, Translate, Cutout and
SolarizeAdd do nothing, but Posterize keeps one bit, Solarize inverts, the
four enhance ops blend with factor 0.1, and AutoContrast, Equalize and Invert
ignore the level.

Random draws, per layer, from the `rng` given: the op index
(`integers(16)`), then for a signed op one uniform (negative if < 0.5), for
Cutout the centre row and column (`integers(H)`, `integers(W)`).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from vmoe_ext.errors import check, require

MAX_LEVEL = 10.0
CUTOUT_CONST = 40
TRANSLATE_CONST = 100
REPLACE = 128
OPS = ("AutoContrast", "Equalize", "Invert", "Rotate", "Posterize",
       "Solarize", "Color", "Contrast", "Brightness", "Sharpness", "ShearX",
       "ShearY", "TranslateX", "TranslateY", "Cutout", "SolarizeAdd")
SIGNED = frozenset({"Rotate", "ShearX", "ShearY", "TranslateX", "TranslateY"})
_F32 = np.float32


# --------------------------------------------------------------------------
# Colour ops.


def blend(image1: np.ndarray, image2: np.ndarray, factor: float
          ) -> np.ndarray:
  """`image1 + factor * (image2 - image1)` in float32, truncated to uint8
  (clipped to [0, 255] first unless 0 < factor < 1)."""
  if factor == 0.0:
    return np.array(image1, np.uint8)
  if factor == 1.0:
    return np.array(image2, np.uint8)
  a = np.asarray(image1).astype(_F32)
  temp = a + _F32(factor) * (np.asarray(image2).astype(_F32) - a)
  if not 0.0 < factor < 1.0:
    temp = np.clip(temp, 0.0, 255.0)
  return temp.astype(np.uint8)


def grayscale(image: np.ndarray) -> np.ndarray:
  """`tf.image.rgb_to_grayscale` of uint8 `[H, W, 3]`: uint8 `[H, W, 1]`."""
  x = image.astype(_F32) * _F32(1.0 / 255)
  gray = x @ np.array([0.2989, 0.5870, 0.1140], _F32)
  return (gray * _F32(255.5)).astype(np.uint8)[:, :, None]


def color(image: np.ndarray, factor: float) -> np.ndarray:
  gray = np.broadcast_to(grayscale(image), image.shape)
  return blend(gray, image, factor)


def contrast(image: np.ndarray, factor: float) -> np.ndarray:
  """Blends towards the constant `min(H * W / 256, 255)` (TF's quirk)."""
  mean = min(_F32(image.shape[0] * image.shape[1]) / _F32(256.0), 255.0)
  return blend(np.full(image.shape, int(mean), np.uint8), image, factor)


def brightness(image: np.ndarray, factor: float) -> np.ndarray:
  return blend(np.zeros_like(image), image, factor)


def sharpness(image: np.ndarray, factor: float) -> np.ndarray:
  x = image.astype(_F32)
  h, w = image.shape[:2]
  degenerate = image.copy()
  if h >= 3 and w >= 3:
    # TF's float32 kernel entries (1/13, 5/13), summed in row-major order.
    kernel = np.array([[1, 1, 1], [1, 5, 1], [1, 1, 1]], _F32) / _F32(13)
    acc = np.zeros((h - 2, w - 2, image.shape[-1]), _F32)
    for dy in range(3):
      for dx in range(3):
        acc += x[dy:h - 2 + dy, dx:w - 2 + dx] * kernel[dy, dx]
    degenerate[1:-1, 1:-1] = np.clip(acc, 0.0, 255.0).astype(np.uint8)
  return blend(degenerate, image, factor)


def posterize(image: np.ndarray, bits: int) -> np.ndarray:
  shift = np.uint8(min(max(8 - int(bits), 0), 7))
  return (image >> shift) << shift


def solarize(image: np.ndarray, threshold: int) -> np.ndarray:
  """Inverts pixels >= threshold (taken modulo 256, as TF's uint8 cast)."""
  t = int(threshold) % 256
  return np.where(image < t, image, 255 - image).astype(np.uint8)


def solarize_add(image: np.ndarray, addition: int, threshold: int = 128
                 ) -> np.ndarray:
  added = np.clip(image.astype(np.int64) + int(addition), 0, 255)
  return np.where(image < threshold, added, image).astype(np.uint8)


def autocontrast(image: np.ndarray) -> np.ndarray:
  """Per channel, maps [min, max] to [0, 255] (float32, truncated)."""
  out = image.copy()
  for c in range(image.shape[-1]):
    ch = image[..., c]
    lo, hi = _F32(ch.min()), _F32(ch.max())
    if hi > lo:
      scale = _F32(255.0) / (hi - lo)
      offset = -lo * scale
      vals = ch.astype(_F32) * scale + offset
      out[..., c] = np.clip(vals, 0.0, 255.0).astype(np.uint8)
  return out


def equalize(image: np.ndarray) -> np.ndarray:
  """Per-channel histogram equalisation, PIL's `ImageOps.equalize` rule."""
  out = image.copy()
  for c in range(image.shape[-1]):
    ch = image[..., c]
    hist = np.bincount(ch.reshape(-1), minlength=256)
    nonzero = hist[hist > 0]
    step = (int(nonzero.sum()) - int(nonzero[-1])) // 255
    if step == 0:
      continue
    lut = (np.cumsum(hist) + step // 2) // step
    lut = np.clip(np.concatenate([[0], lut[:-1]]), 0, 255)
    out[..., c] = lut[ch].astype(np.uint8)
  return out


def invert(image: np.ndarray) -> np.ndarray:
  return (255 - image).astype(np.uint8)


# --------------------------------------------------------------------------
# Geometric ops.


def affine(image: np.ndarray, matrix: tuple[float, ...],
           replace: int = REPLACE) -> np.ndarray:
  """Output (x, y) reads input `round(a x + b y + c, d x + e y + f)`.

  `matrix = (a, b, c, d, e, f)` in pixel-index coordinates; nearest
  neighbour, rounding half away from zero; `replace` where the read pixel
  is outside the image (TF's `ImageProjectiveTransform` with
  `wrap`/`unwrap`).
  """
  a, b, c, d, e, f = (_F32(v) for v in matrix)
  h, w = image.shape[:2]
  ys, xs = np.meshgrid(np.arange(h, dtype=_F32), np.arange(w, dtype=_F32),
                       indexing="ij")
  src_x = a * xs + b * ys + c
  src_y = d * xs + e * ys + f
  ix = (np.sign(src_x) * np.floor(np.abs(src_x) + 0.5)).astype(np.int64)
  iy = (np.sign(src_y) * np.floor(np.abs(src_y) + 0.5)).astype(np.int64)
  inside = (ix >= 0) & (ix < w) & (iy >= 0) & (iy < h)
  out = image[np.clip(iy, 0, h - 1), np.clip(ix, 0, w - 1)]
  out[~inside] = replace
  return out


def rotate(image: np.ndarray, degrees: float, replace: int = REPLACE
           ) -> np.ndarray:
  """Counter-clockwise by `degrees` about the image centre."""
  theta = degrees * math.pi / 180.0
  cos, sin = math.cos(theta), math.sin(theta)
  h, w = image.shape[:2]
  x_off = ((w - 1) - (cos * (w - 1) - sin * (h - 1))) / 2.0
  y_off = ((h - 1) - (sin * (w - 1) + cos * (h - 1))) / 2.0
  return affine(image, (cos, -sin, x_off, sin, cos, y_off), replace)


def shear_x(image: np.ndarray, level: float, replace: int = REPLACE
            ) -> np.ndarray:
  return affine(image, (1.0, level, 0.0, 0.0, 1.0, 0.0), replace)


def shear_y(image: np.ndarray, level: float, replace: int = REPLACE
            ) -> np.ndarray:
  return affine(image, (1.0, 0.0, 0.0, level, 1.0, 0.0), replace)


def translate_x(image: np.ndarray, pixels: float, replace: int = REPLACE
                ) -> np.ndarray:
  return affine(image, (1.0, 0.0, pixels, 0.0, 1.0, 0.0), replace)


def translate_y(image: np.ndarray, pixels: float, replace: int = REPLACE
                ) -> np.ndarray:
  return affine(image, (1.0, 0.0, 0.0, 0.0, 1.0, pixels), replace)


def cutout(image: np.ndarray, pad_size: int, center: tuple[int, int],
           replace: int = REPLACE) -> np.ndarray:
  """Fills rows `[cy - pad, cy + pad)` x cols `[cx - pad, cx + pad)`
  (clipped to the image) with `replace`."""
  cy, cx = center
  out = image.copy()
  out[max(0, cy - pad_size):cy + pad_size,
      max(0, cx - pad_size):cx + pad_size] = replace
  return out


# --------------------------------------------------------------------------
# RandAugment.


def level_args(name: str, level: float) -> tuple[Any, ...]:
  """big_vision's `level_to_arg` before the random sign: the op's args."""
  m = level / MAX_LEVEL
  if name in ("AutoContrast", "Equalize", "Invert"):
    return ()
  if name == "Rotate":
    return (m * 30.0,)
  if name == "Posterize":
    return (int(m * 4),)
  if name == "Solarize":
    return (int(m * 256),)
  if name == "SolarizeAdd":
    return (int(m * 110),)
  if name in ("Color", "Contrast", "Brightness", "Sharpness"):
    return (m * 1.8 + 0.1,)
  if name in ("ShearX", "ShearY"):
    return (m * 0.3,)
  if name in ("TranslateX", "TranslateY"):
    return (m * float(TRANSLATE_CONST),)
  if name == "Cutout":
    return (int(m * CUTOUT_CONST),)
  raise KeyError(f"unknown RandAugment op {name!r}; ops: {list(OPS)}")


_FUNCS = {
    "AutoContrast": autocontrast, "Equalize": equalize, "Invert": invert,
    "Rotate": rotate, "Posterize": posterize, "Solarize": solarize,
    "Color": color, "Contrast": contrast, "Brightness": brightness,
    "Sharpness": sharpness, "ShearX": shear_x, "ShearY": shear_y,
    "TranslateX": translate_x, "TranslateY": translate_y,
    "SolarizeAdd": solarize_add,
}


def apply_op(image: np.ndarray, name: str, level: float,
             rng: np.random.Generator) -> np.ndarray:
  """One RandAugment op at `level`, drawing its sign / centre from `rng`."""
  args = level_args(name, level)
  if name in SIGNED and rng.random() < 0.5:
    args = (-args[0],)
  if name == "Cutout":
    center = (int(rng.integers(0, image.shape[0])),
              int(rng.integers(0, image.shape[1])))
    return cutout(image, args[0], center)
  return _FUNCS[name](image, *args)


def distort_image_with_randaugment(image: np.ndarray, num_layers: int,
                                   magnitude: float,
                                   rng: np.random.Generator) -> np.ndarray:
  """`num_layers` ops, each chosen uniformly from `OPS`, at `magnitude`."""
  check(isinstance(image, np.ndarray) and image.ndim == 3
        and image.shape[-1] == 3 and image.dtype == np.uint8, "image",
        f"randaug needs a uint8 [H, W, 3] image, got "
        f"{getattr(image, 'dtype', type(image).__name__)} "
        f"{getattr(image, 'shape', '')}")
  for _ in range(num_layers):
    name = OPS[int(rng.integers(0, len(OPS)))]
    image = apply_op(image, name, float(magnitude), rng)
  return image


def randaug(num_layers: int = 2, magnitude: float = 10):
  """The `randaug(num_layers, magnitude)` op (random)."""
  require(isinstance(num_layers, (int, np.integer))
          and not isinstance(num_layers, bool) and num_layers >= 0,
          "num_layers", f"must be an integer >= 0, got {num_layers!r}")
  require(isinstance(magnitude, (int, float, np.number))
          and not isinstance(magnitude, bool)
          and 0 <= magnitude <= 30, "magnitude",
          f"must be a number in [0, 30] (vmoe uses 0, 10, 15, 20), "
          f"got {magnitude!r}")
  return lambda image, rng: distort_image_with_randaugment(
      image, int(num_layers), float(magnitude), rng)
