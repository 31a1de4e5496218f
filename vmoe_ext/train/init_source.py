"""Where the `init` section's parameters come from: a run or a foreign file.

Exactly one of:
  * `init.workdir` (+ `init.step`): another run of this project, its orbax
    checkpoint `WORKDIR/checkpoints/<step>/state` (`params` only);
  * `init.checkpoint` (+ `init.format`): a parameter tree written by another
    code base (`vmoe_ext.interop.formats`): google's vmoe partitioned files
    (`PREFIX.index` + `PREFIX.data-*`, how the V-MoE checkpoints are
    published), vit_jax `.npz` files, or a flax msgpack file. When the tree
    is a whole train state (its leaves under `params/`, beside an optimizer
    state), only `params/...` is read, with that prefix removed.
`open_source` lists the source's leaves and shapes without reading array
data; `InitSource.read` reads the leaves a plan needs.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable, Iterable, Optional

import numpy as np

from vmoe_ext.errors import ConfigError, require
from vmoe_ext.train import checkpoint_params as ckpt_params

Shape = tuple[int, ...]
PARAMS_PREFIX = "params/"


@dataclasses.dataclass(frozen=True)
class InitSource:
  """A checkpoint's parameter leaves.

  Attributes:
    location: the workdir or the foreign checkpoint's path.
    step: the checkpoint step (None for a foreign file).
    shapes: `{path: shape}` of every parameter leaf.
    read: `read(paths)` -> `{path: np.ndarray}` of those leaves.
    field: the config field that names the source (for errors).
  """
  location: str
  step: Optional[int]
  shapes: dict[str, Shape]
  read: Callable[[Iterable[str]], dict[str, np.ndarray]]
  field: str

  def describe(self) -> str:
    return (f"{self.location} (step {self.step})" if self.step is not None
            else self.location)


def config_value(config: Any, key: str) -> Any:
  """`config[key]` of a dict or ConfigDict; None when absent."""
  try:
    return config[key]
  except (KeyError, AttributeError):
    return None


def find_checkpoint(workdir: Any, step: Any) -> tuple[str, int]:
  """`(WORKDIR/checkpoints/<step>/state, step)` of the requested checkpoint.

  Raises:
    ConfigError("init.workdir") for a missing workdir or one without
    checkpoints; ConfigError("init.step") for a bad or absent step.
  """
  require(isinstance(workdir, (str, os.PathLike)) and os.fspath(workdir),
          "init.workdir", f"must be a directory path, got {workdir!r}")
  workdir = os.fspath(workdir)
  require(os.path.isdir(workdir), "init.workdir",
          f"{workdir} does not exist or is not a directory")
  directory = os.path.join(workdir, "checkpoints")
  steps = ckpt_params.checkpoint_steps(directory)
  if not steps:
    hint = (" (it looks like a checkpoints directory itself: give the run's "
            "workdir, its parent)"
            if ckpt_params.checkpoint_steps(workdir) else "")
    raise ConfigError("init.workdir", f"{workdir} has no checkpoint "
                      f"(expected {directory}/<step>/state){hint}")
  require(step is None or (isinstance(step, (int, np.integer))
                           and not isinstance(step, bool)), "init.step",
          f"must be an integer step or None (newest), got {step!r}")
  if step is None:
    step = steps[-1]
  require(int(step) in steps, "init.step",
          f"no checkpoint at step {step} in {directory}; available steps: "
          f"{steps}")
  return ckpt_params.state_directory(directory, int(step)), int(step)


def _run_source(init_config: Any) -> InitSource:
  workdir = config_value(init_config, "workdir")
  state_dir, step = find_checkpoint(workdir, config_value(init_config, "step"))
  try:
    shapes = {p: tuple(s) for p, (s, _) in
              ckpt_params.param_shapes(state_dir).items()}
  except Exception as e:  # pylint: disable=broad-except
    raise ConfigError("init.step", f"the checkpoint at step {step} "
                      f"({state_dir}) is unreadable: {e}") from e

  def read(paths: Iterable[str]) -> dict[str, np.ndarray]:
    try:
      return ckpt_params.read_params(state_dir, set(paths))
    except Exception as e:  # pylint: disable=broad-except
      raise ConfigError("init.step", f"the params of the checkpoint at step "
                        f"{step} ({state_dir}) are unreadable: {e}") from e

  return InitSource(os.fspath(workdir), step, shapes, read, "init.workdir")


def _foreign_source(init_config: Any) -> InitSource:
  from vmoe_ext.interop import formats  # Only foreign imports need it.
  path = config_value(init_config, "checkpoint")
  require(isinstance(path, (str, os.PathLike)) and os.fspath(path),
          "init.checkpoint", f"must be a file path or prefix, got {path!r}")
  fmt = config_value(init_config, "format") or "auto"
  path, fmt = formats.resolve(os.fspath(path), fmt)
  shapes = {p: tuple(shape) for p, (shape, _) in
            formats.read_shapes(path, fmt).items()}
  prefix = PARAMS_PREFIX if any(p.startswith(PARAMS_PREFIX)
                                for p in shapes) else ""
  shapes = {p[len(prefix):]: s for p, s in shapes.items()
            if p.startswith(prefix)}

  def read(paths: Iterable[str]) -> dict[str, np.ndarray]:
    arrays = formats.read_arrays(path, fmt, [prefix + p for p in paths])
    return {p[len(prefix):]: a for p, a in arrays.items()}

  return InitSource(f"{path} ({fmt} format)", None, shapes, read,
                    "init.checkpoint")


def open_source(init_config: Any) -> InitSource:
  """The source named by `init.workdir` or `init.checkpoint` (exactly one)."""
  has_file = config_value(init_config, "checkpoint") is not None
  require(not (has_file and config_value(init_config, "workdir") is not None),
          "init.checkpoint", "set only one of init.workdir (a run of this "
          "project) and init.checkpoint (a foreign checkpoint file)")
  return _foreign_source(init_config) if has_file else _run_source(
      init_config)


__all__ = ["InitSource", "config_value", "find_checkpoint", "open_source"]
