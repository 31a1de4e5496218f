"""APGD against loop references written from the paper and from the authors'
released loop (`tests/naive_apgd.py`): iterates, step sizes, checkpoints and
restart points equal to float tolerance from a shared random start; the
closed-form optimum of a linear model; the DLR losses on hand-computed logits;
restarts and targets on the examples still robust; config errors."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import naive_apgd
from vmoe_ext.attacks import apgd as A
from vmoe_ext.attacks import base
from vmoe_ext.errors import ConfigError

B, SHAPE, C = 6, (4, 4, 1), 5
D = int(np.prod(SHAPE))


def _params(seed=0, hidden=12):
  k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
  return dict(w1=jax.random.normal(k1, (D, hidden)) / np.sqrt(D),
              b1=jax.random.normal(k2, (hidden,)) * 0.1,
              w2=jax.random.normal(k3, (hidden, C)) * 2.0)


def mlp(params, x):
  h = jnp.tanh(x.reshape(x.shape[0], -1) @ params["w1"] + params["b1"])
  return h @ params["w2"]


logits_fn = functools.partial(mlp, _params())
X0 = jnp.asarray(np.random.default_rng(0).uniform(0.1, 0.9, (B,) + SHAPE),
                 jnp.float32)
LABELS = jnp.argmax(logits_fn(X0), -1).astype(jnp.int32)  # All correct.
TARGETS = base.top_targets(logits_fn(X0), 2)


def test_checkpoints_match_both_definitions():
  for n in range(1, 130):
    w = [v for v in naive_apgd.paper_checkpoints(n) if 0 < v <= n - 1]
    want = [(v, v - ([0] + w)[i]) for i, v in enumerate(w)]
    assert A.checkpoints(n, "paper") == want, n
    # The released loop: counter3 reaches k, then k shrinks.
    k, c, got = max(int(0.22 * n), 1), 0, []
    for i in range(n):
      c += 1
      if c == k:
        got.append((i, k))
        k, c = max(k - max(int(0.03 * n), 1), max(int(0.06 * n), 1)), 0
    assert A.checkpoints(n, "autoattack") == got, n
  assert [w for w, _ in A.checkpoints(100, "paper")] == [
      22, 41, 57, 70, 80, 87, 93, 99]


@functools.partial(jax.jit, static_argnums=0)
def _loss_grad_one(loss, z, label, target):
  """Loss, gradient and misclassification of one flat image (the model
  oracle of the loop references)."""
  def f(x):
    lg = logits_fn(x.reshape((1,) + SHAPE))
    t = None if loss != "dlr-targeted" else target[None]
    return A.loss_of(loss, lg, label[None], t)[0], lg
  (v, lg), g = jax.value_and_grad(f, has_aux=True)(z)
  return v, g, jnp.argmax(lg[0]) != label


def _oracle(loss, targets, b):
  target = jnp.int32(0) if targets is None else targets[b]

  def one(z):
    v, g, mis = _loss_grad_one(loss, jnp.asarray(z, jnp.float32), LABELS[b],
                               target)
    return np.float32(v), np.asarray(g, np.float32), bool(mis)

  return one


@pytest.mark.parametrize("schedule,norm,loss,eps", [
    ("paper", "linf", "ce", 0.03), ("paper", "l2", "dlr-targeted", 0.05),
    ("autoattack", "linf", "dlr", 0.03), ("autoattack", "l2", "ce", 0.05),
])
def test_single_run_equals_loop_reference(schedule, norm, loss, eps):
  steps = 30
  targets = TARGETS if loss == "dlr-targeted" else None
  done = jnp.zeros((B,), bool)
  run = jax.jit(functools.partial(
      A.single_run, logits_fn, norm=norm, loss=loss, steps=steps, rho=0.75,
      eot_iter=1, schedule=schedule, record_iterates=True))
  _, broken, x_best, f_best, trace = run(X0, LABELS, targets,
                                          jax.random.key(3), X0, done, eps,
                                          0.0, 1.0)
  ref_fn = (naive_apgd.paper_run if schedule == "paper"
            else naive_apgd.autoattack_run)
  xs = np.asarray(trace["x"]).reshape(steps + 1, B, D)
  resets = compared = 0
  for b in range(B):
    ref = ref_fn(_oracle(loss, targets, b), np.asarray(X0[b]).reshape(-1),
                 xs[0, b], eps, norm=norm, n_iter=steps)
    # Up to the first near-tie of the loss (see naive_apgd), all of it.
    tie = ref["ambiguous_at"]
    n = len(ref["x"]) if tie is None else tie + 1
    compared += n
    np.testing.assert_allclose(xs[:n, b], ref["x"][:n], atol=2e-5)
    np.testing.assert_allclose(np.asarray(trace["step"])[:n, b],
                               ref["eta"][:n], rtol=1e-6)
    got_resets = list(np.nonzero(np.asarray(trace["reset"])[:n, b])[0])
    assert got_resets == [r for r in ref["reset"] if r < n]
    resets += len([r for r in ref["reset"] if r < n])
    if tie is not None:
      continue
    assert bool(broken[b]) == (ref["broken_at"] is not None)
    if ref["broken_at"] is None:
      np.testing.assert_allclose(float(f_best[b]), ref["f_best"], rtol=1e-5)
      np.testing.assert_allclose(np.asarray(x_best[b]).reshape(-1),
                                 ref["x_best"], atol=2e-5)
  if norm == "linf":
    # The step-size checks and restarts, over most of the iterations (an
    # Linf iterate moves between the ball's vertices: few near-ties).
    assert resets > 0 and compared >= 0.5 * B * (steps + 1), (resets,
                                                             compared)
  else:
    # L2 iterates converge within a few steps, where the loss differences
    # reach float32 rounding: the start, momentum and projections compared.
    assert compared >= 4 * B, compared


@pytest.mark.parametrize("norm", ["linf", "l2"])
def test_linear_two_class_optimum(norm):
  """CE of a 2-class linear model is maximised at the ball's point furthest
  along w_1 - w_0: x0 + eps sign(w) (Linf), x0 + eps w / ||w|| (L2)."""
  w = np.random.default_rng(1).normal(size=(D, 2)).astype(np.float32)
  d = w[:, 1] - w[:, 0]
  bias = np.array([3.0 + 0.5 * d.sum(), 0.0], np.float32)  # Margin 3 at x0.
  fn = lambda x: x.reshape(x.shape[0], -1) @ w + bias  # noqa: E731
  x0 = jnp.full((2,) + SHAPE, 0.5, jnp.float32)
  y = jnp.zeros((2,), jnp.int32)
  eps = 0.05 if norm == "linf" else 0.2
  x_adv = A.apgd(fn, x0, y, eps=eps, key=jax.random.key(0), norm=norm,
                 steps=40)
  d = d.reshape(SHAPE)
  want = 0.5 + eps * (np.sign(d) if norm == "linf"
                      else d / np.linalg.norm(d))
  # Linf: a vertex, reached exactly; L2: approached along the sphere.
  np.testing.assert_allclose(np.asarray(x_adv), np.stack([want] * 2),
                             atol=1e-6 if norm == "linf" else 1e-4)


def test_dlr_losses_hand_computed():
  z = jnp.array([[3., 1., 2., .5], [0., 4., 1., 2.]])
  y = jnp.array([0, 0])
  np.testing.assert_allclose(base.dlr_loss(z, y), [-1 / 2, 4 / 3], rtol=1e-6)
  np.testing.assert_allclose(base.dlr_targeted_loss(z, y, jnp.array([2, 1])),
                             [-1 / 2.25, 4 / 3.5], rtol=1e-6)
  np.testing.assert_allclose(base.dlr_loss(3 * z + 7, y), base.dlr_loss(z, y),
                             rtol=1e-5)
  np.testing.assert_array_equal(base.top_targets(z, 2), [2, 3])


def test_restarts_and_targets_run_on_robust_examples_only():
  eps = 0.05
  out, info = jax.jit(functools.partial(
      A.apgd_run, logits_fn, norm="linf", loss="dlr-targeted", steps=8,
      restarts=2, target_classes=2, rho=0.75, eot_iter=1,
      schedule="paper", record_iterates=True))(
          X0, LABELS, jax.random.key(0), X0, jnp.zeros((B,), bool), eps,
          0.0, 1.0)
  broken = np.asarray(info["broken"])
  assert 0 < broken.sum() < B
  xs = np.asarray(info["trace"]["x"])  # [runs, steps + 1, B, ...]
  mis = np.asarray(base.misclassified(logits_fn(out), LABELS))
  np.testing.assert_array_equal(mis, broken)
  for b in np.nonzero(broken)[0]:
    # From the run after the one that broke it, the example sits still.
    first = next(r for r in range(4) if base.misclassified(
        logits_fn(jnp.asarray(xs[r, -1])), LABELS)[b])
    for r in range(first + 1, 4):
      np.testing.assert_array_equal(
          xs[r, :, b], np.broadcast_to(xs[first, -1, b], xs[r, :, b].shape))
  assert float(jnp.max(jnp.abs(out - X0))) <= eps + 1e-6


def test_done_examples_untouched_and_misclassified_clean_kept():
  labels = LABELS.at[0].set((LABELS[0] + 1) % C)  # Wrong at the clean image.
  x_adv = A.apgd(logits_fn, X0, labels, eps=0.2, key=jax.random.key(1),
                 steps=5)
  np.testing.assert_array_equal(x_adv[0], X0[0])
  x_start = X0 + 0.01
  done = jnp.arange(B) < 2
  out, _ = A.apgd_run(logits_fn, X0, LABELS, jax.random.key(2), x_start,
                      done, 0.2, 0.0, 1.0, norm="l2", loss="ce", steps=4,
                      restarts=1, target_classes=9, rho=0.75, eot_iter=1,
                      schedule="paper")
  np.testing.assert_array_equal(out[:2], x_start[:2])


def test_eot_gradient_is_the_mean_over_samples():
  scale = lambda k: 1 + 0.5 * jax.random.uniform(k, (1,) + SHAPE)  # noqa
  def noisy(x, key=None):
    return logits_fn(x if key is None else x * scale(key))
  active = jnp.ones((B,), bool)
  key = jax.random.key(5)
  _, _, g = A._loss_and_grad(noisy, X0, LABELS, None, active, key,
                             loss="ce", eot_iter=3)
  want = sum(jax.grad(lambda z: jnp.sum(base.cross_entropy(
      noisy(z, key=k), LABELS)))(X0) for k in jax.random.split(key, 3)) / 3
  np.testing.assert_allclose(g, want, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("field,value", [
    ("loss", "hinge"), ("schedule", "fast"), ("rho", 1.5), ("steps", 0),
    ("eot_iter", 0), ("norm", "l1"), ("eps", -1.0)])
def test_config_errors_name_the_field(field, value):
  with pytest.raises(ConfigError) as e:
    A.apgd(logits_fn, X0, LABELS, key=jax.random.key(0),
           **{"eps": 0.1, field: value})
  assert e.value.field == f"attack.{field}"


def test_call_time_class_errors():
  with pytest.raises(ConfigError) as e:
    A.apgd(logits_fn, X0, LABELS, eps=0.1, key=jax.random.key(0),
           loss="dlr-targeted", target_classes=C)
  assert e.value.field == "attack.target_classes"
  two = lambda x: logits_fn(x)[:, :2]  # noqa: E731
  with pytest.raises(ConfigError) as e:
    A.apgd(two, X0, LABELS % 2, eps=0.1, key=jax.random.key(0), loss="dlr")
  assert e.value.field == "attack.loss"
