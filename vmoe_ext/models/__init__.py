"""Models: the ViT-MoE encoder family and a factory from config dicts."""

from __future__ import annotations

from typing import Any, Mapping

from vmoe_ext.errors import ConfigError, require
from vmoe_ext.models.placement import resolve_moe_layers
from vmoe_ext.models.vit import MOE_DEFAULTS, VisionTransformerMoe

MODELS = ("vit", "vit_moe", "soft_moe_vit")


def build_model(config: Mapping[str, Any]) -> VisionTransformerMoe:
  """Builds a model from a config dict (or ml_collections ConfigDict).

  `config["name"]` is one of:
    * "vit": dense ViT (`moe` must be absent or None);
    * "vit_moe": V-MoE, `moe` required (any router);
    * "soft_moe_vit": SoftMoE ViT, `moe` required; its router is "soft" (set
      by default; any other router name is an error), one image per group.
  The remaining keys are `VisionTransformerMoe` fields. Everything is
  validated here, before any tracing.
  """
  config = _to_dict(config)
  name = config.pop("name", None)
  require(name in MODELS, "model.name",
          f"unknown model {name!r}; expected one of {MODELS}")
  moe = config.get("moe")
  if name == "vit":
    require(moe is None, "model.moe", "a dense 'vit' has no MoE layers; use "
            "name='vit_moe' or drop the moe field")
  else:
    require(moe is not None, "model.moe", f"model {name!r} needs an moe "
            "config")
  if name == "soft_moe_vit":
    moe = dict(moe)
    router = dict(moe.get("router") or {"name": "soft"})
    router.setdefault("name", "soft")
    require(router["name"] == "soft", "model.moe.router.name",
            f"soft_moe_vit uses the 'soft' router, got {router['name']!r}")
    moe["router"] = router
    config["moe"] = moe
  try:
    return VisionTransformerMoe(**config)
  except TypeError as e:  # Unknown keyword: name the field.
    raise ConfigError("model", str(e)) from e


def _to_dict(config: Any) -> Any:
  if hasattr(config, "to_dict"):
    config = config.to_dict()
  if isinstance(config, Mapping):
    return {k: _to_dict(v) for k, v in config.items()}
  return config


__all__ = ["MODELS", "MOE_DEFAULTS", "VisionTransformerMoe", "build_model",
           "resolve_moe_layers"]
