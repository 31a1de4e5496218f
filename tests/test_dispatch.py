"""Capacity, dispatchers and token dropping against hand cases and naive loops."""

from __future__ import annotations

import chex
import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import naive
from conftest import random_token_routing
from vmoe_ext.errors import ConfigError
from vmoe_ext.moe import (ExpertChoiceRouting, MlpExperts, SoftRouting,
                          TokenChoiceRouting, compute_capacity,
                          make_dispatch_plan, token_choice_positions)
from vmoe_ext.routers.expert_choice import expert_choice
from vmoe_ext.routers.soft import soft_routing


# --------------------------------------------------------------- capacity ---


@pytest.mark.parametrize("args,expected", [
    ((2048, 2, 1.25, 8), 640),
    ((10, 1, 1.0, 3), 4),        # ceil(3.33)
    ((100, 1, 1.1, 10), 11),     # 100*1.1 = 110.00000000000001: no spurious +1
    ((6, 2, 1.0, 4), 3),
    ((4, 1, 0.01, 8), 1),        # at least one slot
])
def test_capacity_hand_cases(args, expected):
  assert compute_capacity(*args) == expected


def test_capacity_round_up_multiple():
  assert compute_capacity(6, 2, 1.0, 4, multiple_of=4) == 4
  assert compute_capacity(2048, 2, 1.25, 8, multiple_of=4) == 640
  assert compute_capacity(10, 1, 1.0, 3, multiple_of=3) == 6


@pytest.mark.parametrize("kwargs,field", [
    (dict(group_size=8, num_selected=3, capacity_factor=1.0, num_experts=2),
     "num_selected"),
    (dict(group_size=8, num_selected=1, capacity_factor=0.0, num_experts=2),
     "capacity_factor"),
    (dict(group_size=8, num_selected=1, capacity_factor=-1.0, num_experts=2),
     "capacity_factor"),
    (dict(group_size=8, num_selected=1, capacity_factor=1.0, num_experts=2,
          multiple_of=0), "capacity_multiple"),
    (dict(group_size=0, num_selected=1, capacity_factor=1.0, num_experts=2),
     "group_size"),
])
def test_capacity_errors_name_the_field(kwargs, field):
  with pytest.raises(ConfigError, match=field):
    compute_capacity(**kwargs)


# ------------------------------------------------------- hand-made routing ---


def _routing(idx, gates=None, valid=None):
  idx = jnp.asarray(idx, jnp.int32)
  gates = jnp.ones(idx.shape) if gates is None else jnp.asarray(gates)
  return TokenChoiceRouting.create(idx, gates, valid)


def test_dropping_top1_hand_case():
  # 4 tokens, 2 experts, C=2: the third token sent to expert 0 is dropped.
  routing = _routing([[[0], [0], [0], [1]]])
  pos, kept = token_choice_positions(routing, num_experts=2, capacity=2)
  np.testing.assert_array_equal(pos[0, :, 0], [0, 1, 2, 0])
  np.testing.assert_array_equal(kept[0, :, 0], [True, True, False, True])


def test_batch_priority_hand_case():
  # Same routing; priority by gate 0.1, 0.2, 0.9, 0.5: expert 0 is filled by
  # token 2 then token 1, so token 0 (lowest gate) is the one dropped.
  routing = _routing([[[0], [0], [0], [1]]], gates=[[[.1], [.2], [.9], [.5]]])
  pos, kept = token_choice_positions(routing, 2, 2, batch_priority=True)
  np.testing.assert_array_equal(pos[0, :, 0], [2, 1, 0, 0])
  np.testing.assert_array_equal(kept[0, :, 0], [False, True, True, True])


def test_top2_choice_major_hand_case():
  # All first choices are placed before any second choice.
  routing = _routing([[[0, 1], [0, 1], [1, 0]]])
  pos, kept = token_choice_positions(routing, 2, 2)
  np.testing.assert_array_equal(pos[0], [[0, 1], [1, 2], [0, 2]])
  np.testing.assert_array_equal(kept[0], [[1, 1], [1, 0], [1, 0]])


def test_invalid_choices_take_no_capacity():
  routing = _routing([[[0, 1], [0, 1], [1, 0]]],
                     valid=jnp.array([[[1, 0], [1, 1], [1, 1]]], bool))
  _, kept = token_choice_positions(routing, 2, 2)
  np.testing.assert_array_equal(kept[0], [[1, 0], [1, 1], [1, 0]])


def test_drop_rate_and_usage_hand_case():
  routing = _routing([[[0], [0], [0], [1]]])
  plan = make_dispatch_plan(routing, num_experts=2, group_size=4, capacity=2)
  np.testing.assert_allclose(plan.drop_rate, 0.25)
  np.testing.assert_allclose(plan.expert_usage, [1.0, 0.5])


# ------------------------------------------ dispatchers vs a per-token loop ---


def _experts(rng_key, e, d, h=6):
  module = MlpExperts(num_experts=e, hidden_size=h)
  params = jax.jit(module.init)(rng_key, jnp.zeros((e, 1, d)))
  apply = lambda xe: module.apply(params, xe)
  return apply, params["params"]


def _run(plan, x, apply):
  return plan.dispatcher.combine(apply(plan.dispatcher.dispatch(x)))


SHAPES = [  # G, S, E, K, cf
    (1, 8, 4, 1, 1.0),
    (2, 7, 3, 2, 0.8),
    (3, 5, 5, 3, 1.5),
    (2, 16, 8, 2, 0.5),
]


@pytest.mark.parametrize("g,s,e,k,cf", SHAPES)
@pytest.mark.parametrize("batch_priority", [False, True])
@pytest.mark.parametrize("with_invalid", [False, True])
def test_token_choice_dispatchers_match_naive_loop(rng, g, s, e, k, cf,
                                                   batch_priority,
                                                   with_invalid):
  d = 4
  idx, gates, valid = random_token_routing(rng, g, s, e, k, with_invalid)
  x = rng.normal(size=(g, s, d)).astype(np.float32)
  capacity = compute_capacity(s, k, cf, e)
  apply, params = _experts(jax.random.key(g * 100 + s), e, d)
  routing = TokenChoiceRouting.create(jnp.asarray(idx), jnp.asarray(gates),
                                      jnp.asarray(valid))
  expected = naive.token_choice_moe(x, idx, gates, valid, e, capacity, params,
                                    batch_priority)
  for kind in ("einsum", "indices"):
    @jax.jit
    def run(routing, x, kind=kind):
      plan = make_dispatch_plan(routing, num_experts=e, group_size=s,
                                capacity=capacity, kind=kind,
                                batch_priority=batch_priority)
      return _run(plan, x, apply), plan.drop_rate

    y, drop_rate = run(routing, jnp.asarray(x))
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5,
                               err_msg=kind)
    kept = naive.token_choice_kept(idx, valid, gates, e, capacity,
                                   batch_priority)
    np.testing.assert_allclose(drop_rate, 1 - kept.sum() / valid.sum(),
                               rtol=1e-6)


def test_token_choice_dispatchers_have_equal_gradients(rng):
  g, s, e, k, d = 2, 9, 4, 2, 3
  idx, gates, _ = random_token_routing(rng, g, s, e, k)
  x = rng.normal(size=(g, s, d)).astype(np.float32)
  apply, _ = _experts(jax.random.key(1), e, d)

  def loss(x, gates, kind):
    routing = TokenChoiceRouting.create(jnp.asarray(idx), gates)
    plan = make_dispatch_plan(routing, num_experts=e, group_size=s,
                              capacity=4, kind=kind)
    return jnp.sum(jnp.sin(_run(plan, x, apply)))

  grads = {kind: jax.jit(jax.grad(loss, argnums=(0, 1)),
                         static_argnums=2)(jnp.asarray(x),
                                           jnp.asarray(gates), kind)
           for kind in ("einsum", "indices")}
  chex.assert_trees_all_close(grads["einsum"], grads["indices"], atol=1e-5)
  assert float(jnp.abs(grads["indices"][1]).sum()) > 0


@pytest.mark.parametrize("g,s,e,cf", [(1, 8, 4, 1.0), (2, 6, 3, 2.0),
                                      (3, 10, 5, 0.5)])
def test_expert_choice_dispatchers_match_naive_loop(rng, g, s, e, cf):
  d = 4
  logits = rng.normal(size=(g, s, e)).astype(np.float32)
  capacity = compute_capacity(s, 1, cf, e)
  routing, _ = jax.jit(expert_choice, static_argnums=1)(jnp.asarray(logits),
                                                        capacity)
  # Independent check of the picks: each expert's top-C tokens by gate.
  probs = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
  for gi, ei in np.ndindex(g, e):
    top = np.argsort(-probs[gi, :, ei], kind="stable")[:capacity]
    np.testing.assert_array_equal(routing.token_indices[gi, ei], top)
    np.testing.assert_allclose(routing.weights[gi, ei], probs[gi, top, ei],
                               rtol=1e-6)
  x = rng.normal(size=(g, s, d)).astype(np.float32)
  apply, params = _experts(jax.random.key(s), e, d)
  expected = naive.expert_choice_moe(x, np.asarray(routing.token_indices),
                                     np.asarray(routing.weights), params)
  for kind in ("einsum", "indices"):
    @jax.jit
    def run(routing, x, kind=kind):
      plan = make_dispatch_plan(routing, num_experts=e, group_size=s,
                                capacity=None, kind=kind)
      return _run(plan, x, apply), plan.drop_rate

    y, drop_rate = run(routing, jnp.asarray(x))
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5,
                               err_msg=kind)
  picked = np.zeros((g, s), bool)
  for gi, ei in np.ndindex(g, e):
    picked[gi, np.asarray(routing.token_indices[gi, ei])] = True
  np.testing.assert_allclose(drop_rate, 1 - picked.mean(), rtol=1e-6)


def test_expert_choice_capacity_above_group_size_is_an_error():
  with pytest.raises(ConfigError, match="capacity_factor"):
    expert_choice(jnp.zeros((1, 4, 2)), capacity=5)


def test_soft_routing_normalisation_and_dispatch(rng):
  g, s, d, e, p = 2, 5, 4, 3, 2
  x = rng.normal(size=(g, s, d)).astype(np.float32)
  mu = rng.normal(size=(d, e, p)).astype(np.float32)
  scale = np.float32(1.7)
  routing = soft_routing(jnp.asarray(x), jnp.asarray(mu), jnp.asarray(scale))
  # Independent logits: cosine similarity times scale.
  xn = x / np.linalg.norm(x, axis=-1, keepdims=True)
  mun = mu / np.linalg.norm(mu, axis=0, keepdims=True)
  logits = scale * np.einsum("gsd,dep->gsep", xn, mun)
  disp = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
  comb = np.exp(logits) / np.exp(logits).sum(axis=(2, 3), keepdims=True)
  np.testing.assert_allclose(routing.dispatch_weights, disp, rtol=1e-5)
  np.testing.assert_allclose(routing.combine_weights, comb, rtol=1e-5)
  np.testing.assert_allclose(routing.dispatch_weights.sum(axis=1), 1, rtol=1e-5)
  np.testing.assert_allclose(routing.combine_weights.sum(axis=(2, 3)), 1,
                             rtol=1e-5)
  apply, params = _experts(jax.random.key(3), e, d)
  expected = naive.soft_moe(x, disp, comb, params)
  for kind in ("einsum", "indices"):
    plan = make_dispatch_plan(routing, num_experts=e, group_size=s,
                              capacity=None, kind=kind)
    assert plan.capacity == p
    np.testing.assert_allclose(_run(plan, jnp.asarray(x), apply), expected,
                               rtol=1e-5, atol=1e-5)


def test_unknown_dispatcher_is_an_error():
  with pytest.raises(ConfigError, match="dispatcher"):
    make_dispatch_plan(_routing([[[0]]]), num_experts=2, group_size=1,
                       capacity=1, kind="sparse")


def test_expert_init_modes():
  module = MlpExperts(num_experts=3, hidden_size=5)
  p = jax.jit(module.init)(jax.random.key(0), jnp.zeros((3, 1, 4)))["params"]
  assert not np.allclose(p["Dense_0"]["kernel"][0], p["Dense_0"]["kernel"][1])
  shared = MlpExperts(num_experts=3, hidden_size=5, init_mode="shared")
  p = jax.jit(shared.init)(jax.random.key(0), jnp.zeros((3, 1, 4)))["params"]
  np.testing.assert_array_equal(p["Dense_0"]["kernel"][0],
                                p["Dense_0"]["kernel"][2])
  np.testing.assert_array_equal(p["Dense_1"]["kernel"][1],
                                p["Dense_1"]["kernel"][2])
  with pytest.raises(ConfigError, match="init_mode"):
    MlpExperts(num_experts=3, hidden_size=5, init_mode="copy")


@hypothesis.settings(max_examples=12, deadline=None,
                     suppress_health_check=list(hypothesis.HealthCheck))
@hypothesis.given(g=st.integers(1, 3), s=st.integers(1, 9),
                  e=st.integers(1, 6), data=st.data())
def test_random_shapes_einsum_equals_indices_equals_loop(g, s, e, data):
  k = data.draw(st.integers(1, e))
  cf = data.draw(st.sampled_from([0.25, 0.5, 1.0, 1.5, 3.0]))
  bpr = data.draw(st.booleans())
  seed = data.draw(st.integers(0, 2**16))
  rng = np.random.default_rng(seed)
  d = 3
  idx, gates, valid = random_token_routing(rng, g, s, e, k, with_invalid=True)
  x = rng.normal(size=(g, s, d)).astype(np.float32)
  capacity = compute_capacity(s, k, cf, e)
  apply, params = _experts(jax.random.key(seed), e, d, h=4)
  routing = TokenChoiceRouting.create(jnp.asarray(idx), jnp.asarray(gates),
                                      jnp.asarray(valid))
  expected = naive.token_choice_moe(x, idx, gates, valid, e, capacity, params,
                                    bpr)
  for kind in ("einsum", "indices"):
    # One compilation per shape instead of many small eager kernels.
    run = jax.jit(lambda routing, x, kind=kind: _run(make_dispatch_plan(
        routing, num_experts=e, group_size=s, capacity=capacity, kind=kind,
        batch_priority=bpr), x, apply))
    np.testing.assert_allclose(run(routing, jnp.asarray(x)), expected,
                               rtol=1e-5, atol=1e-5, err_msg=kind)
