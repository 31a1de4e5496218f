"""The streamed test split: `StreamingEvalSplit` (`data.pp_eval`).

With `data.streaming=True` and `data.pp_eval` set, the test split (e.g.
ImageNet's 50,000 validation images) is never loaded whole either: it is
read record by record from the TFDS array_record files in `data.data_dir`
and preprocessed by the `data.pp_eval` string (e.g. `decode|
resize_small(256)|central_crop(224)|value_range(-1, 1)`, vmoe's), with
`data.worker_count` worker processes (0: reader threads of this process).

* `batches(B)`: every example of this process's share exactly once, in
  split order, as `{"image": float32 [B/P, S, S, C] (pp_eval's output, not
  normalised again; uint8 before pp_eval's trailing value_range with
  `data.device_normalize`, mapped by the evaluation step, `device_map`),
  "label": int32 [B/P], "mask": bool [B/P]}`. Process p
  of P owns the contiguous records `[p m, min((p + 1) m, N))`, m =
  ceil(N / P) (every record is evaluated, unlike training's drop-remainder
  shards); the last batch is padded with zero images, label 0 and mask
  False; every process yields the same number of batches, ceil(m / (B/P))
  (a shorter share ends with all-padding batches), so that a multi-process
  evaluation runs the same number of steps everywhere. The batches do not
  depend on the worker count.
* `analysis_dataset(n)`: `n` evenly spaced examples (`readers.
  evenly_spaced`), preprocessed by pp_eval, held in memory as an
  `ArrayDataset` of [0, 1] images for what needs the test images at hand
  (routing analysis, attacks, corruptions): pp_eval's output mapped back
  through the inverse of its value_range (`pp_normalization`), so that
  `(x - mean) / std` with `loader.default_normalization(data)` gives pp_eval's
  output again (to float32 round-off).
* `data.max_examples` limits the split to its first N records, as on the
  in-memory path.

Memory: at most `prefetch` preprocessed images (default 256) and the
batches in flight (`worker_count` x 1 per worker) are held, never the split.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from vmoe_ext.data.dataset import ArrayDataset
from vmoe_ext.data.readers import evenly_spaced
from vmoe_ext.data.stream_iterator import (PreprocessSpec, check_image_side,
                                           num_classes, pp_normalization)
from vmoe_ext.errors import require

PP_EVAL_FIELD = "data.pp_eval"


def streams_evaluation(data: Mapping[str, Any]) -> bool:
  """Whether a data section streams its test split (`data.pp_eval` set)."""
  return bool(data.get("name") == "tfds" and data.get("streaming")
              and data.get("pp_eval"))


def to_unit_range(image: np.ndarray, mean: Any, std: Any) -> np.ndarray:
  """pp output `x` back to [0, 1] images: `clip(x std + mean, 0, 1)`, the
  inverse of `(x - mean) / std` with `pp_normalization`'s statistics."""
  return np.clip(np.asarray(image, np.float32) * np.asarray(std, np.float32)
                 + np.asarray(mean, np.float32), 0.0, 1.0)


class EvalFit:
  """`data.pp_eval` applied to one decoded [0, 1] image `[H, W, C]`, its
  output mapped back to [0, 1] (`[S, S, C]`): how the evaluation datasets
  that are read image by image (ImageNet-A/R/O; `evaluate.datasets`) get
  the eval preprocessing. A leading `decode` is skipped (the readers
  decode); the [0, 1] pixels are rounded back to the uint8 values they were
  decoded from."""

  def __init__(self, spec: str):
    from vmoe_ext.data import pp  # pylint: disable=g-import-not-at-top
    pipeline = pp.parse(spec, PP_EVAL_FIELD)
    self.mean, self.std = pp_normalization(pipeline)
    ops = pipeline.ops[1:] if pipeline.names[0] == "decode" else pipeline.ops
    self.pipeline = pp.Pipeline(list(ops))

  def __call__(self, image: np.ndarray) -> np.ndarray:
    pixels = np.round(np.clip(image, 0.0, 1.0) * 255.0).astype(np.uint8)
    return to_unit_range(self.pipeline(pixels), self.mean, self.std)


class _PadBatch:
  """`[n <= b]` stacked examples -> `[b]` with `mask` (picklable)."""

  def __init__(self, rows: int):
    self.rows = rows

  def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    n = len(batch["label"])
    missing = self.rows - n
    image = batch["image"]
    label = batch["label"].astype(np.int32)
    if missing:
      image = np.concatenate(
          [image, np.zeros((missing,) + image.shape[1:], image.dtype)])
      label = np.concatenate([label, np.zeros(missing, np.int32)])
    mask = np.arange(self.rows) < n
    return {"image": image, "label": label, "mask": mask}


class StreamingEvalSplit:
  """A TFDS split streamed through `data.pp_eval` (module doc)."""

  def __init__(self, data: Mapping[str, Any], *,
               split: str | None = None, split_field: str = "data.test_split",
               process_index: int | None = None,
               process_count: int | None = None, prefetch: int = 256):
    """Opens `split` (default `data.test_split`) of `data.tfds_name`.

    Args:
      data: a validated streaming data section with `pp_eval`.
      split: the split to read (default `data.test_split`); the carve mode
        reads calibration images of the train split this way.
      split_field: the field named in split errors.
      process_index: p, default `jax.process_index()`.
      process_count: P, default `jax.process_count()`.
      prefetch: preprocessed images read ahead by the reader threads.

    Raises:
      ConfigError naming `data.tfds_name`, `data.data_dir`, the split
      field, `data.image_key` / `data.label_key`.
    """
    from vmoe_ext.data import streaming  # pylint: disable=g-import-not-at-top
    self._data = data
    self._preprocess = PreprocessSpec(data["pp_eval"],
                                      data.get("image_key") or "image",
                                      data.get("label_key") or "label",
                                      field=PP_EVAL_FIELD)
    # `batches` (the evaluation step's input): uint8 with
    # `data.device_normalize`; everything else reads the float32 output.
    self._batch_preprocess = PreprocessSpec(
        data["pp_eval"], data.get("image_key") or "image",
        data.get("label_key") or "label", field=PP_EVAL_FIELD,
        device_normalize=bool(data.get("device_normalize")))
    split = split or data.get("test_split") or "test"
    self._source = streaming.open_source(
        data["tfds_name"], split, data.get("data_dir"),
        split_field=split_field, decode_image=not self._preprocess.decodes)
    self.name = f"{data['tfds_name']}/{split}"
    self.num_classes = num_classes(data)
    limit = data.get("max_examples")
    self._len = len(self._source) if limit is None else min(
        len(self._source), int(limit))
    self._p, self._count = streaming.process_position(process_index,
                                                      process_count)
    self._prefetch = prefetch
    self._workers = int(data.get("worker_count") or 0)
    self.mean, self.std = pp_normalization(self._preprocess.pipeline)

  def __len__(self) -> int:
    """N, the examples evaluated (over all processes)."""
    return self._len

  def share(self) -> tuple[int, int]:
    """`[start, stop)` of the records this process evaluates."""
    m = -(-self._len // self._count)
    start = min(self._p * m, self._len)
    return start, min(start + m, self._len)

  def num_batches(self, batch_size: int) -> int:
    """Batches each process yields for a global batch `batch_size`."""
    m = -(-self._len // self._count)
    return -(-m // self._rows(batch_size))

  def _rows(self, batch_size: int) -> int:
    require(isinstance(batch_size, (int, np.integer)) and batch_size > 0
            and batch_size % self._count == 0, "data.eval_batch_size",
            f"the global evaluation batch {batch_size} must be a positive "
            f"multiple of the {self._count} processes")
    return int(batch_size) // self._count

  def check_image_size(self, side: int) -> None:
    """pp_eval's output (of record 0) must be `[side, side, C]`."""
    check_image_side(self._preprocess(self._source[0])["image"], side,
                     PP_EVAL_FIELD)

  def batches(self, batch_size: int) -> Iterator[dict[str, np.ndarray]]:
    """This process's padded, masked batches of B / P rows (module doc)."""
    import grain.python as grain  # pylint: disable=g-import-not-at-top
    rows = self._rows(batch_size)
    start, stop = self.share()
    total = self.num_batches(batch_size)
    return self._batches(grain, rows, start, stop, total)

  def _batches(self, grain, rows: int, start: int, stop: int, total: int
               ) -> Iterator[dict[str, np.ndarray]]:
    produced = 0
    if stop > start:
      # Records, not batches, go to the workers (record i to worker i mod
      # W, interleaved back in order), and batches are formed here: so the
      # batches do not depend on the worker count.
      dataset = (grain.MapDataset.source(self._source)
                 .slice(slice(start, stop)).map(self._batch_preprocess)
                 .to_iter_dataset(grain.ReadOptions(
                     num_threads=max(1, min(16, self._prefetch)),
                     prefetch_buffer_size=self._prefetch)))
      if self._workers:
        from absl import flags  # pylint: disable=g-import-not-at-top
        if not flags.FLAGS.is_parsed():
          flags.FLAGS.mark_as_parsed()
        dataset = dataset.mp_prefetch(grain.MultiprocessingOptions(
            num_workers=self._workers, per_worker_buffer_size=rows))
      dataset = dataset.batch(rows).map(_PadBatch(rows))
      for batch in dataset:
        produced += 1
        yield batch
    if produced < total:  # A shorter share: all-padding batches.
      image = self._batch_preprocess(self._source[0])["image"]
      padding = _PadBatch(rows)({"image": np.zeros((0,) + image.shape,
                                                   image.dtype),
                                 "label": np.zeros(0, np.int32)})
      for _ in range(total - produced):
        yield dict(padding)

  def device_map(self):
    """With `data.device_normalize`: the evaluation step's first op
    (`device_normalize.DeviceNormalize`, pp_eval's trailing pixel map, for
    the channels of record 0's image) for the uint8 `batches`; else None."""
    split = self._batch_preprocess.split
    if split is None:
      return None
    from vmoe_ext.data.device_normalize import DeviceNormalize  # pylint: disable=g-import-not-at-top
    channels = self._batch_preprocess(self._source[0])["image"].shape[-1]
    return DeviceNormalize(split[1], channels)

  def analysis_dataset(self, max_examples: int | None,
                       indices: np.ndarray | None = None) -> ArrayDataset:
    """`max_examples` evenly spaced examples (or the records `indices`) as
    [0, 1] images in memory (module doc); the same in every process."""
    if indices is None:
      indices = evenly_spaced(self._len, max_examples)
    images, labels = [], []
    for i in np.asarray(indices).reshape(-1):
      example = self._preprocess(self._source[int(i)])
      images.append(to_unit_range(example["image"], self.mean, self.std))
      labels.append(example["label"])
    return ArrayDataset(np.stack(images).astype(np.float32),
                        np.asarray(labels, np.int32), self.num_classes,
                        f"{self.name}[{len(labels)} of {self._len}]")


def open_test_split(data: Mapping[str, Any]) -> StreamingEvalSplit:
  """The streamed test split of a `data.pp_eval` config, checked before
  anything compiles: pp_eval's output side is `data.image_size`, and
  `data.eval_batch_size` divides over the processes."""
  split = StreamingEvalSplit(data)
  split.check_image_size(data["image_size"])
  split.num_batches(data["eval_batch_size"])
  return split


__all__ = ["EvalFit", "PP_EVAL_FIELD", "to_unit_range", "StreamingEvalSplit",
           "open_test_split", "streams_evaluation"]
