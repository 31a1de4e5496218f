"""google-research/vmoe's partitioned checkpoint files, read without vmoe.

`vmoe.checkpoints.partitioned` (version V1 "20220622", and un-versioned
parameter trees) writes `PREFIX.index` and data shards
`PREFIX.data-%05d-of-%05d`; `vmoe_ext.interop.formats` documents the layout
and is the public entry point (`read_shapes` / `read_arrays` with format
"vmoe"). Errors are ConfigErrors on "init.checkpoint".
"""

from __future__ import annotations

import difflib
import math
import os
import re
from typing import Any, Iterable, Iterator, NamedTuple, Optional

import ml_dtypes
import msgpack
import numpy as np

from vmoe_ext.errors import ConfigError

FIELD = "init.checkpoint"
VMOE_V1 = "20220622"
CHUNKS_KEY = "__msgpack_array_chunk_a87ca2__"
# vmoe's msgpack ext codes (vmoe/checkpoints/serialization.py) that we decode;
# 4 ShapedArray and 5 Slice only occur packed inside IndexInfo and SliceNd.
EXT_NDARRAY, EXT_COMPLEX, EXT_NPSCALAR, EXT_SLICE_ND, EXT_INDEX_INFO = (
    1, 2, 3, 6, 8)
DATA_SUFFIX = re.compile(r"\.data-\d+-of-\d+$")

Shapes = dict[str, tuple[tuple[int, ...], np.dtype]]
Region = tuple[tuple[int, int], ...]  # (start, stop) per axis.


class _Leaf(NamedTuple):
  """One array of a vmoe index."""
  shape: tuple[int, ...]
  dtype: np.dtype
  slices: tuple[Region, ...]  # Global region of each chunk...
  shards: tuple[int, ...]  # ...and the data shard holding it.


def _dtype(name: Any) -> np.dtype:
  name = name.decode() if isinstance(name, bytes) else name
  dtype = np.dtype(ml_dtypes.bfloat16 if name == "bfloat16" else name)
  if dtype.hasobject:
    raise ValueError(f"object dtype {name!r}")
  return dtype


def _inner(data: bytes) -> Any:  # An ext payload; strings come back as bytes.
  return msgpack.unpackb(data, raw=True)


def _ndarray(data: bytes) -> np.ndarray:
  shape, name, buffer = _inner(data)
  shape, dtype = tuple(int(d) for d in shape), _dtype(name)
  if len(buffer) != math.prod(shape) * dtype.itemsize:
    raise ValueError(f"{len(buffer)} bytes for a {dtype} array of {shape}")
  return np.frombuffer(buffer, dtype).reshape(shape)


def _slice_nd(data: bytes) -> tuple[tuple[Any, Any], ...]:
  out = []
  for item in _inner(data):
    start, stop, step = _inner(item)
    if step not in (None, 1):
      raise ValueError(f"slice step {step}")
    out.append((start, stop))
  return tuple(out)  # A tuple: plain msgpack arrays decode as lists.


def _ext_hook(code: int, data: bytes) -> Any:
  if code in (EXT_NDARRAY, EXT_NPSCALAR):
    array = _ndarray(data)
    return array if code == EXT_NDARRAY else array[()]
  if code == EXT_COMPLEX:
    return complex(*msgpack.unpackb(data))
  if code == EXT_SLICE_ND:
    return _slice_nd(data)
  if code == EXT_INDEX_INFO:
    aval, slices, shards = _inner(data)
    aval = _inner(aval)  # (shape, dtype, weak_type[, named_shape])
    return _Leaf(tuple(int(d) for d in aval[0]), _dtype(aval[1]),
                 tuple(map(_slice_nd, slices)), tuple(map(int, shards)))
  return msgpack.ExtType(code, data)


def read_bytes(path: str, what: str) -> bytes:
  try:
    with open(path, "rb") as f:
      return f.read()
  except FileNotFoundError as e:
    raise ConfigError(FIELD, f"{what} {path} does not exist") from e
  except OSError as e:
    raise ConfigError(FIELD, f"cannot read {what} {path}: {e}") from e


def corrupt(path: str, e: Any) -> ConfigError:
  detail = f"{type(e).__name__}: {e}" if isinstance(e, Exception) else e
  return ConfigError(FIELD, f"{path} is truncated or corrupt ({detail})")


def _load(path: str, what: str) -> Any:
  data = read_bytes(path, what)
  try:
    return msgpack.unpackb(data, raw=False, ext_hook=_ext_hook)
  except Exception as e:  # msgpack's many error types, and _ext_hook's.
    raise corrupt(f"{what} {path}", e) from e


def _region(slices: Any, shape: tuple[int, ...]) -> Region:
  """A decoded SliceNd as (start, stop) per axis, None filled in; checked."""
  if not isinstance(slices, tuple) or len(slices) != len(shape):
    raise ValueError(f"slice {slices!r} for an array of shape {shape}")
  region = tuple((0 if a is None else a, n if b is None else b)
                 for (a, b), n in zip(slices, shape))
  if not all(0 <= a <= b <= n for (a, b), n in zip(region, shape)):
    raise ValueError(f"slice {region} outside an array of shape {shape}")
  return region


def _index_leaves(node: Any, path: str,
                  prefix: str = "") -> Iterator[tuple[str, _Leaf]]:
  """(name, leaf) in vmoe's array-id order: jax's flattening (sorted keys)."""
  if isinstance(node, _Leaf):
    yield prefix[:-1], node
  elif isinstance(node, (dict, list)):
    keys = sorted(node) if isinstance(node, dict) else range(len(node))
    for key in keys:
      yield from _index_leaves(node[key], path, f"{prefix}{key}/")
  elif node is not None:  # None is an empty subtree for jax.
    raise corrupt(path, f"{prefix[:-1]!r} is not an IndexInfo")


def _plain_dicts(tree: Any) -> bool:
  """Whether an un-versioned index is a tree of string-keyed dicts only (a
  params tree, as the released checkpoints are): the saved Python tree then
  flattened in the same sorted-key order as its state dict, so array ids
  are known. Digit keys (sequences) and train-state fields are not."""
  if type(tree) in (list, tuple):  # Not an IndexInfo (a named tuple).
    return False
  if not isinstance(tree, dict):
    return True
  return all(not key.isdigit() and key != "opt_state"
             and _plain_dicts(value) for key, value in tree.items())


def read_index(prefix: str) -> tuple[dict[str, _Leaf], int]:
  """The arrays of a V1 checkpoint, in array-id order, and its shard count."""
  path = prefix + ".index"
  content = _load(path, "vmoe index")
  if not (isinstance(content, dict) and "index" in content
          and "shard_count" in content):
    raise corrupt(path, "not a vmoe index: no 'index' and 'shard_count'")
  version = content.get("version")
  if version is None and not _plain_dicts(content["index"]):
    raise ConfigError(FIELD, (
        f"{path} is an un-versioned (pre-{VMOE_V1}) vmoe checkpoint of a "
        "tree with sequences or a train state: its array ids follow the "
        "flattening of the Python tree that was saved, which the file does "
        "not record, so reading it needs that tree structure; unsupported "
        "(re-save it with a current vmoe)"))
  if version not in (None, VMOE_V1):
    raise ConfigError(FIELD, f"{path} has vmoe checkpoint version "
                      f"{version!r}; only {VMOE_V1!r} (and un-versioned "
                      "parameter trees) are supported")
  count = content["shard_count"]
  if not isinstance(count, int) or count < 1:
    raise corrupt(path, f"shard_count {count!r}")
  leaves = {}
  for name, leaf in _index_leaves(content["index"], path):
    try:
      if len(leaf.slices) != len(leaf.shards) or not all(
          0 <= s < count for s in leaf.shards):
        raise ValueError(f"shards {leaf.shards} of {count}")
      leaves[name] = leaf._replace(
          slices=tuple(_region(s, leaf.shape) for s in leaf.slices))
    except ValueError as e:
      raise corrupt(path, f"array {name!r}: {e}") from e
  return leaves, count


def _shard_chunks(path: str) -> dict[int, list[tuple[Any, list]]]:
  """Array id -> [(slice, 1-d subchunks)] of one vmoe data shard."""
  content = _load(path, "vmoe data shard")
  if not isinstance(content, dict) or content.get(CHUNKS_KEY) is not True:
    raise corrupt(path, f"not a vmoe data shard: no {CHUNKS_KEY!r}")
  try:
    return {int(key): [(slices, list(sub)) for sub, slices in chunks]
            for key, chunks in content.items() if key != CHUNKS_KEY}
  except (TypeError, ValueError) as e:
    raise corrupt(path, e) from e


def read_vmoe_arrays(prefix: str,
                 names: Optional[Iterable[str]]) -> dict[str, np.ndarray]:
  leaves, count = read_index(prefix)
  names = select(leaves, names, prefix + ".index")
  ids = {name: i for i, name in enumerate(leaves)}
  plan: dict[int, list[tuple[str, Region]]] = {}  # Shard -> chunks to read.
  for name in names:
    leaf = leaves[name]
    covered = np.zeros(leaf.shape, bool)
    for region, shard in zip(leaf.slices, leaf.shards):
      covered[tuple(slice(a, b) for a, b in region)] = True
      plan.setdefault(shard, []).append((name, region))
    if not covered.all():
      raise ConfigError(FIELD, (
          f"the chunks of {name!r} listed in {prefix}.index cover "
          f"{int(covered.sum())} of its {covered.size} elements"))
  out = {name: np.empty(leaves[name].shape, leaves[name].dtype)
         for name in names}
  for shard in sorted(plan):  # Only the shards holding the arrays asked for.
    path = f"{prefix}.data-{shard:05d}-of-{count:05d}"
    if not os.path.exists(path):
      raise ConfigError(FIELD, f"vmoe data shard {path} does not exist "
                        f"(it holds a chunk of {plan[shard][0][0]!r})")
    chunks = _shard_chunks(path)
    for name, region in plan[shard]:
      dtype, shape = leaves[name].dtype, leaves[name].shape
      try:
        found = [sub for s, sub in chunks.get(ids[name], [])
                 if _region(s, shape) == region]
        if not found:
          raise ValueError(f"no chunk {region} of {name!r}, which the index "
                           "places in this shard")
        if not all(isinstance(x, np.ndarray) and x.dtype == dtype
                   for x in found[0]):
          raise ValueError(f"chunk {region} of {name!r} is not {dtype}")
        flat = np.concatenate(found[0]) if found[0] else np.empty(0, dtype)
        out[name][tuple(slice(a, b) for a, b in region)] = flat.reshape(
            tuple(b - a for a, b in region))
      except ValueError as e:
        raise corrupt(path, str(e)) from e
    del chunks
  return out


def select(available: Any, names: Optional[Iterable[str]],
           where: str) -> list[str]:
  """The requested names (all if None); an unknown one is an error."""
  if names is None:
    return list(available)
  wanted = list(dict.fromkeys([names] if isinstance(names, str) else names))
  for name in wanted:
    if name not in available:
      close = difflib.get_close_matches(name, list(available), n=3)
      hint = f"; close: {', '.join(close)}" if close else ""
      raise ConfigError(FIELD, f"{where} has no array named {name!r} (it has "
                        f"{len(available)} arrays{hint})")
  return wanted


__all__ = ["CHUNKS_KEY", "DATA_SUFFIX", "FIELD", "VMOE_V1", "corrupt",
           "read_bytes", "read_index", "read_vmoe_arrays", "select"]
