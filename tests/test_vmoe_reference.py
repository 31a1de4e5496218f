"""Self-checks of the NumPy vmoe reference against hand computations."""

import copy
import math

import numpy as np
import pytest

import vmoe_reference as ref


def test_layer_norm_hand_vector():
  x = np.array([1., 2., 3., 4.])  # mean 2.5, biased var 1.25.
  scale = np.array([1., 2., 0.5, -1.])
  bias = np.array([0., 1., -1., 0.25])
  inv = 1.0 / math.sqrt(1.25 + 1e-6)
  expected = [-1.5 * inv * 1. + 0., -0.5 * inv * 2. + 1.,
              0.5 * inv * 0.5 - 1., 1.5 * inv * -1. + 0.25]
  np.testing.assert_allclose(ref.layer_norm(x, scale, bias), expected,
                             rtol=1e-12)
  # eps is 1e-6 (flax default): 1.5 / sqrt(1.25 + 1e-6) = 1.3416402498...
  np.testing.assert_allclose(ref.layer_norm(x, None, None)[3],
                             1.3416402498, rtol=1e-10)


def test_gelu_is_tanh_approximation():
  # 0.5 * 1 * (1 + tanh(sqrt(2/pi) * 1.044715)) = 0.8411919906...
  # (the erf form would give 0.8413447461).
  np.testing.assert_allclose(ref.gelu_tanh(np.array([1.0, 0.0, -1.0])),
                             [0.8411919906, 0.0, -0.1588080094], atol=1e-9)


def _identity_attention(d, heads=1):
  eye = np.eye(d)
  return {"query": {"kernel": eye.reshape(d, heads, d // heads),
                    "bias": np.zeros((heads, d // heads))},
          "key": {"kernel": eye.reshape(d, heads, d // heads),
                  "bias": np.zeros((heads, d // heads))},
          "value": {"kernel": eye.reshape(d, heads, d // heads),
                    "bias": np.zeros((heads, d // heads))},
          "out": {"kernel": eye.reshape(heads, d // heads, d),
                  "bias": np.array([0.5, -0.5])}}


def test_attention_one_head_two_tokens_by_hand():
  p = _identity_attention(2)
  x = np.array([[[1., 0.], [0., 1.]]])
  # q.k / sqrt(2): token 0 scores [1/sqrt2, 0] -> p0 = sigmoid(1/sqrt2).
  p0 = 1.0 / (1.0 + math.exp(-1.0 / math.sqrt(2.0)))  # 0.6697615493
  out = ref.multi_head_attention(p, x, x)
  np.testing.assert_allclose(
      out[0], [[p0 + 0.5, 1 - p0 - 0.5], [1 - p0 + 0.5, p0 - 0.5]],
      rtol=1e-12)
  # normalize_qk: LayerNorm (no bias) over head_dim: [1, 0] -> [1, -1] * s.
  p["query_ln"] = {"scale": np.array([1., 1.])}
  p["key_ln"] = {"scale": np.array([2., 2.])}
  # token 0: q = [1,-1], k0 = [2,-2], k1 = [-2,2] -> scores +-4/sqrt2.
  a = 1.0 / (1.0 + math.exp(-8.0 / math.sqrt(2.0)))
  out = ref.multi_head_attention(p, x, x, qk_norm=True)
  np.testing.assert_allclose(out[0, 0], [a + 0.5, 1 - a - 0.5], rtol=1e-6)


def test_sincos2d_hidden8_grid2x2_by_hand():
  # c // 4 = 2 -> omega = [0, 1] / 1 -> 1 / T**omega = [1, 1/T]; T = 100.
  t = 100.
  x = np.zeros((1, 5, 8))  # cls + 2x2 grid.
  out = ref.add_position_emb({}, {"name": "sincos2d", "temperature": t}, x,
                             (2, 2))
  np.testing.assert_array_equal(out[0, 0], np.zeros(8))  # cls: no posemb.

  def row(yy, xx):
    return [math.sin(xx), math.sin(xx / t), math.cos(xx), math.cos(xx / t),
            math.sin(yy), math.sin(yy / t), math.cos(yy), math.cos(yy / t)]
  # Row-major grid: (y, x) = (0,0), (0,1), (1,0), (1,1).
  expected = [row(0, 0), row(0, 1), row(1, 0), row(1, 1)]
  np.testing.assert_allclose(out[0, 1:], expected, rtol=1e-12, atol=1e-15)
  # Spot-check with explicit numbers: (y=1, x=0) -> sin(1) at index 4.
  np.testing.assert_allclose(out[0, 3, 4], 0.8414709848, rtol=1e-10)
  # Without a classifier token (n == h * w) every token gets the embedding.
  out = ref.add_position_emb({}, {"name": "sincos2d", "temperature": t},
                             np.zeros((1, 4, 8)), (2, 2))
  np.testing.assert_allclose(out[0], expected, rtol=1e-12, atol=1e-15)


def test_patch_embedding_order():
  # 4x4 single-channel image, patch 2: pick pixel (i=0, j=1) of each patch.
  img = np.arange(16.).reshape(1, 4, 4, 1)
  kernel = np.zeros((2, 2, 1, 1))
  kernel[0, 1, 0, 0] = 1.
  y = ref.patch_embed({"kernel": kernel, "bias": np.array([10.])}, img, (2, 2))
  # Grid (py, px): pixel (2 py, 2 px + 1) = 4 * 2py + 2px + 1.
  np.testing.assert_array_equal(y[0, :, :, 0], [[11., 13.], [19., 21.]])


def test_capacity_formula():
  cases = [  # (S, K, E, cf, ceil_or_round, multiple_of) -> hand value.
      ((8, 1, 4, 1.0, "ceil", 4), 4),      # 8/4 = 2 -> up to multiple of 4.
      ((8, 2, 4, 1.25, "ceil", 4), 8),     # 16*1.25/4 = 5 -> 8.
      ((10, 1, 4, 1.05, "ceil", None), 3),  # 2.625 -> 3.
      ((5, 1, 2, 1.0, "round", None), 2),  # round(2.5) = 2 (half to even).
      ((7, 1, 2, 1.0, "round", 1), 4),     # round(3.5) = 4.
      ((12, 2, 8, 1.0, "round", 2), 4),    # 24/8 = 3 -> 4.
  ]
  for (s, k, e, cf, cor, mult), expected in cases:
    assert ref.compute_capacity(s * k, e, cf, cor, mult) == expected, (s, k, e)


def test_capacity_errors_and_default_multiple():
  with pytest.raises(ValueError):  # round(2 / 8) = 0 < 1.
    ref.compute_capacity(2, 8, 1.0, "round", None)
  # vmoe's default capacity_multiple_of is 4: S=6, K=1, E=2, cf=1 -> 3 -> 4.
  moe = {"group_size": 6, "router": {"num_selected_experts": 1, "dispatcher": {
      "capacity_factor": 1.0, "batch_priority": False}}}
  assert ref._dispatcher_settings(moe, 6, 2) == (1, 4, False)


def _toy_experts(scales):
  """1-d experts: Dense_0 kernel a_e, Dense_1 kernel 1, biases 0."""
  e = len(scales)
  return {"Dense_0": {"kernel": np.array(scales, float).reshape(e, 1, 1),
                      "bias": np.zeros((e, 1))},
          "Dense_1": {"kernel": np.ones((e, 1, 1)), "bias": np.zeros((e, 1))}}


def test_dispatch_k1_overflow_drops_later_tokens():
  gates = np.array([[0.9, 0.1], [0.8, 0.2], [0.3, 0.7], [0.6, 0.4]])
  cap = ref.compute_capacity(4 * 1, 2, 0.5, "ceil", 1)
  assert cap == 1
  idx, buf, cw = ref.top_experts_per_item_routing(gates, 1, cap, False)
  np.testing.assert_array_equal(idx[:, 0], [0, 0, 1, 0])
  np.testing.assert_array_equal(buf[:, 0], [0, 1, 0, 2])
  np.testing.assert_array_equal(cw[:, 0], [0.9, 0.0, 0.7, 0.0])
  x = np.array([[1.], [2.], [3.], [4.]])
  y = ref.moe_combine_from_gates(gates, x, _toy_experts([1., 2.]), 1, cap,
                                 False)
  g = ref.gelu_tanh
  np.testing.assert_allclose(
      y[:, 0], [0.9 * g(1.), 0., 0.7 * g(2. * 3.), 0.], rtol=1e-12)


def test_dispatch_k2_second_choices_after_all_first_choices():
  gates = np.array([[0.6, 0.4], [0.7, 0.3], [0.55, 0.45], [0.2, 0.8]])
  cap = ref.compute_capacity(4 * 2, 2, 0.75, "ceil", 1)
  assert cap == 3
  idx, buf, cw = ref.top_experts_per_item_routing(gates, 2, cap, False)
  np.testing.assert_array_equal(idx, [[0, 1], [0, 1], [0, 1], [1, 0]])
  # 1st choices: e0 <- t0, t1, t2 (slots 0..2); e1 <- t3 (slot 0).
  # 2nd choices in token order: e1 <- t0 (1), t1 (2), t2 (3: dropped);
  # e0 <- t3 (3: dropped). (Token-major filling would drop t3's 1st choice.)
  np.testing.assert_array_equal(buf, [[0, 1], [1, 2], [2, 3], [0, 3]])
  np.testing.assert_allclose(
      cw, [[0.6, 0.4], [0.7, 0.3], [0.55, 0.], [0.8, 0.]])  # Not renormalised.
  x = np.array([[1.], [1.], [1.], [1.]])
  y = ref.moe_combine_from_gates(gates, x, _toy_experts([1., 2.]), 2, cap,
                                 False)
  g1, g2 = ref.gelu_tanh(1.), ref.gelu_tanh(2.)
  np.testing.assert_allclose(
      y[:, 0], [0.6 * g1 + 0.4 * g2, 0.7 * g1 + 0.3 * g2, 0.55 * g1, 0.8 * g2],
      rtol=1e-12)


def test_batch_priority_orders_tokens_by_top_gate():
  gates = np.array([[0.6, 0.4], [0.9, 0.1], [0.45, 0.55], [0.7, 0.3]])
  # Capacity 1. Vanilla: e0 keeps t0, drops t1, t3.
  _, _, cw = ref.top_experts_per_item_routing(gates, 1, 1, False)
  np.testing.assert_allclose(cw[:, 0], [0.6, 0., 0.55, 0.])
  # BPR order t1 (0.9), t3 (0.7), t0 (0.6), t2 (0.55): e0 keeps t1 only.
  _, buf, cw = ref.top_experts_per_item_routing(gates, 1, 1, True)
  np.testing.assert_array_equal(buf[:, 0], [2, 0, 0, 1])
  np.testing.assert_allclose(cw[:, 0], [0., 0.9, 0.55, 0.])
  # Ties on the top gate keep token order (stable argsort).
  tie = np.array([[0.6, 0.4], [0.6, 0.4]])
  _, buf, _ = ref.top_experts_per_item_routing(tie, 1, 1, True)
  np.testing.assert_array_equal(buf[:, 0], [0, 1])


def test_groups_are_row_major_over_batch_and_tokens():
  # D = 2, router kernel 10 * I: a token [1, 0] goes to e0, [0, 1] to e1.
  moe_p = {"Router": {"dense": {"kernel": 10. * np.eye(2)}},
           "Mlp": {"Dense_0": {"kernel": np.stack([np.eye(2)] * 2),
                               "bias": np.zeros((2, 2))},
                   "Dense_1": {"kernel": np.stack([np.eye(2), 2 * np.eye(2)]),
                               "bias": np.zeros((2, 2))}}}
  moe = {"num_experts": 2, "group_size": 2, "router": {
      "num_selected_experts": 1, "dispatcher": {
          "capacity_factor": 0.5, "batch_priority": False,
          "capacity_multiple_of": 1}}}
  e0, e1 = [1., 0.], [0., 1.]
  x = np.array([[e0, e0], [e1, e0]])  # [B=2, N=2, D=2]
  y = ref.mlp_moe_block(moe_p, moe, x)
  # Groups (b0n0, b0n1) and (b1n0, b1n1): b0n1 dropped, b1n1 kept.
  gate = 1.0 / (1.0 + math.exp(-10.0))
  g1 = ref.gelu_tanh(1.)
  np.testing.assert_allclose(y[0, 0], [gate * g1, 0.], rtol=1e-12)
  np.testing.assert_array_equal(y[0, 1], [0., 0.])
  np.testing.assert_allclose(y[1, 0], [0., 2 * gate * g1], rtol=1e-12)
  np.testing.assert_allclose(y[1, 1], [gate * g1, 0.], rtol=1e-12)


def _config(**kw):
  cfg = {"num_classes": 5, "patch_size": (2, 2), "hidden_size": 8,
         "classifier": "token", "representation_size": None,
         "encoder": {"num_layers": 2, "num_heads": 2, "mlp_dim": 12,
                     "attention_qk_norm": False,
                     "position_emb": {"name": "learned"}}}
  cfg.update(kw)
  return cfg


def test_single_expert_moe_equals_dense_block_and_vit_jax_layout():
  rng = np.random.default_rng(0)
  images = rng.standard_normal((2, 4, 6, 3))
  cfg = _config(representation_size=6)
  p = ref.random_vmoe_params(rng, cfg, images.shape)
  assert p["Encoder"]["posembed_input"]["pos_embedding"].shape == (1, 7, 8)
  assert p["embedding"]["kernel"].dtype == np.float32
  logits = ref.vmoe_forward(p, cfg, images)
  assert logits.shape == (2, 5) and logits.dtype == np.float64
  # Same weights in vit_jax's layout give the same logits.
  vj = {k: p[k] for k in ("embedding", "cls", "pre_logits", "head")}
  enc = p["Encoder"]
  vj["Transformer"] = {"posembed_input": enc["posembed_input"],
                       "encoder_norm": enc["encoder_norm"]}
  for i in range(2):
    b = enc[f"encoderblock_{i}"]
    vj["Transformer"][f"encoderblock_{i}"] = {
        "LayerNorm_0": b["LayerNorm_0"],
        "MultiHeadDotProductAttention_1": b["SelfAttention"],
        "LayerNorm_2": b["LayerNorm_1"], "MlpBlock_3": b["Mlp"]}
  vj_cfg = {"num_classes": 5, "patches": {"size": (2, 2)}, "hidden_size": 8,
            "classifier": "token", "representation_size": 6,
            "transformer": {"num_layers": 2, "num_heads": 2, "mlp_dim": 12}}
  np.testing.assert_allclose(ref.vit_jax_forward(vj, vj_cfg, images), logits,
                             rtol=1e-12)
  # One expert, K=1, ample capacity: gate = softmax of one logit = 1.
  moe_cfg = copy.deepcopy(cfg)
  moe_cfg["encoder"]["moe"] = {"layers": (1,), "num_experts": 1,
                               "group_size": 7, "router": {
                                   "num_selected_experts": 1, "dispatcher": {
                                       "capacity_factor": 1.0,
                                       "batch_priority": True}}}
  pm = copy.deepcopy(p)
  dense_mlp = pm["Encoder"]["encoderblock_1"].pop("Mlp")
  pm["Encoder"]["encoderblock_1"]["Moe"] = {
      "Router": {"dense": {"kernel": rng.standard_normal((8, 1))}},
      "Mlp": {n: {k: v[None] for k, v in layer.items()}
              for n, layer in dense_mlp.items()}}
  np.testing.assert_allclose(ref.vmoe_forward(pm, moe_cfg, images), logits,
                             rtol=1e-12)
  # Dropping the representation layer changes the logits (it is used).
  assert not np.allclose(ref.vmoe_forward(
      {**p, "pre_logits": {"kernel": p["pre_logits"]["kernel"],
                           "bias": 0 * p["pre_logits"]["bias"]}},
      cfg, images), logits)


def test_random_moe_params_layout_and_heads():
  rng = np.random.default_rng(1)
  images = rng.standard_normal((2, 4, 4, 3))
  enc = {"num_layers": 2, "num_heads": 2, "mlp_dim": 12,
         "attention_qk_norm": True,
         "position_emb": {"name": "sincos2d", "temperature": 50.},
         "moe": {"layers": (0,), "num_experts": 3, "group_size": 2,
                 "mlp_dim": 10, "router": {
                     "num_selected_experts": 2, "dispatcher": {
                         "capacity_factor": 1.0, "batch_priority": True,
                         "capacity_ceil_or_round": "round",
                         "multiple_of": 1}}}}
  for classifier in ("map", "gap", "0", "token"):
    cfg = _config(classifier=classifier, encoder=enc)
    p = ref.random_vmoe_params(rng, cfg, images.shape)
    moe_p = p["Encoder"]["encoderblock_0"]["Moe"]
    assert moe_p["Router"]["dense"]["kernel"].shape == (8, 3)
    assert moe_p["Mlp"]["Dense_0"]["kernel"].shape == (3, 8, 10)
    assert moe_p["Mlp"]["Dense_1"]["bias"].shape == (3, 8)
    assert "Mlp" in p["Encoder"]["encoderblock_1"]
    assert "posembed_input" not in p["Encoder"]
    sa = p["Encoder"]["encoderblock_1"]["SelfAttention"]
    assert sa["query"]["kernel"].shape == (8, 2, 4)
    assert sa["out"]["kernel"].shape == (2, 4, 8)
    assert sa["query_ln"]["scale"].shape == (4,) and "bias" not in sa["key_ln"]
    assert ("cls" in p) == (classifier == "token")
    assert ("MapHead" in p) == (classifier == "map")
    logits = ref.vmoe_forward(p, cfg, images)
    assert logits.shape == (2, 5) and np.all(np.isfinite(logits))
  # MapHead with a single token: attention weights are 1, so the pooled
  # vector is a + Mlp(LN(a)) with a = value/out projection of that token,
  # independent of the probe.
  mh = ref.random_vmoe_params(rng, _config(classifier="map"),
                              (4, 4, 3))["MapHead"]
  tok = rng.standard_normal((1, 1, 8))
  att = mh["MultiHeadDotProductAttention"]
  a = np.einsum("d,dhk->hk", tok[0, 0], att["value"]["kernel"])
  a = np.einsum("hk,hko->o", a + att["value"]["bias"], att["out"]["kernel"])
  a = a + att["out"]["bias"]
  expected = a + ref.mlp_block(mh["Mlp"], ref.layer_norm(
      a, mh["LayerNorm"]["scale"], mh["LayerNorm"]["bias"]))
  np.testing.assert_allclose(ref.map_head(mh, tok)[0], expected, rtol=1e-10)
