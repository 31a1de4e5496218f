"""Lazy name -> class registries for config-selected components (routers, streams)."""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Mapping

from vmoe_ext.errors import ConfigError, require

# Fields every Flax module has that configs must not set.
_RESERVED = {"parent", "name"}


class Registry:
  """Maps config names to `"module:Class"` paths, imported on first use.

  Attributes:
    kind: what is registered ("router", "stream"); used in error messages and
      as the config field prefix.
    entries: name -> "package.module:ClassName".
  """

  def __init__(self, kind: str, entries: Mapping[str, str]):
    self.kind = kind
    self.entries = dict(entries)

  def __contains__(self, name: str) -> bool:
    return name in self.entries

  def names(self) -> list[str]:
    return sorted(self.entries)

  def get(self, name: str) -> type:
    """The class registered under `name`; ConfigError if there is none."""
    require(name in self.entries, f"{self.kind}.name",
            f"unknown {self.kind} {name!r}; registered: {self.names()}")
    module, cls = self.entries[name].split(":")
    return getattr(importlib.import_module(module), cls)

  def build(self, config: Mapping[str, Any], **fixed: Any) -> Any:
    """Instantiates `config = {"name": ..., **fields}` with `fixed` fields.

    Fields the class does not have raise ConfigError naming them, so a typo in
    a config is never silently ignored.
    """
    config = dict(config)
    require("name" in config, f"{self.kind}.name", "missing")
    cls = self.get(config.pop("name"))
    allowed = {f.name for f in dataclasses.fields(cls)} - _RESERVED
    allowed -= set(fixed)
    unknown = sorted(set(config) - allowed)
    if unknown:
      raise ConfigError(f"{self.kind}.{unknown[0]}",
                        f"not a field of {cls.__name__}; settable fields: "
                        f"{sorted(allowed)}")
    return cls(**config, **fixed)
