"""bfloat16 dispatch as google's vmoe `Bfloat16Dispatcher` computes it.

vmoe rounds only the data to bfloat16 around dispatch and combine (the tokens
before dispatch, the expert outputs before combine) and casts it back; the
dispatch/combine weights stay float32 and the contractions accumulate in
float32. The reference is the per-token NumPy loop (`tests/naive.py`) with
that rounding (`ml_dtypes.bfloat16`) and float64 arithmetic elsewhere. The
gradients are checked against vmoe's dispatchers transcribed in JAX (the
end of this file): its boolean dispatch einsum runs in bfloat16, so the
backward pass rounds each slot's cotangent before summing a token's slots.

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

import flax
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from fake_devices import fake_devices_env
import naive
from vmoe_ext.models import build_model
from vmoe_ext.moe import MoeLayer, compute_capacity
from vmoe_ext.moe import layer as layer_module
from vmoe_ext.moe.dispatch import RoundedDispatcher, make_dispatch_plan
from vmoe_ext.moe.routing import ExpertChoiceRouting, TokenChoiceRouting
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
    for dtype in (None, jnp.float32):  # The float32 path: the plain plan.
      plain = make_dispatch_plan(routing, num_experts=1, group_size=2,
                                 capacity=2, kind=kind, dtype=dtype)
      assert not isinstance(plain.dispatcher, RoundedDispatcher)
    plan = make_dispatch_plan(routing, num_experts=1, group_size=2,
                              capacity=2, kind=kind, dtype=jnp.bfloat16)
    assert isinstance(plan.dispatcher, RoundedDispatcher)
    assert plan.dispatcher.copies_tokens  # Slot cotangents rounded.
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


# -- Gradients against vmoe's dispatchers, transcribed in JAX ----------------
#
# vmoe (google-research/vmoe, vmoe/moe.py) wraps its dispatchers in
# `Bfloat16Dispatcher`: `dispatcher.dispatch(data.astype(bfloat16))
# .astype(float32)`, the same around `combine`. Token and expert choice
# dispatch with a *boolean* tensor, so `EinsumDispatcher.dispatch`'s
# `einsum("GSEC,GS...->GEC...", bool, bf16)` runs in bfloat16 (and
# `ExpertIndicesDispatcher.dispatch` scatter-adds bfloat16 rows): in the
# backward pass each slot's cotangent is rounded to bfloat16 (the cast back
# to float32 transposes to a rounding) before the slots of a token are
# summed. Combine weights are float32: the combine contracts in float32.
# Below, those dispatchers built from the layer's own routing (vmoe's
# `_get_top_experts_per_item_common` capacity rule and
# `_get_top_items_per_expert_einsum_dispatcher`), swapped into the model in
# place of its own plan, on the same weights.


def vmoe_token_choice_buffers(idx, valid, num_experts, capacity):
  """vmoe's buffer index `[G, S, K]` of each choice (>= C or -1: none),
  choice-major cumsum as `_get_top_experts_per_item_common`."""
  g, s, k = idx.shape
  ranks = jnp.swapaxes(idx, 1, 2).reshape(g, k * s)
  one_hot = (jax.nn.one_hot(ranks, num_experts, dtype=jnp.int32)
             * jnp.swapaxes(valid, 1, 2).reshape(g, k * s, 1))
  buffer = jnp.cumsum(one_hot, axis=1) * one_hot - 1  # [G, K*S, E]
  buffer = jnp.max(buffer, axis=-1).reshape(g, k, s)
  return jnp.swapaxes(buffer, 1, 2)


@flax.struct.dataclass
class VmoeBf16Einsum:
  """`Bfloat16Dispatcher(EinsumDispatcher(combine_weights,
  dispatch_weights))` with bool `dispatch_weights [G, S, E, C]`.

  `round_slots=False`: the semantics before the fix (the dispatch einsum
  in float32 of rounded tokens: a token's slots summed, then rounded)."""
  dispatch_weights: jax.Array
  combine_weights: jax.Array
  round_slots: bool = flax.struct.field(pytree_node=False, default=True)

  def dispatch(self, x):
    g, _, e, c = self.dispatch_weights.shape
    data = x.astype(jnp.bfloat16)
    if self.round_slots:
      out = jnp.einsum("GSEC,GSD->GECD", self.dispatch_weights, data)
    else:
      out = jnp.einsum("GSEC,GSD->GECD",
                       self.dispatch_weights.astype(jnp.float32),
                       data.astype(jnp.float32))
    return jnp.swapaxes(out, 0, 1).reshape(e, g * c, -1).astype(x.dtype)

  def combine(self, y):
    g, _, e, c = self.combine_weights.shape
    data = jnp.swapaxes(y.astype(jnp.bfloat16).reshape(e, g, c, -1), 0, 1)
    return jnp.einsum("GSEC,GECD->GSD", self.combine_weights,
                      data).astype(y.dtype)


@flax.struct.dataclass
class VmoeBf16Indices:
  """`Bfloat16Dispatcher(ExpertIndicesDispatcher(indices, combine_weights))`:
  `indices [G, S, K, 2]` (expert, buffer), out of range: dropped.
  `round_slots` as `VmoeBf16Einsum`'s."""
  indices: jax.Array
  combine_weights: jax.Array
  num_experts: int = flax.struct.field(pytree_node=False)
  capacity: int = flax.struct.field(pytree_node=False)
  round_slots: bool = flax.struct.field(pytree_node=False, default=True)

  def dispatch(self, x):
    g, _, k, _ = self.indices.shape
    data = x.astype(jnp.bfloat16)
    if not self.round_slots:
      data = data.astype(jnp.float32)
    data = jnp.repeat(data, k, axis=1)
    shape = (self.num_experts, self.capacity, x.shape[-1])
    out = jax.vmap(lambda d, i: jnp.zeros(shape, d.dtype).at[
        i[:, 0], i[:, 1]].add(d, mode="drop"))(
            data, self.indices.reshape(g, -1, 2))  # [G, E, C, D]
    return jnp.swapaxes(out, 0, 1).reshape(
        self.num_experts, -1, x.shape[-1]).astype(x.dtype)

  def combine(self, y):
    g = self.combine_weights.shape[0]
    data = jnp.swapaxes(y.astype(jnp.bfloat16).reshape(
        self.num_experts, g, self.capacity, -1), 0, 1)
    i = self.indices
    data = jax.vmap(lambda d, i: d.at[i[..., 0], i[..., 1]].get(
        mode="fill", fill_value=0))(data, i)
    mask = (i[..., 0] < self.num_experts) & (i[..., 1] < self.capacity)
    data = data * mask[..., None]
    return jnp.einsum("GSKD,GSK->GSD", data, self.combine_weights,
                      precision=jax.lax.Precision.HIGHEST).astype(y.dtype)


def vmoe_dispatcher(routing, num_experts, capacity, kind, round_slots):
  """vmoe's dispatcher for the layer's routing (`kind` "indices" only for
  token choice: vmoe has none for expert choice)."""
  if isinstance(routing, ExpertChoiceRouting):
    picked = jax.nn.one_hot(routing.token_indices, routing.group_size,
                            dtype=jnp.bool_)  # [G, E, C, S]
    dispatch = jnp.transpose(picked, (0, 3, 1, 2))
    combine = jnp.einsum("GEC,GSEC->GSEC", routing.weights, dispatch)
    return VmoeBf16Einsum(dispatch, combine, round_slots)
  idx, gates, valid = (routing.expert_indices, routing.gates, routing.valid)
  buffer = vmoe_token_choice_buffers(idx, valid, num_experts, capacity)
  if kind == "indices":
    return VmoeBf16Indices(jnp.stack([idx, buffer], -1),
                           jnp.where(valid, gates, 0.0), num_experts,
                           capacity, round_slots)
  # [G, S, E, C]: one_hot drops buffer indices outside [0, C).
  dispatch = jnp.einsum("GSKE,GSKC->GSEC",
                        jax.nn.one_hot(idx, num_experts, dtype=jnp.int32),
                        jax.nn.one_hot(buffer, capacity, dtype=jnp.int32)) > 0
  full_gates = jnp.einsum("GSKE,GSK->GSE", jax.nn.one_hot(idx, num_experts),
                          jnp.where(valid, gates, 0.0))
  combine = jnp.einsum("GSE,GSEC->GSEC", full_gates, dispatch)
  return VmoeBf16Einsum(dispatch, combine, round_slots)


GRAD_ROUTERS = {
    "top2": {"name": "noisy_topk", "num_selected": 2},
    "expert_choice": {"name": "expert_choice"},
}


def _vit(router, dispatcher):
  return build_model({
      "name": "vit_moe", "num_classes": 10, "hidden_size": 16, "mlp_dim": 32,
      "num_heads": 2, "num_layers": 4, "patch_size": (2, 2),
      "classifier": "token",
      "moe": {"every": 2, "num_experts": 4, "capacity_factor": 1.0,
              "dispatch_dtype": "bfloat16", "dispatcher": dispatcher,
              "router": GRAD_ROUTERS[router]}})


def _logits_and_grads(model, variables, images, labels):
  """`(logits, d loss / d params, d loss / d images)`, mean CE loss."""
  def loss(params, images):
    logits = model.apply({**variables, "params": params}, images,
                         deterministic=True)[0]
    ce = -jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], 1)
    return jnp.mean(ce), logits
  (_, logits), (d_params, d_images) = jax.value_and_grad(
      loss, argnums=(0, 1), has_aux=True)(variables["params"], images)
  return logits, d_params, d_images


def _with_vmoe_dispatch(monkeypatch, round_slots=True):
  real = layer_module.make_dispatch_plan

  def plan(routing, *, num_experts, group_size, capacity, kind,
           batch_priority, dtype):
    assert jnp.dtype(dtype) == jnp.bfloat16 and not batch_priority
    own = real(routing, num_experts=num_experts, group_size=group_size,
               capacity=capacity, kind=kind, batch_priority=batch_priority,
               dtype=dtype)
    return own.replace(dispatcher=vmoe_dispatcher(
        routing, num_experts, own.capacity, kind, round_slots))

  monkeypatch.setattr(layer_module, "make_dispatch_plan", plan)


def relative_errors(got, want):
  """Per leaf `max |got - want| / max |want|`, leaves named by path; the
  attention key biases are left out (their gradient is 0 in exact
  arithmetic, softmax being shift invariant: only rounding noise)."""
  out = {}
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got),
                          jax.tree.leaves(want)):
    name = jax.tree_util.keystr(path)
    if "['key']['bias']" in name:
      continue
    scale = float(jnp.max(jnp.abs(b)))
    assert scale > 0, name
    out[name] = float(jnp.max(jnp.abs(a - b))) / scale
  return out


# Same algorithm, same weights: the values agree but for float32 summation
# order where the two programs contract differently (our expert-choice
# "indices" combine scatter-adds where vmoe's einsum sums over the slots:
# 1.3e-6 measured), 1e-5 being ~80 float32 ulps of a leaf's largest entry;
# the old semantics are off by 5e-3 here (`old` below), bfloat16's 2^-8
# relative step reaching the gradients.
GRAD_RTOL = 1e-5


@pytest.mark.parametrize("dispatcher", ["einsum", "indices"])
@pytest.mark.parametrize("router", sorted(GRAD_ROUTERS))
def test_gradients_equal_vmoes_bfloat16_dispatch(monkeypatch, router,
                                                 dispatcher):
  """Logits and the gradients of a cross-entropy loss (parameters and
  image) of a V-MoE with two bfloat16-dispatch MoE layers equal those of
  the same model with vmoe's dispatchers; the semantics before the fix (a
  token's slot cotangents summed in float32, then rounded) differ by
  orders of magnitude more."""
  model = _vit(router, dispatcher)
  images = jax.random.uniform(jax.random.key(0), (4, 8, 8, 3))
  labels = jnp.arange(4, dtype=jnp.int32)
  variables = model.init(jax.random.key(1), images)
  params = dict(variables["params"])  # A non-trivial head (vmoe: zeros).
  params["head"] = {**params["head"], "kernel": jax.random.normal(
      jax.random.key(2), params["head"]["kernel"].shape)}
  variables = {**variables, "params": params}
  ours = _logits_and_grads(model, variables, images, labels)
  with monkeypatch.context() as m:
    _with_vmoe_dispatch(m)
    vmoe = _logits_and_grads(model, variables, images, labels)
  with monkeypatch.context() as m:
    _with_vmoe_dispatch(m, round_slots=False)
    before = _logits_and_grads(model, variables, images, labels)
  np.testing.assert_allclose(ours[0], vmoe[0], rtol=GRAD_RTOL, atol=1e-6)
  errors = relative_errors(ours[1:], vmoe[1:])
  assert max(errors.values()) <= GRAD_RTOL, {
      k: v for k, v in errors.items() if v > GRAD_RTOL}
  # The test can tell: summing in float32 first moves the gradients.
  np.testing.assert_array_equal(before[0], vmoe[0])  # Same forward.
  old = relative_errors(before[1:], vmoe[1:])
  print(f"{router}/{dispatcher}: max relative error {max(errors.values()):.2e}"
        f" (image {errors['[1]']:.2e}); before the fix "
        f"{max(old.values()):.2e} (image {old['[1]']:.2e})")
  assert max(old.values()) > 100 * GRAD_RTOL
