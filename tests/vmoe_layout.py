"""Test-side writers of foreign checkpoint files (vmoe, npz, flax msgpack).

`write_vmoe_checkpoint` writes what google-research/vmoe's
`vmoe.checkpoints.partitioned.save_checkpoint` (version V1, "20220622")
writes for a tree of arrays on a single-process mesh, byte for byte, from
vmoe's source rather than from the reader in `vmoe_ext.interop.formats`:

* the tree is flattened as vmoe does (`jax.tree_util.tree_flatten` of the
  flax state dict: dict keys sorted, depth first); array `i` is leaf `i`;
* each array is one chunk (its full slice) or, with `split_axis0`, two chunks
  along axis 0 (what an expert-partitioned array on a 2-device mesh gives);
  the chunks of all arrays, in order (slices sorted), go to the data shard
  holding the fewest bytes so far, the lowest shard on ties
  (`_create_map_slicend_to_checkpoint_shard`, `_find_smallest_ckpt_shard`);
  all `num_shards` data files are written, empty ones too;
* `PREFIX.index` = msgpack of `{"shard_count": N, "index": <the tree with an
  IndexInfo ext per array>, "version": "20220622"}` (in that key order,
  `_create_map_filepath_to_data`);
* `PREFIX.data-%05d-of-%05d` = msgpack of `{CHUNKS_KEY: True, "<i>":
  [[subchunks, SliceNd ext], ...], ...}` with arrays in increasing id and each
  chunk flattened in C order and cut into 1-d ndarray exts of at most
  `subchunk_bytes` (`_lazy_array_chunks_encode`).

Extension payloads are each packed with `msgpack.packb(..., use_bin_type=
True)`: ndarray (1) = (shape, dtype name, C bytes) as flax's
`_ndarray_to_bytes`; ShapedArray (4) = (shape, dtype name, weak_type=False,
named_shape={}); Slice (5, only inside a SliceNd) = (start, stop, None);
SliceNd (6) = tuple of packed Slices; IndexInfo (8) = (packed ShapedArray,
tuple of packed SliceNds, tuple of shards).
"""

from __future__ import annotations

import math
import os
from typing import Any, Mapping, Optional

import jax
import msgpack
import numpy as np

VERSION_V1 = "20220622"
CHUNKS_KEY = "__msgpack_array_chunk_a87ca2__"
EXT_NDARRAY, EXT_SHAPED_ARRAY, EXT_SLICE_ND, EXT_INDEX_INFO = 1, 4, 6, 8
SUBCHUNK_BYTES = 2**30  # flax.serialization.MAX_CHUNK_SIZE.


def _packb(obj: Any) -> bytes:
  return msgpack.packb(obj, use_bin_type=True)


def _slice_nd_bytes(region) -> bytes:
  return _packb(tuple(_packb((start, stop, None)) for start, stop in region))


def _ndarray_ext(arr: np.ndarray) -> msgpack.ExtType:
  return msgpack.ExtType(
      EXT_NDARRAY, _packb((arr.shape, arr.dtype.name, arr.tobytes("C"))))


def _regions(arr: np.ndarray, split_axis0: bool) -> list[tuple]:
  full = tuple((0, n) for n in arr.shape)
  if not split_axis0 or arr.ndim == 0 or arr.shape[0] < 2:
    return [full]
  half = (arr.shape[0] + 1) // 2
  return sorted([((0, half),) + full[1:], ((half, arr.shape[0]),) + full[1:]])


def _subchunks(chunk: np.ndarray, subchunk_bytes: int) -> list:
  flat = np.ascontiguousarray(chunk).reshape(-1)
  size = max(1, subchunk_bytes // flat.dtype.itemsize)
  return [_ndarray_ext(flat[i:i + size]) for i in range(0, flat.size, size)]


def write_vmoe_checkpoint(prefix: str, tree: Mapping[str, Any],
                          num_shards: int = 1, split_axis0: bool = False,
                          version: Optional[str] = VERSION_V1,
                          subchunk_bytes: int = SUBCHUNK_BYTES) -> None:
  """Writes `prefix.index` and `prefix.data-%05d-of-%05d` (see module doc).

  `version=None` writes the old un-versioned index (no "version" key).
  """
  assert num_shards >= 1
  leaves, treedef = jax.tree_util.tree_flatten(tree)
  shard_bytes = [0] * num_shards
  shard_chunks = [{} for _ in range(num_shards)]  # Id -> [(region, chunk)].
  index_leaves = []
  for i, leaf in enumerate(leaves):
    arr = np.asarray(leaf)
    regions = _regions(arr, split_axis0)
    shards = []
    for region in regions:
      shard = min(range(num_shards), key=lambda s: (shard_bytes[s], s))
      shard_bytes[shard] += math.prod(b - a for a, b in region) * arr.itemsize
      shards.append(shard)
      chunk = arr[tuple(slice(a, b) for a, b in region)]
      shard_chunks[shard].setdefault(i, []).append((region, chunk))
    aval = _packb((arr.shape, arr.dtype.name, False, {}))
    info = (aval, tuple(_slice_nd_bytes(r) for r in regions), tuple(shards))
    index_leaves.append(msgpack.ExtType(EXT_INDEX_INFO, _packb(info)))
  index = {"shard_count": num_shards,
           "index": jax.tree_util.tree_unflatten(treedef, index_leaves)}
  if version is not None:
    index["version"] = version
  os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
  with open(prefix + ".index", "wb") as f:
    f.write(_packb(index))
  for shard, chunks in enumerate(shard_chunks):
    state = {CHUNKS_KEY: True}
    for i in sorted(chunks):
      state[str(i)] = [
          [_subchunks(chunk, subchunk_bytes),
           msgpack.ExtType(EXT_SLICE_ND, _slice_nd_bytes(region))]
          for region, chunk in chunks[i]]
    with open(f"{prefix}.data-{shard:05d}-of-{num_shards:05d}", "wb") as f:
      f.write(_packb(state))


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
  """Nested dicts -> {"a/b/c": leaf}."""
  out = {}
  for key, value in tree.items():
    if isinstance(value, Mapping):
      out.update(flatten(value, f"{prefix}{key}/"))
    else:
      out[f"{prefix}{key}"] = value
  return out


def write_npz(path: str, tree: Mapping[str, Any]) -> None:
  """vit_jax's layout: `np.savez` of the "/"-flattened tree."""
  with open(path, "wb") as f:
    np.savez(f, **flatten(tree))


def write_msgpack(path: str, tree: Mapping[str, Any]) -> None:
  """`flax.serialization.to_bytes(tree)`."""
  from flax import serialization  # pylint: disable=g-import-not-at-top
  with open(path, "wb") as f:
    f.write(serialization.to_bytes(tree))
