"""The sharding building blocks on one device: mesh shapes, partition rules,
per-process rows, the partitionable top-k and the plans' drop counts.

(The multi-device equivalence runs are in `test_sharding.py`.)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from vmoe_ext.errors import ConfigError
from vmoe_ext.moe.dispatch import make_dispatch_plan
from vmoe_ext.moe.routing import TokenChoiceRouting
from vmoe_ext.moe.select import partitionable_top_k
from vmoe_ext.sharding.mesh import make_mesh, mesh_shape
from vmoe_ext.sharding.multihost import initialize, process_rows
from vmoe_ext.sharding.partitioning import Partitioning
from vmoe_ext.sharding.rules import check_rules, partition_specs, path_name


@pytest.mark.parametrize("shape,devices,expected", [
    ((-1, 1), 8, (8, 1)), ((1, -1), 8, (1, 8)), ((2, -1), 8, (2, 4)),
    ((4, 2), 8, (4, 2)), ((-1, 1), 1, (1, 1))])
def test_mesh_shape_resolves_the_free_axis(shape, devices, expected):
  assert mesh_shape(("data", "expert"), shape, devices) == expected


@pytest.mark.parametrize("axes,shape,devices,field", [
    (("data", "expert"), (4, 4), 8, "sharding.shape"),
    (("data", "expert"), (3, -1), 8, "sharding.shape"),
    (("data", "expert"), (-1, -1), 8, "sharding.shape"),
    (("data", "expert"), (0, 8), 8, "sharding.shape"),
    (("data", "expert"), (8,), 8, "sharding.shape"),
    (("data", "data"), (8, 1), 8, "sharding.axes"),
])
def test_mesh_shape_errors_name_the_field(axes, shape, devices, field):
  with pytest.raises(ConfigError) as e:
    mesh_shape(axes, shape, devices)
  assert e.value.field == field


def test_make_mesh_axes_are_auto_and_expert_axis_checked():
  mesh = make_mesh()
  assert mesh.axis_names == ("data", "expert")
  assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)
  with pytest.raises(ConfigError) as e:
    make_mesh({"expert_axis": "model"})
  assert e.value.field == "sharding.expert_axis"
  # One device: the MoE layers run unsplit.
  assert Partitioning.from_config(None).expert_parallel is None


def _state():
  """A TrainState-like tree: params, Adam moments, router state, step."""
  params = {"encoderblock_1": {"Moe": {
      "Mlp": {"Dense_0": {"kernel": jnp.zeros((4, 3, 5)),
                          "bias": jnp.zeros((4, 5))}},
      "router": {"dense": {"kernel": jnp.zeros((3, 4))}},
      "SharedMlp": {"Dense_0": {"kernel": jnp.zeros((3, 5))}}}},
            "head": {"kernel": jnp.zeros((3, 2))}}
  opt = optax.adam(1e-3).init(params)
  return {"params": params, "opt_state": opt,
          "collections": {"router_state": {"encoderblock_1": {"Moe": {
              "router": {"adjacency": jnp.zeros((4, 4))}}}}},
          "step": jnp.zeros((), jnp.int32)}


def test_default_rules_split_experts_and_their_moments_only():
  mesh = make_mesh()
  specs = partition_specs(_state(), mesh)
  flat = {path_name(p): s for p, s in
          jax.tree_util.tree_flatten_with_path(
              specs, is_leaf=lambda x: isinstance(x, P))[0]}
  split = sorted(name for name, spec in flat.items() if spec == P("expert"))
  assert split == sorted(
      f"{prefix}encoderblock_1/Moe/Mlp/Dense_0/{leaf}"
      for prefix in ("params/", "opt_state/0/mu/", "opt_state/0/nu/")
      for leaf in ("kernel", "bias"))
  replicated = [n for n, s in flat.items() if s == P()]
  assert "collections/router_state/encoderblock_1/Moe/router/adjacency" in (
      replicated)
  assert "params/encoderblock_1/Moe/SharedMlp/Dense_0/kernel" in replicated
  assert len(split) + len(replicated) == len(flat)


def test_default_rules_are_dropped_without_an_expert_axis():
  mesh = make_mesh({"axes": ("data",), "shape": (-1,), "expert_axis": None})
  specs = jax.tree.leaves(partition_specs(_state(), mesh),
                          is_leaf=lambda x: isinstance(x, P))
  assert all(s == P() for s in specs)


def test_first_matching_rule_wins():
  mesh = make_mesh()
  rules = ((r"Dense_0/bias$", (None, "data")), (r"/Moe/Mlp/", ("expert",)))
  specs = partition_specs(_state()["params"], mesh, rules)
  mlp = specs["encoderblock_1"]["Moe"]["Mlp"]["Dense_0"]
  assert mlp["bias"] == P(None, "data")
  assert mlp["kernel"] == P("expert")


@pytest.mark.parametrize("rules,field", [
    (((r"/Moe/Mlp/", ("model",)),), "sharding.rules[0][1]"),
    (((r"(", ("expert",)),), "sharding.rules[0][0]"),
    (((r"/Moe/Mlp/",),), "sharding.rules[0]"),
    (((r"x", "expert"),), "sharding.rules[0][1]"),
])
def test_bad_rules_name_the_rule(rules, field):
  with pytest.raises(ConfigError) as e:
    check_rules(rules, ("data", "expert"))
  assert e.value.field == field


def test_rule_longer_than_the_leaf_is_an_error():
  mesh = make_mesh()
  with pytest.raises(ConfigError) as e:
    partition_specs(_state()["params"], mesh,
                    ((r"head/kernel", (None, None, "data")),))
  assert e.value.field == "sharding.rules[0][1]"
  assert "head/kernel" in str(e.value)


def test_process_rows_takes_contiguous_shares():
  batch = {"image": np.arange(12).reshape(6, 2), "label": np.arange(6)}
  parts = [process_rows(batch, i, 3) for i in range(3)]
  np.testing.assert_array_equal(
      np.concatenate([p["image"] for p in parts]), batch["image"])
  np.testing.assert_array_equal(parts[1]["label"], [2, 3])
  assert process_rows(batch, 0, 1) == batch
  with pytest.raises(ConfigError) as e:
    process_rows(batch, 0, 4)
  assert e.value.field == "data.batch_size"


def test_initialize_needs_all_three_values_or_none():
  assert initialize() is False  # Single-process: nothing to start.
  with pytest.raises(ConfigError) as e:
    initialize("localhost:1234")
  assert e.value.field == "--coordinator_address"
  with pytest.raises(ConfigError) as e:
    initialize("localhost:1234", 2, 2)
  assert e.value.field == "--process_id"


def test_top_k_equals_lax_top_k_with_ties_and_gradients():
  x = jax.random.normal(jax.random.key(0), (3, 5, 8))
  x = x.at[0, 0, 2].set(x[0, 0, 5])  # A tie: the lower index comes first.
  x = x.at[1, 1, :].set(0.5)  # All tied.
  for k in (1, 2, 8):
    ref_v, ref_i = jax.lax.top_k(x, k)
    v, i = partitionable_top_k(x, k)
    np.testing.assert_array_equal(v, ref_v)
    np.testing.assert_array_equal(i, ref_i)
    w = jax.random.normal(jax.random.key(1), ref_v.shape)
    g_ref = jax.grad(lambda z: jnp.sum(jax.lax.top_k(z, k)[0] * w))(x)
    g = jax.grad(lambda z: jnp.sum(partitionable_top_k(z, k)[0] * w))(x)
    np.testing.assert_array_equal(g, g_ref)
  with pytest.raises(ValueError):
    partitionable_top_k(x, 9)


def test_drop_counts_give_the_drop_rate():
  # 2 groups of 3 tokens, top-2 of 2 experts, capacity 2: expert 0 gets 3
  # first choices in group 0 (one dropped); one choice is invalid.
  idx = jnp.array([[[0, 1], [0, 1], [0, 1]], [[1, 0], [0, 1], [1, 0]]])
  valid = jnp.ones(idx.shape, bool).at[1, 2, 1].set(False)
  routing = TokenChoiceRouting.create(idx, jnp.full(idx.shape, 0.5), valid)
  plan = make_dispatch_plan(routing, num_experts=2, group_size=3, capacity=2)
  assert float(plan.requested) == 11.0
  # Group 0: expert 0 gets 3 first choices (1 dropped), expert 1 gets 3
  # second choices (1 dropped). Group 1: expert 1 gets 2 first + 1 second
  # choice (1 dropped); expert 0 gets 2 choices.
  assert float(plan.dropped) == 3.0
  np.testing.assert_allclose(plan.drop_rate, 3 / 11)
