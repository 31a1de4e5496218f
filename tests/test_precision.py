"""Mixed precision: `model.dtype` and `model.param_dtype`
(`vmoe_ext.models.precision`).

Each check compares against the same model with the option off: the bfloat16
forward of every router and every stream (on the tiny V-MoE / SoftMoE ViT),
of a Swin-MoE and of the language model stays within bfloat16's rounding of
the float32 forward with the same float32 weights; what must stay float32
(router scores, auxiliary losses, stream state, logits, loss, the gradient
with respect to the image) does; `dtype="float32"` is bit-identical to the
model built without the field; a checkpoint saved in one parameter dtype
restores into the other; bad values are ConfigErrors naming the field.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from test_logged_metrics import ROUTER_FIELDS, _config
from vmoe_ext.app.context import resolved
from vmoe_ext.attacks.base import cross_entropy
from vmoe_ext.errors import ConfigError
from vmoe_ext.models import build_model
from vmoe_ext.moe.contract import Router, RoutingContext
from vmoe_ext.routers.registry import ROUTERS
from vmoe_ext.streams import STREAMS
from vmoe_ext.streams.base import ResidualStream
from vmoe_ext.train.checkpoints import CheckpointManager
from vmoe_ext.train.config_files import load_config
from vmoe_ext.train.fingerprint import check_fingerprint, with_filled_model
from vmoe_ext.train.state import TrainState
from vmoe_ext.train.steps import make_train_step

IMAGES = jax.random.uniform(jax.random.key(0), (4, 8, 8, 1))
# bfloat16 keeps 8 significant bits: one rounding is within 2^-8 relative.
BF16_EPS = 2.0 ** -8
# The relative L2 error of a bfloat16 forward (or gradient): the tiny models
# round a token to bfloat16 at up to 8 places between the image and the
# logits (embedding; per block LayerNorm, attention, MLP or experts; head),
# each within BF16_EPS.
FORWARD_RTOL = 8 * BF16_EPS
# Every stream, with fields giving it parameters where it has some.
STREAM_FIELDS = {
    "adam": {}, "complex_momentum": {}, "momentum": {"learn": "gamma"},
    "nag": {}, "plain": {}, "rmsprop": {}, "robust_momentum": {}, "sam": {},
    "time_varying": {}}
# One tiny model per router, each with one of the streams (in turn), so that
# eleven models cover both registries.
PAIRS = list(zip(sorted(ROUTER_FIELDS), itertools.cycle(sorted(
    STREAM_FIELDS))))


def test_every_router_and_stream_is_covered():
  assert set(ROUTER_FIELDS) == set(ROUTERS.names())
  assert set(STREAM_FIELDS) == set(STREAMS.names())
  assert {s for _, s in PAIRS} == set(STREAM_FIELDS)


def _model_config(router: str, stream: str, **fields):
  config = _config(router).model.to_dict()
  return {**config, "stream": {"name": stream, **STREAM_FIELDS[stream]},
          **fields}


def _random_head(variables, key=3):
  """The zero-initialised head redrawn, so that the logits are not 0."""
  params = dict(variables["params"])
  head = dict(params["head"])
  head["kernel"] = 0.3 * jax.random.normal(jax.random.key(key),
                                           head["kernel"].shape)
  return {**variables, "params": {**params, "head": head}}


def _relative_error(y, ref):
  y, ref = np.asarray(y, np.float64), np.asarray(ref, np.float64)
  return np.linalg.norm(y - ref) / np.linalg.norm(ref)


def _floating_leaves(tree):
  return [x for x in jax.tree.leaves(tree)
          if jnp.issubdtype(x.dtype, jnp.floating)]


@pytest.mark.parametrize("router,stream", PAIRS)
def test_bfloat16_forward_is_the_float32_one_within_rounding(router, stream):
  config = _model_config(router, stream)
  model = build_model(config)
  half = build_model({**config, "dtype": "bfloat16"})
  assert half.dtype == jnp.bfloat16 and half.param_dtype == jnp.float32
  variables = _random_head(model.init(jax.random.key(1), IMAGES))
  logits, metrics = model.apply(variables, IMAGES)
  (half_logits, half_metrics), seen = half.apply(
      variables, IMAGES, mutable=["intermediates"],
      capture_intermediates=lambda m, method: method == "__call__" and (
          isinstance(m, (Router, ResidualStream))))
  assert _relative_error(half_logits, logits) < FORWARD_RTOL
  # The float32 parts stay float32: logits, losses, every layer metric, the
  # router scores and the stream state.
  assert half_logits.dtype == jnp.float32
  assert {v.dtype for v in _floating_leaves(half_metrics)} == {
      jnp.dtype("float32")}
  assert set(half_metrics) == set(metrics)
  routers = streams = 0
  for path, out in jax.tree_util.tree_flatten_with_path(
      seen["intermediates"], is_leaf=lambda x: isinstance(x, tuple))[0]:
    owner = jax.tree_util.keystr(path)
    if "router" in owner and "__call__" in owner:
      routers += 1
      for value in _floating_leaves((out[0].routing, out[0].metrics)):
        assert value.dtype == jnp.float32, owner
    elif "Stream" in owner and "__call__" in owner:
      streams += 1
      for value in _floating_leaves(out[0][1]):  # (x, state): the state.
        assert value.dtype == jnp.float32, owner
  assert routers >= 2 and streams >= 2


def test_router_scores_are_the_float32_routers_on_the_rounded_tokens():
  """A router in a bfloat16 model sees bfloat16 tokens and computes in
  float32: its gates equal, bit for bit, the float32 router's on the same
  tokens rounded to bfloat16."""
  router = ROUTERS.build({"name": "noisy_topk", "num_selected": 2},
                         num_experts=4, parent=None)
  x = jax.random.normal(jax.random.key(0), (2, 6, 8))
  rounded = x.astype(jnp.bfloat16)
  ctx = RoutingContext()
  call = lambda v, t: router.apply(v, t, ctx, capacity=6, deterministic=True)
  variables = router.init(jax.random.key(1), x, ctx, capacity=6,
                          deterministic=True)
  half, full = call(variables, rounded), call(variables, rounded.astype(
      jnp.float32))
  assert half.routing.gates.dtype == jnp.float32
  np.testing.assert_array_equal(half.routing.gates, full.routing.gates)
  np.testing.assert_array_equal(half.routing.expert_indices,
                                full.routing.expert_indices)


def test_float32_field_is_bit_identical_to_the_model_without_it():
  config = _model_config("acmoe", "momentum")
  plain = build_model(config)
  named = build_model({**config, "dtype": "float32",
                       "param_dtype": "float32"})
  # The classes' own default, the same dtype object the flax layers got.
  assert named.dtype is plain.dtype is jnp.float32
  assert named.param_dtype is plain.param_dtype is jnp.float32
  variables = _random_head(plain.init(jax.random.key(1), IMAGES))
  named_variables = named.init(jax.random.key(1), IMAGES)
  for a, b in zip(jax.tree.leaves(plain.init(jax.random.key(1), IMAGES)),
                  jax.tree.leaves(named_variables)):
    np.testing.assert_array_equal(a, b)
  run = lambda m: m.apply(variables, IMAGES, deterministic=False,
                          rngs={"gating": jax.random.key(2)})
  for a, b in zip(jax.tree.leaves(run(plain)), jax.tree.leaves(run(named))):
    assert a.dtype == b.dtype
    np.testing.assert_array_equal(a, b)


def test_param_dtype_bfloat16_stores_every_parameter_in_bfloat16():
  """Backbone, experts, router and stream parameters alike; the forward is
  the float32 model's on the same (rounded) weights; a training step keeps
  the parameters and the optimizer state in bfloat16 and its loss in
  float32."""
  config = _model_config("cosine", "momentum")
  config["moe"]["router"]["learnable_temperature"] = True
  model = build_model({**config, "param_dtype": "bfloat16"})
  variables = model.init(jax.random.key(1), IMAGES)
  names = {jax.tree_util.keystr(p) for p, _ in
           jax.tree_util.tree_flatten_with_path(variables["params"])[0]}
  for owner in ("['router']", "['Stream']", "['Moe']['Mlp']", "['head']"):
    assert any(owner in n for n in names), owner
  assert {x.dtype for x in jax.tree.leaves(variables["params"])} == {
      jnp.dtype("bfloat16")}
  variables = _random_head(variables)  # Drawn in float32: round it.
  variables = {**variables, "params": jax.tree.map(
      lambda x: x.astype(jnp.bfloat16), variables["params"])}
  params = variables["params"]
  # Same values as a float32 model applied to the bfloat16 weights cast up.
  full = build_model(config)
  up = {**variables, "params": jax.tree.map(lambda x: x.astype(jnp.float32),
                                            params)}
  logits, _ = model.apply(variables, IMAGES)
  np.testing.assert_array_equal(logits, full.apply(up, IMAGES)[0])

  state = TrainState.create(variables, optax.adam(1e-3), jax.random.key(3))
  batch = {"image": IMAGES, "label": jnp.arange(4) % 3,
           "mask": jnp.ones((4,), bool)}
  new_state, logged = jax.eval_shape(make_train_step(model), state, batch)
  for leaf in jax.tree.leaves((new_state.params, new_state.opt_state)):
    if jnp.issubdtype(leaf.dtype, jnp.floating):
      assert leaf.dtype == jnp.bfloat16
  assert logged["loss"].dtype == jnp.float32


def test_attack_gradient_with_respect_to_the_image_stays_float32():
  """The attacks' loss gradient with respect to the float32 images, of a
  bfloat16 model: float32, and the float32 model's within rounding."""
  config = _model_config("noisy_topk", "plain")
  full = build_model(config)
  half = build_model({**config, "dtype": "bfloat16"})
  variables = _random_head(full.init(jax.random.key(1), IMAGES))
  labels = jnp.arange(4) % 3
  grad = lambda m: jax.grad(lambda x: jnp.sum(cross_entropy(
      m.apply(variables, x)[0], labels)))
  half_grad, full_grad = jax.jit(lambda x: (grad(half)(x), grad(full)(x)))(
      IMAGES)
  assert half_grad.dtype == jnp.float32
  assert _relative_error(half_grad, full_grad) < FORWARD_RTOL


def test_bfloat16_compute_composes_with_bfloat16_dispatch():
  config = _model_config("noisy_topk", "plain")
  config["moe"]["dispatch_dtype"] = "bfloat16"
  model = build_model(config)
  half = build_model({**config, "dtype": "bfloat16"})
  variables = _random_head(model.init(jax.random.key(1), IMAGES))
  logits, _ = model.apply(variables, IMAGES)
  half_logits, _ = half.apply(variables, IMAGES)
  assert half_logits.dtype == jnp.float32
  assert _relative_error(half_logits, logits) < FORWARD_RTOL


def test_swin_moe_in_bfloat16():
  config = dict(
      name="swin_moe", num_classes=3, patch_size=(2, 2), embed_dim=8,
      depths=(2,), num_heads=(2,), window_size=2, mlp_ratio=2.0,
      drop_path_rate=0.0, moe_blocks=((1,),),
      moe=dict(num_experts=2, group_size=None,
               router={"name": "swin_moe", "num_selected": 1}),
      stream={"name": "momentum"})
  model = build_model(config)
  half = build_model({**config, "dtype": "bfloat16"})
  variables = _random_head(model.init(jax.random.key(1), IMAGES))
  logits, metrics = model.apply(variables, IMAGES)
  half_logits, half_metrics = half.apply(variables, IMAGES)
  assert half_logits.dtype == half_metrics["auxiliary_loss"].dtype == (
      jnp.float32)
  assert _relative_error(half_logits, logits) < FORWARD_RTOL


def test_language_model_in_bfloat16():
  config = dict(name="language_model", vocab_size=11, hidden_size=8,
                inner_hidden_size=8, num_heads=2, num_layers=2, attn_span=4,
                moe=dict(num_experts=2))
  model = build_model(config)
  half = build_model({**config, "dtype": "bfloat16",
                      "param_dtype": "bfloat16"})
  tokens = jax.random.randint(jax.random.key(0), (2, 4), 0, 11)
  cache = model.zero_cache(2)
  variables = jax.jit(model.init)(jax.random.key(1), tokens, cache)
  half_variables = jax.eval_shape(half.init, jax.random.key(1), tokens,
                                  cache)
  assert {x.dtype for x in jax.tree.leaves(half_variables["params"])} == {
      jnp.dtype("bfloat16")}
  # The float32 weights, rounded: both precisions read the same values.
  rounded = {**variables, "params": jax.tree.map(
      lambda x: x.astype(jnp.bfloat16).astype(jnp.float32),
      variables["params"])}
  log_probs, _, metrics = jax.jit(model.apply)(rounded, tokens, cache)
  half_log_probs, _, half_metrics = jax.jit(half.apply)(
      {**variables, "params": jax.tree.map(
          lambda x: x.astype(jnp.bfloat16), variables["params"])},
      tokens, cache)
  assert half_log_probs.dtype == jnp.float32
  assert half_metrics["auxiliary_loss"].dtype == jnp.float32
  probs, half_probs = np.exp(log_probs), np.exp(half_log_probs)
  assert _relative_error(half_probs, probs) < FORWARD_RTOL


@pytest.mark.parametrize("saved,restored", [("bfloat16", "float32"),
                                            ("float32", "bfloat16")])
def test_a_checkpoint_evaluates_in_the_other_precision(tmp_path, saved,
                                                        restored):
  """Parameters saved in one `param_dtype` restore (cast) into a model of
  the other, and the evaluation fingerprint accepts it; resuming does not."""
  params = {"layer": {"kernel": jnp.linspace(-1.0, 1.0, 6).reshape(2, 3)
                      .astype(saved), "count": jnp.arange(3)}}
  state = {"params": params, "step": jnp.int32(4)}
  fingerprint = {"model": {"name": "vit", "num_classes": 3,
                           "param_dtype": saved}}
  with CheckpointManager(str(tmp_path), save_every=1, keep=1,
                         config_fingerprint=fingerprint) as manager:
    manager.save(4, state, {})
  target = {"params": jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, restored
                                     if x.dtype == saved else x.dtype),
      params)}
  current = {"model": {**fingerprint["model"], "param_dtype": restored}}
  current = with_filled_model(current)
  reader = CheckpointManager(str(tmp_path), save_every=0, keep=1,
                             config_fingerprint=current, purpose="evaluate")
  try:
    entries, step = reader.restore_variables(target)
  finally:
    reader.close()
  assert step == 4
  kernel = entries["params"]["layer"]["kernel"]
  assert kernel.dtype == jnp.dtype(restored)
  np.testing.assert_array_equal(
      kernel, params["layer"]["kernel"].astype(restored))
  np.testing.assert_array_equal(entries["params"]["layer"]["count"],
                                np.arange(3))
  with pytest.raises(ConfigError, match="param_dtype"):
    check_fingerprint(fingerprint, current, step=4, directory=str(tmp_path))


@pytest.mark.parametrize("field", ["dtype", "param_dtype"])
@pytest.mark.parametrize("value", ["float16", "fp32", 3])
def test_bad_dtype_is_a_config_error_naming_the_field(field, value):
  config = load_config("tiny")
  config.model[field] = value
  with pytest.raises(ConfigError, match=rf"model\.{field}\b"):
    resolved(config)


@pytest.mark.parametrize("name", ["vit_moe", "swin", "language_model"])
def test_every_backbone_checks_its_dtypes(name):
  config = {"vit_moe": _model_config("noisy_topk", "plain"),
            "swin": dict(name="swin", num_classes=3, embed_dim=8,
                         depths=(2,), num_heads=(2,), window_size=2),
            "language_model": dict(name="language_model", vocab_size=11,
                                   hidden_size=8, inner_hidden_size=8,
                                   num_heads=2, num_layers=2, attn_span=4,
                                   moe=dict(num_experts=2))}[name]
  for field in ("dtype", "param_dtype"):
    with pytest.raises(ConfigError, match=rf"model\.{field}\b.*'half'"):
      build_model({**config, field: "half"})
    with pytest.raises(ConfigError, match=rf"model\.{field}\b"):
      build_model({**config, field: jnp.int32})
    assert getattr(build_model({**config, field: "bfloat16"}),
                   field) == jnp.bfloat16

