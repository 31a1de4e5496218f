"""The `sharding` config section: the device mesh and the partition rules
(docs/sharding.md)."""

from __future__ import annotations

from typing import Any

from vmoe_ext.config.schema import Field, Section, Seq, renamed_scope
from vmoe_ext.sharding.mesh import DEFAULTS, check_layout, sharding_config

def _check_sharding(value: dict[str, Any]) -> None:
  # `check_layout` names the fields "sharding.*" (it also checks meshes
  # made without a config); the section check names them relative to it.
  with renamed_scope("sharding", ""):
    check_layout(sharding_config(value))


SHARDING = Section({
    "axes": Seq(Field("str"), DEFAULTS["axes"], min_length=1,
                doc="mesh axis names"),
    "shape": Seq(Field("int", low=-1), DEFAULTS["shape"], min_length=1,
                 doc="one size per axis; one -1: the devices left over"),
    "expert_axis": Field("str", DEFAULTS["expert_axis"], nullable=True,
                         doc="experts split over it; None: replicated"),
    "rules": Seq(Seq(Field("any"), length=2), DEFAULTS["rules"], nullable=True,
                 doc="(regex, PartitionSpec tuple) pairs; None: experts "
                 "over expert_axis, the rest replicated"),
}, default=None, nullable=True, check=_check_sharding,
                   doc="device mesh and partition rules (vmoe_ext.sharding)")

__all__ = ["SHARDING"]
