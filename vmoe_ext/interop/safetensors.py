"""A NumPy reader of Hugging Face checkpoints: safetensors files and
`config.json`.

The safetensors format (one file):

    [8 bytes]  N, the header's length, unsigned 64-bit little-endian
    [N bytes]  a UTF-8 JSON object: for every tensor NAME
               {"dtype": "F32", "shape": [d0, d1, ...],
                "data_offsets": [begin, end]}
               and optionally "__metadata__" (a string -> string map)
    [rest]     the data buffer: tensor NAME is bytes begin..end of it,
               C order, little-endian

Dtypes read: F64, F32, F16, BF16 (as `ml_dtypes.bfloat16`), I64, I32, I16,
I8, U8, BOOL. A Hugging Face model directory holds `model.safetensors`, or
shards listed by `model.safetensors.index.json`
(`{"weight_map": {NAME: FILE, ...}}`), and the model's `config.json`.

Nothing is downloaded: copy the checkpoint to a local directory first. Every
unreadable input (a missing file, a truncated or corrupt header, a tensor
outside the data buffer, a size that does not match its shape and dtype, an
unknown dtype, a name the index lists but its shard lacks) is a
`ConfigError` on the caller's field (`field`, by default
"checkpoint_dir") naming the file and the tensor.
"""

from __future__ import annotations

import json
import os
import struct
from typing import Any, Iterable, Optional

import ml_dtypes
import numpy as np

from vmoe_ext.errors import ConfigError, require

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"
METADATA = "__metadata__"
DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16), "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"), "I16": np.dtype("<i2"), "I8": np.dtype("i1"),
    "U8": np.dtype("u1"), "BOOL": np.dtype("?")}
_MAX_HEADER = 100 * 1024 * 1024  # The library's own bound.


def read_header(path: str, field: str = "checkpoint_dir"
                ) -> tuple[dict[str, dict[str, Any]], int]:
  """The tensor entries of a safetensors file (`__metadata__` dropped),
  checked against the file's size, and the data buffer's byte offset."""
  require(os.path.isfile(path), field, f"no file {path!r}")
  size = os.path.getsize(path)
  with open(path, "rb") as f:
    head = f.read(8)
    require(len(head) == 8, field, f"{path!r} is not a safetensors file "
            f"(shorter than the 8-byte header length)")
    (length,) = struct.unpack("<Q", head)
    require(length <= min(_MAX_HEADER, size - 8), field,
            f"{path!r}: header length {length} exceeds the file "
            f"({size} bytes); truncated or not safetensors")
    raw = f.read(length)
  try:
    header = json.loads(raw.decode("utf-8"))
  except (UnicodeDecodeError, json.JSONDecodeError) as e:
    raise ConfigError(field, f"{path!r}: the header is not JSON ({e})") from e
  require(isinstance(header, dict), field,
          f"{path!r}: the header is not a JSON object")
  start = 8 + length
  buffer = size - start
  entries = {}
  for name, entry in header.items():
    if name == METADATA:
      continue
    where = f"{path!r}, tensor {name!r}"
    require(isinstance(entry, dict) and {"dtype", "shape", "data_offsets"}
            <= set(entry), field, f"{where}: needs dtype, shape and "
            f"data_offsets, got {entry!r}")
    require(entry["dtype"] in DTYPES, field,
            f"{where}: dtype {entry['dtype']!r} is not read here (known: "
            f"{sorted(DTYPES)})")
    shape, offsets = entry["shape"], entry["data_offsets"]
    require(isinstance(shape, list) and all(
        isinstance(d, int) and d >= 0 for d in shape), field,
            f"{where}: bad shape {shape!r}")
    require(isinstance(offsets, list) and len(offsets) == 2 and all(
        isinstance(o, int) for o in offsets) and 0 <= offsets[0]
            <= offsets[1] <= buffer, field,
            f"{where}: data_offsets {offsets!r} fall outside the "
            f"{buffer}-byte data buffer (truncated file?)")
    nbytes = int(np.prod(shape, dtype=np.int64)) * DTYPES[
        entry["dtype"]].itemsize
    require(offsets[1] - offsets[0] == nbytes, field,
            f"{where}: {offsets[1] - offsets[0]} bytes for shape {shape} "
            f"of {entry['dtype']} ({nbytes} bytes)")
    entries[name] = entry
  return entries, start


def load_file(path: str, names: Optional[Iterable[str]] = None, *,
              field: str = "checkpoint_dir") -> dict[str, np.ndarray]:
  """`{name: array}` of a safetensors file (only `names` if given), each
  array with the file's dtype, in native byte order, owning its memory."""
  entries, start = read_header(path, field)
  wanted = list(entries) if names is None else list(names)
  missing = [n for n in wanted if n not in entries]
  require(not missing, field, f"{path!r} has no tensor "
          f"{missing[0] if missing else ''!r}")
  data = np.memmap(path, np.uint8, mode="r")
  out = {}
  for name in wanted:
    entry = entries[name]
    begin, end = entry["data_offsets"]
    dtype = DTYPES[entry["dtype"]]
    chunk = np.asarray(data[start + begin:start + end])
    array = chunk.view(dtype).reshape(entry["shape"])
    out[name] = array.astype(dtype.newbyteorder("="), copy=True)
  del data
  return out


def checkpoint_files(directory: str, field: str = "checkpoint_dir"
                     ) -> dict[str, list[str]]:
  """`{file path: [tensor names]}` of a Hugging Face model directory: its
  `model.safetensors` (names None: all), or the shards of its index."""
  require(os.path.isdir(directory), field, f"no directory {directory!r}")
  index = os.path.join(directory, INDEX_FILE)
  single = os.path.join(directory, SINGLE_FILE)
  if os.path.isfile(index):
    try:
      with open(index, encoding="utf-8") as f:
        weight_map = json.load(f).get("weight_map")
    except (OSError, json.JSONDecodeError, AttributeError) as e:
      raise ConfigError(field, f"{index!r} is not a safetensors index "
                        f"({e})") from e
    require(isinstance(weight_map, dict) and weight_map, field,
            f"{index!r} has no weight_map")
    out: dict[str, list[str]] = {}
    for name, file in weight_map.items():
      out.setdefault(os.path.join(directory, file), []).append(name)
    return out
  require(os.path.isfile(single), field,
          f"{directory!r} holds neither {SINGLE_FILE} nor {INDEX_FILE}")
  entries, _ = read_header(single, field)
  return {single: list(entries)}


def load_checkpoint(directory: str, field: str = "checkpoint_dir"
                    ) -> dict[str, np.ndarray]:
  """Every tensor of a Hugging Face model directory (single file or
  sharded), by name."""
  out: dict[str, np.ndarray] = {}
  for path, names in checkpoint_files(directory, field).items():
    out.update(load_file(path, names, field=field))
  return out


def read_config(directory: str, field: str = "checkpoint_dir"
                ) -> dict[str, Any]:
  """The directory's `config.json` as a dict."""
  path = os.path.join(directory, CONFIG_FILE)
  require(os.path.isfile(path), field, f"no {CONFIG_FILE} in {directory!r}")
  try:
    with open(path, encoding="utf-8") as f:
      config = json.load(f)
  except (OSError, json.JSONDecodeError) as e:
    raise ConfigError(field, f"{path!r} is not JSON ({e})") from e
  require(isinstance(config, dict), field, f"{path!r} is not a JSON object")
  return config


__all__ = ["CONFIG_FILE", "DTYPES", "INDEX_FILE", "SINGLE_FILE",
           "checkpoint_files", "load_checkpoint", "load_file", "read_config",
           "read_header"]
