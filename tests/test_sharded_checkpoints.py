"""Sharded checkpoints move between meshes; resuming on a mesh is exact.

One subprocess with 8 fake CPU devices (`XLA_FLAGS` must be set before jax
is imported) runs a tiny V-MoE with 8 experts (`configs/tiny.py`), its expert
weights and their Adam moments split over the `expert` axis, and reports
each check; the tests below read its report:

  * resume: a (2, 4) run stopped at step 2 and resumed ends bit-identical to
    the uninterrupted run (`resume_check.straight_vs_resumed`);
  * moves: that run's checkpoint (saved on (2, 4)) is restored onto (4, 2)
    and saved again from there; the (4, 2) checkpoint is restored onto
    (8, 1), (1, 8) and one device, and one saved from one device is
    restored onto (1, 8): every restored state (params, optimizer and router
    state, RNG, step) equals the saved one exactly, laid out by the target
    mesh;
  * an incompatible model (4 experts instead of 8) is refused on a sharded
    mesh with a `ConfigError` naming the differing field.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from fake_devices import fake_devices_env

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)

_CHILD = textwrap.dedent("""
    import json, sys, time, traceback
    sys.path.insert(0, sys.argv[2])
    import flax.serialization
    import jax
    import ml_collections
    import numpy as np
    from resume_check import short_schedule, straight_vs_resumed
    from vmoe_ext.errors import ConfigError
    from vmoe_ext.sharding.partitioning import Partitioning
    from vmoe_ext.app import train as loop
    from vmoe_ext.train.checkpoints import CheckpointManager
    from vmoe_ext.train.config_files import load_config

    assert jax.device_count() == 8, jax.devices()
    tmp = sys.argv[1]
    EXPERT = "params/encoderblock_1/Moe/Mlp/Dense_0/kernel"
    report = {}

    def config(shape, num_experts=8):
      c = short_schedule(load_config("tiny"), total_steps=4)
      c.optimizer.warmup_steps = 1
      c.robustness = None
      c.data.eval_batch_size = 64
      c.model.moe.num_experts = num_experts
      c.sharding = ml_collections.ConfigDict({"shape": shape})
      return c

    def leaves(state):
      tree = flax.serialization.to_state_dict(state)
      return {jax.tree_util.keystr(p): np.asarray(
                  jax.random.key_data(x) if jax.dtypes.issubdtype(
                      x.dtype, jax.dtypes.prng_key) else x)
              for p, x in jax.tree_util.tree_leaves_with_path(tree)}

    def expert_layout(state):
      tree = flax.serialization.to_state_dict(state)
      kernel = tree["params"]["encoderblock_1"]["Moe"]["Mlp"]["Dense_0"][
          "kernel"]
      mesh = getattr(kernel.sharding, "mesh", None)
      return {"mesh": None if mesh is None else list(mesh.devices.shape),
              "devices": len(kernel.sharding.device_set),
              "distinct_shards": len({tuple((s.start, s.stop) for s in
                                            sh.index)
                                      for sh in kernel.addressable_shards}),
              "shard_shape": list(kernel.addressable_shards[0].data.shape)}

    def same(a, b):
      bad = [k for k in a if not np.array_equal(a[k], b[k])]
      assert a.keys() == b.keys() and not bad, bad[:5]

    def check(name, fn):
      start = time.time()
      try:
        report[name] = {"ok": True, **(fn() or {})}
      except Exception:  # Reported, not raised: the other checks go on.
        report[name] = {"ok": False, "error": traceback.format_exc()}
      report[name]["seconds"] = round(time.time() - start, 1)

    straight = f"{tmp}/resume/straight"
    reference = {}

    def resume():
      _, state = straight_vs_resumed(lambda: config((2, 4)),
                                     __import__("pathlib").Path(tmp)
                                     / "resume", stop_at_step=2)
      reference.update(leaves(state))
      return {"layout": expert_layout(state)}

    def restore(shape, workdir):
      run = loop.setup(config(shape), workdir)
      step = run.restore()
      run.checkpoints.close()
      assert step == 4, step
      same(reference, leaves(run.state))
      return run

    saved = {}

    def move_2x4_to_4x2():
      run = restore((4, 2), straight)
      saved["4x2"] = f"{tmp}/saved_4x2"
      run.checkpoints = CheckpointManager(
          f"{saved['4x2']}/checkpoints", save_every=0, keep=1,
          config_fingerprint=run.checkpoints.config_fingerprint)
      run.save()
      run.checkpoints.close()
      return {"layout": expert_layout(run.state)}

    def move_4x2_to(shape):
      return lambda: {"layout": expert_layout(
          restore(shape, saved["4x2"]).state)}

    def move_4x2_to_one_device():
      run = loop.setup(config((1, 8)), f"{tmp}/one_device")
      one = Partitioning.from_config({"shape": (1, 1)},
                                     devices=jax.devices()[:1])
      target = one.shard(run.state)
      manager = CheckpointManager(
          f"{saved['4x2']}/checkpoints", save_every=0, keep=1,
          config_fingerprint=run.checkpoints.config_fingerprint)
      state_dict, extra, step = manager.restore(
          flax.serialization.to_state_dict(target))
      manager.close()
      assert step == 4
      run.state = flax.serialization.from_state_dict(target, state_dict)
      same(reference, leaves(run.state))
      devices = {d for x in jax.tree.leaves(run.state)
                 for d in x.sharding.device_set}
      assert devices == {jax.devices()[0]}, devices
      run.data.train_iterator().set_state(extra["data"])
      run.save()  # From one device ...
      run.checkpoints.close()
      return {"layout": expert_layout(run.state)}

    def one_device_to_1x8():  # ... onto (1, 8).
      return {"layout": expert_layout(
          restore((1, 8), f"{tmp}/one_device").state)}

    def incompatible():
      run = loop.setup(config((2, 4), num_experts=4), straight)
      try:
        run.restore()
      except ConfigError as e:
        return {"field": e.field, "message": str(e)}
      finally:
        run.checkpoints.close()
      raise AssertionError("restored a checkpoint of another model")

    check("resume_2x4", resume)
    check("move_2x4_to_4x2", move_2x4_to_4x2)
    check("move_4x2_to_8x1", move_4x2_to((8, 1)))
    check("move_4x2_to_1x8", move_4x2_to((1, 8)))
    check("move_4x2_to_one_device", move_4x2_to_one_device)
    check("move_one_device_to_1x8", one_device_to_1x8)
    check("incompatible_model", incompatible)
    print(json.dumps(report))
""")


@pytest.fixture(scope="module")
def report(tmp_path_factory):
  tmp = tmp_path_factory.mktemp("sharded_checkpoints")
  env = fake_devices_env(8, CI="1")
  out = subprocess.run([sys.executable, "-c", _CHILD, str(tmp), TESTS],
                       cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=600)
  assert out.returncode == 0, out.stderr[-5000:]
  return json.loads(out.stdout.strip().splitlines()[-1])


def _ok(report, name):
  entry = report[name]
  assert entry["ok"], entry.get("error")
  return entry


def test_resume_on_a_mesh_is_bit_identical(report):
  layout = _ok(report, "resume_2x4")["layout"]
  # 8 experts over the 4 devices of the expert axis: 2 each.
  assert layout["mesh"] == [2, 4] and layout["distinct_shards"] == 4
  assert layout["shard_shape"][0] == 2


@pytest.mark.parametrize("name,mesh,distinct", [
    ("move_2x4_to_4x2", [4, 2], 2),
    ("move_4x2_to_8x1", [8, 1], 1),
    ("move_4x2_to_1x8", [1, 8], 8),
    ("move_one_device_to_1x8", [1, 8], 8),
])
def test_checkpoints_move_between_meshes(report, name, mesh, distinct):
  layout = _ok(report, name)["layout"]
  assert layout["mesh"] == mesh
  assert layout["devices"] == 8
  assert layout["distinct_shards"] == distinct
  assert layout["shard_shape"][0] == 8 // distinct


def test_checkpoint_restores_onto_one_device_and_saves_from_it(report):
  layout = _ok(report, "move_4x2_to_one_device")["layout"]
  assert layout["devices"] == 1 and layout["shard_shape"][0] == 8


def test_incompatible_model_is_refused_naming_the_field(report):
  entry = _ok(report, "incompatible_model")
  assert entry["field"] == "workdir"
  assert "model/moe/num_experts: checkpoint 8 vs config 4" in entry["message"]
  assert "incompatible config" in entry["message"]
