"""Name -> component registries for everything a config selects by name.

Routers, streams, attacks, corruptions, models, dispatchers and optimizers
are all looked up the same way: a config names one with a string and a
`Registry` maps it to a class or a function. An entry is either the object
itself or a lazy `"package.module:attr"` path, imported on first use, so that
registering costs no import and registries never create import cycles.
Unknown names raise a `ConfigError` that lists what is registered.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Iterator, Mapping, Optional

from vmoe_ext.errors import ConfigError, require

# Fields every Flax module has that configs must not set.
_RESERVED = frozenset({"parent", "name"})


def resolve(target: Any) -> Any:
  """`target` itself, or the object a "package.module:attr" path names
  (imported now)."""
  if not isinstance(target, str):
    return target
  module, attr = target.split(":")
  return getattr(importlib.import_module(module), attr)


class Registry:
  """Maps config names to classes or functions, resolved lazily.

  Iterating yields the names in registration order; `names()` is sorted.

  Attributes:
    kind: what is registered ("router", "attack", ...); used in messages.
    field: the config field an unknown name is reported on (default
      `"{kind}.name"`; e.g. "moe.dispatcher" for the dispatchers).
    entries: name -> the object or its "package.module:attr" path.
  """

  def __init__(self, kind: str, entries: Mapping[str, Any], *,
               field: Optional[str] = None):
    self.kind = kind
    self.field = field or f"{kind}.name"
    self.entries: dict[str, Any] = dict(entries)

  def register(self, name: str, target: Any) -> None:
    """Adds `name` -> `target` (an object or a "module:attr" path)."""
    if name in self.entries:
      raise ValueError(f"{self.kind} {name!r} is already registered")
    self.entries[name] = target

  def __contains__(self, name: object) -> bool:
    return isinstance(name, str) and name in self.entries

  def __iter__(self) -> Iterator[str]:
    return iter(self.entries)

  def __len__(self) -> int:
    return len(self.entries)

  def __getitem__(self, name: str) -> Any:
    return self.get(name)

  def __repr__(self) -> str:
    return f"Registry({self.kind!r}, {self.names()})"

  def names(self) -> list[str]:
    return sorted(self.entries)

  def check(self, name: Any, field: Optional[str] = None) -> str:
    """Returns `name` if registered, else raises ConfigError on `field`."""
    require(name in self, field or self.field,
            f"unknown {self.kind} {name!r}; registered: {self.names()}")
    return name

  def get(self, name: Any, field: Optional[str] = None) -> Any:
    """The class or function registered under `name` (imported if lazy)."""
    target = self.entries[self.check(name, field)]
    if isinstance(target, str):
      target = resolve(target)
      self.entries[name] = target
    return target

  def fields(self, name: Any) -> dict[str, dataclasses.Field]:
    """The settable dataclass fields of the class registered under `name`."""
    cls = self.get(name)
    return {f.name: f for f in dataclasses.fields(cls)
            if f.init and f.name not in _RESERVED}

  def build(self, config: Mapping[str, Any], **fixed: Any) -> Any:
    """Instantiates `config = {"name": ..., **fields}` with `fixed` fields.

    Fields the class does not have raise ConfigError naming them, so a typo in
    a config is never silently ignored. Errors name fields relative to the
    kind ("router.num_selected"); callers wrap this in `field_scope`.
    """
    config = dict(config)
    require("name" in config, self.field, "missing")
    name = config.pop("name")
    cls = self.get(name)
    allowed = set(self.fields(name)) - set(fixed)
    unknown = sorted(set(config) - allowed)
    if unknown:
      raise ConfigError(f"{self.kind}.{unknown[0]}",
                        f"not a field of {cls.__name__}; settable fields: "
                        f"{sorted(allowed)}")
    return cls(**config, **fixed)
