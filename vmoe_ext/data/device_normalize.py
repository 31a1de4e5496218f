"""uint8 batches to the device, the pp's trailing pixel map applied there.

A streamed training pipeline such as `decode_jpeg_and_inception_crop(224)|
flip_lr|randaug(2, 10)|value_range(-1, 1)` keeps its images uint8 until the
last op; only `value_range` makes them float32. With
`data.device_normalize=True` that trailing op runs on the device instead:
the host pipeline (the loader's workers) stops before it and yields uint8
`[B/P, H, W, C]` batches (4x fewer bytes to pickle between processes, to
hold and to transfer), and the train step maps them to float32 as its first
op, before mixup and the model.

Which tails move. `split_pixel_tail(pipeline)`: the trailing run of ops of
`PIXEL_OPS` (each output pixel a function of that input pixel's value and
channel alone: `value_range`, clipped or not, per-channel or not; several in
a row compose), provided nothing before it makes the image float (no
earlier `value_range`). A pipeline with no such op ends in uint8 already;
its tail is the float32 cast that `PreprocessSpec` applies today. Any other
pipeline (e.g. `value_range(0, 1)|flip_lr`, a float op followed by a
geometric one) has no split: it keeps the float32 host path, and asking for
`data.device_normalize` with it is a config error.

Exactness. A uint8 input has 256 values per channel, so the tail is a table
`[256, C]` float32 (`PixelMap.table`): the host's own ops applied to the
ramp 0..255 of every channel, with numpy, exactly as the host path computes
each pixel. The device looks each pixel up, `table[x[..., c], c]` (one
gather, `apply_table`), so the float32 image the model sees is bit-identical
to today's host output on every backend (recomputing `(x - a) / b * s + v`
on a GPU could differ in the last bit: XLA may fuse the multiply-add).

Shapes: B batch, H, W spatial, C channels.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from vmoe_ext.errors import require

# Ops whose output pixel depends only on the input pixel's value and channel.
PIXEL_OPS = frozenset({"value_range"})
DEVICE_NORMALIZE_FIELD = "data.device_normalize"


@dataclasses.dataclass(frozen=True)
class PixelMap:
  """The tail of a preprocessing string that runs on the device.

  `ops` are the parsed `pp.OpCall`s of the tail, in order (empty: the plain
  uint8 -> float32 cast); `spec` their canonical text ("" when empty).
  """
  ops: tuple[Any, ...]

  @property
  def spec(self) -> str:
    return "|".join(op.spec for op in self.ops)

  def table(self, channels: int) -> np.ndarray:
    """`[256, C]` float32: entry (v, c) is the tail's output for a pixel of
    value v in channel c, computed by the host ops themselves.

    Raises:
      ConfigError on `data.device_normalize` when the tail does not give C
      channels for a C-channel image (e.g. per-channel `in_min` of another
      length).
    """
    ramp = np.repeat(np.arange(256, dtype=np.uint8)[:, None, None],
                     channels, axis=2)  # [256, 1, C]
    out = ramp
    for op in self.ops:
      out = op.fn(out, None)
    out = np.asarray(out)
    require(out.shape == ramp.shape, DEVICE_NORMALIZE_FIELD,
            f"the pp's trailing {self.spec!r} maps {channels}-channel images "
            f"to shape {out.shape[1:]}, not [.., .., {channels}]")
    return np.ascontiguousarray(out[:, 0, :].astype(np.float32))

  def __call__(self, images: np.ndarray) -> np.ndarray:
    """The host path: the tail applied to uint8 `[..., C]` (an image or a
    batch; the ops are per pixel) with numpy, as float32 (for references
    and the init batch)."""
    images = np.asarray(images)
    out = images.reshape(-1, 1, images.shape[-1])  # [pixels, 1, C]
    for op in self.ops:
      out = op.fn(out, None)
    return np.asarray(out, np.float32).reshape(images.shape)


def split_pixel_tail(pipeline) -> tuple[Any, PixelMap] | None:
  """`(host pipeline, device PixelMap)` of a parsed `pp.Pipeline`, or None
  when its tail cannot run on the device (module docstring). The host part
  gives uint8 images (checked per image by `check_host_output`)."""
  from vmoe_ext.data import pp  # pylint: disable=g-import-not-at-top
  ops = list(pipeline.ops)
  cut = len(ops)
  while cut > 0 and ops[cut - 1].name in PIXEL_OPS:
    cut -= 1
  if any(op.name in PIXEL_OPS for op in ops[:cut]) or cut == 0:
    return None  # A float image before the tail, or nothing left to decode.
  return pp.Pipeline(ops[:cut]), PixelMap(tuple(ops[cut:]))


def check_host_output(image: np.ndarray, spec: str) -> np.ndarray:
  """The host part's output must be uint8 (what the table indexes)."""
  require(image.dtype == np.uint8, DEVICE_NORMALIZE_FIELD,
          f"the host part {spec!r} of the pp gave {image.dtype} images; the "
          "device lookup needs uint8 (set data.device_normalize=False)")
  return image


def apply_table(images: Any, table: Any) -> Any:
  """uint8 `[B, H, W, C]` -> float32 `[B, H, W, C]`: `table[x[..c], c]`.

  Args:
    images: uint8 pixels (any leading shape, channels last).
    table: float32 `[256, C]` (`PixelMap.table`).
  """
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  require(images.dtype == jnp.uint8, DEVICE_NORMALIZE_FIELD,
          f"the train step expects uint8 images, got {images.dtype}")
  channels = table.shape[-1]
  require(images.shape[-1] == channels, DEVICE_NORMALIZE_FIELD,
          f"images have {images.shape[-1]} channels, the pixel table "
          f"{channels}")
  index = (images.astype(jnp.int32) * channels
           + jnp.arange(channels, dtype=jnp.int32))
  flat = jnp.asarray(table, jnp.float32).reshape(-1)
  return flat.at[index].get(mode="promise_in_bounds")


class DeviceNormalize:
  """The train step's first op: `normalize(uint8 images) -> float32`, the
  pp tail's table closed over as a constant (`[256 C]` floats)."""

  def __init__(self, pixel_map: PixelMap, channels: int):
    self.pixel_map, self.channels = pixel_map, channels
    self.table = pixel_map.table(channels)

  def __call__(self, images: Any) -> Any:
    return apply_table(images, self.table)

  def __repr__(self) -> str:
    return (f"DeviceNormalize({self.pixel_map.spec or 'float32 cast'!r}, "
            f"channels={self.channels})")


def check_device_normalize(data: dict[str, Any]) -> None:
  """With `device_normalize` on (fields relative to the data section),
  `pp_train` and `pp_eval` (when set) must each end in a pixel map the
  device can apply."""
  if not data.get("device_normalize"):
    return
  from vmoe_ext.data import pp  # pylint: disable=g-import-not-at-top
  for key in ("pp_train", "pp_eval"):
    if data.get(key) is None:
      continue
    pipeline = pp.parse(data[key], key)
    require(split_pixel_tail(pipeline) is not None, "device_normalize",
            f"data.{key} {pipeline.spec!r} has no trailing per-pixel map "
            f"after uint8 ops (ops {sorted(PIXEL_OPS)} must come last, "
            "after every geometric op, and the pipeline needs a host "
            "part): leave data.device_normalize False to keep the float32 "
            "host path")


__all__ = ["DEVICE_NORMALIZE_FIELD", "DeviceNormalize", "PIXEL_OPS",
           "PixelMap", "apply_table", "check_device_normalize",
           "check_host_output", "split_pixel_tail"]
