"""Host-side (numpy) image preprocessing: resize, normalise, light augmentation.

All functions take and return batches `[N, H, W, C]` float32.

Resize is separable linear interpolation with half-pixel centres; when
shrinking, the triangle kernel is widened by the shrink factor (antialiasing),
the same definition as `jax.image.resize(..., method="linear")`. It is done in
numpy as two small matrix products, so the input pipeline never touches the
accelerator.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from vmoe_ext.errors import require

Stat = float | Sequence[float]


def resize_weights(in_size: int, out_size: int) -> np.ndarray:
  """Linear-interpolation weights `[out_size, in_size]`; each row sums to 1.

  Output pixel `o` is centred at input coordinate `(o + 0.5) * in / out - 0.5`;
  input pixel `i` gets weight `max(0, 1 - |i - centre| * min(1, out / in))`
  before the row is normalised.
  """
  scale = out_size / in_size
  centres = (np.arange(out_size) + 0.5) / scale - 0.5
  dist = np.abs(np.arange(in_size)[None, :] - centres[:, None])
  w = np.maximum(0.0, 1.0 - dist * min(1.0, scale))
  return w / w.sum(axis=1, keepdims=True)


def resize(images: np.ndarray, image_size: int) -> np.ndarray:
  """Resizes `[N, H, W, C]` images to `[N, S, S, C]` with S = image_size."""
  require(isinstance(image_size, (int, np.integer)) and image_size > 0,
          "data.image_size", f"must be a positive integer, got {image_size!r}")
  _, h, w, _ = images.shape
  if h == image_size and w == image_size:
    return images.astype(np.float32, copy=False)
  wh = resize_weights(h, image_size).astype(np.float32)
  ww = resize_weights(w, image_size).astype(np.float32)
  out = np.einsum("oh,nhwc->nowc", wh, images.astype(np.float32))
  return np.einsum("pw,nowc->nopc", ww, out).astype(np.float32)


def stack_images(images: Sequence[np.ndarray],
                 image_size: int | Callable[[np.ndarray], np.ndarray] | None,
                 name: str, field: str, channels: int = 1) -> np.ndarray:
  """Stacks decoded images `[H_i, W_i, C]` into `[N, S, S, C]` float32.

  With an int `image_size` each image is resized to a square of that side
  first (images of different shapes are then fine); a callable one maps
  each [0, 1] image to its `[S, S, C]` [0, 1] input instead (e.g.
  `stream_eval.EvalFit`: the eval preprocessing string); without it all
  images must share one shape (a `ConfigError` naming `field` otherwise).
  An empty list gives `[0, S or 1, S or 1, channels]`.
  """
  if not images:
    side = image_size if isinstance(image_size, int) else 1
    return np.zeros((0, side, side, channels), np.float32)
  if callable(image_size):
    return np.stack([image_size(x) for x in images]).astype(np.float32)
  if image_size is not None:
    return np.concatenate([resize(x[None], image_size) for x in images])
  shapes = {x.shape for x in images}
  require(len(shapes) <= 1, field,
          f"{name} has images of different shapes (e.g. {sorted(shapes)[:2]}); "
          "give an image size to resize them when reading")
  return np.stack(images).astype(np.float32, copy=False)


def _channel_stat(value: Stat, channels: int, field: str) -> np.ndarray:
  arr = np.asarray(value, np.float32).reshape(-1)
  require(arr.size in (1, channels), field,
          f"needs 1 or {channels} (one per channel) values, got {arr.size}")
  return arr


def normalize(images: np.ndarray, mean: Stat = 0., std: Stat = 1.
              ) -> np.ndarray:
  """`(images - mean) / std` with scalar or per-channel [C] statistics."""
  c = images.shape[-1]
  mean_arr = _channel_stat(mean, c, "data.mean")
  std_arr = _channel_stat(std, c, "data.std")
  require(np.all(std_arr > 0), "data.std", f"must be positive, got {std!r}")
  return ((images - mean_arr) / std_arr).astype(np.float32)


def preprocess(images: np.ndarray, *, image_size: int | None,
               mean: Stat = 0., std: Stat = 1.) -> np.ndarray:
  """Resizes (if `image_size` is set and differs) then normalises.

  Args:
    images: [N, H, W, C] raw images in [0, 1].
    image_size: target side S, or None to keep H, W.
    mean: scalar or per-channel [C] mean subtracted after resizing.
    std: scalar or per-channel [C] standard deviation divided by.

  Returns:
    [N, S, S, C] (or [N, H, W, C]) float32.
  """
  if image_size is not None:
    images = resize(images, image_size)
  return normalize(images, mean, std)


def default_pad(image_side: int) -> int:
  """Default shift range of `random_shift`: max(1, side // 8) pixels."""
  return max(1, image_side // 8)


def random_shift(images: np.ndarray, rng: np.random.Generator,
                 pad: int) -> np.ndarray:
  """Zero-pads by `pad` pixels on each side and crops back at random offsets.

  Equivalent to translating each image independently by (dy, dx), each drawn
  uniformly from {-pad, ..., pad}, filling the uncovered border with zeros.

  Args:
    images: [N, H, W, C].
    rng: the generator the offsets are drawn from (2N integers).
    pad: maximum shift in pixels (>= 0).

  Returns:
    [N, H, W, C] shifted images.
  """
  n, h, w, _ = images.shape
  if pad == 0 or n == 0:
    return images
  padded = np.pad(images, ((0, 0), (pad, pad), (pad, pad), (0, 0)))
  oy = rng.integers(0, 2 * pad + 1, size=n)
  ox = rng.integers(0, 2 * pad + 1, size=n)
  rows = oy[:, None] + np.arange(h)[None, :]  # [N, H]
  cols = ox[:, None] + np.arange(w)[None, :]  # [N, W]
  return padded[np.arange(n)[:, None, None], rows[:, :, None],
                cols[:, None, :]]


def random_flip(images: np.ndarray, rng: np.random.Generator) -> np.ndarray:
  """Mirrors each image left-right with probability 1/2 (N uniform draws)."""
  flip = rng.random(images.shape[0]) < 0.5
  return np.where(flip[:, None, None, None], images[:, :, ::-1], images)
