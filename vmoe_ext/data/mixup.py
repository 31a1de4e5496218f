"""Batch mixup as vmoe trains with it, in numpy and in jax.

vmoe (`vmoe/train/trainer.py`: `wrap_train_step_with_mixup` and `mixup`)
mixes each example with the next `size - 1` examples of its group:

1. The batch `[B, ...]` is split into `groups` consecutive groups
   `[G, B / G, ...]` (vmoe: one per device, `jax.device_count()`, so mixing
   needs no communication).
2. Weights `[..., size]` are drawn from a symmetric Dirichlet with parameter
   `concentration`, one set per batch (`granularity="batch"`, shape
   `[1, 1, size]`), per group (`"device"`, `[G, 1, size]`, vmoe's paper
   setting) or per example (`"example"`, `[G, B / G, size]`), and sorted in
   decreasing order, so that each example keeps the largest weight.
3. `out[g, b] = sum_i w[g, b, i] * x[g, (b + i) mod (B / G)]` (vmoe's
   `sum_i w_i * roll(x, -i, axis=1)`), for the images and the (one-hot or
   soft) labels alike. With `size = 2`: `w0 x[b] + w1 x[b + 1]`, w0 >= w1.

vmoe's V-MoE paper settings: `size=2`, `granularity="device"`,
`concentration` 0.2 (light1, medium1), 0.5 (medium2, strong1), 0.8
(strong2), 0 for light0. A concentration of 0 (or None) turns mixup off: the
batch is returned unchanged, as vmoe returns the unwrapped train step.

`mix` / `mix_jax` apply given weights (numpy and jax agree to float32
round-off); `mixup` draws the weights with `np.random.Generator.dirichlet`
and `mixup_jax` with `jax.random.dirichlet` (jit-compatible: the config
arguments are static Python values).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from vmoe_ext.errors import check, require

GRANULARITIES = ("batch", "device", "example")


def check_config(concentration: float | None, size: int, granularity: str
                 ) -> bool:
  """Validates the mixup fields; returns whether mixup is on.

  Raises:
    ConfigError: on `concentration`, `size` or `granularity` (paths
      relative to the mixup section).
  """
  require(concentration is None or (
      isinstance(concentration, (int, float)) and not isinstance(
          concentration, bool) and np.isfinite(concentration)
      and concentration >= 0), "concentration",
          f"must be a number >= 0 (0 or None: no mixup), got "
          f"{concentration!r}")
  require(isinstance(size, (int, np.integer)) and not isinstance(size, bool)
          and size >= 1, "size",
          f"must be an integer >= 1 (examples per mixed example; vmoe uses "
          f"2), got {size!r}")
  require(granularity in GRANULARITIES, "granularity",
          f"must be one of {list(GRANULARITIES)}, got {granularity!r}")
  return bool(concentration)


def weights_shape(batch_size: int, *, size: int = 2,
                  granularity: str = "device", groups: int = 1
                  ) -> tuple[int, int, int]:
  """Shape `[G or 1, B / G or 1, size]` of the mixing weights."""
  check(isinstance(groups, (int, np.integer)) and groups >= 1
        and batch_size % groups == 0, "images",
        f"a batch of {batch_size} does not split into {groups} groups")
  if granularity == "batch":
    return (1, 1, size)
  if granularity == "device":
    return (groups, 1, size)
  return (groups, batch_size // groups, size)


def _check_batch(images: Any, labels: Any) -> None:
  check(images.ndim >= 1 and labels.ndim >= 1
        and images.shape[0] == labels.shape[0], "labels",
        f"images {tuple(images.shape)} and labels {tuple(labels.shape)} "
        "need the same batch size")


def sample_weights(rng: np.random.Generator, shape: tuple[int, ...],
                   concentration: float) -> np.ndarray:
  """Dirichlet(concentration) weights `shape`, sorted decreasing, float32."""
  w = rng.dirichlet(np.full(shape[-1], float(concentration)), shape[:-1])
  return -np.sort(-w.astype(np.float32), axis=-1)


def sample_weights_jax(key: jax.Array, shape: tuple[int, ...],
                       concentration: float) -> jax.Array:
  """As `sample_weights`, with `jax.random.dirichlet` called as vmoe does
  (alpha of the full `shape`), so a key gives vmoe's weights."""
  w = jax.random.dirichlet(key, jnp.full(shape, concentration, jnp.float32))
  return -jnp.sort(-w, axis=-1)


def _mix(x: Any, weights: Any, xp: Any) -> Any:
  """`mix` in the array namespace `xp` (numpy or jax.numpy)."""
  g, size = weights.shape[0], weights.shape[-1]
  xg = xp.asarray(x, xp.float32).reshape((g, -1) + x.shape[1:])
  w = xp.asarray(weights, xp.float32)
  w = w.reshape(w.shape + (1,) * (xg.ndim - 2))
  out = sum(w[:, :, i] * xp.roll(xg, -i, axis=1) for i in range(size))
  return out.reshape(x.shape)


def mix(x: np.ndarray, weights: np.ndarray) -> np.ndarray:
  """`[B, ...]` mixed with weights `[G, B/G or 1, size]` (see module doc)."""
  return _mix(x, weights, np).astype(np.float32)


def mix_jax(x: jax.Array, weights: jax.Array) -> jax.Array:
  """jax version of `mix`."""
  return _mix(x, weights, jnp)


def _weights_shape_if_on(images: Any, labels: Any,
                         concentration: float | None, size: int,
                         granularity: str, groups: int
                         ) -> tuple[int, ...] | None:
  """The weights' shape, or None when mixup is off (checks the fields and
  the batch)."""
  if not check_config(concentration, size, granularity):
    return None
  _check_batch(images, labels)
  return weights_shape(images.shape[0], size=size, granularity=granularity,
                       groups=groups)


def mixup(rng: np.random.Generator, images: np.ndarray, labels: np.ndarray,
          *, concentration: float | None, size: int = 2,
          granularity: str = "device", groups: int = 1
          ) -> tuple[np.ndarray, np.ndarray]:
  """Mixes a batch: images `[B, H, W, C]`, labels `[B, classes]`.

  Draws the weights (module doc) from `rng`, unless mixup is off
  (concentration 0 or None), when the inputs are returned unchanged.
  """
  shape = _weights_shape_if_on(images, labels, concentration, size,
                               granularity, groups)
  if shape is None:
    return images, labels
  w = sample_weights(rng, shape, concentration)
  return mix(images, w), mix(labels, w)


def mixup_jax(key: jax.Array, images: jax.Array, labels: jax.Array, *,
              concentration: float | None, size: int = 2,
              granularity: str = "device", groups: int = 1
              ) -> tuple[jax.Array, jax.Array]:
  """jax version of `mixup` (weights from `key`), usable under `jax.jit`."""
  shape = _weights_shape_if_on(images, labels, concentration, size,
                               granularity, groups)
  if shape is None:
    return images, labels
  w = sample_weights_jax(key, shape, concentration)
  return mix_jax(images, w), mix_jax(labels, w)
