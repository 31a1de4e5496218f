"""The `carve` config section: the fields of `CarveSpec` (CMoE carving of a
dense ViT checkpoint into a V-MoE; docs/carving.md)."""

from __future__ import annotations

from typing import Any, Mapping

from vmoe_ext.carving.spec import CarveSpec
from vmoe_ext.config.schema import Section, Spec, dataclass_fields

def _carve_fields(value: Mapping[str, Any]) -> dict[str, Spec]:
  del value
  return dataclass_fields(CarveSpec)


def _check_carve(value: dict[str, Any]) -> None:
  """Ranges that need no other section (the rest: `CarveSpec.check`)."""
  CarveSpec.from_config(value)


CARVE = Section(_carve_fields, default=None, nullable=True, check=_check_carve,
                doc="carve mode: a dense ViT checkpoint into a V-MoE (CMoE)")

__all__ = ["CARVE"]
