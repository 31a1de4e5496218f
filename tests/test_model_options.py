"""The ViT's vmoe options against independent references.

Options: `attention_kernel_init`, `attention_broadcast_dropout`,
`attention_qk_norm`, `classifier` ("token" / "0" / "gap" / "map"),
`representation_size`, `head_kernel_zero_init` / `head_bias_init` and
`position_emb` ("learned" / "sincos2d" / "none"). Every check compares with
something computed outside the code under test: the initializers of
`jax.nn.initializers` called directly with the key flax handed to the
parameter, moments and bounds worked out by hand, NumPy re-implementations of
the pooling heads and of attention (with the dropout mask flax drew), the
sin-cos formula written with `math`, or an invariance (patch permutations,
query scaling under qk-norm).
"""

from __future__ import annotations

import math
import types

import flax.linen as nn
import flax.linen.attention as flax_attention
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import traverse_util

from grad_check import assert_grads_match_differences
from vmoe_ext.errors import ConfigError
from vmoe_ext.models import VisionTransformerMoe, build_model
from vmoe_ext.models.position import sincos2d

BASE = dict(name="vit", num_classes=5, patch_size=(4, 4), hidden_size=16,
            num_layers=2, num_heads=2, mlp_dim=12)
D, HEADS, HEAD_DIM, PATCHES = 16, 2, 8, 4  # 8x8 images, 4x4 patches: 2x2.
IMAGES = jax.random.uniform(jax.random.key(42), (3, 8, 8, 3))
LABELS = jnp.array([1, 3, 4])
RNGS = {"gating": jax.random.key(1), "dropout": jax.random.key(2)}
ATTN_KERNELS = ("query", "key", "value", "out")


def _model(**options):
  return build_model({**BASE, **options})


def _init(model, images=IMAGES, key=0):
  return model.init({"params": jax.random.key(key)}, images)["params"]


def _random_head(params, key=7):
  """The params with a random (non-zero) head kernel, so that gradients and
  logits depend on everything before the head."""
  params = dict(params)
  head = dict(params["head"])
  head["kernel"] = jax.random.normal(jax.random.key(key),
                                     head["kernel"].shape)
  params["head"] = head
  return params


def _np(tree):
  return jax.tree.map(np.asarray, tree)


def _apply_capturing(model, params, images, paths, **kwargs):
  """`(logits, {path: (input, output)})` for the modules at `paths`
  ("encoder_norm", "encoderblock_0/Attention", ...), read through a flax
  method interceptor (the code under test is not asked for them)."""
  seen = {}

  def interceptor(next_fun, args, kw, context):
    out = next_fun(*args, **kw)
    if context.method_name == "__call__":
      path = "/".join(context.module.scope.path)
      if path in paths:
        seen[path] = (args[0], out)
    return out

  with nn.intercept_methods(interceptor):
    logits, _ = model.apply({"params": params}, images, **kwargs)
  assert sorted(seen) == sorted(paths)
  def arr(v):  # an encoder block returns (x, ctx, metrics): keep x.
    return np.asarray(v[0] if isinstance(v, tuple) else v)

  return np.asarray(logits), {k: (arr(a), arr(o))
                              for k, (a, o) in seen.items()}


# ---------------------------------------------------------------- NumPy refs


def _layer_norm(x, scale=None, bias=None, eps=1e-6):
  x = np.asarray(x, np.float64)
  mu = x.mean(-1, keepdims=True)
  var = ((x - mu) ** 2).mean(-1, keepdims=True)
  y = (x - mu) / np.sqrt(var + eps)
  if scale is not None:
    y = y * scale
  if bias is not None:
    y = y + bias
  return y


def _gelu_tanh(x):
  return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))


def _softmax(x):
  x = x - x.max(-1, keepdims=True)
  e = np.exp(x)
  return e / e.sum(-1, keepdims=True)


def _mha(q_in, kv_in, p, keep=None, rate=0.0):
  """Multi-head attention `[B, Tq, D], [B, Tk, D] -> [B, Tq, D]` from the
  `query/key/value/out` params; `keep` a dropout keep-mask broadcastable to
  `[B, heads, Tq, Tk]`."""
  p = _np(p)
  q = np.einsum("btd,dhk->bthk", q_in, p["query"]["kernel"]) + p["query"]["bias"]
  k = np.einsum("btd,dhk->bthk", kv_in, p["key"]["kernel"]) + p["key"]["bias"]
  v = np.einsum("btd,dhk->bthk", kv_in, p["value"]["kernel"]) + p["value"]["bias"]
  w = _softmax(np.einsum("bqhk,bshk->bhqs", q, k) / np.sqrt(q.shape[-1]))
  if keep is not None:
    w = w * keep / (1.0 - rate)
  o = np.einsum("bhqs,bshk->bqhk", w, v)
  return np.einsum("bqhk,hkd->bqd", o, p["out"]["kernel"]) + p["out"]["bias"]


def _dense(x, p):
  return x @ np.asarray(p["kernel"], np.float64) + np.asarray(p["bias"])


def _map_head(x, p):
  """vmoe's MapHead: probe attends over the tokens, then z + Mlp(LN(z))."""
  b = x.shape[0]
  probe = np.broadcast_to(np.asarray(p["probe"], np.float64), (b, 1, x.shape[-1]))
  z = _mha(probe, x, p["MultiHeadDotProductAttention"])
  y = _layer_norm(z, p["LayerNorm"]["scale"], p["LayerNorm"]["bias"])
  y = _dense(_gelu_tanh(_dense(y, p["Mlp"]["Dense_0"])), p["Mlp"]["Dense_1"])
  return (z + y)[:, 0]


def _permute_patches(images, order):
  """Images `[B, 8, 8, C]` with their 2x2 grid of 4x4 patches permuted
  (row-major patch `i` of the result is patch `order[i]` of the input)."""
  b, _, _, c = images.shape
  p = np.asarray(images).reshape(b, 2, 4, 2, 4, c).transpose(0, 1, 3, 2, 4, 5)
  p = p.reshape(b, 4, 4, 4, c)[:, list(order)]
  p = p.reshape(b, 2, 2, 4, 4, c).transpose(0, 1, 3, 2, 4, 5)
  return jnp.asarray(p.reshape(b, 8, 8, c))


# ------------------------------------------------------------- initialisers


@pytest.fixture
def init_keys(monkeypatch):
  """Records `{param path: (rng, init args)}` for every parameter created:
  the exact key flax passes to the parameter's initializer (DenseGeneral's
  `kernel_init_wrap` hands the same key on to `kernel_init`)."""
  records = {}
  original = nn.Module.param

  def param(self, name, init_fn, *args, **kwargs):
    path = "/".join(self.scope.path + (name,))

    def recording(rng, *a, **kw):
      records[path] = (rng, a)
      return init_fn(rng, *a, **kw)

    return original(self, name, recording, *args, **kwargs)

  monkeypatch.setattr(nn.Module, "param", param)
  return records


def _flat_shape(kind, shape):
  """DenseGeneral's 2-D shape of an attention kernel (flax/linen/linear.py:
  the contracted axes times the feature axes)."""
  if kind == "out":  # [heads, head_dim, D] -> [heads * head_dim, D]
    return (shape[0] * shape[1], shape[2])
  return (shape[0], shape[1] * shape[2])  # [D, heads, head_dim]


def test_defaults_are_vmoes():
  for model in (_model(), VisionTransformerMoe(num_classes=3)):
    assert model.attention_kernel_init == "xavier_uniform"
    assert model.attention_broadcast_dropout is False
    assert model.attention_qk_norm is False
    assert model.classifier == "token"
    assert model.position_emb == "learned"
    assert model.representation_size is None
    assert model.head_kernel_zero_init is True
    assert model.head_bias_init == 0.0


@pytest.mark.parametrize("kernel_init,zero_head", [
    ("xavier_uniform", True), ("lecun_normal", False)])
def test_initialisers_equal_direct_draws(init_keys, kernel_init, zero_head):
  direct = {"xavier_uniform": jax.nn.initializers.xavier_uniform(),
            "lecun_normal": jax.nn.initializers.lecun_normal()}[kernel_init]
  model = _model(classifier="map", representation_size=6,
                 attention_kernel_init=kernel_init,
                 head_kernel_zero_init=zero_head, head_bias_init=0.3)
  params = traverse_util.flatten_dict(_init(model), sep="/")

  modules = [f"encoderblock_{i}/Attention" for i in range(2)] + [
      "MapHead/MultiHeadDotProductAttention"]
  kernels = []
  for module in modules:
    for kind in ATTN_KERNELS:
      path = f"{module}/{kind}/kernel"
      value = np.asarray(params[path])
      expect_shape = (HEADS, HEAD_DIM, D) if kind == "out" else (
          D, HEADS, HEAD_DIM)
      assert value.shape == expect_shape, path
      key, _ = init_keys[path]
      want = direct(key, _flat_shape(kind, value.shape), jnp.float32)
      np.testing.assert_array_equal(value, np.asarray(want).reshape(
          value.shape), err_msg=path)
      kernels.append(value)
  # Distinct keys: no two kernels are the same draw.
  for i in range(len(kernels)):
    for j in range(i):
      assert not np.array_equal(kernels[i], kernels[j])

  key, _ = init_keys["MapHead/probe"]
  assert params["MapHead/probe"].shape == (1, 1, D)
  np.testing.assert_array_equal(
      params["MapHead/probe"],
      jax.nn.initializers.xavier_uniform()(key, (1, 1, D), jnp.float32))

  key, _ = init_keys["pre_logits/kernel"]
  np.testing.assert_array_equal(
      params["pre_logits/kernel"],
      jax.nn.initializers.lecun_normal()(key, (D, 6), jnp.float32))
  np.testing.assert_array_equal(params["pre_logits/bias"], np.zeros(6))

  head = np.asarray(params["head/kernel"])
  assert head.shape == (6, 5)
  if zero_head:
    np.testing.assert_array_equal(head, np.zeros((6, 5)))
  else:
    key, _ = init_keys["head/kernel"]
    np.testing.assert_array_equal(
        head, jax.nn.initializers.lecun_normal()(key, (6, 5), jnp.float32))
    assert np.abs(head).sum() > 0
  np.testing.assert_array_equal(params["head/bias"],
                                np.full((5,), 0.3, np.float32))


@pytest.fixture(scope="module")
def wide_attention_kernels():
  """The four attention kernels of one block with D = 256, 4 heads, for both
  initializers: `{option: [flat values]}`."""
  out = {}
  images = jnp.zeros((1, 8, 8, 3))
  for option in ("xavier_uniform", "lecun_normal"):
    model = build_model(dict(name="vit", num_classes=2, patch_size=(4, 4),
                             hidden_size=256, num_layers=1, num_heads=4,
                             mlp_dim=8, attention_kernel_init=option))
    attn = model.init(jax.random.key(3), images)["params"][
        "encoderblock_0"]["Attention"]
    assert attn["query"]["kernel"].shape == (256, 4, 64)
    assert attn["out"]["kernel"].shape == (4, 64, 256)
    out[option] = np.concatenate([np.asarray(attn[k]["kernel"]).ravel()
                                  for k in ATTN_KERNELS]).astype(np.float64)
  return out


def test_attention_kernel_statistics_follow_the_formulas(
    wide_attention_kernels):
  # Flattened fans (flax's DenseGeneral): fan_in = fan_out = 256 for all four
  # kernels. (On the unflattened [256, 4, 64] shape jax would see
  # fan_in = 4 * 256, fan_out = 64 * 256: std 0.0107 for xavier, 1/32 for
  # lecun; the checks below rule that out.)
  fan_in = fan_out = 256
  xav = wide_attention_kernels["xavier_uniform"]
  lec = wide_attention_kernels["lecun_normal"]

  bound = math.sqrt(6.0 / (fan_in + fan_out))  # 0.10825
  assert np.abs(xav).max() <= bound
  assert np.abs(xav).max() > 0.99 * bound     # the uniform fills its range
  xav_std = math.sqrt(2.0 / (fan_in + fan_out))  # 1/16
  assert abs(xav.std() - xav_std) < 0.01 * xav_std
  assert abs(xav.mean()) < 0.01 * xav_std
  # Uniform: kurtosis 9/5.
  assert abs(np.mean(xav ** 4) / np.var(xav) ** 2 - 1.8) < 0.03

  lec_std = math.sqrt(1.0 / fan_in)  # 1/16: the truncated normal is rescaled
  assert abs(lec.std() - lec_std) < 0.01 * lec_std
  # Truncated at 2 standard deviations of the underlying normal, whose std is
  # lec_std / 0.8796 (the std of a standard normal truncated to [-2, 2]).
  s = lec_std / 0.87962566103423978
  assert np.abs(lec).max() <= 2 * s + 1e-7
  # P(|z| > bound / s | |z| < 2) for a standard normal z: about 8.6 %, where
  # the uniform has none beyond its bound.
  z = bound / s

  def phi_tail(t):  # P(|z| > t)
    return math.erfc(t / math.sqrt(2))

  beyond = (phi_tail(z) - phi_tail(2.0)) / (1 - phi_tail(2.0))
  assert abs(np.mean(np.abs(lec) > bound) - beyond) < 0.01
  # Kurtosis of the standard normal truncated to [-2, 2]: m4 / m2^2.
  dens = math.exp(-2.0) / math.sqrt(2 * math.pi)  # phi(2)
  mass = 1 - phi_tail(2.0)
  m2 = 1 - 2 * 2 * dens / mass
  m4 = 3 - 2 * dens * (2 ** 3 + 3 * 2) / mass
  assert abs(np.mean(lec ** 4) / np.var(lec) ** 2 - m4 / m2 ** 2) < 0.03
  # For these square kernels both formulas give the same variance; the
  # distributions differ in shape (above), not in scale.
  assert abs(xav.std() / lec.std() - 1) < 0.02


# ------------------------------------------------------- attention dropout


@pytest.fixture
def dropout_masks(monkeypatch):
  """Records the keep-masks flax's attention dropout draws."""
  masks = []

  def bernoulli(key, p, shape=None):
    keep = jax.random.bernoulli(key, p, shape)
    masks.append(np.asarray(keep))
    return keep

  shim = types.SimpleNamespace(**{
      name: getattr(jax.random, name) for name in dir(jax.random)
      if not name.startswith("_")})
  shim.bernoulli = bernoulli
  monkeypatch.setattr(flax_attention, "random", shim)
  return masks


@pytest.fixture(scope="module")
def dropout_setup():
  images = jnp.broadcast_to(IMAGES[:1], (4, 8, 8, 3))
  cfg = dict(attention_dropout_rate=0.5, dropout_rate=0.0,
             head_kernel_zero_init=False)
  params = _init(_model(**cfg), images)
  return images, cfg, params


@pytest.mark.parametrize("broadcast", [False, True])
def test_attention_dropout_masks(dropout_masks, dropout_setup, broadcast):
  images, cfg, params = dropout_setup
  model = _model(attention_broadcast_dropout=broadcast, **cfg)
  path = "encoderblock_0/Attention"
  logits, seen = _apply_capturing(
      model, params, images, [path], deterministic=False,
      rngs={"dropout": jax.random.key(5)})
  assert len(dropout_masks) == 2  # one per block
  b, t = 4, PATCHES + 1
  for keep in dropout_masks:
    if broadcast:
      assert keep.shape == (1, 1, t, t)
    else:
      assert keep.shape == (b, HEADS, t, t)
      # Independent masks per example and per head.
      assert not np.array_equal(keep[0], keep[1])
      assert not np.array_equal(keep[:, 0], keep[:, 1])
    assert 0.1 < keep.mean() < 0.9  # keep prob 0.5
  # The block's attention output equals attention with that mask.
  x_in, out = seen[path]
  want = _mha(x_in, x_in, params["encoderblock_0"]["Attention"],
              keep=dropout_masks[0], rate=0.5)
  np.testing.assert_allclose(out, want, atol=1e-5, rtol=1e-5)

  spread = np.abs(logits - logits[:1]).max()
  if broadcast:  # Identical images, one shared mask: identical logits.
    assert spread < 1e-6
  else:
    assert spread > 1e-3
  # A fixed dropout rng gives the same logits again.
  again, _ = model.apply({"params": params}, images, deterministic=False,
                         rngs={"dropout": jax.random.key(5)})
  np.testing.assert_array_equal(logits, again)
  # Deterministic: no dropout, identical rows either way.
  det, _ = model.apply({"params": params}, images, deterministic=True)
  assert np.abs(np.asarray(det) - np.asarray(det)[:1]).max() < 1e-6


# ------------------------------------------------------- jit + grad per option


GRAD_CASES = {
    "map": (dict(classifier="map"), ["MapHead/probe"]),
    "gap_pre_logits": (dict(classifier="gap", representation_size=6),
                       ["pre_logits/kernel"]),
    "qk_norm": (dict(attention_qk_norm=True),
                ["encoderblock_0/Attention/query_ln/scale",
                 "encoderblock_1/Attention/key_ln/scale"]),
    "zero_sincos_lecun_bcast": (
        dict(classifier="0", position_emb="sincos2d",
             attention_kernel_init="lecun_normal",
             attention_broadcast_dropout=True, attention_dropout_rate=0.1),
        ["encoderblock_0/Attention/query/kernel"]),
    "vmoe_map_qk_norm_none": (
        dict(name="vit_moe", classifier="map", attention_qk_norm=True,
             position_emb="none", representation_size=6,
             moe=dict(layers=(1,), num_experts=4,
                      router=dict(name="noisy_topk", num_selected=2))),
        ["MapHead/probe", "pre_logits/kernel",
         "MapHead/MultiHeadDotProductAttention/query_ln/scale"]),
}


@pytest.mark.parametrize("case", sorted(GRAD_CASES))
def test_jit_grad_per_option(case, monkeypatch):
  options, own = GRAD_CASES[case]
  # Attention dropout draws its keep-mask at a float32 probability, also in
  # the float64 reference below (where a Python float would be drawn at
  # float64, another mask); the float32 program draws exactly this anyway.
  shim = types.SimpleNamespace(**{
      name: getattr(jax.random, name) for name in dir(jax.random)
      if not name.startswith("_")})
  shim.bernoulli = lambda key, p, shape=None: jax.random.bernoulli(
      key, jnp.float32(p), shape)
  monkeypatch.setattr(flax_attention, "random", shim)
  model = _model(head_kernel_zero_init=False, **options)
  params = _init(model)

  def loss(p, m=model):
    logits, metrics = m.apply({"params": p}, IMAGES, deterministic=False,
                              rngs=RNGS)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, LABELS)
    return ce.mean() + metrics["auxiliary_loss"]

  value, grads = jax.jit(jax.value_and_grad(loss))(params)
  # Reference: the same loss in float64 (same dropout masks and routing
  # noise), its value and its central differences along a random direction
  # of every leaf against the jitted float32 gradient (`grad_check`).
  model64 = model.clone(dtype=jnp.float64)
  checked, value64 = assert_grads_match_differences(
      lambda p: loss(p, model64), params, grads)
  assert checked == len(jax.tree.leaves(params))
  np.testing.assert_allclose(float(value), value64, rtol=1e-6)
  flat = traverse_util.flatten_dict(grads, sep="/")
  for path in own:  # The option's own parameters are reached.
    assert np.abs(flat[path]).max() > 0, path
  assert np.abs(flat["embedding/kernel"]).max() > 0


# ------------------------------------------------------ pooling / head cases


@pytest.mark.parametrize("classifier", ["token", "0", "gap"])
def test_pooling_equals_numpy(classifier):
  model = _model(classifier=classifier, head_kernel_zero_init=False)
  params = dict(_init(model))
  assert ("cls" in params) == (classifier == "token")
  if classifier == "token":
    params["cls"] = jax.random.normal(jax.random.key(9), (1, 1, D))
  logits, seen = _apply_capturing(model, params, IMAGES,
                                  ["encoder_norm", "encoderblock_0"])
  x = seen["encoder_norm"][1].astype(np.float64)
  t = PATCHES + (classifier == "token")
  assert x.shape == (3, t, D)
  pooled = x.mean(1) if classifier == "gap" else x[:, 0]
  np.testing.assert_allclose(logits, _dense(pooled, _np(params["head"])),
                             atol=1e-5, rtol=1e-5)
  if classifier == "token":  # token 0 entering the encoder is the class token
    x_in = seen["encoderblock_0"][0]
    np.testing.assert_allclose(
        x_in[:, 0], np.broadcast_to(params["cls"][0, 0] + params[
            "pos_embedding"][0, 0], (3, D)), atol=1e-6)


def test_representation_size_equals_numpy():
  model = _model(classifier="gap", representation_size=6,
                 head_kernel_zero_init=False)
  params = _init(model)
  assert params["pre_logits"]["kernel"].shape == (D, 6)
  assert params["head"]["kernel"].shape == (6, 5)
  logits, seen = _apply_capturing(model, params, IMAGES, ["encoder_norm"])
  pooled = seen["encoder_norm"][1].astype(np.float64).mean(1)
  pre = np.tanh(_dense(pooled, _np(params["pre_logits"])))
  np.testing.assert_allclose(logits, _dense(pre, _np(params["head"])),
                             atol=1e-5, rtol=1e-5)
  # Without it the head reads the pooled vector directly.
  assert "pre_logits" not in _init(_model(classifier="gap"))


def test_head_bias_and_kernel_init():
  model = _model(head_bias_init=-2.5)
  logits, _ = model.apply({"params": _init(model)}, IMAGES)
  np.testing.assert_array_equal(logits, np.full((3, 5), -2.5, np.float32))
  model = _model(head_bias_init=-2.5, head_kernel_zero_init=False)
  logits, _ = model.apply({"params": _init(model)}, IMAGES)
  logits = np.asarray(logits)
  assert np.abs(logits - logits[:1]).max() > 1e-3      # varies across images
  assert np.abs(logits - logits[:, :1]).max() > 1e-3   # and across classes


@pytest.fixture(scope="module")
def map_none():
  model = _model(classifier="map", position_emb="none",
                 head_kernel_zero_init=False)
  return model, _random_head(_init(model))


def test_map_head_equals_numpy(map_none):
  model, params = map_none
  logits, seen = _apply_capturing(model, params, IMAGES,
                                  ["encoder_norm", "MapHead"])
  x = seen["encoder_norm"][1].astype(np.float64)
  assert x.shape == (3, PATCHES, D)  # no class token with "map"
  pooled = _map_head(x, _np(params["MapHead"]))
  np.testing.assert_allclose(seen["MapHead"][1], pooled, atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(logits, _dense(pooled, _np(params["head"])),
                             atol=1e-5, rtol=1e-5)


def test_map_without_position_emb_is_patch_permutation_invariant(map_none):
  order = (3, 0, 2, 1)
  permuted = _permute_patches(IMAGES, order)
  assert not np.allclose(permuted, IMAGES)
  model, params = map_none
  a, _ = model.apply({"params": params}, IMAGES)
  b, _ = model.apply({"params": params}, permuted)
  np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)
  # "0" pools the first token, which the permutation changes.
  zero = _model(classifier="0", position_emb="none",
                head_kernel_zero_init=False)
  zp = _random_head(_init(zero))
  a, _ = zero.apply({"params": zp}, IMAGES)
  b, _ = zero.apply({"params": zp}, permuted)
  assert np.abs(np.asarray(a) - np.asarray(b)).max() > 1e-3
  # A learned position embedding breaks the invariance of "map" too.
  learned = _model(classifier="map", head_kernel_zero_init=False)
  lp = _random_head(_init(learned))
  a, _ = learned.apply({"params": lp}, IMAGES)
  b, _ = learned.apply({"params": lp}, permuted)
  assert np.abs(np.asarray(a) - np.asarray(b)).max() > 1e-4


@pytest.mark.parametrize("qk_norm", [True, False])
def test_qk_norm_makes_logits_invariant_to_query_scale(qk_norm):
  model = _model(attention_qk_norm=qk_norm, head_kernel_zero_init=False)
  params = _random_head(_init(model))
  attn = params["encoderblock_0"]["Attention"]
  assert ("query_ln" in attn) == qk_norm and ("key_ln" in attn) == qk_norm
  if qk_norm:
    assert set(attn["query_ln"]) == {"scale"}  # no bias
    assert attn["query_ln"]["scale"].shape == (HEAD_DIM,)
    assert set(attn["key_ln"]) == {"scale"}
  # Make the query bias non-zero so that its scaling matters too.
  params = jax.tree_util.tree_map_with_path(
      lambda p, v: v + 0.3 if "bias" in jax.tree_util.keystr(p) and
      "query" in jax.tree_util.keystr(p) else v, params)
  scaled = {k: v for k, v in params.items()}
  for i in range(2):
    block = dict(scaled[f"encoderblock_{i}"])
    attn = dict(block["Attention"])
    attn["query"] = {k: 7.0 * v for k, v in attn["query"].items()}
    block["Attention"] = attn
    scaled[f"encoderblock_{i}"] = block
  a, _ = model.apply({"params": params}, IMAGES)
  b, _ = model.apply({"params": scaled}, IMAGES)
  diff = np.abs(np.asarray(a) - np.asarray(b)).max()
  if qk_norm:
    assert diff < 1e-5
  else:
    assert diff > 1e-3


# ------------------------------------------------------ position embeddings


def test_sincos2d_hand_values():
  got = np.asarray(sincos2d(2, 2, 8, temperature=100.))
  w = [1.0, 0.01]  # q = 2: 100 ** (-0 / 1), 100 ** (-1 / 1)
  rows = []
  for r in range(2):
    for c in range(2):
      rows.append([math.sin(c * w[0]), math.sin(c * w[1]),
                   math.cos(c * w[0]), math.cos(c * w[1]),
                   math.sin(r * w[0]), math.sin(r * w[1]),
                   math.cos(r * w[0]), math.cos(r * w[1])])
  assert got.shape == (4, 8)
  np.testing.assert_allclose(got, np.array(rows), atol=1e-6)
  # Spot values: patch (0, 1) -> sin(1), patch (1, 0) -> cos(1) in the rows.
  np.testing.assert_allclose(got[1, 0], 0.8414709848, atol=1e-6)
  np.testing.assert_allclose(got[2, 6], 0.5403023059, atol=1e-6)


def _sincos_np(h, w, d, temperature):
  q = d // 4
  omega = [temperature ** (-i / (q - 1)) for i in range(q)]
  out = np.zeros((h * w, d))
  for r in range(h):
    for c in range(w):
      out[r * w + c] = ([math.sin(c * o) for o in omega]
                        + [math.cos(c * o) for o in omega]
                        + [math.sin(r * o) for o in omega]
                        + [math.cos(r * o) for o in omega])
  return out


@pytest.mark.parametrize("position_emb", ["sincos2d", "none", "learned"])
def test_position_emb_in_the_model(position_emb):
  model = _model(position_emb=position_emb, position_emb_temperature=50.)
  params = dict(_init(model))
  if position_emb == "learned":
    assert params["pos_embedding"].shape == (1, PATCHES + 1, D)
    assert _init(_model(classifier="gap"))["pos_embedding"].shape == (
        1, PATCHES, D)
  else:
    assert "pos_embedding" not in params
  params["cls"] = jax.random.normal(jax.random.key(9), (1, 1, D))
  _, seen = _apply_capturing(model, params, IMAGES,
                             ["embedding", "encoderblock_0"])
  patches = seen["embedding"][1].reshape(3, PATCHES, D).astype(np.float64)
  x = seen["encoderblock_0"][0]
  want = np.concatenate(
      [np.broadcast_to(np.asarray(params["cls"]), (3, 1, D)), patches], 1)
  if position_emb == "sincos2d":
    want[:, 1:] += _sincos_np(2, 2, D, 50.)[None]  # the class token gets none
  elif position_emb == "learned":
    want += np.asarray(params["pos_embedding"])
  np.testing.assert_allclose(x, want, atol=1e-5, rtol=1e-5)


def test_sincos2d_changes_the_logits():
  none = _model(position_emb="none", head_kernel_zero_init=False)
  params = _random_head(_init(none))
  sincos = _model(position_emb="sincos2d", head_kernel_zero_init=False)
  a, _ = none.apply({"params": params}, IMAGES)
  b, _ = sincos.apply({"params": params}, IMAGES)
  assert np.abs(np.asarray(a) - np.asarray(b)).max() > 1e-3


# --------------------------------------------------------------- validation


@pytest.mark.parametrize("options,field", [
    (dict(classifier="bogus"), "model.classifier"),
    (dict(representation_size=0), "model.representation_size"),
    (dict(representation_size=-3), "model.representation_size"),
    (dict(position_emb="bogus"), "model.position_emb"),
    (dict(position_emb="sincos2d", hidden_size=10, num_heads=2),
     "model.hidden_size"),  # not a multiple of 4
    (dict(position_emb="sincos2d", hidden_size=4, num_heads=2),
     "model.hidden_size"),  # q = 1 frequency: w_i = T ** (-i / (q - 1))
    (dict(position_emb_temperature=0.), "model.position_emb_temperature"),
    (dict(attention_kernel_init="bogus"), "model.attention_kernel_init"),
    (dict(name="vit_moe", classifier="bogus",
          moe=dict(layers=(1,), num_experts=4)), "model.classifier"),
])
def test_bad_options_raise_config_error(options, field):
  with pytest.raises(ConfigError) as info:
    _model(**options)
  assert info.value.field == field
  assert str(info.value).startswith(field + ":")


def test_valid_edge_options_build():
  # 12 is a multiple of 4; 8 is the smallest hidden_size for sincos2d; 10 is
  # fine without it.
  _model(hidden_size=12, num_heads=2, position_emb="sincos2d")
  _model(hidden_size=8, num_heads=2, position_emb="sincos2d")
  _model(hidden_size=10, num_heads=2)
