"""Config name -> router class. A new router is one new module plus one line
here, or, from a module of your own, a `"package.module:Class"` config name
or one `register_router` call (docs/extending.md)."""

from __future__ import annotations

from typing import Any, Mapping, Union

from vmoe_ext.moe.contract import Router
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
}, base=Router)


def register_router(name: str, cls: Union[type, str], *,
                    override: bool = False) -> None:
  """Makes `model.moe.router.name=name` select `cls`.

  Args:
    name: the config name (no ":").
    cls: a `Router` subclass (checked now), or its "package.module:Class"
      path (imported and checked when first used).
    override: replace a router registered under `name` (a built-in too);
      without it a taken name raises ValueError.

  Raises:
    TypeError: `cls` is not a `Router` subclass.
    ValueError: `name` is taken (and not `override`) or contains ":".
  """
  ROUTERS.register(name, cls, override=override)


def get_router_class(name: str) -> type:
  """The router class registered under `name` (or a "module:Class" path)."""
  return ROUTERS.get(name)


def build_router(config: Mapping[str, Any], num_experts: int):
  """Instantiates the router `config = {"name": ..., **fields}` with E experts."""
  return ROUTERS.build(config, num_experts=num_experts)
