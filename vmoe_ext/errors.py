"""Configuration errors raised before anything is traced or compiled."""

from __future__ import annotations

from typing import Any


class ConfigError(ValueError):
  """An invalid configuration value; the message names the offending field."""

  def __init__(self, field: str, message: str):
    self.field = field
    super().__init__(f"{field}: {message}")


def require(condition: Any, field: str, message: str) -> None:
  """Raises `ConfigError(field, message)` unless `condition` holds."""
  if not condition:
    raise ConfigError(field, message)
