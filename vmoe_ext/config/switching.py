"""What switching a selector on the command line removes from a config file.

A config file is written for the components it names: `configs/default.py`
sets `noise_std=1.0` for its `noisy_topk` router. A flag that switches the
component (`--config.model.moe.router.name=cosine`) must not run the new one
with the old one's values, so `prepare_overrides`
(`vmoe_ext.config.overrides`) calls, before the flags are parsed:

* `drop_deselected`: in a section marked `Section.component` (a router, a
  stream, an attack) whose `name` the command line changed, every field the
  config file set and the command line does not set is removed (the new
  component's default applies); in another section whose fields depend on a
  selector (`optimizer.name`), only the fields the new selection lacks or
  defaults differently. One note per removed field whose value is not the new
  default.
* `drop_alternatives`: of two exclusive fields (`model.moe.layers`,
  `model.moe.every`), one set on the command line drops the file's other.
"""

from __future__ import annotations

from typing import Any, Mapping, MutableMapping, Optional, Sequence

import ml_collections

from vmoe_ext.config.schema import REQUIRED, Section, Seq, Spec, plain
from vmoe_ext.errors import ConfigError

PREFIX = "--config."


def _specs_or_none(spec: Section, value: Any) -> Optional[Mapping[str, Spec]]:
  try:
    return spec.fields_of(value if isinstance(value, dict) else {})
  except ConfigError:
    return None


def _default(spec: Spec) -> Any:
  return getattr(spec, "default", None)


def _differs(old: Spec, new: Spec) -> bool:
  """Whether a field means something else to the new selection: another
  default (sub-sections are compared field by field, below)."""
  if isinstance(new, Section) and isinstance(old, Section):
    return False
  try:
    return bool(type(old) is not type(new) or _default(old) != _default(new))
  except Exception:  # pylint: disable=broad-except
    return True  # Defaults that do not compare (arrays).


def _selection(config: Mapping[str, Any], preview: Mapping[str, Any],
               path: str, overridden: set[str]) -> tuple[str, str]:
  """The old and new value of the section's overridden selector, as text."""
  changed = [k for k in preview if f"{path}{k}" in overridden
             and config.get(k) != preview.get(k)]
  if len(changed) == 1 and isinstance(preview[changed[0]], str):
    return str(config.get(changed[0])), str(preview[changed[0]])
  return (", ".join(f"{k}={config.get(k)!r}" for k in changed) or "before",
          ", ".join(f"{k}={preview[k]!r}" for k in changed) or "now")


def drop_deselected(config: Any, preview: Any,
                    root: Spec, overridden: set[str], path: str = ""
                    ) -> list[str]:
  """Gives a section whose selector the overrides changed the new
  selection's defaults: removes from `config` each field the new selection
  lacks or defaults differently, unless the command line sets it (or
  something below it); returns one note per removed field whose value is
  not the new default. Walks sub-sections and list items."""
  if path and path[:-1] in overridden:
    return []  # The command line gives the whole value.
  if isinstance(root, Seq) and isinstance(config, (list, tuple)):
    items = preview if isinstance(preview, (list, tuple)) else ()
    notes = []
    for i, item in enumerate(config):
      if i < len(items):
        notes += drop_deselected(item, items[i], root.item, overridden,
                                 f"{path[:-1]}[{i}].")
    return notes
  if not isinstance(root, Section) or not isinstance(
      config, (ml_collections.ConfigDict, MutableMapping)):
    return []
  notes = []
  preview = preview if isinstance(preview, dict) else {}
  new = _specs_or_none(root, preview)
  if callable(root.fields) and new is not None:
    file = plain(config)
    old = _specs_or_none(root, file)
    switched = (_selector_changed(file, preview, path, overridden)
                if root.component else old is not None
                and _fields_differ(old, new))
    if old is not None and switched:
      was, now = ((str(file.get("name")), str(preview.get("name")))
                  if root.component else
                  _selection(file, preview, path, overridden))
      for k in list(config.keys()):
        set_here = any(f == f"{path}{k}" or f.startswith((f"{path}{k}.",
                                                          f"{path}{k}["))
                       for f in overridden)
        if set_here or k not in old or (
            k in new and not root.component and not _differs(old[k], new[k])):
          continue
        if k in new and _default(new[k]) is REQUIRED:
          continue  # No default to take: the file's value stays.
        del config[k]
        if k not in new:
          notes.append(f"{path}{k}: the config file's {file[k]!r} (for {was})"
                       f" is dropped: {now} has no such field")
        elif file[k] != _default(new[k]):
          notes.append(f"{path}{k}: the config file's {file[k]!r} (for {was})"
                       f" is not carried over to {now}; it takes {now}'s "
                       f"default {_default(new[k])!r}")
  if new is None:
    return notes
  for k in [k for k in new if k in config]:
    notes += drop_deselected(config[k], preview.get(k), new[k], overridden,
                             f"{path}{k}.")
  return notes


def _selector_changed(file: Mapping[str, Any], preview: Mapping[str, Any],
                      path: str, overridden: set[str]) -> bool:
  """Whether the command line set a component section's `name` to another
  value than the config file's."""
  return (f"{path}name" in overridden
          and file.get("name") != preview.get("name"))


def _fields_differ(old: Mapping[str, Spec], new: Mapping[str, Spec]) -> bool:
  return set(old) != set(new) or any(_differs(old[k], new[k]) for k in old)


def drop_alternatives(config: ml_collections.ConfigDict,
                      pairs: list[tuple[str, Optional[str]]],
                      alternatives: Sequence[tuple[str, str]]) -> list[str]:
  """For each pair of exclusive fields (`model.moe.layers`,
  `model.moe.every`): one set (not to None) on the command line drops the
  other one the config file set, unless the command line sets it too;
  returns one note per dropped field."""
  given = {field: text for field, text in pairs}
  notes = []
  for a, b in alternatives:
    for field, other in ((a, b), (b, a)):
      if given.get(field, "None") == "None" or other in given:
        continue
      *parents, last = other.split(".")
      node: Any = config
      for part in parents:
        node = node.get(part) if isinstance(
            node, ml_collections.ConfigDict) else None
      if isinstance(node, ml_collections.ConfigDict) and node.get(
          last) is not None:
        notes.append(f"{other}: the config file's {node[last]!r} is dropped: "
                     f"{PREFIX}{field} replaces it (give one of {field} and "
                     f"{other})")
        node[last] = None
  return notes


__all__ = ["drop_alternatives", "drop_deselected"]
