"""Models: the ViT-MoE encoder family, the Swin family, the language model,
and a factory from config dicts."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Optional

import flax.linen as nn

from vmoe_ext.errors import ConfigError, field_scope, require
from vmoe_ext.models.language import language_model_fields
from vmoe_ext.models.placement import resolve_moe_layers
from vmoe_ext.models.vit import MOE_DEFAULTS, VisionTransformerMoe
from vmoe_ext.moe.expert_parallel import ExpertParallel
from vmoe_ext.moe.contract import SOFT
from vmoe_ext.registry import Registry, resolve
from vmoe_ext.routers.registry import ROUTERS


@dataclasses.dataclass(frozen=True)
class ModelKind:
  """What a `model.name` selects: the module class (its dataclass fields
  are the config's fields) and `complete(config without name) -> fields`,
  which checks and completes the config for that kind."""
  module: str  # "package.module:Class", imported on use.
  complete: Callable[[dict[str, Any]], dict[str, Any]]

  @property
  def cls(self) -> type:
    return resolve(self.module)


_VIT = "vmoe_ext.models.vit:VisionTransformerMoe"
_SWIN = "vmoe_ext.models.swin:SwinTransformerMoe"
_LM = "vmoe_ext.models.language:LanguageModel"
LANGUAGE_MODEL = "language_model"  # The model family of text runs.


def dense_vit_fields(config: dict[str, Any]) -> dict[str, Any]:
  """A dense ViT: no MoE layers."""
  require(config.get("moe") is None, "model.moe", "a dense 'vit' has no MoE "
          "layers; use name='vit_moe' or drop the moe field")
  return config


def vmoe_fields(config: dict[str, Any]) -> dict[str, Any]:
  """A V-MoE: an `moe` section with any router."""
  require(config.get("moe") is not None, "model.moe",
          "model 'vit_moe' needs an moe config")
  return config


def soft_moe_vit_fields(config: dict[str, Any]) -> dict[str, Any]:
  """A SoftMoE ViT: a soft router ("soft", the default), one image per group."""
  require(config.get("moe") is not None, "model.moe",
          "model 'soft_moe_vit' needs an moe config")
  moe = dict(config["moe"])
  router = dict(moe.get("router") or {"name": "soft"})
  router.setdefault("name", "soft")
  with field_scope("model.moe"):  # "soft", or e.g. ACMoE over a soft base.
    kind = ROUTERS.build(router, num_experts=moe.get(
        "num_experts", MOE_DEFAULTS["num_experts"]), parent=None).kind
  require(kind == SOFT, "model.moe.router.name",
          f"soft_moe_vit needs a soft router ('soft', or 'acmoe' with a "
          f"soft base), got {router['name']!r}")
  return {**config, "moe": {**moe, "router": router}}


def dense_swin_fields(config: dict[str, Any]) -> dict[str, Any]:
  """A dense Swin: no MoE layers."""
  require(config.get("moe") is None, "model.moe", "a dense 'swin' has no MoE "
          "layers; use name='swin_moe' or drop the moe field")
  return config


def swin_moe_fields(config: dict[str, Any]) -> dict[str, Any]:
  """A Swin-MoE: an `moe` section (any router) and `moe_blocks`."""
  require(config.get("moe") is not None, "model.moe",
          "model 'swin_moe' needs an moe config")
  return config


# Config name -> its `ModelKind`: a new backbone is one module plus one line.
MODELS = Registry("model", {
    "vit": ModelKind(_VIT, dense_vit_fields),
    "vit_moe": ModelKind(_VIT, vmoe_fields),
    "soft_moe_vit": ModelKind(_VIT, soft_moe_vit_fields),
    "swin": ModelKind(_SWIN, dense_swin_fields),
    "swin_moe": ModelKind(_SWIN, swin_moe_fields),
    LANGUAGE_MODEL: ModelKind(_LM, language_model_fields),
})


def build_model(config: Mapping[str, Any],
                expert_parallel: Optional[ExpertParallel] = None
                ) -> nn.Module:
  """Builds a model from a config dict (or ml_collections ConfigDict).

  `config["name"]` is one of:
    * "vit": dense ViT (`moe` must be absent or None);
    * "vit_moe": V-MoE, `moe` required (any router);
    * "soft_moe_vit": SoftMoE ViT, `moe` required; its router is soft:
      "soft" (the default) or a router over a soft base (ACMoE's SoftMoE
      variant); one image per group;
    * "swin": dense Swin Transformer (`vmoe_ext.models.swin`);
    * "swin_moe": Swin-MoE, `moe` and `moe_blocks` required (any router);
    * "language_model": the papers' word/byte-level language model
      (`vmoe_ext.models.language.LanguageModel`; text data).
  The remaining keys are the selected class's fields
  (`VisionTransformerMoe`, `SwinTransformerMoe` or `LanguageModel`). Everything is
  validated here, before any tracing; errors name the full path
  ("model.moe.router.num_selected"). The types of the fields are checked by
  `vmoe_ext.config` (`validate_config`) before this is called.
  `expert_parallel` (not a config field: the mesh comes from the `sharding`
  section, `vmoe_ext.sharding`) spreads the experts over a mesh axis.
  """
  config = _to_dict(config)
  kind = MODELS.get(config.pop("name", None))
  config = kind.complete(config)
  try:
    with field_scope("model"):
      if expert_parallel is not None and config.get("moe") is not None:
        config["expert_parallel"] = expert_parallel
      return kind.cls(**config)
  except TypeError as e:  # Unknown keyword: name the field.
    raise ConfigError("model", str(e)) from e


def _to_dict(config: Any) -> Any:
  if hasattr(config, "to_dict"):
    config = config.to_dict()
  if isinstance(config, Mapping):
    return {k: _to_dict(v) for k, v in config.items()}
  return config


__all__ = ["LANGUAGE_MODEL", "MODELS", "MOE_DEFAULTS", "ModelKind", "VisionTransformerMoe",
           "build_model", "dense_swin_fields", "dense_vit_fields",
           "resolve_moe_layers", "soft_moe_vit_fields", "swin_moe_fields",
           "vmoe_fields"]
