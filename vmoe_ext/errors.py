"""Configuration errors raised before anything is traced or compiled.

Every `ConfigError` names the offending field by its full dotted path as the
user wrote it (`model.moe.router.num_selected`). A component names its own
fields with its kind first (`router.num_selected`, `stream.kappa`); whoever
builds it from a config section wraps the build in `field_scope` of the
section's parent (`field_scope("model.moe")` for the router), which prefixes
the path of any `ConfigError` raised inside. A config section's own check
names fields relative to the section; the schema scopes it with the
section's path. Errors that are not about the config (a wrong label shape
handed to a metric) are plain `ValueError`/`TypeError`s, never
`ConfigError`s.
"""

from __future__ import annotations

import contextlib
import re
from typing import Any, Iterator, Sequence, Union

Part = Union[str, int]  # A field name, or a list index.
_PART = re.compile(r"([^\[\]]*)((?:\[\d+\])*)")


class ConfigError(ValueError):
  """An invalid configuration value; the message names the offending field.

  Attributes:
    field: the full dotted path of the field (`model.moe.num_experts`).
    reason: the message without the field.
  """

  def __init__(self, field: str, message: str):
    self.field = field
    self.reason = message
    super().__init__(f"{field}: {message}")


def join_path(prefix: str, field: str) -> str:
  """`join_path("model.moe", "router.name") == "model.moe.router.name"`.

  One rule, no guessing: the prefix, a dot, the field (no dot before a list
  index: `join_path("robustness.attacks", "[1].eps")`). Who names a field
  names it relative to what the caller scopes (docs/architecture.md,
  "Config errors"): a section's check names its own fields (`"workdir"`),
  a component names its fields with its kind (`"router.num_selected"`,
  `"stream.kappa"`, `"moe.capacity_factor"`), scoped by its parent section.
  """
  if not prefix:
    return field
  if not field:
    return prefix
  if field.startswith("["):
    return prefix + field
  return f"{prefix}.{field}"


def split_path(path: str) -> list[Part]:
  """`"robustness.attacks[1].eps"` (or `"robustness.attacks.1.eps"`, as a
  command line may spell it) -> `["robustness", "attacks", 1, "eps"]`.

  Raises:
    ConfigError on `path` when it is not a dotted path.
  """
  parts: list[Part] = []
  for i, piece in enumerate(path.split(".")):
    match = _PART.fullmatch(piece)
    name, indices = match.groups() if match else ("", "")
    if not match or not (name or (indices and i)):
      raise ConfigError(path, "is not a field path: fields are joined by "
                        "dots and list items indexed, e.g. "
                        "robustness.attacks[0].eps")
    if name.isdigit() and i:
      parts.append(int(name))  # `attacks.0.eps`: item 0.
    elif name:
      parts.append(name)
    parts += [int(k) for k in re.findall(r"\d+", indices)]
  return parts


def join_parts(parts: Sequence[Part]) -> str:
  """The path of `split_path`'s parts, list items as `[i]`."""
  out = ""
  for part in parts:
    out = join_path(out, f"[{part}]" if isinstance(part, int) else part)
  return out


@contextlib.contextmanager
def field_scope(prefix: str) -> Iterator[None]:
  """Prefixes the field of every `ConfigError` raised inside with `prefix`."""
  try:
    yield
  except ConfigError as e:
    raise ConfigError(join_path(prefix, e.field), e.reason) from e


def require(condition: Any, field: str, message: str) -> None:
  """Raises `ConfigError(field, message)` unless `condition` holds."""
  if not condition:
    raise ConfigError(field, message)


class InputError(ValueError):
  """Data of the wrong shape, dtype or values handed to a function.

  Not a `ConfigError`: the config is fine, the data or the caller is not
  (labels of the wrong shape given to a metric or an attack, an accuracy
  outside [0, 1] in a corruption table). The binary prints it as `error: ...`.

  Attributes:
    field: the offending argument ("labels").
    reason: the message without the field.
  """

  def __init__(self, field: str, message: str):
    self.field = field
    self.reason = message
    super().__init__(f"{field}: {message}")


def check(condition: Any, field: str, message: str) -> None:
  """Raises `InputError(field, message)` unless `condition` holds."""
  if not condition:
    raise InputError(field, message)
