"""Read-only access to the params of a saved train state, without its config.

A run's checkpoints live in `WORKDIR/checkpoints/<step>/` (written by
`vmoe_ext.train.checkpoints`); item `state/` is an orbax PyTree of the train
state dict (`params`, `opt_state`, `collections`, `rng`, `step`). These
helpers list the steps, read the `params` shapes from the orbax metadata (no
array data is read) and restore chosen params as numpy arrays, with no
target state, optimizer or model config of the run that wrote them. Nothing
is written to or deleted from the directory.

A reader of our own checkpoints, below the training package that writes
them, so that the algorithm packages (`vmoe_ext.carving` reads a dense ViT's
weights) need not import `vmoe_ext.train`; `vmoe_ext.train.checkpoint_params`
re-exports it.

Parameter paths are the nested dict keys joined with "/"
(`encoderblock_1/Mlp/Dense_0/kernel`), relative to `params`.
"""

from __future__ import annotations

import os
from typing import Any, Iterable, Mapping

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

# The orbax item holding the train state (`vmoe_ext.train.checkpoints`
# writes it under this name) and its params entry.
STATE = "state"
PARAMS = "params"


def checkpoint_steps(directory: str) -> list[int]:
  """Steps with a complete checkpoint in `directory` (`WORKDIR/checkpoints`).

  A step is a directory named by an integer that holds a `state/` item;
  orbax's temporary directories (`3.orbax-checkpoint-tmp-...`) are ignored.
  Returns the steps ascending; [] when the directory does not exist.
  """
  if not os.path.isdir(directory):
    return []
  return sorted(int(name) for name in os.listdir(directory)
                if name.isdigit()
                and os.path.isdir(os.path.join(directory, name, STATE)))


def state_directory(directory: str, step: int) -> str:
  """`directory/<step>/state`, the orbax item holding the train state."""
  return os.path.join(directory, str(step), STATE)


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
  """Nested mappings to `{"a/b/c": leaf}`; empty mappings vanish."""
  if isinstance(tree, Mapping):
    out: dict[str, Any] = {}
    for key, value in tree.items():
      out.update(flatten(value, f"{prefix}{key}/"))
    return out
  return {prefix[:-1]: tree}


def _unflatten(flat: Mapping[str, Any]) -> dict[str, Any]:
  tree: dict[str, Any] = {}
  for path, leaf in flat.items():
    *parents, name = path.split("/")
    node = tree
    for parent in parents:
      node = node.setdefault(parent, {})
    node[name] = leaf
  return tree


def _absolute(state_dir: str) -> epath.Path:
  """orbax reads absolute paths only; relative ones are from the cwd."""
  return epath.Path(os.path.abspath(state_dir))


def _params_metadata(state_dir: str) -> dict[str, Any]:
  handler = ocp.PyTreeCheckpointHandler()
  try:
    metadata = handler.metadata(_absolute(state_dir))
  finally:
    handler.close()
  tree = getattr(metadata, "tree", metadata)
  if not isinstance(tree, Mapping) or PARAMS not in tree:
    raise ValueError(f"{state_dir} holds no '{PARAMS}' entry")
  return flatten(tree[PARAMS])


def param_shapes(state_dir: str) -> dict[str, tuple[tuple[int, ...], Any]]:
  """`{path: (shape, dtype)}` of every saved param, from metadata only.

  Args:
    state_dir: `WORKDIR/checkpoints/<step>/state`.

  Raises:
    ValueError and orbax/OS errors when the item is unreadable or holds no
    params.
  """
  return {path: (tuple(int(d) for d in getattr(meta, "shape", ())),
                 getattr(meta, "dtype", None))
          for path, meta in _params_metadata(state_dir).items()}


def read_params(state_dir: str,
                paths: Iterable[str] | None = None) -> dict[str, np.ndarray]:
  """Restores saved params as numpy arrays with their saved dtypes.

  Args:
    state_dir: `WORKDIR/checkpoints/<step>/state`.
    paths: the param paths to read (others are not read); None: all.

  Returns:
    `{path: array}` for the requested paths.

  Raises:
    KeyError for a path that is not saved; orbax/OS errors when the data is
    unreadable.
  """
  metadata = _params_metadata(state_dir)
  paths = sorted(metadata if paths is None else set(paths))
  missing = [p for p in paths if p not in metadata]
  if missing:
    raise KeyError(f"not in {state_dir}: {', '.join(missing)}")
  if not paths:
    return {}
  item = {PARAMS: _unflatten({p: metadata[p] for p in paths})}
  restore_args = jax.tree.map(
      lambda _: ocp.RestoreArgs(restore_type=np.ndarray), item)
  handler = ocp.PyTreeCheckpointHandler()
  try:
    restored = handler.restore(
        _absolute(state_dir),
        args=ocp.args.PyTreeRestore(item=item, restore_args=restore_args,
                                    partial_restore=True))
  finally:
    handler.close()
  flat = flatten(restored[PARAMS])
  return {p: np.asarray(flat[p]) for p in paths}


__all__ = ["PARAMS", "STATE", "checkpoint_steps", "flatten", "param_shapes",
           "read_params", "state_directory"]
