"""Name -> component registries for everything a config selects by name.

Routers, streams, attacks, corruptions, models, dispatchers and optimizers
are all looked up the same way: a config names one with a string and a
`Registry` maps it to a class or a function. An entry is either the object
itself or a lazy `"package.module:attr"` path, imported on first use, so that
registering costs no import and registries never create import cycles.
Unknown names raise a `ConfigError` that lists what is registered.

Components from the user's own modules (docs/extending.md). A registry
that can check what it is given (built with `base`, the class every entry
subclasses, or `accept`, which turns an object into an entry or raises
`TypeError`: the router, stream and attack registries) also takes

* a `"package.module:Name"` path as a config name, imported when the config
  is checked (`model.moe.router.name="my_pkg.routers:GreedyRouter"`). A
  path that does not import, names no attribute, or names something that
  `accept` rejects is one `ConfigError` on the config field that holds it;
* `register(name, obj)` of an object from the user's module
  (`vmoe_ext.register_router` and its siblings). A taken name raises
  `ValueError` unless `override=True`; names never contain ":".

Both pass `admit` (`accept`) and then behave as built-ins do: the config
schema reads their fields, unknown fields are errors. Imported paths are
cached in `entries` but not listed (`names()`, iteration).
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import inspect
from typing import Any, Callable, Iterator, Mapping, Optional

from vmoe_ext.errors import ConfigError, require

# Fields every Flax module has that configs must not set.
_RESERVED = frozenset({"parent", "name"})


def resolve(target: Any) -> Any:
  """`target` itself, or the object a "package.module:attr" path names
  (imported now; `attr` may be dotted, "module:Outer.Inner")."""
  if not isinstance(target, str):
    return target
  module, attr = target.split(":")
  obj = importlib.import_module(module)
  for part in attr.split("."):
    obj = getattr(obj, part)
  return obj


def is_path(name: Any) -> bool:
  """Whether a config name is a "package.module:attr" path (has a ":")."""
  return isinstance(name, str) and ":" in name


def describe(obj: Any) -> str:
  """`obj` for messages: "module.Class" for classes and functions."""
  if inspect.ismodule(obj):
    return f"the module {obj.__name__!r}"
  qualname = getattr(obj, "__qualname__", None)
  if qualname is None or not callable(obj):
    return f"a {type(obj).__name__} ({str(obj)[:60]})"
  return f"{getattr(obj, '__module__', '?')}.{qualname}"


def subclass_of(base: type) -> Callable[[Any], Any]:
  """An `accept` check: the object must be a subclass of `base`."""

  def accept(obj: Any) -> Any:
    if not (isinstance(obj, type) and issubclass(obj, base)):
      raise TypeError(f"{describe(obj)} is not a {base.__name__} subclass "
                      f"({describe(base)})")
    return obj

  return accept


def import_path(path: str, field: str) -> Any:
  """The object `path` ("package.module:attr") names; ConfigError on
  `field` if the path is malformed, does not import or names nothing."""
  module, _, attr = path.partition(":")
  require(module and attr and ":" not in attr, field,
          f"{path!r} is not a 'package.module:Name' path")
  try:
    obj = importlib.import_module(module)
  except ImportError as e:
    raise ConfigError(field, f"cannot import module {module!r} of {path!r}: "
                      f"{e} (is it on the Python path: PYTHONPATH or the "
                      "current directory?)") from e
  for i, part in enumerate(attr.split(".")):
    if not hasattr(obj, part):
      owner = ".".join([module, *attr.split(".")[:i]])
      close = difflib.get_close_matches(
          part, [n for n in dir(obj) if not n.startswith("_")], n=1)
      hint = f"; did you mean {close[0]!r}?" if close else ""
      raise ConfigError(field, f"{owner!r} has no attribute {part!r}{hint}")
    obj = getattr(obj, part)
  return obj


class Registry:
  """Maps config names to classes or functions, resolved lazily.

  Iterating yields the registered names in registration order; `names()` is
  sorted. Neither lists the "package.module:Name" paths a config used.

  Attributes:
    kind: what is registered ("router", "attack", ...); used in messages.
    field: the config field an unknown name is reported on (default
      `"{kind}.name"`; e.g. "moe.dispatcher" for the dispatchers).
    entries: name -> the object or its "package.module:attr" path.
    accept: `accept(obj) -> entry`, raising `TypeError` (with the reason)
      for an object that cannot be an entry; `subclass_of(base)` when built
      with `base`. None: anything goes, and config names cannot be paths.
  """

  def __init__(self, kind: str, entries: Mapping[str, Any], *,
               field: Optional[str] = None, base: Optional[type] = None,
               accept: Optional[Callable[[Any], Any]] = None):
    self.kind = kind
    self.field = field or f"{kind}.name"
    self.entries: dict[str, Any] = dict(entries)
    self.accept = accept if base is None else subclass_of(base)
    self._imported: set[str] = set()  # Paths a config named, cached.

  @property
  def takes_paths(self) -> bool:
    """Whether config names may be "package.module:Name" paths."""
    return self.accept is not None

  def admit(self, obj: Any) -> Any:
    """`obj` as an entry (`accept`'s conversion); TypeError if it cannot be
    one."""
    return obj if self.accept is None else self.accept(obj)

  def register(self, name: str, target: Any, *, override: bool = False
               ) -> None:
    """Adds `name` -> `target` (an object or a "module:attr" path).

    An object is checked now (`admit`), a path when first used. ValueError
    if `name` is taken (unless `override`) or contains ":".
    """
    if not isinstance(name, str) or not name or ":" in name:
      raise ValueError(f"{self.kind} names are non-empty strings without "
                       f"':' (that marks a 'package.module:Name' path), got "
                       f"{name!r}")
    if name in self.entries and not override:
      raise ValueError(f"{self.kind} {name!r} is already registered "
                       f"({describe(self.entries[name])}); pass "
                       "override=True to replace it")
    if not isinstance(target, str):
      target = self.admit(target)
    self.entries[name] = target

  def unregister(self, name: str) -> Any:
    """Removes `name` (KeyError if not registered); returns its entry."""
    if name not in self.entries or name in self._imported:
      raise KeyError(f"{self.kind} {name!r} is not registered")
    return self.entries.pop(name)

  def __contains__(self, name: object) -> bool:
    if not isinstance(name, str) or name in self.entries:
      return isinstance(name, str)
    if not (self.takes_paths and is_path(name)):
      return False
    try:
      self._import(name, self.field)
    except ConfigError:
      return False
    return True

  def __iter__(self) -> Iterator[str]:
    return (n for n in self.entries if n not in self._imported)

  def __len__(self) -> int:
    return len(self.entries) - len(self._imported)

  def __getitem__(self, name: str) -> Any:
    return self.get(name)

  def __repr__(self) -> str:
    return f"Registry({self.kind!r}, {self.names()})"

  def names(self) -> list[str]:
    return sorted(self)

  def _import(self, path: str, field: str) -> None:
    """Imports, checks and caches the entry of a config name that is a
    path; ConfigError on `field` naming what is wrong."""
    obj = import_path(path, field)
    try:
      entry = self.admit(obj)
    except TypeError as e:
      raise ConfigError(field, f"{path!r} cannot be a {self.kind}: {e}"
                        ) from e
    self.entries[path] = entry
    self._imported.add(path)

  def check(self, name: Any, field: Optional[str] = None) -> str:
    """Returns `name` if registered (or an importable path, imported now),
    else raises ConfigError on `field`."""
    field = field or self.field
    if self.takes_paths and is_path(name) and name not in self.entries:
      self._import(name, field)
      return name
    hint = (" (or a 'package.module:Name' path to your own)"
            if self.takes_paths else "")
    require(isinstance(name, str) and name in self.entries, field,
            f"unknown {self.kind} {name!r}; registered: {self.names()}"
            f"{hint}")
    return name

  def get(self, name: Any, field: Optional[str] = None) -> Any:
    """The class or function registered under `name` (imported if lazy)."""
    target = self.entries[self.check(name, field)]
    if isinstance(target, str):
      target = self.admit(resolve(target))
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
