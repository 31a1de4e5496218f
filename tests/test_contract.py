"""The router contract: a new router plugs into the model with one registry line.

Two test-only routers exercise what later routers need: reading the previous
MoE layer's routing from the `RoutingContext` (ACMoE) and keeping persistent,
non-parameter state in its own variable collection (Symphony).
"""

from __future__ import annotations

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

import naive
from resume_check import short_schedule, straight_vs_resumed
from vmoe_ext.models import build_model
from vmoe_ext.moe.capacity import compute_capacity
from vmoe_ext.moe.contract import RouterContractError
from vmoe_ext.moe.layer import MoeLayer
from vmoe_ext.moe.routing import TokenChoiceRouting
from vmoe_ext.routers.base import Router, RouterOutput, RoutingContext
from vmoe_ext.routers.registry import ROUTERS
from vmoe_ext.streams import STREAMS
from vmoe_ext.streams.base import ResidualStream
from vmoe_ext.train.config_files import load_config


class FollowPreviousRouter(Router):
  """Top-1 routing that repeats the previous MoE layer's top-1 choice.

  The first MoE layer (no previous routing) sends token s to expert s % E.
  Counts its training calls in the "router_state" collection.
  """

  @nn.compact
  def __call__(self, x, ctx, *, capacity, deterministic, update_state=False):
    del capacity, deterministic
    g, s, _ = x.shape
    calls = self.variable("router_state", "calls", jnp.zeros, (), jnp.int32)
    if update_state:
      calls.value += 1
    if ctx.previous is None:
      idx = jnp.broadcast_to(jnp.arange(s) % self.num_experts, (g, s))
    else:  # Token-major [B, T, K] -> this layer's groups.
      idx = ctx.previous.expert_indices[..., 0].reshape(g, s)
    routing = TokenChoiceRouting.create(idx[..., None], jnp.ones((g, s, 1)))
    return RouterOutput(routing, {"auxiliary_loss": jnp.zeros(())})


@pytest.fixture
def follow_router():
  ROUTERS.entries["follow_previous"] = "test_contract:FollowPreviousRouter"
  yield
  del ROUTERS.entries["follow_previous"]


def test_new_router_reads_context_and_keeps_state(follow_router):
  model = build_model(dict(
      name="vit_moe", num_classes=3, patch_size=(4, 4), hidden_size=8,
      num_layers=4, num_heads=2, mlp_dim=8,
      moe=dict(layers=(0, 2, 3), num_experts=3, capacity_factor=4.0,
               router={"name": "follow_previous"})))
  images = jnp.ones((2, 8, 8, 1))
  variables = jax.jit(model.init)(jax.random.key(0), images)
  assert int(variables["router_state"]["encoderblock_2"]["Moe"]["router"]
             ["calls"]) == 0
  (_, _), state = jax.jit(lambda v: model.apply(
      v, images, deterministic=False, update_state=True,
      mutable=["intermediates", "router_state"]))(variables)
  sown = state["intermediates"]
  first = sown["encoderblock_0"]["Moe"]["selected_experts"][0]
  np.testing.assert_array_equal(first[..., 0],
                                np.broadcast_to(np.arange(5) % 3, (2, 5)))
  for block in ("encoderblock_2", "encoderblock_3"):
    np.testing.assert_array_equal(sown[block]["Moe"]["selected_experts"][0],
                                  first)
    assert int(state["router_state"][block]["Moe"]["router"]["calls"]) == 1


# ----------------------------------------------------------------------------
# Contract v2: a router using (a) expert inputs, (b) forwarded data and
# (c) persistent state together; a stream that calls ffn at an extrapolated
# point (and once more as a probe). One registry line each.
# ----------------------------------------------------------------------------

BETA = 0.5


class ProbeRouter(Router):
  """Top-1 linear router that exercises every v2 seam.

  (a) experts see `x * scale`, `scale = 1 / (1 + |ema|)` (state before this
      batch's update, like Symphony's Algorithm 1);
  (b) forwards its mean gate per expert `[E]` (over the global batch); the
      next layer adds it to its logits and sows what it received;
  (c) keeps `ema[D]`, the EMA (BETA) of the mean input token, updated only
      with `update_state`, averaged over `ctx.axis_name`.
  """

  @nn.compact
  def __call__(self, x, ctx, *, capacity, deterministic, update_state=False):
    del capacity, deterministic
    d = x.shape[-1]
    ema = self.variable("router_state", "ema", jnp.zeros, (d,), jnp.float32)
    scale = jax.lax.stop_gradient(1.0 / (1.0 + jnp.abs(ema.value)))
    logits = nn.Dense(self.num_experts, use_bias=False, name="dense")(x)
    if ctx.previous_forward is not None:
      if ctx.primary:
        self.sow("intermediates", "received", ctx.previous_forward)
      logits = logits + ctx.previous_forward
    gates = jax.nn.softmax(logits)
    top, idx = jax.lax.top_k(gates, 1)
    forward = ctx.reduce_mean(jnp.mean(gates, axis=(0, 1)))
    if ctx.primary:
      self.sow("intermediates", "sent", forward)
    if update_state:
      stat = ctx.reduce_mean(jnp.mean(x, axis=(0, 1)))
      self.sow("intermediates", "stat", stat)
      ema.value = BETA * ema.value + (1 - BETA) * stat
    return RouterOutput(TokenChoiceRouting.create(idx, top),
                        {"auxiliary_loss": 0.01 * jnp.mean(logits**2)},
                        expert_inputs=x * scale, forward=forward)


class ExtrapolatedStream(ResidualStream):
  """`x + ffn(x + c * f_prev)`, state `f_prev` `[B, T, D]`, plus a probe call
  of ffn at x that must neither sow nor update router state."""
  coefficient: float = 0.5

  def init_state(self, x):
    return {"f_prev": jnp.zeros_like(x)}

  def __call__(self, x, ffn, state, *, ctx, is_moe):
    del ctx, is_moe
    ffn(x, primary=False)
    f, _ = ffn(x + self.coefficient * state["f_prev"])
    return x + f, {"f_prev": f}


@pytest.fixture
def probe_components():
  ROUTERS.entries["contract_probe"] = "test_contract:ProbeRouter"
  STREAMS.entries["extrapolated"] = "test_contract:ExtrapolatedStream"
  yield
  del ROUTERS.entries["contract_probe"]
  del STREAMS.entries["extrapolated"]


def _probe_model(**kw):
  return build_model(dict(
      name="vit_moe", num_classes=3, patch_size=(4, 4), hidden_size=8,
      num_layers=4, num_heads=2, mlp_dim=8,
      moe=dict(layers=(0, 2, 3), num_experts=3, capacity_factor=4.0,
               group_size=10, router={"name": "contract_probe"}),
      stream={"name": "extrapolated"}, **kw))


def test_v2_router_and_stream_plug_in_train_under_jit_and_grad(
    probe_components):
  model = _probe_model()
  images = jax.random.uniform(jax.random.key(0), (4, 8, 8, 1))
  variables = jax.jit(model.init)(jax.random.key(1), images)
  params, state = variables["params"], {"router_state":
                                         variables["router_state"]}

  @jax.jit
  def step(params, state):
    def loss(p):
      (logits, metrics), new = model.apply(
          {"params": p, **state}, images, deterministic=False,
          update_state=True, mutable=["router_state", "intermediates"])
      return jnp.mean(logits**2) + metrics["auxiliary_loss"], new
    (value, new), grads = jax.value_and_grad(loss, has_aux=True)(params)
    return value, grads, new

  value, grads, new = step(params, state)
  assert np.isfinite(float(value))
  router_grad = grads["encoderblock_2"]["Moe"]["router"]["dense"]["kernel"]
  assert np.abs(np.asarray(router_grad)).sum() > 0
  sown = new["intermediates"]
  for block in ("encoderblock_0", "encoderblock_2", "encoderblock_3"):
    moe = sown[block]["Moe"]
    # The probe call sowed nothing and updated nothing: one entry each.
    assert len(moe["selected_experts"]) == 1
    assert len(moe["router"]["sent"]) == 1
    assert len(moe["router"]["stat"]) == 1
    stat = np.asarray(moe["router"]["stat"][0])
    np.testing.assert_allclose(new["router_state"][block]["Moe"]["router"]
                               ["ema"], (1 - BETA) * stat, rtol=1e-6)
  # (b) each layer received exactly what the previous MoE layer sent.
  for prev, block in (("encoderblock_0", "encoderblock_2"),
                      ("encoderblock_2", "encoderblock_3")):
    np.testing.assert_array_equal(
        sown[block]["Moe"]["router"]["received"][0],
        sown[prev]["Moe"]["router"]["sent"][0])
  assert "received" not in sown["encoderblock_0"]["Moe"]["router"]


def test_router_state_changes_only_when_asked(probe_components):
  model = _probe_model()
  images = jax.random.uniform(jax.random.key(0), (4, 8, 8, 1))
  variables = jax.jit(model.init)(jax.random.key(1), images)
  variables = jax.tree.map(lambda v: v + 0.25, variables)
  for deterministic in (True, False):
    _, new = jax.jit(lambda v, d=deterministic: model.apply(
        v, images, deterministic=d, rngs={"dropout": jax.random.key(2)},
        mutable=["router_state"]))(variables)
    chex.assert_trees_all_equal(new["router_state"],
                                variables["router_state"])
  _, new = jax.jit(lambda v: model.apply(
      v, images, deterministic=True, update_state=True,
      mutable=["router_state"]))(variables)
  assert not np.allclose(new["router_state"]["encoderblock_0"]["Moe"]
                         ["router"]["ema"], 0.25)


def test_router_state_reduced_over_the_data_axis_equals_one_device(
    probe_components):
  """Two data-parallel shards (vmap with an axis name) update the state to
  exactly the single-device value: the statistic is averaged over the axis."""
  images = jax.random.uniform(jax.random.key(0), (4, 8, 8, 1))
  single = _probe_model()
  variables = jax.jit(single.init)(jax.random.key(1), images)
  (logits, _), one = jax.jit(lambda v: single.apply(
      v, images, update_state=True, mutable=["router_state"]))(variables)
  sharded = _probe_model(state_axis_name="data")

  def shard_apply(x):
    (shard_logits, _), new = sharded.apply(variables, x, update_state=True,
                                           mutable=["router_state"])
    return shard_logits, new

  shard_logits, many = jax.jit(jax.vmap(shard_apply, axis_name="data"))(
      images.reshape(2, 2, 8, 8, 1))
  # Every shard holds the same (reduced) state, equal to one device's.
  for shard in range(2):
    chex.assert_trees_all_close(
        jax.tree.map(lambda v, s=shard: v[s], many["router_state"]),
        one["router_state"], rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(shard_logits.reshape(logits.shape), logits,
                             rtol=1e-5, atol=1e-6)


def test_expert_inputs_are_what_the_experts_see(probe_components):
  """With a non-zero state the layer's output is the naive MoE of `x*scale`."""
  router = ROUTERS.build({"name": "contract_probe"}, num_experts=3)
  layer = MoeLayer(router=router, hidden_size=5, group_size=4,
                   capacity_factor=2.0)
  x = jax.random.normal(jax.random.key(3), (2, 6, 4))
  variables = jax.jit(lambda k: layer.init(k, x, RoutingContext()))(
      jax.random.key(4))
  ema = jnp.array([0.5, -1.0, 2.0, 0.0])
  variables = {**variables, "router_state": {"router": {"ema": ema}}}
  (y, _, record), sown = jax.jit(lambda v: layer.apply(
      v, x, RoutingContext(), mutable=["intermediates"]))(variables)
  xg = np.asarray(x).reshape(3, 4, 4)
  w = np.asarray(variables["params"]["router"]["dense"]["kernel"])
  logits = xg @ w
  probs = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
  idx = np.argmax(probs, -1)[..., None]
  gates = np.take_along_axis(probs, idx, -1)
  scaled = xg / (1.0 + np.abs(np.asarray(ema)))
  cap = compute_capacity(4, 1, 2.0, 3)
  expected = naive.token_choice_moe(scaled, idx, gates,
                                    np.ones(idx.shape, bool), 3, cap,
                                    variables["params"]["Mlp"])
  np.testing.assert_allclose(np.asarray(y).reshape(expected.shape), expected,
                             rtol=2e-5, atol=2e-5)
  # The record is token-major [B, T, K], independent of the grouping.
  np.testing.assert_array_equal(record.assignment.expert_indices,
                                idx.reshape(2, 6, 1))


def test_v2_router_and_stream_checkpoint_and_resume_bit_identically(
    probe_components, tmp_path):
  def config():
    c = load_config("tiny")
    c.model.moe.router = {"name": "contract_probe"}
    c.model.stream = {"name": "extrapolated"}
    c.model.moe.layers = None
    c.model.moe.every = 1
    # SGD with momentum (optimizer state to resume) compiles ~1/3 faster
    # than the tiny config's AdamW; AdamW's resume is test_train_loop's.
    c.optimizer = ml_collections.ConfigDict(dict(
        name="sgd", learning_rate=0.1, momentum=0.9, warmup_steps=2,
        decay="cosine", total_steps=6))
    return short_schedule(c)

  _, state = straight_vs_resumed(config, tmp_path, stop_at_step=3)
  ema = state.collections["router_state"]["encoderblock_1"]["Moe"][
      "router"]["ema"]
  assert np.abs(np.asarray(ema)).sum() > 0  # Trained state, checkpointed.


def test_stream_blocks_moe_or_all(probe_components):
  """`blocks="moe"` leaves dense blocks plain; `"all"` routes them through
  the stream; a stream at coefficient 0 is exactly the plain residual."""
  base = dict(name="vit", num_classes=3, patch_size=(4, 4), hidden_size=8,
              num_layers=3, num_heads=2, mlp_dim=8)
  images = jax.random.uniform(jax.random.key(0), (2, 8, 8, 1))
  plain = build_model(base)
  variables = jax.jit(plain.init)(jax.random.key(1), images)
  # The head starts at zero; give it weights so logits see the encoder.
  head = variables["params"]["head"]
  head["kernel"] = jax.random.normal(jax.random.key(2), head["kernel"].shape)
  expected = plain.apply(variables, images)[0]

  def logits(**stream):
    model = build_model(dict(base, stream={"name": "extrapolated", **stream}))
    return model.apply(variables, images)[0]

  np.testing.assert_array_equal(logits(blocks="moe", coefficient=3.0),
                                expected)
  np.testing.assert_array_equal(logits(blocks="all", coefficient=0.0),
                                expected)
  assert not np.allclose(logits(blocks="all", coefficient=3.0), expected)


def test_a_stream_must_make_exactly_one_primary_call(probe_components):
  class TwoPrimaries(ResidualStream):
    def __call__(self, x, ffn, state, *, ctx, is_moe):
      ffn(x)
      f, _ = ffn(x)
      return x + f, state

  STREAMS.entries["two_primaries"] = TwoPrimaries
  try:
    model = build_model(dict(
        name="vit_moe", num_classes=3, patch_size=(4, 4), hidden_size=8,
        num_layers=2, num_heads=2, mlp_dim=8,
        moe=dict(every=1, num_experts=2), stream={"name": "two_primaries"}))
    with pytest.raises(ValueError, match="2 primary"):
      jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, 8, 8, 1)))
  finally:
    del STREAMS.entries["two_primaries"]


class MisreportingRouter(Router):
  """Top-2 routing (token s to experts s % E and (s + 1) % E) that reports
  `slots_per_token` 1 unless `declared` says otherwise, and leaves
  `auxiliary_loss` out of its metrics when `with_loss` is False."""
  declared: int = 1
  with_loss: bool = True

  @property
  def slots_per_token(self) -> int:
    return self.declared

  @nn.compact
  def __call__(self, x, ctx, *, capacity, deterministic, update_state=False):
    del ctx, capacity, deterministic, update_state
    g, s, _ = x.shape
    first = jnp.arange(s) % self.num_experts
    idx = jnp.broadcast_to(jnp.stack(
        [first, (first + 1) % self.num_experts], -1), (g, s, 2))
    metrics = {"importance_loss": jnp.zeros(())}
    if self.with_loss:
      metrics["auxiliary_loss"] = jnp.zeros(())
    return RouterOutput(TokenChoiceRouting.create(idx, jnp.ones((g, s, 2))),
                        metrics)


def _trace_layer(router):
  layer = MoeLayer(router=router, hidden_size=4, capacity_factor=1.0)
  x = jnp.ones((2, 6, 4))
  return jax.eval_shape(lambda: layer.init_with_output(
      jax.random.key(0), x, RoutingContext()))


def test_a_router_keeping_the_contract_traces():
  (_, metrics, record), _ = _trace_layer(
      MisreportingRouter(num_experts=4, declared=2))
  assert record.assignment.expert_indices.shape == (2, 6, 2)
  assert "auxiliary_loss" in metrics


def test_slots_per_token_must_be_the_routings_k():
  """Capacity is sized from `slots_per_token`: a router that selects K = 2
  but declares 1 is refused while tracing, naming both numbers."""
  with pytest.raises(RouterContractError,
                     match=r"MisreportingRouter .* K = 2 .* slots_per_token "
                     r"is 1"):
    _trace_layer(MisreportingRouter(num_experts=4))


def test_metrics_without_the_auxiliary_loss_are_refused():
  with pytest.raises(RouterContractError,
                     match=r"MisreportingRouter's metrics \['importance_loss'"
                     r"\] have no 'auxiliary_loss'"):
    _trace_layer(MisreportingRouter(num_experts=4, declared=2,
                                    with_loss=False))
