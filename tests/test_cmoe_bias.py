"""CMoE's balancing bias at counts exactly at the mean, against the integer rule.

The authors leave the bias of an expert whose selection count equals the mean
unchanged. The reference here decides in Python integers (`E * c_e` against
`sum(c)`), so a float mean that rounds (E = 7, sum 168: 24.000002) cannot
hide in it. Checked through `balance_bias`, through a training call of the
router (one-hot tokens pick the expert we choose), and with the tokens split
over a data-parallel axis (the counts are summed over devices first).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from vmoe_ext.moe.contract import RoutingContext
from vmoe_ext.routers.cmoe import CMoERouter, balance_bias, cmoe_top_k

RATE = 1e-3
# The counts from the side-by-side check: float32 mean 24.000002.
SEEN = [56, 13, 14, 18, 28, 15, 24]


def integer_rule(bias, counts, rate):
  """`b_e - rate` above the mean, `+ rate` below, unchanged at it."""
  e, total = len(counts), sum(int(c) for c in counts)
  step = [(-rate if e * int(c) > total else rate if e * int(c) < total
           else 0.0) for c in counts]
  return np.asarray(bias, np.float32) + np.asarray(step, np.float32)


def counts_with_ties(e: int, seed: int) -> list[int]:
  """E counts with mean m: at least half of them exactly m, the others in
  pairs moved apart by opposite amounts (a pair's sum stays 2m)."""
  rng = np.random.default_rng(seed)
  m = int(rng.integers(5, 40))
  counts = [m] * e
  for j in range(max(1, e // 4)):
    d = int(rng.integers(1, m))
    counts[2 * j], counts[2 * j + 1] = m + d, m - d
  assert sum(counts) == e * m and counts.count(m) >= e // 2
  return [int(c) for c in rng.permutation(counts)]


def test_the_float_mean_of_the_seen_counts_is_not_the_mean():
  # Why the rule compares in integers: the float32 mean is off by 2e-6, and
  # a comparison with it moves the expert holding exactly 24.
  mean = jnp.mean(jnp.asarray(SEEN, jnp.float32))
  assert float(mean) != 24.0
  got = balance_bias(jnp.zeros(7), jnp.asarray(SEEN, jnp.float32), RATE)
  np.testing.assert_array_equal(got, integer_rule(np.zeros(7), SEEN, RATE))
  assert float(got[-1]) == 0.0


@pytest.mark.parametrize("e", range(3, 17))
def test_balance_bias_leaves_counts_at_the_mean(e):
  counts = counts_with_ties(e, seed=e)
  bias = np.random.default_rng(100 + e).normal(0, 0.1, e).astype(np.float32)
  got = balance_bias(jnp.asarray(bias), jnp.asarray(counts, jnp.float32),
                     RATE)
  np.testing.assert_array_equal(got, integer_rule(bias, counts, RATE))


def _one_hot_tokens(counts):
  """`[1, S, E]` tokens: `counts[e]` copies of the one-hot row e."""
  e = len(counts)
  rows = np.repeat(np.arange(e), counts)
  np.random.default_rng(0).shuffle(rows)
  return np.eye(e, dtype=np.float32)[rows][None]


def _train_call(router, x, bias, ctx):
  """One training call of the router; the kernel `5 I` sends row e to e."""
  e = router.num_experts
  params = {"kernel": 5.0 * jnp.eye(e), "scale": jnp.zeros(e)}
  out, new = router.apply({"params": params, "router_state": {"bias": bias}},
                          x, ctx, capacity=x.shape[1], deterministic=False,
                          update_state=True, mutable=["router_state"])
  return out.routing.expert_indices, new["router_state"]["bias"]


@pytest.mark.parametrize("e", range(3, 17))
def test_a_training_call_leaves_counts_at_the_mean(e):
  counts = counts_with_ties(e, seed=e)
  router = CMoERouter(num_experts=e, num_selected=1, activation="relu",
                      bias_update_rate=RATE)
  x = jnp.asarray(_one_hot_tokens(counts))
  indices, bias = jax.jit(lambda x: _train_call(
      router, x, jnp.zeros(e), RoutingContext()))(x)
  np.testing.assert_array_equal(
      np.bincount(np.asarray(indices).ravel(), minlength=e), counts)
  np.testing.assert_array_equal(bias, integer_rule(np.zeros(e), counts, RATE))


@pytest.mark.parametrize("devices", [3, 7])
def test_over_a_data_parallel_axis_the_device_counts_are_summed(devices):
  # SEEN split unevenly over the devices: no device alone is at the mean,
  # and a mean over devices (168 / 7 / 7 rounds) would not be exact either.
  e = len(SEEN)
  rows = np.random.default_rng(1).permutation(np.repeat(np.arange(e), SEEN))
  shards = np.eye(e, dtype=np.float32)[rows].reshape(devices, 1, -1, e)
  router = CMoERouter(num_experts=e, num_selected=1, activation="relu",
                      bias_update_rate=RATE)
  call = lambda x: _train_call(router, x, jnp.zeros(e),
                               RoutingContext(axis_name="data"))
  indices, bias = jax.jit(jax.vmap(call, axis_name="data"))(
      jnp.asarray(shards))
  np.testing.assert_array_equal(
      np.bincount(np.asarray(indices).ravel(), minlength=e), SEEN)
  expected = integer_rule(np.zeros(e), SEEN, RATE)
  for device_bias in np.asarray(bias):  # Every device holds the same bias.
    np.testing.assert_array_equal(device_bias, expected)


def test_selection_weights_by_hand_also_with_a_numpy_scale_under_jit():
  """`1 + s_e u_e` of the selected experts (by hand), the same when `u` is a
  NumPy array closed over by a jitted function (a restored param)."""
  scores = np.log(np.array([[[1.0, 2.0, 3.0, 4.0]]], np.float32))
  scale = np.array([0.5, -1.0, 2.0, 3.0], np.float32)
  s = np.array([1.0, 2.0, 3.0, 4.0]) / 10.0  # softmax(log v) = v / sum v.
  routing, _ = jax.jit(lambda x: cmoe_top_k(
      x, np.zeros(4, np.float32), scale, 2))(scores)
  np.testing.assert_array_equal(np.asarray(routing.expert_indices)[0, 0], [3, 2])
  np.testing.assert_allclose(np.asarray(routing.gates)[0, 0],
                             [1 + s[3] * 3.0, 1 + s[2] * 2.0], rtol=1e-6)
