"""FAB-T: the box-constrained projections against independent solvers
(`scipy.optimize.linprog`, KKT bisection), the step and the whole attack
against a NumPy implementation on a linear model, the closed-form minimal
distance of a linear model, the batch invariants and argument errors."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy.optimize import linprog

from vmoe_ext.attacks import base
from vmoe_ext.attacks import fab as fab_lib
from vmoe_ext.attacks import registry
from vmoe_ext.attacks.fab_projection import project_onto_hyperplane
from vmoe_ext.errors import ConfigError

B, SHAPE, C = 8, (4, 4, 1), 5
D = int(np.prod(SHAPE))
NORMS = ("linf", "l2")


def linear_apply(params, x):
  """Linear model `[B, 4, 4, 1] -> [B, C]`: `x W + b`."""
  return x.reshape(x.shape[0], -1) @ params["w"] + params["b"]


def mlp_apply(params, x):
  """2-layer tanh MLP `[B, 4, 4, 1] -> [B, C]`."""
  h = jnp.tanh(x.reshape(x.shape[0], -1) @ params["w1"] + params["b1"])
  return h @ params["w2"]


_RNG = np.random.default_rng(0)
LINEAR = dict(w=_RNG.normal(size=(D, C)).astype(np.float32),
              b=(0.1 * _RNG.normal(size=C)).astype(np.float32))
MLP = dict(w1=jnp.asarray(_RNG.normal(size=(D, 16)) / 4.0, jnp.float32),
           b1=jnp.asarray(0.1 * _RNG.normal(size=16), jnp.float32),
           w2=jnp.asarray(2.0 * _RNG.normal(size=(16, C)), jnp.float32))
# Module-level function objects: each jitted attack compiles once.
linear_fn = functools.partial(linear_apply, jax.tree.map(jnp.asarray, LINEAR))
mlp_fn = functools.partial(mlp_apply, MLP)
SEEN = []  # The batches `recording_mlp_fn` was called on.


def recording_mlp_fn(x):
  jax.debug.callback(lambda v: SEEN.append(np.asarray(v)), x)
  return mlp_fn(x)
project = jax.jit(project_onto_hyperplane, static_argnames="norm")
step = jax.jit(fab_lib.fab_step, static_argnames="norm")
start_point = jax.jit(fab_lib.start_point, static_argnames="norm")


@functools.partial(jax.jit, static_argnames=("norm", "restarts"))
def mlp_run(x0, labels, key, x_start, done, eps, *, norm, restarts):
  return fab_lib.fab_run(recording_mlp_fn, x0, labels, key, x_start, done,
                         eps, 0.0, 1.0, norm=norm, steps=10, target_classes=1,
                         restarts=restarts, alpha_max=0.1, eta=1.05, beta=0.9)


# --- Independent NumPy solvers ------------------------------------------------


def np_project(t, w, b, lo, hi, norm):
  """Float64 minimal-norm `d` with `w.(t + d) = b`, `lo <= t + d <= hi`, by
  bisection: Linf on the radius `r` of `d_i = clip(-mu r sign(w_i))` (mu the
  side of the hyperplane), L2 on the KKT multiplier (`d = clip(-lam w)`).
  Returns `(d, feasible)`."""
  t, w = np.asarray(t, np.float64), np.asarray(w, np.float64)
  c = w @ t - b
  side = 1.0 if c >= 0 else -1.0
  shape = np.sign(w) if norm == "linf" else w

  def d_of(scale):
    return np.clip(-side * scale * shape, lo - t, hi - t)

  def gap(scale):  # Decreasing |.| of w.(t + d) - b as scale grows.
    return side * (c + w @ d_of(scale))

  far = 1e8
  if gap(far) > 0:  # The box does not reach the hyperplane.
    return d_of(far), False
  a, z = 0.0, far
  for _ in range(64):  # 1e8 / 2^64 ~ 5e-12.
    mid = 0.5 * (a + z)
    a, z = (mid, z) if gap(mid) > 0 else (a, mid)
  return d_of(z), True


def linf_radius_linprog(t, w, b, lo, hi):
  """`min r s.t. |d_i| <= r, w.d = b - w.t, lo <= t + d <= hi` (HiGHS)."""
  n = t.size
  cost = np.r_[np.zeros(n), 1.0]
  eye = np.eye(n)
  a_ub = np.block([[eye, -np.ones((n, 1))], [-eye, -np.ones((n, 1))]])
  bounds = [(lo - ti, hi - ti) for ti in t] + [(0, None)]
  res = linprog(cost, A_ub=a_ub, b_ub=np.zeros(2 * n),
                A_eq=np.r_[w, 0.0][None], b_eq=[b - w @ t], bounds=bounds)
  assert res.status == 0, res.message
  return res.fun


def _cases(seed, n, dim, lo, hi):
  """Points in the box (some coordinates on its bounds), weights (some zero,
  one row all zero but one), offsets of reachable hyperplanes (one through
  the point itself)."""
  rng = np.random.default_rng(seed)
  t = rng.uniform(lo, hi, (n, dim))
  u = rng.uniform(size=t.shape)
  t = np.where(u < 0.15, lo, np.where(u > 0.85, hi, t))
  w = rng.normal(size=(n, dim)) * (rng.uniform(size=(n, dim)) > 0.2)
  w[0, 1:] = 0.0
  w[0, 0] = 1.5
  z = rng.uniform(lo, hi, (n, dim))  # A box point on each hyperplane.
  b = np.sum(w * z, -1)
  b[1] = w[1] @ t[1]
  return t.astype(np.float32), w.astype(np.float32), b.astype(np.float32)


# --- The projections ----------------------------------------------------------


@pytest.mark.parametrize("lo,hi", [(0.0, 1.0), (-1.0, 2.0)])
def test_linf_projection_matches_linprog(lo, hi):
  t, w, b = _cases(1, 24, 7, lo, hi)
  d = np.asarray(project(t, w, b, lo, hi, norm="linf"), np.float64)
  for i in range(len(t)):
    r = linf_radius_linprog(t[i], w[i], b[i], lo, hi)
    np.testing.assert_allclose(np.max(np.abs(d[i])), r, atol=2e-6)
    np.testing.assert_allclose(w[i] @ (t[i] + d[i]), b[i], atol=2e-5)
    assert np.all(t[i] + d[i] >= lo - 1e-6) and np.all(t[i] + d[i] <= hi
                                                        + 1e-6)
    # The reference's minimiser: every coordinate with w_i != 0 moves by
    # min(r, room), none other.
    expected, feasible = np_project(t[i], w[i], b[i], lo, hi, "linf")
    assert feasible
    np.testing.assert_allclose(d[i], expected, atol=2e-6)
  # Zero weights never move; a point on its hyperplane (up to rounding)
  # barely moves.
  assert np.all(d[0, 1:] == 0.0) and np.max(np.abs(d[1])) < 1e-6


@pytest.mark.parametrize("lo,hi", [(0.0, 1.0), (-1.0, 2.0)])
def test_l2_projection_matches_kkt(lo, hi):
  t, w, b = _cases(2, 24, 7, lo, hi)
  d = np.asarray(project(t, w, b, lo, hi, norm="l2"), np.float64)
  for i in range(len(t)):
    expected, feasible = np_project(t[i], w[i], b[i], lo, hi, "l2")
    assert feasible
    np.testing.assert_allclose(d[i], expected, atol=2e-6)
    np.testing.assert_allclose(w[i] @ (t[i] + d[i]), b[i], atol=2e-5)
  # Zero weights never move; a point on its hyperplane (up to rounding)
  # barely moves.
  assert np.all(d[0, 1:] == 0.0) and np.max(np.abs(d[1])) < 1e-6


@pytest.mark.parametrize("norm", NORMS)
def test_projection_without_box_is_the_closed_form(norm):
  t, w, b = _cases(4, 24, 7, -1.0, 2.0)
  d = np.asarray(project(t, w, b, -np.inf, np.inf, norm=norm), np.float64)
  c = (np.sum(w * t, -1) - b)[:, None]
  if norm == "linf":  # -c sign(w) / ||w||_1 on every coordinate w_i != 0.
    expected = -c * np.sign(w) / np.sum(np.abs(w), -1, keepdims=True)
  else:  # -c w / ||w||_2^2.
    expected = -c * w / np.sum(w * w, -1, keepdims=True)
  np.testing.assert_allclose(d, expected, atol=2e-6)


@pytest.mark.parametrize("norm", NORMS)
def test_projection_out_of_reach_moves_to_the_nearest_corner(norm):
  t, w, _ = _cases(3, 24, 7, 0.0, 1.0)
  top = np.sum(np.maximum(w, 0.0), -1)  # max of w.z over [0, 1]^D.
  bottom = np.sum(np.minimum(w, 0.0), -1)
  # Above the box, below it, and exactly at the top corner.
  b = np.r_[top[:8] + 1.0, bottom[8:16] - 1.0, top[16:]].astype(np.float32)
  d = np.asarray(project(t, w, b, 0.0, 1.0, norm=norm))
  up = (np.arange(24) < 8) | (np.arange(24) >= 16)
  corner = np.where(w == 0, t, np.where((w > 0) == up[:, None], 1.0, 0.0))
  np.testing.assert_allclose(t + d, corner, atol=1e-5)
  for i in range(16):
    assert not np_project(t[i], w[i], b[i], 0.0, 1.0, norm)[1]


# --- One step and the whole attack on a linear model --------------------------


def np_fab_step(x, x0, g, grad, norm, alpha_max=0.1, eta=1.05, lo=0.0,
                hi=1.0):
  """Steps 1-3 of FAB (the paper / fra31/auto-attack) for one example."""
  size = np.max if norm == "linf" else np.linalg.norm
  w = grad.ravel()
  offset = w @ x.ravel() - g
  d1, _ = np_project(x.ravel(), w, offset, lo, hi, norm)
  d2, _ = np_project(x0.ravel(), w, offset, lo, hi, norm)
  a1 = max(size(np.abs(d1)), 1e-8)
  a2 = max(size(np.abs(d2)), 1e-8)
  alpha = min(max(a1 / (a1 + a2), 0.0), alpha_max)
  new = (x.ravel() + eta * d1) * (1 - alpha) + (x0.ravel() + eta * d2) * alpha
  return np.clip(new, lo, hi).reshape(x.shape)


def _images(seed, b=B, lo=0.0, hi=1.0):
  rng = np.random.default_rng(seed)
  return rng.uniform(lo, hi, (b,) + SHAPE).astype(np.float32)


@pytest.mark.parametrize("norm", NORMS)
def test_fab_step_matches_numpy(norm):
  x, x0 = _images(4), _images(5)
  x[:, 0, 0, 0] = 1.0  # On the box's bound.
  rng = np.random.default_rng(6)
  y = rng.integers(0, C, B)
  t = (y + rng.integers(1, C, B)) % C
  logits = np.asarray(linear_fn(x))
  g = logits[np.arange(B), t] - logits[np.arange(B), y]
  grad = (LINEAR["w"][:, t] - LINEAR["w"][:, y]).T.reshape(x.shape)
  got = np.asarray(step(x, x0, g, grad, norm=norm, alpha_max=0.1, eta=1.05,
                        clip_min=0.0, clip_max=1.0))
  for i in range(B):
    expected = np_fab_step(x[i], x0[i], g[i], grad[i], norm)
    np.testing.assert_allclose(got[i], expected, atol=5e-6)


def np_fab_t(x0, y, eps, norm, steps, target_classes, beta=0.9):
  """FAB-T (fra31/auto-attack's `perturb` with `targeted=True`, one restart)
  on one example of the linear model (no coupling between examples)."""
  size = (lambda v: np.max(np.abs(v))) if norm == "linf" else np.linalg.norm
  logits_of = lambda z: z.ravel() @ LINEAR["w"] + LINEAR["b"]  # noqa: E731
  wrong = lambda z: np.argmax(logits_of(z)) != y  # noqa: E731
  if wrong(x0):
    return x0
  order = np.argsort(-logits_of(x0), kind="stable")
  for t in order[1:target_classes + 1]:
    x, best, best_dist = x0.copy(), None, np.inf
    grad = (LINEAR["w"][:, t] - LINEAR["w"][:, y]).reshape(x0.shape)
    for _ in range(steps):
      g = logits_of(x)[t] - logits_of(x)[y]
      x = np_fab_step(x, x0, g, grad, norm)
      if wrong(x):
        if size(x - x0) < best_dist:
          best, best_dist = x.copy(), size(x - x0)
        x = x0 + beta * (x - x0)
    if best_dist <= eps and wrong(best):
      return best
  return x0


@pytest.mark.parametrize("norm,eps", [("linf", 0.07), ("l2", 0.225)])
def test_fab_matches_numpy_on_linear_model(norm, eps):
  x = _images(14, lo=0.2, hi=0.8)
  labels = np.argmax(np.asarray(linear_fn(x)), -1)
  labels[0] = (labels[0] + 1) % C  # Misclassified at the clean image.
  got = fab_lib.fab(linear_fn, x, jnp.asarray(labels), eps=eps, norm=norm,
                    steps=3, target_classes=2)
  assert got.shape == x.shape and got.dtype == x.dtype
  got = np.asarray(got)
  broken_by = []
  for i in range(B):
    expected = np_fab_t(x[i], labels[i], eps, norm, 3, 2)
    np.testing.assert_allclose(got[i], expected, atol=1e-5)
    first = np_fab_t(x[i], labels[i], eps, norm, 3, 1)
    broken_by.append(0 if np.array_equal(expected, x[i])
                     else 1 if np.array_equal(first, expected) else 2)
  assert np.array_equal(got[0], x[0])
  # Examples broken by the first target, by the second, and not broken.
  assert {0, 1, 2} <= set(broken_by[1:]), broken_by


@pytest.mark.parametrize("norm", NORMS)
def test_linear_model_distance_near_closed_form_minimum(norm):
  x = _images(8, lo=0.3, hi=0.7)
  logits = np.asarray(linear_fn(x))
  y = np.argmax(logits, -1)
  got = np.asarray(fab_lib.fab(linear_fn, x, jnp.asarray(y), eps=10.0,
                               norm=norm, steps=30, target_classes=2))
  dist = np.asarray(fab_lib.distance(got, x, norm))
  assert np.all(np.argmax(linear_fn(got), -1) != y)
  # Distance of x0 to the hyperplane f_j = f_y (no box): |gap| / ||w||_dual.
  w = LINEAR["w"]
  normal = w.T[None] - w.T[y][:, None]  # [B, C, D]
  dual = (np.sum(np.abs(normal), -1) if norm == "linf"
          else np.linalg.norm(normal, axis=-1))
  with np.errstate(divide="ignore", invalid="ignore"):
    to_plane = (logits[np.arange(B), y][:, None] - logits) / dual
  to_plane[np.arange(B), y] = np.inf
  target = np.argsort(-logits, -1, kind="stable")[:, 1]
  # The box is not active at the target's projection, so the minimum over
  # the box is the closed form.
  n_t = normal[np.arange(B), target]
  unit = (np.sign(n_t) if norm == "linf"
          else n_t / np.linalg.norm(n_t, axis=-1, keepdims=True))
  reach = x.reshape(B, -1) + unit * to_plane[np.arange(B), target][:, None]
  assert np.all((reach > 0) & (reach < 1))
  assert np.all(dist >= np.min(to_plane, -1) * (1 - 1e-5))
  assert np.all(dist <= 1.01 * to_plane[np.arange(B), target])


# --- Invariants ---------------------------------------------------------------


def test_run_invariants_on_mlp():
  eps = 0.1
  x0 = _images(9)
  labels = np.array(jnp.argmax(mlp_fn(x0), -1))
  labels[1] = (labels[1] + 2) % C  # Misclassified at the clean image.
  done = np.zeros(B, bool)
  done[[2, 5]] = True
  rng = np.random.default_rng(10)
  x_start = np.clip(x0 + rng.uniform(-0.05, 0.05, x0.shape), 0, 1)
  x_start = x_start.astype(np.float32)
  outs = {}
  for restarts in (1, 2):
    SEEN.clear()
    x_out, info = mlp_run(x0, labels, jax.random.key(0), x_start, done, eps,
                          norm="linf", restarts=restarts)
    jax.effects_barrier()
    # Whole batches only, done examples at x_start in every call: the clean
    # batch, then per run 10 steps of 2 calls and the check of its points.
    assert len(SEEN) in range(22, 1 + 21 * restarts + 1)
    for seen in SEEN:
      assert seen.shape == x0.shape
      np.testing.assert_array_equal(seen[done], x_start[done])
    x_out, dist = np.asarray(x_out), np.asarray(info["distance"])
    broken = np.asarray(info["broken"])
    outs[restarts] = x_out, broken
    own = np.max(np.abs(x_out - x0).reshape(B, -1), -1)
    wrong = np.asarray(base.misclassified(mlp_fn(x_out), labels))
    assert np.all((x_out >= 0) & (x_out <= 1))
    np.testing.assert_array_equal(x_out[done], x_start[done])
    np.testing.assert_array_equal(x_out[~broken], x_start[~broken])
    assert not np.any(broken & done)
    assert np.all(wrong[broken]) and np.all(own[broken] <= eps)
    np.testing.assert_allclose(dist[broken], own[broken], atol=1e-6)
    assert np.all(dist[~broken & ~done] > eps)
    assert np.all(np.isinf(dist[done]))
    np.testing.assert_array_equal(x_out[1], x0[1])  # Broken at distance 0.
    assert broken[1] and dist[1] == 0.0
    assert 1 < np.sum(broken) < B - 2
  # The first restart starts at x0, as the one-restart run: the examples
  # it breaks are broken alike; the second runs on the others.
  (x1, broken1), (x2, broken2) = outs[1], outs[2]
  assert np.all(broken2[broken1])
  np.testing.assert_allclose(x2[broken1], x1[broken1], atol=1e-6)


@pytest.mark.parametrize("norm", NORMS)
def test_random_start_is_at_half_eps(norm):
  x0 = jnp.asarray(_images(12, lo=0.3, hi=0.7))
  start = np.asarray(start_point(jax.random.key(1), x0, 0.2, norm, 0.0, 1.0))
  delta = (start - np.asarray(x0)).reshape(B, -1)
  size = (np.max(np.abs(delta), -1) if norm == "linf"
          else np.linalg.norm(delta, axis=-1))
  np.testing.assert_allclose(size, 0.1, rtol=1e-5)
  assert np.all(np.abs(delta) > 0) and np.unique(np.sign(delta)).size == 2
  clipped = np.asarray(start_point(jax.random.key(1), x0, 2.0, norm, 0.0, 1.0))
  unclipped = np.asarray(x0) + 10.0 * delta.reshape(x0.shape)
  assert np.any(unclipped > 1.0) and np.any(unclipped < 0.0)
  np.testing.assert_allclose(clipped, np.clip(unclipped, 0.0, 1.0),
                             atol=1e-5)


# --- Errors -------------------------------------------------------------------

GOOD = dict(eps=0.1, norm="linf", steps=2, target_classes=2, restarts=1,
            alpha_max=0.1, eta=1.05, beta=0.9, clip_min=0.0, clip_max=1.0)


@pytest.mark.parametrize("field,value", [
    ("eps", -0.1), ("norm", "l1"), ("steps", 0), ("target_classes", 0),
    ("restarts", 1.5), ("alpha_max", 1.5), ("alpha_max", "0.1"),
    ("eta", 0.9), ("eta", float("inf")), ("beta", 0.0), ("beta", 1.1),
    ("clip_min", 1.0)])
def test_config_errors_name_the_field(field, value):
  with pytest.raises(ConfigError) as err:
    fab_lib.check_fab(**{**GOOD, field: value})
  assert err.value.field == f"attack.{field}"
  fab_lib.check_fab(**GOOD)  # The good config passes.


def test_follows_the_attack_contract():
  spec = registry.AttackSpec(fab_lib.fab, fab_lib.check_fab)
  registry.check_contract("fab", spec)  # Raises TypeError otherwise.
  assert set(registry.config_fields(fab_lib.fab)) == set(GOOD)


def test_call_time_errors():
  x = _images(11)
  y = jnp.zeros(B, jnp.int32)
  with pytest.raises(ConfigError) as err:
    fab_lib.fab(linear_fn, x, y, eps=0.1, target_classes=C)
  assert err.value.field == "attack.target_classes"
  with pytest.raises(ConfigError) as err:
    fab_lib.fab(linear_fn, x, y, eps=0.1, restarts=2)
  assert err.value.field == "attack.key"
