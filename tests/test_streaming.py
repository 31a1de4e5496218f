"""Streaming training input (`vmoe_ext.data.streaming`) on a mock imagenet2012.

`tfds.testing.mock_data` replaces `tfds.data_source` by an in-memory random
generator (no files, `data_dir` ignored), so it can neither span several
array_record files nor test a wrong `data_dir`. Instead the module fixture
writes a real, tiny `imagenet2012` under a temporary `data_dir` with
`vmoe_ext.data.fake_tfds.build_fake_imagenet`: TFDS's own imagenet2012
builder (same name, version and features) with the ILSVRC archives replaced
by 340 generated 64x64 JPEGs, prepared as array_record in 4 files per split,
without TensorFlow. `tfds.data_source("imagenet2012",
data_dir=...)` then reads it through the registered builder, as it would
read the real dataset. Example i has file_name "n{i:08d}_{i}.JPEG" (its id)
and label (7 i + 3) mod 1000, distinct for every example.
"""

from __future__ import annotations

import gc
import glob
import json
import os
import shutil
import sys
import tracemalloc

import numpy as np
import pytest

tfds = pytest.importorskip("tensorflow_datasets")
grain = pytest.importorskip("grain.python")

from vmoe_ext.data import fake_tfds, streaming  # noqa: E402
from vmoe_ext.errors import ConfigError, InputError  # noqa: E402

N_TRAIN, N_VAL, SIDE, NUM_FILES = 300, 40, 64, 4


def _label_to_id(label):
  return (np.asarray(label) - 3) * 143 % 1000  # 143 = 7^-1 mod 1000.


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
  path = str(tmp_path_factory.mktemp("tfds"))
  fake_tfds.build_fake_imagenet(path, num_train=N_TRAIN,
                                num_validation=N_VAL, image_size=(SIDE, SIDE),
                                num_shards=NUM_FILES)
  return path


@pytest.fixture(scope="module")
def source(data_dir):
  return streaming.open_source("imagenet2012", "train", data_dir)


def _record_id(example):
  name = example["file_name"]
  return int((name.decode() if isinstance(name, bytes) else name)[1:9])


def augment(example, rng):
  """A 24x24 crop at a random offset in [0, 8]^2, a random left-right flip,
  plus the record id."""
  dy, dx = rng.integers(0, 9, size=2)
  image = example["image"][dy:dy + 24, dx:dx + 24]
  if rng.random() < 0.5:
    image = image[:, ::-1]
  return {"image": np.ascontiguousarray(image),
          "label": np.int32(example["label"]),
          "id": np.int32(_record_id(example))}


def ids_only(example, rng):
  del rng
  return {"id": np.int32(_record_id(example))}


def _take(iterator, n):
  return [next(iterator) for _ in range(n)]


def _close(*iterators):
  """Stops worker processes now rather than at interpreter exit."""
  for it in iterators:
    streaming.close(it)
  gc.collect()


def _assert_same_batches(got, want):
  assert len(got) == len(want)
  for g, w in zip(got, want):
    assert g.keys() == w.keys()
    for key in w:
      np.testing.assert_array_equal(g[key], w[key])
      assert g[key].dtype == w[key].dtype


def _ids(source, process_index, process_count, batch_size, seed, batches):
  """Record ids of the first `batches` batches of one process."""
  loader = streaming.train_loader(
      source, batch_size=batch_size, seed=seed, preprocess=ids_only,
      process_index=process_index, process_count=process_count)
  return np.concatenate([b["id"] for b in _take(iter(loader), batches)])


# --------------------------------------------------------------------------


def test_mock_dataset_spans_several_files(data_dir, source):
  files = glob.glob(os.path.join(data_dir, "imagenet2012", "5.1.0",
                                 "imagenet2012-train.array_record-*"))
  assert len(files) == NUM_FILES
  assert len(source) == N_TRAIN
  ids = sorted(_record_id(source[k]) for k in range(N_TRAIN))
  assert ids == list(range(N_TRAIN))
  assert source.dataset_info.features["label"].num_classes == 1000
  assert "tensorflow" not in sys.modules


def test_batches_stream_end_to_end(data_dir, source):
  loader = streaming.train_loader(source, batch_size=16, seed=0,
                                  process_index=0, process_count=1)
  batches = _take(iter(loader), 19)  # 304 records: one epoch and a bit.
  for b in batches:
    assert set(b) == {"image", "label"}
    assert b["image"].shape == (16, SIDE, SIDE, 3)
    assert b["image"].dtype == np.uint8 and b["label"].dtype == np.int32
  labels = np.concatenate([b["label"] for b in batches])
  images = np.concatenate([b["image"] for b in batches])
  # Epoch 0 holds every record once: labels are a permutation of the split's.
  want = sorted(int(source[k]["label"]) for k in range(N_TRAIN))
  assert sorted(labels[:N_TRAIN].tolist()) == want
  # Each row is the record its (unique) label names, read directly.
  position = {_record_id(source[k]): k for k in range(N_TRAIN)}
  for label, image in zip(labels[:40], images[:40]):
    record = source[position[int(_label_to_id(label))]]
    assert int(record["label"]) == int(label)
    np.testing.assert_array_equal(image, record["image"])
  # Undecoded source + the default PIL decode give the same batches.
  raw = streaming.open_source("imagenet2012", "train", data_dir,
                              decode_image=False)
  assert isinstance(raw[0]["image"], bytes)
  decoded = _take(iter(streaming.train_loader(
      raw, batch_size=16, seed=0, process_index=0, process_count=1)), 3)
  _assert_same_batches(decoded, batches[:3])
  assert "tensorflow" not in sys.modules


def _augmentations(batch, source):
  """`(dy, dx, flipped)` of each row, found by hand among all 24x24 crops of
  its record (flipped or not); fails if a row is none of them."""
  position = {_record_id(source[k]): k for k in range(N_TRAIN)}
  found = []
  for image, label, rid in zip(batch["image"], batch["label"], batch["id"]):
    full = source[position[int(rid)]]["image"]
    assert int(_label_to_id(label)) == int(rid)
    match = [(y, x, flip) for y in range(9) for x in range(9)
             for flip in (False, True)
             if np.array_equal(image, (full[y:y + 24, x:x + 24, :][:, ::-1]
                                       if flip else full[y:y + 24, x:x + 24]))]
    assert match, f"row of record {rid} is no crop of it"
    found.append(match[0])
  return found


def test_kill_and_resume_is_bit_identical(source):
  kwargs = dict(batch_size=16, seed=7, preprocess=augment, process_index=0,
                process_count=1)
  full = _take(iter(streaming.train_loader(source, **kwargs)), 25)
  noise = _augmentations(full[0], source) + _augmentations(full[1], source)
  assert {flip for _, _, flip in noise} == {False, True}
  assert len({(y, x) for y, x, _ in noise}) > 10  # The noise really varies.
  killed = iter(streaming.train_loader(source, **kwargs))
  _take(killed, 17)
  state = streaming.get_state(killed)
  del killed
  parsed = json.loads(state.decode())
  assert parsed["version"] == 2 and parsed["worker_count"] == 0
  assert set(parsed) >= {"last_seen_indices", "sampler", "data_source"}
  resumed = streaming.restore(source, state, **kwargs)
  # Batch 18 straddles the end of epoch 0 (300 / 16 = 18.75).
  _assert_same_batches(_take(resumed, 8), full[17:25])
  # A state of another loader (seed, worker count) is refused.
  with pytest.raises(InputError) as e:
    streaming.restore(source, state, **dict(kwargs, seed=8))
  assert e.value.field == "state"
  with pytest.raises(InputError):
    streaming.restore(source, b"not json", **kwargs)


def test_worker_processes_give_the_same_batches_and_resume(source):
  # 2 epochs of 300 records in batches of 16: 37 batches, the last block of
  # two workers incomplete (37 = 18 x 2 + 1), the last 8 records dropped.
  kwargs = dict(batch_size=16, seed=3, preprocess=augment, process_index=0,
                process_count=1, num_epochs=2)
  want = list(iter(streaming.train_loader(source, **kwargs)))
  assert len(want) == 37
  workers = iter(streaming.train_loader(source, worker_count=2, **kwargs))
  got = list(workers)
  _close(workers)
  _assert_same_batches(got, want)
  killed = iter(streaming.train_loader(source, worker_count=2, **kwargs))
  _take(killed, 17)
  state = streaming.get_state(killed)
  _close(killed)
  assert json.loads(state.decode())["worker_count"] == 2
  resumed = streaming.restore(source, state, worker_count=2, **kwargs)
  rest = list(resumed)
  _close(resumed)
  _assert_same_batches(rest, want[17:])
  # Process 1 of 2, one epoch: 150 records in batches of 7 (global 14) give
  # 21 batches, again with an incomplete last block.
  kwargs = dict(kwargs, batch_size=14, process_index=1, process_count=2,
                num_epochs=1)
  want = list(iter(streaming.train_loader(source, **kwargs)))
  workers = iter(streaming.train_loader(source, worker_count=2, **kwargs))
  got = list(workers)
  _close(workers)
  assert len(want) == 21
  _assert_same_batches(got, want)


def test_two_processes_partition_every_epoch(source):
  # Global batch 20 = 2 x 10; each process owns 150 records = 15 batches.
  per_epoch = N_TRAIN // 2
  ids = [_ids(source, p, 2, 20, seed=0, batches=30) for p in (0, 1)]
  for epoch in range(2):
    parts = [i[epoch * per_epoch:(epoch + 1) * per_epoch] for i in ids]
    both = np.concatenate(parts)
    assert sorted(both.tolist()) == list(range(N_TRAIN))  # Once each.
    assert not set(parts[0].tolist()) & set(parts[1].tolist())
  for i in ids:
    assert not np.array_equal(i[:per_epoch], i[per_epoch:])  # New order.
    assert set(i[:per_epoch].tolist()) == set(i[per_epoch:].tolist())
  # Process p owns the stored records [150 p, 150 (p + 1)).
  for p in (0, 1):
    stored = {_record_id(source[k])
              for k in range(p * per_epoch, (p + 1) * per_epoch)}
    assert set(ids[p][:per_epoch].tolist()) == stored
  # 7 processes: 42 records each, the last 300 - 294 = 6 stored never read.
  seen = np.concatenate([_ids(source, p, 7, 14, seed=0, batches=21)
                         for p in range(7)])
  stored = {_record_id(source[k]) for k in range(294)}
  assert len(seen) == 294 and set(seen.tolist()) == stored


def test_epoch_order_is_deterministic_in_the_seed(source):
  a, b, c = (_ids(source, 0, 1, 20, seed=s, batches=30) for s in (0, 0, 1))
  np.testing.assert_array_equal(a, b)
  assert not np.array_equal(a[:N_TRAIN], c[:N_TRAIN])
  assert not np.array_equal(a[:N_TRAIN], a[N_TRAIN:])
  # Consecutive seeds are not shifted copies of one stream (grain seeds
  # epoch e with seed + e; the seed is hashed first).
  assert not np.array_equal(c[:N_TRAIN], a[N_TRAIN:])


class _CountingSource:
  """A source that counts its reads and marks which records were read."""

  def __init__(self, inner):
    self.inner, self.reads = inner, 0
    self.seen = np.zeros(len(inner), bool)

  def __len__(self):
    return len(self.inner)

  def __getitem__(self, index):
    self.reads += 1
    self.seen[index] = True
    return self.inner[index]

  def __repr__(self):
    return f"_CountingSource({self.inner!r})"


def test_host_memory_stays_flat_while_streaming(source):
  counting = _CountingSource(source)
  batch, read_ahead = 4, 4
  loader = streaming.train_loader(
      counting, batch_size=batch, seed=0, process_index=0, process_count=1,
      read_options=grain.ReadOptions(num_threads=1,
                                     prefetch_buffer_size=read_ahead))
  it = iter(loader)
  next(it)  # Warm up: imports, thread pools, file handles.
  per_epoch = N_TRAIN // batch
  lookahead = np.zeros(3 * per_epoch, int)
  held = np.zeros(3, int)
  gc.collect()
  tracemalloc.start()
  base = tracemalloc.get_traced_memory()[0]
  for k in range(3 * per_epoch):  # Three epochs.
    next(it)
    lookahead[k] = counting.reads - (k + 2) * batch
    if k % per_epoch == per_epoch - 1:
      gc.collect()
      held[k // per_epoch] = tracemalloc.get_traced_memory()[0] - base
  peak = tracemalloc.get_traced_memory()[1] - base
  tracemalloc.stop()
  split_bytes = N_TRAIN * SIDE * SIDE * 3  # The decoded split, 3.7 MB.
  # Python/numpy allocations (traced) never come near one split, and what
  # is held does not grow from epoch to epoch.
  assert peak < split_bytes / 8, (peak, split_bytes)
  assert held.max() - held.min() < split_bytes / 50, held
  # Records are read one at a time, a bounded distance ahead of use.
  assert lookahead.max() <= read_ahead + batch
  assert counting.seen.all()


def test_bad_inputs_name_their_field(data_dir, tmp_path, monkeypatch, source):
  def field_of(fn, *args, **kwargs):
    with pytest.raises(ConfigError) as e:
      fn(*args, **kwargs)
    return e.value
  for bad in (None, "", str(tmp_path / "missing")):
    assert field_of(streaming.open_source, "imagenet2012", "train",
                    bad).field == "data.data_dir"
  # A data_dir holding something else: the error lists what is there.
  other = tmp_path / "other"
  os.makedirs(other / "cifar10" / "3.0.2")
  (other / "cifar10" / "3.0.2" / "dataset_info.json").write_text("{}")
  e = field_of(streaming.open_source, "imagenet2012", "train", str(other))
  assert e.field == "data.data_dir" and "cifar10/3.0.2" in str(e)
  e = field_of(streaming.open_source, "cifar10", "train", data_dir)
  assert e.field == "data.data_dir" and "imagenet2012/5.1.0" in str(e)
  e = field_of(streaming.open_source, "no_such_dataset_xyz", "train",
               data_dir)
  assert e.field == "data.tfds_name" and "imagenet2012/5.1.0" in str(e)
  # An unknown split names the split field and lists the splits.
  e = field_of(streaming.open_source, "imagenet2012", "test", data_dir)
  assert e.field == "data.train_split"
  assert "'train'" in str(e) and "'validation'" in str(e)
  e = field_of(streaming.open_source, "imagenet2012", "train[:50%]+tset",
               data_dir, field_prefix="eval",
               split_field="eval.datasets.x.split")
  assert e.field == "eval.datasets.x.split"
  # Prepared as tfrecord only: say what streaming needs and how to get it.
  tfrecord_dir = tmp_path / "tfrecord"
  shutil.copytree(os.path.join(data_dir, "imagenet2012"),
                  tfrecord_dir / "imagenet2012")
  info_path = tfrecord_dir / "imagenet2012" / "5.1.0" / "dataset_info.json"
  info = json.loads(info_path.read_text())
  info["fileFormat"] = "tfrecord"
  info_path.write_text(json.dumps(info))
  monkeypatch.setitem(sys.modules, "tensorflow", None)  # Not installed.
  e = field_of(streaming.open_source, "imagenet2012", "train",
               str(tfrecord_dir))
  assert e.field == "data.data_dir"
  for words in ("tfrecord", "array_record",
                "tfds build imagenet2012", "--file_format=array_record",
                "tensorflow"):
    assert words in str(e)
  # The global batch must divide over the processes.
  e = field_of(streaming.train_loader, source, batch_size=10, seed=0,
               process_index=0, process_count=4)
  assert e.field == "data.batch_size" and "4 processes" in str(e)
  assert field_of(streaming.train_loader, source, batch_size=10, seed=0,
                  process_index=0, process_count=3,
                  field="config.batch").field == "config.batch"
  assert field_of(streaming.train_loader, source, batch_size=8, seed=0,
                  process_index=2, process_count=2).field == "process_index"
  assert field_of(streaming.train_loader, source, batch_size=8, seed=0.5,
                  process_index=0, process_count=1).field == "seed"
