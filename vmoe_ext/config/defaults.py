"""Filling a config section's absent fields with their schema defaults.

`fill_defaults(spec, value)` turns a config section into the plain dict a
component would see once its defaults are applied, so that two sections that
configure the same thing compare equal whether a field was left out or set to
its default value:

    fill_defaults(Section({"a": Field("int", 1), "b": Field("int", 2)}),
                  {"a": 1}) == {"a": 1, "b": 2}

Only `Section`s are walked (their fields may depend on the value, as the
router section's do on its `name`); `Field`, `Seq` and `OneOf` values are kept
as given (tuples stay tuples). A `REQUIRED` field that is absent stays absent,
an absent section whose default is None stays None, and keys the spec does not
know are kept: filling never validates (`vmoe_ext.config.validate` does).
"""

from __future__ import annotations

import copy
from typing import Any, Mapping

from vmoe_ext.config.schema import REQUIRED, Section, Spec, plain
from vmoe_ext.errors import field_scope, join_path


def fill_defaults(spec: Spec, value: Any, path: str = "") -> Any:
  """`value` as plain data with every absent field of its sections filled.

  Args:
    spec: the schema spec of `value` (e.g. `CONFIG.fields_of({})["model"]`).
    value: the config value (ConfigDicts allowed; not modified).
    path: the dotted path of `value`, for errors.

  Returns:
    Plain dicts/lists/scalars; for a `Section` spec and a dict value, a new
    dict holding the given fields (filled recursively where they are
    sections) and the default of every absent field that has one.

  Raises:
    ConfigError: a section's fields depend on a value that selects nothing
      (e.g. an unknown router `name`); the field is named by its full path.
  """
  value = plain(value)
  if not isinstance(spec, Section) or not isinstance(value, Mapping):
    return value
  with field_scope(path):
    fields = spec.fields_of(value)
  out = dict(value)
  for key, sub in fields.items():
    if key in out:
      out[key] = fill_defaults(sub, out[key], join_path(path, key))
      continue
    default = getattr(sub, "default", None)
    if default is REQUIRED:
      continue
    # A copy: defaults are shared (e.g. the router dict of MOE_DEFAULTS).
    out[key] = fill_defaults(sub, copy.deepcopy(default), join_path(path, key))
  return out


__all__ = ["fill_defaults"]
