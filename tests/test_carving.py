"""CMoE carving and the MoE additions it needs, against independent references.

References: unit-by-unit NumPy MLPs and a per-token CMoE router loop
(`tests/naive.py`), brute-force enumeration of balanced partitions, the dense
FFN / dense ViT the carving starts from, and `jax.grad`.
"""

from __future__ import annotations

import functools
import itertools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import naive
from grad_check import assert_grads_match_differences
from vmoe_ext.carving.grouping import (balanced_assignment,
                                       balanced_clusters, distances,
                                       representatives, top_rate_units)
from vmoe_ext.carving.layer import carve_mlp, moe_params, random_split
from vmoe_ext.carving.model import carve_vit
from vmoe_ext.carving.profiling import (activation_markers, activation_rates,
                                        hidden_states)
from vmoe_ext.carving.spec import CarveSpec, carved_model_config
from vmoe_ext.errors import ConfigError
from vmoe_ext.models import build_model
from vmoe_ext.moe.contract import RoutingContext
from vmoe_ext.moe.experts import DenseMlp, MlpExperts
from vmoe_ext.moe.layer import MoeLayer
from vmoe_ext.routers.cmoe import CMoERouter, balance_bias

ACTIVATIONS = ("gelu", "swiglu", "relu")
D, H = 6, 12


def _dense_mlp(activation, seed=0):
  """A dense MLP's params with visible biases, and its module."""
  module = DenseMlp(H, activation=activation)
  params = jax.jit(module.init)(jax.random.key(seed),
                                 jnp.zeros((1, D)))["params"]
  rng = np.random.default_rng(seed + 1)
  params = jax.tree.map(
      lambda a: np.asarray(a) + 0.3 * rng.standard_normal(a.shape).astype(
          np.float32), params)
  return module, params


def _tokens(n, seed=2):
  return np.random.default_rng(seed).standard_normal((n, D)).astype(
      np.float32)


# ------------------------------------------------------------ MoE core pieces


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_dense_mlp_matches_the_unit_loop(activation):
  module, params = _dense_mlp(activation)
  x = _tokens(5)
  y = jax.jit(module.apply)({"params": params}, x)
  ref = np.stack([naive.mlp(params, v, activation) for v in x])
  np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5)
  assert ("Dense_up" in params) == (activation == "swiglu")


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("output_bias", [True, False])
def test_expert_mlps_match_the_unit_loop(activation, output_bias):
  module = MlpExperts(num_experts=3, hidden_size=4, activation=activation,
                      output_bias=output_bias)
  x = np.random.default_rng(0).standard_normal((3, 5, D)).astype(np.float32)
  params = jax.jit(module.init)(jax.random.key(0), x)["params"]
  params = jax.tree.map(lambda a: a + 0.1, params)
  assert ("bias" in params["Dense_1"]) == output_bias
  y = jax.jit(module.apply)({"params": params}, x)
  ref = np.stack([[naive.expert_mlp(params, e, v, activation) for v in x[e]]
                  for e in range(3)])
  np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5)


def _layer(activation="gelu", shared=1, output_bias="once", k=2, e=3,
           hidden=4):
  """A dropless (C = S) MoE layer with the CMoE router."""
  return MoeLayer(router=CMoERouter(num_experts=e, num_selected=k,
                                    activation=activation),
                  hidden_size=hidden, shared_experts=shared,
                  output_bias=output_bias, activation=activation,
                  capacity_factor=e / k)


@pytest.mark.parametrize("output_bias", ["once", "experts"])
def test_shared_experts_and_output_bias_against_the_token_loop(output_bias):
  """y = sum_k w_k E_k(x) + Shared(x) (+ b once), token by token."""
  layer = _layer(shared=2, output_bias=output_bias)
  x = jnp.asarray(np.random.default_rng(3).standard_normal((2, 5, D)),
                  jnp.float32)
  variables = jax.jit(lambda k: layer.init(k, x, RoutingContext()))(
      jax.random.key(0))
  params = jax.tree.map(lambda a: a + 0.05, variables["params"])
  params["router"]["scale"] = jnp.asarray([0.5, -1.0, 2.0])
  y, _, record = jax.jit(lambda v: layer.apply(v, x, RoutingContext()))(
      {**variables, "params": params})
  assert params["SharedMlp"]["Dense_0"]["kernel"].shape == (D, 2 * 4)
  assert ("bias" in params) == (output_bias == "once")
  r = params["router"]
  idx, w = naive.cmoe_route(x.reshape(-1, D), r["kernel"], None,
                            np.asarray(r["scale"]), np.zeros(3), 2, "gelu")
  np.testing.assert_array_equal(record.assignment.expert_indices.reshape(
      -1, 2), idx)
  for n, v in enumerate(np.asarray(x).reshape(-1, D)):
    ref = naive.mlp(params["SharedMlp"], v)
    ref = ref + sum(w[n, j] * naive.expert_mlp(params["Mlp"], idx[n, j], v)
                    for j in range(2))
    if output_bias == "once":
      ref = ref + np.asarray(params["bias"])
    np.testing.assert_allclose(np.asarray(y).reshape(-1, D)[n], ref,
                               rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------- the router


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_cmoe_router_matches_the_token_loop(activation):
  router = CMoERouter(num_experts=5, num_selected=2, activation=activation)
  x = jnp.asarray(np.random.default_rng(4).standard_normal((2, 7, D)),
                  jnp.float32)
  variables = jax.jit(lambda k: router.init(
      k, x, RoutingContext(), capacity=7, deterministic=True))(
          jax.random.key(1))
  scale = jnp.asarray([0.3, -0.7, 1.1, 0.0, 2.0])
  bias = jnp.asarray([0.0, 0.2, -0.1, 0.05, 0.0])
  params = {**variables["params"], "scale": scale}
  out = jax.jit(lambda v: router.apply(v, x, RoutingContext(), capacity=7,
                                       deterministic=True))(
      {"params": params, "router_state": {"bias": bias}})
  idx, w = naive.cmoe_route(np.asarray(x).reshape(-1, D), params["kernel"],
                            params.get("up_kernel"), np.asarray(scale),
                            np.asarray(bias), 2, activation)
  np.testing.assert_array_equal(out.routing.expert_indices.reshape(-1, 2),
                                idx)
  np.testing.assert_allclose(out.routing.gates.reshape(-1, 2), w, rtol=1e-5)


def test_combine_weights_are_one_at_u_zero_and_u_gets_gradients():
  router = CMoERouter(num_experts=4, num_selected=3)
  x = jnp.asarray(np.random.default_rng(5).standard_normal((1, 9, D)),
                  jnp.float32)
  variables = jax.jit(lambda k: router.init(
      k, x, RoutingContext(), capacity=9, deterministic=True))(
          jax.random.key(0))
  out = jax.jit(lambda v: router.apply(v, x, RoutingContext(), capacity=9,
                                       deterministic=True))(variables)
  np.testing.assert_array_equal(out.routing.gates, 1.0)

  def loss(params):
    o = router.apply({**variables, "params": params}, x, RoutingContext(),
                     capacity=9, deterministic=True)
    return jnp.sum(o.routing.gates ** 2)

  grads = jax.jit(jax.grad(loss))(variables["params"])
  # d/du_e of sum (1 + s_e u_e)^2 at u = 0 is 2 * sum of s_e over selections.
  s = jax.nn.softmax(jnp.abs(nn.gelu(x @ variables["params"]["kernel"])))
  sel = jax.nn.one_hot(out.routing.expert_indices, 4).sum(-2)
  np.testing.assert_allclose(grads["scale"], 2 * (s * sel).sum((0, 1)),
                             rtol=1e-5)


def test_bias_update_moves_load_toward_balance():
  """Every token prefers expert 0, by margins that differ across tokens:
  its bias falls and the others' rise until expert 0 holds the mean load;
  experts 1 and 2 score alike, so the rest alternates between them and is
  shared equally over time. Evaluation never moves the bias."""
  router = CMoERouter(num_experts=3, num_selected=1, bias_update_rate=0.02)
  x = np.zeros((1, 9, D), np.float32)
  x[0, :, 0] = np.linspace(0.5, 2.5, 9)
  variables = jax.jit(lambda k: router.init(
      k, x, RoutingContext(), capacity=9, deterministic=True))(
          jax.random.key(0))
  kernel = np.zeros((D, 3), np.float32)
  kernel[0, 0] = 1.0  # Expert 0 scores gelu(x_0) > 0, the others 0.
  params = {**variables["params"], "kernel": jnp.asarray(kernel)}
  state = {"bias": jnp.zeros(3)}

  @functools.partial(jax.jit, static_argnums=1)
  def route(state, update):
    out, new = router.apply({"params": params, "router_state": state}, x,
                            RoutingContext(), capacity=9, deterministic=False,
                            update_state=update, mutable=["router_state"])
    return out.routing.expert_indices, new["router_state"]

  def step(state, update):
    indices, new = route(state, update)
    counts = np.bincount(np.asarray(indices).ravel(), minlength=3)
    return new, counts

  same, counts = step(state, False)
  np.testing.assert_array_equal(same["bias"], 0.0)
  assert counts.tolist() == [9, 0, 0]
  state, _ = step(state, True)
  # Overloaded expert 0 goes down by gamma, the underloaded ones up.
  np.testing.assert_allclose(state["bias"], [-0.02, 0.02, 0.02])
  history = []
  for _ in range(60):
    state, counts = step(state, True)
    history.append(counts)
  first = [int(c[0]) for c in history]
  assert first == sorted(first, reverse=True) and first[-20:] == [3] * 20
  np.testing.assert_allclose(np.mean(history[-20:], axis=0), [3, 3, 3])


def test_balance_bias_against_hand_cases():
  bias = jnp.asarray([0.1, 0.0, -0.2, 0.0])
  np.testing.assert_allclose(
      balance_bias(bias, jnp.asarray([5.0, 1.0, 3.0, 3.0]), 0.01),
      [0.09, 0.01, -0.2, 0.0])  # Mean 3: 5 over, 1 under, 3 at the mean.


# -------------------------------------------------------------- the algorithm


def test_markers_and_rates_against_a_loop():
  h = np.array([[0.1, -3.0, 2.0, 2.0], [5.0, 0.0, -0.5, 0.4],
                [1.0, 1.0, 1.0, 1.0]])
  markers = activation_markers(h, 2)
  expected = np.zeros_like(markers)
  for t, row in enumerate(np.abs(h)):  # Ties: lower index first.
    for i in sorted(range(4), key=lambda j: (-row[j], j))[:2]:
      expected[t, i] = True
  np.testing.assert_array_equal(markers, expected)
  np.testing.assert_allclose(activation_rates(markers), expected.mean(0))


def test_normalised_swiglu_profile_is_the_papers_formula():
  _, params = _dense_mlp("swiglu")
  x = _tokens(4)
  h = hidden_states(params, x, "swiglu", normalize=True)
  for t, v in enumerate(x.astype(np.float64)):
    for i in range(H):
      wg = np.asarray(params["Dense_0"]["kernel"][:, i], np.float64)
      wu = np.asarray(params["Dense_up"]["kernel"][:, i], np.float64)
      bg = float(params["Dense_0"]["bias"][i])
      bu = float(params["Dense_up"]["bias"][i])
      g = (v @ wg + bg) / (np.linalg.norm(v) * np.linalg.norm(wg))
      u = (v @ wu + bu) / (np.linalg.norm(v) * np.linalg.norm(wu))
      np.testing.assert_allclose(h[t, i], naive.silu(g) * u, rtol=1e-9)


def _brute_force_cost(cost, size):
  """Minimum summed cost over every partition of n items into k labelled
  groups of `size` (enumeration)."""
  n, k = cost.shape
  best = np.inf

  def rec(items, label, acc):
    nonlocal best
    if label == k:
      best = min(best, acc)
      return
    for group in itertools.combinations(items, size):
      rest = [i for i in items if i not in group]
      rec(rest, label + 1, acc + cost[list(group), label].sum())

  rec(list(range(n)), 0, 0.0)
  return best


@pytest.mark.parametrize("metric", ["l2", "l1"])
@pytest.mark.parametrize("n,k", [(6, 3), (8, 2), (9, 3)])
def test_balanced_assignment_is_optimal_and_balanced(metric, n, k):
  rng = np.random.default_rng(n * k)
  for trial in range(3):
    points = rng.integers(0, 2, (n, 5)).astype(float)  # 0/1 markers: ties.
    centroids = rng.random((k, 5))
    cost = distances(points, centroids, metric)
    labels, total = balanced_assignment(cost, n // k)
    assert np.bincount(labels, minlength=k).tolist() == [n // k] * k
    np.testing.assert_allclose(total, cost[np.arange(n), labels].sum())
    np.testing.assert_allclose(total, _brute_force_cost(cost, n // k),
                               rtol=1e-12, err_msg=f"trial {trial}")


def test_distances_by_definition():
  p, c = np.array([[0., 1, 1]]), np.array([[1., 1, 0], [0.5, 0.5, 0.5]])
  np.testing.assert_allclose(distances(p, c, "l1"), [[2.0, 1.5]])
  np.testing.assert_allclose(distances(p, c, "l2"),
                             [[np.sqrt(2), np.sqrt(0.75)]])


@pytest.mark.parametrize("metric", ["l2", "l1"])
@pytest.mark.parametrize("iterations", [1, 4])
def test_shared_units_top_rates_and_representatives(metric, iterations):
  _, params = _dense_mlp("gelu", seed=3)
  x = _tokens(40, seed=7)
  layer = carve_mlp(params, x, num_experts=4, num_shared=1,
                    activation="gelu", activation_markers_k=3,
                    distance=metric, iterations=iterations)
  m = H // 4
  assert layer.shared.shape == (m,) and layer.experts.shape == (3, m)
  everything = np.concatenate([layer.shared, layer.experts.ravel()])
  assert sorted(everything.tolist()) == list(range(H))  # A partition.
  rates = layer.rates
  others = np.setdiff1d(np.arange(H), layer.shared)
  assert rates[layer.shared].min() >= rates[others].max()
  np.testing.assert_array_equal(
      np.sort(layer.shared), np.sort(top_rate_units(rates, m)))
  markers = activation_markers(hidden_states(params, x, "gelu"), 3)
  for p, units in enumerate(layer.experts):  # Nearest the cluster's mean.
    centroid = markers[:, units].mean(1)
    d = [distances(markers[:, [u]].T, centroid[None], metric)[0, 0]
         for u in units]
    assert layer.representatives[p] == units[int(np.argmin(d))]
  assert 1 <= layer.iterations <= iterations


def test_clusters_seed_at_the_top_rate_units_and_stop_when_stable():
  markers = np.array([[1, 1, 0, 0], [1, 1, 0, 0], [0, 0, 1, 1]], bool)
  rates = np.array([0.9, 0.1, 0.8, 0.2])
  clusters = balanced_clusters(markers, rates, np.arange(4), 2,
                               iterations=10)
  np.testing.assert_array_equal(clusters.units, [[0, 1], [2, 3]])
  assert clusters.iterations == 2 and clusters.cost == 0.0
  np.testing.assert_array_equal(representatives(markers, clusters), [0, 2])


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_all_experts_active_carved_layer_equals_the_dense_mlp(activation):
  module, params = _dense_mlp(activation)
  x = _tokens(30)
  carved = carve_mlp(params, x, num_experts=4, num_shared=1,
                     activation=activation, activation_markers_k=2)
  layer = _layer(activation, shared=1, k=3, e=3, hidden=H // 4)
  xs = jnp.asarray(x[None])
  fresh = jax.jit(lambda k: layer.init(k, xs, RoutingContext()))(
      jax.random.key(0))
  moe = moe_params(params, carved, activation)
  y, _, _ = jax.jit(lambda v: layer.apply(v, xs, RoutingContext()))(
      {**fresh, "params": moe})
  np.testing.assert_allclose(y[0], jax.jit(module.apply)({"params": params},
                                                         x),
                             rtol=1e-5, atol=1e-5)
  # Routing with fewer experts drops exactly the unselected experts' units.
  few = _layer(activation, shared=1, k=1, e=3, hidden=H // 4)
  y1, _, rec = jax.jit(lambda v: few.apply(v, xs, RoutingContext()))(
      {**fresh, "params": moe})
  for t, v in enumerate(x):
    e = int(rec.assignment.expert_indices[0, t, 0])
    units = np.concatenate([carved.shared, carved.experts[e]])
    sub = {"Dense_0": {k: (a[:, units] if k == "kernel" else a[units])
                       for k, a in params["Dense_0"].items()},
           "Dense_1": {"kernel": params["Dense_1"]["kernel"][units],
                       "bias": params["Dense_1"]["bias"]}}
    if activation == "swiglu":
      sub["Dense_up"] = {k: (a[:, units] if k == "kernel" else a[units])
                         for k, a in params["Dense_up"].items()}
    np.testing.assert_allclose(y1[0, t], naive.mlp(sub, v, activation),
                               rtol=1e-5, atol=1e-5)


def test_random_split_is_a_seeded_partition():
  a = random_split(16, num_experts=4, num_shared=1, seed=3)
  b = random_split(16, num_experts=4, num_shared=1, seed=3)
  c = random_split(16, num_experts=4, num_shared=1, seed=4)
  np.testing.assert_array_equal(a.experts, b.experts)
  assert not np.array_equal(a.experts, c.experts)
  assert sorted(np.concatenate([a.shared, a.experts.ravel()]).tolist()) == (
      list(range(16)))
  assert a.representatives is None


# ----------------------------------------------------------------- whole ViTs

DENSE = dict(name="vit", num_classes=5, patch_size=(4, 4), hidden_size=8,
             num_layers=3, num_heads=2, mlp_dim=16)


def _dense_vit(activation):
  config = {**DENSE, "mlp_activation": activation}
  model = build_model(config)
  images = np.random.default_rng(8).standard_normal((6, 8, 8, 1)).astype(
      np.float32)
  params = jax.tree.map(np.asarray, jax.jit(model.init)(
      jax.random.key(0), images)["params"])
  params["head"]["kernel"] = np.random.default_rng(9).standard_normal(
      params["head"]["kernel"].shape).astype(np.float32)
  return config, model, params, images


@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_all_active_carved_vit_has_the_dense_logits(activation):
  config, model, params, images = _dense_vit(activation)
  spec = CarveSpec(checkpoint_dir="-", num_experts=4, num_shared=1,
                   num_activated=3, activation_markers=3)
  spec.check(config)
  result = carve_vit(config, params, images, spec)
  carved = build_model(result.model)
  assert carved.moe_layers == (0, 1, 2)
  logits, _ = jax.jit(carved.apply)(
      {"params": result.params, **result.collections}, images)
  np.testing.assert_allclose(logits, jax.jit(model.apply)({"params": params},
                                                          images)[0],
                             rtol=1e-5, atol=1e-5)
  again = carve_vit(config, params, images, spec)  # Deterministic.
  jax.tree.map(np.testing.assert_array_equal, again.params, result.params)


def test_blocks_are_calibrated_on_the_carved_blocks_outputs():
  """Block 1's grouping is that of its MLP inputs in the model whose block 0
  is already carved (captured here by intercepting the MLP call)."""
  config, _, params, images = _dense_vit("gelu")
  spec = CarveSpec(checkpoint_dir="-", num_experts=4, num_shared=1,
                   num_activated=1, layers=(0, 1), every=None,
                   activation_markers=3)
  result = carve_vit(config, params, images, spec)
  partial = build_model(carved_model_config(
      config, CarveSpec(num_experts=4, num_shared=1, num_activated=1,
                        layers=(0,), every=None)))
  first = {**params, "encoderblock_0": result.params["encoderblock_0"]}
  seen = []

  def grab(next_fun, args, kwargs, context):
    if (context.method_name == "__call__" and isinstance(
        context.module, DenseMlp) and context.module.name == "Mlp"
        and context.module.parent.name == "encoderblock_1"):
      seen.append(np.asarray(args[0]))
    return next_fun(*args, **kwargs)

  with nn.intercept_methods(grab):
    partial.apply({"params": first, **result.collections}, images)
  x = seen[0].reshape(-1, seen[0].shape[-1])
  direct = carve_mlp(params["encoderblock_1"]["Mlp"], x, num_experts=4,
                     num_shared=1, activation="gelu", activation_markers_k=3)
  np.testing.assert_array_equal(result.layers[1].experts, direct.experts)
  np.testing.assert_array_equal(result.layers[1].shared, direct.shared)


def test_random_split_vit_keeps_a_fresh_router():
  config, _, params, images = _dense_vit("gelu")
  spec = CarveSpec(checkpoint_dir="-", num_experts=4, num_shared=1,
                   num_activated=1, method="random")
  result = carve_vit(config, params, images, spec)
  assert result.model["moe"]["router"]["name"] == "noisy_topk"
  fresh = jax.jit(build_model(result.model).init)(jax.random.key(spec.seed),
                                                   images[:1])["params"]
  for i in range(3):
    np.testing.assert_array_equal(
        result.params[f"encoderblock_{i}"]["Moe"]["router"]["logits"][
            "dense"]["kernel"],
        fresh[f"encoderblock_{i}"]["Moe"]["router"]["logits"]["dense"][
            "kernel"])
    np.testing.assert_array_equal(
        result.params[f"encoderblock_{i}"]["Attention"]["query"]["kernel"],
        params[f"encoderblock_{i}"]["Attention"]["query"]["kernel"])


# ------------------------------------------------------------------ bad input


@pytest.mark.parametrize("change,field", [
    (dict(num_experts=5), "carve.num_experts"),      # 16 % 5 != 0
    (dict(num_shared=4), "carve.num_shared"),        # shared >= total
    (dict(num_activated=4), "carve.num_activated"),  # > routed (3)
    (dict(num_activated=0), "carve.num_activated"),
    (dict(activation_markers=0), "carve.activation_markers"),
    (dict(activation_markers=17), "carve.activation_markers"),
    (dict(num_calibration=0), "carve.num_calibration"),
    (dict(checkpoint_dir=None), "carve.checkpoint_dir"),
    (dict(distance="cos"), "carve.distance"),
    (dict(method="moefication"), "carve.method"),
    (dict(iterations=0), "carve.iterations"),
    (dict(every=None, layers=(7,)), "carve.layers"),
])
def test_bad_carve_fields_name_the_field(change, field):
  spec = CarveSpec(**{**dict(checkpoint_dir="-", num_experts=4,
                             num_shared=1, num_activated=1), **change})
  with pytest.raises(ConfigError) as e:
    spec.check(DENSE)
  assert e.value.field == field, e.value


@pytest.mark.parametrize("model,field", [
    ({**DENSE, "name": "vit_moe", "moe": {"every": 2}}, "model.name"),
    ({**DENSE, "mlp_activation": "tanh"}, "model.mlp_activation"),
    ({**DENSE, "stream": {"name": "momentum"}}, "model.stream"),
])
def test_carving_rejects_models_it_cannot_carve(model, field):
  with pytest.raises(ConfigError) as e:
    CarveSpec(checkpoint_dir="-", num_experts=4).check(model)
  assert e.value.field == field


def test_profiling_rejects_an_unknown_activation_and_empty_data():
  _, params = _dense_mlp("gelu")
  with pytest.raises(ConfigError, match="model.mlp_activation"):
    hidden_states(params, _tokens(2), "tanh")
  with pytest.raises(ConfigError, match="carve.num_calibration"):
    carve_mlp(params, np.zeros((0, D)), num_experts=4, num_shared=1,
              activation="gelu")


@pytest.mark.parametrize("moe,field", [
    ({"shared_experts": -1}, "model.moe.shared_experts"),
    ({"output_bias": "twice"}, "model.moe.output_bias"),
    ({"router": {"name": "cmoe", "activation": "tanh"}},
     "model.moe.router.activation"),
    ({"router": {"name": "cmoe", "bias_update_rate": -1.0}},
     "model.moe.router.bias_update_rate"),
    ({"router": {"name": "cmoe", "num_selected": 9}},
     "model.moe.router.num_selected"),
])
def test_bad_moe_fields_name_the_field(moe, field):
  config = {**DENSE, "name": "vit_moe",
            "moe": {"every": 2, "num_experts": 4, **moe}}
  with pytest.raises(ConfigError) as e:
    build_model(config)
  assert e.value.field == field, e.value


def test_bad_model_activation_names_the_field():
  with pytest.raises(ConfigError) as e:
    build_model({**DENSE, "mlp_activation": "tanh"})
  assert e.value.field == "model.mlp_activation"


# -------------------------------------------------------------- composability

CMOE = {"name": "cmoe", "num_selected": 2, "bias_update_rate": 0.01}


@pytest.mark.parametrize("router,stream,shared", [
    ({"name": "symphony", "base": CMOE}, None, 1),
    ({"name": "acmoe", "base": CMOE}, {"name": "momentum"}, 1),
    (CMOE, {"name": "robust_momentum"}, 2),
    ({"name": "soft", "num_slots": 2}, None, 1),
])
def test_cmoe_and_shared_experts_compose_under_jit_and_grad(router, stream,
                                                             shared):
  """The CMoE router under Symphony / ACMoE, with momentum streams, and
  shared experts on SoftMoE: a training forward and backward under jit. The
  gradient is the float64 finite differences' (`grad_check`), shared experts
  included; the bias moves by gamma against the mean of the selection counts
  (NumPy, from the sown selections; with a zero graph Symphony falls back
  to its base's top-K, and ACMoE selects with its base); plain CMoE selects
  as the per-token NumPy router on the sown MoE input."""
  soft = router["name"] == "soft"
  config = dict(name="soft_moe_vit" if soft else "vit_moe", num_classes=3,
                patch_size=(4, 4), hidden_size=8, num_layers=3, num_heads=2,
                mlp_dim=8, stream=stream,
                moe=dict(layers=(1, 2), num_experts=4, capacity_factor=2.0,
                         shared_experts=shared, output_bias="once",
                         router=router))
  model = build_model(config)
  images = jax.random.uniform(jax.random.key(0), (4, 8, 8, 1))
  variables = jax.jit(model.init)(jax.random.key(1), images)
  params = variables.pop("params")
  params["head"]["kernel"] = jax.random.normal(jax.random.key(4),
                                               params["head"]["kernel"].shape)

  def loss(p, state, m=model):
    (logits, metrics), new = m.apply(
        {"params": p, **state}, images, deterministic=False,
        update_state=True, mutable=["router_state", "intermediates"],
        rngs={"gating": jax.random.key(2), "dropout": jax.random.key(3)})
    return jnp.sum(logits ** 2) + metrics["auxiliary_loss"], new

  grads, new = jax.jit(jax.grad(loss, has_aux=True))(params, variables)

  def downstream(path):
    """The leaves after the last routing decision (block 2's experts,
    shared experts, CMoE combine scale, post-LayerNorm; the head): the loss
    is smooth in them. Earlier ones move the top-K selections of a loss this
    steep within any usable step (routers' gradients: test_models.py)."""
    if path.startswith(("head/", "encoder_norm/")):
      return True
    if not path.startswith(("encoderblock_2/Moe/", "encoderblock_2/Stream/")):
      return False
    return "/router/" not in path or (path.endswith("/scale") and not soft)

  model64 = model.clone(dtype=jnp.float64)
  checked, _ = assert_grads_match_differences(
      lambda p: loss(p, variables, model64)[0], params, grads,
      only=downstream)
  assert checked >= 10
  shared_grad = grads["encoderblock_2"]["Moe"]["SharedMlp"]["Dense_0"][
      "kernel"]
  assert np.abs(np.asarray(shared_grad)).sum() > 0
  if soft:
    assert not [p for p, _ in flax_paths(new) if p.endswith("bias")]
    return
  for i in (1, 2):
    moe = new["intermediates"][f"encoderblock_{i}"]["Moe"]
    selected = np.asarray(moe["selected_experts"][0])  # [B, T, K]
    path = ["router"] + ["base"] * (router is not CMOE)
    bias_state = new["router_state"][f"encoderblock_{i}"]["Moe"]
    cmoe_params = params[f"encoderblock_{i}"]["Moe"]
    for key in path:
      bias_state, cmoe_params = bias_state[key], cmoe_params[key]
    if router is CMOE:  # The selection itself, token by token.
      x = np.asarray(moe["moe_input"][0]).reshape(-1, 8)
      want, _ = naive.cmoe_route(x, cmoe_params["kernel"], None,
                                 np.asarray(cmoe_params["scale"]),
                                 np.zeros(4), 2, "gelu")
      np.testing.assert_array_equal(selected.reshape(-1, 2), want)
    counts = np.bincount(selected.ravel(), minlength=4)
    want = 0.01 * np.sign(counts.mean() - counts)
    assert np.any(want != 0)
    np.testing.assert_allclose(np.asarray(bias_state["bias"]), want,
                               rtol=1e-6, atol=0)


def flax_paths(tree):
  from flax.traverse_util import flatten_dict
  return flatten_dict(dict(tree), sep="/").items()
