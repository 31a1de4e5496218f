"""The schema language of config sections; it imports no component.

Each package declares its own section beside the code it configures (e.g.
`vmoe_ext.train.config.TRAIN`, `vmoe_ext.models.config.MODEL`); the run
assembly (`vmoe_ext.app.schema`) builds the root schema from them and
resolves a config once: `validate(spec, value, path)` checks a value and
raises `ConfigError` naming the full dotted path, `fill_defaults(spec,
value)` sets every absent field to its default.
"""

from __future__ import annotations

from vmoe_ext.config.defaults import fill_defaults
from vmoe_ext.config.schema import (REQUIRED, Field, OneOf, Section, Seq,
                                    Spec, dataclass_fields, default_fields,
                                    function_fields, plain, renamed_scope,
                                    validate)

__all__ = ["Field", "OneOf", "REQUIRED", "Section", "Seq", "Spec",
           "dataclass_fields", "default_fields", "fill_defaults",
           "function_fields", "plain", "renamed_scope", "validate"]
