"""Reading foreign checkpoints: vmoe's partitioned files, vit_jax npz, flax msgpack.

The files are written here: vmoe's by `vmoe_layout` (a writer that follows
vmoe's source and does not use the reader), and one index/data pair is built
byte by byte from msgpack primitives as an independent check of the layout.
"""

from __future__ import annotations

import os
import struct

import jax
import ml_dtypes
import msgpack
import numpy as np
import pytest

from vmoe_ext.errors import ConfigError
from vmoe_ext.interop import formats
from vmoe_layout import (CHUNKS_KEY, flatten, write_msgpack, write_npz,
                         write_vmoe_checkpoint)

BF16 = np.dtype(ml_dtypes.bfloat16)
E, D, H = 4, 3, 5


def _tree(rng) -> dict:
  f32 = lambda *s: rng.standard_normal(s).astype(np.float32)
  bf16 = lambda *s: rng.standard_normal(s).astype(BF16)
  return {
      "Encoder": {
          "encoderblock_1": {"Moe": {"Mlp": {"Dense_0": {
              "kernel": f32(E, D, H), "bias": bf16(E, H)}}}},
          "encoder_norm": {"scale": f32(D)},
      },
      "head": {"kernel": bf16(D, 2), "bias": f32(2)},
      "counts": rng.integers(-9, 9, (3, 2)).astype(np.int32),
      "step": np.array(7, np.int32),
  }


def _assert_same(got: dict, want: dict) -> None:
  """Same names, shapes, dtypes and bytes."""
  assert sorted(got) == sorted(want)
  for name, w in want.items():
    g = got[name]
    assert isinstance(g, np.ndarray), name
    assert (g.dtype, g.shape) == (w.dtype, w.shape), name
    assert g.tobytes() == w.tobytes(), name


def _shapes(flat: dict) -> dict:
  return {name: (a.shape, a.dtype) for name, a in flat.items()}


def _field(excinfo) -> str:
  return excinfo.value.field


# --- Round trips. -----------------------------------------------------------


@pytest.mark.parametrize("fmt", ["vmoe", "npz", "msgpack"])
def test_round_trip(tmp_path, rng, fmt):
  tree = _tree(rng)
  want = flatten(tree)
  path = {"vmoe": tmp_path / "ckpt", "npz": tmp_path / "ckpt.npz",
          "msgpack": tmp_path / "ckpt.msgpack"}[fmt]
  {"vmoe": write_vmoe_checkpoint, "npz": write_npz,
   "msgpack": write_msgpack}[fmt](str(path), tree)
  assert formats.resolve(str(path)) == (str(path), fmt)
  assert formats.read_shapes(str(path)) == _shapes(want)
  assert formats.read_shapes(str(path), fmt) == _shapes(want)
  _assert_same(formats.read_arrays(str(path)), want)
  name = "Encoder/encoderblock_1/Moe/Mlp/Dense_0/kernel"
  got = formats.read_arrays(str(path), fmt, names=[name, "step"])
  assert list(got) == [name, "step"]
  _assert_same(got, {name: want[name], "step": want["step"]})


def test_vmoe_array_ids_follow_jax_flattening(tmp_path, rng):
  # Nested sorted keys ("a" < "a-b", so a/x is array 0) differ from sorted
  # joined paths ("a-b" < "a/x"); shapes differ so a wrong id cannot pass.
  tree = {"a": {"x": np.arange(2, dtype=np.float32)},
          "a-b": np.arange(3, dtype=np.float32),
          "encoderblock_10": np.arange(4, dtype=np.int32),
          "encoderblock_2": np.arange(5, dtype=np.int32)}
  order = [jax.tree_util.keystr(p, simple=True, separator="/")
           for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
  assert order == ["a/x", "a-b", "encoderblock_10", "encoderblock_2"]
  assert order != sorted(flatten(tree))
  write_vmoe_checkpoint(str(tmp_path / "c"), tree, num_shards=2)
  _assert_same(formats.read_arrays(str(tmp_path / "c")), flatten(tree))


def test_vmoe_shards_and_split_chunks(tmp_path, rng):
  tree = _tree(rng)
  prefix = str(tmp_path / "ckpt")
  write_vmoe_checkpoint(prefix, tree, num_shards=3, split_axis0=True,
                        subchunk_bytes=8)
  # The layout really spreads chunks: read the files with plain msgpack.
  holders = {}  # Array id -> shards holding a chunk of it.
  for shard in range(3):
    with open(f"{prefix}.data-{shard:05d}-of-00003", "rb") as f:
      content = msgpack.unpackb(f.read())
    assert content.pop(CHUNKS_KEY) is True
    for key, chunks in content.items():
      holders.setdefault(key, set()).add(shard)
      assert all(len(subchunks) >= 1 for subchunks, _ in chunks)
  assert set().union(*holders.values()) == {0, 1, 2}
  assert any(len(s) == 2 for s in holders.values())
  _assert_same(formats.read_arrays(prefix), flatten(tree))


def test_vmoe_shapes_read_the_index_only(tmp_path, rng):
  tree = _tree(rng)
  prefix = str(tmp_path / "ckpt")
  write_vmoe_checkpoint(prefix, tree, num_shards=2, split_axis0=True)
  for shard in range(2):
    os.remove(f"{prefix}.data-{shard:05d}-of-00002")
  assert formats.read_shapes(prefix) == _shapes(flatten(tree))
  with pytest.raises(ConfigError) as e:
    formats.read_arrays(prefix)
  assert _field(e) == "init.checkpoint"
  assert ".data-0000" in str(e.value) and "does not exist" in str(e.value)


def test_vmoe_reads_only_the_needed_shards(tmp_path):
  tree = {"a": np.arange(4, dtype=np.float32).reshape(2, 2),
          "b": np.arange(3, dtype=np.int32)}
  prefix = str(tmp_path / "ckpt")
  write_vmoe_checkpoint(prefix, tree, num_shards=2)
  with open(f"{prefix}.data-00000-of-00002", "rb") as f:
    assert set(msgpack.unpackb(f.read())) == {CHUNKS_KEY, "0"}  # a only.
  os.remove(f"{prefix}.data-00001-of-00002")
  _assert_same(formats.read_arrays(prefix, names=["a"]), {"a": tree["a"]})
  with pytest.raises(ConfigError) as e:
    formats.read_arrays(prefix, names=["b"])
  assert _field(e) == "init.checkpoint"
  assert "ckpt.data-00001-of-00002" in str(e.value) and "'b'" in str(e.value)


def test_msgpack_flax_chunked_arrays(tmp_path, rng, monkeypatch):
  from flax import serialization
  monkeypatch.setattr(serialization, "MAX_CHUNK_SIZE", 8)
  tree = {"layer": {"kernel": rng.standard_normal((3, 5)).astype(np.float32)}}
  path = str(tmp_path / "p.msgpack")
  write_msgpack(path, tree)
  with open(path, "rb") as f:
    assert b"__msgpack_chunked_array__" in f.read()
  _assert_same(formats.read_arrays(path), flatten(tree))


def test_npz_shapes_read_headers_only(tmp_path, rng, monkeypatch):
  tree = _tree(rng)
  path = str(tmp_path / "vit.npz")
  write_npz(path, tree)

  def no_load(*args, **kwargs):
    raise AssertionError("np.load called")
  monkeypatch.setattr(np, "load", no_load)
  assert formats.read_shapes(path) == _shapes(flatten(tree))


# --- A vmoe index/data pair built byte by byte. ------------------------------

NIL, FALSE, TRUE = b"\xc0", b"\xc2", b"\xc3"


def _int(n):  # positive fixint
  assert 0 <= n < 128
  return bytes([n])


def _str(s):  # fixstr
  b = s.encode()
  assert len(b) < 32
  return bytes([0xa0 | len(b)]) + b


def _bin(b):  # bin 8
  assert len(b) < 256
  return b"\xc4" + bytes([len(b)]) + b


def _ext(code, b):  # fixext 1/2/4/8/16, else ext 8
  fixed = {1: 0xd4, 2: 0xd5, 4: 0xd6, 8: 0xd7, 16: 0xd8}
  if len(b) in fixed:
    return bytes([fixed[len(b)], code]) + b
  assert len(b) < 256
  return b"\xc7" + bytes([len(b), code]) + b


def _arr(*items):  # fixarray
  assert len(items) < 16
  return bytes([0x90 | len(items)]) + b"".join(items)


def _map(*pairs):  # fixmap
  assert len(pairs) < 16
  return bytes([0x80 | len(pairs)]) + b"".join(k + v for k, v in pairs)


def _slice_nd(region):
  return _arr(*[_bin(_arr(_int(a), _int(b), NIL)) for a, b in region])


def _handmade(prefix, values, index_regions, data_regions=None):
  """`{"w": values}` (float32 [2, 3]) as vmoe V1 writes it, one shard."""
  aval = _arr(_arr(_int(2), _int(3)), _str("float32"), FALSE, _map())
  info = _arr(_bin(aval), _arr(*[_bin(_slice_nd(r)) for r in index_regions]),
              _arr(*[_int(0) for _ in index_regions]))
  index = _map((_str("shard_count"), _int(1)),
               (_str("index"), _map((_str("w"), _ext(8, info)))),
               (_str("version"), _str("20220622")))
  chunks = []
  for region in index_regions if data_regions is None else data_regions:
    chunk = values[tuple(slice(a, b) for a, b in region)]
    ndarray = _arr(_arr(_int(chunk.size)), _str("float32"),
                   _bin(chunk.tobytes()))
    chunks.append(_arr(_arr(_ext(1, ndarray)), _ext(6, _slice_nd(region))))
  data = _map((_str(CHUNKS_KEY), TRUE), (_str("0"), _arr(*chunks)))
  with open(prefix + ".index", "wb") as f:
    f.write(index)
  with open(prefix + ".data-00000-of-00001", "wb") as f:
    f.write(data)
  return index, data


W = np.arange(6, dtype=np.float32).reshape(2, 3) - 2.5
FULL = [((0, 2), (0, 3))]
ROWS = [((0, 1), (0, 3)), ((1, 2), (0, 3))]


def test_handmade_bytes_are_read_and_match_the_writer(tmp_path):
  for regions in (FULL, ROWS):
    prefix = str(tmp_path / "hand")
    index, data = _handmade(prefix, W, regions)
    assert formats.read_shapes(prefix) == {"w": ((2, 3), np.dtype("float32"))}
    _assert_same(formats.read_arrays(prefix), {"w": W})
  prefix = str(tmp_path / "hand")
  index, data = _handmade(prefix, W, FULL)
  write_vmoe_checkpoint(str(tmp_path / "writer"), {"w": W})
  with open(str(tmp_path / "writer") + ".index", "rb") as f:
    assert f.read() == index
  with open(str(tmp_path / "writer") + ".data-00000-of-00001", "rb") as f:
    assert f.read() == data


def test_handmade_duplicate_chunks_are_harmless(tmp_path):
  prefix = str(tmp_path / "hand")
  _handmade(prefix, W, ROWS, data_regions=ROWS + ROWS[::-1])
  _assert_same(formats.read_arrays(prefix), {"w": W})


def test_chunks_that_do_not_cover_the_array(tmp_path):
  prefix = str(tmp_path / "hand")
  _handmade(prefix, W, ROWS[:1])
  with pytest.raises(ConfigError) as e:
    formats.read_arrays(prefix)
  assert _field(e) == "init.checkpoint"
  assert "'w'" in str(e.value) and "cover 3 of its 6" in str(e.value)


def test_chunk_missing_from_its_data_shard(tmp_path):
  prefix = str(tmp_path / "hand")
  _handmade(prefix, W, ROWS, data_regions=ROWS[:1])
  with pytest.raises(ConfigError) as e:
    formats.read_arrays(prefix)
  assert _field(e) == "init.checkpoint"
  assert "hand.data-00000-of-00001" in str(e.value)
  assert "no chunk ((1, 2), (0, 3)) of 'w'" in str(e.value)


# --- Path resolution and errors. --------------------------------------------


def test_resolve_auto(tmp_path):
  prefix = str(tmp_path / "vmoe_s32")
  write_vmoe_checkpoint(prefix, {"w": W})
  for path in (prefix, prefix + ".index", prefix + ".data-00000-of-00001"):
    assert formats.resolve(path) == (prefix, "vmoe")
    assert formats.resolve(path, "vmoe") == (prefix, "vmoe")
  for ext, fmt in ((".npz", "npz"), (".msgpack", "msgpack")):
    path = str(tmp_path / f"p{ext}")
    open(path, "wb").close()
    assert formats.resolve(path) == (path, fmt)
  other = str(tmp_path / "weights.bin")
  open(other, "wb").close()
  assert formats.resolve(other, "npz") == (other, "npz")
  with pytest.raises(ConfigError) as e:
    formats.resolve(other)
  assert _field(e) == "init.checkpoint" and "weights.bin" in str(e.value)


@pytest.mark.parametrize("name,fmt", [("nope", "auto"), ("nope.npz", "auto"),
                                      ("nope.msgpack", "auto"),
                                      ("nope", "vmoe"), ("nope", "npz")])
def test_missing_file(tmp_path, name, fmt):
  path = str(tmp_path / name)
  for read in (formats.read_shapes, formats.read_arrays):
    with pytest.raises(ConfigError) as e:
      read(path, fmt)
    assert _field(e) == "init.checkpoint" and "nope" in str(e.value)
    assert "does not exist" in str(e.value)


def test_unknown_format(tmp_path):
  with pytest.raises(ConfigError) as e:
    formats.read_shapes(str(tmp_path / "x.npz"), "safetensors")
  assert _field(e) == "init.format" and "'safetensors'" in str(e.value)


def _write(fmt, tmp_path, tree):
  if fmt == "vmoe":
    path = str(tmp_path / "ckpt")
    write_vmoe_checkpoint(path, tree)
  else:
    path = str(tmp_path / f"ckpt.{fmt}")
    {"npz": write_npz, "msgpack": write_msgpack}[fmt](path, tree)
  return path


def _truncate(path):
  with open(path, "rb") as f:
    data = f.read()
  with open(path, "wb") as f:
    f.write(data[:len(data) // 2])


@pytest.mark.parametrize("fmt", ["vmoe", "npz", "msgpack"])
def test_truncated_file(tmp_path, rng, fmt):
  path = _write(fmt, tmp_path, _tree(rng))
  victim = path + ".index" if fmt == "vmoe" else path
  _truncate(victim)
  for read in (formats.read_shapes, formats.read_arrays):
    with pytest.raises(ConfigError) as e:
      read(path)
    assert _field(e) == "init.checkpoint" and victim in str(e.value)


def test_vmoe_truncated_or_garbage_data_shard(tmp_path, rng):
  tree = _tree(rng)
  prefix = _write("vmoe", tmp_path, tree)
  data = prefix + ".data-00000-of-00001"
  _truncate(data)
  assert formats.read_shapes(prefix) == _shapes(flatten(tree))
  with pytest.raises(ConfigError) as e:
    formats.read_arrays(prefix)
  assert _field(e) == "init.checkpoint" and data in str(e.value)
  with open(data, "wb") as f:
    f.write(struct.pack(">BI", 0xc6, 4) + b"junk")  # A bin, not a map.
  with pytest.raises(ConfigError) as e:
    formats.read_arrays(prefix)
  assert _field(e) == "init.checkpoint" and "not a vmoe data shard" in str(
      e.value)


@pytest.mark.parametrize("fmt", ["vmoe", "npz", "msgpack"])
def test_unknown_array_name(tmp_path, rng, fmt):
  path = _write(fmt, tmp_path, _tree(rng))
  with pytest.raises(ConfigError) as e:
    formats.read_arrays(path, names=["head/kernel", "head/kernal"])
  assert _field(e) == "init.checkpoint"
  assert "'head/kernal'" in str(e.value) and "head/kernel" in str(e.value)


def test_vmoe_unversioned_and_unknown_versions(tmp_path, rng):
  prefix = str(tmp_path / "old")
  tree = _tree(rng)  # Plain dicts (a params tree): the same array ids.
  write_vmoe_checkpoint(prefix, tree, num_shards=2, version=None)
  flat = flatten(tree)
  got = formats.read_arrays(prefix)
  assert sorted(got) == sorted(flat)
  for name, value in flat.items():
    np.testing.assert_array_equal(got[name], value)
  for bad in ({"opt_state": {"w": W}, "params": {"w": W}}, {"w": [W, W]}):
    write_vmoe_checkpoint(prefix, bad, version=None)
    with pytest.raises(ConfigError) as e:
      formats.read_shapes(prefix)
    assert _field(e) == "init.checkpoint" and "old.index" in str(e.value)
    assert "un-versioned" in str(e.value) and "tree structure" in str(
        e.value)
  write_vmoe_checkpoint(prefix, {"w": W}, version="20990101")
  with pytest.raises(ConfigError) as e:
    formats.read_arrays(prefix)
  assert _field(e) == "init.checkpoint" and "'20990101'" in str(e.value)
