"""Checkpoint faults: corrupt and unwritable checkpoints, config fingerprints.

Tiny pytrees saved directly with `CheckpointManager` (no model training).
"""

from __future__ import annotations

import asyncio
import errno
import glob
import json
import os
import sys
import time
import types
import warnings

import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from ml_collections import ConfigDict

from vmoe_ext.config import REQUIRED, Field, OneOf, Section, Seq
from vmoe_ext.config.defaults import fill_defaults
from vmoe_ext.errors import ConfigError
from vmoe_ext.train import checkpoints as ckpt_lib
from vmoe_ext.train import orbax_quiet
from vmoe_ext.train.checkpoints import (CheckpointError, CheckpointManager,
                                        CheckpointSaveError,
                                        config_fingerprint)

NUM_ARRAYS = 60  # Enough parallel reads for orbax to close its loop early.
FP = {"run": "faults"}


def _state(seed: int) -> dict:
  """A state whose every value depends on `seed` (built independently of any
  checkpoint, as the expectation)."""
  rng = np.random.default_rng(seed)
  params = {f"w{i:02d}": rng.standard_normal((4, 8)).astype(np.float32)
            for i in range(NUM_ARRAYS)}
  return {"params": {k: jnp.asarray(v) for k, v in params.items()},
          "step": jnp.asarray(seed, jnp.int32)}


def _zeros() -> dict:
  return {"params": {f"w{i:02d}": jnp.zeros((4, 8), jnp.float32)
                     for i in range(NUM_ARRAYS)},
          "step": jnp.zeros((), jnp.int32)}


def _manager(directory, **kw) -> CheckpointManager:
  args = dict(save_every=1, keep=5, config_fingerprint=FP)
  args.update(kw)
  return CheckpointManager(str(directory), **args)


def _assert_state(restored: dict, seed: int) -> None:
  expected = _state(seed)
  assert sorted(restored["params"]) == sorted(expected["params"])
  for k, v in expected["params"].items():
    np.testing.assert_array_equal(np.asarray(restored["params"][k]),
                                  np.asarray(v))
  assert int(restored["step"]) == seed


def _corrupt(directory, step: int, how: str) -> None:
  """Damages the state item of checkpoint `step` in one of several ways."""
  root = os.path.join(directory, str(step), "state")
  data = [p for p in glob.glob(os.path.join(root, "**", "d", "*"),
                               recursive=True) if os.path.isfile(p)]
  assert data, "no array data files found"
  if how == "delete_data":
    for path in data:
      os.remove(path)
  elif how == "truncate_data":
    for path in data:
      with open(path, "rb") as f:
        content = f.read()
      with open(path, "wb") as f:
        f.write(content[:len(content) // 2])
  elif how == "garbage_metadata":
    with open(os.path.join(root, "_METADATA"), "wb") as f:
      f.write(b"\x00garbage")
  elif how == "garbage_manifest":
    with open(os.path.join(root, "manifest.ocdbt"), "wb") as f:
      f.write(b"\x00garbage")
  else:
    raise ValueError(how)


def _save_steps(directory, steps) -> None:
  with _manager(directory) as mgr:
    for step in steps:
      mgr.save(step, _state(step), {"pos": step})


# ------------------------------------------------------- corrupt checkpoints


@pytest.mark.parametrize("how", ["delete_data", "truncate_data",
                                 "garbage_metadata", "garbage_manifest"])
def test_corrupt_newest_gives_one_warning_and_falls_back(tmp_path, how, capfd,
                                                         caplog, monkeypatch):
  _save_steps(tmp_path, [1, 2])
  _corrupt(tmp_path, 2, how)
  unraisable = []
  monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
  capfd.readouterr()
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    with _manager(tmp_path) as mgr:
      restored, extra, step = mgr.restore(_zeros())
    time.sleep(0.3)  # Stray callbacks of the failed reads arrive late.
  assert (step, extra) == (1, {"pos": 1})
  _assert_state(restored, 1)
  messages = [str(w.message) for w in caught]
  assert len(messages) == 1, messages
  assert "step 2" in messages[0] and str(tmp_path) in messages[0]
  assert "falling back" in messages[0] and len(messages[0]) < 450
  assert "tensorstore_spec" not in messages[0]
  out, err = capfd.readouterr()
  assert "Event loop is closed" not in out + err
  assert "Traceback" not in out + err
  assert not [u for u in unraisable if "Event loop" in str(u.exc_value)]
  assert not [r for r in caplog.records if r.levelname == "ERROR"]


def test_closed_loop_filter_drops_only_that_noise():
  loop = asyncio.new_event_loop()
  loop.close()
  try:
    loop.call_soon_threadsafe(print)
  except RuntimeError as e:
    noise = types.SimpleNamespace(exc_type=RuntimeError, exc_value=e,
                                  exc_traceback=e.__traceback__,
                                  err_msg=None, object=None)
  other = types.SimpleNamespace(exc_type=ValueError,
                                exc_value=ValueError("real"),
                                exc_traceback=None, err_msg=None, object=None)
  seen = []
  hook = orbax_quiet._ClosedLoopNoiseFilter(seen.append)
  hook(noise)
  hook(other)
  assert seen == [other]


def test_all_corrupt_raises_one_clear_paragraph(tmp_path):
  _save_steps(tmp_path, [1, 2])
  _corrupt(tmp_path, 1, "delete_data")
  _corrupt(tmp_path, 2, "garbage_metadata")
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    with _manager(tmp_path) as mgr:
      with pytest.raises(CheckpointError) as info:
        mgr.restore(_zeros())
    assert [str(w.message).split(";")[-1] for w in caught] == [
        " falling back to an older checkpoint", " no older checkpoint is left"]
    with _manager(tmp_path, purpose="evaluate") as mgr:
      with pytest.raises(CheckpointError) as evaluating:
        mgr.restore_variables({"params": _zeros()["params"]})
  message = str(info.value)
  assert "\n" not in message and len(message) < 900
  assert message.index("step 2:") < message.index("step 1:")
  assert f"move or delete {tmp_path} to start the run over" in message
  assert "none of the 2 checkpoints" in message
  assert "tensorstore_spec" not in message
  assert "evaluate another training run" in str(evaluating.value)
  assert "move or delete" not in str(evaluating.value)


# ------------------------------------------------------------ failing saves

_TENSORSTORE_ENOSPC = (
    'RESOURCE_EXHAUSTED: Error writing "w/0" in OCDBT database at local file '
    '"/x/2.orbax-checkpoint-tmp/state/": Failed to write 110888 bytes to file '
    "17: No space left on device [os_error_code='28']")


@pytest.mark.parametrize("handler,method,error", [
    # Before any write starts (the other items' writers run on).
    (ocp.JsonCheckpointHandler, "async_save",
     OSError(errno.ENOSPC, "No space left")),
    (ocp.StandardCheckpointHandler, "async_save",
     ValueError(_TENSORSTORE_ENOSPC)),
    # In orbax's writer thread, which logs the error with its traceback.
    (ocp.JsonCheckpointHandler, "_save_fn",
     OSError(errno.ENOSPC, "No space left")),
])
def test_full_disk_at_save_is_a_clear_error(tmp_path, monkeypatch, capfd,
                                            caplog, handler, method, error):
  if not hasattr(handler, method):
    pytest.skip(f"this orbax version has no {handler.__name__}.{method}")
  _save_steps(tmp_path, [1])

  async def failing_save(self, *args, **kwargs):
    raise error

  capfd.readouterr()
  with _manager(tmp_path) as mgr:
    with monkeypatch.context() as patch:
      patch.setattr(handler, method, failing_save)
      with pytest.raises(CheckpointSaveError) as info:
        mgr.save(2, _state(2), {"pos": 2})
    assert mgr.all_steps() == [1]
  assert isinstance(info.value, CheckpointError)
  assert (info.value.step, info.value.errno) == (2, errno.ENOSPC)
  message = str(info.value)
  assert "step 2" in message and str(tmp_path) in message
  assert "no space left on device" in message
  assert "free space" in message and "resumes from step 1" in message
  assert not glob.glob(os.path.join(tmp_path, "2.orbax-checkpoint-tmp*"))
  assert "Traceback" not in "".join(capfd.readouterr())
  assert not [r for r in caplog.records if r.levelname == "ERROR"]
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    with _manager(tmp_path) as mgr:
      assert mgr.latest_step() == 1
      restored, extra, step = mgr.restore(_zeros())
      assert (step, extra) == (1, {"pos": 1})
      _assert_state(restored, 1)
      mgr.save(2, _state(2), {"pos": 2})  # Space is back: saving works.
      assert mgr.restore(_zeros())[2] == 2


def test_non_io_error_at_save_is_not_disguised(tmp_path, monkeypatch):
  async def failing_save(self, *args, **kwargs):
    raise TypeError("not an array")

  monkeypatch.setattr(ocp.JsonCheckpointHandler, "async_save", failing_save)
  with _manager(tmp_path) as mgr:
    with pytest.raises(TypeError, match="not an array"):
      mgr.save(1, _state(1), {})
    assert mgr.all_steps() == []


# ---------------------------------------------------------- fill_defaults


def _pick_fields(value):
  if value.get("name", "p") == "p":
    return {"name": Field("str", "p"), "k": Field("int", 7)}
  return {"name": Field("str", REQUIRED), "m": Field("int", 9)}


SPEC = Section({
    "a": Field("int", 1),
    "b": Field("int", REQUIRED),
    "sub": Section({"x": Field("float", 0.5),
                    "y": Seq(Field("int"), (1, 2))}, default={"x": 2.0}),
    "off": Section({"z": Field("int", 3)}, default=None, nullable=True),
    "pick": Section(_pick_fields, default={"name": "p"}),
    "either": OneOf((Field("int"), Field("str")), "int or str", default=4),
})


def test_fill_defaults_on_a_small_spec():
  given = {"b": 5}
  assert fill_defaults(SPEC, given) == {
      "a": 1, "b": 5, "sub": {"x": 2.0, "y": (1, 2)}, "off": None,
      "pick": {"name": "p", "k": 7}, "either": 4}
  assert given == {"b": 5}  # Not modified.
  filled = fill_defaults(SPEC, ConfigDict(dict(
      a=3, sub=dict(y=[9]), off=dict(), pick=dict(name="q"), extra=True)))
  assert filled == {"a": 3, "sub": {"x": 0.5, "y": [9]}, "off": {"z": 3},
                    "pick": {"name": "q", "m": 9}, "either": 4, "extra": True}
  assert fill_defaults(Field("int", 3), None) is None
  assert fill_defaults(Seq(SPEC), [{"b": 1}]) == [{"b": 1}]  # Kept as given.


def test_fill_defaults_names_the_field_of_a_bad_selector():
  spec = Section({"outer": Section(
      lambda v: (_ for _ in ()).throw(ConfigError("name", "unknown 'x'")),
      default={})})
  with pytest.raises(ConfigError) as info:
    fill_defaults(spec, {"outer": {"name": "x"}}, "root")
  assert info.value.field == "root.outer.name"


def _config(**model) -> ConfigDict:
  base = dict(name="vit_moe", num_classes=10, patch_size=(4, 4),
              hidden_size=16, num_layers=2, num_heads=2, mlp_dim=16,
              moe=dict(every=2, num_experts=2, capacity_factor=1.5,
                       group_size=10,
                       router=dict(name="noisy_topk", num_selected=1)))
  base.update(model)
  return ConfigDict(dict(model=base, data=dict(name="digits"),
                         optimizer=dict(name="adamw")))


PARAMS = {"a": {"kernel": jnp.zeros((3, 4))}, "b": jnp.zeros((2,))}


def test_absent_field_and_default_value_give_equal_fingerprints():
  explicit = _config(
      patch_size=[4, 4], classifier="token", dropout_rate=0.0, stream=None,
      moe=dict(every=2, num_experts=2, capacity_factor=1.5, group_size=10,
               dispatcher="indices", capacity_rounding="exact",
               router=dict(name="noisy_topk", num_selected=1, noise_std=1.0,
                           importance_loss_weight=0.005)))
  short = config_fingerprint(_config(), PARAMS)
  assert short == config_fingerprint(explicit, PARAMS)
  assert short["model"]["moe"]["router"]["noise_std"] == 1.0
  assert short["model"]["mlp_dim"] == 16 and short["data"] == "digits"
  json.dumps(short)  # JSON-serialisable (dtype defaults by name).
  wider = config_fingerprint(_config(hidden_size=32), PARAMS)
  assert ckpt_lib.fingerprint_diff(short, wider) == ["model/hidden_size"]


def test_old_unfilled_fingerprint_on_disk_still_matches(tmp_path):
  old = {"model": _config().model.to_dict(), "data": "digits",
         "param_shapes": {"a/kernel": [3, 4], "b": [2]},
         "optimizer": "adamw"}
  with _manager(tmp_path, config_fingerprint=old) as mgr:
    mgr._manager.save(1, args=ocp.args.Composite(**{  # As saved before.
        "state": ocp.args.StandardSave(_state(1)),
        "extra": ocp.args.JsonSave({"pos": 1}),
        "fingerprint": ocp.args.JsonSave(json.loads(json.dumps(old)))}))
    mgr._manager.wait_until_finished()
  explicit = _config(classifier="token", moe=dict(
      every=2, num_experts=2, capacity_factor=1.5, group_size=10,
      router=dict(name="noisy_topk", num_selected=1, noise_std=1.0)))
  with _manager(tmp_path,
                config_fingerprint=config_fingerprint(explicit, PARAMS)) as mgr:
    restored, extra, step = mgr.restore(_zeros())
  assert (step, extra) == (1, {"pos": 1})
  _assert_state(restored, 1)


# ------------------------------------------------------- mismatch messages


def test_evaluation_mismatch_names_the_full_field(tmp_path):
  trained = config_fingerprint(_config(hidden_size=16), PARAMS)
  with _manager(tmp_path, config_fingerprint=trained) as mgr:
    mgr.save(3, _state(3), {})
  other = config_fingerprint(_config(hidden_size=32), PARAMS)
  with _manager(tmp_path, config_fingerprint=other,
                purpose="evaluate") as mgr:
    with pytest.raises(ConfigError) as info:
      mgr.restore_variables({"params": _zeros()["params"]})
  assert info.value.field == "model.hidden_size"
  message = str(info.value)
  assert f"the checkpoint in {tmp_path} (step 3) was trained with " \
         "model.hidden_size=16, the config has 32" in message
  assert "(e.g. --config.model.hidden_size=16)" in message
  assert "new --workdir" not in message


def test_variables_of_a_chosen_step(tmp_path):
  """A checkpoint kept along training is read by its step (the newest by
  default); a step that is not on disk gives None."""
  _save_steps(tmp_path, (1, 2, 3))
  with _manager(tmp_path, purpose="evaluate") as mgr:
    for step in (2, 1, None):
      entries, got = mgr.restore_variables(
          {"params": _zeros()["params"], "step": _zeros()["step"]}, step)
      assert got == (3 if step is None else step)
      _assert_state(entries, got)
    assert mgr.restore_variables({"params": _zeros()["params"]}, 4) is None


def test_evaluation_ignores_the_optimizer_and_resume_does_not(tmp_path):
  trained = config_fingerprint(_config(), PARAMS)
  with _manager(tmp_path, config_fingerprint=trained) as mgr:
    mgr.save(3, _state(3), {})
  sgd = dict(trained, optimizer="sgd")
  with _manager(tmp_path, config_fingerprint=sgd, purpose="evaluate") as mgr:
    assert mgr.restore_variables({"params": _zeros()["params"]})[1] == 3
  with _manager(tmp_path, config_fingerprint=sgd) as mgr:
    with pytest.raises(ConfigError) as info:
      mgr.restore(_zeros())
  assert info.value.field == "workdir"
  assert "optimizer: checkpoint \"adamw\" vs config \"sgd\"" in str(info.value)
  assert "new --workdir" in str(info.value)
  with pytest.raises(ConfigError, match="purpose"):
    _manager(tmp_path, purpose="train")


def test_late_never_retrieved_tensorstore_future_is_dropped_only():
  """asyncio logs "Future exception was never retrieved" when a failed
  tensorstore read of a corrupt checkpoint is garbage-collected, possibly
  after the restore returned: that record is dropped, others are kept."""
  import logging
  from vmoe_ext.train.orbax_quiet import quiet_orbax
  with quiet_orbax():
    pass
  logger = logging.getLogger("asyncio")

  def kept(exc):
    record = logger.makeRecord("asyncio", logging.ERROR, __file__, 1,
                               "Future exception was never retrieved\n"
                               "future: <Future finished>", (),
                               (type(exc), exc, None))
    return all(f.filter(record) for f in logger.filters)

  assert not kept(ValueError('NOT_FOUND: Error reading "params.w1/.zarray" '
                             "[tensorstore_spec='{}']"))
  assert kept(ValueError("some other failure"))


def test_never_awaited_orbax_coroutines_are_dropped_others_kept():
  """A failed restore leaves orbax coroutines that never ran; Python warns
  about each when it is collected, possibly late. Those (and only orbax's)
  are dropped, also inside a caller's catch_warnings("always")."""
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    with orbax_quiet.quiet_orbax():
      pass
    for name in ("Store._get_array_metadatas", "mine", "Store.mine"):
      warnings.warn(f"coroutine '{name}' was never awaited", RuntimeWarning)
  assert [str(w.message) for w in caught] == [
      "coroutine 'mine' was never awaited",
      "coroutine 'Store.mine' was never awaited"]
