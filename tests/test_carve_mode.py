"""The binary's carve mode end to end: a tiny dense ViT run is carved, and the
evaluation and training modes load the carved checkpoint as is."""

from __future__ import annotations

import json
import os
import re

import flax
import jax
import ml_collections
import numpy as np
import pytest

import naive
from resume_check import short_schedule
from vmoe_ext import main
from vmoe_ext.carving.spec import CarveSpec, carved_model_config
from vmoe_ext.errors import ConfigError
from vmoe_ext.models import build_model
from vmoe_ext.train import checkpoint_params as ckpt_params
from vmoe_ext.app import train as loop
from vmoe_ext.train.checkpoints import CheckpointManager
from vmoe_ext.train.config_files import load_config
from vmoe_ext.train.initialization import identity_rules
from vmoe_ext.train.optimizer import make_optimizer
from vmoe_ext.train.state import TrainState
from vmoe_ext.app.schema import validate_config

CARVE = dict(num_experts=4, num_shared=1, num_activated=1, every=1,
             activation_markers=3, num_calibration=24, batch_size=16)


def _dense_config():
  config = load_config("tiny")
  config.model.name = "vit"
  config.model.moe = None
  config.robustness = None
  config.optimizer.warmup_steps = 1
  return short_schedule(config, total_steps=4)


def _carve_config(dense_dir, **changes):
  config = _dense_config()
  config.carve = ml_collections.ConfigDict(
      {**CARVE, "checkpoint_dir": dense_dir, **changes})
  return config


def _carved_model(config):
  spec = CarveSpec.from_config(config.carve)
  return carved_model_config(config.model.to_dict(), spec)


def _records(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


def _params(workdir, step=0):
  return ckpt_params.read_params(ckpt_params.state_directory(
      os.path.join(workdir, "checkpoints"), step))


@pytest.fixture(scope="module")
def carved(tmp_path_factory):
  """A dense run and two carvings of it (same data, two workdirs)."""
  root = tmp_path_factory.mktemp("carve")
  dense_dir = str(root / "dense")
  loop.train_and_evaluate(_dense_config(), dense_dir)
  config = _carve_config(dense_dir)
  dirs = [str(root / "carve_a"), str(root / "carve_b")]
  for workdir in dirs:
    main.run(config, workdir)
  return dense_dir, dirs, config


def test_carve_mode_writes_a_v_moe_checkpoint_and_a_report(carved):
  _, (workdir, again), config = carved
  records = _records(workdir)
  blocks = [r for r in records if r["split"] == "carve"]
  assert [r["block"] for r in blocks] == [0, 1]
  assert all(r["assignment_cost"] >= 0 and r["seconds"] > 0 for r in blocks)
  final = [r for r in records if r.get("final")]
  assert len(final) == 1 and final[0]["split"] == "test"
  assert final[0]["carve_seconds"] > 0
  assert any(r["split"] == "dense_test" for r in records)
  with open(os.path.join(workdir, "report.md")) as f:
    report = f.read()
  assert "Carving wall time" in report and "S1A1E4" in report
  assert "training_curves.png" not in report  # Nothing was trained.
  # The per-block table is rounded: 4 decimals for the rates.
  rows = [l for l in report.splitlines() if re.match(r"\| \d+ \| ", l)]
  assert rows and all(re.fullmatch(
      r"\| \d+ \| \d+\.\d\d \| [-\d.e+]+ \| (-|nan|\d\.\d{4}) \| "
      r"\d\.\d{4} \|", l) for l in rows), rows
  assert not os.path.exists(os.path.join(workdir, "training_curves.png"))
  params = _params(workdir)
  assert params["encoderblock_0/Moe/Mlp/Dense_0/kernel"].shape == (3, 16, 4)
  assert params["encoderblock_1/Moe/SharedMlp/Dense_0/kernel"].shape == (
      16, 4)
  assert not any("/Mlp/Dense_0" in p and "Moe" not in p for p in params)
  # Carving twice with the same data gives the same checkpoint.
  other = _params(again)
  assert sorted(other) == sorted(params)
  for path in params:
    np.testing.assert_array_equal(other[path], params[path], err_msg=path)


def test_evaluation_mode_loads_the_carved_checkpoint_as_is(carved, tmp_path):
  _, (workdir, _), config = carved
  evaluation = _dense_config()
  evaluation.model = ml_collections.ConfigDict(_carved_model(config))
  evaluation.robustness = load_config(os.path.join(
      os.path.dirname(__file__), "fast_tiny_config.py")).robustness
  evaluation.robustness.checkpoint_dir = workdir
  out = str(tmp_path / "eval")
  main.run(evaluation, out)
  final = [r for r in _records(out) if r.get("final")][0]
  carved_final = [r for r in _records(workdir) if r.get("final")][0]
  assert final["accuracy"] == carved_final["accuracy"]
  assert any(r["split"].startswith("adversarial") for r in _records(out))


def test_fine_tune_starts_from_the_carved_params_with_balancing(carved,
                                                                 tmp_path):
  _, (workdir, _), config = carved
  tune = _dense_config()
  tune.model = ml_collections.ConfigDict(_carved_model(config))
  tune.init = dict(workdir=workdir, step=0, rules=identity_rules())
  tune.optimizer.frozen = (r"encoderblock_1/Moe/router/.*",)
  run = loop.setup(tune, str(tmp_path / "tune"))
  run.checkpoints.close()
  saved = _params(workdir)
  for path, value in ckpt_params.flatten(jax.device_get(
      run.state.params)).items():
    np.testing.assert_array_equal(value, saved[path], err_msg=path)
  loop.train_and_evaluate(tune, str(tmp_path / "tune"))
  resumed = loop.setup(tune, str(tmp_path / "tune"))
  assert resumed.restore() == 4
  resumed.checkpoints.close()
  tuned = ckpt_params.flatten(jax.device_get(resumed.state.params))
  for path, value in tuned.items():  # The frozen router did not move.
    same = np.array_equal(value, saved[path])
    assert same == path.startswith("encoderblock_1/Moe/router/"), path
  biases = [np.asarray(b["Moe"]["router"]["bias"]) for b in
            resumed.state.collections["router_state"].values()]
  assert any(np.any(b != 0) for b in biases)  # Balancing moved the bias,
  for b in biases:  # by whole steps of gamma = 1e-3.
    np.testing.assert_allclose(b * 1e3, np.round(b * 1e3), atol=1e-4)


def _layer(flat, prefix):
  """`{"Dense_0": {"kernel": ..., ...}, ...}` of the params under prefix."""
  out = {}
  for path, value in flat.items():
    if path.startswith(prefix + "/"):
      layer, name = path[len(prefix) + 1:].split("/")
      out.setdefault(layer, {})[name] = np.asarray(value)
  return out


def test_random_split_carving_partitions_the_dense_mlps(carved, tmp_path):
  """The random split (S1A1E4: m = 16 / 4 = 4 units per expert) of each
  dense MLP: the units of the seeded permutation (seed + block, the first
  N_s m shared, then blocks of m) are exact column / row slices of the dense
  weights, together every unit once, so that all experts plus the shared
  one plus b_1 compute the dense MLP (NumPy, unit by unit); everything
  outside the MLPs is the dense checkpoint's; the routers are fresh."""
  dense_dir, _, _ = carved
  config = _carve_config(dense_dir, method="random")
  main.run(config, str(tmp_path / "random"))
  params = _params(str(tmp_path / "random"))
  steps = ckpt_params.checkpoint_steps(os.path.join(dense_dir, "checkpoints"))
  dense = _params(dense_dir, steps[-1])
  assert steps[-1] == 4
  tokens = np.random.default_rng(0).standard_normal((5, 16))
  for i in (0, 1):
    mlp = _layer(dense, f"encoderblock_{i}/Mlp")
    experts = _layer(params, f"encoderblock_{i}/Moe/Mlp")
    shared = _layer(params, f"encoderblock_{i}/Moe/SharedMlp")
    perm = np.random.default_rng(0 + i).permutation(16)  # carve.seed 0.
    groups = [np.sort(perm[:4])] + [np.sort(perm[4 * e:4 * e + 4])
                                    for e in (1, 2, 3)]
    slices = [(shared["Dense_0"]["kernel"], shared["Dense_0"]["bias"],
               shared["Dense_1"]["kernel"])] + [
                   (experts["Dense_0"]["kernel"][e],
                    experts["Dense_0"]["bias"][e],
                    experts["Dense_1"]["kernel"][e]) for e in range(3)]
    for units, (w0, b0, w1) in zip(groups, slices):
      np.testing.assert_array_equal(w0, mlp["Dense_0"]["kernel"][:, units])
      np.testing.assert_array_equal(b0, mlp["Dense_0"]["bias"][units])
      np.testing.assert_array_equal(w1, mlp["Dense_1"]["kernel"][units])
    assert sorted(np.concatenate(groups)) == list(range(16))
    np.testing.assert_array_equal(params[f"encoderblock_{i}/Moe/bias"],
                                  mlp["Dense_1"]["bias"])
    # b_1 once, in Moe/bias; no expert adds it again.
    assert "bias" not in experts["Dense_1"] and "bias" not in shared["Dense_1"]
    for v in tokens:
      summed = params[f"encoderblock_{i}/Moe/bias"].astype(np.float64) + (
          naive.mlp(shared, v) + sum(naive.mlp(experts, v, expert=e)
                                     for e in range(3)))
      np.testing.assert_allclose(summed, naive.mlp(mlp, v), rtol=1e-9,
                                 atol=1e-9)
    # A fresh router (no representative rows): LeCun-normal [D, 3].
    router = params[f"encoderblock_{i}/Moe/router/logits/dense/kernel"]
    assert router.shape == (16, 3)
  for path, value in dense.items():
    if "/Mlp/" not in path:
      np.testing.assert_array_equal(params[path], value, err_msg=path)


def _save_moe_checkpoint(workdir):
  params = {"encoderblock_0": {"Moe": {"Mlp": {"Dense_0": {
      "kernel": np.zeros((2, 3, 4), np.float32)}}}}}
  tx = make_optimizer(dict(name="adam", learning_rate=0.1, warmup_steps=0,
                           total_steps=10))
  with CheckpointManager(os.path.join(workdir, "checkpoints"), save_every=1,
                         keep=1, config_fingerprint={"run": "moe"}) as mgr:
    state = TrainState.create({"params": params}, tx, jax.random.key(0))
    mgr.save(1, flax.serialization.to_state_dict(state),
             {"data": {"epoch": 0, "index": 0}}, force=True)


@pytest.mark.parametrize("case", ["missing", "moe", "too_many_images",
                                  "not_dense_model"])
def test_bad_carve_input_names_the_field(carved, tmp_path, case):
  dense_dir, _, _ = carved
  field = "carve.checkpoint_dir"
  config = _carve_config(dense_dir)
  if case == "missing":
    config.carve.checkpoint_dir = str(tmp_path / "nowhere")
  elif case == "moe":
    _save_moe_checkpoint(str(tmp_path / "moe"))
    config.carve.checkpoint_dir = str(tmp_path / "moe")
  elif case == "too_many_images":
    config.carve.num_calibration = 10_000
    field = "carve.num_calibration"
  else:
    config.model = load_config("tiny").model
    field = "model.name"
  with pytest.raises(ConfigError) as e:
    main.run(config, str(tmp_path / "out"))
  assert e.value.field == field, e.value
  assert not os.path.exists(tmp_path / "out" / "checkpoints")


@pytest.mark.parametrize("arg", ["", "S2A2E8,random", "S1A3E8,l1,swiglu",
                                 "S1A1E8,relu", "S1A1E8,evaluate",
                                 "S1A1E8,finetune,freeze_router",
                                 "S2A2E8,finetune,freeze_router_kernel",
                                 "S2A2E8,swiglu,finetune"])
def test_carve_configs_validate(arg):
  config = load_config("carve", arg)
  validate_config(config)
  if "evaluate" in arg or "finetune" in arg:
    assert config.model.moe.router.name == "cmoe"
    build_model(config.model)
  else:
    CarveSpec.from_config(config.carve).check(config.model.to_dict())
