"""Config name -> router class. A new router is one new module plus one line here."""

from __future__ import annotations

from typing import Any, Mapping

from vmoe_ext.registry import Registry

ROUTERS = Registry("router", {
    "noisy_topk": "vmoe_ext.routers.noisy_top_k:NoisyTopKRouter",
    "expert_choice": "vmoe_ext.routers.expert_choice:ExpertChoiceRouter",
    "soft": "vmoe_ext.routers.soft:SoftRouter",
    "cosine": "vmoe_ext.routers.cosine:CosineRouter",
    "cosine_lm": "vmoe_ext.routers.cosine:CosineLMRouter",
    "top_p": "vmoe_ext.routers.top_p:TopPRouter",
    "acmoe": "vmoe_ext.routers.acmoe:ACMoERouter",
    "symphony": "vmoe_ext.routers.symphony:SymphonyRouter",
    "symphony_soft": "vmoe_ext.routers.symphony_soft:SymphonySoftRouter",
    "cmoe": "vmoe_ext.routers.cmoe:CMoERouter",
    "swin_moe": "vmoe_ext.routers.swin_moe:SwinMoeRouter",
})


def get_router_class(name: str) -> type:
  """The router class registered under `name`."""
  return ROUTERS.get(name)


def build_router(config: Mapping[str, Any], num_experts: int):
  """Instantiates the router `config = {"name": ..., **fields}` with E experts."""
  return ROUTERS.build(config, num_experts=num_experts)
