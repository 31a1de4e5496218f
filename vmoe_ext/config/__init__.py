"""Config schema: one `Section` per config section, checked before compiling.

`validate(CONFIG, config)` checks a whole training config (unknown fields,
types, NaN/inf, ranges, the components' own checks) and raises `ConfigError`
naming the full dotted path; `validate_section("optimizer", cfg)` checks one
section. `vmoe_ext.train.validate.validate_config` is the entry point the
training code calls.
"""

from __future__ import annotations

from typing import Any

from vmoe_ext.config.schema import (REQUIRED, Field, OneOf, Section, Seq,
                                    Spec, dataclass_fields, default_fields,
                                    function_fields, plain, renamed_scope,
                                    validate)
from vmoe_ext.config.sections import CONFIG, SECTIONS


def validate_section(name: str, value: Any) -> None:
  """Checks the config section `name` ("optimizer", "robustness", ...)."""
  validate(CONFIG.fields_of({})[name], value, name)


__all__ = ["CONFIG", "Field", "OneOf", "REQUIRED", "SECTIONS", "Section",
           "Seq", "Spec", "dataclass_fields", "default_fields",
           "function_fields", "plain", "renamed_scope", "validate",
           "validate_section"]
