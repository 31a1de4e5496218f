"""Routers that wrap a base router given by its config (ACMoE, Symphony).

A wrapper router has a `base` field, a router config `{"name": ..., **fields}`
with the wrapper's E. It builds the base as a submodule named "base" (so its
parameters live under `router/base`), and takes the base's kind, K and
placement rules as its own. Config errors inside the base name
`router.base.*` (the model prefixes `model.moe.`), and the config schema
validates and overrides the base's fields (`nested_routers`).
"""

from __future__ import annotations

from typing import Any, ClassVar, Mapping

from vmoe_ext.config.schema import renamed_scope
from vmoe_ext.errors import require
from vmoe_ext.moe.contract import Router
from vmoe_ext.routers.registry import ROUTERS


class WrapperRouter(Router):
  """Base class of routers with a `base` router config (see module doc).

  Subclasses declare the `base` field with their default and may override
  `base_config` (to adapt the base's config) and `check_base` (to reject
  bases they cannot wrap).
  """
  base: Mapping[str, Any]

  nested_routers: ClassVar[tuple[str, ...]] = ("base",)

  def base_config(self) -> dict[str, Any]:
    """The base router's config (checked to be a router config)."""
    require(isinstance(self.base, Mapping) and "name" in self.base,
            "router.base", "must be a router config {'name': ..., ...}")
    return dict(self.base)

  def build_base(self, config: Mapping[str, Any] | None = None,
                 **kwargs: Any) -> Router:
    """The base router (unbound with `parent=None`, else a submodule)."""
    with renamed_scope("router", "router.base"):
      return ROUTERS.build(self.base_config() if config is None else config,
                           num_experts=self.num_experts, **kwargs)

  def base_prototype(self) -> Router:
    """The unbound base router (validated; errors name `router.base.*`)."""
    return self.build_base(parent=None)

  @property
  def kind(self) -> str:  # type: ignore[override]
    return self.base_prototype().kind

  @property
  def needs_image_groups(self) -> bool:  # type: ignore[override]
    return self.base_prototype().needs_image_groups

  @property
  def fixed_top_k(self) -> bool:  # type: ignore[override]
    return self.base_prototype().fixed_top_k

  @property
  def slots_per_token(self) -> int:
    return self.base_prototype().slots_per_token

  @property
  def assignment_width(self) -> int:
    return self.base_prototype().assignment_width

  def check_placement(self, moe_blocks: tuple[int, ...]) -> None:
    with renamed_scope("router", "router.base"):
      self.base_prototype().check_placement(moe_blocks)

  def check_stages(self, stages: tuple[tuple[int, ...], ...]) -> None:
    with renamed_scope("router", "router.base"):
      self.base_prototype().check_stages(stages)
