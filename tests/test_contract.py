"""The router contract: a new router plugs into the model with one registry line.

Two test-only routers exercise what later routers need: reading the previous
MoE layer's routing from the `RoutingContext` (ACMoE) and keeping persistent,
non-parameter state in its own variable collection (Symphony).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from vmoe_ext.models import build_model
from vmoe_ext.moe.routing import TokenChoiceRouting
from vmoe_ext.routers.base import Router, RouterOutput
from vmoe_ext.routers.registry import ROUTERS


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
  variables = model.init(jax.random.key(0), images)
  assert int(variables["router_state"]["encoderblock_2"]["Moe"]["router"]
             ["calls"]) == 0
  (_, _), state = model.apply(variables, images, deterministic=False,
                              update_state=True,
                              mutable=["intermediates", "router_state"])
  sown = state["intermediates"]
  first = sown["encoderblock_0"]["Moe"]["selected_experts"][0]
  np.testing.assert_array_equal(first[..., 0],
                                np.broadcast_to(np.arange(5) % 3, (2, 5)))
  for block in ("encoderblock_2", "encoderblock_3"):
    np.testing.assert_array_equal(sown[block]["Moe"]["selected_experts"][0],
                                  first)
    assert int(state["router_state"][block]["Moe"]["router"]["calls"]) == 1
