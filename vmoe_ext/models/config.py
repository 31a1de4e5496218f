"""The `model` config section, read from the classes that define its fields.

    model         the fields of the class `name` selects (a `MODELS` entry:
                  `VisionTransformerMoe`, `SwinTransformerMoe`,
                  `LanguageModel`)
    model.dtype, model.param_dtype
                  "float32" (default) or "bfloat16"
                  (`vmoe_ext.models.precision`)
    model.moe     the keys of `MOE_DEFAULTS` (types from `MoeLayer`, `Router`,
                  `resolve_moe_layers`); the language model's defaults are
                  `LM_MOE_DEFAULTS` over them
    model.moe.router / model.stream / model.ac_router (language model)
                  `{"name": ..., **the selected class's dataclass fields}`

The fields are read at validation time, so a new router, stream or MoE field
needs no edit here. The section types and ranges the fields; the model's own
checks (placement, a router's `__post_init__`) run when the run assembly
builds the model, once (`vmoe_ext.app`), inside `field_scope("model")`.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

from vmoe_ext.config.schema import (REQUIRED, Field, Section, Spec,
                                    dataclass_fields, default_fields,
                                    function_fields)
from vmoe_ext.errors import require
from vmoe_ext.models import LANGUAGE_MODEL, MODELS
from vmoe_ext.models.lm_config import LM_MOE_DEFAULTS
from vmoe_ext.models.placement import resolve_moe_layers
from vmoe_ext.models.precision import DTYPES, PRECISION_FIELDS
from vmoe_ext.models.vit import MOE_DEFAULTS, VisionTransformerMoe
from vmoe_ext.moe.contract import Router
from vmoe_ext.moe.layer import MoeLayer
from vmoe_ext.routers.registry import ROUTERS
from vmoe_ext.streams import STREAMS

def registered(registry: Any, fixed: tuple[str, ...] = (),
               default_name: Optional[str] = None, default: Any = REQUIRED,
               nullable: bool = False) -> Section:
  """The section `{"name": ..., **fields}` of a registered dataclass.

  Its fields are the dataclass fields of the class that `name` selects
  (minus `fixed`, which the builder sets); unknown names list the registry.
  """

  def fields(value: Mapping[str, Any]) -> dict[str, Spec]:
    name = value.get("name", default_name)
    require(name is not None, "name", "is required")
    registry.check(name, field="name")
    out: dict[str, Spec] = {"name": Field("str", default_name or REQUIRED)}
    cls = registry.get(name)
    out.update(dataclass_fields(cls, exclude=fixed))
    for key in getattr(cls, "nested_routers", ()):  # e.g. ACMoE's `base`.
      out[key] = registered(registry, fixed=fixed, default=out[key].default)
    return out

  return Section(fields, default=default, nullable=nullable,
                 component=True)


# Sub-sections of the model that select a registered class by name.
_REGISTRIES = {"router": ROUTERS, "stream": STREAMS}


def _subsections(fields: dict[str, Spec], soft: bool) -> dict[str, Spec]:
  registries = _REGISTRIES
  for key, spec in fields.items():
    if key == "router":
      fields[key] = registered(registries[key], fixed=("num_experts",),
                               default_name="soft" if soft else None,
                               default={"name": "soft"} if soft
                               else spec.default)
    elif key == "stream":
      fields[key] = registered(registries[key], default=spec.default,
                               nullable=True)
  return fields


def _moe_fields(soft: bool, defaults: Mapping[str, Any] = MOE_DEFAULTS):
  """Fields of `model.moe`: the keys of `MOE_DEFAULTS`, read at call time,
  with the model family's `defaults` (the language model's differ).

  Types come from where each field is consumed: `resolve_moe_layers`
  (placement), `MoeLayer` (layer fields), `Router` (num_experts).
  """

  def fields(value: Mapping[str, Any]) -> dict[str, Spec]:
    del value
    types = {**function_fields(resolve_moe_layers), **dataclass_fields(Router),
             **dataclass_fields(MoeLayer)}
    types = {k: v for k, v in types.items() if k in MOE_DEFAULTS}
    types["num_experts"] = Field("int", low=1)
    return _subsections(default_fields(defaults, types), soft)

  return fields


def _language_model_fields(fields: dict[str, Spec]) -> dict[str, Spec]:
  """The language model's own defaults: the `moe` section filled with
  `LM_MOE_DEFAULTS` (16 experts, the authors' top-2 gate, dropless), and
  `vocab_size` None meaning the corpus's vocabulary (the run assembly reads
  it from the data), `ac_router` a router section."""
  fields["moe"] = Section(_moe_fields(False, {**MOE_DEFAULTS,
                                              **LM_MOE_DEFAULTS}),
                          default=None, nullable=True)
  fields["vocab_size"] = Field(
      "int", None, nullable=True, low=1,
      doc="V; None: the corpus's vocabulary (read from the data)")
  # The router of the `c` layers, a router section as `moe.router` is
  # (None: `LM_AC_ROUTER`).
  fields["ac_router"] = registered(ROUTERS, fixed=("num_experts",),
                                   default=None, nullable=True)
  return fields


def _model_fields(value: Mapping[str, Any]) -> dict[str, Spec]:
  fields: dict[str, Spec] = {"name": Field("str", REQUIRED, choices=MODELS)}
  name = value.get("name")
  cls = MODELS.get(name).cls if name in MODELS else VisionTransformerMoe
  fields.update(dataclass_fields(cls))
  for key in PRECISION_FIELDS:  # A dtype name (the classes take dtypes too).
    if key in fields:
      fields[key] = Field("str", "float32", choices=tuple(DTYPES),
                          doc=PRECISION_DOCS[key])
  soft = value.get("name") == "soft_moe_vit"
  if name == LANGUAGE_MODEL:
    fields = _language_model_fields(fields)
  elif "moe" in fields:
    fields["moe"] = Section(_moe_fields(soft), default=None, nullable=True)
  return _subsections(fields, soft)


# `model.dtype` / `model.param_dtype` (`vmoe_ext.models.precision`).
PRECISION_DOCS = {
    "dtype": "compute dtype of the matmuls and activations (routers, "
             "LayerNorm statistics, stream state and logits stay float32)",
    "param_dtype": "dtype the parameters (and the optimizer state) are "
                   "stored in"}

MODEL = Section(_model_fields)

__all__ = ["MODEL", "registered"]
