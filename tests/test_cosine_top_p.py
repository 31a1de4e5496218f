"""XMoE cosine routing, top-p routing, the new routers through both
dispatchers, their configs and config errors, and ACMoE + top-p training."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

import naive
from eval_check import assert_final_metrics_match
from resume_check import short_schedule, straight_vs_resumed
from vmoe_ext.errors import ConfigError
from vmoe_ext.models import build_model
from vmoe_ext.moe import MoeLayer
from vmoe_ext.moe.contract import Assignment, LayerRecord, RoutingContext
from vmoe_ext.routers import build_router
from vmoe_ext.routers.top_p import top_p
from vmoe_ext.train.config_files import load_config
from vmoe_ext.app.schema import validate_config

E, D = 4, 6


def _unit(v):
  return v / np.maximum(np.linalg.norm(v, axis=-1, keepdims=True), 1e-4)


@pytest.mark.parametrize("projection,learnable", [(3, True), (None, False)])
def test_cosine_router_logits_match_numpy(rng, projection, learnable):
  router = build_router({"name": "cosine", "num_selected": 2,
                         "projection_dim": projection, "temperature": 0.5,
                         "learnable_temperature": learnable}, E)
  x = jnp.asarray(rng.normal(size=(2, 5, D)), jnp.float32)
  variables = router.init(jax.random.key(0), x, RoutingContext(), capacity=4,
                          deterministic=True)
  p = variables["params"]
  assert ("temperature" in p) == learnable
  assert ("projection" in p) == (projection is not None)
  h = np.asarray(x, np.float64)
  if projection is not None:
    h = h @ np.asarray(p["projection"], np.float64)
  logits = _unit(h) @ _unit(np.asarray(p["embeddings"], np.float64)).T / 0.5
  got = router.apply(variables, x, RoutingContext(), capacity=4,
                     deterministic=True)
  probs = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
  top = np.argsort(-probs, -1, kind="stable")[..., :2]
  np.testing.assert_array_equal(got.routing.expert_indices, top)
  np.testing.assert_allclose(got.routing.gates,
                             np.take_along_axis(probs, top, -1), rtol=1e-5)
  # Expert embeddings start orthogonal with gain 0.32 (torchscale's X-MoE).
  emb = np.asarray(p["embeddings"])
  gram = emb.T @ emb if emb.shape[0] >= emb.shape[1] else emb @ emb.T
  np.testing.assert_allclose(gram, 0.32**2 * np.eye(len(gram)), atol=1e-5)


def test_top_p_selects_exactly_the_experts_above_p_up_to_the_cap(rng):
  logits = jnp.asarray(rng.normal(scale=1.5, size=(3, 7, 6)), jnp.float32)
  p, cap = 0.12, 3
  routing, metrics = top_p(logits, None, p, max_experts=cap)
  gates = np.asarray(jax.nn.softmax(logits))
  expected = naive.top_p_choices(gates, p, cap)
  idx = np.asarray(routing.expert_indices).reshape(-1, cap)
  valid = np.asarray(routing.valid).reshape(-1, cap)
  weights = np.asarray(routing.gates).reshape(-1, cap)
  flat = gates.reshape(-1, 6)
  counts = []
  for i, chosen in enumerate(expected):
    assert list(idx[i][valid[i]]) == chosen
    np.testing.assert_allclose(weights[i][valid[i]], flat[i][chosen],
                               rtol=1e-6)
    assert np.all(weights[i][~valid[i]] == 0)
    counts.append(len(chosen))
  assert 1 in counts and cap in counts  # Both the floor and the cap occur.
  np.testing.assert_allclose(metrics["experts_per_token"], np.mean(counts),
                             rtol=1e-6)


@pytest.mark.parametrize("which", ["clean", "noisy"])
def test_top_p_importance_loss_of_the_chosen_gates(rng, which):
  logits = rng.normal(size=(2, 9, 4)).astype(np.float32)
  noise = rng.normal(scale=0.3, size=logits.shape).astype(np.float32)
  _, metrics = top_p(jnp.asarray(logits), jnp.asarray(noise), 0.1,
                     max_experts=2, importance_gates=which)
  z = logits + noise if which == "noisy" else logits
  g = np.exp(z) / np.exp(z).sum(-1, keepdims=True)
  imp = g.sum(1)  # [G, E]
  expected = np.mean(imp.var(-1) / imp.mean(-1)**2)
  np.testing.assert_allclose(metrics["importance_loss"], expected, rtol=1e-5)


def test_learnable_p_straight_through_gradient(rng):
  """dL/dp = -sum over selected e of g_e dL/dw_e (straight-through mask)."""
  logits = jnp.asarray(rng.normal(size=(2, 5, 4)), jnp.float32)
  c = jnp.asarray(rng.normal(size=(2, 5, 3)), jnp.float32)

  def loss(p):
    routing, _ = top_p(logits, None, p, max_experts=3)
    return jnp.sum(routing.gates * c)

  grad = float(jax.grad(loss)(jnp.float32(0.2)))
  routing, _ = top_p(logits, None, 0.2, max_experts=3)
  top = np.asarray(jax.lax.top_k(jax.nn.softmax(logits), 3)[0])
  expected = -np.sum(np.where(np.asarray(routing.valid), top * np.asarray(c),
                              0))
  np.testing.assert_allclose(grad, expected, rtol=1e-5)
  assert grad != 0


def _previous_ctx(rng, b, t, k):
  idx = rng.integers(0, E, size=(b, t, k)).astype(np.int32)
  gates = rng.uniform(0.1, 1, size=(b, t, k)).astype(np.float32)
  record = LayerRecord(Assignment(jnp.asarray(idx), jnp.asarray(gates),
                                  jnp.ones((b, t, k), bool)), None, block=0,
                       num_experts=E, width=D)
  return RoutingContext(block=1, records=(record,))


NEW_ROUTERS = {
    "cosine": {"name": "cosine", "num_selected": 2},
    "cosine_lm": {"name": "cosine_lm", "num_selected": 2},
    "top_p": {"name": "top_p", "num_selected": 3, "threshold": 0.2},
    "acmoe_swin": {"name": "acmoe", "normalization": "swin",
                   "base": {"name": "noisy_topk", "num_selected": 2}},
    "acmoe_top_p": {"name": "acmoe", "mix_k": 2,
                    "base": {"name": "top_p", "num_selected": 3,
                             "threshold": 0.2}},
    "acmoe_soft": {"name": "acmoe", "normalization": "softmoe",
                   "base": {"name": "soft", "num_slots": 2}},
}


@pytest.mark.parametrize("name", sorted(NEW_ROUTERS))
def test_new_routers_agree_through_both_dispatchers(rng, name):
  cfg = NEW_ROUTERS[name]
  soft = name.endswith("soft")
  b, t = 2, 6
  x = jnp.asarray(rng.normal(size=(b, t, D)), jnp.float32)
  ctx = _previous_ctx(rng, b, t, 8 if soft else 3)
  outs = []
  for dispatcher in ("einsum", "indices"):
    layer = MoeLayer(router=build_router(cfg, E), hidden_size=5,
                     group_size=None if soft else 4, capacity_factor=0.75,
                     dispatcher=dispatcher)
    variables = layer.init(jax.random.key(0), x, ctx)
    (y, metrics, _) = layer.apply(variables, x, ctx)
    outs.append((np.asarray(y), float(metrics["drop_rate"])))
  np.testing.assert_allclose(outs[0][0], outs[1][0], rtol=1e-5, atol=1e-6)
  assert outs[0][1] == outs[1][1]
  assert np.abs(outs[0][0]).sum() > 0


# What each config file documents, written out by hand for the default
# backbone (MoE in blocks 1 and 3, width 64, 4 experts; MNIST 28x28): the
# router's fields and the parameter shapes its router builds. X-MoE: R = 16,
# learnable temperature from 0.07, no noise; ACMoE wraps a base router
# ("base"): V-MoE noisy top-2 (paper, swin: a linear [64, 4] gate) or
# cosine_lm (expert embeddings [4, 64]); SoftMoE: 4 slots per expert
# ([64, 4, 4] and a scalar scale); top-p: p = 0.8 / E = 0.2, at most 3
# experts, a learnable scalar p only with "learnable".
_LINEAR = {"logits": {"dense": {"kernel": (64, 4)}}}
_TOP_P = dict(name="top_p", num_selected=3, threshold=0.8 / 4,
              load_loss_weight=0.0)
CONFIGS = {
    ("xmoe", None): (
        dict(name="cosine", num_selected=2, projection_dim=16,
             temperature=0.07, learnable_temperature=True, noise_std=0.0),
        {"embeddings": (4, 16), "projection": (64, 16), "temperature": ()}),
    ("acmoe", None): (
        dict(name="acmoe", normalization="paper",
             base=dict(name="noisy_topk", num_selected=2, noise_std=1.0)),
        {"base": _LINEAR}),
    ("acmoe", "language"): (
        dict(name="acmoe", normalization="language",
             base=dict(name="cosine_lm", num_selected=2)),
        {"base": {"embeddings": (4, 64)}}),
    ("acmoe", "swin"): (
        dict(name="acmoe", normalization="swin",
             base=dict(name="noisy_topk", num_selected=2, noise_std=1.0)),
        {"base": _LINEAR}),
    ("acmoe_soft", None): (
        dict(name="acmoe", normalization="softmoe",
             base=dict(name="soft", num_slots=4)),
        {"base": {"mu": (64, 4, 4), "scale": ()}}),
    ("top_p", None): (dict(_TOP_P, learnable_threshold=False), _LINEAR),
    ("top_p", "learnable"): (dict(_TOP_P, learnable_threshold=True),
                             dict(_LINEAR, threshold=())),
    ("acmoe_top_p", None): (
        dict(name="acmoe", normalization="paper",
             base=dict(_TOP_P, learnable_threshold=False)),
        {"base": _LINEAR}),
    ("acmoe_top_p", "learnable"): (
        dict(name="acmoe", normalization="paper",
             base=dict(_TOP_P, learnable_threshold=True)),
        {"base": dict(_LINEAR, threshold=())}),
}


def _subset(got, want, path="router"):
  for key, value in want.items():
    assert key in got, f"{path}.{key} missing"
    if isinstance(value, dict):
      _subset(got[key], value, f"{path}.{key}")
    elif isinstance(value, float):
      assert got[key] == pytest.approx(value), f"{path}.{key}"
    else:
      assert got[key] == value, f"{path}.{key}"


@pytest.mark.parametrize("name,arg", sorted(CONFIGS, key=str))
def test_configs_validate_and_build_the_documented_router(name, arg):
  fields, shapes = CONFIGS[(name, arg)]
  config = load_config(name, arg)
  validate_config(config)
  _subset(config.model.moe.router.to_dict(), fields)
  model = build_model(config.model)
  params = jax.eval_shape(model.init, jax.random.key(0),
                          jnp.zeros((8, 28, 28, 1)))["params"]
  for i in range(4):
    block = params[f"encoderblock_{i}"]
    assert ("Moe" in block) == (i in (1, 3)), i
    if i in (1, 3):
      got = jax.tree.map(lambda a: tuple(a.shape), block["Moe"]["router"])
      assert got == shapes, (i, got)


def _with_router(router, layers=(1, 3)):
  config = load_config("default")
  config.model.moe.layers = layers
  config.model.moe.every = None
  config.model.moe.router = router
  return config


@pytest.mark.parametrize("router,field,message", [
    ({"name": "acmoe", "layers": [1, 3]}, "model.moe.router.layers",
     "block 1 is the first MoE layer"),
    ({"name": "acmoe", "normalization": "lm"},
     "model.moe.router.normalization", "unknown preset"),
    ({"name": "acmoe", "eps": -1e-3}, "model.moe.router.eps", ">= 0"),
    ({"name": "acmoe", "clamp": -2.0}, "model.moe.router.clamp", "> 0"),
    ({"name": "acmoe", "mix_k": 3}, "model.moe.router.mix_k",
     "provides 2"),
    ({"name": "acmoe", "mix_weights": "slot_softmax"},
     "model.moe.router.mix_weights", "only a soft layer"),
    ({"name": "acmoe", "mix_k": 2, "mix_weights": "raw",
      "base": {"name": "cosine_lm", "num_selected": 2}},
     "model.moe.router.mix_weights", "raw softmax"),
    ({"name": "acmoe", "base": {"name": "top_p", "threshold": 1.0}},
     "model.moe.router.base.threshold", "(0, 1)"),
    ({"name": "top_p", "threshold": 0.0}, "model.moe.router.threshold",
     "(0, 1)"),
    ({"name": "top_p", "num_selected": 5}, "model.moe.router.num_selected",
     "cap"),
    ({"name": "top_p", "load_loss_weight": 0.01},
     "model.moe.router.load_loss_weight", "not defined"),
    ({"name": "acmoe", "base": {"name": "noisy_topk", "num_selectd": 2}},
     "model.moe.router.base.num_selectd", "unknown field"),
    ({"name": "cosine", "temperature": 0.0}, "model.moe.router.temperature",
     "> 0"),
])
def test_bad_input_names_the_full_field(router, field, message):
  with pytest.raises(ConfigError) as info:
    validate_config(_with_router(router))
  assert info.value.field == field, str(info.value)
  assert message in info.value.reason


def test_ac_layer_without_an_moe_layer_before_it_names_the_layer():
  config = _with_router({"name": "acmoe", "layers": [3]}, layers=(3,))
  with pytest.raises(ConfigError, match="block 3 is the first MoE layer"):
    validate_config(config)


def test_acmoe_top_p_trains_under_jit_and_grad_and_resumes_bit_identically(
    tmp_path):
  def config():
    c = load_config("tiny")
    del c["robustness"]
    c.model.moe.every = 1  # Blocks 0 and 1: AC on block 1.
    c.model.moe.num_experts = 4
    c.model.moe.router = {
        "name": "acmoe", "normalization": "swin",
        "base": {"name": "top_p", "num_selected": 3, "threshold": 0.2,
                 "learnable_threshold": True}}
    # SGD with momentum (optimizer state to resume) compiles ~1/3 faster
    # than the tiny config's AdamW; AdamW's resume is test_train_loop's.
    c.optimizer = ml_collections.ConfigDict(dict(
        name="sgd", learning_rate=0.1, momentum=0.9, warmup_steps=1,
        decay="cosine", total_steps=4))
    return short_schedule(c, total_steps=4)

  final, state = straight_vs_resumed(config, tmp_path, stop_at_step=2)
  router = state.params["encoderblock_1"]["Moe"]["router"]["base"]
  assert float(router["threshold"]) != np.float32(0.2)  # p was trained.
  assert_final_metrics_match(final, config(), state, str(tmp_path / "eval"))


def test_router_fields_are_overridable_from_the_command_line():
  """Nested base fields, a placement list over a preset name, None for "no
  clamp" (which ml_collections' typed parser cannot read) all reach the model."""
  from absl import flags as absl_flags
  from ml_collections import config_flags
  from vmoe_ext.app.schema import CONFIG
  from vmoe_ext.config.overrides import prepare_overrides, take_none_overrides
  config = load_config("acmoe", "swin")
  argv = ["--config.model.moe.router.eps=0.01",
          "--config.model.moe.router.clamp=None",
          "--config.model.moe.router.layers=[3]",
          "--config.model.moe.router.mix_k=2",
          "--config.model.moe.router.dispersion=variance",
          "--config.model.moe.router.base.noise_std=0.5"]
  prepare_overrides(config, ["prog", *argv], CONFIG)
  rest = take_none_overrides(config, ["prog", *argv], CONFIG)
  assert "--config.model.moe.router.clamp=None" not in rest
  values = absl_flags.FlagValues()
  config_flags.DEFINE_config_dict("config", config, flag_values=values,
                                  sys_argv=rest)
  values(rest)
  validate_config(values.config)
  router = values.config.model.moe.router
  assert router.clamp is None and router.eps == 0.01 and router.mix_k == 2
  assert tuple(router.layers) == (3,) and router.base.noise_std == 0.5
  assert router.dispersion == "variance" and router.base.num_selected == 2


def test_soft_moe_vit_takes_acmoe_over_soft_but_not_a_token_choice_router():
  config = load_config("acmoe_soft")
  validate_config(config)
  config.model.moe.router = {"name": "acmoe", "base": {"name": "noisy_topk"}}
  with pytest.raises(ConfigError, match="needs a soft router") as info:
    validate_config(config)
  assert info.value.field == "model.moe.router.name"
