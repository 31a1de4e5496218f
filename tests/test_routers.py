"""Routers through the full MoE layer, the registry, and their config errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import naive
from vmoe_ext.errors import ConfigError
from vmoe_ext.moe import MoeLayer, compute_capacity
from vmoe_ext.routers import ROUTERS, RoutingContext, build_router
from vmoe_ext.routers.noisy_top_k import NoisyTopKRouter

ROUTER_CONFIGS = {
    "noisy_topk": {"name": "noisy_topk", "num_selected": 2},
    "noisy_topk_bpr_renorm": {"name": "noisy_topk", "num_selected": 2,
                              "renormalize_gates": True},
    "expert_choice": {"name": "expert_choice"},
    "soft": {"name": "soft", "num_slots": 2},
}


def _layer(router_cfg, dispatcher, group_size, e=4, cf=1.0, bpr=False):
  return MoeLayer(router=build_router(router_cfg, num_experts=e),
                  hidden_size=6, group_size=group_size, capacity_factor=cf,
                  dispatcher=dispatcher, batch_priority=bpr)


def _naive_layer(router_cfg, variables, x, layer, mutated, group_size, e):
  """Reference output from the sown routing and the expert params."""
  b, t, d = x.shape
  s = t if group_size is None else group_size
  xg = np.asarray(x).reshape(-1, s, d)
  params = variables["params"]["Mlp"]
  name = router_cfg["name"]
  inter = mutated["intermediates"]
  if name == "noisy_topk":
    # Recompute the routing independently from the router kernel.
    w = np.asarray(variables["params"]["router"]["logits"]["dense"]["kernel"])
    logits = xg @ w
    probs = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    k = router_cfg["num_selected"]
    idx = np.argsort(-probs, axis=-1, kind="stable")[..., :k]
    gates = np.take_along_axis(probs, idx, -1)
    if router_cfg.get("renormalize_gates"):
      gates = gates / gates.sum(-1, keepdims=True)
    np.testing.assert_array_equal(
        inter["selected_experts"][0].reshape(idx.shape), idx)
    cap = compute_capacity(s, k, layer.capacity_factor, e)
    return naive.token_choice_moe(xg, idx, gates, np.ones(idx.shape, bool), e,
                                  cap, params, layer.batch_priority)
  if name == "expert_choice":
    w = np.asarray(variables["params"]["router"]["logits"]["dense"]["kernel"])
    logits = xg @ w
    probs = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    cap = compute_capacity(s, 1, layer.capacity_factor, e)
    idx = np.argsort(-probs.transpose(0, 2, 1), axis=-1, kind="stable")
    idx = idx[..., :cap]
    weights = np.take_along_axis(probs.transpose(0, 2, 1), idx, -1)
    return naive.expert_choice_moe(xg, idx, weights, params)
  disp, comb = naive.soft_routing(xg, variables["params"]["router"]["mu"],
                                  variables["params"]["router"]["scale"])
  return naive.soft_moe(xg, disp, comb, params)


@pytest.mark.parametrize("router", sorted(ROUTER_CONFIGS))
@pytest.mark.parametrize("dispatcher", ["einsum", "indices"])
@pytest.mark.parametrize("b,t,d,group", [(2, 6, 5, 4), (3, 4, 3, None)])
def test_moe_layer_matches_naive_loop(router, dispatcher, b, t, d, group):
  cfg = ROUTER_CONFIGS[router]
  if cfg["name"] == "soft":
    group = None  # SoftMoE groups are whole images.
  e = 4
  layer = _layer(cfg, dispatcher, group, e=e, cf=0.75,
                 bpr=router.endswith("renorm"))
  x = jax.random.normal(jax.random.key(b * t), (b, t, d))
  variables = layer.init(jax.random.key(0), x, RoutingContext())
  (y, metrics, _), mutated = layer.apply(variables, x, RoutingContext(),
                                         mutable=["intermediates"])
  expected = _naive_layer(cfg, variables, x, layer, mutated, group, e)
  np.testing.assert_allclose(np.asarray(y).reshape(expected.shape), expected,
                             rtol=2e-5, atol=2e-5)
  assert "auxiliary_loss" in metrics
  np.testing.assert_allclose(np.sum(metrics["expert_load"]), 1.0, rtol=1e-6)


def test_noise_std_is_noise_std_over_num_experts():
  # With zero weights all clean logits are 0 and E=K=2 keeps both experts:
  # log(g0/g1) = n0 - n1 ~ N(0, 2 (noise_std/E)^2).
  e, noise_std, s = 2, 1.5, 8192
  router = NoisyTopKRouter(num_experts=e, num_selected=2, noise_std=noise_std)
  x = jnp.ones((1, s, 3))
  params = jax.tree.map(jnp.zeros_like,
                        router.init(jax.random.key(0), x, RoutingContext(),
                                    capacity=s, deterministic=True))
  routing = router.apply(params, x, RoutingContext(), capacity=s,
                         deterministic=False,
                         rngs={"gating": jax.random.key(1)}).routing
  g = np.asarray(routing.gates)
  idx = np.asarray(routing.expert_indices)
  g0 = np.where(idx[..., 0] == 0, g[..., 0], g[..., 1])
  log_ratio = np.log(g0) - np.log(1 - g0)
  expected = np.sqrt(2) * noise_std / e
  np.testing.assert_allclose(np.std(log_ratio), expected, rtol=0.05)
  # Deterministic: no noise at all.
  routing = router.apply(params, x, RoutingContext(), capacity=s,
                         deterministic=True).routing
  np.testing.assert_allclose(routing.gates, 0.5, rtol=1e-6)


@pytest.mark.parametrize("cfg,e,field", [
    ({"name": "noisy_topk", "num_selected": 3}, 2, "router.num_selected"),
    ({"name": "noisy_topk", "noise_std": -1.0}, 2, "router.noise_std"),
    ({"name": "noisy_topk", "importance_gates": "x"}, 2,
     "router.importance_gates"),
    ({"name": "noisy_topk", "load_loss_weight": -0.1}, 2,
     "router.load_loss_weight"),
    ({"name": "nosiy_topk"}, 2, "router.name"),
    ({"name": "noisy_topk", "num_selcted": 2}, 2, "router.num_selcted"),
    ({"name": "soft", "num_slots": 0}, 2, "router.num_slots"),
    ({"num_selected": 1}, 2, "router.name"),
])
def test_router_config_errors_name_the_field(cfg, e, field):
  with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
    build_router(cfg, num_experts=e)


def test_registry_lists_the_routers():
  assert {"noisy_topk", "expert_choice", "soft"} <= set(ROUTERS.names())
  assert ROUTERS.get("noisy_topk") is NoisyTopKRouter


def test_soft_router_needs_image_groups():
  layer = _layer({"name": "soft"}, "indices", group_size=8)
  x = jnp.zeros((2, 4, 3))
  with pytest.raises(ConfigError, match="group_size"):
    layer.init(jax.random.key(0), x, RoutingContext())


def test_group_size_must_divide_tokens():
  layer = _layer({"name": "noisy_topk"}, "indices", group_size=5)
  with pytest.raises(ConfigError, match="group_size"):
    layer.init(jax.random.key(0), jnp.zeros((2, 4, 3)), RoutingContext())


@pytest.mark.parametrize("kwargs,field", [
    (dict(capacity_factor=0.0), "capacity_factor"),
    (dict(capacity_factor=-2.0), "capacity_factor"),
    (dict(dispatcher="dense"), "dispatcher"),
    (dict(group_size=0), "group_size"),
])
def test_moe_layer_config_errors(kwargs, field):
  with pytest.raises(ConfigError, match=field):
    MoeLayer(router=build_router({"name": "noisy_topk"}, 2), hidden_size=4,
             **kwargs)
