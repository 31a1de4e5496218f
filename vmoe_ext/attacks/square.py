"""Square attack: score-based black-box random search, Linf and L2
(Andriushchenko, Croce, Flammarion & Hein, ECCV 2020; docs/robustness.md,
"Attacks").

Each example minimises its untargeted margin loss
`f(x) = z_y - max_{j != y} z_j` (`z = logits_fn(x)`); it is broken once
`f <= 0`. Images are `x [B, H, W, C]`; squares cover H and W, with one sign
per channel. Iteration `i = 0, 1, ...` uses squares of side `s_i`:
`p_i = p_init / 2^k`, `k` the number of thresholds `10, 50, 200, 500, 1000,
2000, 4000, 6000, 8000` strictly below `int(i / queries * 10000)` (`i`
itself with `rescale_schedule=False`); `s_i = max(round(sqrt(p_i H W)), 1)`
(Linf), `max(round(sqrt(p_i H W)), 3)` made odd (L2), capped at `min(H, W)`.

Linf (`x0` the clean image, `clip` to the valid range):
  init: `x = clip(x0 + eps v)`, `v in {-1, +1}^[1, W, C]`: vertical stripes.
  step: `x' = clip(proj_eps(x + 2 eps 1_Q r))`, `r in {-1, +1}^C`, `Q` the
    s x s square at `(vh, vw)`, uniform in `[0, H - s) x [0, W - s)` (0 when
    `s` is the side of the image): the square is set to `x0 +- eps`.
L2 (`eta(s)`: the s x s pseudo-Gaussian, `+` on its top `s // 2` rows and `-`
below, each half a sum of nested centred rectangles weighted `1 / (k+1)^2`,
unit norm, transposed with probability 1/2):
  init: `delta` = `eta(s0) r_{g,c}` on a grid of s0 x s0 squares
    (`s0 = max(min(H, W) // 5, 1)`); `x = clip(x0 + eps delta / ||delta||)`.
  step: with `delta = x - x0` and two windows `Q1, Q2` of side `s`, per
    channel `c`: `n_c = eta(s) r_c + delta[Q1, c] / ||delta[Q1, c]||`,
    rescaled to norm `sqrt(max(eps^2 - ||delta||^2, 0) / C +
    ||delta 1_{Q1 u Q2}||^2)`; then `delta[Q2] = 0`, `delta[Q1] = n`,
    `x' = clip(x0 + eps delta / ||delta||)`: the norm stays <= eps.
Acceptance: `x <- x'` iff `f(x') < f(x)` or `f(x') <= 0`; an example is
frozen at its first misclassified point. Queries: 1 for the init and 1 per
iteration an example is still attacked; `queries` bounds the total (so at
most `queries - 1` iterations).

Batch semantics: every `logits_fn` call is on the whole `[B, ...]` batch
(frozen examples sit at their point), iterations run in one
`lax.while_loop` that stops when no example is left to attack.

Differences from the reference code (fra31/auto-attack, autoattack/square.py):
* The draws are per example (square positions, signs, the pseudo-Gaussian's
  transposition), as the paper's per-image algorithm; the reference draws
  one position (and one transposition) per iteration shared by the batch.
  The init draws from `key`, iteration `i` from `fold_in(key, i)`, one
  `jax.random.bits` each (positions: bits modulo the range).
* The budget counts the init query (as the original square-attack code):
  the reference runs `n_queries` iterations after the init.
* Sides capped at `min(H, W)`, the L2 grid generalised to `H, W < 5` and
  non-square images (the reference assumes square images with side >= 5).
* Untargeted margin loss and one restart only (AutoAttack's standard use).
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from vmoe_ext.attacks import base
from vmoe_ext.errors import check, require

Array = jax.Array
THRESHOLDS = (10, 50, 200, 500, 1000, 2000, 4000, 6000, 8000)
LEVELS = len(THRESHOLDS) + 1  # p_init / 2^k, k = 0..9.
TINY = 1e-12  # The reference's floor in normalisations.


def p_selection(iteration: int, queries: int, p_init: float,
                rescale_schedule: bool) -> float:
  """The fraction `p` of the image a square covers at `iteration` (0-based)."""
  it = int(iteration / queries * 10000) if rescale_schedule else iteration
  return p_init / 2 ** sum(it > t for t in THRESHOLDS)


def level_starts(queries: int, rescale_schedule: bool) -> tuple[int, ...]:
  """First iteration of each level `k = 1..9` of the `p` schedule (levels
  never reached start at `queries - 1`, the end of the loop)."""
  i = np.arange(queries - 1)
  it = (i / queries * 10000).astype(np.int64) if rescale_schedule else i
  level = np.searchsorted(np.asarray(THRESHOLDS), it, side="left")
  return tuple(int(v) for v in np.searchsorted(level, np.arange(1, LEVELS)))


def square_size(p: float, height: int, width: int, channels: int,
                norm: str) -> int:
  """Side of the squares for the fraction `p` (see the module docstring)."""
  s = int(round(math.sqrt(p * (channels * height * width) / channels)))
  if norm == "linf":
    s = max(s, 1)
  else:
    s = max(s, 3)
    s += 1 - s % 2
  return min(s, height, width)


def _rectangles(rows: int, cols: int) -> np.ndarray:
  """`[rows, cols]` nested centred rectangles weighted `1 / (k+1)^2`, unit
  norm (nothing for `rows == 0`)."""
  out = np.zeros((rows, cols))
  if rows == 0:
    return out
  r, c = rows // 2, cols // 2
  for k in range(max(r, c) + 1):
    out[max(r - k, 0):r + k + 1, max(c - k, 0):c + k + 1] += 1.0 / (k + 1) ** 2
  return out / np.sqrt(np.sum(out ** 2))


def pseudo_gaussian(s: int) -> np.ndarray:
  """`[s, s]` float64 pseudo-Gaussian `eta(s)` (before any transposition)."""
  out = np.concatenate([_rectangles(s // 2, s), -_rectangles(s - s // 2, s)])
  return out / np.sqrt(np.sum(out ** 2))


def l2_grid(height: int, width: int) -> tuple[list[int], list[int], int]:
  """`(row starts, column starts, side)` of the L2 init's squares."""
  s = max(min(height, width) // 5, 1)

  def starts(n):
    first = max((n - 5 * s) // 2, 0)
    return [v for v in range(first, first + (n // s) * s, s) if v + s <= n]

  return starts(height), starts(width), s


def _sign(bits: Array) -> Array:
  """+-1 float32 from the top bit of uint32 `bits`."""
  return jnp.where(bits >> 31 == 1, 1.0, -1.0).astype(jnp.float32)


def init_draws(key: Array, shape: tuple[int, ...], norm: str
               ) -> dict[str, Array]:
  """The init's random draws (from `key` itself) for images of `shape =
  (B, H, W, C)`.

  Linf: `signs [B, 1, W, C]`. L2: `signs [B, gh, gw, C]` and `transpose
  [B, gh, gw]` bool, per square of the `l2_grid` (rows, then columns).
  """
  b, h, w, c = shape
  if norm == "linf":
    return {"signs": _sign(jax.random.bits(key, (b, 1, w, c)))}
  gh, gw, _ = l2_grid(h, w)
  bits = jax.random.bits(key, (b, len(gh), len(gw), c + 1))
  return {"signs": _sign(bits[..., 1:]), "transpose": bits[..., 0] >> 31 == 1}


def step_draws(key: Array, iteration: Any, s: Any, shape: tuple[int, ...],
               norm: str) -> dict[str, Array]:
  """Iteration `iteration`'s random draws (from `fold_in(key, iteration)`)
  for squares of side `s`.

  `vh, vw [B]` int32, uniform in `[0, H - s)`, `[0, W - s)` (0 when the
  square spans the image): the square (L2: the window `Q1`) at rows
  `vh:vh+s` and columns `vw:vw+s`; `signs [B, C]` +-1. L2 adds `vh2, vw2`
  (the window `Q2`) and `transpose [B]` bool (of the pseudo-Gaussian). One
  draw of bits serves both norms.
  """
  b, h, w, c = shape
  bits = jax.random.bits(jax.random.fold_in(key, iteration), (b, 5 + c))
  pos = lambda j, n: (  # noqa: E731
      bits[:, j] % jnp.maximum(n - s, 1).astype(jnp.uint32)).astype(jnp.int32)
  draws = {"vh": pos(0, h), "vw": pos(1, w), "signs": _sign(bits[:, 5:])}
  if norm == "l2":
    draws.update(vh2=pos(2, h), vw2=pos(3, w), transpose=bits[:, 4] >> 31 == 1)
  return draws


def _window(vh: Array, vw: Array, s: Any, h: int, w: int) -> Array:
  """`[B, H, W, 1]` bool: the s x s square at `(vh[b], vw[b])`."""
  rows = (jnp.arange(h) >= vh[:, None]) & (jnp.arange(h) < vh[:, None] + s)
  cols = (jnp.arange(w) >= vw[:, None]) & (jnp.arange(w) < vw[:, None] + s)
  return (rows[:, :, None] & cols[:, None, :])[..., None]


def _l2_norm(x: Array, axis: tuple[int, ...]) -> Array:
  return jnp.sqrt(jnp.sum(jnp.square(x), axis=axis, keepdims=True))


def _on_sphere(x0: Array, delta: Array, eps: Any) -> Array:
  """`x0 + eps delta / ||delta||` per example (the reference's floor)."""
  return x0 + eps * delta / (_l2_norm(delta, (1, 2, 3)) + TINY)


def _init(x0: Array, draws: dict[str, Array], eps: Any, norm: str) -> Array:
  """The starting points (before the range clip) `[B, H, W, C]`."""
  if norm == "linf":
    return x0 + eps * draws["signs"].astype(x0.dtype)
  _, h, w, _ = x0.shape
  gh, gw, s = l2_grid(h, w)
  eta = pseudo_gaussian(s)

  def cells(starts, n):  # Square index (-1: none) and offset of each pixel.
    cell, offset = np.full(n, -1), np.zeros(n, int)
    for g, v in enumerate(starts):
      cell[v:v + s], offset[v:v + s] = g, np.arange(s)
    return cell, offset

  (ch, oh), (cw, ow) = cells(gh, h), cells(gw, w)
  inside = ((ch >= 0)[:, None] & (cw >= 0)[None, :])[None, :, :, None]
  ch, cw = np.maximum(ch, 0)[:, None], np.maximum(cw, 0)[None, :]
  pattern = jnp.where(draws["transpose"][:, ch, cw],
                      eta[ow[None, :], oh[:, None]],
                      eta[oh[:, None], ow[None, :]])  # [B, H, W]
  delta = pattern[..., None] * draws["signs"][:, ch, cw, :]
  return _on_sphere(x0, jnp.where(inside, delta, 0.0).astype(x0.dtype), eps)


def _linf_step(x_best, x0, draws, s, eps):
  _, h, w, _ = x0.shape
  q = _window(draws["vh"], draws["vw"], s, h, w)
  step = 2.0 * eps * draws["signs"][:, None, None, :]
  x = x_best + jnp.where(q, step, 0.0).astype(x0.dtype)
  return jnp.clip(x, x0 - eps, x0 + eps)


def _l2_step(x_best, x0, draws, s, eta, eps):
  """`eta [S, S]`: `eta(s)` zero-padded to the largest side `S`."""
  _, h, w, c = x0.shape
  delta = x_best - x0
  q1 = _window(draws["vh"], draws["vw"], s, h, w)
  q2 = _window(draws["vh2"], draws["vw2"], s, h, w)
  etas = jnp.where(draws["transpose"][:, None, None], eta.T, eta)
  rows = jnp.clip(jnp.arange(h) - draws["vh"][:, None], 0, eta.shape[0] - 1)
  cols = jnp.clip(jnp.arange(w) - draws["vw"][:, None], 0, eta.shape[0] - 1)
  placed = jax.vmap(lambda e, r, k: e[r[:, None], k[None, :]])(
      etas, rows, cols)[..., None]  # [B, H, W, 1]
  old = delta / (TINY + _l2_norm(jnp.where(q1, delta, 0.0), (1, 2)))
  new = jnp.where(q1, placed * draws["signs"][:, None, None, :] + old, 0.0)
  budget = jnp.sqrt(
      jnp.maximum(eps ** 2 - _l2_norm(delta, (1, 2, 3)) ** 2, 0.0) / c
      + _l2_norm(jnp.where(q1 | q2, delta, 0.0), (1, 2, 3)) ** 2)
  new = new / (TINY + _l2_norm(new, (1, 2))) * budget
  delta = jnp.where(q1, new, jnp.where(q2, 0.0, delta)).astype(x0.dtype)
  return _on_sphere(x0, delta, eps)


def square(logits_fn: base.LogitsFn, x: Array, labels: Array, *, eps: float,
           key: Optional[Array] = None, norm: str = "linf",
           queries: int = 5000, p_init: float = 0.8,
           rescale_schedule: bool = True, clip_min: float = 0.0,
           clip_max: float = 1.0) -> Array:
  """Square attack (untargeted); returns `x_adv [B, H, W, C]` (`x`'s dtype).

  Examples misclassified at the clean point are returned unchanged; the
  others at their first misclassified point, else at the point of lowest
  margin found (within the eps-ball and the valid range).

  Args:
    logits_fn: `x [B, H, W, C] -> logits [B, K]`, deterministic (`base`).
    x: `[B, H, W, C]` clean images in `[clip_min, clip_max]`.
    labels: `[B]` int true labels.
    eps: radius (>= 0) of the `norm` ball, in the units of `x`.
    key: PRNG key (required).
    norm: "linf" or "l2".
    queries: model queries per example (>= 1), the init's included; the
      clean check costs one more call on the batch.
    p_init: fraction of the image the first squares cover, in (0, 1].
    rescale_schedule: stretch the `p` schedule (made for 10,000 queries) to
      `queries` (the released `SquareAttack`'s default; the released
      AutoAttack's standard version runs False: `autoattack`).
    clip_min, clip_max: the valid range of the images.

  Raises:
    ConfigError: invalid argument; the message names the field ("attack.eps").
  """
  check_square(eps=eps, norm=norm, queries=queries, p_init=p_init,
               rescale_schedule=rescale_schedule, clip_min=clip_min,
               clip_max=clip_max)
  base.check_inputs(x, labels)
  check(jnp.ndim(x) == 4, "attack.x",
        f"Square needs images [B, H, W, C], got shape {jnp.shape(x)}")
  base.check_key(key, True, "(Square samples random squares)")
  static = dict(norm=norm, queries=queries, p_init=float(p_init),
                rescale_schedule=rescale_schedule)
  return base.run_jitted(_square, logits_fn, static, x, labels, key, eps,
                         clip_min, clip_max)


def check_square(*, eps, norm, queries, p_init, rescale_schedule, clip_min,
                 clip_max) -> None:
  """`square`'s config check (the attack contract, `attacks.registry`): every
  config field, keyword-only; ConfigError naming "attack.<field>"."""
  base.check_eps(eps)
  require(norm in base.NORMS, "attack.norm",
          f"must be one of {base.NORMS}, got {norm!r}")
  base.check_int(queries, "attack.queries", 1)
  require(isinstance(p_init, numbers.Real) and not isinstance(p_init, bool)
          and 0 < p_init <= 1, "attack.p_init",
          f"must be a number in (0, 1], got {p_init!r}")
  base.check_bool(rescale_schedule, "attack.rescale_schedule")
  base.check_range(clip_min, clip_max)


def _square(logits_fn, x, labels, key, eps, clip_min, clip_max, **static):
  done = base.misclassified(base.split_output(logits_fn(x), False)[0], labels)
  return square_run(logits_fn, x, labels, key, x, done, eps, clip_min,
                    clip_max, **static)[0]


def square_run(logits_fn: base.LogitsFn, x0: Array, labels: Array, key: Array,
               x_start: Array, done: Array, eps: Any, clip_min: Any,
               clip_max: Any, *, norm: str, queries: int, p_init: float,
               rescale_schedule: bool) -> tuple[Array, dict[str, Array]]:
  """One Square run on a batch, chained after earlier attacks (traceable).

  Args:
    logits_fn: `x [B, H, W, C] -> logits [B, K]`.
    x0: `[B, H, W, C]` clean images, the centres of the eps-balls.
    labels: `[B]` int true labels.
    key: PRNG key of the draws (`init_draws`, `step_draws`).
    x_start: `[B, H, W, C]` the batch's current points; only the `done`
      examples' are used: they sit there in every `logits_fn` call.
    done: `[B]` bool, examples broken earlier: never modified nor counted.
    eps, clip_min, clip_max, norm, queries, p_init, rescale_schedule: as
      `square` (checked there).

  Returns:
    `(x_out [B, H, W, C], {"queries": [B] int32})`: `done` examples at
    `x_start` (0 queries); the others at their first misclassified point,
    else their lowest-margin point, with the queries they used.
  """
  shape = x0.shape
  _, h, w, c = shape
  starts = jnp.asarray(level_starts(queries, rescale_schedule), jnp.int32)
  sizes = [square_size(p_init / 2 ** k, h, w, c, norm) for k in range(LEVELS)]
  size_of_level = jnp.asarray(sizes, jnp.int32)
  if norm == "l2":
    big = max(sizes)
    etas = jnp.asarray(np.stack([
        np.pad(pseudo_gaussian(s), ((0, big - s), (0, big - s)))
        for s in sizes]), x0.dtype)  # [LEVELS, S, S]

  def margin_of(x):
    logits = base.split_output(logits_fn(x), False)[0]
    return base.margin_loss(logits, labels)

  def clip(x):
    return jnp.clip(x, clip_min, clip_max).astype(x0.dtype)

  def attacked(margin):
    return ~done & (margin > 0)

  def body(state):
    i, x_best, margin, used = state
    active = attacked(margin)
    level = jnp.sum(i >= starts)
    s = size_of_level[level]
    draws = step_draws(key, i, s, shape, norm)
    if norm == "linf":
      x_new = clip(_linf_step(x_best, x0, draws, s, eps))
    else:
      x_new = clip(_l2_step(x_best, x0, draws, s, etas[level], eps))
    new_margin = margin_of(base.where_examples(active, x_new, x_best))
    better = active & ((new_margin < margin) | (new_margin <= 0))
    return (i + 1, base.where_examples(better, x_new, x_best),
            jnp.where(better, new_margin, margin),
            used + active.astype(jnp.int32))

  def cond(state):
    i, _, margin, _ = state
    return (i < queries - 1) & jnp.any(attacked(margin))

  x_init = clip(_init(x0, init_draws(key, shape, norm), eps, norm))
  x_best = base.where_examples(done, x_start.astype(x0.dtype), x_init)
  used = jnp.where(done, 0, 1).astype(jnp.int32)
  state = (jnp.zeros((), jnp.int32), x_best, margin_of(x_best), used)
  _, x_best, _, used = jax.lax.while_loop(cond, body, state)
  return x_best, {"queries": used}
