"""A tiny schema language for config sections, and the walk that checks one.

A config section is described by `Section(fields)`, whose fields are `Field`s
(scalars: type, default, range, choices), `Seq`s (lists/tuples of a spec),
`OneOf`s (alternatives) and nested `Section`s. `validate(spec, value, path)`
checks a value against its spec and raises `ConfigError` naming the full
dotted path as the user wrote it (`model.moe.router.num_selected`,
`robustness.attacks[1].eps`) for

* unknown fields (with a "did you mean" hint), at every depth;
* missing required fields;
* wrong types: a string where an int belongs, a bool where a number belongs
  (bool is not an int here), a float where an int belongs;
* NaN or infinite floats, and finite ones beyond float32's range;
* values out of a declared range or not among the declared choices.

A section's fields may depend on its value (`fields` is then a function of
it): the fields of `model.moe.router` are those of the router class its
`name` selects. `Section.check` runs a component's own checks (a router's
`__post_init__`) inside `field_scope(path)`, after the fields passed.
Helpers derive fields from dataclasses, function signatures and default
dicts, so that a component's fields are declared once, where it lives.
"""

from __future__ import annotations

import collections.abc
import contextlib
import dataclasses
import difflib
import inspect
import math
import numbers
import sys
import types
import typing
from typing import Any, Callable, Iterator, Mapping, Optional, Union

from vmoe_ext.errors import ConfigError, field_scope, join_path


class _Required:

  def __repr__(self) -> str:
    return "REQUIRED"


REQUIRED: Any = _Required()
FLOAT32_MAX = 3.4028234663852886e38  # numpy.finfo(numpy.float32).max
KINDS = ("int", "float", "bool", "str", "mapping", "any")
_DESCRIPTIONS = {"int": "an integer", "float": "a finite number",
                 "bool": "a bool (True or False)", "str": "a string",
                 "mapping": "a dict", "any": "any value"}


@dataclasses.dataclass(frozen=True)
class Field:
  """A scalar value (or a free-form dict, kind "mapping").

  Attributes:
    kind: one of `KINDS`. "float" accepts integers; "int" rejects floats and
      bools; floats must be finite and within float32's range.
    default: the value when absent (None: the component's default), or
      `REQUIRED`.
    nullable: None is allowed.
    low, high: inclusive bounds (exclusive with `low_open` / `high_open`).
    choices: allowed values: any container supporting `in` and iteration
      (a tuple, a `vmoe_ext.registry.Registry`), or a function returning one.
    doc: one line for humans.
  """
  kind: str = "any"
  default: Any = None
  nullable: bool = False
  low: Optional[float] = None
  high: Optional[float] = None
  low_open: bool = False
  high_open: bool = False
  choices: Any = None
  doc: str = ""


@dataclasses.dataclass(frozen=True)
class Seq:
  """A list or tuple whose items all match `item`."""
  item: "Spec"
  default: Any = ()
  nullable: bool = False
  length: Optional[int] = None
  min_length: int = 0
  doc: str = ""


@dataclasses.dataclass(frozen=True)
class OneOf:
  """A value matching any of `options` (tried in order)."""
  options: tuple["Spec", ...]
  description: str
  default: Any = None
  nullable: bool = False
  doc: str = ""


@dataclasses.dataclass(frozen=True)
class Section:
  """A dict of named fields; keys it does not know are errors.

  Attributes:
    fields: name -> spec, or a function of the section's (plain dict) value
      returning them.
    default: the value when absent (`REQUIRED`: the section must be given).
    nullable: None is allowed (the section is off).
    check: called with the plain dict value inside `field_scope(path)` once
      every field passed; components validate their own ranges there.
    doc: one line for humans.
    component: the section configures one component chosen by its `name`
      (a router, a stream, an attack): switching the name on the command
      line gives every field the command line does not set the new
      component's own default (`vmoe_ext.config.overrides`).
  """
  fields: Union[Mapping[str, "Spec"],
                Callable[[Mapping[str, Any]], Mapping[str, "Spec"]]]
  default: Any = REQUIRED
  nullable: bool = False
  check: Optional[Callable[[dict[str, Any]], None]] = None
  doc: str = ""
  component: bool = False

  def fields_of(self, value: Mapping[str, Any]) -> Mapping[str, "Spec"]:
    return self.fields(value) if callable(self.fields) else self.fields


Spec = Union[Field, Seq, OneOf, Section]


def plain(value: Any) -> Any:
  """ConfigDicts (and FieldReferences inside) to plain dicts, recursively."""
  if hasattr(value, "to_dict"):
    value = value.to_dict()
  if isinstance(value, Mapping):
    return {k: plain(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return type(value)(plain(v) for v in value)
  return value


def _got(value: Any) -> str:
  return f"got {value!r} ({type(value).__name__})"


def _range_text(spec: Field) -> str:
  lo = None if spec.low is None else (
      f"> {spec.low}" if spec.low_open else f">= {spec.low}")
  hi = None if spec.high is None else (
      f"< {spec.high}" if spec.high_open else f"<= {spec.high}")
  return " and ".join(s for s in (lo, hi) if s)


def _check_field(spec: Field, value: Any, path: str) -> None:
  kind = spec.kind
  if kind == "any":
    pass
  elif kind == "int":
    if not isinstance(value, numbers.Integral) or isinstance(value, bool):
      raise ConfigError(path, f"must be an integer, {_got(value)}")
  elif kind == "float":
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
      raise ConfigError(path, f"must be a number, {_got(value)}")
    if not math.isfinite(float(value)):
      raise ConfigError(path, f"must be finite, got {value!r}")
    if abs(float(value)) > FLOAT32_MAX:
      raise ConfigError(path, f"{value!r} overflows float32 (largest finite "
                        f"value {FLOAT32_MAX:.4g}); it would become inf on "
                        "the device")
  elif kind == "bool":
    if not isinstance(value, bool):
      raise ConfigError(path, f"must be True or False, {_got(value)}")
  elif kind == "str":
    if not isinstance(value, str):
      raise ConfigError(path, f"must be a string, {_got(value)}")
  elif kind == "mapping":
    if not isinstance(value, Mapping):
      raise ConfigError(path, f"must be a dict, {_got(value)}")
  else:
    raise ValueError(f"unknown field kind {kind!r}; expected one of {KINDS}")
  if spec.low is not None or spec.high is not None:
    ok = ((spec.low is None or (value > spec.low if spec.low_open
                                else value >= spec.low)) and
          (spec.high is None or (value < spec.high if spec.high_open
                                 else value <= spec.high)))
    if not ok:
      raise ConfigError(path, f"must be {_range_text(spec)}, got {value!r}")
  if spec.choices is not None:
    choices = spec.choices() if callable(spec.choices) else spec.choices
    if hasattr(choices, "check"):  # A Registry: its own message.
      choices.check(value, field=path)
    elif value not in choices:
      listed = sorted(choices) if not isinstance(choices, tuple) else choices
      raise ConfigError(path, f"unknown value {value!r}; expected one of "
                        f"{list(listed)}")


def unknown_message(key: str, known: list[str]) -> str:
  close = difflib.get_close_matches(key, known, n=1)
  hint = f"did you mean {close[0]!r}? " if close else ""
  return f"unknown field; {hint}known fields: {known}"


def _check_section(spec: Section, value: Any, path: str) -> None:
  if not isinstance(value, Mapping):
    raise ConfigError(path, f"must be a dict of fields, {_got(value)}")
  with field_scope(path):  # A selector field (`name`) may be wrong.
    fields = spec.fields_of(value)
  known = sorted(fields)
  for key in value:
    if key not in fields:
      raise ConfigError(join_path(path, str(key)),
                        unknown_message(str(key), known))
  missing = []
  for key, sub in fields.items():
    if key in value:
      validate(sub, value[key], join_path(path, key))
    elif getattr(sub, "default", None) is REQUIRED:
      missing.append(key)
  if missing:
    _raise_in_field_order(spec, dict(value), path, list(fields), missing[0])
  if spec.check is not None:
    with field_scope(path):
      spec.check(dict(value))


def _raise_in_field_order(spec: Section, value: dict[str, Any], path: str,
                          order: list[str], missing: str) -> None:
  """Raises "`missing`: is required", unless the section's own check finds
  a problem in a field before it (a PGD entry's `eps` before its `steps`):
  the check runs with the missing fields None, and only its ConfigError on
  an earlier field counts."""
  if spec.check is not None:
    try:
      spec.check({**{k: None for k in order if k not in value}, **value})
    except ConfigError as e:
      first = e.field.split(".")[0].split("[")[0]
      if first in order and order.index(first) < order.index(missing):
        raise ConfigError(join_path(path, e.field), e.reason) from e
    except Exception:  # pylint: disable=broad-except
      pass  # A check that needs every field: the missing one is the error.
  raise ConfigError(join_path(path, missing), "is required")


def validate(spec: Spec, value: Any, path: str = "") -> None:
  """Checks `value` against `spec`; ConfigError names the failing field.

  `value` may hold ConfigDicts. `path` is the dotted path of `value` itself.
  """
  value = plain(value)
  if value is None:
    if spec.nullable or (isinstance(spec, Field) and spec.kind == "any"):
      return
    raise ConfigError(path, "must not be None")
  if isinstance(spec, Field):
    _check_field(spec, value, path)
  elif isinstance(spec, Seq):
    if isinstance(value, Mapping) and isinstance(spec.item, Section):
      raise ConfigError(path, f"must be a tuple/list of dicts (one per "
                        f"entry), got one dict; wrap it: ({value!r},)")
    if not isinstance(value, (list, tuple)):
      raise ConfigError(path, f"must be a list or tuple, {_got(value)}")
    if spec.length is not None and len(value) != spec.length:
      raise ConfigError(path, f"must have {spec.length} items, got "
                        f"{len(value)}")
    if len(value) < spec.min_length:
      raise ConfigError(path, f"must have at least {spec.min_length} items, "
                        f"got {len(value)}")
    for i, item in enumerate(value):
      validate(spec.item, item, f"{path}[{i}]")
  elif isinstance(spec, OneOf):
    for option in spec.options:
      try:
        validate(option, value, path)
        return
      except ConfigError:
        continue
    raise ConfigError(path, f"must be {spec.description}, {_got(value)}")
  elif isinstance(spec, Section):
    _check_section(spec, value, path)
  else:
    raise TypeError(f"not a schema spec: {spec!r}")


@contextlib.contextmanager
def renamed_scope(old: str, new: str) -> Iterator[None]:
  """Reports a component's `old.*` fields as `new.*` (others prefixed).

  `make_attack` names its fields "attack.eps"; inside
  `renamed_scope("attack", "robustness.attacks[1]")` that error becomes
  "robustness.attacks[1].eps". `new=""` strips the prefix ("eps"), for use
  inside an enclosing `field_scope`.
  """
  try:
    yield
  except ConfigError as e:
    field = e.field
    if field == old or field.startswith((old + ".", old + "[")):
      field = new + field[len(old):]
      field = field[1:] if field.startswith(".") else field
    else:
      field = join_path(new, field)
    raise ConfigError(field, e.reason) from e


# ---------------------------------------------------------------------------
# Deriving fields from where components declare them.
# ---------------------------------------------------------------------------

_NONE_TYPE = type(None)


def spec_for(annotation: Any, default: Any = REQUIRED) -> Spec:
  """The spec of a type annotation (a typing object; strings: "any")."""
  origin = typing.get_origin(annotation)
  args = typing.get_args(annotation)
  if origin is Union or origin is types.UnionType:
    rest = [a for a in args if a is not _NONE_TYPE]
    inner = spec_for(rest[0], default) if len(rest) == 1 else Field(
        "any", default)
    return dataclasses.replace(inner, nullable=_NONE_TYPE in args or
                               inner.nullable)
  simple = {bool: "bool", int: "int", float: "float", str: "str"}
  if annotation in simple:
    return Field(simple[annotation], default)
  if origin in (tuple, list, collections.abc.Sequence):
    if origin is tuple and args and args[-1] is not Ellipsis:
      item = spec_for(args[0]) if len(set(args)) == 1 else Field("any")
      return Seq(item, default, length=len(args))
    return Seq(spec_for(args[0]) if args else Field("any"), default)
  if origin in (dict, collections.abc.Mapping,
                collections.abc.MutableMapping) or annotation in (dict,
                                                                  Mapping):
    return Field("mapping", default)
  return Field("any", default)


def _type_hints(obj: Any) -> dict[str, Any]:
  """Resolved annotations of a class or function; unresolvable ones dropped."""
  try:
    return typing.get_type_hints(obj)
  except Exception:  # pylint: disable=broad-except
    pass
  raw = getattr(obj, "__annotations__", {})
  module = sys.modules.get(getattr(obj, "__module__", ""), None)
  namespace = dict(vars(module)) if module else {}
  hints = {}
  for name, ann in raw.items():
    if isinstance(ann, str):
      try:
        ann = eval(ann, namespace)  # pylint: disable=eval-used
      except Exception:  # pylint: disable=broad-except
        continue
    hints[name] = ann
  return hints


def _default_of(f: dataclasses.Field) -> Any:
  if f.default is not dataclasses.MISSING:
    return f.default
  if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
    return f.default_factory()  # type: ignore[misc]
  return REQUIRED


def dataclass_fields(cls: type, exclude: tuple[str, ...] = ()
                     ) -> dict[str, Spec]:
  """Specs of a dataclass's (or Flax module's) init fields.

  Flax's `parent` and `name` are never config fields.
  """
  hints = _type_hints(cls)
  skip = {"parent", "name", *exclude}
  for base in reversed(cls.__mro__):  # Annotations of every base class.
    for name, ann in _type_hints(base).items():
      hints.setdefault(name, ann)
  out: dict[str, Spec] = {}
  for f in dataclasses.fields(cls):
    if not f.init or f.name in skip:
      continue
    out[f.name] = spec_for(hints.get(f.name, Any), _default_of(f))
  return out


def function_fields(fn: Callable[..., Any], exclude: tuple[str, ...] = ()
                    ) -> dict[str, Spec]:
  """Specs of a function's parameters (those without a default: required)."""
  hints = _type_hints(fn)
  out: dict[str, Spec] = {}
  for p in inspect.signature(fn).parameters.values():
    if p.name in exclude or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
      continue
    default = REQUIRED if p.default is p.empty else p.default
    out[p.name] = spec_for(hints.get(p.name, Any), default)
  return out


def default_fields(defaults: Mapping[str, Any],
                   types: Optional[Mapping[str, Spec]] = None
                   ) -> dict[str, Spec]:
  """Specs of a `{field: default}` dict: typed by `types`, else by default.

  A default of None makes the field nullable (untyped unless `types` has it).
  """
  types = types or {}
  out: dict[str, Spec] = {}
  for name, default in defaults.items():
    if name in types:
      out[name] = dataclasses.replace(
          types[name], default=default,
          nullable=types[name].nullable or default is None)
    elif default is None:
      out[name] = Field("any", None, nullable=True)
    elif isinstance(default, Mapping):
      out[name] = Field("mapping", default)
    elif isinstance(default, (list, tuple)):
      out[name] = Seq(Field("any"), default)
    else:
      out[name] = spec_for(type(default), default)
  return out


__all__ = ["Field", "OneOf", "REQUIRED", "Section", "Seq", "Spec",
           "unknown_message",
           "dataclass_fields", "default_fields", "function_fields", "plain",
           "renamed_scope", "spec_for", "validate"]
