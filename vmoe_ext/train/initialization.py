r"""Initialising a new model's params from another run's checkpoint by rules.

Config section (`init`), used by the training setup:

    init = dict(
        workdir="/path/to/other/run",  # holds checkpoints/<step>/
        step=None,                     # None: the newest checkpoint
        rules=[                        # (target_regex, source_replacement)
            (r"(encoderblock_\d+)/Moe/Mlp/(.+)", r"\1/Mlp/\2"),
            (r"encoderblock_\d+/Moe/.+", None),
            (r"(.+)", r"\1"),
        ])

Semantics:
  * Paths are the params' nested dict keys joined with "/", relative to
    `params` (`encoderblock_1/Moe/Mlp/Dense_0/kernel`).
  * For every parameter of the NEW model, the first rule whose target regex
    matches the whole path (`re.fullmatch`) decides. Its source replacement
    is expanded like `re.sub`'s (`\1`, `\g<name>`) into the path of the
    source parameter in the checkpoint; a replacement of None keeps the fresh
    initialisation. Parameters that no rule matches keep their fresh
    initialisation as well and are listed in the report (`unmatched`).
  * Shapes: the source shape must equal the target shape, except that a
    target with one extra leading axis (`[E, ...]` from `[...]`, the expert
    axis) gets the source tiled E times, so a dense MLP initialises every
    expert. Values are cast to the fresh parameter's dtype and placed with
    its sharding.
  * Errors (`ConfigError`, all raised before any array data is read and
    before anything is compiled): `init.rules` not a non-empty sequence of
    pairs, or `init.rules[i]` with a bad regex or replacement template, a
    target regex that fully matches no parameter, a source path missing from
    the checkpoint (with close matches) or a shape mismatch (both shapes);
    `init.workdir` missing or without any checkpoint; `init.step` not found
    (the available steps are listed) or unreadable.
  * Rules that match only parameters already claimed by earlier rules, and
    checkpoint parameters that nothing loads, are allowed and reported.

Foreign checkpoints (`vmoe_ext.interop`): `init.checkpoint` (a vmoe
partitioned prefix, a vit_jax `.npz` or a flax msgpack file; `init.format`,
default "auto") replaces `init.workdir`, and `init.layout` ("vmoe" |
"vit_jax") supplies the rules when `init.rules` is empty and first compares
the two trees structurally, so a mismatch names the model field to change
(`model.moe.num_experts`, `model.moe.layers`, ...). `init.strict` (the
import configs set it) makes every model parameter that no rule matches, and
every checkpoint leaf that nothing loads, an `init.rules` error naming the
leaf.

Only the `params` of the checkpoint's saved train state are read (as numpy
arrays, see `vmoe_ext.train.checkpoint_params`): neither the source run's
config nor its optimizer is needed. This is independent of resuming: a run
whose own workdir has a checkpoint resumes from it (with the fingerprint
check) and the `init` section does not apply then.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import re
from typing import Any, Mapping, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from vmoe_ext.errors import ConfigError, require
from vmoe_ext.interop.layouts import check_layout, layout_rules
from vmoe_ext.naming import PARAM_PATTERN
from vmoe_ext.train import checkpoint_params as ckpt_params
from vmoe_ext.train.init_source import (InitSource, config_value as _get,
                                        find_checkpoint, open_source)

Rule = tuple[str, Optional[str]]
Shape = tuple[int, ...]


def identity_rules(fresh: Sequence[str] = ()) -> list[Rule]:
  """Every parameter from the same path (fine-tuning / continuing).

  Args:
    fresh: target regexes kept freshly initialised (e.g. `"head/.+"` for a
      new classifier), checked before the identity rule.
  """
  return [(pattern, None) for pattern in fresh] + [(r"(.+)", r"\1")]


def dense_to_moe_rules(fresh: Sequence[str] = ()) -> list[Rule]:
  r"""Upcycling: a V-MoE from a dense ViT with the same backbone.

  Every expert of `encoderblock_i/Moe/Mlp/...` (`[E, ...]`) is a copy of the
  dense `encoderblock_i/Mlp/...`; every other parameter of an MoE layer
  (router weights) keeps its fresh initialisation; all the rest (dense
  blocks, attention, norms, embeddings, head) comes from the same path.

  Args:
    fresh: extra target regexes kept freshly initialised, checked first.
  """
  return [(pattern, None) for pattern in fresh] + [
      (rf"({PARAM_PATTERN})/Moe/Mlp/(.+)", r"\1/Mlp/\2"),
      (rf"{PARAM_PATTERN}/Moe/.+", None),
      (r"(.+)", r"\1"),
  ]


@dataclasses.dataclass(frozen=True)
class InitReport:
  """What `load_init_params` did.

  Attributes:
    workdir: the source workdir, or the foreign checkpoint's path.
    step: the checkpoint step read (None for a foreign checkpoint).
    loaded: `{target path: source path}` of every loaded parameter.
    tiled: `{target path: E}` for the loaded parameters tiled to E experts.
    fresh: targets kept fresh by a rule whose replacement is None.
    unmatched: targets matched by no rule (kept fresh as well).
    shadowed_rules: indices of rules that matched only parameters claimed
      by earlier rules.
    unused_source: checkpoint parameters that nothing loaded.
  """
  workdir: str
  step: Optional[int]
  loaded: Mapping[str, str]
  tiled: Mapping[str, int]
  fresh: tuple[str, ...]
  unmatched: tuple[str, ...]
  shadowed_rules: tuple[int, ...]
  unused_source: tuple[str, ...]

  def summary(self, max_names: int = 10) -> str:
    """A few lines for the log."""

    def names(paths: Sequence[str]) -> str:
      more = len(paths) - max_names
      return ", ".join(paths[:max_names]) + (f", ... ({more} more)"
                                             if more > 0 else "")

    where = (self.workdir if self.step is None
             else f"{self.workdir} (step {self.step})")
    lines = [f"initialised from {where}: "
             f"{len(self.loaded)} params loaded, {len(self.tiled)} of them "
             f"tiled to experts; {len(self.fresh)} kept fresh by rule; "
             f"{len(self.unmatched)} matched by no rule (fresh)"]
    if self.unmatched:
      lines.append(f"  matched by no rule: {names(self.unmatched)}")
    if self.fresh:
      lines.append(f"  fresh by rule: {names(self.fresh)}")
    if self.shadowed_rules:
      lines.append("  rules matching only params claimed earlier: "
                   f"{list(self.shadowed_rules)}")
    if self.unused_source:
      lines.append(f"  checkpoint params not loaded: "
                   f"{names(self.unused_source)}")
    return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class _Rule:
  index: int
  pattern: re.Pattern
  replacement: Optional[str]
  optional: bool = False  # A layout's rule: may match no parameter.

  @property
  def field(self) -> str:
    return (f"init.layout rule {self.index}" if self.optional
            else f"init.rules[{self.index}]")


def parse_rules(rules: Any, optional: bool = False) -> list[_Rule]:
  """Validates and compiles `init.rules`; ConfigError names the rule.

  `optional`: the rules of a layout, which may match no parameter (a vmoe
  tree has `pre_logits` only with a representation size).
  """
  require(isinstance(rules, Sequence) and not isinstance(rules, (str, bytes)),
          "init.rules", "must be a sequence of (target_regex, "
          f"source_replacement) pairs, got {type(rules).__name__}")
  require(len(rules) > 0, "init.rules",
          "is empty: nothing would be loaded (use e.g. "
          "identity_rules() or dense_to_moe_rules())")
  parsed = []
  for i, rule in enumerate(rules):
    field = f"init.rules[{i}]"
    require(isinstance(rule, Sequence) and not isinstance(rule, str)
            and len(rule) == 2, field,
            f"must be a (target_regex, source_replacement) pair, got {rule!r}")
    target, source = rule
    require(isinstance(target, str), field,
            f"target regex must be a string, got {target!r}")
    require(source is None or isinstance(source, str), field,
            f"source replacement must be a string or None, got {source!r}")
    try:
      pattern = re.compile(target)
    except re.error as e:
      raise ConfigError(field, f"bad target regex {target!r}: {e}") from e
    parsed.append(_Rule(i, pattern, source, optional))
  return parsed


def _close(name: str, candidates: Sequence[str]) -> str:
  close = difflib.get_close_matches(name, candidates, n=3, cutoff=0.5)
  return f"; close matches: {', '.join(close)}" if close else ""


def plan(rules: Sequence[_Rule], targets: Mapping[str, Shape],
         sources: Mapping[str, Shape]) -> tuple[dict, dict, list, list, list]:
  """Resolves rules against target and source shapes, without any data.

  Args:
    rules: parsed rules.
    targets: `{path: shape}` of the new model's params (in order).
    sources: `{path: shape}` of the checkpoint's params.

  Returns:
    `(loaded, tiled, fresh, unmatched, shadowed_rules)` as in `InitReport`.

  Raises:
    ConfigError("init.rules[i]") for a rule matching no target, a bad
    replacement, a missing source or a shape mismatch.
  """
  loaded, tiled, fresh, unmatched = {}, {}, [], []
  won = set()
  for rule in rules:
    if not rule.optional and not any(rule.pattern.fullmatch(path)
                                     for path in targets):
      close = _close(rule.pattern.pattern, list(targets))
      raise ConfigError(
          rule.field, f"target regex {rule.pattern.pattern!r} fully matches "
          f"no parameter of the model{close}")
  for path, shape in targets.items():
    for rule in rules:
      match = rule.pattern.fullmatch(path)
      if match:
        break
    else:
      unmatched.append(path)
      continue
    won.add(rule.index)
    if rule.replacement is None:
      fresh.append(path)
      continue
    try:
      source = match.expand(rule.replacement)
    except (re.error, IndexError) as e:
      raise ConfigError(rule.field, f"bad source replacement "
                        f"{rule.replacement!r} for {path}: {e}") from e
    if source not in sources:
      raise ConfigError(
          rule.field, f"maps {path} to {source}, which is not in the "
          f"checkpoint{_close(source, list(sources))}")
    shape, source_shape = tuple(shape), tuple(sources[source])
    if shape == source_shape:
      loaded[path] = source
    elif shape[1:] == source_shape and len(shape) == len(source_shape) + 1:
      loaded[path] = source
      tiled[path] = int(shape[0])
    else:
      raise ConfigError(
          rule.field, f"maps {path} {list(shape)} to {source} "
          f"{list(source_shape)}: shapes must be equal, or the target may "
          "add one leading expert axis ([E, ...] from [...])")
  shadowed = [r.index for r in rules if r.index not in won]
  return loaded, tiled, fresh, unmatched, shadowed


def _rebuild(tree: Any, leaves: Mapping[str, Any], prefix: str = "") -> Any:
  """`tree` with the leaves at the paths in `leaves` replaced (new dicts)."""
  if isinstance(tree, Mapping):
    return type(tree)({k: _rebuild(v, leaves, f"{prefix}{k}/")
                       for k, v in tree.items()})
  return leaves.get(prefix[:-1], tree)


def _place(value: np.ndarray, like: Any) -> Any:
  """`value` as an array of `like`'s shape, dtype and placement."""
  dtype = like.dtype
  value = np.broadcast_to(value, like.shape)
  if isinstance(like, np.ndarray):
    return np.array(value, dtype=dtype)
  if isinstance(like, jax.Array):
    return jax.device_put(np.asarray(value, dtype=dtype), like.sharding)
  return jnp.asarray(value, dtype=dtype)


def _rules_of(init_config: Any) -> list[_Rule]:
  """`init.rules`, or the rules of `init.layout` when no rules are given."""
  rules, layout = _get(init_config, "rules"), _get(init_config, "layout")
  if layout is not None and not rules:
    return parse_rules(layout_rules(layout, bool(_get(init_config,
                                                      "upcycle"))),
                       optional=True)
  return parse_rules(rules)


def _check_strict(source: InitSource, resolved: tuple, targets: Any) -> None:
  """`init.strict`: every parameter loaded or kept fresh by a rule, every
  checkpoint leaf loaded."""
  loaded, _, _, unmatched, _ = resolved
  if unmatched:
    raise ConfigError("init.rules", f"(strict) model parameter "
                      f"{unmatched[0]} {list(targets[unmatched[0]])} is "
                      f"matched by no rule: {source.describe()} has no "
                      f"counterpart for it ({len(unmatched)} such)")
  used = set(loaded.values())
  extra = [p for p in source.shapes if p not in used]
  if extra:
    raise ConfigError("init.rules", f"(strict) checkpoint leaf {extra[0]} "
                      f"{list(source.shapes[extra[0]])} of "
                      f"{source.describe()} is loaded into no model "
                      f"parameter ({len(extra)} such: "
                      f"{', '.join(extra[:5])})")


def _resolve(init_config: Any, params: Any):
  """Rules, checkpoint and plan, from shapes only (no array data read)."""
  rules = _rules_of(init_config)
  source = open_source(init_config)
  flat = ckpt_params.flatten(params)
  targets = {p: tuple(getattr(leaf, "shape", None) or np.shape(leaf))
             for p, leaf in flat.items()}
  layout = _get(init_config, "layout")
  if layout is not None:
    check_layout(layout, targets, source.shapes,
                 upcycle=bool(_get(init_config, "upcycle")))
  resolved = plan(rules, targets, source.shapes)
  if _get(init_config, "strict"):
    _check_strict(source, resolved, targets)
  return source, flat, resolved


def check_init(init_config: Any, params: Any) -> None:
  """Raises the errors `load_init_params` would, reading no array data.

  `params` may be abstract (`jax.eval_shape(model.init, ...)["params"]`), so
  a bad `init` section is reported before anything is compiled.
  """
  _resolve(init_config, params)


def load_init_params(init_config: Any, params: Any) -> tuple[Any, InitReport]:
  """The new model's params with values from another checkpoint.

  Args:
    init_config: the `init` section (dict or ConfigDict): `workdir` and
      `step` (None: newest), or `checkpoint` and `format`; `rules` and/or
      `layout` (`upcycle`), `strict` (see the module docstring).
    params: the freshly initialised params of the new model (nested dicts of
      arrays); not modified.

  Returns:
    `(new_params, report)`: new nested dicts of the same structure, shapes,
    dtypes and shardings as `params`, loaded leaves replaced, every other
    leaf the same object as in `params`; and an `InitReport` (its summary is
    also logged).

  Raises:
    ConfigError naming `init.rules[i]`, `init.workdir`, `init.step`,
    `init.checkpoint`, `init.layout` or the model field a layout check
    found different; see the module docstring.
  """
  source, flat, resolved = _resolve(init_config, params)
  loaded, tiled, fresh, unmatched, shadowed = resolved
  values = source.read(set(loaded.values()))
  new_leaves = {t: _place(values[s], flat[t]) for t, s in loaded.items()}
  used = set(loaded.values())
  report = InitReport(
      workdir=source.location, step=source.step, loaded=loaded, tiled=tiled,
      fresh=tuple(fresh), unmatched=tuple(unmatched),
      shadowed_rules=tuple(shadowed),
      unused_source=tuple(p for p in source.shapes if p not in used))
  logging.getLogger(__name__).info(report.summary())
  return _rebuild(params, new_leaves), report


__all__ = ["InitReport", "Rule", "check_init", "dense_to_moe_rules",
           "find_checkpoint",
           "identity_rules", "load_init_params", "parse_rules", "plan"]
