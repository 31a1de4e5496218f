"""Configuration errors raised before anything is traced or compiled.

Every `ConfigError` names the offending field by its full dotted path as the
user wrote it (`model.moe.router.num_selected`). Components validate their own
fields with paths relative to themselves (`num_selected`); whoever builds a
component from a config section wraps the build in `field_scope("model.moe.
router")`, which prefixes the path of any `ConfigError` raised inside. Errors
that are not about the config (a wrong label shape handed to a metric) are
plain `ValueError`/`TypeError`s, never `ConfigError`s.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator


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

  Where the field already starts with the last parts of the prefix they are
  merged (`join_path("model.moe", "moe.group_size") == "model.moe.group_size"`),
  so a scope applied twice, or a component that names its own section, does
  not repeat a part.
  """
  if not prefix:
    return field
  if not field:
    return prefix
  if field.startswith("["):
    return prefix + field
  head = prefix.split(".")
  tail = field.split(".")
  for n in range(min(len(head), len(tail)), 0, -1):
    if head[-n:] == [t.split("[")[0] for t in tail[:n - 1]] + [tail[n - 1]]:
      return ".".join(head[:-n] + tail)
  return f"{prefix}.{field}"


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
