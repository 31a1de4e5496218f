"""Loop references of Auto-PGD (Croce & Hein 2020), one example at a time in
NumPy, for `tests/test_apgd.py`.

`paper_run` is Algorithm 1 of the paper read literally (histories of the
iterates, the losses and the step sizes; the checkpoints from exact
fractions); `autoattack_run` re-traces the authors' released loop
(fra31/auto-attack `APGDAttack.attack_single_run`: its `loss_steps` array with
the wrap-around index of `check_oscillation`, `counter3`, `k`). Both take the
model as `oracle(x [D]) -> (loss, grad [D], misclassified)` and a given start.
They stop an example at its first misclassified iterate, as `vmoe_ext` does.

A loss comparison between values equal to float32 rounding (the loss of an
iterate that has converged) is decided by rounding, differently in two
implementations: both loops record `ambiguous_at`, the first iteration whose
decisions involved such a near-tie; iterates agree up to there.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np


def paper_checkpoints(n_iter: int) -> list[int]:
  """`w_j = ceil(p_j N_iter)` for j >= 0 while `p_j <= 1`."""
  p = [Fraction(0), Fraction(22, 100)]
  while p[-1] <= 1:
    p.append(p[-1] + max(p[-1] - p[-2] - Fraction(3, 100), Fraction(6, 100)))
  return sorted({math.ceil(q * n_iter) for q in p if q <= 1})


TIE = 2e-6  # Relative difference below which a comparison is a near-tie.


class _Ties:
  """`gt(a, b, k)`: `a > b`, recording the first k with a near-tie."""

  def __init__(self):
    self.first = None

  def gt(self, a, b, k, same=False):
    """`same`: both values are of the same point (no rounding question)."""
    if (not same and abs(a - b) <= TIE * max(abs(a), abs(b), 1e-3)
        and self.first is None):
      self.first = k
    return a > b


def _project(x, x0, eps, norm):
  if norm == "linf":
    x = np.minimum(np.maximum(x, x0 - eps), x0 + eps)
  else:
    d = x - x0
    n = np.sqrt(np.sum(d * d))
    x = x0 + d / (n + 1e-12) * min(eps, n)
  return np.clip(x, 0.0, 1.0)


def _direction(g, norm):
  if norm == "linf":
    return np.sign(g)
  return g / (np.sqrt(np.sum(g * g)) + 1e-12)


def paper_run(oracle, x0, x_start, eps, *, norm, n_iter, rho=0.75,
              alpha=0.75):
  """Algorithm 1. Returns dict of `x [n_iter + 1, D]` (iterates after any
  restart), `eta [n_iter + 1]` (eta used to compute x^(k+1)), `reset`
  (k where x^(k) was replaced by x_max), `x_best`, `f_best`, `broken_at`."""
  W = paper_checkpoints(n_iter)
  ties = _Ties()
  X, F = [x_start.copy()], []
  f, g, mis = oracle(X[0])
  F.append(f)
  G = [g]
  eta = [STEP * eps]
  resets = []
  f_max, x_max, g_max = f, X[0].copy(), g
  f_max_at = {0: f_max}
  eta_at = {0: eta[0]}
  if mis:
    return dict(x=np.stack(X), eta=np.array(eta), reset=resets, x_best=x_max,
                f_best=f_max, broken_at=0, ambiguous_at=None)
  for k in range(0, n_iter):
    a = 1.0 if k == 0 else alpha
    z = _project(X[k] + eta[k] * _direction(G[k], norm), x0, eps, norm)
    prev = X[k - 1] if k > 0 else X[k]
    x_new = _project(X[k] + a * (z - X[k]) + (1 - a) * (X[k] - prev), x0,
                     eps, norm)
    f, g, mis = oracle(x_new)
    X.append(x_new)
    F.append(f)
    G.append(g)
    if mis:
      eta.append(eta[k])
      return dict(x=np.stack(X), eta=np.array(eta), reset=resets,
                  x_best=x_max, f_best=f_max, broken_at=k + 1,
                  ambiguous_at=ties.first)
    if ties.gt(f, f_max, k, np.array_equal(x_new, x_max)):
      f_max, x_max, g_max = f, x_new.copy(), g
    new_eta = eta[k]
    if k in W and k > 0:
      j = W.index(k)
      lo, hi = W[j - 1], W[j]
      increases = sum(ties.gt(F[i + 1], F[i], k,
                              np.array_equal(X[i + 1], X[i]))
                      for i in range(lo, hi))
      cond1 = increases < rho * (hi - lo)
      cond2 = eta_at[lo] == eta[k] and f_max_at[lo] == f_max
      if cond1 or cond2:
        new_eta = eta[k] / 2
        X[k + 1], F[k + 1], G[k + 1] = x_max.copy(), f_max, g_max
        resets.append(k + 1)
      f_max_at[k] = f_max
      eta_at[k] = eta[k]  # eta^(w_j): before this checkpoint's halving.
    eta.append(new_eta)
  return dict(x=np.stack(X), eta=np.array(eta), reset=resets, x_best=x_max,
              f_best=f_max, broken_at=None, ambiguous_at=ties.first)


STEP = 2.0


def autoattack_run(oracle, x0, x_start, eps, *, norm, n_iter, rho=0.75):
  """The released loop, as its variables go (one example)."""
  ties = _Ties()
  n_iter_2 = max(int(0.22 * n_iter), 1)
  n_iter_min = max(int(0.06 * n_iter), 1)
  size_decr = max(int(0.03 * n_iter), 1)
  x_adv = x_start.copy()
  loss, grad, mis = oracle(x_adv)
  X, eta_hist, resets = [x_adv.copy()], [], []
  x_best, grad_best, loss_best = x_adv.copy(), grad, loss
  if mis:
    return dict(x=np.stack(X), eta=np.array([STEP * eps]), reset=resets,
                x_best=x_best, f_best=loss_best, broken_at=0, ambiguous_at=None)
  step = STEP * eps
  x_old = x_adv.copy()
  k = n_iter_2
  counter3 = 0
  loss_steps = np.zeros(n_iter)
  points = [None] * n_iter  # The (pre-restart) point of each loss_steps.
  best_last, reduced_last = loss_best, 1.0
  for i in range(n_iter):
    eta_hist.append(step)
    grad2 = x_adv - x_old
    x_old = x_adv.copy()
    a = 0.75 if i > 0 else 1.0
    x1 = _project(x_adv + step * _direction(grad, norm), x0, eps, norm)
    x_adv = _project(x_adv + (x1 - x_adv) * a + grad2 * (1 - a), x0, eps,
                     norm)
    loss, grad, mis = oracle(x_adv)
    if mis:
      X.append(x_adv.copy())
      eta_hist.append(step)
      return dict(x=np.stack(X), eta=np.array(eta_hist), reset=resets,
                  x_best=x_best, f_best=loss_best, broken_at=i + 1,
                  ambiguous_at=ties.first)
    loss_steps[i] = loss
    points[i] = x_adv.copy()
    if ties.gt(loss, loss_best, i, np.array_equal(x_adv, x_best)):
      x_best, grad_best, loss_best = x_adv.copy(), grad, loss
    counter3 += 1
    if counter3 == k:
      t = sum(ties.gt(loss_steps[i - c], loss_steps[i - c - 1], i,
                      points[i - c - 1] is None or np.array_equal(
                          points[i - c], points[i - c - 1]))
              for c in range(k))
      osc = t <= k * rho
      no_impr = (1.0 - reduced_last) * (best_last >= loss_best)
      osc = osc or no_impr > 0
      reduced_last = float(osc)
      best_last = loss_best
      if osc:
        step /= 2.0
        x_adv = x_best.copy()
        grad = grad_best
        resets.append(i + 1)
      k = max(k - size_decr, n_iter_min)
      counter3 = 0
    X.append(x_adv.copy())
  eta_hist.append(step)
  return dict(x=np.stack(X), eta=np.array(eta_hist), reset=resets,
              x_best=x_best, f_best=loss_best, broken_at=None,
              ambiguous_at=ties.first)
