"""The device mesh of a run, from the config's `sharding` section.

    sharding.axes         ("data", "expert")   mesh axis names
    sharding.shape        (-1, 1)              one size per axis; one -1 takes
                                               the devices left over
    sharding.expert_axis  "expert"             the axis experts are split over
                                               (None: no expert parallelism)
    sharding.rules        see `vmoe_ext.sharding.rules`

The batch is split over every axis (each device holds different examples);
expert weights over `expert_axis` only (vmoe's scheme). The mesh's axes are
`AxisType.Auto`: `jit` propagates shardings and the MoE layers'
`shard_map`s take their inputs from it (this jax's `jax.make_mesh` defaults
to explicit axes, which would need every shard_map input pre-sharded).
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Optional, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from vmoe_ext.errors import require
from vmoe_ext.moe.expert_parallel import ExpertParallel
from vmoe_ext.sharding.rules import check_rules

DEFAULTS: dict[str, Any] = {
    "axes": ("data", "expert"),
    "shape": (-1, 1),
    "expert_axis": "expert",
    "rules": None,  # None: `rules.DEFAULT_RULES`
}


def sharding_config(section: Optional[Mapping[str, Any]]) -> dict[str, Any]:
  """The `sharding` section with defaults filled in (None: all defaults)."""
  section = dict(section or {})
  return {**DEFAULTS, **{k: v for k, v in section.items() if v is not None
                         or k == "expert_axis"}}


def check_layout(config: Mapping[str, Any]) -> None:
  """What a filled `sharding` section must satisfy whatever the devices:
  distinct axes, one size each (>= 1, at most one -1), the expert axis one
  of them, well-formed rules naming only those axes; errors name
  `sharding.*`."""
  axes, shape = tuple(config["axes"]), tuple(int(s) for s in config["shape"])
  require(len(axes) > 0 and len(set(axes)) == len(axes), "sharding.axes",
          f"must be distinct axis names, got {axes}")
  require(len(shape) == len(axes), "sharding.shape",
          f"has {len(shape)} sizes for the {len(axes)} axes {axes}")
  require(all(s == -1 or s >= 1 for s in shape) and shape.count(-1) <= 1,
          "sharding.shape", f"sizes must be >= 1, with at most one -1 (the "
          f"devices left over), got {shape}")
  expert = config["expert_axis"]
  require(expert is None or expert in axes, "sharding.expert_axis",
          f"{expert!r} is not one of sharding.axes {axes}")
  if config["rules"] is not None:
    check_rules(config["rules"], axes)


def mesh_shape(axes: Sequence[str], shape: Sequence[int],
               num_devices: int) -> tuple[int, ...]:
  """The shape with its -1 resolved; errors name `sharding.*`."""
  check_layout({"axes": axes, "shape": shape, "expert_axis": None,
                "rules": None})
  axes, shape = tuple(axes), tuple(int(s) for s in shape)
  fixed = math.prod(s for s in shape if s != -1)
  if -1 in shape:
    require(num_devices % fixed == 0, "sharding.shape",
            f"{shape}: the fixed sizes (product {fixed}) do not divide the "
            f"{num_devices} devices")
    shape = tuple(num_devices // fixed if s == -1 else s for s in shape)
  require(math.prod(shape) == num_devices, "sharding.shape",
          f"mesh {dict(zip(axes, shape))} has {math.prod(shape)} devices; "
          f"this job has {num_devices} (jax.device_count())")
  return shape


def make_mesh(section: Optional[Mapping[str, Any]] = None,
              devices: Optional[Sequence[Any]] = None) -> Mesh:
  """The mesh of a `sharding` section over `devices` (all by default)."""
  config = sharding_config(section)
  check_layout(config)
  devices = list(jax.devices() if devices is None else devices)
  shape = mesh_shape(config["axes"], config["shape"], len(devices))
  axes = tuple(config["axes"])
  types = (AxisType.Auto,) * len(axes)
  if devices == list(jax.devices()):
    return jax.make_mesh(shape, axes, axis_types=types)
  return Mesh(np.asarray(devices).reshape(shape), axes, axis_types=types)


def expert_parallel(mesh: Mesh, section: Optional[Mapping[str, Any]] = None
                    ) -> Optional[ExpertParallel]:
  """The MoE layers' layout on `mesh`, or None on one device (the layers
  then run as they are; there is nothing to split)."""
  expert = sharding_config(section)["expert_axis"]
  if mesh.size == 1 or expert is None:  # None: pure data parallelism.
    return None
  return ExpertParallel(mesh, expert,
                        tuple(a for a in mesh.axis_names if a != expert))


def batch_axes(mesh: Mesh) -> tuple[str, ...]:
  """The axes the batch is split over: all of them."""
  return tuple(mesh.axis_names)
