"""bfloat16 dispatch as google's vmoe `Bfloat16Dispatcher` computes it.

vmoe rounds only the data to bfloat16 around dispatch and combine (the tokens
before dispatch, the expert outputs before combine) and casts it back; the
dispatch/combine weights stay float32 and the contractions accumulate in
float32. The reference is the per-token NumPy loop (`tests/naive.py`) with
that rounding (`ml_dtypes.bfloat16`) and float64 arithmetic elsewhere.

Rounding is discontinuous, so each case first checks that none of the
expert outputs the reference rounds lies within 2e-6 (relative, ~30 float32
ulps) of a bfloat16 rounding midpoint: there float32 and float64 arithmetic
could round to neighbouring bfloat16 values, and the comparison would test
luck, not semantics. (The tokens are float32 inputs, rounded alike.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from fake_devices import fake_devices_env
import naive
from vmoe_ext.moe import MoeLayer, compute_capacity
from vmoe_ext.moe.dispatch import RoundedDispatcher, make_dispatch_plan
from vmoe_ext.moe.routing import TokenChoiceRouting
from vmoe_ext.routers import RoutingContext, build_router

E, H = 4, 6
ROUTERS = {
    "token_choice": {"name": "noisy_topk", "num_selected": 2},
    "expert_choice": {"name": "expert_choice"},
    "soft": {"name": "soft", "num_slots": 2},
}
MARGIN = 2e-6


def bf16(a):
  """Round to bfloat16 (nearest even) in NumPy; float64 back."""
  return np.asarray(a, np.float64).astype(ml_dtypes.bfloat16).astype(
      np.float64)


class Rounding:
  """`round_data` for the naive loops that also records how close every
  value it rounds came to a bfloat16 rounding midpoint (relative)."""

  def __init__(self):
    self.closest = np.inf

  def __call__(self, a):
    a = np.asarray(a, np.float64)
    # Tokens are float32 inputs: their rounding is the same in both. Only
    # the values the loop computed (expert outputs) can straddle.
    computed = a.astype(np.float32).astype(np.float64) != a
    nonzero = a[computed & (a != 0)]
    if nonzero.size:
      ulp = np.exp2(np.floor(np.log2(np.abs(nonzero))) - 7)
      frac = np.abs(nonzero) / ulp
      frac -= np.floor(frac)
      self.closest = min(self.closest, float(np.min(
          np.abs(frac - 0.5) * ulp / np.abs(nonzero))))
    return bf16(a)


def _layer(router, dispatcher, dtype):
  return MoeLayer(router=build_router(ROUTERS[router], num_experts=E),
                  hidden_size=H, group_size=None, capacity_factor=1.0,
                  dispatcher=dispatcher, dispatch_dtype=dtype)


def _reference(router, layer, variables, x, round_data, num_experts=E):
  """The layer's output from its router's routing and the naive loops."""
  t = x.shape[1]
  params = variables["params"]
  capacity = compute_capacity(t, layer.router.slots_per_token,
                              layer.capacity_factor, num_experts)
  routing = layer.router.apply({"params": params["router"]}, x,
                               RoutingContext(), capacity=capacity,
                               deterministic=True).routing
  experts = params["Mlp"]
  if router == "token_choice":
    return naive.token_choice_moe(
        x, np.asarray(routing.expert_indices), np.asarray(routing.gates),
        np.asarray(routing.valid), num_experts, capacity, experts,
        round_data=round_data)
  if router == "expert_choice":
    return naive.expert_choice_moe(
        x, np.asarray(routing.token_indices), np.asarray(routing.weights),
        experts, round_data=round_data)
  return naive.soft_moe(x, np.asarray(routing.dispatch_weights, np.float64),
                        np.asarray(routing.combine_weights, np.float64),
                        experts, round_data=round_data)


def _inputs():
  # Tokens of magnitude ~3: their bfloat16 rounding is visible (2^-6 steps).
  return 3.0 * jax.random.normal(jax.random.key(3), (2, 8, 5))


@pytest.mark.parametrize("dispatcher", ["einsum", "indices"])
@pytest.mark.parametrize("router", sorted(ROUTERS))
def test_layer_rounds_the_data_not_the_weights(router, dispatcher):
  x = _inputs()
  layer = _layer(router, dispatcher, "bfloat16")
  variables = layer.init(jax.random.key(1), x, RoutingContext())
  y = np.asarray(layer.apply(variables, x, RoutingContext())[0])
  rounding = Rounding()
  expected = _reference(router, layer, variables, np.asarray(x), rounding)
  assert rounding.closest > MARGIN  # See the module docstring.
  assert y.dtype == np.float32
  np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-6)
  # The rounding is real: float32 dispatch gives the unrounded loop, which
  # is far (bfloat16's 2^-8 relative steps) from the rounded one.
  f32 = _layer(router, dispatcher, None)
  y32 = np.asarray(f32.apply(variables, x, RoutingContext())[0])
  unrounded = _reference(router, layer, variables, np.asarray(x),
                         lambda a: a)
  np.testing.assert_allclose(y32, unrounded, rtol=1e-5, atol=1e-6)
  assert np.max(np.abs(expected - unrounded)) > 1e-3


def test_the_plan_keeps_float32_weights_and_wraps_the_dispatcher():
  routing = TokenChoiceRouting.create(jnp.zeros((1, 2, 1), jnp.int32),
                                      jnp.full((1, 2, 1), 0.3))
  for kind in ("einsum", "indices"):
    plan = make_dispatch_plan(routing, num_experts=1, group_size=2,
                              capacity=2, kind=kind, dtype=jnp.bfloat16)
    assert isinstance(plan.dispatcher, RoundedDispatcher)
    leaves = jax.tree.leaves(plan.dispatcher.dispatcher)
    floats = [v for v in leaves if jnp.issubdtype(v.dtype, jnp.floating)]
    assert floats and all(v.dtype == jnp.float32 for v in floats)
    # 1 + 2^-9 rounds to 1 in bfloat16; the gate 0.3 stays float32's 0.3.
    x = jnp.asarray([[[1.0 + 2.0 ** -9], [2.0]]])
    out = plan.dispatcher.combine(plan.dispatcher.dispatch(x))
    np.testing.assert_array_equal(
        out, np.float32(0.3) * np.asarray([[[1.0], [2.0]]], np.float32))
    assert out.dtype == jnp.float32


_EXPERT_PARALLEL = textwrap.dedent("""
    import json, sys
    import jax, numpy as np
    sys.path.insert(0, sys.argv[2])
    from test_bfloat16_dispatch import MESH, ep_inputs, ep_layer
    from vmoe_ext.routers import RoutingContext
    from vmoe_ext.sharding.partitioning import Partitioning
    assert jax.device_count() == 8
    ep = Partitioning.from_config(
        {"axes": ("data", "expert"), "shape": MESH}).expert_parallel
    x = ep_inputs()
    out = {}
    for name in json.loads(sys.argv[1]):
      v = ep_layer(name, None).init(jax.random.key(1), x, RoutingContext())
      apply = jax.jit(
          lambda v, x: ep_layer(name, ep).apply(v, x, RoutingContext())[0])
      out[name] = np.asarray(apply(v, x)).tolist()
    print(json.dumps(out))
""")
MESH = (2, 4)  # (data, expert): 8 experts, 2 a device; 8 groups, 1 a shard.


def ep_layer(router, expert_parallel):
  return MoeLayer(router=build_router(ROUTERS[router], num_experts=8),
                  hidden_size=H, group_size=None, capacity_factor=1.0,
                  dispatch_dtype="bfloat16", expert_parallel=expert_parallel)


def ep_inputs():
  return 3.0 * jax.random.normal(jax.random.key(3), (8, 8, 5))


def test_expert_parallel_path_rounds_as_the_reference():
  """On a (2, 4) mesh of fake CPU devices, the expert-parallel layer with
  bfloat16 dispatch (its all-to-alls carrying bfloat16 where exact) against
  the same reference, for the variables every process initialises alike."""
  env = fake_devices_env(8)
  proc = subprocess.run(
      [sys.executable, "-c", _EXPERT_PARALLEL, json.dumps(sorted(ROUTERS)),
       os.path.dirname(__file__)], env=env, capture_output=True, text=True,
      timeout=300, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  result = json.loads(proc.stdout.strip().splitlines()[-1])
  assert sorted(result) == sorted(ROUTERS)
  x = ep_inputs()
  for router, y in result.items():
    layer = ep_layer(router, None)
    variables = layer.init(jax.random.key(1), x, RoutingContext())
    rounding = Rounding()
    expected = _reference(router, layer, variables, np.asarray(x), rounding,
                          num_experts=8)
    assert rounding.closest > MARGIN, router
    assert np.max(np.abs(expected)) > 0.1, router
    np.testing.assert_allclose(np.asarray(y), expected, rtol=1e-5, atol=1e-6,
                               err_msg=router)
