"""Block names (`vmoe_ext.naming`) and the deprecated aliases kept for
one release (old module paths, `MoeLayer(record=)`, `RoutingContext
(layer_index=)`)."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from vmoe_ext.models import build_model
from vmoe_ext import naming
from vmoe_ext.moe.contract import RoutingContext
from vmoe_ext.moe.layer import MoeLayer
from vmoe_ext.routers.registry import build_router


def test_block_names_round_trip():
  assert naming.param_name(3) == "encoderblock_3"
  assert naming.metric_key(3) == "layer_3"
  for block in (0, 7, 12):
    assert naming.block_index(naming.param_name(block)) == block
    assert naming.block_index(naming.metric_key(block)) == block
    assert naming.metric_key_of(naming.param_name(block)) == f"layer_{block}"
  for bad in ("encoderblock_", "layer_x", "Moe", "encoderblock_1/Moe",
              "xlayer_1"):
    with pytest.raises(ValueError):
      naming.block_index(bad)


def test_metric_keys_are_block_indices():
  # MoE layers on blocks 1 and 3 of 4: metrics `layer_1`, `layer_3` (block
  # indices, not MoE ordinals), params `encoderblock_0..3`.
  model = build_model(dict(
      name="vit_moe", num_classes=3, patch_size=(4, 4), hidden_size=8,
      num_layers=4, num_heads=2, mlp_dim=8,
      moe=dict(layers=(1, 3), num_experts=2,
               router=dict(name="noisy_topk", num_selected=1))))
  x = jnp.zeros((2, 8, 8, 1))
  # Shapes only: the names are all this checks.
  variables = jax.eval_shape(model.init, jax.random.key(0), x)
  assert sorted(variables["params"]) == sorted(
      [naming.param_name(i) for i in range(4)] + ["cls", "embedding",
                                                  "encoder_norm", "head",
                                                  "pos_embedding"])
  _, metrics = jax.eval_shape(model.apply, variables, x)
  assert {k for k in metrics if k != "auxiliary_loss"} == {"layer_1",
                                                          "layer_3"}
  assert "Moe" in variables["params"]["encoderblock_1"]
  assert "Mlp" in variables["params"]["encoderblock_0"]


def test_old_module_paths_reexport_the_new_objects():
  from vmoe_ext.moe import select
  from vmoe_ext.moe import top_k as old_select
  from vmoe_ext.routers import noisy_top_k
  from vmoe_ext.routers import topk as old_router
  assert old_select.top_k is select.partitionable_top_k
  assert old_select.partitionable_top_k is select.partitionable_top_k
  assert select.top_k is select.partitionable_top_k
  assert old_router.NoisyTopKRouter is noisy_top_k.NoisyTopKRouter
  assert old_router.noisy_top_k is noisy_top_k.noisy_top_k


def test_moe_layer_record_keyword_is_a_deprecated_alias_of_primary():
  layer = MoeLayer(router=build_router({"name": "noisy_topk"}, 2),
                   hidden_size=4)
  x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 3, 4)),
                  jnp.float32)
  variables = jax.jit(lambda x: layer.init(jax.random.key(0), x,
                                           RoutingContext()))(x)

  def apply(**flag):  # The warning is raised while tracing.
    return jax.jit(lambda v, x: layer.apply(
        v, x, RoutingContext(), mutable=["intermediates"], **flag))(
            variables, x)

  for primary in (True, False):
    new, sown_new = apply(primary=primary)
    with pytest.warns(DeprecationWarning, match="primary"):
      old, sown_old = apply(record=primary)
    np.testing.assert_array_equal(new[0], old[0])
    assert bool(sown_new) == bool(sown_old) == primary


def test_routing_context_layer_index_is_a_deprecated_alias_of_block():
  ctx = RoutingContext(block=2)
  assert ctx.layer_index == 2
  assert ctx.at_block(3).block == ctx.at_layer(3).block == 3
  with pytest.warns(DeprecationWarning, match="block"):
    old = RoutingContext(layer_index=4)
  assert old.block == 4
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    RoutingContext(block=4)  # The new keyword warns about nothing.
