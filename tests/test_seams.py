"""The seams the paper methods build on: token-major assignments from every
routing form, pytree dispatch plans, experts as a pure function, bfloat16
dispatch, expert-choice noise, and the errors of misplaced components."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import naive
from vmoe_ext.errors import ConfigError
from vmoe_ext.models import build_model
from vmoe_ext.moe.capacity import compute_capacity
from vmoe_ext.moe.contract import RoutingContext
from vmoe_ext.moe.dispatch import make_dispatch_plan
from vmoe_ext.moe.experts import MlpExperts, mlp_experts
from vmoe_ext.moe.layer import MoeLayer
from vmoe_ext.moe.routing import (ExpertChoiceRouting, SoftRouting,
                                  TokenChoiceRouting)
from vmoe_ext.routers.expert_choice import ExpertChoiceRouter
from vmoe_ext.routers.registry import ROUTERS, build_router
from vmoe_ext.routers.noisy_top_k import NoisyTopKRouter


def test_expert_choice_assignment_hand_case():
  # S=3 tokens, E=2 experts, C=2: expert 0 picks tokens (2, 0) with weights
  # (.9, .5); expert 1 picks (0, 1) with (.7, .6).
  routing = ExpertChoiceRouting(jnp.array([[[2, 0], [0, 1]]], jnp.int32),
                                jnp.array([[[.9, .5], [.7, .6]]]), 3)
  idx, gates, valid = routing.assignment(2)
  np.testing.assert_array_equal(idx[0], [[1, 0], [1, -1], [0, -1]])
  np.testing.assert_allclose(gates[0], [[.7, .5], [.6, 0], [.9, 0]])
  np.testing.assert_array_equal(valid[0], [[1, 1], [1, 0], [1, 0]])
  np.testing.assert_array_equal(
      routing.expert_mask(2)[0], [[1, 1], [0, 1], [1, 0]])


def test_soft_assignment_hand_case():
  # E=2 experts with P=2 slots: slot j belongs to expert j // 2.
  combine = jnp.array([[[[.1, .4], [.3, .2]]]])  # [G=1, S=1, E=2, P=2]
  routing = SoftRouting(jnp.zeros_like(combine), combine, assigned_slots=3)
  idx, gates, valid = routing.assignment(2)
  np.testing.assert_array_equal(idx[0, 0], [0, 1, 1])  # slots 1, 2, 3
  np.testing.assert_allclose(gates[0, 0], [.4, .3, .2])
  assert bool(np.all(valid))
  # K is capped at the E*P slots.
  wide = SoftRouting(jnp.zeros_like(combine), combine, assigned_slots=8)
  assert wide.assignment(2)[0].shape == (1, 1, 4)


def test_token_choice_assignment_marks_invalid_choices():
  routing = TokenChoiceRouting.create(
      jnp.array([[[2, 1]]]), jnp.array([[[.6, .3]]]),
      jnp.array([[[True, False]]]))
  idx, gates, valid = routing.assignment(3)
  np.testing.assert_array_equal(idx, [[[2, -1]]])
  np.testing.assert_allclose(gates, [[[.6, 0]]])
  np.testing.assert_array_equal(valid, [[[True, False]]])


@pytest.mark.parametrize("router", [
    {"name": "noisy_topk", "num_selected": 2},
    {"name": "expert_choice"},
    {"name": "soft", "num_slots": 2, "assigned_slots": 3},
])
def test_layer_record_is_token_major_and_independent_of_grouping(router):
  """The record a layer leaves is `[B, T, K]` in image order: the same for
  any routing grouping (for routers whose choices do not depend on it)."""
  b, t, d, e = 2, 6, 5, 3
  x = jax.random.normal(jax.random.key(0), (b, t, d))
  records = []
  groupings = (None,) if router["name"] != "noisy_topk" else (None, 4, 12)
  for group_size in groupings:
    layer = MoeLayer(router=build_router(router, num_experts=e),
                     hidden_size=4, group_size=group_size,
                     capacity_factor=1.0)
    # Jitted: one compilation each, not op-by-op eager ones.
    variables = jax.jit(lambda k, x: layer.init(k, x, RoutingContext()))(
        jax.random.key(1), x)
    (_, _, record), sown = jax.jit(lambda v, x: layer.apply(
        v, x, RoutingContext(), mutable=["intermediates"]))(variables, x)
    records.append(record)
    mask = sown["intermediates"]["expert_mask"][0]  # [B, T, E]
    a = record.assignment
    assert a.expert_indices.shape[:2] == (b, t)
    # Every valid entry is an expert the token went to (soft: its slots'
    # experts), and the sown selection is the assignment.
    np.testing.assert_array_equal(sown["intermediates"]["selected_experts"][0],
                                  a.expert_indices)
    if router["name"] != "soft":
      one_hot = jax.nn.one_hot(a.expert_indices, e, dtype=bool)
      np.testing.assert_array_equal(
          np.any(one_hot & a.valid[..., None], axis=2), mask)
  for other in records[1:]:
    np.testing.assert_array_equal(other.assignment.expert_indices,
                                  records[0].assignment.expert_indices)
    np.testing.assert_array_equal(other.assignment.gates,
                                  records[0].assignment.gates)


def test_experts_are_a_pure_function_of_their_weights():
  e, n, d, h = 3, 4, 5, 6
  module = MlpExperts(num_experts=e, hidden_size=h)
  x = jax.random.normal(jax.random.key(0), (e, n, d))
  params = module.init(jax.random.key(1), x)["params"]
  y = mlp_experts(params, x)
  np.testing.assert_array_equal(y, module.apply({"params": params}, x))
  # Weights passed as arguments of a jitted function.
  np.testing.assert_allclose(jax.jit(mlp_experts)(params, x), y, rtol=1e-6,
                             atol=1e-6)
  for i, j in np.ndindex(e, n):
    np.testing.assert_allclose(
        y[i, j], naive.expert_mlp(params, i, np.asarray(x[i, j], np.float64)),
        rtol=1e-5, atol=1e-6)


def test_dispatch_plans_are_pytrees_that_cross_jit():
  routing = TokenChoiceRouting.create(jnp.array([[[0], [1], [0], [0]]]),
                                      jnp.full((1, 4, 1), 0.5))
  x = jnp.arange(8.0).reshape(1, 4, 2)
  for kind in ("einsum", "indices"):
    plan = make_dispatch_plan(routing, num_experts=2, group_size=4,
                              capacity=2, kind=kind)
    leaves, treedef = jax.tree.flatten(plan)
    assert leaves and all(isinstance(v, jax.Array) for v in leaves)
    rebuilt = jax.tree.unflatten(treedef, leaves)
    assert rebuilt.capacity == 2
    out = jax.jit(lambda p, v: p.dispatcher.dispatch(v))(plan, x)
    # Expert 0 holds tokens 0 and 2 (token 3 is dropped); expert 1 token 1.
    np.testing.assert_array_equal(out, [[[0, 1], [4, 5]], [[2, 3], [0, 0]]])


def test_bfloat16_dispatch_matches_the_naive_loop_to_bfloat16_precision():
  b, t, d, e = 2, 6, 4, 3
  x = jax.random.normal(jax.random.key(0), (b, t, d))
  cfg = {"name": "noisy_topk", "num_selected": 2, "renormalize_gates": True}
  outputs = {}
  for dtype in (None, "bfloat16"):
    layer = MoeLayer(router=build_router(cfg, num_experts=e), hidden_size=5,
                     group_size=6, capacity_factor=1.0, dispatch_dtype=dtype,
                     dispatcher="einsum")
    # Jitted: one compilation each, not op-by-op eager ones.
    variables = jax.jit(lambda k, x: layer.init(k, x, RoutingContext()))(
        jax.random.key(1), x)
    outputs[dtype] = jax.jit(lambda v, x: layer.apply(
        v, x, RoutingContext())[0])(variables, x)
  assert outputs["bfloat16"].dtype == jnp.float32  # Cast back to x's dtype.
  # bfloat16 keeps 8 bits of mantissa: agreement to ~1e-2, not better.
  np.testing.assert_allclose(outputs["bfloat16"], outputs[None], rtol=5e-2,
                             atol=5e-2)
  assert not np.array_equal(outputs["bfloat16"], outputs[None])
  # What exactly is rounded (the data, not the weights) is checked against
  # a NumPy reference in tests/test_bfloat16_dispatch.py.


def test_expert_choice_noise_std_is_noise_std_over_num_experts():
  # Zero weights: clean logits are 0; C = S so every expert keeps every
  # token and the log-ratio of two gates is n0 - n1 ~ N(0, 2 (std/E)^2).
  e, noise_std, s = 2, 1.5, 4096
  router = ExpertChoiceRouter(num_experts=e, noise_std=noise_std)
  x = jnp.ones((1, s, 3))
  # Jitted: one compilation each, not op-by-op eager ones.
  params = jax.tree.map(jnp.zeros_like, jax.jit(lambda k, x: router.init(
      k, x, RoutingContext(), capacity=s, deterministic=True))(
          jax.random.key(0), x))

  def noisy(r):
    return jax.jit(lambda v, x, k: r.apply(
        v, x, RoutingContext(), capacity=s, deterministic=False,
        rngs={"gating": k}).routing)

  routing = noisy(router)(params, x, jax.random.key(1))
  weights, _ = routing._token_weights()  # pylint: disable=protected-access
  log_ratio = np.log(weights[0, :, 0]) - np.log(weights[0, :, 1])
  np.testing.assert_allclose(np.std(log_ratio), np.sqrt(2) * noise_std / e,
                             rtol=0.05)
  quiet = jax.jit(lambda v, x: router.apply(
      v, x, RoutingContext(), capacity=s, deterministic=True).routing)(
          params, x)
  np.testing.assert_allclose(quiet.weights, 0.5)
  # The default adds no noise, as before.
  plain = ExpertChoiceRouter(num_experts=e)
  routing = noisy(plain)(params, x, jax.random.key(1))
  np.testing.assert_allclose(routing.weights, 0.5)


def test_vmoe_capacity_rounding_reaches_the_layer():
  x = jnp.zeros((1, 800, 4))
  for rounding, expected in (("exact", 220), ("vmoe", 224)):
    layer = MoeLayer(router=NoisyTopKRouter(num_experts=8, num_selected=2),
                     hidden_size=2, capacity_factor=1.1,
                     capacity_rounding=rounding)
    # Jitted: one compilation each, not op-by-op eager ones.
    variables = jax.jit(lambda k, x: layer.init(k, x, RoutingContext()))(
        jax.random.key(0), x)
    assert variables["params"]["Mlp"]["Dense_0"]["kernel"].shape == (8, 4, 2)
    assert compute_capacity(800, 2, 1.1, 8, rounding=rounding) == expected
    (_, metrics, _) = jax.jit(lambda v, x: layer.apply(
        v, x, RoutingContext()))(variables, x)
    # Zero tokens: all logits tie, every token picks experts 0 and 1, which
    # keep C choices each of the 1,600.
    np.testing.assert_allclose(metrics["drop_rate"], 1 - 2 * expected / 1600,
                               rtol=1e-6)


class _NeedsPrevious(NoisyTopKRouter):
  needs_previous = True


@pytest.fixture
def needs_previous_router():
  ROUTERS.entries["needs_previous"] = "test_seams:_NeedsPrevious"
  yield
  del ROUTERS.entries["needs_previous"]


def test_a_router_needing_the_previous_layer_cannot_route_the_first_one(
    needs_previous_router):
  cfg = dict(name="vit_moe", num_classes=3, patch_size=(4, 4), hidden_size=8,
             num_layers=2, num_heads=2, mlp_dim=8,
             moe=dict(every=1, num_experts=2,
                      router={"name": "needs_previous"}))
  with pytest.raises(ConfigError, match=r"model\.moe\.router\.name.*first"):
    build_model(cfg)


def test_stream_is_chosen_at_the_model_level():
  cfg = dict(name="vit_moe", num_classes=3, patch_size=(4, 4), hidden_size=8,
             num_layers=2, num_heads=2, mlp_dim=8,
             moe=dict(every=1, num_experts=2, stream={"name": "plain"}))
  with pytest.raises(ConfigError, match=r"model\.moe\.stream.*model\.stream"):
    build_model(cfg)
  del cfg["moe"]["stream"]
  with pytest.raises(ConfigError, match=r"model\.stream\.blocks"):
    build_model(dict(cfg, stream={"name": "plain", "blocks": "dense"}))
