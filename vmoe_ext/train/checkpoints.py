"""Checkpoints of the full train state with orbax, resumable and verified.

Layout: `WORKDIR/checkpoints/<step>/` (one orbax step directory per save)
holding three items:

  state/        the train-state pytree (orbax StandardSave: params, optimizer
                state, router-state collections, RNG key data, step, ...);
  extra/        JSON: anything else needed to resume (data iterator position);
  fingerprint/  JSON: the `config_fingerprint` of the manager that saved it.

Saves are synchronous: orbax writes each step into a temporary directory and
renames it when complete, and `save` returns only after that, so a process
killed mid-save leaves at worst a temporary directory that is ignored (and
removed when the next manager opens the directory), never a half-written step
that `restore` would take as the latest one.

Typed PRNG keys (`jax.random.key`) cannot be serialised as such; the manager
handles them itself: such a leaf is saved as its `jax.random.key_data` and
restored into a typed key with the implementation of the corresponding leaf
of `target_state`. Raw uint32 keys (`jax.random.PRNGKey`) are plain arrays.
Typed keys in the target must be concrete arrays (not `ShapeDtypeStruct`s).

`restore_variables` reads only some entries of the saved state (e.g. params
and router state for evaluation, without the optimizer state).
"""

from __future__ import annotations

import json
import os
import warnings
from typing import Any, Callable, Mapping

import jax
import flax.traverse_util
import ml_collections
import numpy as np
import orbax.checkpoint as ocp

from vmoe_ext.errors import ConfigError, require

STATE, EXTRA, FINGERPRINT = "state", "extra", "fingerprint"


class CheckpointError(RuntimeError):
  """Checkpoints exist but none of them can be restored."""


def _is_typed_key(x: Any) -> bool:
  dtype = getattr(x, "dtype", None)
  return dtype is not None and jax.dtypes.issubdtype(dtype,
                                                     jax.dtypes.prng_key)


def _to_saveable(x: Any) -> Any:
  if _is_typed_key(x):
    return jax.random.key_data(x)
  if isinstance(x, (np.generic, int, float, bool)):
    return np.asarray(x)
  return x


def _to_restore_target(x: Any) -> Any:
  """Turns a target leaf into what orbax's StandardRestore expects."""
  if _is_typed_key(x):
    if isinstance(x, jax.ShapeDtypeStruct):
      raise TypeError("typed PRNG keys in target_state must be concrete key "
                      "arrays, not ShapeDtypeStructs")
    x = jax.random.key_data(x)
  if isinstance(x, jax.Array):
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
  if isinstance(x, jax.ShapeDtypeStruct):
    sharding = x.sharding or jax.sharding.SingleDeviceSharding(
        jax.devices()[0])
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
  if isinstance(x, (np.generic, int, float, bool)):
    return np.asarray(x)
  return x


def _from_restored(target: Any, value: Any) -> Any:
  """Gives a restored leaf the type of its target leaf."""
  if _is_typed_key(target):
    return jax.random.wrap_key_data(value, impl=jax.random.key_impl(target))
  if isinstance(target, np.generic):
    return target.dtype.type(np.asarray(value))
  if isinstance(target, (bool, int, float)):
    return type(target)(np.asarray(value).item())
  return value


def _normalise_json(value: Any, name: str) -> Any:
  try:
    return json.loads(json.dumps(value, sort_keys=True))
  except (TypeError, ValueError) as e:
    raise TypeError(f"{name} must be JSON-serialisable: {e}") from e


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
  if isinstance(tree, Mapping) and tree:
    out = {}
    for k, v in tree.items():
      out.update(_flatten(v, f"{prefix}{k}/"))
    return out
  return {prefix.rstrip("/") or "<root>": tree}


def fingerprint_diff(stored: Any, current: Any) -> list[str]:
  """Keys (nested dicts flattened with "/") whose values differ, sorted."""
  a, b = _flatten(stored), _flatten(current)
  missing = object()
  return sorted(k for k in set(a) | set(b)
                if a.get(k, missing) != b.get(k, missing))


def config_fingerprint(config: ml_collections.ConfigDict,
                       params: Any) -> dict:
  """What a workdir's checkpoint must match to be resumed or evaluated with
  `config`: model config, data name, parameter shapes, optimizer name.

  `params` may hold arrays or `jax.ShapeDtypeStruct`s (only shapes are used).
  """
  shapes = jax.tree.map(lambda x: list(np.shape(x)), params)
  flat = flax.traverse_util.flatten_dict(shapes, sep="/")
  return {"model": config.model.to_dict(), "data": config.data.name,
          "param_shapes": {k: flat[k] for k in sorted(flat)},
          "optimizer": config.optimizer.name}


def _short(value: Any, limit: int = 80) -> str:
  text = json.dumps(value) if value is not None else "<absent>"
  return text if len(text) <= limit else text[:limit - 3] + "..."


class CheckpointManager:
  """Saves and restores train-state checkpoints in `directory`.

  Attributes:
    directory: absolute path of the checkpoint directory.
    save_every: `should_save(step)` is true at positive multiples of it;
      0 means only forced saves.
    keep: how many of the newest checkpoints are kept; older ones are deleted
      after each save.
    config_fingerprint: JSON-normalised dict of what must match to resume.
  """

  def __init__(self, directory: str, *, save_every: int, keep: int,
               config_fingerprint: dict):
    """Opens (creating if needed) the checkpoint directory.

    Args:
      directory: WORKDIR/checkpoints.
      save_every: checkpoint period in steps (>= 0; 0: only forced saves).
      keep: number of newest checkpoints to keep (>= 1).
      config_fingerprint: JSON-serialisable dict describing what must match
        to resume (e.g. model config and parameter shapes); stored with each
        checkpoint and compared on restore.

    Raises:
      ConfigError("save_every" / "keep") for invalid values; TypeError when
      the fingerprint is not JSON-serialisable.
    """
    require(isinstance(save_every, int) and not isinstance(save_every, bool)
            and save_every >= 0, "save_every",
            f"must be an integer >= 0, got {save_every!r}")
    require(isinstance(keep, int) and not isinstance(keep, bool) and keep >= 1,
            "keep", f"must be an integer >= 1, got {keep!r}")
    require(isinstance(config_fingerprint, Mapping), "config_fingerprint",
            f"must be a dict, got {type(config_fingerprint).__name__}")
    self.directory = os.path.abspath(os.fspath(directory))
    self.save_every = save_every
    self.keep = keep
    self.config_fingerprint = _normalise_json(dict(config_fingerprint),
                                              "config_fingerprint")
    self._corrupt: set[int] = set()
    options = ocp.CheckpointManagerOptions(
        max_to_keep=keep,
        create=True,
        enable_async_checkpointing=False,
        cleanup_tmp_directories=True,
    )
    self._manager = ocp.CheckpointManager(
        self.directory, options=options,
        item_names=(STATE, EXTRA, FINGERPRINT))

  def should_save(self, step: int) -> bool:
    """True when `step` is a positive multiple of `save_every`."""
    return self.save_every > 0 and step > 0 and step % self.save_every == 0

  def all_steps(self) -> list[int]:
    """Steps of the checkpoints on disk, ascending (corrupt ones included)."""
    return sorted(int(s) for s in self._manager.all_steps())

  def latest_step(self) -> int | None:
    """The newest checkpoint's step (it may still turn out unreadable)."""
    steps = self.all_steps()
    return steps[-1] if steps else None

  def save(self, step: int, state: Any, extra: Mapping[str, Any], *,
           force: bool = False) -> None:
    """Writes checkpoint `step` if `should_save(step)` or `force`.

    Returns once the checkpoint is complete on disk. A step that already has
    a checkpoint is left as it is (saving twice at one step, e.g. periodic
    then final, is a no-op), unless `restore` found that checkpoint
    unreadable, in which case it is replaced.

    Args:
      step: the train step (>= 0).
      state: pytree of jax/numpy arrays (typed PRNG keys allowed).
      extra: JSON-serialisable dict (e.g. data iterator position).
      force: save even when `should_save(step)` is false.
    """
    if not (force or self.should_save(step)):
      return
    step = int(step)
    extra = _normalise_json(dict(extra), "extra")
    if step in self.all_steps():
      if step not in self._corrupt:
        return
      self._manager.delete(step)
    self._corrupt.discard(step)
    state = jax.tree.map(_to_saveable, state)
    self._manager.save(
        step,
        args=ocp.args.Composite(**{
            STATE: ocp.args.StandardSave(state),
            EXTRA: ocp.args.JsonSave(extra),
            FINGERPRINT: ocp.args.JsonSave(self.config_fingerprint),
        }),
        force=True)
    self._manager.wait_until_finished()

  def _check_fingerprint(self, step: int, stored: Any) -> None:
    if stored == self.config_fingerprint:
      return
    stored_flat = _flatten(stored)
    current_flat = _flatten(self.config_fingerprint)
    diffs = fingerprint_diff(stored, self.config_fingerprint)
    details = "; ".join(
        f"{k}: checkpoint {_short(stored_flat.get(k))} vs config "
        f"{_short(current_flat.get(k))}" for k in diffs[:10])
    more = f" (and {len(diffs) - 10} more)" if len(diffs) > 10 else ""
    raise ConfigError(
        "workdir",
        f"{self.directory} holds a checkpoint (step {step}) of an "
        f"incompatible config; differing keys: {details}{more}. Use a new "
        "workdir or restore the original config.")

  def restore(self, target_state: Any) -> tuple[Any, dict, int] | None:
    """Restores the newest readable checkpoint into `target_state`'s layout.

    Args:
      target_state: pytree with the structure, shapes and dtypes of the saved
        state (concrete arrays or `jax.ShapeDtypeStruct`s; jax arrays are
        restored with the target leaf's sharding, numpy arrays as numpy).

    Returns:
      `(state, extra, step)`, or None when the directory has no checkpoint.

    Raises:
      ConfigError("workdir"): the checkpoint was saved with a different
        `config_fingerprint` (the message lists the differing keys).
      CheckpointError: checkpoints exist but none can be read.

    An unreadable checkpoint triggers a warning naming its step and a fall
    back to the next older one.
    """
    leaves, treedef = jax.tree.flatten(target_state)
    abstract = treedef.unflatten([_to_restore_target(x) for x in leaves])

    def read_state(step: int) -> Any:
      restored = self._manager.restore(step, args=ocp.args.Composite(**{
          STATE: ocp.args.StandardRestore(abstract)}))[STATE]
      restored_leaves = treedef.flatten_up_to(restored)
      return treedef.unflatten(
          [_from_restored(t, v) for t, v in zip(leaves, restored_leaves)])

    return self._restore_newest(read_state)

  def restore_variables(self, target: Mapping[str, Any]
                        ) -> tuple[dict[str, Any], int] | None:
    """Restores only the entries of `target` from the newest readable
    checkpoint's state (e.g. `{"params": ..., "collections": ...}`, leaving
    the optimizer state on disk).

    Args:
      target: top-level state entries to read, each a pytree of
        `jax.ShapeDtypeStruct`s or arrays (no typed PRNG keys) matching the
        saved entry; empty subtrees are returned as they are.

    Returns:
      `(entries, step)` with jax arrays, or None when there is no checkpoint.
      Fingerprint check and fallback to older checkpoints as in `restore`.
      Meant for read-only managers (e.g. evaluation): do not `save` with the
      same manager afterwards.
    """
    wanted = {k: v for k, v in target.items() if jax.tree.leaves(v)}
    leaves, treedef = jax.tree.flatten(wanted)
    abstract = treedef.unflatten([_to_restore_target(x) for x in leaves])
    restore_args = jax.tree.map(
        lambda x: ocp.ArrayRestoreArgs(sharding=x.sharding), abstract)

    def read_state(step: int) -> dict[str, Any]:
      restored = self._manager.restore(step, args=ocp.args.Composite(**{
          STATE: ocp.args.PyTreeRestore(item=abstract,
                                        restore_args=restore_args,
                                        partial_restore=True)}))[STATE]
      values = treedef.unflatten(treedef.flatten_up_to(restored))
      return {k: values.get(k, v) for k, v in target.items()}

    restored = self._restore_newest(read_state)
    return None if restored is None else (restored[0], restored[2])

  def _restore_newest(self, read_state: Callable[[int], Any]
                      ) -> tuple[Any, dict, int] | None:
    """`(read_state(step), extra, step)` for the newest readable step."""
    steps = self.all_steps()
    if not steps:
      return None
    failures = []
    for step in reversed(steps):
      try:
        meta = self._manager.restore(step, args=ocp.args.Composite(**{
            EXTRA: ocp.args.JsonRestore(),
            FINGERPRINT: ocp.args.JsonRestore()}))
        stored = meta[FINGERPRINT]
        extra = meta[EXTRA]
        if not isinstance(stored, Mapping) or not isinstance(extra, Mapping):
          raise ValueError("fingerprint/extra is not a JSON object")
      except Exception as e:  # pylint: disable=broad-except
        self._unreadable(step, e, failures)
        continue
      self._check_fingerprint(step, stored)
      try:
        state = read_state(step)
      except Exception as e:  # pylint: disable=broad-except
        self._unreadable(step, e, failures)
        continue
      return state, dict(extra), step
    raise CheckpointError(
        f"none of the checkpoints in {self.directory} can be restored "
        "(refusing to start from scratch over them): "
        + "; ".join(failures))

  def _unreadable(self, step: int, error: Exception, failures: list) -> None:
    reason = f"{type(error).__name__}: {error}"
    if len(reason) > 300:
      reason = reason[:297] + "..."
    failures.append(f"step {step}: {reason}")
    self._corrupt.add(step)
    warnings.warn(
        f"checkpoint at step {step} in {self.directory} is unreadable "
        f"({reason}); falling back to an older checkpoint", stacklevel=4)

  def close(self) -> None:
    """Waits for pending work and releases orbax resources."""
    self._manager.wait_until_finished()
    self._manager.close()

  def __enter__(self) -> "CheckpointManager":
    return self

  def __exit__(self, *exc) -> None:
    self.close()


__all__ = ["CheckpointError", "CheckpointManager", "config_fingerprint",
           "fingerprint_diff"]
