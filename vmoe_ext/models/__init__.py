"""Models: the ViT-MoE encoder family and a factory from config dicts."""

from __future__ import annotations

from typing import Any, Mapping, Optional

from vmoe_ext.errors import ConfigError, field_scope, require
from vmoe_ext.models.placement import resolve_moe_layers
from vmoe_ext.models.vit import MOE_DEFAULTS, VisionTransformerMoe
from vmoe_ext.moe.expert_parallel import ExpertParallel
from vmoe_ext.moe.contract import SOFT
from vmoe_ext.registry import Registry
from vmoe_ext.routers.registry import ROUTERS

# Config name -> `fn(config without name) -> VisionTransformerMoe fields`:
# each model kind checks and completes its own config.
MODELS = Registry("model", {
    "vit": "vmoe_ext.models:dense_vit_fields",
    "vit_moe": "vmoe_ext.models:vmoe_fields",
    "soft_moe_vit": "vmoe_ext.models:soft_moe_vit_fields",
})


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


def build_model(config: Mapping[str, Any],
                expert_parallel: Optional[ExpertParallel] = None
                ) -> VisionTransformerMoe:
  """Builds a model from a config dict (or ml_collections ConfigDict).

  `config["name"]` is one of:
    * "vit": dense ViT (`moe` must be absent or None);
    * "vit_moe": V-MoE, `moe` required (any router);
    * "soft_moe_vit": SoftMoE ViT, `moe` required; its router is soft:
      "soft" (the default) or a router over a soft base (ACMoE's SoftMoE
      variant); one image per group.
  The remaining keys are `VisionTransformerMoe` fields. Everything is
  validated here, before any tracing; errors name the full path
  ("model.moe.router.num_selected"). The types of the fields are checked by
  `vmoe_ext.config` (`validate_config`) before this is called.
  `expert_parallel` (not a config field: the mesh comes from the `sharding`
  section, `vmoe_ext.sharding`) spreads the experts over a mesh axis.
  """
  config = _to_dict(config)
  config = MODELS.get(config.pop("name", None))(config)
  try:
    with field_scope("model"):
      if expert_parallel is not None and config.get("moe") is not None:
        config["expert_parallel"] = expert_parallel
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
           "dense_vit_fields", "resolve_moe_layers", "soft_moe_vit_fields",
           "vmoe_fields"]
