"""The one evaluation forward pass (`vmoe_ext.train.forward`) against a plain
`model.apply`, on one device and (in a subprocess) on a mesh of 8 CPU
devices; and the users built on it (eval step, Evaluator, routing analysis)
against the same reference."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fake_devices import fake_devices_env

from vmoe_ext.evaluate.evaluator import Evaluator
from vmoe_ext.evaluate.routing_analysis import (make_routing_forward,
                                                top1_experts)
from vmoe_ext.models import build_model
from vmoe_ext.train import steps
from vmoe_ext.train.forward import Forward, forward_pass, moe_intermediates
from vmoe_ext.train.state import TrainState

MEAN, STD = 0.3, 0.4
MODEL = dict(name="vit_moe", num_classes=7, patch_size=(4, 4),
             hidden_size=16, num_layers=4, num_heads=2, mlp_dim=16,
             moe=dict(layers=(1, 3), num_experts=4, capacity_factor=1.0,
                      group_size=10, router={"name": "noisy_topk",
                                            "num_selected": 2}))


@pytest.fixture(scope="module")
def setup():
  model = build_model(MODEL)
  rng = np.random.default_rng(0)
  images = rng.uniform(size=(8, 8, 8, 1)).astype(np.float32)
  labels = rng.integers(0, 7, 8).astype(np.int32)
  variables = jax.jit(model.init)(jax.random.key(0), images)
  variables = {k: v for k, v in variables.items() if k != "intermediates"}
  variables["params"] = jax.jit(lambda p: jax.tree.map(
      # A non-trivial head and routers.
      lambda v: v + 0.3 * jax.random.normal(jax.random.key(2), v.shape),
      p))(variables["params"])
  return model, variables, images, labels


def _reference(model, variables, x):
  """`model.apply` by hand: deterministic, with the sown intermediates
  (jitted: one compilation, not op-by-op eager ones)."""
  (logits, metrics), state = jax.jit(lambda v, x: model.apply(
      v, x, deterministic=True, mutable=["intermediates"]))(variables, x)
  return logits, metrics, state["intermediates"]


def test_forward_pass_is_model_apply(setup):
  model, variables, images, _ = setup
  logits, metrics, sown = _reference(model, variables, images)
  # Jitted like `_reference`: one compilation each, not op-by-op eager ones.
  out = jax.jit(lambda v, x: forward_pass(model, v, x, intermediates=True))(
      variables, images)
  np.testing.assert_array_equal(out.logits, logits)
  jax.tree.map(np.testing.assert_array_equal, out.metrics, metrics)
  assert sorted(out.moe) == ["encoderblock_1", "encoderblock_3"]
  for block, values in out.moe.items():
    for name in ("expert_mask", "selected_experts", "moe_input"):
      np.testing.assert_array_equal(values[name],
                                    sown[block]["Moe"][name][0])
  # Without intermediates: against `model.apply` without them, in one
  # program (a program with other outputs may fuse, so round, differently).
  plain, applied = jax.jit(lambda v, x: (
      forward_pass(model, v, x),
      model.apply(v, x, deterministic=True)[0]))(variables, images)
  np.testing.assert_array_equal(plain.logits, applied)
  assert plain.moe == {}
  # Dense blocks sow nothing of the MoE layer's and are left out.
  assert moe_intermediates({"encoderblock_0": {"Attention": {}},
                            "head": ()}) == {}


def test_normalisation_and_jit_on_one_device(setup):
  model, variables, images, _ = setup
  fwd = Forward(model, mean=MEAN, std=STD)
  want = jax.jit(lambda v, x: model.apply(
      v, (x - jnp.float32(MEAN)) / jnp.float32(STD),
      deterministic=True))(variables, images)
  got = fwd.jit(lambda v, x: fwd.apply(v, x).logits)(variables, images)
  np.testing.assert_array_equal(got, want[0])
  # In one program with the reference (the same outputs: the same fusion).
  (logits, aux), (want_logits, want_metrics) = fwd.jit(lambda v, x: (
      fwd.logits_and_aux(v, x),
      model.apply(v, (x - jnp.float32(MEAN)) / jnp.float32(STD),
                  deterministic=True)))(variables, images)
  np.testing.assert_array_equal(logits, want_logits)
  np.testing.assert_array_equal(aux, want_metrics["auxiliary_loss"])
  # No mean/std: the images as they are.
  np.testing.assert_array_equal(*jax.jit(lambda v, x: (  # One compilation.
      Forward(model).logits(v, x),
      model.apply(v, x, deterministic=True)[0]))(variables, images))
  with pytest.raises(ValueError, match="both mean and std"):
    Forward(model, mean=MEAN)


def test_users_of_the_forward_pass_agree_with_model_apply(setup):
  model, variables, images, labels = setup
  normalised = (images - np.float32(MEAN)) / np.float32(STD)
  logits, _, sown = _reference(model, variables, normalised)
  logits = np.asarray(logits)
  # Evaluator (raw images): logits and expert masks.
  evaluator = Evaluator(model, variables, MEAN, STD)
  got, masks = evaluator.forward(images)
  np.testing.assert_allclose(got, logits, rtol=1e-5, atol=1e-5)
  for block, mask in masks.items():
    np.testing.assert_array_equal(mask, sown[block]["Moe"]["expert_mask"][0])
  # Eval step (normalised images): top-1/top-5 counts and summed loss.
  state = TrainState.create(variables, optax.sgd(0.1), jax.random.key(1))
  mask = np.arange(8) < 6
  sums = jax.jit(steps.make_eval_step(model))(
      state, {"image": normalised, "label": labels, "mask": mask})
  order = np.argsort(-logits, -1, kind="stable")
  assert float(sums["correct_top1"]) == np.sum((order[:, 0] == labels)[mask])
  assert float(sums["correct_top5"]) == np.sum(
      np.any(order[:, :5] == labels[:, None], -1)[mask])
  z = logits.astype(np.float64)
  logp = z - z.max(-1, keepdims=True)
  logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
  np.testing.assert_allclose(
      float(sums["loss"]), -np.sum(logp[np.arange(8), labels][mask]),
      rtol=1e-5)
  # Routing analysis forward: assignment counts and top-1 experts.
  forward = make_routing_forward(model)
  out = forward(variables, normalised, mask, np.arange(5, dtype=np.int32))
  for block in ("encoderblock_1", "encoderblock_3"):
    moe = sown[block]["Moe"]
    layer = "layer_" + block.rsplit("_", 1)[1]
    want = np.sum(np.asarray(moe["expert_mask"][0]) & mask[:, None, None],
                  axis=(0, 1))
    np.testing.assert_array_equal(out[layer]["assignments"], want)
    np.testing.assert_array_equal(
        out[layer]["top1"], top1_experts(moe["expert_mask"][0],
                                         moe["selected_experts"][0]))
    x = np.asarray(moe["moe_input"][0]).reshape(-1, 16)
    np.testing.assert_allclose(out[layer]["samples"], x[:5], rtol=1e-5,
                               atol=1e-6)


_MESH = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, sys.argv[1])
    import jax, jax.numpy as jnp, numpy as np
    from test_forward import MEAN, MODEL, STD
    from vmoe_ext.evaluate.evaluator import Evaluator
    from vmoe_ext.evaluate.routing_analysis import make_routing_forward
    from vmoe_ext.models import build_model
    from vmoe_ext.sharding.partitioning import Partitioning
    from vmoe_ext.train.forward import Forward
    jax.config.update("jax_default_matmul_precision", "highest")
    assert jax.device_count() == 8
    part = Partitioning.from_config({"shape": (4, 2)})
    one, many = build_model(MODEL), build_model(MODEL, part.expert_parallel)
    rng = np.random.default_rng(0)
    images = rng.uniform(size=(16, 8, 8, 1)).astype(np.float32)
    labels = rng.integers(0, 7, 16).astype(np.int32)
    variables = jax.jit(one.init)(jax.random.key(0), images[:8])
    variables = {k: v for k, v in variables.items() if k != "intermediates"}
    variables["params"] = jax.tree.map(
        lambda v: v + 0.3 * jax.random.normal(jax.random.key(2), v.shape),
        variables["params"])
    sharded = part.shard(variables)
    out = {}
    fwd = Forward(many, mean=MEAN, std=STD, partitioning=part)
    fn = fwd.jit(lambda v, x, idx: (fwd.apply(v, x).logits, x[idx, 0, 0, 0]),
                 replicated=(1,))
    logits, picked = fn(sharded, images, np.arange(8, dtype=np.int32))
    out["replicated"] = bool(logits.sharding.is_fully_replicated
                             and picked.sharding.is_fully_replicated)
    # A jax array goes in like host data (same sharding: one compilation).
    again, _ = fn(sharded, jax.device_put(images, part.replicated),
                  np.arange(8, dtype=np.int32))
    out["again_equal"] = bool(np.array_equal(again, logits))
    out["picked"] = np.asarray(picked).tolist()
    want = jax.jit(lambda v, x: one.apply(v, (x - MEAN) / STD,
                                          deterministic=True)[0])(
        variables, images)
    out["logits_diff"] = float(np.max(np.abs(np.asarray(logits) - want)))
    # The evaluator and its attack, on the mesh and on one device.
    ev_many = Evaluator(many, sharded, MEAN, STD, part)
    ev_one = Evaluator(one, variables, MEAN, STD)
    # L2 steps: continuous in the gradient (a sign would amplify rounding).
    attack = {"name": "pgd", "eps": 0.5, "steps": 2, "norm": "l2",
              "random_start": False}
    adv = [ev.attack(attack)(images, labels, jax.random.key(3))
           for ev in (ev_many, ev_one)]
    out["attack_diff"] = float(np.max(np.abs(np.asarray(adv[0])
                                             - np.asarray(adv[1]))))
    masks = [ev.forward(images)[1] for ev in (ev_many, ev_one)]
    out["masks_equal"] = all(np.array_equal(masks[0][b], masks[1][b])
                             for b in masks[1])
    # The routing analysis' forward: counts, top-1, sampled tokens.
    valid = np.arange(16) < 13
    index = np.arange(0, 40, 5, dtype=np.int32)
    r = [make_routing_forward(m, p)(v, (images - MEAN) / STD, valid, index)
         for m, p, v in ((many, part, sharded), (one, None, variables))]
    out["routing_equal"] = all(
        np.array_equal(r[0][l][k], r[1][l][k])
        for l in r[1] for k in ("assignments", "top1"))
    out["samples_diff"] = max(float(np.max(np.abs(
        np.asarray(r[0][l]["samples"]) - r[1][l]["samples"]))) for l in r[1])
    print(json.dumps(out))
""")


def test_forward_on_a_mesh_of_eight_devices_matches_one_device():
  here = os.path.dirname(os.path.abspath(__file__))
  env = fake_devices_env(8)
  proc = subprocess.run([sys.executable, "-c", _MESH, here], env=env,
                        capture_output=True, text=True, timeout=900,
                        check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  out = json.loads(proc.stdout.strip().splitlines()[-1])
  assert out["replicated"] and out["again_equal"]
  images = np.random.default_rng(0).uniform(size=(16, 8, 8, 1)).astype(
      np.float32)
  np.testing.assert_array_equal(out["picked"], images[:8, 0, 0, 0])
  assert out["logits_diff"] < 1e-5
  assert out["attack_diff"] < 1e-5
  assert out["masks_equal"] and out["routing_equal"]
  assert out["samples_diff"] < 1e-5
