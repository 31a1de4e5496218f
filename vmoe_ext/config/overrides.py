"""Command-line overrides `--config.FIELD=VALUE`, checked against the schema.

ml_collections can only override a field that the loaded `ConfigDict` holds
with a non-None value (it takes the field's type from that value). Users
expect to set every documented field: one whose default is None
(`robustness.num_examples`), one the config file leaves out
(`model.moe.router.noise_std` on `configs/tiny.py`), or a field of a section
that is off (`robustness.corruptions.names`). `prepare_overrides` walks the
root schema (given by the caller: the binary's is
`vmoe_ext.app.schema.CONFIG`) for each overridden field:

* a field the schema does not know is a `ConfigError` naming the full path,
  with a "did you mean" hint, before anything is parsed;
* a known field that the config lacks, or holds as None, is added as a typed
  `ml_collections` placeholder (its type from the schema, else from the value
  as a Python literal), creating the sections on the way, so the flag parser
  sets it like any other field; an untyped field (a router's `layers`, a
  preset name or a list) is retyped to the value's own type;
* `--config.FIELD=None` on a nullable field sets it to None
  (`take_none_overrides`), which the typed flag parser cannot do;
* a selector changed from the command line (`model.moe.router.name=greedy`
  on a config written for `noisy_topk`) drops the fields the config file set
  that only the previous selection knows (`importance_loss_weight`), and
  says which (`notes`); fields the new selection shares keep their values.

Fields that are not overridden are left exactly as the config file wrote them.
Section fields that depend on a selector (`model.moe.router` on its `name`)
are looked up with the selector's overridden value, wherever its flag stands.
"""

from __future__ import annotations

import ast
from typing import Any, Optional, Sequence

import ml_collections
from ml_collections import config_dict

from vmoe_ext.config.schema import (Field, Section, Seq, Spec, plain,
                                    unknown_message)
from vmoe_ext.errors import ConfigError

PREFIX = "--config."
_TYPES = {"int": int, "float": float, "bool": bool, "str": str}


def overrides(argv: Sequence[str]) -> list[tuple[str, Optional[str]]]:
  """`(field, value text)` of each `--config.FIELD[=VALUE]` flag, in order.

  The value is None for a flag without `=` (a bool set with its bare name).
  """
  out = []
  for arg in argv:
    if arg.startswith(PREFIX):
      field, eq, value = arg[len(PREFIX):].partition("=")
      out.append((field, value if eq else None))
  return out


def literal(text: Optional[str]) -> Any:
  """The Python literal `text` stands for, else the string itself."""
  if text is None:
    return True
  try:
    return ast.literal_eval(text)
  except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
    return text


def _set(tree: dict, parts: list[str], value: Any) -> None:
  for part in parts[:-1]:
    if not isinstance(tree.get(part), dict):
      tree[part] = {}
    tree = tree[part]
  tree[parts[-1]] = value


def _preview(config: ml_collections.ConfigDict,
             pairs: list[tuple[str, Optional[str]]]) -> dict:
  """The config as a plain dict with every override applied as a literal."""
  tree = plain(config)
  for field, text in pairs:
    if "[" not in field:
      _set(tree, field.split("."), literal(text))
  return tree


def field_spec(field: str, preview: dict, root: Spec) -> Optional[Spec]:
  """The spec of dotted `field` in the schema `root`; None below a
  free-form value.

  Raises:
    ConfigError naming the first unknown part of `field` (or a bad selector
    value such as an unknown router name).
  """
  spec: Spec = root
  value: Any = preview
  walked: list[str] = []
  for part in field.split("."):
    if not isinstance(spec, Section) or "[" in part:
      return None  # A dict-valued field, or a list item: checked later.
    section = value if isinstance(value, dict) else {}
    try:
      fields = spec.fields_of(section)
    except ConfigError as e:
      raise ConfigError(".".join(walked + [e.field]), e.reason) from e
    walked.append(part)
    if part not in fields:
      raise ConfigError(".".join(walked), f"({PREFIX}{field}) " +
                        unknown_message(part, sorted(fields)))
    spec = fields[part]
    value = section.get(part)
  return spec


def _placeholder_type(spec: Optional[Spec], text: Optional[str]) -> type:
  if isinstance(spec, Field) and spec.kind in _TYPES:
    return _TYPES[spec.kind]
  if isinstance(spec, Seq):
    return tuple
  if isinstance(spec, Section) or (isinstance(spec, Field)
                                   and spec.kind == "mapping"):
    return dict
  value = literal(text)  # "any" and OneOf fields: the value's own type.
  if isinstance(value, (list, tuple)):
    return tuple
  return type(value) if isinstance(value, (bool, int, float, dict)) else str


def _add_placeholder(config: ml_collections.ConfigDict, parts: list[str],
                     kind: type, retype: bool = False) -> None:
  node = config
  for part in parts[:-1]:
    child = node.get(part) if part in node else None
    if child is None:
      node[part] = ml_collections.ConfigDict()
      child = node[part]
    if not isinstance(child, ml_collections.ConfigDict):
      return  # Below a leaf: the flag parser reports it.
    node = child
  last = parts[-1]
  if last in node and node[last] is not None and retype and not isinstance(
      node[last], kind):
    del node[last]  # An untyped field given a value of another type.
  if last not in node or node[last] is None:
    node[last] = config_dict.placeholder(kind)


def _fields_or_none(spec: Section, value: Any) -> Optional[set[str]]:
  try:
    return set(spec.fields_of(value if isinstance(value, dict) else {}))
  except ConfigError:
    return None


def drop_deselected(config: ml_collections.ConfigDict, preview: dict,
                    root: Spec, overridden: set[str], path: str = ""
                    ) -> list[str]:
  """Removes from `config` the fields of a section whose selector the
  overrides changed that the new selection does not know (unless they were
  overridden themselves); returns one note per section changed."""
  if not isinstance(root, Section) or not isinstance(config,
                                                     ml_collections.ConfigDict):
    return []
  notes = []
  preview = preview if isinstance(preview, dict) else {}
  new = _fields_or_none(root, preview)
  if callable(root.fields):
    old = _fields_or_none(root, plain(config))
    if old is not None and new is not None and old != new:
      gone = [k for k in config if k in old and k not in new
              and f"{path}{k}" not in overridden]
      for k in gone:
        del config[k]
      if gone:
        changed = sorted(f for f in overridden if f.startswith(path)
                         and "." not in f[len(path):])
        notes.append(
            f"{path.rstrip('.')}: overriding {', '.join(changed) or 'it'} "
            f"leaves out {', '.join(gone)} (set by the config file for the "
            "previous choice): dropped")
  if new is None:
    return notes
  specs = root.fields_of(preview)
  for k in new & set(config.keys()):
    notes += drop_deselected(config[k], preview.get(k), specs[k], overridden,
                             f"{path}{k}.")
  return notes


def prepare_overrides(config: ml_collections.ConfigDict,
                      argv: Sequence[str], root: Spec,
                      notes: Optional[list[str]] = None
                      ) -> ml_collections.ConfigDict:
  """Checks the `--config.FIELD` flags of `argv` and makes each settable.

  Args:
    config: the loaded config file (unlocked); changed in place.
    argv: the command line.
    root: the config's schema.
    notes: gets one line for each section whose selector an override
      changed, naming the previous selection's fields it dropped.

  Returns:
    `config`, with a typed placeholder for each overridden field that it
    lacked or held as None.

  Raises:
    ConfigError naming the first unknown field.
  """
  pairs = overrides(argv)
  if not pairs:
    return config
  preview = _preview(config, pairs)
  for field, _ in pairs:
    field_spec(field, preview, root)  # Unknown fields first.
  dropped = drop_deselected(config, preview, root,
                            {field for field, _ in pairs})
  if notes is not None:
    notes.extend(dropped)
  preview = _preview(config, pairs)
  for field, text in pairs:
    spec = field_spec(field, preview, root)
    if "[" in field:
      continue
    untyped = not isinstance(spec, (Field, Seq, Section)) or (
        isinstance(spec, Field) and spec.kind == "any")
    _add_placeholder(config, field.split("."), _placeholder_type(spec, text),
                     retype=untyped and text is not None)
  return config


def take_none_overrides(config: ml_collections.ConfigDict,
                        argv: Sequence[str], root: Spec) -> list[str]:
  """Applies `--config.FIELD=None` for nullable fields; returns the other args.

  ml_collections parses a flag with the field's type, so "None" cannot set a
  float field (`model.moe.router.clamp`) or becomes the string "None" in an
  untyped one. For every field the schema marks nullable, this sets it to
  None in `config` (creating the sections on the way) and drops the flag.
  Call it after `prepare_overrides`, which has checked every field exists.
  """
  pairs = overrides(argv)
  preview = _preview(config, pairs)
  rest = []
  for arg in argv:
    field, eq, text = arg[len(PREFIX):].partition("=")
    if (arg.startswith(PREFIX) and eq and text == "None" and "[" not in field
        and getattr(field_spec(field, preview, root), "nullable", False)):
      *parents, last = field.split(".")
      node = config
      for part in parents:
        if node.get(part) is None:
          node[part] = ml_collections.ConfigDict()
        node = node[part]
      node[last] = None
      continue
    rest.append(arg)
  return rest


__all__ = ["drop_deselected", "field_spec", "literal", "overrides",
           "prepare_overrides",
           "take_none_overrides"]
