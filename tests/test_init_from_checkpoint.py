"""Initialising params from another run's checkpoint by regex mapping rules."""

from __future__ import annotations

import os

import flax
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from vmoe_ext.errors import ConfigError
from vmoe_ext.models import build_model
from vmoe_ext.train import checkpoint_params as ckpt_params
from vmoe_ext.train import initialization as init_lib
from vmoe_ext.train.checkpoints import CheckpointManager
from vmoe_ext.train.optimizer import make_optimizer
from vmoe_ext.train.state import TrainState


def _arange(shape, offset=0.0):
  return jnp.arange(np.prod(shape), dtype=jnp.float32).reshape(shape) + offset


def _source(offset=0.0):
  """A dense source model's params."""
  return {"dense": {"kernel": _arange((3, 4), offset),
                    "bias": _arange((4,), offset)},
          "emb": {"w": _arange((2, 3), offset)},
          "head": {"kernel": _arange((3, 5), offset)}}


def _target():
  """A new model: 2 experts in place of `dense`, a new head and a new param."""
  return {"moe": {"kernel": jnp.full((2, 3, 4), -1.0),
                  "bias": jnp.full((2, 4), -1.0)},
          "emb": {"w": jnp.full((2, 3), -1.0, jnp.bfloat16)},
          "head": {"kernel": jnp.full((3, 7), -1.0)},
          "new": {"x": jnp.full((2,), -1.0)}}


def _save(workdir, params_by_step):
  """Saves train states the way the training loop does."""
  tx = make_optimizer(dict(name="adam", learning_rate=0.1, warmup_steps=0,
                           total_steps=10))
  with CheckpointManager(os.path.join(workdir, "checkpoints"), save_every=1,
                         keep=10, config_fingerprint={"run": "source"}) as mgr:
    for step, params in params_by_step.items():
      state = TrainState.create({"params": params}, tx, jax.random.key(step))
      state = state.replace(step=jnp.asarray(step, jnp.int32))
      mgr.save(step, flax.serialization.to_state_dict(state),
               {"data": {"epoch": 0, "index": step}}, force=True)
  return str(workdir)


RULES = [
    (r"head/.*", None),
    (r"moe/(.*)", r"dense/\1"),
    (r"emb/(?P<name>.*)", r"emb/\g<name>"),
    (r"emb/w", r"dense/bias"),  # shadowed by the rule before it
]


def test_mapping_tiling_fresh_and_unmatched(tmp_path):
  workdir = _save(tmp_path, {1: _source()})
  fresh = _target()
  before = jax.tree.map(np.array, fresh)
  params, report = init_lib.load_init_params(
      dict(workdir=workdir, step=None, rules=RULES), fresh)
  src = _source()
  # Same structure, shapes and dtypes; the input is untouched.
  assert jax.tree.structure(params) == jax.tree.structure(fresh)
  assert jax.tree.map(lambda x: (x.shape, x.dtype), params) == \
      jax.tree.map(lambda x: (x.shape, x.dtype), fresh)
  jax.tree.map(np.testing.assert_array_equal, fresh, before)
  # Tiled to both experts.
  for e in range(2):
    np.testing.assert_array_equal(params["moe"]["kernel"][e],
                                  src["dense"]["kernel"])
    np.testing.assert_array_equal(params["moe"]["bias"][e],
                                  src["dense"]["bias"])
  assert isinstance(params["moe"]["kernel"], jax.Array)
  assert params["moe"]["kernel"].sharding == fresh["moe"]["kernel"].sharding
  # Named group; cast to the new model's dtype.
  assert params["emb"]["w"].dtype == jnp.bfloat16
  np.testing.assert_array_equal(params["emb"]["w"],
                                src["emb"]["w"].astype(jnp.bfloat16))
  # Kept fresh (by rule / by no rule): the very same arrays.
  assert params["head"]["kernel"] is fresh["head"]["kernel"]
  assert params["new"]["x"] is fresh["new"]["x"]
  assert report.step == 1 and report.workdir == workdir
  assert report.loaded == {"moe/kernel": "dense/kernel",
                           "moe/bias": "dense/bias", "emb/w": "emb/w"}
  assert report.tiled == {"moe/kernel": 2, "moe/bias": 2}
  assert report.fresh == ("head/kernel",)
  assert report.unmatched == ("new/x",)
  assert report.shadowed_rules == (3,)
  assert report.unused_source == ("head/kernel",)
  summary = report.summary()
  assert "3 params loaded" in summary and "new/x" in summary


def test_step_selection_and_config_dict(tmp_path):
  workdir = _save(tmp_path, {1: _source(0.0), 3: _source(100.0)})
  rules = [(r"moe/(.*)", r"dense/\1"), (r"(emb/.*)", r"\1")]
  newest, report = init_lib.load_init_params(
      ml_collections.ConfigDict(dict(workdir=workdir, step=None,
                                     rules=rules)), _target())
  assert report.step == 3
  np.testing.assert_array_equal(newest["moe"]["bias"][1],
                                _source(100.0)["dense"]["bias"])
  older, report = init_lib.load_init_params(
      dict(workdir=workdir, step=1, rules=rules), _target())
  assert report.step == 1
  np.testing.assert_array_equal(older["moe"]["bias"][1],
                                _source(0.0)["dense"]["bias"])
  # Numpy params stay numpy.
  numpy_target = jax.tree.map(np.asarray, _target())
  out, _ = init_lib.load_init_params(
      dict(workdir=workdir, step=1, rules=rules), numpy_target)
  assert isinstance(out["moe"]["kernel"], np.ndarray)


def test_read_params_reads_only_params_as_numpy(tmp_path):
  workdir = _save(tmp_path, {2: _source()})
  directory = os.path.join(workdir, "checkpoints")
  assert ckpt_params.checkpoint_steps(directory) == [2]
  state_dir = ckpt_params.state_directory(directory, 2)
  shapes = ckpt_params.param_shapes(state_dir)
  assert {p: s for p, (s, _) in shapes.items()} == {
      "dense/kernel": (3, 4), "dense/bias": (4,), "emb/w": (2, 3),
      "head/kernel": (3, 5)}
  values = ckpt_params.read_params(state_dir, ["emb/w"])
  assert list(values) == ["emb/w"]
  assert isinstance(values["emb/w"], np.ndarray)
  np.testing.assert_array_equal(values["emb/w"], _source()["emb"]["w"])
  with pytest.raises(KeyError, match="nope"):
    ckpt_params.read_params(state_dir, ["nope"])


def test_relative_workdirs_are_read_from_the_cwd(tmp_path, monkeypatch):
  """orbax takes absolute paths only: `init.workdir="src"` (and the carve
  mode's `carve.checkpoint_dir`) are relative to the working directory."""
  _save(tmp_path / "src", {2: _source()})
  monkeypatch.chdir(tmp_path)
  state_dir = ckpt_params.state_directory(os.path.join("src", "checkpoints"),
                                          2)
  assert ckpt_params.param_shapes(state_dir)["emb/w"][0] == (2, 3)
  params, report = init_lib.load_init_params(
      dict(workdir="src", step=None, rules=OK), _target())
  np.testing.assert_array_equal(params["emb"]["w"],
                                _source()["emb"]["w"].astype(jnp.bfloat16))
  assert report.step == 2


OK = [(r"moe/(.*)", r"dense/\1"), (r"(emb/.*)", r"\1")]

ERRORS = {
    "bad_regex": (dict(rules=[(r"moe/(", r"dense/\1")]),
                  "init.rules[0]", "bad target regex"),
    "not_a_pair": (dict(rules=OK + [("emb/w",)]), "init.rules[2]",
                   "pair"),
    "replacement_type": (dict(rules=[("emb/w", 3)]), "init.rules[0]",
                         "string or None"),
    "empty_rules": (dict(rules=[]), "init.rules", "empty"),
    "rules_not_a_sequence": (dict(rules="(.*)"), "init.rules", "sequence"),
    "matches_nothing": (dict(rules=OK + [(r"encoder/.*", None)]),
                        "init.rules[2]", "matches no parameter"),
    "partial_match_only": (dict(rules=OK + [(r"head", None)]),
                           "init.rules[2]", "matches no parameter"),
    "bad_group": (dict(rules=[(r"moe/(.*)", r"dense/\2")]), "init.rules[0]",
                  "bad source replacement"),
    "missing_source": (dict(rules=[(r"moe/(.*)", r"dence/\1")]),
                       "init.rules[0]",
                       "dence/kernel, which is not in the checkpoint; close "
                       "matches: dense/kernel"),
    "shape_mismatch": (dict(rules=OK + [(r"(head/.*)", r"\1")]),
                       "init.rules[2]",
                       r"head/kernel [3, 7] to head/kernel [3, 5]"),
    "tile_needs_leading_axis": (dict(rules=[(r"emb/w", r"dense/bias")]),
                                "init.rules[0]", "[2, 3] to dense/bias [4]"),
    "no_workdir": (dict(workdir="MISSING"), "init.workdir", "does not exist"),
    "workdir_type": (dict(workdir=None), "init.workdir", "directory path"),
    "no_checkpoint": (dict(workdir="EMPTY"), "init.workdir",
                      "has no checkpoint"),
    "checkpoints_dir_given": (dict(workdir="CHECKPOINTS"), "init.workdir",
                              "give the run's workdir"),
    "step_not_found": (dict(step=2), "init.step",
                       "available steps: [1, 3]"),
    "step_type": (dict(step="3"), "init.step", "integer step or None"),
}


@pytest.mark.parametrize("case", sorted(ERRORS))
def test_errors_name_the_field(tmp_path, monkeypatch, case):
  workdir = _save(tmp_path / "run", {1: _source(), 3: _source()})
  (tmp_path / "empty").mkdir()
  overrides, field, message = ERRORS[case]
  config = dict(workdir=workdir, step=None, rules=OK)
  config.update(overrides)
  config["workdir"] = {
      "MISSING": str(tmp_path / "missing"), "EMPTY": str(tmp_path / "empty"),
      "CHECKPOINTS": os.path.join(workdir, "checkpoints"),
  }.get(config["workdir"], config["workdir"])

  def no_data(*args, **kwargs):
    raise AssertionError("array data read before the config was checked")

  monkeypatch.setattr(ckpt_params, "read_params", no_data)
  with pytest.raises(ConfigError) as info:
    init_lib.load_init_params(config, _target())
  assert info.value.field == field
  assert message in info.value.reason, info.value.reason


def test_unreadable_checkpoint_names_the_step(tmp_path):
  workdir = _save(tmp_path, {1: _source()})
  state_dir = ckpt_params.state_directory(
      os.path.join(workdir, "checkpoints"), 1)
  for root, _, files in os.walk(state_dir):
    for name in files:
      with open(os.path.join(root, name), "wb") as f:
        f.write(b"garbage")
  with pytest.raises(ConfigError, match="unreadable") as info:
    init_lib.load_init_params(dict(workdir=workdir, step=1, rules=OK),
                              _target())
  assert info.value.field == "init.step"


# ---------------------------------------------------------------- end to end

BASE = dict(num_classes=5, patch_size=(4, 4), hidden_size=16, num_layers=3,
            num_heads=2, mlp_dim=24)
IMAGES = jax.random.uniform(jax.random.key(42), (2, 8, 8, 1))


def _moe_model(num_experts):
  return build_model(dict(name="vit_moe", **BASE, moe=dict(
      every=1, num_experts=num_experts, capacity_factor=1.0,
      router={"name": "noisy_topk", "num_selected": 1,
              "renormalize_gates": True})))


def _random_params(model, seed):
  """Params of `model`, all random (no zero-initialised head or biases).

  Drawn with numpy from the abstract shapes: compiling `model.init` takes
  many seconds on a small CPU.
  """
  shapes = jax.eval_shape(model.init, jax.random.key(0), IMAGES)["params"]
  leaves, treedef = jax.tree.flatten(shapes)
  rng = np.random.default_rng(seed)
  return treedef.unflatten([
      jnp.asarray(0.1 * rng.standard_normal(x.shape), x.dtype)
      for x in leaves])


def test_dense_vit_to_single_expert_vmoe_gives_the_same_logits(tmp_path):
  dense = build_model(dict(name="vit", **BASE))
  dense_params = _random_params(dense, 0)
  workdir = _save(tmp_path, {7: dense_params})
  moe = _moe_model(1)
  fresh = _random_params(moe, 1)
  params, report = init_lib.load_init_params(
      dict(workdir=workdir, step=None,
           rules=init_lib.dense_to_moe_rules()), fresh)
  # Only the routers keep their fresh initialisation.
  assert report.fresh and all("/Moe/router/" in p for p in report.fresh)
  assert not report.unmatched and not report.unused_source
  assert set(report.tiled) == {p for p in report.loaded if "/Moe/Mlp/" in p}
  assert len(report.tiled) == 4 * BASE["num_layers"]
  dense_logits, _ = jax.jit(dense.apply)({"params": dense_params}, IMAGES)
  moe_logits, metrics = jax.jit(moe.apply)({"params": params}, IMAGES)
  assert float(metrics["layer_0"]["drop_rate"]) == 0.0
  # Two different programs (the MoE one adds a one-hot dispatch and combine,
  # exact multiplications by 1 and additions of 0): equal up to the order in
  # which XLA sums the MLP's products, a few float32 ulps.
  np.testing.assert_allclose(moe_logits, dense_logits, rtol=4 * 2.0**-23,
                             atol=0)


def test_dense_vit_initialises_every_expert(tmp_path):
  dense_params = _random_params(build_model(dict(name="vit", **BASE)), 0)
  workdir = _save(tmp_path, {1: dense_params})
  fresh = _random_params(_moe_model(4), 1)
  params, report = init_lib.load_init_params(
      dict(workdir=workdir, step=1,
           rules=init_lib.dense_to_moe_rules(fresh=[r"head/.*"])), fresh)
  assert set(report.tiled.values()) == {4}
  assert {"head/kernel", "head/bias"} <= set(report.fresh)
  expert = params["encoderblock_2"]["Moe"]["Mlp"]["Dense_1"]["kernel"]
  dense = dense_params["encoderblock_2"]["Mlp"]["Dense_1"]["kernel"]
  assert expert.shape == (4,) + dense.shape
  for e in range(4):
    np.testing.assert_array_equal(expert[e], dense)
  np.testing.assert_array_equal(
      params["encoderblock_0"]["Attention"]["query"]["kernel"],
      dense_params["encoderblock_0"]["Attention"]["query"]["kernel"])
  assert params["head"]["kernel"] is fresh["head"]["kernel"]
  jax.tree.map(np.testing.assert_array_equal,
               params["encoderblock_1"]["Moe"]["router"],
               fresh["encoderblock_1"]["Moe"]["router"])


# ------------------------------------------------- the training job's `init`


def _tiny(moe):
  from vmoe_ext.train.config_files import load_config
  config = load_config("tiny")
  config.model.name = "vit" if moe is None else "vit_moe"
  config.model.moe = moe
  config.robustness = None
  config.train.update(dict(total_steps=2, log_every=1, eval_every=0,
                           checkpoint_every=2))
  config.optimizer.warmup_steps = 1
  return config


def test_a_training_run_starts_from_a_dense_run(tmp_path):
  """`init` with the dense->MoE preset: an E=1 V-MoE run starts with the
  dense run's trained logits, exactly; resuming ignores `init`."""
  from vmoe_ext.app import train as loop
  dense_dir, moe_dir = str(tmp_path / "dense"), str(tmp_path / "moe")
  loop.train_and_evaluate(_tiny(None), dense_dir)
  dense = loop.setup(_tiny(None), dense_dir)
  assert dense.restore() == 2
  dense.checkpoints.close()
  config = _tiny(dict(every=1, num_experts=1, capacity_factor=1.0,
                      group_size=None,
                      router=dict(name="noisy_topk", num_selected=1,
                                  renormalize_gates=True)))
  config.init = dict(workdir=dense_dir, step=None,
                     rules=init_lib.dense_to_moe_rules())
  run = loop.setup(config, moe_dir)
  run.checkpoints.close()
  images = next(iter(run.eval_batches()))["image"]
  apply = lambda model, params: jax.jit(
      lambda p, x: model.apply({"params": p}, x)[0])(params, images)
  np.testing.assert_array_equal(apply(run.model, run.state.params),
                                apply(dense.model, dense.state.params))
  # A bad `init` is a ConfigError naming the field, raised by setup before
  # anything is compiled.
  config.init = dict(workdir=str(tmp_path / "nowhere"), step=None,
                     rules=init_lib.dense_to_moe_rules())
  with pytest.raises(ConfigError, match=r"init\.workdir"):
    loop.setup(config, str(tmp_path / "other"))
  config.init = dict(workdir=dense_dir, step=None,
                     rules=[(r"(.*)/Moe/Mlp/(.*)", r"\1/Mlp/\2")])
  config.model.moe.num_experts = 2
  config.model.moe.hidden_size = 8  # Experts narrower than the dense MLP.
  with pytest.raises(ConfigError, match=r"init\.rules\[0\]"):
    loop.setup(config, str(tmp_path / "other"))
