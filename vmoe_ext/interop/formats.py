"""Readers for foreign checkpoint files that hold a parameter tree.

Nothing is downloaded: copy a published checkpoint to a local path first
(`gsutil -m cp 'gs://vmoe_checkpoints/NAME*' DIR/`). Arrays are named by their
tree path joined with "/" (`Encoder/encoderblock_1/Moe/Mlp/Dense_0/kernel`).

* "vmoe": google-research/vmoe's partitioned checkpoint (`vmoe.checkpoints.
  partitioned`, version V1 "20220622"), how V-MoE checkpoints are published.
  `path` is a PREFIX naming `PREFIX.index` and the data shards
  `PREFIX.data-%05d-of-%05d` (shard i of N). Each file is one msgpack object
  with vmoe's extension types, whose payloads are themselves msgpack: 1 ndarray
  (shape, dtype name, C-order bytes) as flax writes it, 6 SliceNd (a tuple of
  packed (start, stop, step) Slices), 8 IndexInfo (packed ShapedArray (shape,
  dtype name, weak_type[, named_shape]), tuple of packed SliceNds, tuple of
  shard numbers). The index is `{"shard_count": N, "index": tree, "version":
  "20220622"}`, `tree` being the flax state dict of the saved tree with an
  IndexInfo per array: global shape and dtype, the global slice of each chunk
  and the shard holding it. A data shard is `{"__msgpack_array_chunk_a87ca2__":
  True, "<id>": [[subchunks, SliceNd], ...], ...}`: its chunks of array `id`,
  each flattened in C order and cut into 1-d ndarrays to concatenate. Ids
  number the index leaves in jax's flattening order (dict keys sorted at every
  level, depth first). The older un-versioned index (checkpoints written
  before 2022-06-22) numbers arrays by the flattening of the Python tree that
  was saved, which the file does not record; for a tree of plain dicts (a
  params tree) that order is the same sorted-key order, so such files are
  read; others (sequences, a train state) are refused.
* "npz": vit_jax's ViT/AugReg checkpoints, `np.savez` of a flat dict keyed by
  "/"-joined paths. Shapes come from the `.npy` member headers alone. A 2-byte
  void dtype (what `np.save` writes for bfloat16, "|V2") is read as bfloat16.
* "msgpack": `flax.serialization.to_bytes(params)` of a nested dict of arrays
  (flax's chunking of arrays over 1 GiB is undone by its `msgpack_restore`).
* "auto": `*.npz` -> npz, `*.msgpack` -> msgpack; `P.index`, `P.data-i-of-n`,
  or a path P with an existing `P.index` -> vmoe with prefix P.

Any unreadable input (missing file or data shard, truncated or corrupt file,
chunks that do not cover an array, an unknown array name) is a ConfigError on
"init.checkpoint" naming the file or array; an unknown format one on
"init.format".
"""

from __future__ import annotations

import os
import zipfile
from typing import Any, Iterable, Iterator, Optional

import ml_dtypes
import numpy as np

from vmoe_ext.errors import ConfigError
from vmoe_ext.interop.vmoe_partitioned import (DATA_SUFFIX, FIELD, Shapes,
                                               corrupt, read_bytes,
                                               read_index, read_vmoe_arrays,
                                               select)

FORMATS = ("auto", "vmoe", "npz", "msgpack")
_NPY_HEADERS = {(1, 0): np.lib.format.read_array_header_1_0,
                (2, 0): np.lib.format.read_array_header_2_0}
_NPZ_ERRORS = (zipfile.BadZipFile, ValueError, OSError, EOFError)


def _npz_shapes(path: str) -> Shapes:
  out = {}
  try:
    with zipfile.ZipFile(path) as archive:
      for member in archive.infolist():
        if member.filename.endswith(".npy"):
          with archive.open(member) as f:
            version = np.lib.format.read_magic(f)
            if version not in _NPY_HEADERS:
              raise ValueError(f"{member.filename}: npy version {version}")
            shape, _, dtype = _NPY_HEADERS[version](f)
          if dtype.kind == "V" and dtype.itemsize == 2 and not dtype.names:
            dtype = np.dtype(ml_dtypes.bfloat16)  # np.save of bfloat16.
          if dtype.hasobject:
            raise ValueError(f"{member.filename}: object dtype")
          out[member.filename[:-4]] = (tuple(shape), dtype)
  except FileNotFoundError as e:
    raise ConfigError(FIELD, f"{path} does not exist") from e
  except _NPZ_ERRORS as e:
    raise corrupt(path, e) from e
  return out


def _npz_arrays(path: str,
                names: Optional[Iterable[str]]) -> dict[str, np.ndarray]:
  shapes = _npz_shapes(path)
  wanted = select(shapes, names, path)  # Outside the try: a ValueError.
  try:
    with np.load(path, allow_pickle=False) as npz:
      return {name: npz[name].view(shapes[name][1]) for name in wanted}
  except _NPZ_ERRORS as e:
    raise corrupt(path, e) from e


def _flatten(tree: Any, prefix: str = "") -> Iterator[tuple[str, np.ndarray]]:
  """Nested dicts (lists) of arrays -> ("a/b/c", array); other leaves skipped."""
  if isinstance(tree, (dict, list, tuple)):
    items = tree.items() if isinstance(tree, dict) else enumerate(tree)
    for key, value in items:
      yield from _flatten(value, f"{prefix}{key}/")
  elif isinstance(tree, (np.ndarray, np.generic, bool, int, float, complex)):
    yield prefix[:-1], np.asarray(tree)


def _msgpack_arrays(path: str) -> dict[str, np.ndarray]:
  from flax import serialization  # pylint: disable=g-import-not-at-top
  data = read_bytes(path, "msgpack checkpoint")
  try:
    tree = serialization.msgpack_restore(data)
  except Exception as e:  # msgpack's many error types, and flax's.
    raise corrupt(path, e) from e
  if not isinstance(tree, dict):
    raise ConfigError(FIELD, f"{path} holds a {type(tree).__name__}, not a "
                      "dict of arrays")
  return dict(_flatten(tree))


def resolve(path: str, format: str = "auto") -> tuple[str, str]:
  """Returns (path, or vmoe PREFIX, and the concrete format) of a checkpoint.

  ConfigError on "init.format" for a format not in FORMATS; on
  "init.checkpoint" when the file (or `PREFIX.index`) does not exist or
  "auto" cannot tell the format.
  """
  if format not in FORMATS:
    raise ConfigError("init.format", f"unknown checkpoint format {format!r}; "
                      f"expected one of {', '.join(FORMATS)}")
  if not path:
    raise ConfigError(FIELD, "no checkpoint path given")
  path = os.path.expanduser(os.fspath(path))
  if format == "auto":
    if path.endswith((".npz", ".msgpack")):
      format = os.path.splitext(path)[1][1:]
    elif (path.endswith(".index") or DATA_SUFFIX.search(path)
          or os.path.isfile(path + ".index")):
      format = "vmoe"
    elif os.path.exists(path):
      raise ConfigError(FIELD, (
          f"cannot tell the format of {path}: name it *.npz or *.msgpack, "
          "give a vmoe PREFIX (PREFIX.index must exist), or set init.format"))
    else:
      raise ConfigError(FIELD, f"{path} does not exist (nor {path}.index)")
  if format == "vmoe":
    prefix = DATA_SUFFIX.sub("", path)
    prefix = prefix[:-len(".index")] if prefix.endswith(".index") else prefix
    if not os.path.isfile(prefix + ".index"):
      raise ConfigError(FIELD, f"vmoe index {prefix}.index does not exist")
    return prefix, "vmoe"
  if not os.path.isfile(path):
    raise ConfigError(FIELD, f"{path} does not exist or is not a file")
  return path, format


def read_shapes(path: str, format: str = "auto") -> Shapes:
  """Flat "/" names -> (shape, dtype) of every array of a checkpoint.

  Reads no array data for "vmoe" (the index only) and "npz" (the `.npy`
  headers only); "msgpack" decodes the whole file.
  """
  path, format = resolve(path, format)
  if format == "vmoe":
    leaves, _ = read_index(path)
    return {name: (leaf.shape, leaf.dtype) for name, leaf in leaves.items()}
  if format == "npz":
    return _npz_shapes(path)
  return {name: (a.shape, a.dtype)
          for name, a in _msgpack_arrays(path).items()}


def read_arrays(path: str, format: str = "auto",
                names: Optional[Iterable[str]] = None) -> dict[str, np.ndarray]:
  """Flat "/" names -> numpy arrays, of `names` only (all if None), in order.

  "vmoe" opens only the data shards holding chunks of the arrays asked for and
  reassembles each array from its chunks.
  """
  path, format = resolve(path, format)
  if format == "vmoe":
    return read_vmoe_arrays(path, names)
  if format == "npz":
    return _npz_arrays(path, names)
  arrays = _msgpack_arrays(path)
  return {name: arrays[name] for name in select(arrays, names, path)}
