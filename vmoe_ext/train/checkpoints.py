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
that `restore` would take as the latest one. A save that fails (a full disk)
removes its temporary directory and raises `CheckpointSaveError`.

Faults are reported once, in our words: an unreadable checkpoint gives one
warning and a fall back to the next older one; orbax's own error logs, the
"Event loop is closed" tracebacks of its abandoned reads and those of its
abandoned writes are filtered out (see `quiet_orbax`).

Typed PRNG keys (`jax.random.key`) cannot be serialised as such; the manager
handles them itself: such a leaf is saved as its `jax.random.key_data` and
restored into a typed key with the implementation of the corresponding leaf
of `target_state`. Raw uint32 keys (`jax.random.PRNGKey`) are plain arrays.
Typed keys in the target must be concrete arrays (not `ShapeDtypeStruct`s).

`restore_variables` reads only some entries of the saved state (e.g. params
and router state for evaluation, without the optimizer state).

Sharded states: every array is saved with its sharding (each device's shard
written by the process that holds it) and restored into the sharding of the
corresponding leaf of `target_state`, whatever mesh saved it: a checkpoint
written on a `(4, 2)` mesh restores onto `(8, 1)`, `(1, 8)` or one device,
and back.

Multi-process jobs: every process calls `save` and `restore` with the same
arguments (orbax's collective protocol: each process writes its shards,
process 0 the JSON items, the step directory's rename and the deletion of
old steps, with barriers between); the cleanup of a failed save is process
0's.
"""

from __future__ import annotations

import errno
import glob
import os
import shutil
import warnings
from typing import Any, Callable, Mapping

import jax
import numpy as np
import orbax.checkpoint as ocp

from vmoe_ext.errors import require
from vmoe_ext.interop.checkpoint_params import STATE
from vmoe_ext.sharding.multihost import is_main_process
from vmoe_ext.train.fingerprint import (check_fingerprint, config_fingerprint,
                                        fingerprint_diff, normalise_json,
                                        with_filled_model)
from vmoe_ext.train.orbax_quiet import (is_io_failure, join_threads,
                                        orbax_threads, os_errno, quiet_orbax,
                                        release_abandoned_tasks, short_reason)

EXTRA, FINGERPRINT = "extra", "fingerprint"  # STATE: the params reader's.
PURPOSES = ("resume", "evaluate")


class CheckpointError(RuntimeError):
  """A checkpoint directory cannot be used: checkpoints exist but none of
  them can be restored (or, as `CheckpointSaveError`, one cannot be written).
  """


class CheckpointSaveError(CheckpointError):
  """Writing a checkpoint failed (e.g. the disk is full); nothing of that
  step is left for `restore` to take.

  Attributes:
    directory: the checkpoint directory.
    step: the step that could not be saved.
    errno: the OS error number (`errno.ENOSPC` for a full disk), or None.
  """

  def __init__(self, message: str, *, directory: str, step: int,
               os_errno: int | None):
    super().__init__(message)
    self.directory = directory
    self.step = step
    self.errno = os_errno


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


# -------------------------------------------------------------------- manager


class CheckpointManager:
  """Saves and restores train-state checkpoints in `directory`.

  Attributes:
    directory: absolute path of the checkpoint directory.
    save_every: `should_save(step)` is true at positive multiples of it;
      0 means only forced saves.
    keep: how many of the newest checkpoints are kept; older ones are deleted
      after each save.
    config_fingerprint: JSON-normalised dict of what must match to resume
      (its "model" entry with absent fields filled with their defaults).
    purpose: "resume" (training) or "evaluate"; shapes the messages of
      fingerprint mismatches and unusable directories.
  """

  def __init__(self, directory: str, *, save_every: int, keep: int,
               config_fingerprint: dict, purpose: str = "resume"):
    """Opens (creating if needed) the checkpoint directory.

    Args:
      directory: WORKDIR/checkpoints.
      save_every: checkpoint period in steps (>= 0; 0: only forced saves).
      keep: number of newest checkpoints to keep (>= 1).
      config_fingerprint: JSON-serialisable dict describing what must match
        to resume (e.g. model config and parameter shapes); stored with each
        checkpoint and compared on restore.
      purpose: "resume": a mismatch means another run's workdir; "evaluate":
        the checkpoint is only read for evaluation, a mismatch names the
        first differing config field and the optimizer is not compared.

    Raises:
      ConfigError("save_every" / "keep" / "purpose") for invalid values;
      TypeError when the fingerprint is not JSON-serialisable.
    """
    require(isinstance(save_every, int) and not isinstance(save_every, bool)
            and save_every >= 0, "save_every",
            f"must be an integer >= 0, got {save_every!r}")
    require(isinstance(keep, int) and not isinstance(keep, bool) and keep >= 1,
            "keep", f"must be an integer >= 1, got {keep!r}")
    require(isinstance(config_fingerprint, Mapping), "config_fingerprint",
            f"must be a dict, got {type(config_fingerprint).__name__}")
    require(purpose in PURPOSES, "purpose",
            f"must be one of {PURPOSES}, got {purpose!r}")
    self.directory = os.path.abspath(os.fspath(directory))
    self.save_every = save_every
    self.keep = keep
    self.purpose = purpose
    self.config_fingerprint = normalise_json(
        with_filled_model(config_fingerprint), "config_fingerprint")
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

    Raises:
      CheckpointSaveError: writing failed (full disk, permissions, ...); the
        partial step was removed, the older checkpoints are intact.
    """
    if not (force or self.should_save(step)):
      return
    step = int(step)
    extra = normalise_json(dict(extra), "extra")
    if step in self.all_steps():
      if step not in self._corrupt:
        return
      self._manager.delete(step)
    self._corrupt.discard(step)
    state = jax.tree.map(_to_saveable, state)
    threads = orbax_threads()
    with quiet_orbax():
      try:
        self._manager.save(
            step,
            args=ocp.args.Composite(**{
                STATE: ocp.args.StandardSave(state),
                EXTRA: ocp.args.JsonSave(extra),
                FINGERPRINT: ocp.args.JsonSave(self.config_fingerprint),
            }),
            force=True)
        self._manager.wait_until_finished()
      except Exception as e:  # pylint: disable=broad-except
        # The other items' writer threads may still be running: let them
        # end before removing the directory they write into.
        join_threads(orbax_threads() - threads, timeout=60.0)
        release_abandoned_tasks(e)
        self._discard_partial(step)
        if not is_io_failure(e):
          raise
        raise self._save_error(step, e) from e

  def _discard_partial(self, step: int) -> None:
    """Removes what a failed save of `step` left (frees the space it took);
    on process 0 only (no barrier: the other processes may not have failed
    at the same point)."""
    if is_main_process():
      pattern = os.path.join(glob.escape(self.directory),
                             f"{step}.orbax-checkpoint-tmp*")
      for path in glob.glob(pattern):
        shutil.rmtree(path, ignore_errors=True)
    self._manager.reload()

  def _save_error(self, step: int, error: Exception) -> CheckpointSaveError:
    code = os_errno(error)
    if code is not None:
      reason = os.strerror(code).lower()
      reason = f"{reason} ({errno.errorcode.get(code, code)})"
    else:
      reason = short_reason(error, self.directory)
    good = [s for s in self.all_steps() if s not in self._corrupt]
    latest = good[-1] if good else None
    if latest == step:  # Failed after orbax committed it (e.g. cleanup).
      where = f"Step {step} was completed nonetheless"
    else:
      where = (f"The partial step {step} was removed; " + (
          "there is no complete checkpoint there yet" if latest is None
          else f"the newest complete checkpoint there is step {latest}"))
    resumes = ("starts from scratch" if latest is None
               else f"resumes from step {latest}")
    todo = ("free space on that disk" if code in (errno.ENOSPC, errno.EDQUOT)
            else "fix the cause")
    return CheckpointSaveError(
        f"could not write the checkpoint of step {step} to {self.directory}:"
        f" {reason}. {where}. To go on, {todo} and re-run the same command: "
        f"the run {resumes}.",
        directory=self.directory, step=step, os_errno=code)

  def _check_fingerprint(self, step: int, stored: Any) -> None:
    check_fingerprint(stored, self.config_fingerprint, step=step,
                      directory=self.directory, purpose=self.purpose)

  def restore(self, target_state: Any) -> tuple[Any, dict, int] | None:
    """Restores the newest readable checkpoint into `target_state`'s layout.

    Args:
      target_state: pytree with the structure, shapes and dtypes of the saved
        state (concrete arrays or `jax.ShapeDtypeStruct`s; jax arrays are
        restored with the target leaf's sharding, numpy arrays as numpy).

    Returns:
      `(state, extra, step)`, or None when the directory has no checkpoint.

    Raises:
      ConfigError: the checkpoint was saved with a different
        `config_fingerprint` (field "workdir" listing the differing keys; for
        purpose "evaluate", the first differing config field).
      CheckpointError: checkpoints exist but none can be read.

    An unreadable checkpoint triggers one warning naming its step and the
    reason, and a fall back to the next older one.
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

  def restore_variables(self, target: Mapping[str, Any],
                        step: int | None = None
                        ) -> tuple[dict[str, Any], int] | None:
    """Restores only the entries of `target` from the newest readable
    checkpoint's state (e.g. `{"params": ..., "collections": ...}`, leaving
    the optimizer state on disk), or from the checkpoint of `step`.

    Args:
      target: top-level state entries to read, each a pytree of
        `jax.ShapeDtypeStruct`s or arrays (no typed PRNG keys) matching the
        saved entry; empty subtrees are returned as they are.
      step: read this step's checkpoint only (None: the newest readable);
        None is returned when no checkpoint of that step is on disk.

    Returns:
      `(entries, step)` with jax arrays, or None when there is no checkpoint.
      Fingerprint check and fallback to older checkpoints as in `restore`.
      Leaves are cast to the dtypes of `target` where the saved ones differ.
      Meant for read-only managers (e.g. evaluation): do not `save` with the
      same manager afterwards.
    """
    wanted = {k: v for k, v in target.items() if jax.tree.leaves(v)}
    leaves, treedef = jax.tree.flatten(wanted)
    abstract = treedef.unflatten([_to_restore_target(x) for x in leaves])
    # In the target's dtype: parameters saved in bfloat16 restore into a
    # float32 model and vice versa (`model.param_dtype`).
    restore_args = jax.tree.map(
        lambda x: ocp.ArrayRestoreArgs(sharding=x.sharding, dtype=x.dtype),
        abstract)

    def read_state(step: int) -> dict[str, Any]:
      restored = self._manager.restore(step, args=ocp.args.Composite(**{
          STATE: ocp.args.PyTreeRestore(item=abstract,
                                        restore_args=restore_args,
                                        partial_restore=True)}))[STATE]
      values = treedef.unflatten(treedef.flatten_up_to(restored))
      return {k: values.get(k, v) for k, v in target.items()}

    restored = self._restore_newest(read_state, step)
    return None if restored is None else (restored[0], restored[2])

  def _restore_newest(self, read_state: Callable[[int], Any],
                      only: int | None = None
                      ) -> tuple[Any, dict, int] | None:
    """`(read_state(step), extra, step)` for the newest readable step (of
    the steps on disk, or of `[only]` where that step is on disk)."""
    steps = self.all_steps()
    if only is not None:
      steps = [s for s in steps if s == only]
    if not steps:
      return None
    failures = []
    for step in reversed(steps):
      try:
        with quiet_orbax():
          meta = self._manager.restore(step, args=ocp.args.Composite(**{
              EXTRA: ocp.args.JsonRestore(),
              FINGERPRINT: ocp.args.JsonRestore()}))
        stored = meta[FINGERPRINT]
        extra = meta[EXTRA]
        if not isinstance(stored, Mapping) or not isinstance(extra, Mapping):
          raise ValueError("fingerprint/extra is not a JSON object")
      except Exception as e:  # pylint: disable=broad-except
        self._unreadable(step, "extra/fingerprint", e, failures, steps)
        continue
      self._check_fingerprint(step, stored)
      try:
        with quiet_orbax():
          state = read_state(step)
      except Exception as e:  # pylint: disable=broad-except
        self._unreadable(step, "state", e, failures, steps)
        continue
      return state, dict(extra), step
    if self.purpose == "evaluate":
      todo = ("Put a good checkpoint back there (a numbered step directory "
              "from a backup), or evaluate another training run.")
    else:
      todo = (f"Refusing to start from scratch over them: move or delete "
              f"{self.directory} to start the run over, or put a good "
              "checkpoint back there (a numbered step directory from a "
              "backup) to resume from it.")
    raise CheckpointError(
        f"none of the {len(steps)} checkpoints in {self.directory} can be "
        f"restored ({'; '.join(failures)}). {todo}")

  def _unreadable(self, step: int, item: str, error: Exception,
                  failures: list, steps: list[int]) -> None:
    reason = f"{item}: {short_reason(error, self.directory)}"
    failures.append(f"step {step}: {reason}")
    self._corrupt.add(step)
    then = ("falling back to an older checkpoint" if step > steps[0]
            else "no older checkpoint is left")
    warnings.warn(f"checkpoint at step {step} in {self.directory} is "
                  f"unreadable ({reason}); {then}", stacklevel=4)

  def close(self) -> None:
    """Waits for pending work and releases orbax resources."""
    self._manager.wait_until_finished()
    self._manager.close()

  def __enter__(self) -> "CheckpointManager":
    return self

  def __exit__(self, *exc) -> None:
    self.close()


__all__ = ["CheckpointError", "CheckpointManager", "CheckpointSaveError",
           "PURPOSES", "config_fingerprint", "fingerprint_diff"]
