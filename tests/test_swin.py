"""Swin / Swin-MoE against an independent NumPy reference (`naive_swin`).

Windows, relative positions, shift masks, one block, patch merging and the
whole dense model's logits are compared with loops written from the
reference implementation's semantics (microsoft/Swin-Transformer), on
random weights; plus stochastic depth, config errors and the MoE placement.
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import naive_swin as naive
from vmoe_ext.errors import ConfigError, field_scope
from vmoe_ext.models import build_model
from vmoe_ext.models import swin_window
from vmoe_ext.models.swin import PatchMerging, SwinBlock
from vmoe_ext.models.swin_attention import DropPath, log_spaced_offsets
from vmoe_ext.moe.contract import RoutingContext

ATOL = 2e-5


def _randomize(params, seed):
  """Every leaf replaced by random normals (kernels scaled by 1/sqrt(fan
  in), so activations stay O(1) and no softmax saturates), in float32; the
  naive reference reads the same float32 values in float64."""
  rng = np.random.RandomState(seed)

  def leaf(path, a):
    scale = 1.0
    if getattr(path[-1], "key", None) == "kernel":
      scale = 1.0 / math.sqrt(int(np.prod(a.shape[:-1])))
    return jnp.asarray(rng.normal(size=a.shape) * scale, jnp.float32)
  return jax.tree_util.tree_map_with_path(leaf, params)


def _np(tree):
  return jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64), tree)


# ---------------------------------------------------------------- windows ---

@pytest.mark.parametrize("h,w,m", [(8, 8, 4), (8, 12, 4), (6, 9, 3),
                                   (4, 4, 4)])
def test_window_partition_and_reverse_match_loops(h, w, m):
  x = np.random.RandomState(0).normal(size=(2, h, w, 3)).astype(np.float32)
  windows = np.asarray(swin_window.window_partition(jnp.asarray(x), m))
  np.testing.assert_array_equal(windows, naive.window_partition(x, m))
  back = np.asarray(swin_window.window_reverse(jnp.asarray(windows), m, h, w))
  np.testing.assert_array_equal(back, x)
  w_rand = np.random.RandomState(1).normal(
      size=windows.shape).astype(np.float32)
  np.testing.assert_array_equal(
      np.asarray(swin_window.window_reverse(jnp.asarray(w_rand), m, h, w)),
      naive.window_reverse(w_rand, m, h, w))


def test_cyclic_shift_matches_loops():
  x = np.random.RandomState(2).normal(size=(2, 8, 12, 3)).astype(np.float32)
  for s in (0, 2, 3):
    shifted = np.asarray(swin_window.cyclic_shift(jnp.asarray(x), s))
    np.testing.assert_array_equal(shifted, naive.cyclic_shift(x, s))
    np.testing.assert_array_equal(
        np.asarray(swin_window.cyclic_shift(jnp.asarray(shifted), -s)), x)


@pytest.mark.parametrize("m", [1, 2, 3, 7])
def test_relative_position_index_matches_pair_loop(m):
  index = swin_window.relative_position_index(m)
  assert index.shape == (m * m, m * m)
  np.testing.assert_array_equal(index, naive.relative_position_index(m))


@pytest.mark.parametrize("h,w,m,s", [(8, 8, 4, 2), (12, 8, 4, 2),
                                     (8, 12, 4, 2), (14, 14, 7, 3)])
def test_shift_attention_mask_matches_region_labels(h, w, m, s):
  np.testing.assert_array_equal(swin_window.shift_regions(h, w, m, s),
                                naive.shift_labels(h, w, m, s))
  mask = swin_window.shift_attention_mask(h, w, m, s)
  assert mask.shape == ((h // m) * (w // m), m * m, m * m)
  np.testing.assert_array_equal(mask, naive.shift_attention_mask(h, w, m, s))
  # Only the last window row / column mixes regions.
  assert (mask[0] == 0).all() and (mask[-1] != 0).any()


def test_shift_attention_mask_under_jit():
  """The mask is built while the model is traced (jit, eval_shape, the
  train step): it must be a trace-time constant."""
  mask = jax.jit(lambda z: z + swin_window.shift_attention_mask(8, 8, 4, 2))(
      jnp.zeros((4, 16, 16)))
  np.testing.assert_array_equal(np.asarray(mask),
                                naive.shift_attention_mask(8, 8, 4, 2))


@pytest.mark.parametrize("h,w,m,s,expect", [
    (8, 8, 4, 2, (4, 2)), (8, 8, 8, 4, (8, 0)), (4, 8, 7, 3, (4, 0)),
    (14, 14, 7, 3, (7, 3)), (16, 4, 4, 2, (4, 0))])
def test_stage_window(h, w, m, s, expect):
  assert swin_window.stage_window(h, w, m, s) == expect
  assert naive.stage_window(h, w, m, s) == expect


@pytest.mark.parametrize("m", [1, 2, 4, 7])
def test_log_spaced_offsets_match_loops(m):
  np.testing.assert_allclose(log_spaced_offsets(m),
                             naive.log_spaced_offsets(m), rtol=1e-6,
                             atol=1e-7)


# ------------------------------------------------------------- one block ---

BLOCK_CASES = {
    # name: (grid, window, shift, heads, position bias)
    "unshifted": ((8, 8), 4, 0, 2, "table"),
    "shifted": ((8, 8), 4, 2, 2, "table"),
    "shifted_nonsquare": ((8, 12), 4, 2, 2, "table"),
    "shifted_log_cpb": ((8, 8), 4, 2, 2, "log_cpb"),
}
BLOCK_C = 8


def _block(grid, window, shift, heads, kind, rate=0.0):
  return SwinBlock(num_heads=heads, grid=grid, window=window, shift=shift,
                   mlp_dim=2 * BLOCK_C, drop_path_rate=rate,
                   relative_position_bias=kind)


def _block_input(grid, batch=2, seed=3):
  return jnp.asarray(np.random.RandomState(seed).normal(
      size=(batch, grid[0] * grid[1], BLOCK_C)), jnp.float32)


def _block_params(module, x, seed):
  variables = module.init(jax.random.key(0), x, RoutingContext())
  return _randomize(variables["params"], seed)


@pytest.mark.parametrize("name", sorted(BLOCK_CASES))
def test_swin_block_matches_naive(name):
  grid, window, shift, heads, kind = BLOCK_CASES[name]
  module = _block(grid, window, shift, heads, kind)
  x = _block_input(grid)
  params = _block_params(module, x, seed=10)
  y, _, metrics = module.apply({"params": params}, x, RoutingContext())
  assert metrics is None
  want = naive.swin_block(_np(params), np.asarray(x), grid, window, shift,
                          heads, kind=kind)
  np.testing.assert_allclose(np.asarray(y), want, atol=ATOL, rtol=1e-5)
  if shift:  # The mask matters on these weights: dropping it is caught.
    unmasked = naive.swin_block(_np(params), np.asarray(x), grid, window,
                                shift, heads, kind=kind, use_mask=False)
    assert np.abs(unmasked - want).max() > 100 * ATOL


def test_patch_merging_matches_naive():
  grid, c = (4, 6), 3
  module = PatchMerging(grid)
  x = jnp.asarray(np.random.RandomState(4).normal(
      size=(2, grid[0] * grid[1], c)), jnp.float32)
  params = _randomize(module.init(jax.random.key(0), x)["params"], 11)
  assert params["reduction"]["kernel"].shape == (4 * c, 2 * c)
  assert "bias" not in params["reduction"]
  y = module.apply({"params": params}, x)
  assert y.shape == (2, 2 * 3, 2 * c)
  np.testing.assert_allclose(np.asarray(y),
                             naive.patch_merging(_np(params), np.asarray(x),
                                                 grid),
                             atol=ATOL, rtol=1e-5)


# ------------------------------------------------------------ stochastic ---

def test_drop_path_drops_whole_examples_with_scaling():
  grid, window, shift, heads = (4, 4), 4, 0, 2
  rate = 0.5
  x = _block_input(grid, batch=16, seed=5)
  module = _block(grid, window, shift, heads, "table", rate=rate)
  params = _block_params(module, x, seed=12)
  p, xn = _np(params), np.asarray(x)
  # deterministic=True: no drop (the same as a rate of 0).
  y_det, _, _ = module.apply({"params": params}, x, RoutingContext())
  want = naive.swin_block(p, xn, grid, window, shift, heads)
  np.testing.assert_allclose(np.asarray(y_det), want, atol=ATOL, rtol=1e-5)
  # Training: each example's attention and MLP branches are each either
  # dropped or kept and scaled by 1 / (1 - rate).
  y, _, _ = module.apply({"params": params}, x, RoutingContext(),
                         deterministic=False,
                         rngs={"dropout": jax.random.key(3)})
  y = np.asarray(y)
  keep = 1.0 / (1.0 - rate)
  combos = [(a, m) for a in (0.0, keep) for m in (0.0, keep)]
  outs = {c: naive.swin_block(p, xn, grid, window, shift, heads,
                              branch_scales=[c] * xn.shape[0])
          for c in combos}
  chosen = []
  for b in range(xn.shape[0]):
    hits = [c for c in combos
            if np.allclose(y[b], outs[c][b], atol=1e-4, rtol=1e-5)]
    assert len(hits) == 1, (b, hits)
    chosen.append(hits[0])
  attn_kept = {a for a, _ in chosen}
  mlp_kept = {m for _, m in chosen}
  assert attn_kept == {0.0, keep} and mlp_kept == {0.0, keep}, chosen


def test_drop_path_module_rate_zero_and_deterministic_are_identity():
  x = jnp.ones((64, 3, 2))
  for rate, det in ((0.0, False), (0.4, True)):
    y = DropPath(rate).apply({}, x, deterministic=det,
                             rngs={"dropout": jax.random.key(0)})
    np.testing.assert_array_equal(np.asarray(y), np.asarray(x))
  y = np.asarray(DropPath(0.4).apply({}, x, deterministic=False,
                                     rngs={"dropout": jax.random.key(0)}))
  per_example = y.reshape(64, -1)
  for row in per_example:  # whole examples: all 0 or all 1 / 0.6
    assert np.allclose(row, 0.0) or np.allclose(row, 1.0 / 0.6)
  assert 0 < np.isclose(per_example[:, 0], 0.0).sum() < 64


# ----------------------------------------------------------- whole model ---

DENSE = dict(name="swin", num_classes=5, patch_size=(2, 2), embed_dim=8,
             depths=(2, 2), num_heads=(2, 4), window_size=4,
             drop_path_rate=0.3)
# Stage 0: 8 x 8 tokens, shifted 4 x 4 windows in its second block; stage 1:
# 4 x 4, one window (min(4, 4) <= 4) without shift.
IMAGES = jnp.asarray(np.random.RandomState(6).uniform(size=(2, 16, 16, 3)),
                     jnp.float32)
# Stage 0: 8 x 16 tokens, shifted 4 x 4 windows (2 x 4 of them); stage 1:
# 4 x 8, window min(4, 8) = 4 without shift (2 windows).
IMAGES_WIDE = jnp.asarray(np.random.RandomState(7).uniform(
    size=(2, 16, 32, 3)), jnp.float32)
MODEL_CASES = {"table": ("table", IMAGES), "log_cpb": ("log_cpb", IMAGES),
               "table_nonsquare": ("table", IMAGES_WIDE)}


def _record_blocks(seen):
  """An interceptor recording each SwinBlock's resolved fields."""
  def record(next_fun, args, kwargs, context):
    module = context.module
    if isinstance(module, SwinBlock) and context.method_name == "__call__":
      seen[module.name] = (module.drop_path_rate, module.shift,
                           module.window, module.grid)
    return next_fun(*args, **kwargs)
  return record


@pytest.fixture(scope="module")
def dense_swin():
  """`case -> (config, model, random params, eager logits, block fields)`,
  each built once. Eager (not jitted) so the values are checked even while
  the model fails under `jit` (see `test_dense_swin_jits`)."""
  cache = {}

  def get(case):
    if case not in cache:
      kind, images = MODEL_CASES[case]
      config = dict(DENSE, relative_position_bias=kind)
      model = build_model(config)
      variables = model.init(jax.random.key(0), images)
      params = _randomize(variables["params"], 13)
      seen = {}
      with nn.intercept_methods(_record_blocks(seen)):
        logits, metrics = model.apply({"params": params}, images)
      assert float(metrics["auxiliary_loss"]) == 0.0
      cache[case] = (config, model, params, logits, seen)
    return cache[case]
  return get


def _naive_logits(config, params, images):
  fields = {k: config[k] for k in ("patch_size", "embed_dim", "depths",
                                   "num_heads", "window_size",
                                   "relative_position_bias")}
  return naive.swin_forward(_np(params), np.asarray(images), **fields)


@pytest.mark.parametrize("case", sorted(MODEL_CASES))
def test_dense_swin_logits_match_naive(dense_swin, case):
  config, _, params, logits, _ = dense_swin(case)
  want = _naive_logits(config, params, MODEL_CASES[case][1])
  assert want.shape == logits.shape == (2, 5)
  assert np.abs(want).max() > 0.1   # a random (not zero) head
  np.testing.assert_allclose(np.asarray(logits), want, atol=5e-5, rtol=1e-5)


def test_dense_swin_jits(dense_swin):
  """The jitted model (as training runs it) gives the reference logits."""
  config, model, params, _, _ = dense_swin("table")
  logits, _ = jax.jit(model.apply)({"params": params}, IMAGES)
  np.testing.assert_allclose(np.asarray(logits),
                             _naive_logits(config, params, IMAGES),
                             atol=5e-5, rtol=1e-5)


def test_drop_path_rates_follow_linspace_over_all_blocks(dense_swin):
  _, _, _, _, seen = dense_swin("table")
  rates = naive.drop_path_rates(DENSE["drop_path_rate"], DENSE["depths"])
  assert rates == pytest.approx([0.0, 0.1, 0.2, 0.3])
  # (rate, shift, window, grid) of each block.
  want = {f"encoderblock_{i}": (rates[i],) + geometry for i, geometry in
          enumerate([(0, 4, (8, 8)), (2, 4, (8, 8)), (0, 4, (4, 4)),
                     (0, 4, (4, 4))])}
  assert sorted(seen) == sorted(want)
  for name, (rate, *geometry) in want.items():
    assert seen[name][0] == pytest.approx(rate), name
    assert list(seen[name][1:]) == geometry, name
  _, _, _, _, wide = dense_swin("table_nonsquare")
  assert [wide[f"encoderblock_{i}"][1:] for i in range(4)] == [
      (0, 4, (8, 16)), (2, 4, (8, 16)), (0, 4, (4, 8)), (0, 4, (4, 8))]


def test_model_drop_path_is_stochastic_only_in_training(dense_swin):
  _, model, params, det, _ = dense_swin("table")
  train = [model.apply({"params": params}, IMAGES, deterministic=False,
                       rngs={"dropout": jax.random.key(k)})[0]
           for k in range(3)]
  assert any(not np.allclose(t, det, atol=1e-4) for t in train)
  train0, _ = model.clone(drop_path_rate=0.0).apply(
      {"params": params}, IMAGES, deterministic=False,
      rngs={"dropout": jax.random.key(0)})
  np.testing.assert_allclose(np.asarray(train0), np.asarray(det), atol=1e-6)


# --------------------------------------------------------- config errors ---

def _error(fn):
  with pytest.raises(ConfigError) as info:
    fn()
  return info.value


def test_window_that_does_not_tile_a_stage_names_window_size():
  model = build_model(dict(DENSE, window_size=5))   # 24x24 / 2 -> 12x12
  def check():
    with field_scope("model"):
      model.check_image_size((24, 24))
  e = _error(check)
  assert e.field == "model.window_size"
  assert "12x12" in str(e)
  e = _error(lambda: model.init(jax.random.key(0),
                               jnp.zeros((1, 24, 24, 3))))
  assert e.field.endswith("window_size")
  model.check_image_size((20, 20))   # 10x10 (window 5), 5x5 (one window)


def test_grid_that_cannot_be_merged_names_patch_size():
  model = build_model(dict(DENSE, depths=(1, 1, 1), num_heads=(1, 1, 1),
                           window_size=3))
  model.check_image_size((24, 24))   # 12x12, 6x6, 3x3
  with pytest.raises(ConfigError, match="merged") as info:
    with field_scope("model"):
      model.check_image_size((12, 12))   # 6x6, 3x3, (3x3 cannot merge)
  assert info.value.field == "model.patch_size"
  with pytest.raises(ConfigError, match="divide") as info:
    with field_scope("model"):
      model.check_image_size((15, 16))
  assert info.value.field == "model.patch_size"


@pytest.mark.parametrize("changes,field", [
    (dict(num_heads=(2, 3)), "model.num_heads[1]"),
    (dict(num_heads=(2,)), "model.num_heads"),
    (dict(relative_position_bias="cpb"), "model.relative_position_bias"),
    (dict(name="swin_moe", moe=dict(num_experts=2),
          moe_blocks=[[-1], [2]]), "model.moe_blocks[1]"),
    (dict(name="swin_moe", moe=dict(num_experts=2, layers=(1,)),
          moe_blocks=[[-1], [1]]), "model.moe.layers"),
    (dict(name="swin_moe", moe=dict(num_experts=2, every=2),
          moe_blocks=[[-1], [1]]), "model.moe.every"),
    (dict(name="swin_moe", moe=dict(num_experts=2),
          moe_blocks=[[-1], [-1]]), "model.moe_blocks"),
    (dict(name="swin_moe", moe_blocks=[[-1], [1]]), "model.moe"),
    (dict(moe=dict(num_experts=2), moe_blocks=[[-1], [1]]), "model.moe"),
    (dict(moe_blocks=[[-1], [1]]), "model.moe"),
])
def test_config_errors_name_the_field(changes, field):
  e = _error(lambda: build_model(dict(DENSE, **changes)))
  assert e.field == field, str(e)
  assert str(e).startswith(field + ":")


# ------------------------------------------------------------ placement ---

def test_swin_moe_placement_and_token_grids():
  model = build_model(dict(DENSE, name="swin_moe", moe_blocks=[[-1], [0, 1]],
                           moe=dict(num_experts=2)))
  assert model.moe_stages == ((), (2, 3))
  assert model.moe_layers == (2, 3)
  assert model.num_layers == 4
  assert [model.token_grid(b, (16, 16)) for b in range(4)] == [
      (8, 8, 0), (8, 8, 0), (4, 4, 0), (4, 4, 0)]
  assert [model.token_grid(b, (16, 32)) for b in range(4)] == [
      (8, 16, 0), (8, 16, 0), (4, 8, 0), (4, 8, 0)]
  # window 8: no shifted block, so `eval_shape` traces it (see
  # `test_dense_swin_jits` for shifted blocks under tracing).
  shapes = jax.eval_shape(model.clone(window_size=8).init,
                          {"params": jax.random.key(0),
                           "gating": jax.random.key(1)}, IMAGES)
  params = shapes["params"]
  assert "Mlp" in params["encoderblock_0"] and "Mlp" in params[
      "encoderblock_1"]
  assert "Moe" in params["encoderblock_2"] and "Moe" in params[
      "encoderblock_3"]
