"""Partition rules: regex -> `PartitionSpec` for every leaf of a state tree.

A leaf's path is its keys joined by "/", e.g.
`params/encoderblock_1/Moe/Mlp/Dense_0/kernel` or, for Adam's first moment,
`opt_state/0/mu/encoderblock_1/Moe/Mlp/Dense_0/kernel`. The first rule whose
regex `re.search`es the path gives the leaf's spec (a tuple of axis names,
None or tuples of axis names, one per leading dimension); leaves no rule
matches are replicated. One rule set covers parameters, optimizer state
(whose moments carry their parameter's path) and router state.

    DEFAULT_RULES = ((r"/Moe/Mlp/", ("expert",)),)

splits every expert weight `[E, ...]` over the expert axis (vmoe's scheme).
On a mesh without the expert axis (`sharding.expert_axis=None`), rules that
name it are dropped: the experts are replicated.
"""

from __future__ import annotations

import re
from typing import Any, Optional, Sequence

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from vmoe_ext.errors import ConfigError, require

Rules = Sequence[tuple[str, Sequence[Any]]]
DEFAULT_RULES: Rules = ((r"/Moe/Mlp/", ("expert",)),)


def _axes_of(entry: Any) -> tuple[str, ...]:
  if entry is None:
    return ()
  return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


def check_rules(rules: Rules, axes: Sequence[str],
                field: str = "sharding.rules") -> list[tuple[re.Pattern,
                                                             PartitionSpec]]:
  """Compiled rules; errors name `field[i]` for a bad regex, a malformed
  spec or an axis the mesh does not have."""
  compiled = []
  for i, rule in enumerate(rules):
    require(isinstance(rule, (tuple, list)) and len(rule) == 2,
            f"{field}[{i}]", f"must be a (regex, spec) pair, got {rule!r}")
    pattern, spec = rule
    try:
      regex = re.compile(pattern)
    except (re.error, TypeError) as e:
      raise ConfigError(f"{field}[{i}][0]",
                        f"invalid regex {pattern!r}: {e}") from e
    require(isinstance(spec, (tuple, list)), f"{field}[{i}][1]",
            f"must be a tuple of axis names (or None) per dimension, got "
            f"{spec!r}")
    for entry in spec:
      for axis in _axes_of(entry):
        require(axis in axes, f"{field}[{i}][1]",
                f"unknown mesh axis {axis!r}; the mesh has {tuple(axes)} "
                "(sharding.axes)")
    compiled.append((regex, PartitionSpec(*spec)))
  return compiled


def path_name(path: Sequence[Any]) -> str:
  """`"a/b/0/c"` for a `jax.tree_util` key path."""
  parts = []
  for key in path:
    for attr in ("key", "name", "idx"):
      if hasattr(key, attr):
        parts.append(str(getattr(key, attr)))
        break
    else:
      parts.append(str(key))
  return "/".join(parts)


def partition_specs(tree: Any, mesh: Mesh, rules: Optional[Rules] = None,
                    field: str = "sharding.rules") -> Any:
  """A tree of `PartitionSpec`s for `tree` (arrays or ShapeDtypeStructs).

  Errors name the rule when its spec has more dimensions than a leaf or an
  axis size does not divide the leaf's dimension.
  """
  axes = tuple(mesh.axis_names)
  rules = DEFAULT_RULES if rules is None else rules
  if rules is DEFAULT_RULES:  # Drop the rule of a mesh without experts.
    rules = [r for r in rules if all(a in axes for e in r[1]
                                     for a in _axes_of(e))]
  compiled = check_rules(rules, axes, field)

  def spec(path, leaf) -> PartitionSpec:
    name = path_name(path)
    shape = getattr(leaf, "shape", ())
    for i, (regex, pspec) in enumerate(compiled):
      if regex.search(name):
        require(len(pspec) <= len(shape), f"{field}[{i}][1]",
                f"{tuple(pspec)} has {len(pspec)} dimensions; {name} has "
                f"shape {tuple(shape)}")
        for dim, entry in enumerate(pspec):
          size = 1
          for axis in _axes_of(entry):
            size *= mesh.shape[axis]
          require(shape[dim] % size == 0, f"{field}[{i}][1]",
                  f"splits dimension {dim} of {name} {tuple(shape)} over "
                  f"{size} devices, which does not divide {shape[dim]}")
        return pspec
    return PartitionSpec()

  return jax.tree_util.tree_map_with_path(spec, tree)


def named_shardings(tree: Any, mesh: Mesh, rules: Optional[Rules] = None,
                    field: str = "sharding.rules") -> Any:
  """`partition_specs` as `NamedSharding`s on `mesh`."""
  return jax.tree.map(lambda s: NamedSharding(mesh, s),
                      partition_specs(tree, mesh, rules, field),
                      is_leaf=lambda x: isinstance(x, PartitionSpec))
