"""The Swin-MoE (tutel) router and the MoE options Swin-MoE needs.

References are independent: `naive_tutel` re-implements tutel's routing,
`load_importance_loss`, `gshard_loss`, capacity and dispatch locations in
NumPy from the formulas (docs/routers.md, "`swin_moe`"), with the same noise
handed to both sides.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

import naive_tutel
from vmoe_ext.app.schema import validate_config
from vmoe_ext.errors import ConfigError
from vmoe_ext.models import build_model
from vmoe_ext.moe import experts as experts_lib
from vmoe_ext.moe.capacity import compute_capacity
from vmoe_ext.moe.dispatch import token_choice_positions
from vmoe_ext.moe.expert_parallel import ExpertParallel
from vmoe_ext.moe.layer import MoeLayer
from vmoe_ext.routers import ROUTERS, RoutingContext, build_router
from vmoe_ext.routers.swin_moe import SwinMoeRouter, tutel_top_k
from vmoe_ext.train.config_files import load_config

E = 4
G, S = 2, 12


def _logits_and_noise(seed, gate_noise=1.0, scale=1.0):
  k1, k2 = jax.random.split(jax.random.key(seed))
  logits = scale * jax.random.normal(k1, (G, S, E))
  noise = gate_noise / E * jax.random.normal(k2, (G, S, E))
  return logits, noise


def _per_group_reference(logits, noise, k, normalize_gate, gate_noise):
  """Per group NumPy routing and losses; losses averaged over the groups as
  the router reports them."""
  out = {"idx": [], "gates": [], "priority": [], "importance_loss": [],
         "load_loss": [], "gshard_loss": []}
  for g in range(G):
    nz = None if noise is None else np.asarray(noise[g])
    idx, gates, scores, noisy = naive_tutel.route(np.asarray(logits[g]), nz,
                                                  k, normalize_gate)
    l_imp, l_load = naive_tutel.load_importance_loss(
        np.asarray(logits[g]), noisy, idx, gate_noise)
    out["idx"].append(idx)
    out["gates"].append(gates)
    out["priority"].append(scores.max(1))
    out["importance_loss"].append(l_imp)
    out["load_loss"].append(0.0 if noise is None else l_load)
    out["gshard_loss"].append(naive_tutel.gshard_loss(scores, idx))
  return {k_: (np.stack(v) if k_ in ("idx", "gates", "priority")
               else float(np.mean(v))) for k_, v in out.items()}


@pytest.mark.parametrize("k,normalize_gate,balance_loss,noisy", [
    (1, False, "importance_load", True),
    (2, False, "importance_load", True),
    (2, True, "importance_load", True),
    (3, True, "gshard", True),
    (2, False, "gshard", False),
    (2, False, "importance_load", False),
])
def test_pure_function_matches_numpy_tutel(k, normalize_gate, balance_loss,
                                           noisy):
  gate_noise = 1.5
  logits, noise = _logits_and_noise(k, gate_noise)
  noise = noise if noisy else None
  routing, metrics = tutel_top_k(
      logits, noise, num_selected=k, gate_noise=gate_noise,
      normalize_gate=normalize_gate, balance_loss=balance_loss,
      aux_loss_weight=0.01)
  ref = _per_group_reference(logits, noise, k, normalize_gate, gate_noise)
  np.testing.assert_array_equal(routing.expert_indices, ref["idx"])
  np.testing.assert_allclose(routing.gates, ref["gates"], rtol=1e-5,
                             atol=1e-7)
  np.testing.assert_allclose(routing.priority, ref["priority"], rtol=1e-5)
  for name in ("importance_loss", "load_loss", "gshard_loss"):
    np.testing.assert_allclose(metrics[name], ref[name], rtol=2e-4,
                               atol=1e-7, err_msg=name)
  balance = (ref["gshard_loss"] if balance_loss == "gshard"
             else (ref["importance_loss"] + ref["load_loss"]) / 2)
  np.testing.assert_allclose(metrics["balance_loss"], balance, rtol=2e-4)
  np.testing.assert_allclose(metrics["auxiliary_loss"], 0.01 * balance,
                             rtol=2e-4)
  if noisy:
    assert float(metrics["load_loss"]) > 0
  if normalize_gate and k > 1:
    np.testing.assert_allclose(np.sum(routing.gates, -1), 1.0, rtol=1e-6)


def test_normalize_gate_leaves_top1_alone():
  logits, noise = _logits_and_noise(7)
  plain, _ = tutel_top_k(logits, noise, num_selected=1, gate_noise=1.0)
  normed, _ = tutel_top_k(logits, noise, num_selected=1, gate_noise=1.0,
                          normalize_gate=True)
  np.testing.assert_array_equal(plain.gates, normed.gates)
  assert float(jnp.max(plain.gates)) < 1.0


@pytest.mark.parametrize("balance_loss", ["importance_load", "gshard"])
def test_gradient_of_the_loss_is_finite(balance_loss):
  """Also at perfect balance (all logits equal: zero spread of importance
  and load), where a std-based CV would give NaN."""
  logits, noise = _logits_and_noise(3)
  loss = lambda l: tutel_top_k(l, noise, num_selected=2, gate_noise=1.0,
                               balance_loss=balance_loss)[1]["auxiliary_loss"]
  grad, balanced = jax.jit(jax.vmap(jax.grad(loss)))(
      jnp.stack([logits, jnp.zeros_like(logits)]))
  assert np.all(np.isfinite(grad)) and float(jnp.max(jnp.abs(grad))) > 0
  assert np.all(np.isfinite(balanced))
  if balance_loss == "importance_load":  # Zero spread: a zero gradient.
    np.testing.assert_allclose(balanced, 0.0, atol=1e-12)


def test_wrapper_draws_noise_in_training_only():
  """Zero router weights: clean logits are 0, so the noisy scores are
  `softmax(n)` and `log(scores) - mean_e log(scores) = n - mean_e(n)`, whose
  std is `(gate_noise / E) * sqrt(1 - 1/E)`."""
  gate_noise, s = 2.0, 1024
  router = SwinMoeRouter(num_experts=E, num_selected=2,
                         gate_noise=gate_noise)
  x = jnp.ones((1, s, 3))
  variables = jax.tree.map(jnp.zeros_like, router.init(
      jax.random.key(0), x, RoutingContext(), capacity=s,
      deterministic=True))
  assert variables["params"]["logits"]["dense"]["kernel"].shape == (3, E)
  # Deterministic: no rng needed, no noise, no load loss.
  clean, out = jax.jit(lambda v: (
      router.apply(v, x, RoutingContext(), capacity=s, deterministic=True),
      router.apply(v, x, RoutingContext(), capacity=s, deterministic=False,
                   rngs={"gating": jax.random.key(1)})))(variables)
  np.testing.assert_allclose(clean.gates, 1.0 / E, rtol=1e-6)
  assert float(clean.metrics["load_loss"]) == 0.0
  log_g = np.log(np.asarray(out.gates, np.float64))
  centred = log_g - log_g.mean(-1, keepdims=True)
  np.testing.assert_allclose(np.std(centred),
                             gate_noise / E * np.sqrt(1 - 1 / E), rtol=0.05)
  # The routing is top-K of those gates, combined with their raw values.
  top = np.sort(np.asarray(out.gates), -1)[..., ::-1][..., :2]
  np.testing.assert_allclose(out.routing.gates, top, rtol=1e-6)


@pytest.mark.parametrize("cfg,field", [
    ({"gate_noise": 0.0}, "router.gate_noise"),
    ({"gate_noise": -1.0}, "router.gate_noise"),
    ({"balance_loss": "switch"}, "router.balance_loss"),
    ({"num_selected": 5}, "router.num_selected"),
    ({"normalize_gate": "yes"}, "router.normalize_gate"),
    ({"aux_loss_weight": -0.1}, "router.aux_loss_weight"),
])
def test_config_errors_name_the_field(cfg, field):
  with pytest.raises(ConfigError) as info:
    build_router({"name": "swin_moe", **cfg}, num_experts=E)
  assert info.value.field == field


def test_gshard_loss_allows_no_noise():
  router = build_router({"name": "swin_moe", "gate_noise": 0.0,
                         "balance_loss": "gshard"}, num_experts=E)
  assert ROUTERS.get("swin_moe") is SwinMoeRouter
  assert router.slots_per_token == 1


@pytest.mark.parametrize("s,k,cf,e,tutel,exact", [
    (10, 2, 1.0, 4, 6, 5),      # 2 * int(1.0 * 3); exact ceil(5.0)
    (10, 1, 1.25, 4, 3, 4),     # int(3.75) = 3; exact ceil(3.125) = 4
    (16, 2, 1.25, 4, 10, 10),   # 2 * int(5.0)
    (49 * 8, 2, 1.25, 4, 244, 245),  # 2 * int(1.25 * 98) = 2 * 122
    (100, 1, 0.29, 1, 28, 29),  # int(28.999999999999996): raw float truncated
])
def test_tutel_capacity_hand_cases(s, k, cf, e, tutel, exact):
  assert compute_capacity(s, k, cf, e, rounding="tutel") == tutel
  assert naive_tutel.capacity(s, k, cf, e) == tutel
  assert compute_capacity(s, k, cf, e, rounding="exact") == exact
  # The multiple (tutel's `alignment`) rounds up afterwards.
  assert compute_capacity(10, 2, 1.0, 4, 4, rounding="tutel") == 8
  assert naive_tutel.capacity(10, 2, 1.0, 4, alignment=4) == 8


def test_tutel_capacity_below_one_is_an_error():
  with pytest.raises(ConfigError, match="capacity_factor"):
    compute_capacity(8, 1, 0.4, 4, rounding="tutel")  # int(0.4 * 2) = 0


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("bpr", [False, True])
@pytest.mark.parametrize("normalize_gate", [False, True])
def test_dispatch_positions_equal_tutel_locations(k, bpr, normalize_gate):
  """Our dispatcher's choice-major positions (with BPR: ordered by the
  routing's priority, tutel's max score) equal `extract_critical`'s
  locations for every pick, so the same picks fit any capacity."""
  logits, noise = _logits_and_noise(10 + k)
  routing, _ = tutel_top_k(logits, noise, num_selected=k, gate_noise=1.0,
                           normalize_gate=normalize_gate)
  cap = naive_tutel.capacity(S, k, 0.5, E)
  position, kept = token_choice_positions(routing, E, cap, bpr)
  for g in range(G):
    idx, _, scores, _ = naive_tutel.route(np.asarray(logits[g]),
                                          np.asarray(noise[g]), k)
    locs = naive_tutel.locations(scores, idx, bpr)
    np.testing.assert_array_equal(position[g], locs)
    np.testing.assert_array_equal(kept[g], locs < cap)
  assert 0 < int(jnp.sum(kept)) < kept.size  # Some picks are dropped.


def test_bpr_with_normalized_gates_needs_the_priority():
  """Without the routing's priority, BPR orders by the largest combine
  weight: with normalised gates that is not tutel's max score, and the
  kept picks differ from tutel's somewhere."""
  differs = 0
  for seed in range(4):
    logits, noise = _logits_and_noise(20 + seed, scale=0.5)
    routing, _ = tutel_top_k(logits, noise, num_selected=2, gate_noise=1.0,
                             normalize_gate=True)
    cap = naive_tutel.capacity(S, 2, 0.5, E)
    with_priority = token_choice_positions(routing, E, cap, True)[1]
    without = token_choice_positions(routing.replace(priority=None), E,
                                     cap, True)[1]
    differs += int(jnp.sum(with_priority != without))
  assert differs > 0


def _swin_layer(**kw):
  args = dict(router=build_router({"name": "swin_moe", "num_selected": 2},
                                  num_experts=E),
              hidden_size=6, group_size=S, capacity_factor=0.75,
              capacity_rounding="tutel", batch_priority=True,
              output_bias="none", dropout_output=False)
  return MoeLayer(**{**args, **kw})


@pytest.mark.parametrize("dispatcher", ["indices", "einsum"])
def test_layer_matches_numpy_tutel(dispatcher):
  """Deterministic layer (clean logits) = tutel's routing, capacity,
  BPR locations and combine, group by group."""
  layer = _swin_layer(dispatcher=dispatcher)
  x = jax.random.normal(jax.random.key(4), (2, S, 5))

  def run(x):
    variables = layer.init(jax.random.key(0), x, RoutingContext())
    y, metrics, _ = layer.apply(variables, x, RoutingContext())
    return variables, y, metrics

  variables, y, metrics = jax.jit(run)(x)
  params = variables["params"]
  assert "bias" not in params["Mlp"]["Dense_1"] and "bias" not in params
  w = np.asarray(params["router"]["logits"]["dense"]["kernel"], np.float64)
  cap = naive_tutel.capacity(S, 2, 0.75, E)
  assert cap == 4
  xg = np.asarray(x, np.float64).reshape(-1, S, 5)
  dropped = 0
  for g in range(xg.shape[0]):
    idx, gates, scores, _ = naive_tutel.route(xg[g] @ w, None, 2)
    locs = naive_tutel.locations(scores, idx, True)
    dropped += int(np.sum(locs >= cap))
    expected = naive_tutel.moe(xg[g], idx, gates, locs, cap, params["Mlp"])
    np.testing.assert_allclose(np.asarray(y[g]), expected, rtol=2e-5,
                               atol=2e-6)
  assert dropped > 0
  np.testing.assert_allclose(metrics["drop_rate"], dropped / (2 * S * 2),
                             rtol=1e-6)


def test_output_bias_none_equals_experts_with_zero_bias():
  x = jax.random.normal(jax.random.key(5), (2, S, 5))
  none = _swin_layer(shared_experts=1)
  with_bias = _swin_layer(shared_experts=1, output_bias="experts")
  zero_output_bias = lambda variables: jax.tree_util.tree_map_with_path(
      lambda path, v: jnp.zeros_like(v) if any(
          getattr(p, "key", None) == "Dense_1" for p in path)
      and path[-1].key == "bias" else v, variables)

  def run(x):
    v_none = none.init(jax.random.key(0), x, RoutingContext())
    v_bias = with_bias.init(jax.random.key(0), x, RoutingContext())
    ys = [none.apply(v_none, x, RoutingContext())[0],
          with_bias.apply(zero_output_bias(v_bias), x, RoutingContext())[0],
          with_bias.apply(v_bias, x, RoutingContext())[0]]
    return v_none, v_bias, ys

  v_none, v_bias, (y_none, y_zero, y_bias) = jax.jit(run)(x)
  p_none, p_bias = v_none["params"], v_bias["params"]
  assert "bias" not in p_none["Mlp"]["Dense_1"]
  assert "bias" not in p_none["SharedMlp"]["Dense_1"]
  assert "bias" not in p_none
  assert p_bias["Mlp"]["Dense_1"]["bias"].shape == (E, 5)
  # Same weights otherwise (same init keys and shapes).
  for name in ("Dense_0", "Dense_1"):
    np.testing.assert_array_equal(p_none["Mlp"][name]["kernel"],
                                  p_bias["Mlp"][name]["kernel"])
  np.testing.assert_allclose(y_none, y_zero, rtol=1e-6, atol=1e-7)
  assert float(jnp.max(jnp.abs(y_bias - y_none))) > 0


def test_dropout_after_the_activation_only():
  """`mlp_experts(dropout_output=False)` is tutel's expert: the hidden
  units are dropped with the first keep mask, the outputs are not."""
  e, n, d, h, rate = 2, 3, 4, 5, 0.5
  module = experts_lib.MlpExperts(num_experts=e, hidden_size=h,
                                  dropout_rate=rate, dropout_output=False)
  x = jax.random.normal(jax.random.key(0), (e, n, d))
  params = module.init(jax.random.key(1), x)["params"]
  key = jax.random.key(2)
  keep_h, keep_out = experts_lib.expert_dropout_keep(key, rate, e, n, h, d)
  assert not np.all(keep_h) and not np.all(keep_out)
  got, both = jax.jit(lambda p: [
      experts_lib.mlp_experts(p, x, dropout_rate=rate, dropout_output=flag,
                              dropout_rng=key) for flag in (False, True)])(
                                  params)
  expected = naive_tutel.expert_dropout_after_activation(
      params, x, np.asarray(keep_h), rate)
  np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
  # vmoe's placement drops the outputs too, with the second mask.
  np.testing.assert_allclose(
      both, np.where(keep_out, expected / (1 - rate), 0), rtol=1e-5,
      atol=1e-6)


def test_dropout_output_flag_reaches_the_module_and_expert_parallel(
    monkeypatch):
  """The layer's experts (module path) use the recorded masks as the hand
  computation; the expert-parallel path (a 1 x 1 mesh) draws the same
  masks and equals the single-device layer."""
  recorded = []
  draw = experts_lib.expert_dropout_keep

  def record(*args):
    recorded.append(draw(*args))
    return recorded[-1]

  monkeypatch.setattr(experts_lib, "expert_dropout_keep", record)
  rate = 0.5
  module = experts_lib.MlpExperts(num_experts=2, hidden_size=5,
                                  dropout_rate=rate, dropout_output=False)
  x = jax.random.normal(jax.random.key(0), (2, 3, 4))
  params = module.init(jax.random.key(1), x)["params"]
  y = module.apply({"params": params}, x, deterministic=False,
                   rngs={"dropout": jax.random.key(3)})
  expected = naive_tutel.expert_dropout_after_activation(
      params, x, np.asarray(recorded[-1][0]), rate)
  np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-6)

  monkeypatch.setattr(experts_lib, "expert_dropout_keep", draw)
  mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "expert"))
  xs = jax.random.normal(jax.random.key(6), (2, S, 5))
  rngs = {"gating": jax.random.key(7), "dropout": jax.random.key(8)}
  variables = _swin_layer(dropout_rate=rate).init(jax.random.key(0), xs,
                                                  RoutingContext())
  layers = [_swin_layer(dropout_rate=rate, dropout_output=False),
            _swin_layer(dropout_rate=rate, dropout_output=False,
                        expert_parallel=ExpertParallel(mesh))]
  # Were the flag lost on the way to the shard, the shard would also drop
  # the outputs (with the same masks) and differ.
  single, parallel = jax.jit(lambda v: [
      layer.apply(v, xs, RoutingContext(), deterministic=False,
                  rngs=rngs)[0] for layer in layers])(variables)
  np.testing.assert_allclose(parallel, single, rtol=1e-6, atol=1e-7)


def _tiny_vmoe(router):
  return build_model(dict(
      name="vit_moe", num_classes=3, patch_size=(4, 4), hidden_size=8,
      num_layers=2, num_heads=2, mlp_dim=8,
      moe=dict(layers=(0, 1), num_experts=E, capacity_factor=1.25,
               capacity_rounding="tutel", batch_priority=True,
               output_bias="none", dropout_output=False, group_size=10,
               router=router)))


def test_acmoe_and_symphony_over_swin_moe_run_on_the_tiny_vmoe():
  """Symphony over ACMoE (`swin` preset, AC on the second MoE layer) over
  `swin_moe`: the base's gates reach Symphony through ACMoE, its losses
  reach the model's metrics. One model, one compile (init and a training
  forward)."""
  swin = {"name": "swin_moe", "num_selected": 2}
  model = _tiny_vmoe({"name": "symphony", "base": {
      "name": "acmoe", "normalization": "swin", "base": swin}})
  images = jax.random.uniform(jax.random.key(0), (4, 8, 8, 1))

  def run(x):
    variables = model.init(jax.random.key(1), x)
    (logits, metrics), state = model.apply(
        variables, x, deterministic=False, update_state=True,
        rngs={"gating": jax.random.key(2), "dropout": jax.random.key(3)},
        mutable=["router_state", "intermediates"])
    return logits, metrics, state["router_state"]

  logits, metrics, state = jax.jit(run)(images)
  assert np.all(np.isfinite(logits))
  for layer in ("layer_0", "layer_1"):
    m = metrics[layer]
    assert float(m["load_loss"]) > 0, layer
    np.testing.assert_allclose(
        m["auxiliary_loss"],
        0.01 * (m["importance_loss"] + m["load_loss"]) / 2, rtol=1e-6)
    assert float(m["symphony_fallback"]) == 1.0  # The zero graph's step.
  graph = state["encoderblock_1"]["Moe"]["router"]["adjacency"]
  assert float(jnp.sum(graph)) > 0  # Updated from swin_moe's selections.


def test_symphony_directly_over_swin_moe():
  """Symphony re-selects from `swin_moe`'s gates (`RouterOutput.gates`,
  the noisy scores in training) and keeps its losses."""
  swin = {"name": "swin_moe", "num_selected": 2}
  router = build_router({"name": "symphony", "graph_init": "identity",
                         "base": swin}, E)
  assert router.slots_per_token == 2
  x = jax.random.normal(jax.random.key(0), (G, S, 5))

  def run(x):
    variables = router.init(jax.random.key(1), x, RoutingContext(),
                            capacity=8, deterministic=True)
    apply = lambda r, v, det: r.apply(
        v, x, RoutingContext(), capacity=8, deterministic=det,
        rngs={"gating": jax.random.key(2)}, mutable=["router_state"])[0]
    base = apply(build_router(swin, E),
                 {"params": variables["params"]["base"]}, True)
    return apply(router, variables, True), base, apply(router, variables,
                                                       False)

  clean, base, noisy = jax.jit(run)(x)
  # The identity graph leaves the base's gates as they are.
  np.testing.assert_allclose(clean.gates, base.gates, rtol=1e-6)
  np.testing.assert_array_equal(clean.routing.expert_indices,
                                base.routing.expert_indices)
  for name in ("importance_loss", "load_loss", "auxiliary_loss"):
    np.testing.assert_allclose(clean.metrics[name], base.metrics[name],
                               rtol=1e-6)
  # Training: the routing is the top-2 of the base's noisy scores.
  assert float(jnp.max(jnp.abs(noisy.gates - clean.gates))) > 0
  np.testing.assert_array_equal(
      noisy.routing.expert_indices,
      np.argsort(-np.asarray(noisy.gates), -1, kind="stable")[..., :2])
  assert float(noisy.metrics["load_loss"]) > 0


def test_config_with_the_new_fields_validates():
  config = load_config("tiny")
  config.model.moe.update(dict(
      capacity_rounding="tutel", output_bias="none", dropout_output=False,
      router={"name": "swin_moe", "num_selected": 2, "gate_noise": 1.0,
              "normalize_gate": False, "balance_loss": "importance_load",
              "aux_loss_weight": 0.01}))
  validate_config(config)
  for field, value in (("dropout_output", "no"), ("output_bias", "never"),
                       ("capacity_rounding", "torch")):
    bad = load_config("tiny")
    with bad.model.moe.ignore_type():
      bad.model.moe[field] = value
    with pytest.raises(ConfigError) as info:
      validate_config(bad)
    assert info.value.field == f"model.moe.{field}", (field, info.value)
  bad = load_config("tiny")
  bad.model.moe.router = {"name": "swin_moe", "gate_noise": 0.0}
  with pytest.raises(ConfigError) as info:
    validate_config(bad)
  assert info.value.field == "model.moe.router.gate_noise"

