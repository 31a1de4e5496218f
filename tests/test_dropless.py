"""Dropless experts against a per-choice NumPy loop and the `indices` dispatcher.

Every (token, choice) computed, nothing dropped: the values, the gradients
(w.r.t. the tokens, the gates and the expert weights) and the metrics of
`dropless_moe` and of the MoE layer with `dispatcher="dropless"` equal the
`indices` dispatcher at a capacity where nothing drops and a loop over the
choices written from the definition, for both grouped-matmul backends (the
CPU's padded blocks, at block sizes that split experts over several blocks
or leave blocks unused, and `jax.lax.ragged_dot`). Dropout against the loop
with the same per-choice masks; bfloat16 dispatch against `indices`; the
expert-parallel layer on 8 fake CPU devices against one device (one
subprocess).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import naive
from conftest import random_token_routing
from fake_devices import fake_devices_env
from vmoe_ext.errors import ConfigError
from vmoe_ext.models import build_model
from vmoe_ext.moe import (MlpExperts, MoeLayer, TokenChoiceRouting,
                          make_dispatch_plan)
from vmoe_ext.moe.dropless import dropless_moe, make_dropless_plan
from vmoe_ext.moe.experts import expert_dropout_keep, mlp_experts
from vmoe_ext.moe.grouped import BlockGroups, grouped_matmul
from vmoe_ext.routers import RoutingContext, build_router

# (backend, block size): one row a block; 3 rows, so experts span several
# blocks and end in partial ones; 128 (capped at G*S*K: one block can hold
# everything, most blocks unused); ragged_dot (masked dense on CPU).
PATHS = [("blocks", 1), ("blocks", 3), ("blocks", 128), ("ragged", 1)]
PATH_IDS = [f"{b}{n}" for b, n in PATHS]


def _params(key, e, d, h, activation="gelu", output_bias=True):
  module = MlpExperts(num_experts=e, hidden_size=h, activation=activation,
                      output_bias=output_bias)
  # Non-zero biases, so a bias read from the wrong expert shows.
  return jax.jit(lambda key: jax.tree.map(
      lambda p: p + 0.3 * jax.random.normal(jax.random.key(7), p.shape),
      module.init(key, jnp.zeros((e, 1, d)))["params"]))(key)


def _loop(x, idx, gates, valid, params, activation="gelu", keep=None,
          rate=0.0, dropout_output=True):
  """`[G, S, D]`: sum over each token's valid choices of gate * expert MLP,
  choice by choice in float64, dropout by the choice's own keep masks."""
  p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
  act = {"gelu": naive.gelu, "relu": naive.relu, "swiglu": naive.silu}
  y = np.zeros(x.shape, np.float64)
  for g, s, k in np.ndindex(*idx.shape):
    if not valid[g, s, k]:
      continue
    e, v = idx[g, s, k], np.asarray(x[g, s], np.float64)
    h = act[activation](v @ p["Dense_0"]["kernel"][e]
                        + p["Dense_0"]["bias"][e])
    if activation == "swiglu":
      h = h * (v @ p["Dense_up"]["kernel"][e] + p["Dense_up"]["bias"][e])
    if keep is not None:
      h = np.where(keep[0][g, s, k], h / (1 - rate), 0)
    out = h @ p["Dense_1"]["kernel"][e]
    if "bias" in p["Dense_1"]:
      out = out + p["Dense_1"]["bias"][e]
    if keep is not None and dropout_output:
      out = np.where(keep[1][g, s, k], out / (1 - rate), 0)
    y[g, s] += gates[g, s, k] * out
  return y


def _indices(routing, x, params, e, activation="gelu", dtype=None):
  """The `indices` dispatcher at C = S*K: nothing drops."""
  plan = make_dispatch_plan(routing, num_experts=e, group_size=x.shape[1],
                            capacity=x.shape[1] * routing.num_selected,
                            kind="indices", dtype=dtype)
  out = mlp_experts(params, plan.dispatcher.dispatch(x), activation=activation)
  return plan.dispatcher.combine(out), plan


# ------------------------------------------------------------- the layout ---


def test_plan_hand_case():
  # 5 choices (K=1) to experts 0, 2, 0, 0, 2 of E=3, blocks of b=2: expert 0
  # has 3 rows (2 blocks, one padding row), expert 1 none, expert 2 two
  # rows (1 block); NB = (5 + 3*1) // 2 = 4 blocks, the last unused.
  routing = TokenChoiceRouting.create(jnp.array([[[0], [2], [0], [0], [2]]]),
                                      jnp.ones((1, 5, 1)))
  plan = jax.jit(make_dropless_plan, static_argnums=(1, 2))(routing, 3, 2)
  np.testing.assert_array_equal(plan.dispatcher.slot[0, :, 0], [0, 4, 1, 2, 5])
  np.testing.assert_array_equal(plan.dispatcher.source,
                                [0, 2, 3, 5, 1, 4, 5, 5])
  np.testing.assert_array_equal(plan.choice, [0, 2, 3, 5, 1, 4, 5, 5])
  np.testing.assert_array_equal(plan.groups.block_expert, [0, 0, 2, 2])
  np.testing.assert_array_equal(plan.groups.group_sizes, [4, 0, 2])
  assert int(plan.groups.used_blocks) == 3
  # Invalid choices and experts outside an expert-parallel shard get no row.
  routing = TokenChoiceRouting.create(
      jnp.array([[[0, 1], [2, 0]]]), jnp.ones((1, 2, 2)),
      jnp.array([[[True, False], [True, True]]]))
  plan = jax.jit(make_dropless_plan, static_argnums=(1, 2))(routing, 2, 1,
                                                            1)
  # One row used of the M = 4 the layout has room for; 4 = no row.
  np.testing.assert_array_equal(plan.dispatcher.slot[0], [[4, 4], [0, 4]])
  np.testing.assert_array_equal(plan.groups.group_sizes, [0, 1])


def test_grouped_matmul_and_its_gradient_against_dense_blocks():
  x = jax.random.normal(jax.random.key(0), (5, 3, 4))
  w = jax.random.normal(jax.random.key(1), (3, 4, 2))
  groups = BlockGroups(block_expert=jnp.array([0, 0, 2, 2, 2], jnp.int32),
                       used_blocks=jnp.array(3, jnp.int32),
                       group_sizes=jnp.array([6, 0, 3], jnp.int32))
  used = jnp.arange(5)[:, None, None] < 3

  def dense(x, w):
    return jnp.where(used, jnp.einsum("nbi,nio->nbo", x,
                                      w[groups.block_expert]), 0)

  cot = jax.random.normal(jax.random.key(2), (5, 3, 2))
  loss = lambda f: lambda x, w: jnp.sum(jnp.sin(f(x, w)) * cot)
  value_and_grad = lambda f: jax.jit(lambda x, w: (
      f(x, w), jax.grad(loss(f), argnums=(0, 1))(x, w)))
  expected = value_and_grad(dense)(x, w)
  for backend in ("blocks", "ragged"):
    f = lambda x, w, backend=backend: grouped_matmul(x, w, groups, backend)
    chex.assert_trees_all_close(value_and_grad(f)(x, w), expected, atol=1e-6)
  assert float(jnp.abs(expected[1][1][1]).max()) == 0  # Expert 1: no rows.


# ----------------------------------------- values, metrics and gradients ---


@pytest.mark.parametrize("backend,block", PATHS, ids=PATH_IDS)
def test_values_and_metrics_equal_the_loop_and_indices(rng, backend, block):
  g, s, e, k, d, h = 2, 7, 4, 2, 3, 5
  idx, gates, valid = random_token_routing(rng, g, s, e, k, with_invalid=True)
  idx[0, :, 0] = 1  # Expert 1 takes many rows: several blocks.
  idx[0, :, 1] = np.where(idx[0, :, 1] == 1, 0, idx[0, :, 1])
  x = rng.normal(size=(g, s, d)).astype(np.float32)
  params = _params(jax.random.key(1), e, d, h)
  routing = TokenChoiceRouting.create(jnp.asarray(idx), jnp.asarray(gates),
                                      jnp.asarray(valid))
  y, drop, usage = jax.jit(lambda r, x, p: dropless_moe(
      r, x, p, num_experts=e, backend=backend, block_size=block))(
          routing, jnp.asarray(x), params)
  np.testing.assert_allclose(y, _loop(x, idx, gates, valid, params),
                             rtol=1e-5, atol=1e-5)
  ref, plan = jax.jit(lambda r, x, p: _indices(r, x, p, e))(
      routing, jnp.asarray(x), params)
  np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5)
  assert float(drop) == 0.0 and float(plan.drop_rate) == 0.0
  rows = np.array([(idx[valid] == i).sum() for i in range(e)])
  np.testing.assert_allclose(usage, rows / (g * s * k / e), rtol=1e-6)
  # The capacity dispatcher's usage at C = S*K, rescaled to C = S*K/E.
  np.testing.assert_allclose(usage, plan.expert_usage * e, rtol=1e-6)


def test_gated_and_biasless_experts(rng):
  g, s, e, k, d, h, activation = 1, 6, 3, 2, 4, 3, "swiglu"
  idx, gates, valid = random_token_routing(rng, g, s, e, k)
  x = rng.normal(size=(g, s, d)).astype(np.float32)
  params = _params(jax.random.key(2), e, d, h, activation, output_bias=False)
  routing = TokenChoiceRouting.create(jnp.asarray(idx), jnp.asarray(gates))
  expected = _loop(x, idx, gates, valid, params, activation)
  for backend in ("blocks", "ragged"):
    y, _, _ = jax.jit(lambda r, x, p, backend=backend: dropless_moe(
        r, x, p, num_experts=e, activation=activation, backend=backend,
        block_size=2))(routing, jnp.asarray(x), params)
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5,
                               err_msg=backend)


def test_gradients_equal_indices(rng):
  """W.r.t. the tokens, the gates and every expert weight."""
  g, s, e, k, d, h = 2, 5, 4, 2, 3, 4
  idx, gates, valid = random_token_routing(rng, g, s, e, k, with_invalid=True)
  x = jnp.asarray(rng.normal(size=(g, s, d)), jnp.float32)
  params = _params(jax.random.key(3), e, d, h)
  cot = jnp.asarray(rng.normal(size=(g, s, d)), jnp.float32)

  def loss(x, gates, params, path):
    routing = TokenChoiceRouting.create(jnp.asarray(idx), gates,
                                        jnp.asarray(valid))
    if path is None:
      y, _ = _indices(routing, x, params, e)
    else:
      y, _, _ = dropless_moe(routing, x, params, num_experts=e,
                             backend=path[0], block_size=path[1])
    return jnp.sum(jnp.sin(y) * cot)

  grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)), static_argnums=3)
  expected = grad(x, jnp.asarray(gates), params, None)
  assert all(float(jnp.abs(a).sum()) > 0 for a in jax.tree.leaves(expected))
  for path in (("blocks", 3), ("ragged", 1)):
    chex.assert_trees_all_close(grad(x, jnp.asarray(gates), params, path),
                                expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dropout_output,backend,block",
                         [(True, "blocks", 2), (False, "ragged", 1)])
def test_dropout_uses_each_choices_own_masks(rng, dropout_output, backend,
                                             block):
  g, s, e, k, d, h, rate = 2, 4, 3, 2, 3, 5, 0.4
  idx, gates, valid = random_token_routing(rng, g, s, e, k, with_invalid=True)
  x = rng.normal(size=(g, s, d)).astype(np.float32)
  params = _params(jax.random.key(4), e, d, h)
  routing = TokenChoiceRouting.create(jnp.asarray(idx), jnp.asarray(gates),
                                      jnp.asarray(valid))
  key = jax.random.key(5)
  keep = [np.asarray(m).reshape(g, s, k, -1)
          for m in expert_dropout_keep(key, rate, g * s, k, h, d)]
  expected = _loop(x, idx, gates, valid, params, keep=keep, rate=rate,
                   dropout_output=dropout_output)
  assert not np.allclose(expected, _loop(x, idx, gates, valid, params))
  y, _, _ = jax.jit(lambda r, x, p: dropless_moe(
      r, x, p, num_experts=e, dropout_rate=rate,
      dropout_output=dropout_output, dropout_rng=key, backend=backend,
      block_size=block))(routing, jnp.asarray(x), params)
  np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------- the layer ---


def _layer(dispatcher, **kwargs):
  router = build_router({"name": "noisy_topk", "num_selected": 2},
                        num_experts=4)
  return MoeLayer(router=router, hidden_size=5, group_size=6,
                  capacity_factor=1.0 if dispatcher == "dropless" else 3.0,
                  dispatcher=dispatcher, **kwargs)


@pytest.mark.parametrize("fields", [
    dict(shared_experts=1, output_bias="once"),
    dict(dispatch_dtype="bfloat16", output_bias="none"),
], ids=["shared_once", "bfloat16_none"])
def test_layer_equals_indices_values_metrics_and_gradients(fields):
  """The layer's output, metrics and gradients (w.r.t. the input and every
  parameter, the router's included) with shared experts, a single output
  bias, no output bias, and bfloat16 dispatch (slot cotangents rounded)."""
  x = jax.random.normal(jax.random.key(0), (2, 6, 4))
  ref = _layer("indices", **fields)  # C = 2*6*3/4 = 9: nothing drops.
  variables = jax.jit(lambda key: jax.tree.map(
      lambda v: v + 0.2 * jax.random.normal(jax.random.key(2), v.shape),
      ref.init(key, x, RoutingContext())))(jax.random.key(1))

  def run(layer):
    def loss(params, x):
      y, metrics, _ = layer.apply({"params": params}, x, RoutingContext())
      return jnp.sum(jnp.sin(y)), (y, metrics)
    return jax.jit(jax.grad(loss, argnums=(0, 1), has_aux=True))(
        variables["params"], x)

  grads, (y, metrics) = run(ref)
  assert float(metrics["drop_rate"]) == 0.0
  for backend in ("blocks",):  # Both backends: the tests above.
    got_grads, (got, got_metrics) = run(_layer(
        "dropless", dropless_backend=backend, dropless_block_size=2,
        **fields))
    np.testing.assert_allclose(got, y, rtol=1e-5, atol=1e-5)
    chex.assert_trees_all_close(got_grads, grads, rtol=1e-5, atol=1e-5)
    assert float(got_metrics["drop_rate"]) == 0.0
    np.testing.assert_allclose(got_metrics["expert_load"],
                               metrics["expert_load"])
    # Usage over S*K/E = 3 rows an expert a group, not C = 9.
    np.testing.assert_allclose(got_metrics["expert_usage"],
                               metrics["expert_usage"] * 3, rtol=1e-6)


# -------------------------------------------------------------- errors ---


_VIT = dict(name="vit_moe", num_classes=3, patch_size=(4, 4), hidden_size=8,
            num_layers=2, num_heads=2, mlp_dim=8)


@pytest.mark.parametrize("router", ["expert_choice", "soft"])
def test_expert_choice_and_soft_routing_are_config_errors(router):
  with pytest.raises(ConfigError, match="token-choice") as e:
    build_model(dict(_VIT, moe=dict(layers=(1,), dispatcher="dropless",
                                    router={"name": router})))
  assert e.value.field == "model.moe.dispatcher"


def test_bad_dropless_inputs_are_errors():
  with pytest.raises(ConfigError) as e:
    _layer("dropless", dropless_backend="cuda")
  assert e.value.field == "moe.dropless_backend"
  with pytest.raises(ConfigError) as e:
    _layer("dropless", dropless_block_size=0)
  assert e.value.field == "moe.dropless_block_size"
  with pytest.raises(ConfigError, match="no fixed-capacity plan"):
    make_dispatch_plan(TokenChoiceRouting.create(jnp.zeros((1, 1, 1)),
                                                 jnp.ones((1, 1, 1))),
                       num_experts=2, group_size=1, capacity=1,
                       kind="dropless")


# ---------------------------------------------------- expert parallelism ---


_SHARDED = textwrap.dedent("""
    import json
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import AxisType
    from vmoe_ext.moe import MoeLayer
    from vmoe_ext.moe.expert_parallel import ExpertParallel
    from vmoe_ext.routers import RoutingContext, build_router
    jax.config.update("jax_default_matmul_precision", "highest")
    assert jax.device_count() == 8
    def layer(ep):
      router = build_router({"name": "noisy_topk", "num_selected": 2},
                            num_experts=8)
      return MoeLayer(router=router, hidden_size=6, dispatcher="dropless",
                      dropout_rate=0.2, dropless_block_size=3,
                      dropless_backend="blocks", shared_experts=1,
                      expert_parallel=ep)
    x = jax.random.normal(jax.random.key(0), (16, 5, 4))
    v = jax.jit(lambda k: layer(None).init(k, x, RoutingContext()))(
        jax.random.key(1))
    rngs = {"gating": jax.random.key(2), "dropout": jax.random.key(3)}
    def run(m):
      def loss(p, x):
        y, met, _ = m.apply({"params": p}, x, RoutingContext(),
                            deterministic=False, rngs=rngs)
        return jnp.sum(jnp.sin(y)), (y, met)
      return jax.jit(jax.grad(loss, argnums=(0, 1), has_aux=True))(
          v["params"], x)
    one = run(layer(None))
    grads = jax.tree.leaves(one[0])
    one = jax.tree.leaves(one)
    report = {}
    for shape in ((4, 2),):
      mesh = jax.make_mesh(shape, ("data", "expert"),
                           axis_types=(AxisType.Auto,) * 2)
      many = jax.tree.leaves(run(layer(ExpertParallel(mesh))))
      # Each leaf's largest difference over its scale (at least 1).
      report[str(shape)] = max(
          float(np.abs(np.asarray(a) - np.asarray(b)).max())
          / max(1.0, float(np.abs(np.asarray(a)).max()))
          for a, b in zip(one, many))
    report["magnitude"] = min(float(np.abs(np.asarray(a)).max())
                              for a in grads)
    print(json.dumps(report))
""")


def test_expert_parallel_equals_one_device():
  """A (data, expert) = (4, 2) mesh, 8 experts (4 a device), shared
  experts: forward, metrics and gradients in training mode (gating noise,
  dropout) equal one device's, to 2e-6 of each leaf's scale (at least 1): the
  shared MLP's bias gradients (|g| ~ 75) are sums over the batch, taken in
  another order on a mesh, and differ by one float32 ulp (7.6e-6)."""
  out = subprocess.run([sys.executable, "-c", _SHARDED],
                       env=fake_devices_env(8), capture_output=True,
                       text=True, timeout=300, check=False)
  assert out.returncode == 0, out.stderr[-3000:]
  report = json.loads(out.stdout.strip().splitlines()[-1])
  assert report.pop("magnitude") > 0  # Every gradient leaf is non-zero.
  assert report == {k: pytest.approx(0, abs=2e-6) for k in report}, report
