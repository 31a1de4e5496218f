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
  with a "did you mean" hint, before anything is parsed; so is a value that
  cannot have the field's type (`train.total_steps=1e3`, `robustness=none`,
  one dict where a list of them belongs), with the spelling that works;
* a known field that the config lacks, or holds as None, is added as a typed
  `ml_collections` placeholder (its type from the schema, else from the value
  as a Python literal), creating the sections on the way, so the flag parser
  sets it like any other field; an untyped field (a router's `layers`, a
  preset name or a list) is retyped to the value's own type;
* a component switched from the command line (`model.moe.router.name=cosine`
  on a config written for `noisy_topk`; a stream's or an attack's `name`:
  sections marked `Section.component`) gets its own defaults: every field of
  the section that the config file set and the command line does not set is
  removed, with one note each (`notes`) where the file's value is not the new
  component's default (`noise_std`: the file's 1.0, cosine's 0.0) or the
  new component has no such field (`importance_loss_weight` for
  expert_choice). Another selector (`data.name`, `optimizer.name`) changed
  from the command line removes only the fields the new selection lacks or
  defaults differently, so that an optimizer's schedule survives a switch
  of optimizer. Alternatives (`model.moe.layers` and `model.moe.every`):
  setting one drops the file's other one (`vmoe_ext.config.switching`).

`take_none_overrides` then applies what the typed flag parser cannot:
`--config.FIELD=None` on a nullable field, and list items
(`robustness.attacks[1].steps=5`, also written `robustness.attacks.1.steps`),
which may name a field the entry lacks. Fields that are not overridden are
left exactly as the config file wrote them. Section fields that depend on a
selector (`model.moe.router` on its `name`) are looked up with the selector's
overridden value, wherever its flag stands.
"""

from __future__ import annotations

import ast
import re
from typing import Any, Optional, Sequence

import ml_collections
from ml_collections import config_dict

from vmoe_ext.config.schema import (Field, Section, Seq, Spec,
                                    plain, unknown_message)
from vmoe_ext.config.switching import drop_alternatives, drop_deselected
from vmoe_ext.errors import (ConfigError, Part, join_path, join_parts,
                             split_path)

PREFIX = "--config."
_TYPES = {"int": int, "float": float, "bool": bool, "str": str}
_BOOLS = {"true": True, "t": True, "1": True, "false": False, "f": False,
          "0": False}  # absl's spellings, any case.


def overrides(argv: Sequence[str]) -> list[tuple[str, Optional[str]]]:
  """`(field, value text)` of each `--config.FIELD[=VALUE]` flag, in order;
  list items spelled `[i]` (`attacks.0.eps` becomes `attacks[0].eps`).

  The value is None for a flag without `=` (a bool set with its bare name).
  """
  out = []
  for arg in argv:
    if arg.startswith(PREFIX):
      field, eq, value = arg[len(PREFIX):].partition("=")
      out.append((join_parts(split_path(field)), value if eq else None))
  return out


def literal(text: Optional[str]) -> Any:
  """The Python literal `text` stands for, else the string itself."""
  if text is None:
    return True
  try:
    return ast.literal_eval(text)
  except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
    return text


def _set(tree: Any, parts: Sequence[Part], value: Any) -> None:
  """Sets `parts` of the plain `tree` (lists for tuples, in place); does
  nothing below a leaf or past a list's end (`field_spec` reports those)."""
  for i, part in enumerate(parts):
    if isinstance(part, str) != isinstance(tree, dict) or (
        isinstance(part, int) and part >= len(tree)):
      return
    if i == len(parts) - 1:
      tree[part] = value
      return
    child = tree.get(part) if isinstance(part, str) else tree[part]
    if isinstance(child, tuple):
      child = list(child)
    elif isinstance(part, str) and not isinstance(child, (dict, list)):
      child = {}
    tree[part] = child
    tree = child


def _preview(config: ml_collections.ConfigDict,
             pairs: list[tuple[str, Optional[str]]]) -> dict:
  """The config as a plain dict with every override applied as a literal."""
  tree = plain(config)
  for field, text in pairs:
    _set(tree, split_path(field), literal(text))
  return tree


def field_spec(field: str, preview: dict, root: Spec) -> Optional[Spec]:
  """The spec of `field` (dotted, list items `[i]`) in the schema `root`;
  None below a free-form value.

  Raises:
    ConfigError naming the first unknown part of `field`, a list item the
    list lacks, or a bad selector value such as an unknown router name.
  """
  spec: Any = root
  value: Any = preview
  walked: list[Part] = []
  for part in split_path(field):
    if isinstance(part, int):
      if not isinstance(spec, Seq):
        return None  # A free-form list: checked later.
      items = value if isinstance(value, (list, tuple)) else ()
      walked.append(part)
      if part >= len(items):
        raise ConfigError(join_parts(walked), (
            f"({PREFIX}{field}) no such item: the config has {len(items)} "
            f"(indices 0..{len(items) - 1})" if items else
            f"({PREFIX}{field}) no such item: the list is empty") +
                          f"; set the whole list with "
                          f"{PREFIX}{join_parts(walked[:-1])}=(...)")
      spec, value = spec.item, items[part]
      continue
    if not isinstance(spec, Section):
      return None  # A dict-valued field: checked later.
    section = value if isinstance(value, dict) else {}
    try:
      fields = spec.fields_of(section)
    except ConfigError as e:
      raise ConfigError(join_path(join_parts(walked), e.field),
                        e.reason) from e
    walked.append(part)
    if part not in fields:
      raise ConfigError(join_parts(walked), f"({PREFIX}{field}) " +
                        unknown_message(part, sorted(fields)))
    spec = fields[part]
    value = section.get(part)
  return spec


def check_text(field: str, text: Optional[str], spec: Optional[Spec]) -> None:
  """Raises ConfigError, with the spelling that works, when the flag value
  `text` cannot have the type `spec` gives `field` (before the flag parser
  would say it in Python)."""
  if text == "None" and getattr(spec, "nullable", False):
    return
  value = literal(text)
  kind = spec.kind if isinstance(spec, Field) else None
  if kind == "int" and not (isinstance(value, int) and not isinstance(
      value, bool) or re.fullmatch(r"\s*[+-]?\d+\s*", text or "")):
    example = (f"{int(value)}" if isinstance(value, float)
               and value.is_integer() else "1000")
    raise ConfigError(field, f"expects an integer (e.g. {example}), got "
                      f"{text!r}")
  if kind == "float":
    try:
      float(text or "")
    except ValueError:
      raise ConfigError(field, f"expects a number (e.g. 0.1 or 1e-3), got "
                        f"{text!r}") from None
  if kind == "bool" and text is not None and text.lower() not in _BOOLS:
    raise ConfigError(field, f"expects True or False, got {text!r}")
  if isinstance(spec, Section) and not isinstance(value, dict):
    off = ("None (capital N) to turn it off, or to " if spec.nullable
           else "")
    raise ConfigError(field, f"is a section: set it to {off}a dict of its "
                      f"fields, e.g. {PREFIX}{field}=\"{{...}}\" (or set one "
                      f"field: {PREFIX}{field}.FIELD=VALUE); got {text!r}")
  if isinstance(spec, Seq) and isinstance(value, dict):
    raise ConfigError(field, f"expects a tuple/list, got one dict; wrap it: "
                      f"{PREFIX}{field}=\"({text},)\"" +
                      (", e.g. ({'name': 'fgsm', 'eps': 0.03},)"
                       if "attacks" in field else ""))


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


def prepare_overrides(config: ml_collections.ConfigDict,
                      argv: Sequence[str], root: Spec,
                      notes: Optional[list[str]] = None,
                      alternatives: Sequence[tuple[str, str]] = ()
                      ) -> ml_collections.ConfigDict:
  """Checks the `--config.FIELD` flags of `argv` and makes each settable.

  Args:
    config: the loaded config file (unlocked); changed in place.
    argv: the command line.
    root: the config's schema.
    notes: gets one line for each field of the config file that a selector
      changed on the command line (or an alternative set there) removed.
    alternatives: pairs of exclusive fields (full paths).

  Returns:
    `config`, with a typed placeholder for each overridden field that it
    lacked or held as None.

  Raises:
    ConfigError naming the first unknown field, or a value that cannot have
    its field's type.
  """
  pairs = overrides(argv)
  if not pairs:
    return config
  preview = _preview(config, pairs)
  for field, text in pairs:  # Unknown fields first, then value types.
    check_text(field, text, field_spec(field, preview, root))
  dropped = drop_alternatives(config, pairs, alternatives)
  dropped += drop_deselected(config, preview, root,
                             {field for field, _ in pairs})
  if notes is not None:
    notes.extend(dropped)
  preview = _preview(config, pairs)
  for field, text in pairs:
    spec = field_spec(field, preview, root)
    parts = split_path(field)
    if any(isinstance(p, int) for p in parts):
      continue  # `take_none_overrides` sets list items.
    untyped = not isinstance(spec, (Field, Seq, Section)) or (
        isinstance(spec, Field) and spec.kind == "any")
    _add_placeholder(config, parts, _placeholder_type(spec, text),
                     retype=untyped and text is not None)
  return config


def _item_value(text: Optional[str], spec: Optional[Spec]) -> Any:
  if isinstance(spec, Field) and spec.kind == "str" and text is not None:
    return text
  if isinstance(spec, Field) and spec.kind == "bool" and text is not None:
    return _BOOLS.get(text.lower(), text)
  if isinstance(spec, Field) and spec.kind == "float":
    try:
      return float(text or "")
    except ValueError:
      return text
  return literal(text)


def _set_item(config: ml_collections.ConfigDict, parts: list[Part],
              value: Any) -> None:
  """Sets a field at or below a list item, rebuilding the tuples above."""
  first = next(i for i, p in enumerate(parts) if isinstance(p, int))
  holder: Any = config
  for part in parts[:first - 1]:
    holder = holder[part]
  tree = {"v": plain(holder[parts[first - 1]])}
  _set(tree, ["v", *parts[first:]], value)

  def tuples(v: Any) -> Any:
    if isinstance(v, list):
      return tuple(tuples(x) for x in v)
    if isinstance(v, dict):
      return {k: tuples(x) for k, x in v.items()}
    return v

  holder[parts[first - 1]] = tuples(tree["v"])


def take_none_overrides(config: ml_collections.ConfigDict,
                        argv: Sequence[str], root: Spec) -> list[str]:
  """Applies the overrides the typed flag parser cannot; returns the other
  args.

  ml_collections parses a flag with the field's type, so "None" cannot set a
  float field (`model.moe.router.clamp`) or becomes the string "None" in an
  untyped one; and it cannot reach a field a list item lacks. This sets, in
  `config` (creating the sections on the way), every field the schema marks
  nullable to None and every field at or below a list item
  (`robustness.attacks[1].steps`, also spelled `attacks.1.steps`) to its
  value, and drops those flags. Call it after `prepare_overrides`, which has
  checked every field exists.
  """
  pairs = overrides(argv)
  preview = _preview(config, pairs)
  rest = []
  for arg in argv:
    if not arg.startswith(PREFIX):
      rest.append(arg)
      continue
    (field, text), = overrides([arg])
    parts = split_path(field)
    spec = field_spec(field, preview, root)
    if any(isinstance(p, int) for p in parts):
      value = (None if text == "None" and getattr(spec, "nullable", False)
               else _item_value(text, spec))
      _set_item(config, parts, value)
    elif text == "None" and getattr(spec, "nullable", False):
      node = config
      for part in parts[:-1]:
        if node.get(part) is None:
          node[part] = ml_collections.ConfigDict()
        node = node[part]
      node[parts[-1]] = None
    else:
      rest.append(PREFIX + field + ("" if text is None else f"={text}"))
  return rest


def flag_error(error: BaseException, argv: Sequence[str]) -> ConfigError:
  """The `ConfigError` for an exception the flag parser raised on a
  `--config.FIELD` flag of `argv`: the field it names, the first line of
  its message."""
  text = str(error)
  match = re.match(r"flag --config\.([^=\s]+)=", text)
  fields = [match.group(1)] if match else [
      f for f, _ in overrides(argv) if f in text or
      f.replace("[", ".").replace("]", "") in text]
  reason = text.split(": ", 1)[-1] if match else (
      f"{type(error).__name__}: {text}")
  reason = reason.strip().splitlines()[0] if reason.strip() else (
      type(error).__name__)
  field = fields[0] if fields else "--config"
  return ConfigError(field, f"cannot set it from the command line: {reason}")


__all__ = ["check_text", "drop_alternatives", "drop_deselected",
           "field_spec", "flag_error", "literal", "overrides",
           "prepare_overrides", "take_none_overrides"]
