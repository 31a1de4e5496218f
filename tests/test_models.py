"""ViT / V-MoE / SoftMoE-ViT: reference equivalences, jit+grad, determinism, errors."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from grad_check import assert_grads_match_differences
from vmoe_ext.errors import ConfigError
from vmoe_ext.models import build_model, resolve_moe_layers

BASE = dict(num_classes=5, patch_size=(4, 4), hidden_size=16, num_layers=3,
            num_heads=2, mlp_dim=24)
IMAGES = jax.random.uniform(jax.random.key(42), (2, 8, 8, 1))  # T = 4 (+cls)
RNGS = {"gating": jax.random.key(1), "dropout": jax.random.key(2)}


def _moe(router, **kw):
  moe = {"every": 2, "num_experts": 4, "router": router, **kw}
  return dict(name="vit_moe", **BASE, moe=moe)


MODELS = {
    "vit": dict(name="vit", **BASE),
    "vmoe_top2": _moe({"name": "noisy_topk", "num_selected": 2},
                      group_size=10, capacity_factor=1.0),
    "vmoe_bpr": _moe({"name": "noisy_topk", "num_selected": 1},
                     batch_priority=True, capacity_factor=0.5),
    "expert_choice": _moe({"name": "expert_choice"}, group_size=5),
    "soft_moe_vit": dict(name="soft_moe_vit", **BASE,
                         moe=dict(last=2, num_experts=3,
                                  router={"num_slots": 2})),
}


def _init(model):
  """Initial variables with a random (instead of zero) classifier head."""
  variables = jax.jit(model.init)({"params": jax.random.key(0)}, IMAGES)
  params = dict(variables["params"])
  head = params["head"]
  params["head"] = {**head, "kernel": jax.random.normal(
      jax.random.key(7), head["kernel"].shape)}
  return {**variables, "params": params}


def _loss(model, params, deterministic, rngs=None):
  logits, metrics = model.apply({"params": params}, IMAGES,
                                deterministic=deterministic, rngs=rngs)
  labels = jnp.array([1, 3])
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
  return ce + metrics["auxiliary_loss"]


@pytest.mark.parametrize("name", sorted(MODELS))
def test_jit_grad_through_the_whole_model(name):
  model = build_model(MODELS[name])
  params = _init(model)["params"]
  loss, grads = jax.jit(jax.value_and_grad(
      lambda p: _loss(model, p, False, RNGS)))(params)
  # The same loss in float64 (same routing noise: the routers draw it in
  # float32) is the reference: its value, and its central differences along
  # a random direction of every leaf against the jitted float32 gradient.
  model64 = model.clone(dtype=jnp.float64)
  checked, loss64 = assert_grads_match_differences(
      lambda p: _loss(model64, p, False, RNGS), params, grads)
  assert checked == len(jax.tree.leaves(params))
  np.testing.assert_allclose(float(loss), loss64, rtol=1e-6)
  # The gradient reaches the patch embedding through every block.
  assert float(jnp.abs(grads["embedding"]["kernel"]).sum()) > 0


@pytest.mark.parametrize("name", ["vmoe_top2", "vmoe_bpr", "expert_choice",
                                  "soft_moe_vit"])
def test_einsum_and_indices_models_agree(name):
  cfg = MODELS[name]
  outs = {}
  for kind in ("einsum", "indices"):
    model = build_model({**cfg, "moe": {**cfg["moe"], "dispatcher": kind}})
    params = _init(model)["params"]
    outs[kind] = jax.jit(jax.value_and_grad(
        lambda p, m=model: _loss(m, p, False, RNGS)))(params)
  chex.assert_trees_all_close(outs["einsum"], outs["indices"], atol=1e-5,
                              rtol=1e-5)


@pytest.mark.parametrize("name", ["vmoe_top2", "expert_choice",
                                  "soft_moe_vit"])
def test_deterministic_mode_is_deterministic(name):
  model = build_model({**MODELS[name], "dropout_rate": 0.1})
  params = _init(model)["params"]
  apply = jax.jit(lambda i, deterministic: model.apply(
      {"params": params}, IMAGES, deterministic=deterministic,
      rngs={"gating": jax.random.key(i), "dropout": jax.random.key(i)}),
                  static_argnums=1)
  outs = [apply(i, True) for i in range(2)]
  chex.assert_trees_all_equal(outs[0], outs[1])
  train = [apply(i, False)[0] for i in range(2)]
  assert not np.allclose(train[0], train[1])


def test_single_expert_moe_equals_the_dense_vit():
  # E=1, K=1, renormalised gate (=1), capacity for every token: each MoE block
  # computes exactly the dense MLP whose weights its only expert holds.
  dense = build_model(MODELS["vit"])
  moe = build_model(dict(name="vit_moe", **BASE, moe=dict(
      every=1, num_experts=1, capacity_factor=1.0,
      router={"name": "noisy_topk", "num_selected": 1,
              "renormalize_gates": True})))
  dense_params = _init(dense)["params"]
  moe_params = jax.tree.map(lambda x: x, _init(moe)["params"])
  moe_params = jax.tree_util.tree_map(np.asarray, moe_params)
  moe_params = {k: dict(v) if isinstance(v, dict) else v
                for k, v in moe_params.items()}
  for key, value in dense_params.items():
    if not key.startswith("encoderblock_"):
      moe_params[key] = value
      continue
    block = dict(moe_params[key])
    for sub in ("Attention", "LayerNorm_0", "LayerNorm_1"):
      block[sub] = value[sub]
    mlp = value["Mlp"]
    block["Moe"] = dict(block["Moe"], Mlp=jax.tree.map(lambda a: a[None],
                                                       mlp))
    moe_params[key] = block
  dense_logits, _ = jax.jit(dense.apply)({"params": dense_params}, IMAGES)
  moe_logits, metrics = jax.jit(moe.apply)({"params": moe_params}, IMAGES)
  np.testing.assert_allclose(moe_logits, dense_logits, rtol=1e-5, atol=1e-6)
  assert set(metrics) == {"auxiliary_loss", "layer_0", "layer_1", "layer_2"}
  assert float(metrics["layer_1"]["drop_rate"]) == 0.0


def test_metrics_tree_and_sown_selected_experts():
  model = build_model(MODELS["vmoe_top2"])
  variables = _init(model)
  (logits, metrics), state = jax.jit(lambda v, x: model.apply(
      v, x, deterministic=False, rngs=RNGS, mutable=["intermediates"]))(
          variables, IMAGES)
  assert logits.shape == (2, 5)
  assert model.moe_layers == (1,)
  layer = metrics["layer_1"]
  for key in ("auxiliary_loss", "importance_loss", "load_loss", "drop_rate"):
    assert layer[key].shape == ()
  assert layer["expert_load"].shape == (4,)
  np.testing.assert_allclose(metrics["auxiliary_loss"],
                             layer["auxiliary_loss"], rtol=1e-6)
  sown = state["intermediates"]["encoderblock_1"]["Moe"]
  selected = sown["selected_experts"][0]
  mask = sown["expert_mask"][0]
  assert selected.shape == (2, 5, 2) and mask.shape == (2, 5, 4)
  # The mask is exactly the one-hot union of the selected experts.
  np.testing.assert_array_equal(
      mask, jax.nn.one_hot(selected, 4).sum(-2) > 0)
  # Expert load from the sown selections.
  counts = np.bincount(np.asarray(selected).ravel(), minlength=4)
  np.testing.assert_allclose(layer["expert_load"], counts / counts.sum(),
                             rtol=1e-6)


@pytest.mark.parametrize("args,expected", [
    (dict(num_layers=12, every=2), (1, 3, 5, 7, 9, 11)),
    (dict(num_layers=12, every=2, last=2), (9, 11)),
    (dict(num_layers=12, last=2), (10, 11)),
    (dict(num_layers=4, layers=(3, 0)), (0, 3)),
    (dict(num_layers=6, every=3), (2, 5)),
])
def test_moe_placement(args, expected):
  assert resolve_moe_layers(**args) == expected


@pytest.mark.parametrize("args,field", [
    (dict(num_layers=4, layers=(4,)), "moe.layers"),
    (dict(num_layers=4, layers=(-1,)), "moe.layers"),
    (dict(num_layers=4, layers=(1, 1)), "moe.layers"),
    (dict(num_layers=4), "moe.layers"),
    (dict(num_layers=4, every=5), "moe.every"),
    (dict(num_layers=4, every=2, last=3), "moe.last"),
    (dict(num_layers=4, layers=(1,), every=2), "moe.every"),
])
def test_moe_placement_errors(args, field):
  with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
    resolve_moe_layers(**args)


@pytest.mark.parametrize("cfg,field", [
    (dict(MODELS["vit"], name="resnet"), "model.name"),
    (dict(MODELS["vit"], moe=dict(every=1)), "model.moe"),
    (dict(MODELS["vmoe_top2"], moe=None), "model.moe"),
    (_moe({"name": "noisy_topk", "num_selected": 5}), "router.num_selected"),
    (_moe({"name": "noisy_topk"}, capacity_factor=0), "moe.capacity_factor"),
    (_moe({"name": "noisy_topk"}, num_experts=0), "moe.num_experts"),
    (_moe({"name": "noisy_topk"}, layers=(1, 7), every=None),
     "moe.layers"),
    (_moe({"name": "what"}), "router.name"),
    (_moe({"name": "noisy_topk"}, capacity=4), "moe.capacity"),
    (dict(_moe({"name": "noisy_topk"}), stream={"name": "nesterov"}),
     "stream.name"),
    (dict(name="soft_moe_vit", **BASE,
          moe=dict(every=1, router={"name": "noisy_topk"})),
     "model.moe.router.name"),
    (dict(MODELS["vit"], classifier="cls"), "classifier"),
    (dict(MODELS["vit"], num_heads=3), "num_heads"),
    (dict(MODELS["vit"], num_heads=0), "num_heads: must be a positive"),
    (dict(MODELS["vit"], hidden_size=0), "hidden_size: must be a positive"),
    (dict(MODELS["vit"], mlp_dim=0), "mlp_dim: must be a positive"),
    (dict(MODELS["vit"], num_layers=0), "num_layers: must be a positive"),
    (dict(MODELS["vit"], patch_size=(0, 0)), "patch_size: must be two"),
    (dict(MODELS["vit"], patch_size=(4,)), "patch_size: must be two"),
    (dict(MODELS["vit"], dropout_rate=-0.1), "dropout_rate"),
])
def test_model_config_errors_are_raised_at_construction(cfg, field):
  with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
    build_model(cfg)


def test_shape_errors_are_raised_before_compilation():
  model = build_model(dict(MODELS["vmoe_top2"]))  # group_size 10 = 2 images
  with pytest.raises(ConfigError, match="group_size"):
    jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((3, 8, 8, 1)))
  with pytest.raises(ConfigError, match="patch_size"):
    jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((2, 9, 8, 1)))
