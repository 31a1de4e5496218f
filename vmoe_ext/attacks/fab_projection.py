"""FAB's inner problem: the box-constrained projection onto a hyperplane.

For a point `t` in the box `[lo, hi]^D`, a hyperplane `{z : w.z = b}` and a
norm (Linf or L2), `project_onto_hyperplane` returns

    d* = argmin_d ||d||   s.t.   w.(t + d) = b,   lo <= t + d <= hi.

Derivation. Let `c = w.t - b` and `s = -sign(c)` (`s = -1` when `c = 0`),
the direction in which `w.z` must move. An optimal `d` only moves
coordinates towards the hyperplane: `d_i = s sign(w_i) m_i` with
`0 <= m_i <= cap_i`, where `cap_i` is the room left in the box that way
(`hi - t_i` if `s sign(w_i) > 0`, else `t_i - lo`). The constraint becomes
`sum_i |w_i| m_i = |c|`, and:

* Linf: minimising `max_i m_i`, the optimum is `m_i = min(r, cap_i)` for the
  smallest `r >= 0` with `sum_i |w_i| min(r, cap_i) = |c|` (any coordinate
  below `min(r, cap_i)` would force another one above `r`);
* L2: the KKT conditions of `min sum_i m_i^2 / 2` give
  `m_i = min(lambda |w_i|, cap_i)` with the multiplier `lambda >= 0` solving
  `sum_i |w_i| min(lambda |w_i|, cap_i) = |c|` (the problem is strictly
  convex: this `d*` is the unique minimiser).

Both are `m_i = min(sigma k_i, cap_i)` (`k_i = 1` for Linf, `|w_i|` for L2)
where `sigma >= 0` solves `F(sigma) = |c|` for the nondecreasing, piecewise
linear `F(sigma) = sum_i |w_i| min(sigma k_i, cap_i)`, whose breakpoints are
`sigma_i = cap_i / k_i`. With the breakpoints sorted, `F` at each of them is
a cumulative sum, the segment holding `|c|` is found by counting, and on it
`F(sigma) = A + sigma S` (`A` the saturated terms `|w_i| cap_i`, `S` the
slope `sum |w_i| k_i` of the others): `sigma = (|c| - A) / S`. Exact, no
iteration; `O(D log D)` per point. Coordinates with `w_i = 0` never move
(the Linf optimum is not unique there; 0 is the smallest choice).

When the box does not reach the hyperplane (`|c| >= F(inf) =
sum_i |w_i| cap_i`; equality: only at a corner), the result is
`m_i = cap_i` for every `w_i != 0`: each such coordinate moved to the bound
on the hyperplane's side, i.e. the point of the box where `w.z` is closest
to `b` (others unmoved), as the reference implementation
(fra31/auto-attack, `projection_linf`, `projection_l2`) returns.

The reference's box is `[0, 1]`; here it is `[lo, hi]` (infinite bounds
allowed: no constraint that side).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

Array = jax.Array
# Stands in for infinite room / breakpoints (finite: avoids inf * 0).
BIG = 1e30


def project_onto_hyperplane(t: Array, w: Array, b: Array, lo: Any, hi: Any,
                            norm: str) -> Array:
  """Minimal-`norm` `d [N, D]` with `w.(t + d) = b` and `t + d` in the box.

  Args:
    t: `[N, D]` points, each in `[lo, hi]^D`.
    w: `[N, D]` normals of the hyperplanes (zero rows allowed).
    b: `[N]` offsets: hyperplane `n` is `{z : w[n].z = b[n]}`.
    lo, hi: the box's bounds (scalars, `lo < hi`, may be infinite).
    norm: "linf" or "l2".

  Returns:
    `d [N, D]` float32; if the box does not reach a hyperplane, the move of
    every coordinate with `w_i != 0` to its bound on the hyperplane's side
    (see the module docstring).
  """
  t, w = t.astype(jnp.float32), w.astype(jnp.float32)
  c = jnp.sum(w * t, axis=-1) - b.astype(jnp.float32)  # [N]
  s = jnp.where(c >= 0, -1.0, 1.0)[:, None]
  direction = s * jnp.sign(w)  # [N, D] in {-1, 0, 1}.
  room = jnp.where(direction > 0, hi - t, t - lo)
  cap = jnp.clip(room, 0.0, BIG)
  aw = jnp.abs(w)
  k = jnp.ones_like(aw) if norm == "linf" else aw
  sat = jnp.where(aw > 0, aw * cap, 0.0)  # |w_i| cap_i: F's saturated terms.
  slope = aw * k
  brk = jnp.minimum(cap / jnp.where(k > 0, k, 1.0), BIG)
  brk = jnp.where(k > 0, brk, BIG)

  order = jnp.argsort(brk, axis=-1)
  brk_s = jnp.take_along_axis(brk, order, axis=-1)
  sat_s = jnp.take_along_axis(sat, order, axis=-1)
  slope_s = jnp.take_along_axis(slope, order, axis=-1)
  zero = jnp.zeros_like(c)[:, None]
  # acc[:, j]: saturated terms of the first j breakpoints; rest[:, j]: slope
  # of the others (a reversed cumsum: exactly 0 past the last w_i != 0).
  acc = jnp.concatenate([zero, jnp.cumsum(sat_s, axis=-1)], axis=-1)
  rest = jnp.concatenate(
      [jnp.cumsum(slope_s[:, ::-1], axis=-1)[:, ::-1], zero], axis=-1)
  f_at_brk = acc[:, :-1] + brk_s * rest[:, :-1]  # F(sigma_(j)), [N, D].
  need = jnp.abs(c)
  passed = jnp.sum(f_at_brk <= need[:, None], axis=-1)  # In 0..D.
  a = jnp.take_along_axis(acc, passed[:, None], axis=-1)[:, 0]
  slope_left = jnp.take_along_axis(rest, passed[:, None], axis=-1)[:, 0]
  feasible = (need < acc[:, -1]) & (slope_left > 0)
  sigma = jnp.where(
      feasible,
      jnp.maximum((need - a) / jnp.where(slope_left > 0, slope_left, 1.0),
                  0.0),
      jnp.inf)[:, None]
  move = jnp.where(k > 0, jnp.minimum(sigma * k, cap), 0.0)
  return direction * move
