"""Streaming training input: Grain over a TFDS dataset prepared as array_record.

For training sets that do not fit in memory (ImageNet-1k and up), where
`tfds_adapter.load_tfds_split` would read a whole split. Records are read one
by one from `data_dir` with TFDS's random-access data source (no TensorFlow),
shuffled, sharded per process, preprocessed and batched by a `grain.python`
`DataLoader`:

    source = open_source("imagenet2012", "train", data_dir)
    loader = train_loader(source, batch_size=4096, seed=0, preprocess=pp,
                          worker_count=16)
    it = iter(loader)                       # batches {"image", "label"}, ...
    state = get_state(it)                   # JSON bytes, after k batches
    it = restore(source, state, batch_size=4096, seed=0, preprocess=pp,
                 worker_count=16)           # yields batch k + 1, k + 2, ...

Order. Process p of P owns the records `[p n, (p + 1) n)` of the split, with
n = N // P (grain `ShardOptions(drop_remainder=True)`: the last N mod P
records are never read). Each epoch visits the process's records in a fresh
order drawn from the global seed and the epoch number; epochs follow each
other without a gap (a batch may span two), forever or for `num_epochs`.
Each process yields batches of B / P consecutive records of its own order, so
the P per-process batches of one step together hold B distinct records.

Randomness. `preprocess(example, rng)` gets a `np.random.Generator` that
grain derives from the seed and the record's position in the stream alone,
so the output is a function of (seed, P, p, B / P) and the position, and not
of `worker_count`, of prefetching, or of an interruption. The user's seed is
hashed to grain's 32-bit seed: grain shuffles epoch e with seed + e and
seeds the record at position i with seed + i, so consecutive raw seeds would
give shifted copies of one stream.

Workers. `worker_count` > 0 reads, decodes and preprocesses in that many
spawned processes, each prefetching `worker_buffer_size` batches. grain's
`DataLoader` gives worker w the positions j = w (mod W) and batches inside
each worker, which makes a batch's records depend on W; `_WorkerBlockSampler`
renumbers the positions so that the W workers emit exactly the batches of
the single-process loader (tested). Spawned workers re-import the calling
module (scripts need an `if __name__ == "__main__":` guard), and `preprocess`
must pickle (a module-level function or object).

State. `get_state(iterator)` is grain's `DataLoaderIterator.get_state()`:
UTF-8 JSON bytes `{"version": 2, "last_seen_indices": {"<worker>": i},
"last_worker_index": w, "worker_count": W, "sampler": repr,
"data_source": repr}`, the position of the last record delivered by each
worker (a few hundred bytes, independent of the dataset size). Save it with
the train state of the same step, one per process (they differ by
process_index), e.g. as a uint8 array `np.frombuffer(state, np.uint8)`. A
state only restores a loader built with the same source, seed, process
index/count, worker_count and num_epochs (grain checks the sampler and
source reprs and the worker count).

Memory. Nothing holds the split: each process (or worker) keeps at most
`read_options.prefetch_buffer_size` records read ahead (grain default 500)
and `worker_buffer_size` batches per worker.
"""

from __future__ import annotations

import io
import json
import os
import sys
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import PIL.Image

from vmoe_ext.data.tfds_adapter import _split_names, check_data_dir
from vmoe_ext.errors import ConfigError, InputError, require

try:  # Optional (like TFDS): only `train_loader` needs it.
  import grain.python as grain
except ImportError:  # pragma: no cover - depends on the environment.
  grain = None

Example = dict[str, Any]
Preprocess = Callable[[Example, np.random.Generator], Example]

_RANDOM_ACCESS_FORMATS = ("array_record", "parquet")


# --------------------------------------------------------------------------
# The source.


def _prepared_datasets(data_dir: str) -> list[str]:
  """`name[/config]/version` of every prepared TFDS dataset under data_dir."""
  found = []
  for root, dirs, files in os.walk(data_dir):
    depth = os.path.relpath(root, data_dir).count(os.sep)
    if "dataset_info.json" in files:
      found.append(os.path.relpath(root, data_dir))
      dirs[:] = []
    elif depth >= 2:  # name/config/version is the deepest layout.
      dirs[:] = []
    else:
      dirs[:] = [d for d in dirs if d not in ("downloads", "extracted")]
  return sorted(found)


def open_source(tfds_name: str, split: str, data_dir: Any,
                field_prefix: str = "data", *, split_field: str | None = None,
                decode_image: bool = True):
  """Random access (`len`, `[i]`) to `split` of a TFDS dataset in data_dir.

  Args:
    tfds_name: e.g. "imagenet2012" or "name/config"; read from `data_dir`
      (registered builder or not), never downloaded.
    split: a TFDS split expression, e.g. "train" or "train[:99%]".
    data_dir: the directory holding `tfds_name/<version>/` prepared in the
      array_record (or parquet) file format.
    field_prefix: config section named in errors ("data").
    split_field: field named in split errors (`{field_prefix}.train_split`).
    decode_image: False leaves the "image" feature as encoded bytes, for
      preprocessing that decodes itself (e.g. a fused decode-and-crop).

  Returns:
    TFDS's `ArrayRecordDataSource`: `source[i]` is the i-th example as a dict
    of numpy values (image uint8 [H, W, C] or bytes, label int, ...).

  Raises:
    ConfigError naming `{prefix}.tfds_name`, `{prefix}.data_dir` (missing,
    without the dataset, or holding it only as tfrecord) or the split field.
  """
  prefix = field_prefix
  name_field, dir_field = f"{prefix}.tfds_name", f"{prefix}.data_dir"
  split_field = split_field or f"{prefix}.train_split"
  require(isinstance(tfds_name, str) and tfds_name, name_field,
          f"required: a TFDS dataset name, e.g. 'imagenet2012', got "
          f"{tfds_name!r}")
  data_dir = check_data_dir(data_dir, dir_field)
  require(isinstance(split, str) and split, split_field,
          f"must be a TFDS split name, got {split!r}")
  try:
    import tensorflow_datasets as tfds  # Heavy optional import.
  except ImportError as e:
    raise ConfigError(name_field, "TFDS datasets need the tensorflow-datasets"
                      " package: pip install 'vmoe_ext[tfds]'") from e

  def listing() -> str:
    there = _prepared_datasets(data_dir)
    return f"prepared there: {there}" if there else "nothing is prepared there"

  try:
    builder = tfds.builder(tfds_name, data_dir=data_dir, try_gcs=False)
  except tfds.core.DatasetNotFoundError as e:
    raise ConfigError(name_field, f"no dataset {tfds_name!r} in TFDS or under "
                      f"{data_dir!r} ({listing()})") from e
  except ValueError as e:  # e.g. an unknown builder config "name/config".
    raise ConfigError(name_field, f"{tfds_name!r}: {e}") from e
  if not builder.is_prepared():
    raise ConfigError(dir_field, f"no prepared copy of {tfds_name} under "
                      f"{data_dir!r} (expected {builder.data_dir}; nothing "
                      f"is downloaded); {listing()}")
  known = list(builder.info.splits)
  for base in _split_names(split):
    require(base in known, split_field,
            f"{tfds_name} has no split {base!r}; splits: {known}")
  formats = sorted(f.value for f in builder.info.available_file_formats())
  require(set(formats) & set(_RANDOM_ACCESS_FORMATS), dir_field,
          f"{tfds_name} is prepared under {data_dir!r} only as {formats}; "
          "streaming reads records at random and needs the array_record "
          "format. Prepare it again with `tfds build "
          f"{tfds_name} --data_dir={data_dir} --file_format=array_record`, "
          "or convert this copy with `tfds convert_format "
          f"--dataset_version_dir={builder.data_dir} "
          "--out_file_format=array_record` (reading tfrecord needs "
          "TensorFlow once), or install TensorFlow (pip install "
          "tensorflow-cpu) to read tfrecord through tf.data")
  decoders = None if decode_image else {"image": tfds.decode.SkipDecoding()}
  return tfds.data_source(tfds_name, split=split, data_dir=data_dir,
                          download=False, try_gcs=False, decoders=decoders)


# --------------------------------------------------------------------------
# Preprocessing.


def decode_example(example: Mapping[str, Any], rng: np.random.Generator
                   ) -> Example:
  """Default preprocessing: `{"image": uint8 [H, W, C], "label": int32}`.

  Encoded image bytes are decoded with PIL (RGB for colour images, one channel
  for greyscale); arrays pass through. `rng` is unused.
  """
  del rng
  image = example["image"]
  if isinstance(image, (bytes, np.bytes_)):
    with PIL.Image.open(io.BytesIO(image)) as pil:
      if pil.mode not in ("L", "RGB"):
        pil = pil.convert("RGB")
      image = np.asarray(pil)
  image = np.asarray(image)
  if image.ndim == 2:
    image = image[..., None]
  return {"image": image, "label": np.int32(example["label"])}


if grain is not None:

  class _Preprocess(grain.RandomMapTransform):
    """`preprocess(example, rng)` as a grain transform (pickled to workers)."""

    def __init__(self, fn: Preprocess):
      self.fn = fn

    def random_map(self, element: Example, rng: np.random.Generator
                   ) -> Example:
      return self.fn(element, rng)


# --------------------------------------------------------------------------
# Worker-count-independent batches.


class _WorkerBlockSampler:
  """A sampler whose W-worker `DataLoader` batches equal the 1-worker ones.

  grain hands worker w the local positions j = w + W t (t = 0, 1, ...),
  batches B consecutive ones inside the worker and interleaves the workers'
  batches round robin (`process_prefetch.multiprocess_prefetch`:
  `slice(i, None, num_workers)` + `InterleaveIterDataset(cycle_length=W)`).
  Serving at j the record that `inner` has at local position
  L(j) = (k W + w) B + r, with (k, r) = divmod(t, B), makes the n-th emitted
  batch hold positions [n B, (n + 1) B), rng included, as with W = 0.

  A finite stream of nb = F W + m full batches ends with a partial block:
  its length is cut to m + W (B - 1) positions, so that workers 0..m-1 get
  exactly B (their batch) and the others fewer than B (dropped, their
  placeholder reads of position F W B are discarded).
  """

  def __init__(self, inner: grain.IndexSampler, shard_count: int,
               workers: int, batch: int):
    self._inner, self._p = inner, shard_count
    self._w, self._b = workers, batch
    local = len(inner) // shard_count
    if len(inner) >= sys.maxsize:  # Infinite stream: blocks only.
      self._full, self._m, self._len = local, 0, len(inner)
    else:
      f, self._m = divmod(local // batch, workers)
      self._full = f * workers * batch
      tail = self._m + workers * (batch - 1) if self._m else 0
      self._len = (self._full + tail) * shard_count

  def __len__(self) -> int:
    return self._len

  def __repr__(self) -> str:
    return (f"_WorkerBlockSampler({self._inner!r}, workers={self._w}, "
            f"batch={self._b})")

  def _position(self, j: int) -> int:
    w, b = self._w, self._b
    if j < self._full:
      k, r = divmod(j // w, b)
      return (k * w + j % w) * b + r
    t, worker = divmod(j - self._full, w)
    return self._full + (worker * b + t if worker < self._m else 0)

  def __getitem__(self, index: int):
    if index < 0 or index >= self._len:
      raise IndexError(f"index {index} out of range [0, {self._len})")
    j, shard = divmod(index, self._p)
    return self._inner[self._position(j) * self._p + shard]


# --------------------------------------------------------------------------
# The loader and its state.


def _grain_seed(seed: Any) -> int:
  require(isinstance(seed, (int, np.integer)) and not isinstance(seed, bool),
          "seed", f"must be an integer, got {seed!r}")
  word = int(seed) % 2**64
  return int(np.random.SeedSequence(word).generate_state(1, np.uint32)[0])


def _check_count(value: Any, field: str, minimum: int) -> int:
  require(isinstance(value, (int, np.integer)) and not isinstance(value, bool)
          and value >= minimum, field,
          f"must be an integer >= {minimum}, got {value!r}")
  return int(value)


def process_position(process_index: int | None = None,
                     process_count: int | None = None) -> tuple[int, int]:
  """`(p, P)`: the given process index and count, each defaulting to jax's
  (`jax.process_index()`, `jax.process_count()`), checked (0 <= p < P)."""
  if process_index is None or process_count is None:
    import jax  # pylint: disable=g-import-not-at-top
    process_index = (jax.process_index() if process_index is None
                     else process_index)
    process_count = (jax.process_count() if process_count is None
                     else process_count)
  count = _check_count(process_count, "process_count", 1)
  index = _check_count(process_index, "process_index", 0)
  require(index < count, "process_index",
          f"must be < process_count = {count}, got {index}")
  return index, count


def train_loader(source, *, batch_size: int, seed: int,
                 preprocess: Preprocess | None = None,
                 process_index: int | None = None,
                 process_count: int | None = None, worker_count: int = 0,
                 worker_buffer_size: int = 2, num_epochs: int | None = None,
                 read_options: grain.ReadOptions | None = None,
                 field: str = "data.batch_size") -> grain.DataLoader:
  """A `grain.python.DataLoader` of this process's training batches.

  Iterating it yields dicts of numpy arrays, each leaf of `preprocess`'s
  output stacked over B / P records: by default `{"image": [B / P, H, W, C]
  uint8, "label": [B / P] int32}` (images must then share one shape). Order,
  randomness, workers, state and memory: module docstring.

  Args:
    source: a random-access source (`len`, `[i]`), e.g. `open_source(...)`.
    batch_size: B, the global batch over all processes.
    seed: any integer; fixes every epoch's order and all preprocessing noise.
    preprocess: `(example, rng) -> dict`; default `decode_example`.
    process_index: p, default `jax.process_index()`.
    process_count: P, default `jax.process_count()`.
    worker_count: W, processes that read and preprocess (0: this process).
    worker_buffer_size: batches each worker prefetches.
    num_epochs: None: an endless stream; else stop after the last full batch
      of that many epochs.
    read_options: grain's reader threads and read-ahead buffer (None: grain's
      defaults, 16 threads and 500 records).
    field: config field of `batch_size`, named in errors.
  """
  if grain is None:
    raise ImportError("streaming training input needs Grain: pip install "
                      "grain")
  n = len(source)
  index, count = process_position(process_index, process_count)
  batch_size = _check_count(batch_size, field, 1)
  require(batch_size % count == 0, field,
          f"the global batch {batch_size} must divide evenly over the "
          f"{count} processes (per-process batch {batch_size / count:g})")
  workers = _check_count(worker_count, "worker_count", 0)
  buffer = _check_count(worker_buffer_size, "worker_buffer_size", 1)
  if num_epochs is not None:
    num_epochs = _check_count(num_epochs, "num_epochs", 1)
  if n < count:
    raise InputError("source", f"{n} records cannot be shared by {count} "
                     "processes")
  shard = grain.ShardOptions(shard_index=index, shard_count=count,
                             drop_remainder=True)
  sampler = grain.IndexSampler(n, shard_options=shard, shuffle=True,
                               num_epochs=num_epochs, seed=_grain_seed(seed))
  local_batch = batch_size // count
  if workers > 1:
    sampler = _WorkerBlockSampler(sampler, count, workers, local_batch)
  if workers:
    # grain's workers read absl flags (profiling); outside an absl app mark
    # them parsed so that the defaults apply.
    from absl import flags  # pylint: disable=g-import-not-at-top
    if not flags.FLAGS.is_parsed():
      flags.FLAGS.mark_as_parsed()
  return grain.DataLoader(
      data_source=source, sampler=sampler, shard_options=shard,
      operations=[_Preprocess(preprocess or decode_example),
                  grain.Batch(local_batch, drop_remainder=True)],
      worker_count=workers, worker_buffer_size=buffer,
      read_options=read_options)


def get_state(iterator: grain.PyGrainDatasetIterator) -> bytes:
  """The position of `iterator(train_loader(...))`: JSON bytes (module doc)."""
  return iterator.get_state()


def close(iterator: Any) -> None:
  """Stops an iterator's worker processes now (grain stops them only when
  the iterator is garbage-collected); a no-op without workers."""
  inner = getattr(iterator, "_iterator", None)
  if inner is not None and hasattr(inner, "close"):
    inner.close()


def restore(source, state: bytes, **loader_kwargs: Any
            ) -> grain.PyGrainDatasetIterator:
  """An iterator of `train_loader(source, **loader_kwargs)` resumed at `state`.

  It yields exactly the batches that the iterator `state` was taken from
  would have yielded next. `loader_kwargs` must match those of that loader
  (grain checks the sampler, the source and the worker count).
  """
  iterator = iter(train_loader(source, **loader_kwargs))
  try:
    if not isinstance(json.loads(bytes(state).decode()), dict):
      raise TypeError("not a JSON object")
    iterator.set_state(bytes(state))
  except (ValueError, KeyError, TypeError) as e:
    raise InputError("state", f"cannot resume this loader from the saved "
                     f"data state: {e}") from e
  return iterator
