"""Config fingerprints: what a checkpoint must match to be resumed or evaluated.

A checkpoint stores the `config_fingerprint` of the config that trained it:
the model section with every absent field filled with its schema default
(`vmoe_ext.config.defaults.fill_defaults`, so leaving a field out and setting
it to its default are the same config), the data name, the parameter shapes
and the optimizer name. `check_fingerprint` compares a stored fingerprint
(filled again, so checkpoints saved before filling existed still match) with
the current one and raises a `ConfigError` worded for resuming ("workdir":
the differing keys) or for evaluating (the first differing field by its full
path, with the flag that would fix it; `model.dtype`, `model.param_dtype`,
`model.remat` and `model.attention` may differ there).
"""

from __future__ import annotations

import json
from typing import Any, Mapping

import flax.traverse_util
import jax
import ml_collections
import numpy as np

from vmoe_ext.config.defaults import fill_defaults
from vmoe_ext.errors import ConfigError
from vmoe_ext.models.config import MODEL
from vmoe_ext.models.precision import PRECISION_FIELDS


def normalise_json(value: Any, name: str) -> Any:
  """`value` as JSON would give it back (tuples as lists, sorted keys)."""
  try:
    return json.loads(json.dumps(value, sort_keys=True))
  except (TypeError, ValueError) as e:
    raise TypeError(f"{name} must be JSON-serialisable: {e}") from e


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
  if isinstance(tree, Mapping) and tree:
    out = {}
    for k, v in tree.items():
      out.update(_flatten(v, f"{prefix}{k}/"))
    return out
  return {prefix.rstrip("/") or "<root>": tree}


def fingerprint_diff(stored: Any, current: Any) -> list[str]:
  """Keys (nested dicts flattened with "/") whose values differ, sorted."""
  a, b = _flatten(stored), _flatten(current)
  missing = object()
  return sorted(k for k in set(a) | set(b)
                if a.get(k, missing) != b.get(k, missing))


def _json_safe(value: Any) -> Any:
  """Schema defaults that JSON cannot hold (dtype classes) as their names."""
  if isinstance(value, Mapping):
    return {k: _json_safe(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [_json_safe(v) for v in value]
  if isinstance(value, (type, np.dtype)):
    try:
      return np.dtype(value).name
    except TypeError:
      return getattr(value, "__name__", repr(value))
  return value


def with_filled_model(fingerprint: Mapping[str, Any]) -> dict[str, Any]:
  """`fingerprint` with its "model" entry's absent fields set to their schema
  defaults (`fill_defaults`), so that leaving a field out and setting it to
  its default match. A model the schema cannot walk is kept as it is."""
  out = dict(fingerprint)
  if isinstance(out.get("model"), Mapping):
    try:
      out["model"] = _json_safe(fill_defaults(MODEL,
                                              out["model"], "model"))
    except Exception:  # pylint: disable=broad-except
      pass  # E.g. a router name no longer registered: compared as stored.
  return out


def config_fingerprint(config: ml_collections.ConfigDict,
                       params: Any) -> dict:
  """What a workdir's checkpoint must match to be resumed or evaluated with
  `config`: model config (absent fields filled with their defaults), data
  name, parameter shapes, optimizer name.

  `params` may hold arrays or `jax.ShapeDtypeStruct`s (only shapes are used).
  """
  shapes = jax.tree.map(lambda x: list(np.shape(x)), params)
  flat = flax.traverse_util.flatten_dict(shapes, sep="/")
  return with_filled_model({
      "model": config.model.to_dict(), "data": config.data.name,
      "param_shapes": {k: flat[k] for k in sorted(flat)},
      "optimizer": config.optimizer.name})


_MISSING = object()
# Not compared when evaluating: the precision fields (parameters are cast on
# restore) and the fields that change how the same parameters are computed,
# not what they are (`model.remat`, `model.attention`).
_EVALUATION_FREE = tuple(("model", k) for k in (*PRECISION_FIELDS, "remat",
                                                  "attention"))


def _differences(stored: Any, current: Any, key: tuple = ()
                 ) -> list[tuple[tuple, Any, Any]]:
  """`(key path, stored value, current value)` where the two differ, sorted;
  nested dicts are compared entry by entry, `_MISSING` marks an absent key."""
  if isinstance(stored, Mapping) and isinstance(current, Mapping):
    out = []
    for k in sorted(set(stored) | set(current), key=str):
      out += _differences(stored.get(k, _MISSING), current.get(k, _MISSING),
                          key + (k,))
    return out
  return [] if stored == current else [(key or ("<root>",), stored, current)]


def _short(value: Any, limit: int = 80) -> str:
  text = "<absent>" if value is _MISSING else json.dumps(value)
  return text if len(text) <= limit else text[:limit - 3] + "..."


def _flag_value(value: Any) -> str:
  """`value` as written after `--config.FIELD=` (tuples for lists)."""
  if isinstance(value, str):
    return value
  if isinstance(value, list):
    items = [_flag_value(v) for v in value]
    return "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"
  if value is None or isinstance(value, bool):
    return str(value)
  return _short(value)


def _config_path(key: tuple) -> str:
  """The config field a fingerprint key stands for (`model.hidden_size`)."""
  if key == ("data",):
    return "data.name"
  if key == ("optimizer",):
    return "optimizer.name"
  return ".".join(str(k) for k in key)


def check_fingerprint(stored: Any, current: Mapping[str, Any], *, step: int,
                      directory: str, purpose: str = "resume") -> None:
  """Raises ConfigError unless the `stored` fingerprint of the checkpoint of
  `step` in `directory` matches `current` (both with filled model defaults).

  For `purpose="resume"` the error names "workdir" and lists the differing
  keys; for "evaluate" it names the first differing config field by its full
  path (the optimizer is not compared).
  """
  stored = normalise_json(with_filled_model(stored), "stored fingerprint")
  if stored == current:
    return
  diffs = _differences(stored, current)
  if purpose == "evaluate":
    _evaluation_mismatch(step, directory, diffs)
    return
  describe = lambda k, a, b: (f"{'/'.join(map(str, k))}: checkpoint "
                              f"{_short(a)} vs config {_short(b)}")
  fields = [d for d in diffs if d[0][0] != "param_shapes"]
  shapes = [d for d in diffs if d[0][0] == "param_shapes"]
  details = [describe(*d) for d in fields[:10]]
  if len(fields) > 10:
    details.append(f"{len(fields) - 10} more")
  if shapes:  # They follow from the model fields: one example is enough.
    details.append(f"the shapes of {len(shapes)} parameters (e.g. "
                   f"{describe(*shapes[0])})")
  raise ConfigError(
      "workdir",
      f"{directory} holds a checkpoint (step {step}) of an "
      f"incompatible config; differing keys: {'; '.join(details)}. Give "
      "this config a new --workdir, or resume with the config that trained "
      "it.")

def _evaluation_mismatch(step: int, directory: str,
                       diffs: list[tuple[tuple, Any, Any]]) -> None:
  """Raises ConfigError naming the first differing config field (the
  optimizer is not needed for evaluation and not compared, nor are the
  model's precision fields: a checkpoint trained in one precision evaluates
  in the other, its parameters cast on restore; nor `model.remat` and
  `model.attention`, which compute the same parameters otherwise)."""
  diffs = [d for d in diffs if d[0][0] != "optimizer"
           and d[0] not in _EVALUATION_FREE]
  if not diffs:
    return
  where = f"the checkpoint in {directory} (step {step})"
  fields = [d for d in diffs if d[0][0] != "param_shapes"]
  if not fields:  # Same config fields, other parameter shapes.
    key, a, b = diffs[0]
    raise ConfigError(
        "model", f"{where} has parameter {'/'.join(key[1:])} of shape "
        f"{_short(a)}, the config's model gives {_short(b)}; give the "
        "evaluation config the training run's model and data fields.")
  key, a, b = fields[0]
  path = _config_path(key)
  trained = (f"without {path}" if a is _MISSING
             else f"with {path}={_flag_value(a)}")
  has = "does not set it" if b is _MISSING else f"has {_flag_value(b)}"
  example = ("" if a is _MISSING or isinstance(a, Mapping)
             else f" (e.g. --config.{path}={_flag_value(a)})")
  others = [_config_path(k) for k, _, _ in fields[1:]]
  more = (f" Other differing fields: {', '.join(others[:10])}"
          f"{' and more' if len(others) > 10 else ''}." if others else "")
  raise ConfigError(
      path, f"{where} was trained {trained}, the config {has}; give the "
      "evaluation config the training run's model and data fields"
      f"{example}.{more}")


__all__ = ["check_fingerprint", "config_fingerprint", "fingerprint_diff",
           "normalise_json", "with_filled_model"]
