"""Symphony router (docs/routers.md): Algorithm 1 against a NumPy loop, the graph
as training state (evaluation, attacks, checkpoints, data parallelism),
Proposition 1 on random graphs, SymphonySoftMoE, configs and bad input."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

import naive
from resume_check import short_schedule, straight_vs_resumed
from sharded_check import one_vs_eight_devices
from vmoe_ext.errors import ConfigError
from vmoe_ext.evaluate.evaluator import Evaluator
from vmoe_ext.models import build_model
from vmoe_ext.moe.contract import RoutingContext
from vmoe_ext.moe.layer import MoeLayer
from vmoe_ext.routers import symphony as sym
from vmoe_ext.routers.registry import ROUTERS
from vmoe_ext.routers.symphony_soft import symphony_soft_combine
from vmoe_ext.train.config_files import load_config
from vmoe_ext.train.state import TrainState
from vmoe_ext.train.steps import make_train_step
from vmoe_ext.app.schema import validate_config

E = 4


def _router(**fields):
  config = {"name": "symphony",
            "base": {"name": "noisy_topk", "num_selected": 2,
                     "noise_std": 0.0}, **fields}
  return ROUTERS.build(config, num_experts=E)


def _apply(router, variables, x, update_state, deterministic=True):
  out, new = router.apply(variables, x, RoutingContext(), capacity=8,
                          deterministic=deterministic,
                          update_state=update_state, mutable=["router_state"])
  return out, new["router_state"]["adjacency"]


@pytest.mark.parametrize("k,init,threshold,beta", [
    (2, "zeros", 0.0, 0.9), (1, "zeros", 0.0, 0.5), (3, "identity", 0.0, 0.7),
    (2, "uniform", 0.2, 0.9), (2, "random", 0.3, 0.3)])
def test_three_steps_follow_algorithm_1(k, init, threshold, beta):
  """Routing of each batch (smoothed with the graph *before* its update)
  and the graph after each update equal the NumPy loop of Algorithm 1."""
  router = _router(base={"name": "noisy_topk", "num_selected": k,
                         "noise_std": 0.0}, graph_init=init, threshold=threshold,
                   beta=beta)
  batches = jax.random.normal(jax.random.key(0), (3, 2, 6, 5))
  variables = router.init(jax.random.key(1), batches[0], RoutingContext(),
                          capacity=8, deterministic=True)
  kernel = np.asarray(variables["params"]["base"]["logits"]["dense"]
                      ["kernel"], np.float64)
  a = np.asarray(variables["router_state"]["adjacency"], np.float64)
  if init == "random":
    assert np.all((a >= 0) & (a < 1)) and a.std() > 0.1
  else:
    np.testing.assert_array_equal(a, {"zeros": np.zeros((E, E)),
                                      "identity": np.eye(E),
                                      "uniform": np.full((E, E), 0.25)}[init])
  for step, x in enumerate(batches):
    out, new = _apply(router, variables, x, update_state=True,
                      deterministic=False)
    idx, w, a = naive.symphony_step(np.asarray(x).reshape(-1, 5), kernel, a,
                                    k=k, beta=beta, threshold=threshold)
    routing = out.routing
    np.testing.assert_array_equal(
        np.asarray(routing.expert_indices).reshape(-1, k), idx,
        err_msg=f"step {step}")
    np.testing.assert_allclose(np.asarray(routing.gates).reshape(-1, k), w,
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(new, a, rtol=1e-5, atol=1e-6)
    zero_graph = step == 0 and init == "zeros"
    assert float(out.metrics["symphony_fallback"]) == float(zero_graph)
    variables = {**variables, "router_state": {"adjacency": new}}


def test_first_update_counts_the_noisy_base_selection_in_the_model():
  """In training the base's noise is part of gamma: with the zero graph the
  first step routes by the (noisy) base gates, so the graph after it is
  (1 - beta) RowNorm of the co-selections of what the layer sowed."""
  model = _model({"name": "symphony", "beta": 0.8,
                  "base": {"name": "noisy_topk", "num_selected": 2,
                           "noise_std": 2.0}})
  images = jax.random.uniform(jax.random.key(0), (4, 8, 8, 1))
  # Jitted: one compilation each, not op-by-op eager ones.
  variables = jax.jit(model.init)(jax.random.key(1), images)
  (_, metrics), new = jax.jit(lambda v, x, k: model.apply(
      v, x, deterministic=False, update_state=True, rngs={"gating": k},
      mutable=["router_state", "intermediates"]))(
          variables, images, jax.random.key(5))
  _, clean = jax.jit(lambda v, x: model.apply(
      v, x, mutable=["intermediates"]))(variables, images)
  differs = 0
  for block in ("encoderblock_1", "encoderblock_3"):
    assert float(metrics[f"layer_{block[-1]}"]["symphony_fallback"]) == 1
    chosen = np.asarray(new["intermediates"][block]["Moe"]
                        ["selected_experts"][0]).reshape(-1, 2)
    differs += np.sum(np.sort(chosen, -1) != np.sort(np.asarray(
        clean["intermediates"][block]["Moe"]["selected_experts"][0]
    ).reshape(-1, 2), -1))
    counts = np.zeros((E, E))
    for row in chosen:
      for i in row:
        for j in row:
          counts[i, j] += 1
    want = 0.2 * counts / counts.sum(1, keepdims=True).clip(1)
    np.testing.assert_allclose(new["router_state"][block]["Moe"]["router"]
                               ["adjacency"], want, rtol=1e-6)
  # The noise changed some selections (else this test would not see it).
  assert differs > 0


def test_base_gates_seam_is_what_the_base_selected_from():
  """`RouterOutput.gates` of a token-choice router: its top-K are the
  routing's choices and (V-MoE, not renormalised) their combine weights."""
  x = jax.random.normal(jax.random.key(0), (2, 6, 5))
  for config in ({"name": "noisy_topk", "num_selected": 2, "noise_std": 1.},
                 {"name": "cosine", "num_selected": 3},
                 {"name": "top_p", "num_selected": 3, "threshold": 0.2}):
    router = ROUTERS.build(config, num_experts=E)
    variables = router.init(jax.random.key(1), x, RoutingContext(),
                            capacity=8, deterministic=True)
    out = router.apply(variables, x, RoutingContext(), capacity=8,
                       deterministic=False,
                       rngs={"gating": jax.random.key(2)})
    np.testing.assert_allclose(np.asarray(out.gates).sum(-1), 1, rtol=1e-6)
    top, idx = jax.lax.top_k(out.gates, out.routing.num_selected)
    np.testing.assert_array_equal(idx, out.routing.expert_indices)
    valid = np.asarray(out.routing.valid)
    np.testing.assert_allclose(np.asarray(out.routing.gates)[valid],
                               np.asarray(top)[valid], rtol=1e-6)


def test_rows_of_the_normalised_counts_sum_to_one():
  counts = np.array([[3., 1, 0], [1, 2, 0], [0, 0, 0]])
  normed = np.asarray(sym.row_normalize(jnp.asarray(counts)))
  np.testing.assert_allclose(normed.sum(1), [1, 1, 0])
  np.testing.assert_allclose(normed[0], [0.75, 0.25, 0])
  idx = jnp.array([[0, 1], [1, 0], [0, 2], [2, 2]])  # Last: a set of one.
  valid = jnp.array([[True, True], [True, True], [True, False],
                     [True, True]])
  np.testing.assert_array_equal(
      sym.coselection_counts(idx, valid, 3),
      [[3, 2, 0], [2, 2, 0], [0, 0, 1]])


def test_frozen_in_evaluation_used_in_routing_and_no_gradient():
  router = _router()
  x = jax.random.normal(jax.random.key(0), (2, 6, 5))
  variables = router.init(jax.random.key(1), x, RoutingContext(), capacity=8,
                          deterministic=True)
  graph = jnp.array([[0., 0, 0, 1], [0, 0, 1, 0], [0, 1, 0, 0],
                     [1, 0, 0, 0]])
  variables = {**variables, "router_state": {"adjacency": graph}}
  out, same = _apply(router, variables, x, update_state=False)
  np.testing.assert_array_equal(same, graph)
  # A permutation graph sends each token to the permuted base choice.
  base, _ = _apply(router, {**variables, "router_state": {
      "adjacency": jnp.eye(E)}}, x, update_state=False)
  np.testing.assert_array_equal(out.routing.expert_indices,
                                3 - np.asarray(base.routing.expert_indices))
  grad = jax.grad(lambda a: jnp.sum(sym.smooth_gates(
      jax.nn.softmax(x[..., :E]), a)[0] ** 2))(graph)
  np.testing.assert_array_equal(grad, 0)


def _model(router, **kw):
  return build_model(dict(
      name="vit_moe", num_classes=3, patch_size=(4, 4), hidden_size=8,
      num_layers=4, num_heads=2, mlp_dim=8,
      moe=dict(layers=(1, 3), num_experts=E, capacity_factor=2.0,
               group_size=10, router=router), **kw))


def test_trained_graph_frozen_under_evaluation_and_attacks():
  model = _model({"name": "symphony",
                  "base": {"name": "noisy_topk", "num_selected": 2}})
  images = jax.random.uniform(jax.random.key(0), (4, 8, 8, 1))
  labels = jnp.array([0, 1, 2, 0])
  import optax
  state = TrainState.create(jax.jit(model.init)(jax.random.key(1), images),
                            optax.adam(1e-2), jax.random.key(2))
  step = jax.jit(make_train_step(model))
  selected = []
  for _ in range(3):
    state, metrics = step(state, {"image": images, "label": labels})
    selected.append(np.asarray(metrics["layer_1/expert_load"]) > 0)
  graph = state.collections["router_state"]["encoderblock_1"]["Moe"][
      "router"]["adjacency"]
  # Three EMA updates (beta 0.9) from zero, each adding a row that sums to 1
  # for every expert selected in that step: row r sums to
  # sum_t 0.1 * 0.9^(3 - t) over the steps t that selected r.
  expected = sum(0.1 * 0.9**(2 - t) * selected[t] for t in range(3))
  assert expected.max() > 0
  np.testing.assert_allclose(np.asarray(graph).sum(1), expected, rtol=1e-5,
                             atol=1e-7)
  evaluator = Evaluator(model, state.variables(), 0.0, 1.0)
  before = jax.tree.map(np.asarray, state.collections)
  logits = jax.jit(evaluator.logits_fn)(images)  # Not op-by-op eager.
  adv = evaluator.attack({"name": "pgd", "eps": 0.1, "steps": 2})(
      images, labels, jax.random.key(3))
  assert float(jnp.abs(adv - images).max()) > 0
  chex.assert_trees_all_equal(before, jax.tree.map(np.asarray,
                                                   state.collections))
  # The evaluation reads the trained graph: another graph, other logits.
  other = jax.tree.map(jnp.zeros_like, state.collections)
  zero = Evaluator(model, {"params": state.params, **other}, 0.0, 1.0)
  assert not np.allclose(jax.jit(zero.logits_fn)(images), logits)


def test_checkpoint_resume_bit_identical_with_acmoe_base(tmp_path):
  def config():
    c = load_config("tiny")
    c.model.moe.every = 1  # Blocks 0 and 1: ACMoE on block 1.
    c.model.moe.router = {"name": "symphony", "beta": 0.7, "base": {
        "name": "acmoe", "base": {"name": "noisy_topk", "num_selected": 1}}}
    # SGD with momentum (optimizer state to resume) compiles ~1/3 faster
    # than the tiny config's AdamW; AdamW's resume is test_train_loop's.
    c.optimizer = ml_collections.ConfigDict(dict(
        name="sgd", learning_rate=0.1, momentum=0.9, warmup_steps=2,
        decay="cosine", total_steps=6))
    return short_schedule(c)

  _, state = straight_vs_resumed(config, tmp_path, stop_at_step=3)
  graph = state.collections["router_state"]["encoderblock_1"]["Moe"][
      "router"]["adjacency"]
  np.testing.assert_allclose(np.asarray(graph).sum(1), 1 - 0.7**6, rtol=1e-5)





def test_eight_data_parallel_devices_equal_one():
  """Symphony over ACMoE (both reduce over the data axis): a batch of 16
  images split over 8 CPU devices updates the graph (twice) to the
  single-device graph; without the axis the shards would differ. (Symphony
  over top-k on the (8, 1) mesh, through the train step, is
  test_sharding.py's.)"""
  router = {"name": "symphony", "base": {"name": "acmoe", "base": {
      "name": "noisy_topk", "num_selected": 2}}}
  (one_logits, *one_graphs), (many_logits, *many_graphs) = (
      one_vs_eight_devices(router))
  assert np.abs(np.asarray(one_logits)).max() > 0.1
  np.testing.assert_allclose(many_logits, one_logits, rtol=1e-5, atol=1e-6)
  for a, b in zip(many_graphs, one_graphs):
    assert np.abs(np.asarray(b)).sum() > 0
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def _doubly_stochastic(rng, m):
  """A random symmetric, positive (so connected and aperiodic), doubly
  stochastic matrix by symmetric Sinkhorn scaling."""
  w = rng.uniform(0.05, 1.0, (m, m))
  w = w + w.T
  d = np.ones(m)
  for _ in range(2000):
    d = np.sqrt(d / (w @ d))
  return d[:, None] * w * d[None, :]


@pytest.mark.parametrize("seed", range(5))
def test_proposition_1_on_random_graphs(seed):
  rng = np.random.default_rng(seed)
  m, k = 8, 2
  a = _doubly_stochastic(rng, m)
  np.testing.assert_allclose(a.sum(0), 1, atol=1e-10)
  np.testing.assert_allclose(a.sum(1), 1, atol=1e-10)
  eig = np.sort(np.abs(np.linalg.eigvalsh(a)))[::-1]
  assert abs(eig[0] - 1) < 1e-9
  rho = eig[1]
  assert rho < 1
  smooth = lambda s: np.asarray(sym.smooth_gates(
      jnp.asarray(s, jnp.float32), jnp.asarray(a, jnp.float32))[0],
                                np.float64)
  # (i) Mean-zero perturbations contract by rho (tight: the 2nd
  # eigenvector attains it).
  v = rng.normal(size=(200, m))
  v -= v.mean(1, keepdims=True)
  ratio = np.linalg.norm(smooth(v), axis=1) / np.linalg.norm(v, axis=1)
  assert ratio.max() <= rho + 1e-5
  _, vecs = np.linalg.eigh(a)
  second = vecs[:, np.argsort(np.abs(np.linalg.eigvalsh(a)))[-2]]
  assert abs(np.linalg.norm(smooth(second[None]))[()] - rho) < 1e-5
  # (ii) TopK is stable under any ||ds|| < g / (2 rho).
  checked = 0
  for _ in range(50):
    s = rng.dirichlet(np.ones(m))
    r = smooth(s[None])[0]
    order = np.argsort(-r)
    margin = r[order[k - 1]] - r[order[k]]
    if margin < 1e-4:
      continue
    top = set(order[:k])
    for _ in range(20):
      ds = rng.normal(size=m)
      ds *= rng.uniform(0, 1) * margin / (2 * rho) / np.linalg.norm(ds)
      r2 = smooth((s + ds)[None])[0]
      assert set(np.argsort(-r2)[:k]) == top
      checked += 1
  assert checked > 100


def test_symphony_soft_matches_a_loop_and_counts_top_mass_experts():
  rng = np.random.default_rng(0)
  g, s, e, p = 1, 5, 3, 2
  logits = rng.normal(size=(g, s, e * p))
  combine = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
  combine = combine.reshape(g, s, e, p)
  graph = rng.uniform(size=(e, e))
  out, q, fallback = symphony_soft_combine(jnp.asarray(combine),
                                           jnp.asarray(graph))
  assert not bool(fallback)
  for t in range(s):
    mass = combine[0, t].sum(-1)
    for j in range(e):
      smoothed = sum(graph[j, m] * mass[m] for m in range(e))
      for slot in range(p):
        want = combine[0, t, j, slot] * smoothed / mass[j]
        assert abs(float(out[0, t, j, slot]) - want) < 1e-6
  renormed, _, _ = symphony_soft_combine(jnp.asarray(combine),
                                         jnp.asarray(graph),
                                         renormalize_gates=True)
  np.testing.assert_allclose(np.asarray(renormed).sum((-2, -1)), 1,
                             rtol=1e-6)
  zero, _, fallback = symphony_soft_combine(jnp.asarray(combine),
                                            jnp.zeros((e, e)))
  assert bool(fallback)
  np.testing.assert_allclose(zero, combine, rtol=1e-6)
  # Graph update: co-selection of each token's two largest-mass experts.
  router = ROUTERS.build({"name": "symphony_soft", "beta": 0.5,
                          "base": {"name": "soft", "num_slots": 2}},
                         num_experts=e)
  x = jnp.asarray(rng.normal(size=(2, 4, 6)), jnp.float32)
  variables = router.init(jax.random.key(0), x, RoutingContext(), capacity=1,
                          deterministic=True)
  (routing_out, state) = router.apply(
      variables, x, RoutingContext(), capacity=1, deterministic=True,
      update_state=True, mutable=["router_state"])
  base = ROUTERS.build({"name": "soft", "num_slots": 2}, num_experts=e)
  base_out = base.apply({"params": variables["params"]["base"]}, x,
                        RoutingContext(), capacity=1, deterministic=True)
  mass = np.asarray(base_out.routing.combine_weights).sum(-1).reshape(-1, e)
  counts = np.zeros((e, e))
  for row in mass:
    top = naive.top_k_order(row, 2)
    for i in top:
      for j in top:
        counts[i, j] += 1
  want = 0.5 * counts / counts.sum(1, keepdims=True).clip(1e-30)
  np.testing.assert_allclose(state["router_state"]["adjacency"], want,
                             rtol=1e-6)
  # First call: zero graph, so the routing is the base's.
  np.testing.assert_allclose(routing_out.routing.combine_weights,
                             base_out.routing.combine_weights, rtol=1e-6)


@pytest.mark.parametrize("router", [
    {"name": "symphony", "base": {"name": "noisy_topk", "num_selected": 2}},
    {"name": "symphony", "threshold": 0.05, "renormalize_gates": True,
     "base": {"name": "cosine", "num_selected": 2}},
])
def test_both_dispatchers_agree(router):
  x = jax.random.normal(jax.random.key(0), (2, 10, 6))
  outs = []
  for dispatcher in ("einsum", "indices"):
    layer = MoeLayer(router=ROUTERS.build(router, num_experts=E),
                     hidden_size=8, group_size=5, capacity_factor=1.0,
                     dispatcher=dispatcher)
    # Jitted: one compilation each, not op-by-op eager ones.
    variables = jax.jit(lambda k, x: layer.init(k, x, RoutingContext()))(
        jax.random.key(1), x)
    graph = jax.random.uniform(jax.random.key(2), (E, E))
    variables = {**variables, "router_state": {"router": {"adjacency":
                                                          graph}}}
    outs.append(jax.jit(lambda v, x: layer.apply(v, x, RoutingContext())[0])(
        variables, x))
  np.testing.assert_allclose(outs[0], outs[1], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", [
    "symphony", "symphony:cosine", "symphony:acmoe",
    "symphony:linear,beta=0.5,init=random,sparse", "symphony_soft",
    "symphony_soft:acmoe"])
def test_configs_validate_and_build(name):
  path, _, arg = name.partition(":")
  config = load_config(path, arg or None)
  validate_config(config)
  model = build_model(config.model)
  assert model.moe["router"]["name"] == path


@pytest.mark.parametrize("config,field,change", [
    ("symphony", "model.moe.router.beta", {"beta": 1.5}),
    ("symphony", "model.moe.router.beta", {"beta": float("nan")}),
    ("symphony", "model.moe.router.graph_init",
     {"graph_init": "kaiming_normal"}),
    ("symphony", "model.moe.router.threshold", {"threshold": 1.0}),
    ("symphony", "model.moe.router.threshold", {"threshold": -0.01}),
    ("symphony", "model.moe.router.base.num_selected",
     {"base": {"name": "noisy_topk", "num_selected": 5}}),
    ("symphony", "model.moe.router.base.name",
     {"base": {"name": "expert_choice"}}),
    ("symphony", "model.moe.router.base.name", {"base": {"name": "soft"}}),
    ("symphony", "model.moe.router.base.name", {"base": {"name": "top_p"}}),
    ("symphony_soft", "model.moe.router.num_selected", {"num_selected": 5}),
    ("symphony_soft", "model.moe.router.base.name",
     {"base": {"name": "noisy_topk"}}),
])
def test_bad_input_names_the_full_field(config, field, change):
  c = load_config(config)
  for key, value in change.items():  # (`update` would merge `base`.)
    c.model.moe.router[key] = value
  with pytest.raises(ConfigError) as error:
    validate_config(c)
    build_model(c.model)
  assert error.value.field == field, str(error.value)
