"""Patch swap: a random set of an image's patches replaced by one constant
"token" patch — the vision analogue of the word-swap attack of the language
models' "attacked PPL" (docs/robustness.md, "Patch swap").

The language-model attack (TextAttack's word swap, after Han et al. 2024)
replaces 2.5% of the words of each evaluation line by the generic token
`AAA`, after clean training. Here an image `x [B, H, W, C]` is cut into a
row-major grid of `N = (H / ph) * (W / pw)` patches of `ph x pw` pixels
(patch `n = i * (W / pw) + j` is rows `i*ph .. (i+1)*ph - 1`, columns
`j*pw .. (j+1)*pw - 1`, the order of a ViT's patch embedding), and

    x_adv[b] = x[b] with every pixel of each patch in S_b set to `value`

where `S_b` is a uniformly random subset of exactly

    k = max(floor(rate * N), 1)   if rate > 0,        k = 0   if rate == 0

patches, drawn independently per image (`swap_mask`).

Exact count, not a Bernoulli draw per patch: the papers' attacked WikiText
was made (Fsoft-AIC/Tight-Clusters-Make-Specialized-Experts,
language-modeling/data.py, `_tokenize_attack`) with TextAttack's
`Augmenter(pct_words_to_swap=0.025, transformations_per_example=1,
fast_augment=True)` applied line by line, and the Augmenter (QData/TextAttack,
textattack/augmentation/augmenter.py) swaps
`max(int(pct_words_to_swap * len(words)), 1)` distinct words of each text,
picked uniformly one at a time among those not yet swapped. An image plays
the part of a line: each one gets that count, with the same floor and the
same minimum of one. So the swapped fraction of an image is `k / N`, not
`rate`: on the default MNIST model's 16 patches (patch 7) `rate=0.025` swaps
1 patch (6.25%), `rate=0.1` also 1, `rate=0.2` 3. `rate=0` is the identity
(TextAttack would still swap one word; a rate of 0 here is the clean
control). Not mirrored: TextAttack's stop-word filter (no analogue: every
patch can be swapped), and a quirk of `fast_augment`, whose last step
samples the result from the finished candidates together with the text one
swap short of them, so a line keeps one word fewer swapped with probability
`1 / (M + 1)`, `M` the line's candidate words. The attack sees neither
the model nor the labels: it is a fixed corruption, random given `key`.
"""

from __future__ import annotations

import functools
import numbers
from typing import Any, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np

from vmoe_ext.attacks import base
from vmoe_ext.errors import ConfigError, check, require

Array = jax.Array
PatchSize = Union[int, tuple[int, int]]
DEFAULT_RATE = 0.025  # The papers' word-swap rate.
DEFAULT_VALUE = 0.5  # Grey: neither MNIST's background (0) nor its ink (1).


def swap_count(rate: Any, num_patches: int) -> Any:
  """`k`, the number of patches swapped per image (module docstring).

  A Python int for a concrete `rate` (the floor as TextAttack's `int()`,
  in float64); an int32 scalar for a traced one (float32: a rate whose
  product with `num_patches` is within float32 rounding of an integer may
  give a count one lower than the concrete rate does).
  """
  if base.is_concrete(rate):
    r = float(rate)
    return max(int(r * num_patches), 1) if r > 0 else 0
  r = jnp.asarray(rate, jnp.float32)
  k = jnp.maximum(jnp.floor(r * num_patches), 1.0)
  return jnp.where(r > 0, k, 0.0).astype(jnp.int32)


def swap_mask(key: Array, batch: int, num_patches: int, rate: Any) -> Array:
  """`[B, N]` bool: the patches `patch_swap` replaces, row-major per image.

  Each row has exactly `swap_count(rate, N)` True entries, at a uniformly
  random subset of the `N` positions, independent across rows: the ranks of
  `N` uniform draws per row, the `k` lowest swapped.
  """
  return _mask(key, batch, num_patches, swap_count(rate, num_patches))


def _mask(key: Array, batch: int, num_patches: int, count: Any) -> Array:
  scores = jax.random.uniform(key, (batch, num_patches))
  ranks = jnp.argsort(jnp.argsort(scores, axis=-1), axis=-1)
  return ranks < count


@functools.partial(jax.jit, static_argnames=("ph", "pw"))
def _swap(x: Array, key: Array, count: Any, fill: Array, *, ph: int,
          pw: int) -> tuple[Array, Array]:
  """`(x_adv [B, H, W, C], mask [B, N])`: `count` patches per image set to
  `fill` (`[C]`); one compilation per shape, inlined inside a trace."""
  b, h, w, _ = x.shape
  gh, gw = h // ph, w // pw
  mask = _mask(key, b, gh * gw, count)
  pixels = jnp.broadcast_to(mask.reshape(b, gh, 1, gw, 1, 1),
                            (b, gh, ph, gw, pw, 1)).reshape(b, h, w, 1)
  return jnp.where(pixels, fill, x).astype(x.dtype), mask


def patch_grid(image_shape: Sequence[int], patch_size: PatchSize
               ) -> tuple[int, int, int, int]:
  """`(ph, pw, gh, gw)`: the patch's side and the grid's for `[H, W, ...]`
  images; ConfigError naming "attack.patch_size" unless it divides both."""
  ph, pw = _pair(patch_size)
  h, w = image_shape[0], image_shape[1]
  require(h % ph == 0 and w % pw == 0, "attack.patch_size",
          f"{(ph, pw)} must divide the images' {h} x {w} pixels")
  return ph, pw, h // ph, w // pw


def patch_swap(logits_fn: base.LogitsFn, x: Array, labels: Array, *,
               key: Optional[Array] = None, patch_size: PatchSize,
               rate: float = DEFAULT_RATE,
               value: Union[float, Sequence[float]] = DEFAULT_VALUE
               ) -> Array:
  """Patch swap; returns `x_adv [B, H, W, C]` (`x`'s shape and dtype).

  Args:
    logits_fn: unused (the attack does not look at the model).
    x: `[B, H, W, C]` clean images, raw [0, 1] pixels.
    labels: unused.
    key: PRNG key (required): which patches.
    patch_size: `ph` or `(ph, pw)`, pixels of the stored images; must divide
      `H` and `W`. Give the model's patch size (the default MNIST model's is
      7) so that a swapped patch is one whole token, scaled by stored /
      model size when the model resizes its input (`data.image_size`).
    rate: in [0, 1]; `max(floor(rate * N), 1)` patches per image, none at 0
      (module docstring).
    value: the fill, raw [0, 1] pixel units: a scalar, or one per channel
      (`C` values).

  Raises:
    ConfigError: an invalid field, named "attack.<field>"; also, once the
      images are seen, a patch size that does not divide them or a
      per-channel value of the wrong length.
    InputError: `x` is not `[B, H, W, C]` floating point ("attack.x").
  """
  return patch_swap_details(logits_fn, x, labels, patch_size=patch_size,
                            key=key, rate=rate, value=value)[0]


def patch_swap_details(logits_fn: base.LogitsFn, x: Array, labels: Array, *,
                       key: Optional[Array] = None, patch_size: PatchSize,
                       rate: float = DEFAULT_RATE,
                       value: Union[float, Sequence[float]] = DEFAULT_VALUE
                       ) -> tuple[Array, dict[str, Array]]:
  """`patch_swap` with its diagnostics: `(x_adv, {"swapped_fraction": [B]})`,
  each image's fraction `k / N` of swapped patches (float32)."""
  del logits_fn, labels
  check_patch_swap(patch_size=patch_size, rate=rate, value=value)
  check(jnp.ndim(x) == 4, "attack.x",
        f"needs images [B, H, W, C], got shape {jnp.shape(x)}")
  check(jnp.issubdtype(jnp.result_type(x), jnp.floating), "attack.x",
        f"must be floating point images, got {jnp.result_type(x)}")
  base.check_key(key, True, "(patch_swap draws the patches)")
  b, h, w, c = x.shape
  ph, pw, gh, gw = patch_grid((h, w), patch_size)
  fill = jnp.asarray(value, x.dtype)
  require(fill.ndim == 0 or fill.shape == (c,), "attack.value",
          f"needs one value or one per channel ({c}), got shape "
          f"{fill.shape}")
  count = swap_count(rate, gh * gw)
  x_adv, mask = _swap(x, key, count, jnp.broadcast_to(fill, (c,)), ph=ph,
                      pw=pw)
  return x_adv, {"swapped_fraction": jnp.mean(mask, axis=-1,
                                              dtype=jnp.float32)}


def check_patch_swap(*, patch_size: Any, rate: Any, value: Any) -> None:
  """`patch_swap`'s config check (the attack contract, `attacks.registry`):
  every config field, keyword-only; ConfigError naming "attack.<field>"
  (`rate` and `value` unchecked when traced)."""
  _pair(patch_size)
  if base.is_concrete(rate):
    _fractions(rate, "attack.rate", "a fraction in [0, 1]", max_ndim=0)
  if base.is_concrete(value):
    _fractions(value, "attack.value", "a number in [0, 1] (raw pixel "
               "units) or one per channel", max_ndim=1)


def _pair(patch_size: Any) -> tuple[int, int]:
  """`(ph, pw)` of an int or a pair of ints >= 1; ConfigError otherwise."""
  is_int = lambda v: (isinstance(v, numbers.Integral)  # noqa: E731
                      and not isinstance(v, bool) and v >= 1)
  if is_int(patch_size):
    return int(patch_size), int(patch_size)
  if (isinstance(patch_size, (tuple, list)) and len(patch_size) == 2
      and all(is_int(v) for v in patch_size)):
    return int(patch_size[0]), int(patch_size[1])
  raise ConfigError("attack.patch_size",
                    f"must be an integer >= 1 or a pair of them (ph, pw), "
                    f"got {patch_size!r}")


def _fractions(value: Any, field: str, what: str, max_ndim: int) -> None:
  """`value`: real numbers in [0, 1], a scalar (or, with `max_ndim=1`, a
  non-empty sequence); ConfigError naming `field` otherwise."""
  items = value if isinstance(value, (tuple, list)) else [value]
  try:
    ok = not any(isinstance(v, (bool, str)) for v in items)
    arr = np.asarray(value, np.float64) if ok else None
  except (TypeError, ValueError):
    arr = None
  require(arr is not None and arr.ndim <= max_ndim and arr.size > 0
          and bool(np.all(np.isfinite(arr) & (arr >= 0) & (arr <= 1))),
          field, f"must be {what}, got {value!r}")
