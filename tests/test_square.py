"""Square attack: the p schedule and square sides against hand tables, the
pseudo-Gaussian against a closed form, the Linf and L2 runs against a
per-example NumPy loop fed the same draws, invariants (ball, range, done
examples, queries) and argument errors."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from vmoe_ext.attacks import registry, square
from vmoe_ext.errors import ConfigError, InputError

B, SHAPE, K, HIDDEN = 8, (10, 10, 2), 4, 8
D = int(np.prod(SHAPE))
QUERIES = 40  # Rescaled schedule: p drops to p_init / 8 at iteration 1.
KEY = jax.random.key(3)
# Compile without backend optimisation: the PRNG's kernels otherwise
# dominate the file's runtime (same semantics, float tolerance).
FAST = {"xla_backend_optimization_level": 0,
        "xla_llvm_disable_expensive_passes": True}


def model(params, x):
  """`tanh(x W1 + b1) W2 + x W3 + b3`: an MLP (`W3 = 0`) or a linear model
  (`W1 = W2 = 0`) with one compiled attack for both. `x [B, 10, 10, 2]`."""
  f = x.reshape(x.shape[0], -1)
  return jnp.tanh(f @ params["w1"] + params["b1"]) @ params["w2"] + (
      f @ params["w3"] + params["b3"])


def np_model(params, x):
  """`model` of one image `x [10, 10, 2]` in float64."""
  p = {k: np.asarray(v, np.float64) for k, v in params.items()}
  f = x.reshape(-1)
  return np.tanh(f @ p["w1"] + p["b1"]) @ p["w2"] + f @ p["w3"] + p["b3"]


def np_margin(params, x, y):
  z = np_model(params, x)
  return z[y] - np.max(np.delete(z, y))


def _mlp(seed=0):
  r = np.random.default_rng(seed)
  return {k: jnp.asarray(v, jnp.float32) for k, v in dict(
      w1=r.normal(size=(D, HIDDEN)) * 3 / np.sqrt(D),
      b1=r.normal(size=HIDDEN) * 0.1, w2=r.normal(size=(HIDDEN, K)) * 2,
      w3=np.zeros((D, K)), b3=np.zeros(K)).items()}


def _linear():
  """Class 0's logit is `0.5 + 50 / D (sum of the top half's pixels - sum of
  the bottom half's)`, class 1's the constant 0.48: vertical stripes (the
  Linf init) leave it unchanged, one pixel moved by 2 eps moves it by
  `100 eps / D`."""
  rows = np.where(np.arange(SHAPE[0]) < SHAPE[0] // 2, 1.0, -1.0)
  w3 = np.zeros((D, K))
  w3[:, 0] = (50.0 / D * rows[:, None, None] * np.ones(SHAPE)).reshape(-1)
  return {k: jnp.asarray(v, jnp.float32) for k, v in dict(
      w1=np.zeros((D, HIDDEN)), b1=np.zeros(HIDDEN),
      w2=np.zeros((HIDDEN, K)), w3=w3,
      b3=np.array([0.5, 0.48, -1.0, -1.0])).items()}


MLP, LINEAR = _mlp(), _linear()


def _images(seed):
  """Images in [0, 1] with some pixels exactly on the bounds."""
  r = np.random.default_rng(seed)
  x = r.uniform(size=(B,) + SHAPE)
  u = r.uniform(size=x.shape)
  return np.where(u < 0.1, 0.0, np.where(u > 0.9, 1.0, x)).astype(np.float32)


def _fast_jit(fn, *args):
  return jax.jit(fn).lower(*args).compile(FAST)


# -- The schedule ------------------------------------------------------------

# (iteration, queries, rescale_schedule, p_init / p): the reference's
# thresholds 10 < it <= 50 -> /2, ... 8000 < it -> /512, it = i * 10000 / n.
P_TABLE = [
    (0, 10000, True, 1), (10, 10000, True, 1), (11, 10000, True, 2),
    (50, 10000, True, 2), (51, 10000, True, 4), (200, 10000, True, 4),
    (201, 10000, True, 8), (500, 10000, True, 8), (501, 10000, True, 16),
    (1000, 10000, True, 16), (1001, 10000, True, 32), (2001, 10000, True, 64),
    (4000, 10000, True, 64), (4001, 10000, True, 128), (6001, 10000, True, 256),
    (8000, 10000, True, 256), (8001, 10000, True, 512),
    (9999, 10000, True, 512),
    (5, 5000, True, 1), (6, 5000, True, 2), (25, 5000, True, 2),
    (26, 5000, True, 4), (100, 5000, True, 4), (101, 5000, True, 8),
    (4000, 5000, True, 256), (4001, 5000, True, 512),
    (4999, 5000, True, 512),
    (11, 5000, False, 2), (4001, 5000, False, 128), (4999, 5000, False, 128),
    (1, 1000, True, 1), (2, 1000, True, 2),
    (0, 40, True, 1), (1, 40, True, 8), (3, 40, True, 16), (5, 40, True, 32),
    (39, 40, True, 512),
]


def ref_p(i, queries, p_init=0.8, rescale=True):
  it = int(i / queries * 10000) if rescale else i
  for bound, div in ((8000, 512), (6000, 256), (4000, 128), (2000, 64),
                     (1000, 32), (500, 16), (200, 8), (50, 4), (10, 2)):
    if it > bound:
      return p_init / div
  return p_init


def ref_side(p, h, w, c, norm):
  s = int(round(math.sqrt(p * h * w * c / c)))
  if norm == "l2":
    s = max(s, 3)
    s = s + 1 if s % 2 == 0 else s
  return min(max(s, 1), h, w)


@pytest.mark.parametrize("i,queries,rescale,div", P_TABLE)
def test_p_selection_matches_the_reference_thresholds(i, queries, rescale,
                                                      div):
  assert square.p_selection(i, queries, 0.8, rescale) == 0.8 / div
  assert ref_p(i, queries, 0.8, rescale) == 0.8 / div


@pytest.mark.parametrize("queries,rescale", [(40, True), (5000, True),
                                             (5000, False), (37, True),
                                             (1, True)])
def test_level_starts_reproduce_p_selection(queries, rescale):
  starts = np.asarray(square.level_starts(queries, rescale))
  got = [0.8 / 2 ** int(np.sum(i >= starts)) for i in range(queries - 1)]
  assert got == [ref_p(i, queries, 0.8, rescale) for i in range(queries - 1)]


# (p, H, W, C, norm, side) by hand: round(sqrt(p H W)), L2 >= 3 and odd.
SIDES = [
    (0.8, 10, 10, 2, "linf", 9), (0.4, 10, 10, 2, "linf", 6),
    (0.2, 10, 10, 2, "linf", 4), (0.1, 10, 10, 2, "linf", 3),
    (0.025, 10, 10, 2, "linf", 2), (0.0125, 10, 10, 2, "linf", 1),
    (0.8 / 512, 10, 10, 2, "linf", 1), (0.0625, 10, 10, 1, "linf", 2),
    (0.8, 32, 32, 3, "linf", 29), (0.8 / 512, 32, 32, 3, "linf", 1),
    (0.8, 10, 10, 2, "l2", 9), (0.4, 10, 10, 2, "l2", 7),
    (0.2, 10, 10, 2, "l2", 5), (0.025, 10, 10, 2, "l2", 3),
    (0.8, 4, 4, 1, "l2", 4), (0.8, 4, 4, 1, "linf", 4),
]


@pytest.mark.parametrize("p,h,w,c,norm,side", SIDES)
def test_square_size_table(p, h, w, c, norm, side):
  assert square.square_size(p, h, w, c, norm) == side
  assert ref_side(p, h, w, c, norm) == side


# -- The pseudo-Gaussian and the L2 grid ---------------------------------------


def ref_half(rows, cols):
  """Closed form: pixel (i, j) lies in the rectangles k >= max(|i - r|,
  |j - c|), each adding 1 / (k + 1)^2; unit norm."""
  out = np.zeros((rows, cols))
  if rows == 0:
    return out
  r, c = rows // 2, cols // 2
  for i in range(rows):
    for j in range(cols):
      out[i, j] = sum(1 / (k + 1) ** 2 for k in range(
          max(abs(i - r), abs(j - c)), max(r, c) + 1))
  return out / np.linalg.norm(out)


def ref_eta(s):
  out = np.concatenate([ref_half(s // 2, s), -ref_half(s - s // 2, s)])
  return out / np.linalg.norm(out)


def test_pseudo_gaussian_matches_closed_form_and_hand_values():
  top = np.array([0.25, 1.25, 0.25]) / np.sqrt(1.6875)
  bottom = np.array([[0.25] * 3, [0.25, 1.25, 0.25]]) / np.sqrt(1.875)
  hand = np.concatenate([top[None], -bottom]) / np.sqrt(2)
  np.testing.assert_allclose(ref_eta(3), hand, atol=1e-12)
  np.testing.assert_allclose(square.pseudo_gaussian(1), [[-1.0]])
  for s in range(1, 12):
    np.testing.assert_allclose(square.pseudo_gaussian(s), ref_eta(s),
                               atol=1e-12)


def test_l2_grid_matches_the_reference_layout():
  # Reference: side h // 5, first square at (h - 5 side) // 2.
  assert square.l2_grid(10, 10) == ([0, 2, 4, 6, 8], [0, 2, 4, 6, 8], 2)
  assert square.l2_grid(32, 32) == ([1, 7, 13, 19, 25],) * 2 + (6,)
  assert square.l2_grid(224, 224) == ([2, 46, 90, 134, 178],) * 2 + (44,)
  # Side 1 at h = 9: the reference's squares 9, 10 fall outside the image.
  assert square.l2_grid(9, 9) == ([2, 3, 4, 5, 6, 7, 8],) * 2 + (1,)


# -- The runs against a NumPy loop fed the same draws ------------------------


@functools.lru_cache(maxsize=None)
def _run(norm):
  """`square_run` on `model`, compiled once per norm (params traced)."""
  def run(params, x0, y, key, x_start, done, eps, lo, hi):
    return square.square_run(lambda z: model(params, z), x0, y, key, x_start,
                             done, eps, lo, hi, norm=norm, queries=QUERIES,
                             p_init=0.8, rescale_schedule=True)
  x = jnp.zeros((B,) + SHAPE)
  f32 = jnp.float32(0)
  return _fast_jit(run, MLP, x, jnp.zeros(B, jnp.int32), KEY, x,
                   jnp.zeros(B, bool), f32, f32, f32)


def run(norm, params, x0, y, x_start, done, eps, lo=0.0, hi=1.0):
  out, info = _run(norm)(params, jnp.asarray(x0), jnp.asarray(y, jnp.int32),
                         KEY, jnp.asarray(x_start), jnp.asarray(done),
                         jnp.float32(eps), jnp.float32(lo), jnp.float32(hi))
  return np.asarray(out), np.asarray(info["queries"])


@functools.lru_cache(maxsize=None)
def _draws():
  """All iterations' draws at once and both inits (one compile)."""
  def draws(key, iters, sides):
    steps = jax.vmap(lambda i, s: square.step_draws(
        key, i, s, (B,) + SHAPE, "l2"))(iters, sides)
    inits = {n: square.init_draws(key, (B,) + SHAPE, n)
             for n in ("linf", "l2")}
    return steps, inits
  i = jnp.zeros(QUERIES - 1, jnp.int32)
  return _fast_jit(draws, KEY, i, i)


def ref_run(params, x0, y, x_start, done, eps, norm, lo=0.0, hi=1.0):
  """Per-example NumPy Square (the paper's algorithm, the reference code's
  formulas) on the draws of `square.init_draws` / `step_draws`."""
  h, w, c = SHAPE
  iters = QUERIES - 1
  sides = [ref_side(ref_p(i, QUERIES), h, w, c, norm) for i in range(iters)]
  steps, inits = jax.tree.map(np.asarray, _draws()(
      KEY, jnp.arange(iters, dtype=jnp.int32),
      jnp.asarray(sides, jnp.int32)))
  init = inits[norm]
  for i, s in enumerate(sides):  # The documented ranges of the draws.
    for v in ("vh", "vw", "vh2", "vw2"):
      assert np.all((steps[v][i] >= 0) & (steps[v][i] < max(h - s, 1)))
  assert set(np.unique(steps["signs"])) <= {-1.0, 1.0}
  x0 = np.asarray(x0, np.float64)
  l2 = lambda d: np.sqrt(np.sum(d ** 2))  # noqa: E731
  outs, used = [], []
  for e in range(B):
    if done[e]:
      outs.append(np.asarray(x_start[e], np.float64))
      used.append(0)
      continue
    if norm == "linf":  # Stripes: one sign per column and channel.
      xb = np.clip(x0[e] + eps * init["signs"][e], lo, hi)
    else:  # 5 x 5 grid of 2 x 2 pseudo-Gaussians, one sign per channel.
      delta = np.zeros(SHAPE)
      for gi in range(5):
        for gj in range(5):
          eta = ref_eta(2).T if init["transpose"][e, gi, gj] else ref_eta(2)
          delta[2 * gi:2 * gi + 2, 2 * gj:2 * gj + 2] = (
              eta[:, :, None] * init["signs"][e, gi, gj])
      xb = np.clip(x0[e] + eps * delta / (l2(delta) + 1e-12), lo, hi)
    margin, queries = np_margin(params, xb, y[e]), 1
    for i in range(iters):
      if margin <= 0:
        break
      s = sides[i]
      dr = {k: v[i, e] for k, v in steps.items()}
      vh, vw = dr["vh"], dr["vw"]
      if norm == "linf":
        xn = xb.copy()
        xn[vh:vh + s, vw:vw + s] += 2 * eps * dr["signs"]
        xn = np.clip(np.clip(xn, x0[e] - eps, x0[e] + eps), lo, hi)
      else:
        vh2, vw2 = dr["vh2"], dr["vw2"]
        delta = xb - x0[e]
        win = delta[vh:vh + s, vw:vw + s]
        both = np.zeros((h, w, 1))
        both[vh:vh + s, vw:vw + s] = both[vh2:vh2 + s, vw2:vw2 + s] = 1
        eta = ref_eta(s).T if dr["transpose"] else ref_eta(s)
        new = eta[:, :, None] * dr["signs"] + win / (
            1e-12 + np.sqrt(np.sum(win ** 2, axis=(0, 1))))
        new = new / (1e-12 + np.sqrt(np.sum(new ** 2, axis=(0, 1)))) * np.sqrt(
            max(eps ** 2 - l2(delta) ** 2, 0) / c + l2(delta * both) ** 2)
        delta[vh2:vh2 + s, vw2:vw2 + s] = 0
        delta[vh:vh + s, vw:vw + s] = new
        xn = np.clip(x0[e] + eps * delta / (l2(delta) + 1e-12), lo, hi)
      new_margin = np_margin(params, xn, y[e])
      queries += 1
      if new_margin < margin or new_margin <= 0:
        xb, margin = xn, new_margin
    outs.append(xb)
    used.append(queries)
  return np.stack(outs), np.asarray(used)


def _batch(seed):
  """Images, labels (clean argmax but example 2 mislabelled), done
  examples 0 and 5 sitting at a moved `x_start`."""
  x0 = _images(seed)
  y = np.argmax(np.asarray(model(MLP, jnp.asarray(x0))), -1)
  y[2] = (y[2] + 1) % K
  done = np.zeros(B, bool)
  done[[0, 5]] = True
  x_start = np.clip(x0 + 0.01, 0, 1).astype(np.float32)
  return x0, y, x_start, done


@pytest.mark.parametrize("norm,eps", [("linf", 0.06), ("l2", 1.0)])
def test_run_matches_numpy_loop_and_invariants(norm, eps):
  x0, y, x_start, done = _batch(1)
  got, used = run(norm, MLP, x0, y, x_start, done, eps)
  want, want_used = ref_run(MLP, x0, y, x_start, done, eps, norm)
  np.testing.assert_allclose(got, want, atol=2e-5, rtol=0)
  np.testing.assert_array_equal(used, want_used)
  # Both outcomes occur: some broken early, some out of budget.
  broken = np.array([np_margin(MLP, got[e], y[e]) <= 0 for e in range(B)])
  assert np.any(broken & ~done & (used < QUERIES))
  assert np.any(~broken & ~done & (used == QUERIES))
  # Done examples untouched, no queries; budget respected; ball and range.
  np.testing.assert_array_equal(got[done], x_start[done])
  np.testing.assert_array_equal(used[done], 0)
  assert np.all((used[~done] >= 1) & (used[~done] <= QUERIES))
  assert got.min() >= 0.0 and got.max() <= 1.0
  delta = (got - x0)[~done].reshape(-1, D)
  if norm == "linf":
    assert np.abs(delta).max() <= eps + 1e-6
  else:
    assert np.linalg.norm(delta, axis=-1).max() <= eps * (1 + 1e-5)


def test_l2_norm_stays_within_eps_without_range_clip():
  """Away from the range's bounds every L2 point lies on the eps-sphere."""
  x0 = np.full((B,) + SHAPE, 0.5, np.float32) + 0.01 * _images(2)
  y = np.argmax(np.asarray(model(MLP, jnp.asarray(x0))), -1)
  done = np.zeros(B, bool)
  got, _ = run("l2", MLP, x0, y, x0, done, 0.3, lo=-10.0, hi=10.0)
  norms = np.linalg.norm((got - x0).reshape(B, -1), axis=-1)
  np.testing.assert_allclose(norms, 0.3, rtol=1e-5)
  assert norms.max() <= 0.3 * (1 + 1e-6)


def test_linear_model_succeeds_with_room_and_never_without():
  noise = 0.01 * (_images(3)[:, :SHAPE[0] // 2] - 0.5)
  x0 = 0.5 + np.concatenate([noise, noise[:, ::-1]], axis=1)  # Mirrored.
  y = np.zeros(B, np.int32)
  margins = np.asarray([np_margin(LINEAR, x0[e], 0) for e in range(B)])
  np.testing.assert_allclose(margins, 0.02, atol=1e-6)
  done = np.zeros(B, bool)
  # eps = 0.1: one pixel moved the right way lowers the margin by 0.05.
  got, used = run("linf", LINEAR, x0, y, x0, done, 0.1)
  assert all(np_margin(LINEAR, got[e], 0) <= 0 for e in range(B))
  assert np.all(used < QUERIES) and np.abs(got - x0).max() <= 0.1 + 1e-6
  # eps = 0.0002: the margin stays >= 0.02 - 50 eps > 0 in the ball.
  got, used = run("linf", LINEAR, x0, y, x0, done, 0.0002)
  final = np.asarray([np_margin(LINEAR, got[e], 0) for e in range(B)])
  assert np.all(final > 0.01) and np.all(final < 0.02 - 1e-4)
  np.testing.assert_array_equal(used, QUERIES)
  for norm in ("linf", "l2"):  # eps = 0: nothing moves.
    got, used = run(norm, LINEAR, x0, y, x0, done, 0.0)
    np.testing.assert_array_equal(got, x0)
    np.testing.assert_array_equal(used, QUERIES)


# -- The public function -----------------------------------------------------


@functools.lru_cache(maxsize=None)
def _public():
  def attack(params, x, y, key, eps):
    return square.square(lambda z: model(params, z), x, y, eps=eps, key=key,
                         queries=QUERIES)
  x = jnp.zeros((B,) + SHAPE)
  return _fast_jit(attack, MLP, x, jnp.zeros(B, jnp.int32), KEY,
                   jnp.float32(0))


def test_public_square_skips_clean_misclassified_and_chains_run():
  x0 = _images(4)
  y = np.argmax(np.asarray(model(MLP, jnp.asarray(x0))), -1)
  wrong = np.zeros(B, bool)
  wrong[[1, 6]] = True
  y[wrong] = (y[wrong] + 1) % K
  got = np.asarray(_public()(MLP, jnp.asarray(x0), jnp.asarray(y, jnp.int32),
                             KEY, jnp.float32(0.05)))
  np.testing.assert_array_equal(got[wrong], x0[wrong])
  assert np.abs(got - x0)[~wrong].max() > 0.04  # The others moved.
  want, _ = run("linf", MLP, x0, y, x0, wrong, 0.05)
  np.testing.assert_allclose(got, want, atol=1e-6, rtol=0)
  got = _public()(MLP, jnp.asarray(x0), jnp.asarray(y, jnp.int32), KEY,
                  jnp.float32(0.0))
  np.testing.assert_array_equal(np.asarray(got), x0)


# -- Argument errors ---------------------------------------------------------

GOOD = dict(eps=0.1, norm="linf", queries=10, p_init=0.8,
            rescale_schedule=True, clip_min=0.0, clip_max=1.0)


@pytest.mark.parametrize("bad,field", [
    (dict(eps=-0.1), "attack.eps"), (dict(eps=float("nan")), "attack.eps"),
    (dict(norm="l1"), "attack.norm"), (dict(queries=0), "attack.queries"),
    (dict(queries=2.0), "attack.queries"), (dict(p_init=0.0), "attack.p_init"),
    (dict(p_init=1.5), "attack.p_init"), (dict(p_init="0.8"), "attack.p_init"),
    (dict(rescale_schedule=1), "attack.rescale_schedule"),
    (dict(clip_min=1.0, clip_max=0.0), "attack.clip_min"),
])
def test_config_errors_name_the_field(bad, field):
  config = {**GOOD, **bad}
  with pytest.raises(ConfigError) as e:
    square.check_square(**config)
  assert e.value.field == field
  with pytest.raises(ConfigError) as e:
    square.square(model, np.zeros((B,) + SHAPE, np.float32),
                  np.zeros(B, np.int32), key=KEY, **config)
  assert e.value.field == field


def test_call_errors_and_attack_contract():
  assert square.check_square(**GOOD) is None
  registry.check_contract(  # TypeError unless it follows the contract.
      "square", registry.AttackSpec(square.square, square.check_square))
  assert set(registry.config_fields(square.square)) == set(GOOD)
  x, y = np.zeros((B,) + SHAPE, np.float32), np.zeros(B, np.int32)
  with pytest.raises(ConfigError) as e:
    square.square(model, x, y, eps=0.1)
  assert e.value.field == "attack.key"
  with pytest.raises(InputError) as e:
    square.square(model, x.reshape(B, -1), y, eps=0.1, key=KEY)
  assert e.value.field == "attack.x"
