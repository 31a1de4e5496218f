"""`model.attention="fused"`: `jax.nn.dot_product_attention` in place of the
models' own attention, checked against the option off ("plain", today's
path) on CPU in float32: the same parameter tree, the same logits and the
same parameter gradients, for a ViT with a class token, a V-MoE with the
"map" head and qk-norm, and a Swin with shifted windows under both
position biases; and the configuration errors."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from vmoe_ext.errors import ConfigError, field_scope
from vmoe_ext.models import build_model
from vmoe_ext.models.attention import dot_product_attention
from vmoe_ext.models.swin_attention import WindowAttention
from vmoe_ext.models.swin_window import (relative_position_index,
                                         shift_attention_mask)

RTOL = 1e-5
VIT = dict(name="vit", num_classes=3, patch_size=(4, 4), hidden_size=16,
           num_layers=1, num_heads=2, mlp_dim=16, head_kernel_zero_init=False)
SWIN = dict(name="swin", num_classes=3, patch_size=(2, 2), embed_dim=8,
            depths=(2,), num_heads=(2,), window_size=4,
            drop_path_rate=0.0, head_kernel_zero_init=False)
# ViT: a 3 x 3 patch grid (+ the class token); Swin: 8 x 8 tokens in 4 x 4
# windows, block 1 shifted by 2 (masked).
VIT_IMAGES = np.random.RandomState(0).uniform(size=(2, 12, 12, 3))
SWIN_IMAGES = np.random.RandomState(1).uniform(size=(2, 16, 16, 3))


def _randomize(params, seed=2):
  """Every leaf random normal (kernels scaled by 1/sqrt(fan in)), so the
  position biases, the probe and the zero-initialised leaves all matter."""
  rng = np.random.RandomState(seed)

  def leaf(path, a):
    scale = 1.0
    if getattr(path[-1], "key", None) == "kernel":
      scale = 1.0 / math.sqrt(int(np.prod(a.shape[:-1])))
    return jnp.asarray(rng.normal(size=a.shape) * scale, a.dtype)
  return jax.tree_util.tree_map_with_path(leaf, params)


def _logits_and_grads(config, images, params=None):
  model = build_model(config)
  images = jnp.asarray(images, jnp.float32)
  if params is None:
    params = _randomize(jax.jit(model.init)(jax.random.key(0),
                                            images)["params"])
  weights = jnp.asarray(np.random.RandomState(3).normal(
      size=(images.shape[0], config["num_classes"])), jnp.float32)

  def loss(p):
    logits, metrics = model.apply({"params": p}, images)
    return jnp.sum(logits * weights) + metrics["auxiliary_loss"], logits

  (_, logits), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(
      params)
  return params, np.asarray(logits), jax.tree_util.tree_map(np.asarray, grads)


def _assert_fused_equals_plain(config, images):
  params, logits, grads = _logits_and_grads(config, images)
  fused = dict(config, attention="fused")
  # The same parameter layout: fused initialises the same tree, and runs
  # the plain model's parameters.
  init = jax.eval_shape(build_model(fused).init, jax.random.key(0),
                        jnp.asarray(images, jnp.float32))["params"]
  assert (jax.tree_util.tree_structure(init)
          == jax.tree_util.tree_structure(params))
  assert jax.tree_util.tree_map(np.shape, init) == jax.tree_util.tree_map(
      np.shape, params)
  _, f_logits, f_grads = _logits_and_grads(fused, images, params)
  np.testing.assert_allclose(f_logits, logits, rtol=RTOL,
                             atol=RTOL * np.abs(logits).max())
  # Gradients relative to the largest one: some are 0 up to rounding (the
  # key bias shifts every score of a query equally).
  scale = max(np.abs(g).max() for g in jax.tree_util.tree_leaves(grads))
  for (path, g), f in zip(jax.tree_util.tree_leaves_with_path(grads),
                          jax.tree_util.tree_leaves(f_grads)):
    np.testing.assert_allclose(f, g, rtol=RTOL, atol=RTOL * scale,
                               err_msg=jax.tree_util.keystr(path))


def test_vmoe_class_token():
  config = dict(VIT, name="vit_moe",
                moe=dict(layers=(0,), num_experts=2, group_size=20,
                         router=dict(name="noisy_topk", num_selected=1,
                                     noise_std=0.0)))
  _assert_fused_equals_plain(config, VIT_IMAGES)


def test_vit_map_head_qk_norm():
  _assert_fused_equals_plain(
      dict(VIT, classifier="map", attention_qk_norm=True), VIT_IMAGES)


@pytest.mark.parametrize("bias", ["table", "log_cpb"])
def test_swin_shifted_windows(bias):
  _assert_fused_equals_plain(dict(SWIN, relative_position_bias=bias),
                             SWIN_IMAGES)


def test_window_attention_against_numpy_with_mask():
  """The fused window attention against a NumPy loop over windows and
  heads (the plain path's formula written out), the mask included."""
  m, h, c, batch = 2, 2, 4, 2
  mask = shift_attention_mask(4, 4, m, 1)               # [nW=4, N=4, N]
  x = jnp.asarray(np.random.RandomState(4).normal(
      size=(batch * 4, m * m, c)), jnp.float32)
  module = WindowAttention(h, m, attention="fused")
  params = _randomize(module.init(jax.random.key(0), x, mask)["params"])
  got = np.asarray(module.apply({"params": params}, x, mask))
  p = jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64), params)
  xs = np.asarray(x, np.float64)
  qkv = xs @ p["qkv"]["kernel"] + p["qkv"]["bias"]
  table = p["relative_position_bias_table"]
  index = relative_position_index(m)
  out = np.zeros_like(xs)
  for w in range(x.shape[0]):
    for head in range(h):
      sl = slice(head * c // h, (head + 1) * c // h)
      q, k, v = (qkv[w, :, i * c:(i + 1) * c][:, sl] for i in range(3))
      s = q @ k.T / math.sqrt(c // h) + table[index, head] + mask[w % 4]
      e = np.exp(s - s.max(-1, keepdims=True))
      out[w, :, sl] = (e / e.sum(-1, keepdims=True)) @ v
  want = out @ p["proj"]["kernel"] + p["proj"]["bias"]
  np.testing.assert_allclose(got, want, rtol=RTOL, atol=RTOL)


def test_bfloat16_fused_within_bfloat16_of_float32():
  """In bfloat16 compute the fused attention (float32 logits and softmax)
  stays within bfloat16 rounding of the float32 model."""
  images = jnp.asarray(VIT_IMAGES, jnp.float32)
  plain = build_model(VIT)
  params = _randomize(plain.init(jax.random.key(0), images)["params"])
  logits = np.asarray(plain.apply({"params": params}, images)[0])
  model = build_model(dict(VIT, attention="fused", dtype="bfloat16"))
  got, _ = model.apply({"params": params}, images)
  got = np.asarray(got, np.float32)
  assert np.abs(got - logits).max() > 0   # bfloat16 compute did round.
  # bfloat16 keeps 8 significant bits: 2^-8 relative per rounding, a few
  # dozen roundings deep.
  np.testing.assert_allclose(got, logits,
                             atol=0.05 * np.abs(logits).max())


def test_dot_product_attention_bias_broadcast():
  """A `[1, N, T, S]` bias broadcasts over the batch as the einsum form."""
  rng = np.random.RandomState(5)
  q, k, v = (jnp.asarray(rng.normal(size=(2, 3, 2, 4)), jnp.float32)
             for _ in range(3))
  bias = jnp.asarray(rng.normal(size=(1, 2, 3, 3)), jnp.float32)
  got = dot_product_attention(q, k, v, bias)
  s = jnp.einsum("btnh,bsnh->bnts", q, k) / 2.0 + bias
  want = jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(s, axis=-1), v)
  np.testing.assert_allclose(got, want, rtol=RTOL, atol=RTOL)


@pytest.mark.parametrize("config,match", [
    (dict(VIT, attention="flash"), "must be one of"),
    (dict(VIT, attention="fused", attention_dropout_rate=0.1),
     "no attention dropout"),
    (dict(SWIN, attention="fused", attention_dropout_rate=0.1),
     "no attention dropout"),
    (dict(VIT, attention="cudnn"), "GPU backend"),
    (dict(name="language_model", vocab_size=11, hidden_size=8, num_heads=2,
          attn_span=4, attention="fused"), "only the 'plain'"),
])
def test_config_errors_name_model_attention(config, match):
  with pytest.raises(ConfigError, match=match) as info:
    build_model(config)
  assert info.value.field == "model.attention"
  assert str(info.value).startswith("model.attention:")


@pytest.mark.parametrize("config,match", [
    (dict(VIT, dtype="float32"), "bfloat16 or float16"),
    (dict(VIT, dtype="bfloat16", hidden_size=24, num_heads=2),
     "multiple of 8"),                                        # H = 12
    (dict(SWIN, dtype="bfloat16", window_size=3, embed_dim=16),
     "even number of tokens"),                                # N = 9
])
def test_cudnn_requirements_checked_at_build(monkeypatch, config, match):
  """cuDNN's limits, checked before tracing (the backend faked as a GPU:
  only the checks run)."""
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  with pytest.raises(ConfigError, match=match) as info:
    build_model(dict(config, attention="cudnn"))
  assert info.value.field == "model.attention"


def test_cudnn_swin_window_shrunk_on_a_small_stage(monkeypatch):
  """A 4 x 4 window is even, but a 3 x 3 stage shrinks it to 9 tokens:
  `check_image_size` (run before compiling) names `model.attention`."""
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  model = build_model(dict(SWIN, attention="cudnn", dtype="bfloat16",
                           embed_dim=16))
  model.check_image_size((16, 16))                 # 8 x 8: 4 x 4 windows
  with pytest.raises(ConfigError, match="9") as info:
    with field_scope("model"):
      model.check_image_size((6, 6))               # 3 x 3: one 3 x 3 window
  assert info.value.field == "model.attention"
