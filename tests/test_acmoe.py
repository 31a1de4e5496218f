"""ACMoE: the AC transform, the router over every base, placement, SoftMoE.

References are independent: `naive.ac_cluster_weights` / `ac_token_scales`
(per-cluster, per-feature loops in float64) with the preset table copied
from docs/routers.md ("`acmoe`") below (not from the implementation's
`PRESETS`), NumPy router scores, and `naive.soft_moe` / `token_choice_moe` for layer outputs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import naive
from vmoe_ext.errors import ConfigError
from vmoe_ext.models import build_model
from vmoe_ext.moe import MoeLayer
from vmoe_ext.moe.contract import Assignment, LayerRecord, RoutingContext
from vmoe_ext.routers import adaptive_clustering as ac
from vmoe_ext.routers import build_router
from vmoe_ext.routers.acmoe import resolve_ac_layers

# docs/routers.md, "`acmoe`": (eps, clamp, mean) of each preset's MAD form and
# variance form.
TABLE = {
    ("paper", "mad"): (1e-4, None, "cluster"),
    ("paper", "variance"): (1e-4, None, "cluster"),
    ("language", "mad"): (1e-4, 10.0, "feature"),
    ("language", "variance"): (0.1, None, "none"),
    ("swin", "mad"): (1e-4, 1.5, "global_pre_clamp"),
    ("swin", "variance"): (1e-4, 10.0, "global_pre_clamp"),
    ("softmoe", "mad"): (0.35, 5.0, "global_post_clamp"),
    ("softmoe", "variance"): (1e-4, 10.0, "global_pre_clamp"),
}
E, D = 4, 5


def _previous(rng, n, k, e=E, invalid=True):
  """A previous layer's assignment `[N, K]`: cluster 3 empty (as top-1),
  cluster 2 a single token, some later entries invalid."""
  top1 = rng.choice([0, 1], size=n)
  top1[4] = 2
  idx = np.stack([top1] + [rng.integers(0, e, size=n) for _ in range(k - 1)],
                 axis=1).astype(np.int32)
  gates = rng.uniform(0.05, 1.0, size=(n, k)).astype(np.float32)
  valid = np.ones((n, k), bool)
  if invalid and k > 1:
    valid[::3, k - 1] = False
  return idx, gates, valid


def _ctx(idx, gates, valid, b, t, e=E, d=D, block=1, moe_blocks=()):
  k = idx.shape[-1]
  assignment = Assignment(jnp.asarray(idx).reshape(b, t, k),
                          jnp.asarray(gates).reshape(b, t, k),
                          jnp.asarray(valid).reshape(b, t, k))
  record = LayerRecord(assignment, None, block=block - 1,
                       num_experts=e, width=d)
  return RoutingContext(block=block, records=(record,),
                        moe_blocks=moe_blocks)


@pytest.mark.parametrize("data", ["edge", "clamp"])
@pytest.mark.parametrize("preset,dispersion", sorted(TABLE))
def test_scaling_of_every_preset_matches_the_naive_loop(rng, preset,
                                                        dispersion, data):
  """"edge": an empty cluster and a cluster of one token (dispersion 0, so
  weights 1/eps); "clamp": every cluster populated, one feature of cluster 0
  constant, so that 1/eps exceeds the clamp and the clamp binds."""
  n = 13
  tokens = rng.normal(size=(n, D)).astype(np.float32)
  idx, gates, valid = _previous(rng, n, 1)
  if data == "clamp":
    idx[:, 0] = np.arange(n) % E
    tokens *= 10.0  # Spread ~8: 1/(s+0.35) is far below 1/0.35.
    tokens[idx[:, 0] == 0, 2] = 0.5
  opts = ac.resolve_options(preset, dispersion, mix_k=1)
  eps, clamp, mean = TABLE[preset, dispersion]
  assert (opts.eps, opts.clamp, opts.mean) == (eps, clamp, mean)
  got = ac.adaptive_scales(jnp.asarray(tokens), jnp.asarray(idx),
                           jnp.asarray(gates), jnp.asarray(valid),
                           num_clusters=E, opts=opts)
  w = naive.ac_cluster_weights(tokens, idx[:, 0], E, dispersion, eps, clamp,
                               mean)
  expected = naive.ac_token_scales(w, idx, gates, valid, 1, "renormalized")
  np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-5)
  if clamp is not None and data == "clamp":  # The clamp binds.
    raw = naive.ac_cluster_weights(tokens, idx[:, 0], E, dispersion, eps,
                                   None, "none")
    assert raw.max() > clamp * raw.mean()


@pytest.mark.parametrize("k,mix_k,weights", [
    (2, 2, "renormalized"), (3, 2, "raw"), (3, 3, "renormalized"),
    (3, 3, "raw"), (8, 8, "slot_softmax")])
def test_mix_k_matches_the_naive_loop(rng, k, mix_k, weights):
  n = 11
  tokens = rng.normal(size=(n, D)).astype(np.float32)
  idx, gates, valid = _previous(rng, n, k)
  opts = ac.resolve_options("swin", mix_k=mix_k, mix_weights=weights)
  got = ac.adaptive_scales(jnp.asarray(tokens), jnp.asarray(idx),
                           jnp.asarray(gates), jnp.asarray(valid),
                           num_clusters=E, opts=opts)
  w = naive.ac_cluster_weights(tokens, idx[:, 0], E, "mad", 1e-4, 1.5,
                               "global_pre_clamp")
  expected = naive.ac_token_scales(w, idx, gates, valid, mix_k, weights)
  np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-5)


@pytest.mark.parametrize("dispersion", ["mad", "variance"])
def test_causal_scaling_is_the_naive_loop_over_each_prefix(rng, dispersion):
  """`causal_adaptive_scales`: position t of every row is scaled by the
  naive statistics of the tokens at positions <= t of all rows (an empty
  cluster, clusters of one token early on, invalid second choices, the
  language preset's clamp and Mix-2)."""
  g, s, k = 3, 5, 2
  tokens = rng.normal(size=(g * s, D)).astype(np.float32)
  idx, gates, valid = _previous(rng, g * s, k)
  opts = ac.resolve_options("language", dispersion, mix_k=2)
  got = np.asarray(ac.causal_adaptive_scales(
      jnp.asarray(tokens.reshape(g, s, D)),
      jnp.asarray(idx.reshape(g, s, k)), jnp.asarray(gates.reshape(g, s, k)),
      jnp.asarray(valid.reshape(g, s, k)), num_clusters=E,
      opts=opts)).reshape(g * s, D)
  position = np.tile(np.arange(s), g)
  for t in range(s):
    seen = position <= t
    top1 = np.where(valid[seen, 0], idx[seen, 0], -1)
    w = naive.ac_cluster_weights(tokens[seen], top1, E, dispersion,
                                 opts.eps, opts.clamp, opts.mean)
    now = position == t
    expected = naive.ac_token_scales(w, idx[now], gates[now], valid[now], 2,
                                     opts.mix_weights)
    np.testing.assert_allclose(got[now], expected, rtol=2e-5, atol=1e-6)


def test_no_gradient_through_the_scaling(rng):
  tokens = jnp.asarray(rng.normal(size=(9, D)), jnp.float32)
  idx, gates, valid = _previous(rng, 9, 2)
  opts = ac.resolve_options("paper", mix_k=2)
  grad = jax.jit(jax.grad(lambda t: jnp.sum(ac.adaptive_scales(
      t, jnp.asarray(idx), jnp.asarray(gates), jnp.asarray(valid),
      num_clusters=E, opts=opts) * jnp.arange(D))))(tokens)
  np.testing.assert_array_equal(np.asarray(grad), 0.0)


def _linear_reference(x, m, kernel, k):
  logits = (np.asarray(x, np.float64) * m) @ np.asarray(kernel, np.float64)
  probs = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
  top = np.argsort(-probs, axis=-1, kind="stable")[..., :k]
  return probs, top


@pytest.mark.parametrize("preset", ["paper", "language", "swin"])
@pytest.mark.parametrize("base", ["noisy_topk", "cosine", "cosine_lm"])
def test_router_scores_and_top_k_match_the_loop(rng, preset, base):
  b, t = 2, 6
  x = rng.normal(size=(b, t, D)).astype(np.float32)
  idx, gates, valid = _previous(rng, b * t, 2)
  ctx = _ctx(idx, gates, valid, b, t)
  router = build_router({"name": "acmoe", "normalization": preset,
                         "base": {"name": base, "num_selected": 2}}, E)
  xg = jnp.asarray(x).reshape(3, 4, D)
  variables = jax.jit(lambda k: router.init(k, xg, ctx, capacity=8,
                                            deterministic=True))(
      jax.random.key(0))
  out = jax.jit(lambda v: router.apply(v, xg, ctx, capacity=8,
                                       deterministic=True))(variables)
  eps, clamp, mean = TABLE[preset, "mad"]
  w = naive.ac_cluster_weights(x.reshape(-1, D), idx[:, 0], E, "mad", eps,
                               clamp, mean)
  m = naive.ac_token_scales(w, idx, gates, valid, 1, "renormalized")
  h = x.reshape(-1, D).astype(np.float64) * m
  p = variables["params"]["base"]
  if base == "noisy_topk":
    logits = h @ np.asarray(p["logits"]["dense"]["kernel"], np.float64)
  else:
    emb = np.asarray(p["embeddings"], np.float64)
    emb = emb / np.maximum(np.linalg.norm(emb, axis=-1, keepdims=True), 1e-4)
    if base == "cosine":
      h = h @ np.asarray(p["projection"], np.float64)
      h = h / np.maximum(np.linalg.norm(h, axis=-1, keepdims=True), 1e-4)
    logits = h @ emb.T / (float(p["temperature"]) if base == "cosine" else 1)
  probs = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
  top = np.argsort(-probs, axis=-1, kind="stable")[:, :2]
  expected_gates = np.take_along_axis(probs, top, -1)
  if base == "cosine_lm":  # softmax(top-K logits)
    expected_gates /= expected_gates.sum(-1, keepdims=True)
  routing = out.routing
  np.testing.assert_array_equal(
      np.asarray(routing.expert_indices).reshape(-1, 2), top)
  np.testing.assert_allclose(np.asarray(routing.gates).reshape(-1, 2),
                             expected_gates, rtol=2e-5, atol=1e-6)
  if preset == "swin":  # Scaled tokens go to the experts too.
    np.testing.assert_allclose(np.asarray(out.expert_inputs).reshape(-1, D),
                               h if base == "noisy_topk" else
                               x.reshape(-1, D) * m, rtol=1e-5, atol=1e-6)
  else:
    assert out.expert_inputs is None


def _ac_layer(router_cfg, dispatcher="indices", group_size=4, cf=4.0):
  return MoeLayer(router=build_router(router_cfg, E), hidden_size=6,
                  group_size=group_size, capacity_factor=cf,
                  dispatcher=dispatcher)


def test_statistics_are_the_whole_batch_not_per_group(rng):
  """Groups of 4 tokens and one group of all 12 give the same layer output
  (no token dropped), so the statistic is one for the batch."""
  b, t = 2, 6
  x = jnp.asarray(rng.normal(size=(b, t, D)), jnp.float32)
  idx, gates, valid = _previous(rng, b * t, 2)
  ctx = _ctx(idx, gates, valid, b, t)
  cfg = {"name": "acmoe", "normalization": "swin",
         "base": {"name": "noisy_topk", "num_selected": 2}}
  grouped, whole = _ac_layer(cfg, group_size=4), _ac_layer(cfg, group_size=12)
  variables = jax.jit(lambda k: grouped.init(k, x, ctx))(jax.random.key(1))
  y4, _, _ = jax.jit(lambda v: grouped.apply(v, x, ctx))(variables)
  y12, _, _ = jax.jit(lambda v: whole.apply(v, x, ctx))(variables)
  np.testing.assert_allclose(np.asarray(y4), np.asarray(y12), rtol=1e-6,
                             atol=1e-7)
  # Per-group statistics would differ: the groups' own MADs are not the
  # batch's (a check that the comparison above can fail).
  tokens = np.asarray(x).reshape(-1, D)
  per_group = naive.ac_cluster_weights(tokens[:4], idx[:4, 0], E, "mad",
                                       1e-4, 1.5, "global_pre_clamp")
  batch = naive.ac_cluster_weights(tokens, idx[:, 0], E, "mad", 1e-4, 1.5,
                                   "global_pre_clamp")
  assert not np.allclose(per_group, batch, rtol=1e-3)


def _tiny_model(router, **kw):
  return build_model(dict(
      name="vit_moe", num_classes=3, patch_size=(4, 4), hidden_size=8,
      num_layers=3, num_heads=2, mlp_dim=8,
      moe=dict(layers=(0, 2), num_experts=E, capacity_factor=4.0,
               group_size=None, router=router), **kw))


def test_data_parallel_statistics_equal_one_device():
  """Two vmapped shards reduce the statistic over the data axis: logits equal
  the single-device run (and differ without the reduction)."""
  router = {"name": "acmoe", "normalization": "swin",
            "base": {"name": "noisy_topk", "num_selected": 2}}
  images = jax.random.uniform(jax.random.key(0), (4, 8, 8, 1))
  single = _tiny_model(router)
  variables = jax.jit(single.init)(jax.random.key(1), images)
  variables = jax.jit(lambda t: jax.tree.map(
      lambda v: v + 0.3 * jax.random.normal(jax.random.key(2), v.shape),
      t))(variables)  # Non-zero head.
  logits, _ = jax.jit(single.apply)(variables, images)
  shards = images.reshape(2, 2, 8, 8, 1)
  for axis_name, equal in (("data", True), (None, False)):
    model = _tiny_model(router, state_axis_name=axis_name)
    out = jax.jit(jax.vmap(lambda x, m=model: m.apply(variables, x)[0],
                           axis_name="data"))(shards)
    close = np.allclose(np.asarray(out).reshape(logits.shape),
                        np.asarray(logits), rtol=1e-5, atol=1e-6)
    assert close == equal, axis_name


def test_statistics_reduced_over_many_devices_keep_small_clusters():
  """The mean over 8 devices of a cluster's count can be below 1 (a cluster
  of 3 tokens, all on one device): its dispersion must still be the global
  one (regression: the denominator was clamped at 1 after the mean)."""
  rng = np.random.default_rng(0)
  tokens = jnp.asarray(rng.normal(size=(12, 5)), jnp.float32)
  clusters = jnp.asarray([0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, -1])
  want, _ = ac.cluster_dispersion(tokens, clusters, 3, "mad")
  # One device holds every token; seven hold none: pmean = sum / 8.
  got, counts = ac.cluster_dispersion(tokens, clusters, 3, "mad",
                                      reduce=lambda v: v / 8)
  np.testing.assert_allclose(counts, [3 / 8, 1, 0])
  np.testing.assert_allclose(got, want, rtol=1e-6)
  cluster0 = np.asarray(tokens)[:3]
  np.testing.assert_allclose(
      got[0], np.abs(cluster0 - cluster0.mean(0)).mean(0), rtol=1e-5)


def test_placement_presets_match_the_paper():
  # Switch: 6 MoE layers (paper layers 1..6 = blocks 0..5).
  switch = tuple(range(6))
  assert resolve_ac_layers("full", switch) == (1, 2, 3, 4, 5)
  assert resolve_ac_layers("skip1", switch) == (2, 3, 4, 5)
  assert resolve_ac_layers("alternating", switch) == (1, 3, 5)
  assert resolve_ac_layers("back_half", switch) == (3, 4, 5)
  # Swin's depth-18 stage: MoE on paper layers 2, 4, ..., 18 (blocks 1..17).
  swin = tuple(range(1, 18, 2))
  paper = {"full": (4, 6, 8, 10, 12, 14, 16, 18),
           "skip1": (6, 8, 10, 12, 14, 16, 18),
           "skip2": (8, 10, 12, 14, 16, 18), "alternating": (4, 8, 12, 16),
           "back_half": (10, 12, 14, 16, 18)}  # "the last 5 layers"
  for preset, layers in paper.items():
    assert resolve_ac_layers(preset, swin) == tuple(l - 1 for l in layers)
  assert resolve_ac_layers([3, 5], swin) == (3, 5)


@pytest.mark.parametrize("preset,placement", [
    ("paper", (1, 2, 3, 4, 5)), ("language", (2, 3, 4, 5)),
    ("swin", (1, 2, 3, 4, 5)), ("softmoe", (1, 2, 3, 4, 5))])
def test_placement_defaults_to_where_the_authors_runs_put_it(preset,
                                                             placement):
  """docs/routers.md, `layers` "preset": LM code from the 3rd of 6 MoE
  layers; Swin, SoftMoE (and the paper's Definition 2) from the 2nd."""
  base = {"name": "soft"} if preset == "softmoe" else {"name": "noisy_topk"}
  router = build_router({"name": "acmoe", "normalization": preset,
                         "base": base}, E)
  ctx = RoutingContext(moe_blocks=tuple(range(6)))
  assert tuple(b for b in range(6)
               if router.is_ac_layer(ctx.at_block(b))) == placement
  router = build_router({"name": "acmoe", "normalization": "language",
                         "layers": "full"}, E)
  assert router.is_ac_layer(ctx.at_block(1))


@pytest.mark.parametrize("layers,blocks,message", [
    ([1, 3], (1, 3, 5), "block 1 is the first MoE layer"),
    ([2], (1, 3, 5), "block 2 is not an MoE block"),
    ("full", (3,), "selects no AC layer"),
    ("everywhere", (1, 3), "unknown placement preset"),
])
def test_placement_errors_name_the_field(layers, blocks, message):
  with pytest.raises(ConfigError, match=message) as info:
    resolve_ac_layers(layers, blocks)
  assert info.value.field == "router.layers"


def test_ac_layer_after_a_layer_of_another_width_is_an_error(rng):
  idx, gates, valid = _previous(rng, 12, 2)
  ctx = _ctx(idx, gates, valid, 2, 6, d=D + 3)
  router = build_router({"name": "acmoe"}, E)
  x = jnp.zeros((3, 4, D))
  with pytest.raises(ConfigError, match="of another shape") as info:
    router.init(jax.random.key(0), x, ctx, capacity=8, deterministic=True)
  assert info.value.field == "router.layers"


def test_random_diagonal_ablation_is_fixed_per_layer(rng):
  idx, gates, valid = _previous(rng, 12, 2)
  x = jnp.asarray(rng.normal(size=(3, 4, D)), jnp.float32)
  router = build_router({"name": "acmoe", "transform": "random",
                         "scaled_to": "experts", "random_seed": 7}, E)
  outs = []
  for layer in (1, 1, 2):
    ctx = _ctx(idx, gates, valid, 2, 6, block=layer)
    v = jax.jit(lambda k, c=ctx: router.init(k, x, c, capacity=8,
                                             deterministic=True))(
        jax.random.key(layer))
    outs.append(np.asarray(jax.jit(lambda v, c=ctx: router.apply(
        v, x, c, capacity=8, deterministic=True).expert_inputs)(v)))
  np.testing.assert_array_equal(outs[0], outs[1])
  assert not np.allclose(outs[0], outs[2])
  diag = outs[0].reshape(-1, D) / np.asarray(x).reshape(-1, D)
  np.testing.assert_allclose(diag, diag[:1].repeat(12, 0), rtol=1e-5)
  big = np.asarray(ac.random_diagonal(7, 1, 40000))
  assert abs(np.mean(big == 0) - 0.02275) < 0.004  # P(N(1, .5) < 0)
  # E[max(X, 0)], X ~ N(1, 0.5^2): Phi(2) + 0.5 phi(2) = 1.00425.
  np.testing.assert_allclose(np.mean(big), 1.00425, atol=0.01)


def test_softmoe_variant_matches_the_naive_soft_moe(rng):
  """Tokens L2-normalised, scaled by the Mix-8 AC transform, routed without
  re-normalising, and the scaled tokens are what the slots mix."""
  b, t, p = 2, 5, 3
  x = rng.normal(size=(b, t, D)).astype(np.float32)
  idx, gates, valid = _previous(rng, b * t, 8, invalid=False)
  ctx = _ctx(idx, gates, valid, b, t)
  layer = _ac_layer({"name": "acmoe", "normalization": "softmoe",
                     "base": {"name": "soft", "num_slots": p}},
                    group_size=None)
  xj = jnp.asarray(x)
  variables = jax.jit(lambda k: layer.init(k, xj, ctx))(jax.random.key(3))
  y, _, _ = jax.jit(lambda v: layer.apply(v, xj, ctx))(variables)
  xn = x.astype(np.float64)
  xn = xn / np.sqrt((xn**2).sum(-1, keepdims=True) + 1e-6)
  w = naive.ac_cluster_weights(xn.reshape(-1, D), idx[:, 0], E, "mad", 0.35,
                               5.0, "global_post_clamp")
  m = naive.ac_token_scales(w, idx, gates, valid, 8, "slot_softmax")
  s = xn * m.reshape(b, t, D)
  rp = variables["params"]["router"]["base"]
  disp, comb = naive.soft_routing(s, rp["mu"], rp["scale"],
                                  normalize_tokens=False)
  expected = naive.soft_moe(s, disp, comb, variables["params"]["Mlp"])
  np.testing.assert_allclose(np.asarray(y), expected, rtol=2e-5, atol=2e-6)


def test_plain_softmoe_dispatch_normalized(rng):
  b, t, p = 2, 5, 2
  x = rng.normal(size=(b, t, D)).astype(np.float32)
  layer = _ac_layer({"name": "soft", "num_slots": p,
                     "dispatch_normalized": True}, group_size=None)
  variables = jax.jit(lambda k: layer.init(k, jnp.asarray(x),
                                           RoutingContext()))(
      jax.random.key(0))
  y, _, _ = jax.jit(lambda v: layer.apply(v, jnp.asarray(x),
                                          RoutingContext()))(variables)
  xn = x.astype(np.float64)
  xn = xn / np.sqrt((xn**2).sum(-1, keepdims=True) + 1e-6)
  rp = variables["params"]["router"]
  disp, comb = naive.soft_routing(x, rp["mu"], rp["scale"])
  expected = naive.soft_moe(xn, disp, comb, variables["params"]["Mlp"])
  np.testing.assert_allclose(np.asarray(y), expected, rtol=2e-5, atol=2e-6)
  # Without the option the raw tokens are mixed (a different output).
  raw = naive.soft_moe(x, disp, comb, variables["params"]["Mlp"])
  assert not np.allclose(raw, expected, atol=1e-3)
