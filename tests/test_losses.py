"""Auxiliary losses against hand-computed numbers and a SciPy loop."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import scipy.stats

from vmoe_ext.moe import losses
from vmoe_ext.routers.noisy_top_k import noisy_top_k


def test_cv_squared_hand_case():
  # mean 2, population variance 2/3 -> (2/3) / 4.
  np.testing.assert_allclose(losses.cv_squared(jnp.array([1., 2., 3.])),
                             1 / 6, rtol=1e-6)


def test_importance_loss_hand_case():
  gates = jnp.array([[[0.5, 0.5], [1.0, 0.0]]])  # imp = [1.5, 0.5]
  np.testing.assert_allclose(losses.importance_loss(gates), 0.25, rtol=1e-6)


def test_importance_loss_averages_groups():
  gates = jnp.array([[[0.5, 0.5], [1.0, 0.0]], [[0.5, 0.5], [0.5, 0.5]]])
  np.testing.assert_allclose(losses.importance_loss(gates), 0.125, rtol=1e-6)


def test_load_loss_matches_scipy_loop(rng):
  g, s, e, k, std = 2, 6, 4, 2, 0.3
  logits = rng.normal(size=(g, s, e))
  noisy = logits + std * rng.normal(size=(g, s, e))
  expected = []
  for gi in range(g):
    load = np.zeros(e)
    for si in range(s):
      threshold = sorted(noisy[gi, si])[-k]  # K-th largest noisy logit.
      for ei in range(e):
        load[ei] += 1 - scipy.stats.norm.cdf((threshold - logits[gi, si, ei])
                                             / std)
    expected.append(np.var(load) / np.mean(load)**2)
  got = losses.load_loss(jnp.asarray(logits, jnp.float32),
                         jnp.asarray(noisy, jnp.float32), std, k)
  np.testing.assert_allclose(got, np.mean(expected), rtol=1e-5)


def test_gshard_loss_hand_case():
  gates = jnp.array([[[0.75, 0.25], [0.5, 0.5]]])
  # frac = [1, 0], mean_prob = [0.625, 0.375] -> 4 * mean([0.625, 0]) = 1.25.
  np.testing.assert_allclose(losses.gshard_loss(gates, jnp.array([[0, 0]])),
                             1.25, rtol=1e-6)
  balanced = jnp.full((1, 4, 2), 0.5)
  np.testing.assert_allclose(
      losses.gshard_loss(balanced, jnp.array([[0, 1, 0, 1]])), 1.0, rtol=1e-6)


def test_z_loss_hand_case():
  np.testing.assert_allclose(losses.z_loss(jnp.zeros((1, 3, 4))),
                             math.log(4)**2, rtol=1e-6)


def test_noisy_top_k_combines_unnormalised_gates_by_default(rng):
  logits = jnp.asarray(rng.normal(size=(1, 5, 4)), jnp.float32)
  routing, metrics = noisy_top_k(logits, None, num_selected=2, noise_std=0.)
  probs = np.asarray(jax.nn.softmax(logits))
  order = np.argsort(-probs, axis=-1)[..., :2]
  np.testing.assert_array_equal(routing.expert_indices, order)
  np.testing.assert_allclose(routing.gates,
                             np.take_along_axis(probs, order, -1), rtol=1e-6)
  assert float(metrics["load_loss"]) == 0.0  # Undefined without noise.
  renorm, _ = noisy_top_k(logits, None, num_selected=2, noise_std=0.,
                          renormalize_gates=True)
  top = np.take_along_axis(probs, order, -1)
  np.testing.assert_allclose(renorm.gates, top / top.sum(-1, keepdims=True),
                             rtol=1e-6)


def test_noisy_top_k_auxiliary_loss_is_the_weighted_sum(rng):
  logits = jnp.asarray(rng.normal(size=(2, 6, 4)), jnp.float32)
  noise = jnp.asarray(0.25 * rng.normal(size=(2, 6, 4)), jnp.float32)
  _, m = noisy_top_k(logits, noise, num_selected=2, noise_std=0.25,
                     importance_loss_weight=0.1, load_loss_weight=0.2,
                     gshard_loss_weight=0.3, z_loss_weight=0.4)
  expected = (0.1 * m["importance_loss"] + 0.2 * m["load_loss"]
              + 0.3 * m["gshard_loss"] + 0.4 * m["z_loss"])
  np.testing.assert_allclose(m["auxiliary_loss"], expected, rtol=1e-6)
  # Importance from clean gates (the default, google vmoe's code) vs noisy
  # gates (the V-MoE paper's appendix).
  np.testing.assert_allclose(
      m["importance_loss"], losses.importance_loss(jax.nn.softmax(logits)),
      rtol=1e-6)
  _, m_noisy = noisy_top_k(logits, noise, num_selected=2, noise_std=0.25,
                           importance_gates="noisy")
  np.testing.assert_allclose(
      m_noisy["importance_loss"],
      losses.importance_loss(jax.nn.softmax(logits + noise)), rtol=1e-6)


def test_gradients_are_finite_at_perfect_balance():
  # All-equal logits: every expert has exactly the same importance and load.
  x = jnp.ones((2, 8, 3))

  def aux(w):
    logits = x @ w
    noise = jnp.zeros_like(logits)  # Equal noisy logits too.
    _, m = noisy_top_k(logits, noise, num_selected=2, noise_std=0.25,
                       gshard_loss_weight=1.0, z_loss_weight=1.0)
    return m["auxiliary_loss"], m

  (value, m), grad = jax.value_and_grad(aux, has_aux=True)(jnp.zeros((3, 4)))
  np.testing.assert_allclose(m["importance_loss"], 0.0, atol=1e-12)
  np.testing.assert_allclose(m["load_loss"], 0.0, atol=1e-12)
  assert np.all(np.isfinite(grad)) and np.isfinite(value)

  # The reference that motivated this: CV through jnp.std has a NaN gradient.
  def std_cv(w):
    imp = jnp.sum(jax.nn.softmax(x @ w), axis=-2)
    return jnp.mean((jnp.std(imp, -1) / jnp.mean(imp, -1))**2)

  assert np.any(np.isnan(jax.grad(std_cv)(jnp.zeros((3, 4)))))


def _naive_fastmoe_balance(logits, temperature, k):
  """The language-model gates' `set_load_balance` as a loop over the
  flattened tokens: scores `softmax(logits / t)`, expert counts over every
  (token, choice) pair, both divided by the number of pairs."""
  flat = np.asarray(logits, np.float64).reshape(-1, logits.shape[-1])
  e = flat.shape[-1]
  count, prob = np.zeros(e), np.zeros(e)
  pairs = 0
  for row in flat:
    scores = np.exp(row / temperature - np.max(row / temperature))
    scores /= scores.sum()
    prob += scores
    for expert in np.argsort(-row, kind="stable")[:k]:
      count[expert] += 1
      pairs += 1
  return e * np.sum(count / pairs * prob / pairs)


def test_fastmoe_balance_loss_matches_the_gates_loop_and_routes_into_aux(rng):
  logits = jnp.asarray(rng.normal(size=(3, 5, 6)), jnp.float32)
  for temperature in (1.0, 0.3):
    routing, metrics = noisy_top_k(
        logits, None, num_selected=2, noise_std=0.0, renormalize_gates=True,
        importance_loss_weight=0.0, load_loss_weight=0.0,
        balance_loss_weight=0.01, balance_temperature=temperature)
    expected = _naive_fastmoe_balance(np.asarray(logits), temperature, 2)
    np.testing.assert_allclose(metrics["balance_loss"], expected, rtol=1e-5)
    np.testing.assert_allclose(metrics["auxiliary_loss"], 0.01 * expected,
                               rtol=1e-5)
  # Perfect balance (uniform scores, every expert picked equally): 1 / K.
  uniform = jnp.zeros((1, 4, 4))
  idx = jnp.array([[[0, 1], [2, 3], [0, 1], [2, 3]]])
  np.testing.assert_allclose(
      losses.fastmoe_balance_loss(jax.nn.softmax(uniform), idx), 0.5,
      rtol=1e-6)
  # Off (weight 0): no metric, nothing added.
  _, metrics = noisy_top_k(logits, None, num_selected=2, noise_std=0.0,
                           importance_loss_weight=0.0, load_loss_weight=0.0)
  assert "balance_loss" not in metrics and float(
      metrics["auxiliary_loss"]) == 0.0
