"""Optimizer factory, orbax checkpoints and metric writers (vmoe_ext.train)."""

from __future__ import annotations

import io
import json
import math
import os
import struct
import warnings

import chex
import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from ml_collections import ConfigDict
from tensorboardX.crc32c import crc32c
from tensorboardX.proto import event_pb2
from test_models import IMAGES, MODELS

from vmoe_ext.config import validate
from vmoe_ext.errors import ConfigError
from vmoe_ext.models import build_model
from vmoe_ext.reporting import writers as writers_lib
from vmoe_ext.train import checkpoints as ckpt_lib
from vmoe_ext.train import optimizer as opt_lib

# ----------------------------------------------------------------- optimizer


def _opt_config(**kw):
  cfg = dict(name="adam", learning_rate=1.0, warmup_steps=10,
             decay="cosine", total_steps=110, end_learning_rate=0.1)
  cfg.update(kw)
  return ConfigDict(cfg)


# Peak 1, end 0.1, 10 warmup steps, 100 decay steps. Hand-computed values:
# warmup s/10; cosine 0.1 + 0.45 * (1 + cos(pi t)); linear 1 - 0.9 t.
SCHEDULES = {
    "cosine": {0: 0.0, 5: 0.5, 10: 1.0, 35: 0.8681981, 60: 0.55,
               85: 0.2318019, 110: 0.1, 500: 0.1},
    "linear": {0: 0.0, 5: 0.5, 10: 1.0, 35: 0.775, 60: 0.55, 85: 0.325,
               110: 0.1, 500: 0.1},
    "constant": {0: 0.0, 5: 0.5, 10: 1.0, 60: 1.0, 500: 1.0},
}


@pytest.mark.parametrize("decay", sorted(SCHEDULES))
def test_schedule_values_at_hand_picked_steps(decay):
  schedule = opt_lib.make_learning_rate(_opt_config(decay=decay))
  jitted = jax.jit(schedule)
  for step, expected in SCHEDULES[decay].items():
    np.testing.assert_allclose(schedule(step), expected, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(jitted(jnp.int32(step)), expected, rtol=1e-6,
                               atol=1e-7)


def test_schedule_without_warmup_and_optax_count():
  # No warmup: the first update (optax count 0) uses the peak.
  schedule = opt_lib.make_learning_rate(
      dict(name="sgd", learning_rate=0.2, decay="linear", total_steps=4))
  np.testing.assert_allclose([schedule(s) for s in range(6)],
                             [0.2, 0.15, 0.1, 0.05, 0.0, 0.0], atol=1e-7)
  tx = opt_lib.make_optimizer(
      dict(name="sgd", learning_rate=0.2, decay="linear", total_steps=4))
  params = {"w": jnp.zeros(())}
  state = tx.init(params)
  updates = []
  for _ in range(3):
    u, state = tx.update({"w": jnp.ones(())}, state, params)
    updates.append(float(u["w"]))
  np.testing.assert_allclose(updates, [-0.2, -0.15, -0.1], rtol=1e-6)


def test_adam_update_matches_manual_formula_and_optax():
  cfg = dict(name="adam", learning_rate=0.1, decay="constant", b1=0.8,
             b2=0.9, eps=1e-3)
  tx = opt_lib.make_optimizer(cfg)
  params = {"w": jnp.array([1.0, -2.0]), "b": jnp.array([0.5])}
  grads = [{"w": jnp.array([0.3, -1.0]), "b": jnp.array([2.0])},
           {"w": jnp.array([-0.5, 0.25]), "b": jnp.array([1.0])}]
  ref = optax.adam(0.1, b1=0.8, b2=0.9, eps=1e-3)
  state, ref_state = tx.init(params), ref.init(params)
  m = {k: np.zeros_like(v) for k, v in params.items()}
  v = {k: np.zeros_like(x) for k, x in params.items()}
  for t, g in enumerate(grads, start=1):
    u, state = tx.update(g, state, params)
    u_ref, ref_state = ref.update(g, ref_state, params)
    chex.assert_trees_all_close(u, u_ref, rtol=1e-6)
    for k in params:
      gk = np.asarray(g[k], np.float64)
      m[k] = 0.8 * m[k] + 0.2 * gk
      v[k] = 0.9 * v[k] + 0.1 * gk**2
      m_hat, v_hat = m[k] / (1 - 0.8**t), v[k] / (1 - 0.9**t)
      manual = -0.1 * m_hat / (np.sqrt(v_hat) + 1e-3)
      np.testing.assert_allclose(u[k], manual, rtol=1e-5)


def test_adamw_matches_optax_and_mask_skips_bias_and_norm():
  params = {
      "Dense_0": {"kernel": jnp.full((2, 3), 2.0), "bias": jnp.ones((3,))},
      "LayerNorm_0": {"scale": jnp.full((3,), 3.0), "bias": jnp.ones((3,))},
  }
  grads = jax.tree.map(lambda p: jnp.linspace(-1.0, 1.0, p.size).reshape(
      p.shape), params)
  common = dict(learning_rate=0.1, decay="constant")
  adamw = opt_lib.make_optimizer(dict(name="adamw", weight_decay=0.5,
                                      **common))
  adam = opt_lib.make_optimizer(dict(name="adam", **common))
  u_w, _ = adamw.update(grads, adamw.init(params), params)
  u_a, _ = adam.update(grads, adam.init(params), params)
  # Biases and the LayerNorm scale get exactly the un-decayed Adam update.
  for path in (("Dense_0", "bias"), ("LayerNorm_0", "scale"),
               ("LayerNorm_0", "bias")):
    np.testing.assert_array_equal(u_w[path[0]][path[1]],
                                  u_a[path[0]][path[1]])
  # The kernel additionally moves by -lr * wd * w = -0.1 * 0.5 * 2 = -0.1.
  np.testing.assert_allclose(u_w["Dense_0"]["kernel"],
                             u_a["Dense_0"]["kernel"] - 0.1, atol=1e-6)
  mask = {"Dense_0": {"kernel": True, "bias": False},
          "LayerNorm_0": {"scale": False, "bias": False}}
  ref = optax.adamw(0.1, weight_decay=0.5, mask=mask)
  u_ref, _ = ref.update(grads, ref.init(params), params)
  chex.assert_trees_all_close(u_w, u_ref, rtol=1e-6)
  # Passing params eagerly builds the same optimizer.
  eager = opt_lib.make_optimizer(dict(name="adamw", weight_decay=0.5,
                                      **common), params)
  chex.assert_trees_all_close(
      eager.update(grads, eager.init(params), params)[0], u_w)
  # "all" decays the bias too.
  every = opt_lib.make_optimizer(dict(name="adamw", weight_decay=0.5,
                                      weight_decay_mask="all", **common))
  u_all, _ = every.update(grads, every.init(params), params)
  np.testing.assert_allclose(u_all["Dense_0"]["bias"],
                             u_a["Dense_0"]["bias"] - 0.05, atol=1e-6)


def test_no_bias_norm_mask_on_a_real_vmoe_param_tree():
  decayed, kept = set(), set()
  for name in ("vmoe_top2", "soft_moe_vit"):
    model = build_model(MODELS[name])
    params = jax.eval_shape(
        lambda m=model: m.init({"params": jax.random.key(0)}, IMAGES)
    )["params"]
    mask = opt_lib.weight_decay_mask(params)
    for path, leaf in jax.tree_util.tree_flatten_with_path(mask)[0]:
      (decayed if leaf else kept).add(path[-1].key)
  # Expert weights are named like the dense MLP's (Moe/Mlp/Dense_i/kernel,
  # [E, ...]): expert kernels decay, expert biases (2-D) do not.
  assert decayed == {"kernel", "mu"}
  assert kept == {"bias", "scale", "pos_embedding", "cls"}


def test_global_norm_clipping_against_hand_computed_norm():
  # Global norm sqrt(3^2 + 4^2 + 12^2) = 13.
  grads = {"a": jnp.array([3.0, 4.0]), "b": jnp.array([[12.0]])}
  params = jax.tree.map(jnp.zeros_like, grads)
  cfg = dict(name="sgd", learning_rate=1.0, decay="constant",
             clip_global_norm=1.0)
  tx = opt_lib.make_optimizer(cfg)
  u, _ = tx.update(grads, tx.init(params), params)
  chex.assert_trees_all_close(
      u, {"a": jnp.array([-3 / 13, -4 / 13]), "b": jnp.array([[-12 / 13]])},
      rtol=1e-6)
  # Under the threshold nothing changes; 0 and None disable clipping.
  for clip in (13.5, 0, None):
    tx = opt_lib.make_optimizer({**cfg, "clip_global_norm": clip})
    u, _ = tx.update(grads, tx.init(params), params)
    chex.assert_trees_all_close(u, jax.tree.map(lambda g: -g, grads))


def test_frozen_params_get_no_update_and_leave_the_clip_norm():
  """`frozen`: the router's grad is zeroed before clipping (the global norm
  is then that of the rest, 5) and its update, decay included, is 0."""
  grads = {"blk": {"router": {"kernel": jnp.array([[12.0]])},
                   "Mlp": {"kernel": jnp.array([[3.0, 4.0]])}}}
  params = jax.tree.map(jnp.ones_like, grads)
  cfg = dict(name="sgd", learning_rate=1.0, decay="constant",
             clip_global_norm=1.0, weight_decay=0.5,
             frozen=(".*/router/.*",))
  tx = opt_lib.make_optimizer(cfg)
  u, _ = tx.update(grads, tx.init(params), params)
  chex.assert_trees_all_close(
      u, {"blk": {"router": {"kernel": jnp.array([[0.0]])},
                  "Mlp": {"kernel": jnp.array([[-3 / 5 - 0.5,
                                                -4 / 5 - 0.5]])}}},
      rtol=1e-6)
  with pytest.raises(ConfigError, match=r"optimizer\.frozen\[1\]"):
    opt_lib.make_optimizer({**cfg, "frozen": (".*/Mlp/.*", "nothing")}
                           ).init(params)


@pytest.mark.parametrize("nesterov", [False, True])
def test_sgd_momentum_and_decoupled_decay(nesterov):
  params = {"kernel": jnp.array([[1.0, -1.0]])}
  grads = [{"kernel": jnp.array([[0.5, 1.0]])},
           {"kernel": jnp.array([[-1.0, 2.0]])}]
  tx = opt_lib.make_optimizer(dict(
      name="sgd", learning_rate=0.1, decay="constant", momentum=0.9,
      nesterov=nesterov, weight_decay=0.01))
  state = tx.init(params)
  trace = np.zeros((1, 2))
  w = np.asarray(params["kernel"])
  for g in grads:
    u, state = tx.update(g, state, params)
    gk = np.asarray(g["kernel"])
    trace = gk + 0.9 * trace
    direction = gk + 0.9 * trace if nesterov else trace
    np.testing.assert_allclose(u["kernel"], -0.1 * (direction + 0.01 * w),
                               rtol=1e-6)


BAD_CONFIGS = [
    (dict(name="lamb"), "optimizer.name"),
    (dict(learning_rate=-0.1), "optimizer.learning_rate"),
    (dict(learning_rate=float("nan")), "optimizer.learning_rate"),
    (dict(warmup_steps=200), "optimizer.warmup_steps"),
    (dict(warmup_steps=-1), "optimizer.warmup_steps"),
    (dict(warmup_steps=2.5), "optimizer.warmup_steps"),
    (dict(total_steps=0), "optimizer.total_steps"),
    (dict(total_steps=None), "optimizer.total_steps"),
    (dict(decay="step"), "optimizer.decay"),
    (dict(end_learning_rate=-1.0), "optimizer.end_learning_rate"),
    (dict(end_learning_rate=2.0), "optimizer.end_learning_rate"),
    (dict(b1=1.0), "optimizer.b1"),
    (dict(b2=-0.1), "optimizer.b2"),
    (dict(name="adamw", weight_decay=-1e-4), "optimizer.weight_decay"),
    (dict(weight_decay=1e-4), "optimizer.weight_decay"),  # adam: use adamw
    (dict(name="adamw", weight_decay_mask="kernels"),
     "optimizer.weight_decay_mask"),
    (dict(clip_global_norm=-1.0), "optimizer.clip_global_norm"),
    (dict(momentum=0.9), "optimizer.momentum"),  # SGD field on adam
    (dict(name="sgd", momentum=1.0), "optimizer.momentum"),
    (dict(name="sgd", nesterov=True), "optimizer.nesterov"),
    (dict(learning_rte=0.1), "optimizer.learning_rte"),  # typo
    (dict(frozen=("(",)), "optimizer.frozen[0]"),
]


@pytest.mark.parametrize("overrides,field", BAD_CONFIGS)
def test_invalid_optimizer_configs_name_the_field(overrides, field):
  cfg = dict(_opt_config())
  cfg.update(overrides)
  if cfg["name"] == "sgd":
    cfg.pop("b1", None)
  with pytest.raises(ConfigError) as info:
    validate(opt_lib.OPTIMIZER, cfg, "optimizer")
  assert info.value.field == field
  assert str(info.value).startswith(field)


def test_missing_learning_rate_is_an_error():
  with pytest.raises(ConfigError, match="optimizer.learning_rate"):
    validate(opt_lib.OPTIMIZER, dict(name="adam", decay="constant"),
             "optimizer")


# --------------------------------------------------------------- checkpoints


@flax.struct.dataclass
class _TrainState:
  step: jax.Array
  params: dict
  opt_state: optax.OptState
  router_state: dict
  rng: jax.Array


def _state(seed: int) -> _TrainState:
  k = jax.random.key(seed)
  params = {"Dense_0": {"kernel": jax.random.normal(k, (3, 4)),
                        "bias": jnp.arange(4.0) + seed}}
  tx = opt_lib.make_optimizer(dict(name="adamw", learning_rate=0.1,
                                   warmup_steps=2, total_steps=10,
                                   weight_decay=0.1, clip_global_norm=1.0))
  opt_state = tx.init(params)
  _, opt_state = tx.update(jax.tree.map(jnp.ones_like, params), opt_state,
                           params)
  return _TrainState(
      step=jnp.asarray(seed, jnp.int32), params=params, opt_state=opt_state,
      router_state={"symphony": {"adjacency": jnp.eye(3) * (seed + 1)}},
      rng=jax.random.fold_in(k, 7))


def _assert_states_equal(actual: _TrainState, expected: _TrainState):
  assert jax.dtypes.issubdtype(actual.rng.dtype, jax.dtypes.prng_key)
  assert jax.random.key_impl(actual.rng) == jax.random.key_impl(expected.rng)
  np.testing.assert_array_equal(jax.random.key_data(actual.rng),
                                jax.random.key_data(expected.rng))
  chex.assert_trees_all_equal(actual.replace(rng=None),
                              expected.replace(rng=None))
  chex.assert_trees_all_equal_dtypes(actual.replace(rng=None),
                                     expected.replace(rng=None))


FP = {"model": {"num_experts": 4, "hidden_size": 8}, "shapes": [[3, 4], [4]]}


def _manager(directory, **kw):
  args = dict(save_every=1, keep=3, config_fingerprint=FP)
  args.update(kw)
  return ckpt_lib.CheckpointManager(str(directory), **args)


def test_checkpoint_round_trip(tmp_path):
  state = _state(1)
  extra = {"data": {"epoch": 2, "position": 17}, "note": "x"}
  with _manager(tmp_path / "ckpt") as mgr:
    assert mgr.restore(_state(0)) is None
    assert mgr.latest_step() is None
    mgr.save(5, state, extra)
    assert mgr.latest_step() == 5
  # A fresh manager (a restarted process) restores it into a different state.
  with _manager(tmp_path / "ckpt") as mgr:
    restored, restored_extra, step = mgr.restore(_state(0))
  assert step == 5
  assert restored_extra == extra
  _assert_states_equal(restored, state)
  # Numpy and Python scalar leaves keep their types.
  tree = {"a": np.arange(3, dtype=np.int64), "b": np.float32(2.5), "c": 7}
  with _manager(tmp_path / "np") as mgr:
    mgr.save(1, tree, {})
    out, _, _ = mgr.restore({"a": np.zeros(3, np.int64),
                             "b": np.float32(0), "c": 0})
  assert isinstance(out["a"], np.ndarray) and out["a"].tolist() == [0, 1, 2]
  assert isinstance(out["b"], np.float32) and out["b"] == 2.5
  assert isinstance(out["c"], int) and out["c"] == 7
  # Abstract targets (jax.eval_shape) restore too; typed keys must be
  # concrete.
  abstract = jax.eval_shape(lambda: state.params)
  with _manager(tmp_path / "ckpt") as mgr:
    out, _, _ = mgr.restore(state.replace(params=abstract))
    chex.assert_trees_all_equal(out.params, state.params)
    with pytest.raises(TypeError, match="typed PRNG keys"):
      mgr.restore(state.replace(rng=jax.eval_shape(lambda: state.rng)))


def test_keep_last_k_and_save_every(tmp_path):
  with _manager(tmp_path, save_every=3, keep=2) as mgr:
    assert [s for s in range(10) if mgr.should_save(s)] == [3, 6, 9]
    for step in range(1, 8):
      mgr.save(step, _state(step), {"step": step})
    assert mgr.all_steps() == [3, 6]
    mgr.save(7, _state(7), {"step": 7}, force=True)
    assert mgr.all_steps() == [6, 7]
    assert sorted(p for p in os.listdir(tmp_path) if p.isdigit()) == ["6", "7"]
    # Saving an existing step again is a no-op (first save wins).
    mgr.save(7, _state(99), {"step": 99}, force=True)
    restored, extra, step = mgr.restore(_state(0))
  assert (step, extra) == (7, {"step": 7})
  _assert_states_equal(restored, _state(7))
  with _manager(tmp_path / "never", save_every=0) as mgr:
    assert not any(mgr.should_save(s) for s in range(10))


def _corrupt(directory, step, how="overwrite_all"):
  """Damages a checkpoint's state: garbage in every file ("overwrite_all"),
  or only the array data chunks cut in half ("truncate_data")."""
  root = os.path.join(directory, str(step), "state")
  count = 0
  for dirpath, _, files in os.walk(root):
    for name in files:
      path = os.path.join(dirpath, name)
      if how == "overwrite_all":
        data = b"\x00garbage"
      elif os.path.basename(dirpath) == "d":
        data = open(path, "rb").read()
        data = data[:len(data) // 2]
      else:
        continue
      with open(path, "wb") as f:
        f.write(data)
      count += 1
  assert count > 0


# A failed tensorstore read can leave a callback for orbax's closed event
# loop ("Event loop is closed", reported as unraisable): harmless noise.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("how", ["overwrite_all", "truncate_data"])
def test_corrupt_newest_checkpoint_falls_back_with_a_warning(tmp_path, how):
  with _manager(tmp_path) as mgr:
    mgr.save(1, _state(1), {"pos": 1})
    mgr.save(2, _state(2), {"pos": 2})
  _corrupt(tmp_path, 2, how)
  with _manager(tmp_path) as mgr:
    with pytest.warns(UserWarning, match="step 2"):
      restored, extra, step = mgr.restore(_state(0))
    assert (step, extra) == (1, {"pos": 1})
    _assert_states_equal(restored, _state(1))
    # The resumed run reaches step 2 again and replaces the corrupt one.
    mgr.save(2, _state(22), {"pos": 22})
    with warnings.catch_warnings():
      warnings.simplefilter("error")
      restored, extra, step = mgr.restore(_state(0))
  assert (step, extra) == (2, {"pos": 22})
  _assert_states_equal(restored, _state(22))


def test_all_corrupt_checkpoints_raise(tmp_path):
  with _manager(tmp_path) as mgr:
    mgr.save(1, _state(1), {})
    mgr.save(2, _state(2), {})
  _corrupt(tmp_path, 1)
  _corrupt(tmp_path, 2)
  with _manager(tmp_path) as mgr:
    with pytest.warns(UserWarning), pytest.raises(
        ckpt_lib.CheckpointError, match="step 2.*step 1"):
      mgr.restore(_state(0))


def test_unfinished_save_is_ignored(tmp_path):
  with _manager(tmp_path) as mgr:
    mgr.save(1, _state(1), {"pos": 1})
  # What a process killed during the save of step 2 leaves behind.
  partial = tmp_path / "2.orbax-checkpoint-tmp-1234567" / "state"
  partial.mkdir(parents=True)
  (partial / "_METADATA").write_bytes(b"{trunc")
  with _manager(tmp_path) as mgr:
    assert mgr.latest_step() == 1
    with warnings.catch_warnings():
      warnings.simplefilter("error")
      _, extra, step = mgr.restore(_state(0))
  assert (step, extra) == (1, {"pos": 1})


def test_incompatible_fingerprint_is_a_config_error(tmp_path):
  with _manager(tmp_path) as mgr:
    mgr.save(1, _state(1), {})
  other = {"model": {"num_experts": 8, "hidden_size": 8},
           "shapes": [[3, 4], [4]], "router": "topk"}
  with _manager(tmp_path, config_fingerprint=other) as mgr:
    with pytest.raises(ConfigError) as info:
      mgr.restore(_state(0))
  assert info.value.field == "workdir"
  message = str(info.value)
  assert "model/num_experts" in message and "router" in message
  assert "hidden_size" not in message and "incompatible" in message
  assert ckpt_lib.fingerprint_diff(FP, other) == ["model/num_experts",
                                                  "router"]


def test_restore_variables_reads_only_the_requested_entries(tmp_path):
  def as_dict(seed):
    return flax.serialization.to_state_dict(_state(seed).replace(
        rng=jax.random.key_data(_state(seed).rng)))

  with _manager(tmp_path) as mgr:
    assert mgr.restore_variables({"params": {}}) is None
    mgr.save(1, as_dict(1), {})
    mgr.save(2, as_dict(2), {})
  _corrupt(tmp_path, 2)
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                          {"params": _state(0).params,
                           "router_state": _state(0).router_state})
  with _manager(tmp_path, save_every=0) as mgr:
    with pytest.warns(UserWarning, match="step 2"):
      entries, step = mgr.restore_variables({**abstract, "none": {}})
  assert step == 1 and sorted(entries) == ["none", "params", "router_state"]
  assert entries["none"] == {}
  chex.assert_trees_all_equal(entries["params"], _state(1).params)
  chex.assert_trees_all_equal(entries["router_state"], _state(1).router_state)
  other = dict(FP, model={"num_experts": 8})
  with _manager(tmp_path, config_fingerprint=other) as mgr:
    with pytest.raises(ConfigError, match="model/num_experts"):
      mgr.restore_variables(abstract)


def test_config_fingerprint_from_shapes_only():
  config = ConfigDict(dict(
      model=dict(name="vit"), data=dict(name="digits"),
      optimizer=dict(name="adamw")))
  params = {"a": {"kernel": jnp.zeros((3, 4))}, "b": jnp.zeros((2,))}
  abstract = jax.eval_shape(lambda: params)
  fp = ckpt_lib.config_fingerprint(config, params)
  assert fp == ckpt_lib.config_fingerprint(config, abstract)
  assert {k: v for k, v in fp.items() if k != "model"} == {
      "data": "digits", "optimizer": "adamw",
      "param_shapes": {"a/kernel": [3, 4], "b": [2]}}
  # The model section with its defaults filled (VisionTransformerMoe's).
  assert fp["model"]["name"] == "vit" and fp["model"]["hidden_size"] == 64
  assert fp["model"]["moe"] is None


def test_checkpoint_manager_argument_errors(tmp_path):
  for kw, field in ((dict(save_every=-1), "save_every"),
                    (dict(keep=0), "keep")):
    with pytest.raises(ConfigError, match=field):
      _manager(tmp_path, **kw)
  with pytest.raises(TypeError, match="config_fingerprint"):
    _manager(tmp_path, config_fingerprint={"a": object()})


# ------------------------------------------------------------------- writers


def _read_records(path):
  """Minimal TFRecord reader: yields payloads after checking both CRCs."""

  def masked(data):
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xa282ead8) & 0xffffffff

  with open(path, "rb") as f:
    blob = f.read()
  offset = 0
  while offset < len(blob):
    header = blob[offset:offset + 8]
    (length,) = struct.unpack("<Q", header)
    (length_crc,) = struct.unpack("<I", blob[offset + 8:offset + 12])
    assert length_crc == masked(header)
    data = blob[offset + 12:offset + 12 + length]
    (data_crc,) = struct.unpack("<I", blob[offset + 12 + length:
                                          offset + 16 + length])
    assert data_crc == masked(data)
    offset += 16 + length
    yield data


def _tensorboard_scalars(logdir):
  files = [os.path.join(logdir, n) for n in os.listdir(logdir)
           if n.startswith("events.out.tfevents")]
  assert files
  scalars = {}
  for path in files:
    for record in _read_records(path):
      event = event_pb2.Event.FromString(record)
      for value in event.summary.value:
        scalars[(value.tag, event.step)] = value.simple_value
  return scalars


def test_metric_writer_jsonl_and_tensorboard(tmp_path):
  workdir = str(tmp_path / "run")
  with writers_lib.MetricWriter(workdir) as writer:
    writer.write(10, "train", {
        "loss": 0.5, "accuracy": np.float32(0.75), "count": 3,
        "load": jnp.array([0.25, 0.75]),
        "layer_1": {"drop_rate": jnp.float32(0.125), "router": {"z": 2}},
        "name": "pgd"})
    writer.write(20, "test", {"accuracy": 0.875}, final=True)
  lines = open(os.path.join(workdir, "metrics.jsonl")).read().splitlines()
  assert [json.loads(line) for line in lines] == [
      {"step": 10, "split": "train", "loss": 0.5, "accuracy": 0.75,
       "count": 3.0, "load": [0.25, 0.75], "layer_1/drop_rate": 0.125,
       "layer_1/router/z": 2.0, "name": "pgd"},
      {"step": 20, "split": "test", "accuracy": 0.875, "final": True},
  ]
  assert writers_lib.read_metrics(workdir) == [json.loads(l) for l in lines]
  first = json.loads(lines[0])
  assert isinstance(first["step"], int)
  assert isinstance(first["count"], float) and "final" not in first
  scalars = _tensorboard_scalars(os.path.join(workdir, "tensorboard"))
  assert scalars == {
      ("train/loss", 10): 0.5, ("train/accuracy", 10): 0.75,
      ("train/count", 10): 3.0, ("train/load/0", 10): 0.25,
      ("train/load/1", 10): 0.75, ("train/layer_1/drop_rate", 10): 0.125,
      ("train/layer_1/router/z", 10): 2.0, ("test/accuracy", 20): 0.875}


def test_metric_writer_appends_truncates_and_rejects_bad_metrics(tmp_path):
  with writers_lib.MetricWriter(str(tmp_path), tensorboard=False) as w:
    for step in (1, 2, 3):
      w.write(step, "train", {"loss": step / 4})
    with pytest.raises(ValueError, match="reserved"):
      w.write(4, "train", {"step": 1.0})
    with pytest.raises(ValueError, match="too large"):
      w.write(4, "train", {"big": np.zeros(writers_lib.MAX_ARRAY_SIZE + 1)})
    with pytest.raises(TypeError, match="obj"):
      w.write(4, "train", {"obj": object()})
  assert not os.path.exists(tmp_path / "tensorboard")
  # A resumed run appends after dropping what followed its checkpoint.
  with writers_lib.MetricWriter(str(tmp_path), tensorboard=False) as w:
    w.truncate(after_step=1)
    w.write(2, "train", {"loss": 9.0})
  assert [(r["step"], r["loss"]) for r in writers_lib.read_metrics(
      str(tmp_path))] == [(1, 0.25), (2, 9.0)]
  # A line cut short by a kill is skipped.
  with open(tmp_path / "metrics.jsonl", "a") as f:
    f.write('{"step": 3, "spl')
  assert len(writers_lib.read_metrics(str(tmp_path))) == 2
  with pytest.raises(ValueError, match="closed"):
    w.write(5, "train", {"loss": 1.0})


def test_metric_writer_non_finite_values_round_trip(tmp_path):
  with writers_lib.MetricWriter(str(tmp_path), tensorboard=False) as w:
    w.write(1, "train", {"loss": float("nan"), "gnorm": np.inf})
  (record,) = writers_lib.read_metrics(str(tmp_path))
  assert math.isnan(record["loss"]) and record["gnorm"] == math.inf


class _FakeTty(io.StringIO):

  def isatty(self):
    return True


def test_progress_bar_is_quiet_off_a_terminal(monkeypatch):
  monkeypatch.delenv("CI", raising=False)
  stream = io.StringIO()
  monkeypatch.setattr("sys.stderr", stream)
  bar = writers_lib.progress_bar(5, "train")
  assert bar.disable
  for _ in range(5):
    bar.update(1)
  bar.close()
  assert stream.getvalue() == ""
  tty = _FakeTty()
  monkeypatch.setattr("sys.stderr", tty)
  bar = writers_lib.progress_bar(5, "train")
  assert not bar.disable
  bar.update(5)
  bar.close()
  assert "train" in tty.getvalue() and "5/5" in tty.getvalue()
  monkeypatch.setenv("CI", "true")
  assert writers_lib.progress_bar(5, "train").disable
  assert not writers_lib.progress_bar(5, "train", disable=False,
                                      file=io.StringIO()).disable
