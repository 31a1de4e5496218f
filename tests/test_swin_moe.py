"""Swin-MoE (docs/models.md, "Swin"): the library's routers and streams inside
a Swin, against the dense Swin and against the base router; the ACMoE
authors' per-stage placement; the routing analysis on a Swin's stages; the
run assembly's checks; kill-and-resume.

The dense Swin itself is checked against a NumPy forward in test_swin.py.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from resume_check import short_schedule, straight_vs_resumed
from vmoe_ext.errors import ConfigError
from vmoe_ext.evaluate.routing_analysis import analyze_routing
from vmoe_ext.models import build_model
from vmoe_ext.routers.acmoe import resolve_ac_stages
from vmoe_ext.train.config_files import load_config
from vmoe_ext.train.forward import moe_intermediates

IMAGES = jax.random.uniform(jax.random.key(0), (4, 8, 8, 1))
# Stage 0: 8 x 8 tokens, windows of 4, block 1 shifted (MoE); stage 1:
# 4 x 4 tokens, one window, blocks 2 and 3 (MoE).
MOE_BLOCKS = ((1,), (0, 1))
SWIN_MOE = dict(name="swin_moe", num_selected=2, gate_noise=1.0)
TOPK = dict(name="noisy_topk", num_selected=2, noise_std=1.0)


def swin(router=None, stream=None, name="swin_moe", **model):
  cfg = dict(name=name, num_classes=4, patch_size=(1, 1), embed_dim=8,
             depths=(2, 2), num_heads=(2, 2), window_size=4, mlp_ratio=2.0,
             drop_path_rate=0.1, stream=stream, **model)
  if router is not None:
    cfg.update(moe_blocks=MOE_BLOCKS, moe=dict(
        num_experts=4, capacity_factor=2.0, group_size=None, router=router))
  return cfg


ROUTERS = {
    "noisy_topk": TOPK,
    "swin_moe": SWIN_MOE,
    "xmoe": dict(name="cosine", num_selected=2, projection_dim=4,
                 temperature=0.07, noise_std=0.0),
    "top_p": dict(name="top_p", num_selected=3, threshold=0.2),
    "expert_choice": dict(name="expert_choice"),
    "acmoe_swin": dict(name="acmoe", normalization="swin", base=SWIN_MOE),
    "symphony": dict(name="symphony", base=SWIN_MOE),
    "acmoe_symphony": dict(name="symphony", base=dict(
        name="acmoe", normalization="swin", base=SWIN_MOE)),
}
STREAMS = {"momentum": dict(name="momentum", mu=0.8, gamma=1.0)}
# ACMoE + Symphony covers both wrappers (and ACMoE's placement is checked
# against its base below); XMoE's forward inside Swin is the dense
# equivalence test's; the other streams share the momentum stream's
# per-stage restart (`mlp_sublayer`, `STREAMS.init_state` per stage).
CASES = [(r, None) for r in ("noisy_topk", "top_p", "expert_choice",
                             "acmoe_symphony")] + [("swin_moe", "momentum")]


@pytest.mark.parametrize("router,stream", CASES,
                         ids=[f"{r}-{s}" for r, s in CASES])
def test_router_and_stream_train_inside_swin_moe(router, stream):
  """A training-mode step of every router (and stream) on the Swin's two
  stages: the MoE inputs have each stage's tokens, every MoE block reports
  its metrics, the gradient reaches every MoE block's experts and router,
  and the persistent router state updates."""
  model = build_model(swin(ROUTERS[router], stream and STREAMS[stream],
                           head_kernel_zero_init=False))
  variables = model.init(jax.random.key(1), IMAGES)
  rngs = {"gating": jax.random.key(2), "dropout": jax.random.key(3)}

  def loss(params):
    (logits, metrics), new = model.apply(
        {**variables, "params": params}, IMAGES, deterministic=False,
        update_state=True, rngs=rngs,
        mutable=["router_state", "intermediates"])
    return jnp.mean(logits ** 2) + metrics["auxiliary_loss"], (metrics, new)

  grads, (metrics, new) = jax.jit(jax.grad(loss, has_aux=True))(
      variables["params"])
  assert sorted(k for k in metrics if k.startswith("layer_")) == [
      "layer_1", "layer_2", "layer_3"]
  assert np.isfinite(float(metrics["auxiliary_loss"]))
  moe = moe_intermediates(new["intermediates"])
  assert {b: m["moe_input"].shape for b, m in moe.items()} == {
      "encoderblock_1": (4, 64, 8), "encoderblock_2": (4, 16, 16),
      "encoderblock_3": (4, 16, 16)}
  for block in (1, 2, 3):
    g = grads[f"encoderblock_{block}"]["Moe"]
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(g))
    assert float(jnp.abs(g["Mlp"]["Dense_0"]["kernel"]).max()) > 0
    if router != "expert_choice" or block == 1:  # Some router has params.
      assert any(float(jnp.abs(x).max()) > 0
                 for x in jax.tree.leaves(g["router"])), block
  if "symphony" in router:
    before = jax.tree.leaves(variables["router_state"])
    after = jax.tree.leaves(new["router_state"])
    assert len(after) == 3
    assert any(not np.allclose(a, b) for a, b in zip(before, after))


def _experts_from_dense(moe_params, dense_params):
  """The Swin-MoE params whose experts are all the dense MLP (and whose
  other params are the dense Swin's)."""
  out = jax.tree.map(lambda x: x, moe_params)
  for name, block in dense_params.items():
    if "Moe" not in moe_params.get(name, {}):
      out[name] = block
      continue
    out[name] = {**block, "Moe": dict(moe_params[name]["Moe"])}
    del out[name]["Mlp"]
    e = moe_params[name]["Moe"]["Mlp"]["Dense_0"]["kernel"].shape[0]
    out[name]["Moe"]["Mlp"] = jax.tree.map(
        lambda d: jnp.broadcast_to(d, (e,) + d.shape), block["Mlp"])
  return out


@pytest.mark.parametrize("router,dispatcher", [
    (dict(SWIN_MOE, normalize_gate=True), "indices"),
    (dict(SWIN_MOE, normalize_gate=True), "einsum"),
    (dict(TOPK, renormalize_gates=True), "indices"),
    (dict(ROUTERS["xmoe"], renormalize_gates=True), "indices"),
])
def test_swin_moe_with_copies_of_the_dense_mlp_equals_the_dense_swin(
    router, dispatcher):
  """Every expert a copy of the dense MLP, the K gates renormalised to sum
  to 1 and room for every token: the Swin-MoE computes the dense Swin's
  logits, whatever the router picks and with either dispatcher (the MoE blocks are wired as the dense
  blocks are: norm, residual, stochastic depth, stages)."""
  dense = build_model(swin(name="swin", head_kernel_zero_init=False))
  config = swin(router, head_kernel_zero_init=False)
  config["moe"]["dispatcher"] = dispatcher
  moe_model = build_model(config)
  dense_vars = dense.init(jax.random.key(4), IMAGES)
  moe_vars = moe_model.init(jax.random.key(5), IMAGES)
  params = _experts_from_dense(moe_vars["params"], dense_vars["params"])
  want = dense.apply(dense_vars, IMAGES)[0]
  got, metrics = moe_model.apply({**moe_vars, "params": params}, IMAGES)
  assert float(jnp.abs(want).max()) > 0.1
  for block in (1, 2, 3):
    assert float(metrics[f"layer_{block}"]["drop_rate"]) == 0.0
  np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)


def test_acmoe_places_ac_layers_per_stage_as_the_authors_swin():
  """The release's Swin-MoE-S: MoE blocks [[-1], [-1], [1, 3, ..., 17],
  [1]]; the ACMoE authors' COSA_POSITIONS are [3, 5, ..., 17] of stage 2:
  every MoE block of a stage but its first (the previous assignment
  restarts with each stage), none in a stage with one MoE block."""
  stage2 = tuple(4 + b for b in range(1, 18, 2))
  assert resolve_ac_stages("full", ((), (), stage2, (23,))) == stage2[1:]
  assert resolve_ac_stages((7, 9), ((), (), stage2, (23,))) == (7, 9)
  with pytest.raises(ConfigError, match="first MoE layer of its stage") as e:
    resolve_ac_stages((5, 23), ((), (), stage2, (23,)))
  assert e.value.field == "router.layers"
  with pytest.raises(ConfigError, match="no AC layer in any stage"):
    resolve_ac_stages("full", ((1,), (23,)))
  # In a model: the first MoE block of stage 1 (block 2) is no AC layer.
  bad = swin(dict(ROUTERS["acmoe_swin"], layers=(2, 3)))
  with pytest.raises(ConfigError, match="first MoE layer of its stage") as e:
    build_model(bad)
  assert e.value.field == "model.moe.router.layers"
  one_each = swin(ROUTERS["acmoe_swin"])
  one_each["moe_blocks"] = ((1,), (1,))
  with pytest.raises(ConfigError, match="no AC layer in any stage") as e:
    build_model(one_each)
  assert e.value.field == "model.moe.router.layers"


def _without_base(params):
  """ACMoE's params (`router/base/...`) as its base router's."""
  flat = {"/".join(str(k.key) for k in p): v for p, v in
          jax.tree_util.tree_flatten_with_path(params)[0]}
  out = {}
  for path, v in flat.items():
    node = out
    keys = path.replace("/router/base/", "/router/").split("/")
    for k in keys[:-1]:
      node = node.setdefault(k, {})
    node[keys[-1]] = v
  return out


def test_acmoe_in_swin_routes_as_its_base_until_its_ac_layer():
  """ACMoE (swin preset) and its base router on the same weights: blocks
  1 (stage 0) and 2 (the first MoE block of stage 1) route alike — the
  context restarts at the stage, so block 2 has no previous assignment —
  and block 3, the AC layer, routes the rescaled tokens."""
  ac = build_model(swin(ROUTERS["acmoe_swin"]))
  base = build_model(swin(SWIN_MOE))
  v = ac.init(jax.random.key(6), IMAGES)
  v["params"]["head"]["kernel"] = jax.random.normal(
      jax.random.key(7), v["params"]["head"]["kernel"].shape)
  run = lambda m, p: m.apply({"params": p}, IMAGES,
                             mutable=["intermediates"])
  (got_logits, got), sown = run(ac, v["params"])
  (want_logits, want), _ = run(base, _without_base(v["params"]))
  for block in ("layer_1", "layer_2"):
    for name, value in want[block].items():
      np.testing.assert_array_equal(got[block][name], value,
                                    err_msg=f"{block}/{name}")
  # Block 3 sees the same tokens, routes them otherwise.
  assert abs(float(got["layer_3"]["importance_loss"])
             - float(want["layer_3"]["importance_loss"])) > 1e-6
  assert float(jnp.abs(got_logits - want_logits).max()) > 1e-4
  assert moe_intermediates(sown["intermediates"])["encoderblock_3"][
      "moe_input"].shape == (4, 16, 16)


def test_routing_analysis_maps_each_stage_to_its_grid():
  """Expert maps per stage grid (8 x 8 for block 1, 4 x 4 for blocks 2 and
  3), equal to the model's own top-1 experts; instability only between the
  MoE layers of one stage; a token sample per layer."""
  model = build_model(swin(dict(SWIN_MOE, num_selected=1)))
  variables = model.init(jax.random.key(8), IMAGES)
  batches = [{"image": np.asarray(IMAGES), "mask": np.ones(4, bool)}]
  analysis = analyze_routing(model, variables, batches, map_examples=(0, 2),
                             num_tokens=10)
  assert {l: m.shape for l, m in analysis.maps.items()} == {
      "layer_1": (2, 8, 8), "layer_2": (2, 4, 4), "layer_3": (2, 4, 4)}
  sown = moe_intermediates(model.apply(variables, IMAGES,
                                       mutable=["intermediates"])[1][
                                           "intermediates"])
  for block, (h, w) in ((1, (8, 8)), (2, (4, 4)), (3, (4, 4))):
    top1 = np.argmax(np.asarray(sown[f"encoderblock_{block}"]
                                ["expert_mask"]), -1)
    np.testing.assert_array_equal(analysis.maps[f"layer_{block}"],
                                  top1[[0, 2]].reshape(2, h, w))
  assert "layer_3/instability" in analysis.metrics
  assert "layer_2/instability" not in analysis.metrics
  assert {l: len(t) for l, t in analysis.sample.tokens.items()} == {
      "layer_1": 10, "layer_2": 10, "layer_3": 10}
  assert analysis.sample.tokens["layer_1"].shape[1] == 8
  assert analysis.sample.tokens["layer_3"].shape[1] == 16


def _digits_swin(router):
  c = load_config("tiny")
  c.model = ml_collections.ConfigDict(swin(router))
  c.model.num_classes = 10
  c.model.moe.group_size = None
  return c


def test_the_run_assembly_rejects_windows_that_do_not_tile_the_data():
  """digits are 8 x 8: windows of 3 do not tile stage 0's 8 x 8 tokens;
  the error names the field before anything compiles."""
  from vmoe_ext.app import train as loop
  c = _digits_swin(SWIN_MOE)
  c.model.window_size = 3
  with pytest.raises(ConfigError, match=re.escape("model.window_size")):
    loop.train_and_evaluate(c, "/nonexistent/never_written")


def test_checkpoint_resume_bit_identical(tmp_path):
  """Stop after step 2 of 4 and resume: params and the Symphony graphs of
  every stage equal the uninterrupted run's, bit for bit (drop path and
  gate noise draw from the step's rngs)."""
  def config():
    c = _digits_swin(ROUTERS["acmoe_symphony"])
    c.robustness = None
    c.optimizer = ml_collections.ConfigDict(dict(
        name="sgd", learning_rate=0.1, momentum=0.9, warmup_steps=1,
        decay="cosine", total_steps=4))
    return short_schedule(c, total_steps=4)

  _, state = straight_vs_resumed(config, tmp_path, stop_at_step=2)
  graphs = jax.tree.leaves(state.collections)
  assert len(graphs) == 3 and all(float(jnp.abs(g).sum()) > 0
                                  for g in graphs)
