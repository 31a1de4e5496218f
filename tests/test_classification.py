"""The one top-k hit test and the one cross-entropy
(`vmoe_ext.classification`) against NumPy references, ties and NaN
included; and the users that must agree with them."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from vmoe_ext import attacks
from vmoe_ext.classification import (LOSSES, cross_entropy, soft_targets,
                                     topk_correct)
from vmoe_ext.evaluate.metrics import topk_accuracy


def argsort_reference(logits: np.ndarray, labels: np.ndarray,
                      k: int) -> np.ndarray:
  """The label is among the first k of a stable descending argsort (ties:
  lower class index first)."""
  order = np.argsort(-logits, axis=-1, kind="stable")[:, :k]
  return np.any(order == labels[:, None], axis=-1)


@pytest.mark.parametrize("seed", range(6))
def test_topk_correct_matches_a_stable_argsort_with_ties(seed):
  rng = np.random.default_rng(seed)
  b, c = 40, int(rng.integers(2, 12))
  # Integer-valued logits: many ties.
  logits = rng.integers(-2, 3, (b, c)).astype(np.float32)
  labels = rng.integers(0, c, b)
  for k in range(1, c + 2):
    want = argsort_reference(logits, labels, k)
    host = topk_correct(logits, labels, k)
    assert isinstance(host, np.ndarray) and host.dtype == bool
    np.testing.assert_array_equal(host, want)
    np.testing.assert_array_equal(
        topk_correct(jnp.asarray(logits), jnp.asarray(labels), k), want)
    jitted = jax.jit(topk_correct, static_argnums=2)
    np.testing.assert_array_equal(jitted(logits, labels, k), want)


def test_top1_is_argmax_even_with_nan_and_signed_zeros():
  rng = np.random.default_rng(0)
  logits = rng.integers(-1, 2, (200, 5)).astype(np.float32)
  logits[rng.random(logits.shape) < 0.15] = np.nan
  logits[rng.random(logits.shape) < 0.15] = -0.0
  labels = rng.integers(0, 5, 200)
  np.testing.assert_array_equal(topk_correct(logits, labels, 1),
                                np.argmax(logits, -1) == labels)
  np.testing.assert_array_equal(
      topk_correct(jnp.asarray(logits), jnp.asarray(labels), 1),
      jnp.argmax(jnp.asarray(logits), -1) == labels)


def test_hand_case_and_invalid_labels():
  logits = np.array([[0.0, 2.0, 1.0, 2.0]])
  # Ranking: class 1, class 3 (tie, higher index), class 2, class 0.
  for label, rank in ((1, 1), (3, 2), (2, 3), (0, 4)):
    for k in (1, 2, 3, 4):
      assert topk_correct(logits, np.array([label]), k)[0] == (rank <= k)
  # A label outside [0, C) (e.g. padding) is never correct.
  assert not topk_correct(logits, np.array([4]), 4).any()
  assert not topk_correct(logits, np.array([-1]), 4).any()


def test_host_metrics_use_the_same_ranking():
  rng = np.random.default_rng(3)
  logits = rng.integers(-2, 3, (60, 6)).astype(np.float32)
  labels = rng.integers(0, 6, 60)
  mask = rng.random(60) < 0.7
  for k in (1, 3, 6):
    want = argsort_reference(logits, labels, k)
    assert topk_accuracy(logits, labels, k) == np.mean(want)
    assert topk_accuracy(logits, labels, k, mask) == pytest.approx(
        np.mean(want[mask]))


def _numpy_loss(logits, targets, loss):
  z = np.asarray(logits, np.float64)
  t = np.asarray(targets, np.float64)
  if loss == "sigmoid_xent":
    p = 1 / (1 + np.exp(-z))
    return -np.sum(t * np.log(p) + (1 - t) * np.log(1 - p), -1)
  logp = z - z.max(-1, keepdims=True)
  logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
  return -np.sum(t * logp, -1)


@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize("smoothing", [0.0, 0.2])
def test_cross_entropy_against_numpy(loss, smoothing):
  rng = np.random.default_rng(1)
  logits = (rng.normal(size=(6, 5)) * 3).astype(np.float32)
  labels = np.array([0, 4, 2, 2, 1, 3])
  targets = np.eye(5)[labels] * (1 - smoothing) + smoothing / 5
  np.testing.assert_allclose(soft_targets(labels, 5, smoothing), targets,
                             rtol=1e-6)
  np.testing.assert_allclose(cross_entropy(logits, labels, smoothing, loss),
                             _numpy_loss(logits, targets, loss), rtol=1e-5)
  soft = rng.dirichlet(np.ones(5), 6).astype(np.float32)
  np.testing.assert_allclose(cross_entropy(logits, soft, 0.0, loss),
                             _numpy_loss(logits, soft, loss), rtol=1e-5)
  with pytest.raises(ValueError, match="unknown loss"):
    cross_entropy(logits, labels, loss="hinge")


def test_the_attack_objective_is_the_same_cross_entropy():
  """The attacks' float32 softmax cross-entropy is `cross_entropy`, and it
  equals (value and gradient, bit for bit) the integer-label form
  `-log_softmax(z)[y]` the attacks used before."""
  rng = np.random.default_rng(2)
  logits = jnp.asarray(rng.normal(size=(16, 10)) * 4, jnp.float32)
  labels = jnp.asarray(rng.integers(0, 10, 16))

  def integer_form(z):
    logp = jax.nn.log_softmax(z.astype(jnp.float32), axis=-1)
    return -jnp.take_along_axis(logp, labels[:, None], axis=-1)[:, 0]

  np.testing.assert_array_equal(attacks.cross_entropy(logits, labels),
                                cross_entropy(logits, labels))
  np.testing.assert_array_equal(attacks.cross_entropy(logits, labels),
                                integer_form(logits))
  mean = lambda f: jax.jit(jax.grad(lambda z: jnp.mean(f(z))))  # noqa: E731
  np.testing.assert_array_equal(
      mean(lambda z: attacks.cross_entropy(z, labels))(logits),
      mean(integer_form)(logits))
  # bfloat16 logits: computed in float32.
  assert attacks.cross_entropy(logits.astype(jnp.bfloat16),
                               labels).dtype == jnp.float32
