"""The training binary's streaming input: `StreamingTrainIterator`.

With `data.name = "tfds"` and `data.streaming = True` the train split is
never loaded into memory: `StreamingTrainIterator` reads it record by record
through `vmoe_ext.data.streaming` (Grain over the TFDS array_record files in
`data.data_dir`) and preprocesses each record with the `data.pp_train`
string (`vmoe_ext.data.pp`), in `data.worker_count` worker processes (0: in
this process). It has `TrainIterator`'s protocol: `next(it)` is
`{"image": float32 [B/P, H, W, C], "label": int32 [B/P]}` (uint8 images
with `data.device_normalize`: pp_train's trailing `value_range` then runs
in the train step, `device_map`; see `vmoe_ext.data.device_normalize`),
`get_state()` a
JSON-able dict of every process's Grain state, gathered from all processes
and saved in the checkpoints' `extra["data"]`, and `set_state(state)`
resumes each process exactly there.

Scaling. The images leave `pp_train` already scaled (e.g.
`value_range(-1, 1)`); the trainer applies no `(x - mean) / std` to them.
The test split is still read in memory as [0, 1] images and normalised with
`default_normalization(config.data)`, which for a streaming config is the
affine map that makes it match `pp_train`'s scaling (`pp_normalization`:
mean = std = 0.5 for `value_range(-1, 1)`). Explicit `data.mean` / `data.std`
must equal it (checked with the config).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from vmoe_ext.errors import InputError, require

PP_FIELD = "data.pp_train"


def pp_normalization(pipeline) -> tuple[Any, Any]:
  """`(mean, std)` with `(x - mean) / std` of [0, 1] images == pp's scaling.

  The last `value_range(vmin, vmax, in_min, in_max)` of the parsed pipeline
  maps x255 = 255 x to vmin + (x255 - in_min) (vmax - vmin) / (in_max -
  in_min); that is `(x - mean) / std` with std = (in_max - in_min) /
  (255 (vmax - vmin)) and mean = in_min / 255 - vmin std (per channel when
  in_min / in_max are). Without a value_range the output is in [0, 255]:
  mean 0, std 1 / 255.
  """
  ops = [op for op in pipeline.ops if op.name == "value_range"]
  if not ops:
    return 0.0, 1.0 / 255.0
  op = ops[-1]
  names = ("vmin", "vmax", "in_min", "in_max")
  values = dict(zip(names, (0.0, 0.0, 0.0, 255.0)))
  values.update(zip(names, op.args))
  values.update(dict(op.kwargs))
  in_min = np.asarray(values["in_min"], np.float64)
  in_max = np.asarray(values["in_max"], np.float64)
  std = (in_max - in_min) / (255.0 * (float(values["vmax"])
                                      - float(values["vmin"])))
  mean = in_min / 255.0 - float(values["vmin"]) * std
  as_stat = lambda a: float(a) if a.ndim == 0 else tuple(float(v) for v in a)
  return as_stat(mean), as_stat(std)


def check_streaming_config(data: Mapping[str, Any]) -> None:
  """Cross-field checks of a streaming data section (fields relative to it).

  Called by the config schema inside `field_scope("data")`: `pp_train` must
  be given and parse; augmentation lives in it; `image_size` is required
  (the test split is resized or preprocessed to it); explicit `mean` /
  `std` must match `pp_train`'s scaling; `pp_eval`, when given, must parse,
  be deterministic and scale images as `pp_train` does.
  """
  from vmoe_ext.data import pp  # pylint: disable=g-import-not-at-top
  spec = data.get("pp_train")
  require(spec is not None, "pp_train",
          "required with data.streaming=True: the per-example training "
          "preprocessing, e.g. 'decode_jpeg_and_inception_crop(224)|flip_lr|"
          "value_range(-1, 1)'")
  pipeline = pp.parse(spec, "pp_train")
  require(not data.get("augment"), "augment",
          "must be False with data.streaming=True: augmentation is part of "
          "data.pp_train (e.g. inception_crop, flip_lr, randaug)")
  require(data.get("image_size") is not None, "image_size",
          "required with data.streaming=True: the side of pp_train's output "
          "images, to which the in-memory test split is resized")
  from vmoe_ext.data.device_normalize import check_device_normalize  # pylint: disable=g-import-not-at-top
  check_device_normalize(data)
  want_mean, want_std = pp_normalization(pipeline)
  if data.get("pp_eval") is not None:
    evaluation = pp.parse(data["pp_eval"], "pp_eval")
    require(not evaluation.random_ops, "pp_eval",
            f"has random ops {list(evaluation.random_ops)}; evaluation "
            "preprocessing must be deterministic, e.g. 'decode|"
            "resize_small(256)|central_crop(224)|value_range(-1, 1)'")
    got = pp_normalization(evaluation)
    same = all(np.allclose(np.asarray(a, np.float64), np.asarray(b, np.float64))
               for a, b in zip(got, (want_mean, want_std)))
    require(same, "pp_eval",
            f"scales images as (x - mean) / std with (mean, std) = {got} "
            f"for [0, 1] images; data.pp_train scales them with "
            f"{(want_mean, want_std)}: give both the same final value_range")
  for key, want in (("mean", want_mean), ("std", want_std)):
    got = data.get(key)
    if got is None:
      continue
    ok = np.allclose(np.asarray(got, np.float64),
                     np.asarray(want, np.float64), rtol=1e-5, atol=1e-7)
    require(ok, key,
            f"{got!r} does not match data.pp_train's output scaling, which "
            f"needs {key}={want!r} for the test split (leave it None to get "
            "that; streamed train images are not normalised again)")


class PreprocessSpec:
  """A preprocessing string applied to one record; picklable (the string is
  parsed lazily, in each worker: parsed pipelines hold closures).

  `field` is the config field named in parse errors (`data.pp_train`,
  `data.pp_eval`)."""

  def __init__(self, spec: str, image_key: str = "image",
               label_key: str = "label", field: str = PP_FIELD,
               device_normalize: bool = False):
    self.spec, self.image_key, self.label_key = spec, image_key, label_key
    self.field, self.device_normalize = field, device_normalize
    self._pipeline = self._split = None

  def __getstate__(self) -> dict[str, Any]:
    return {**self.__dict__, "_pipeline": None, "_split": None}

  @property
  def pipeline(self):
    """The whole parsed string (the host path's ops)."""
    if self._pipeline is None:
      from vmoe_ext.data import pp  # pylint: disable=g-import-not-at-top
      self._pipeline = pp.parse(self.spec, self.field)
    return self._pipeline

  @property
  def split(self):
    """With `device_normalize`: `(host pipeline, device PixelMap)`
    (`device_normalize.split_pixel_tail`); else None."""
    if self.device_normalize and self._split is None:
      from vmoe_ext.data import device_normalize  # pylint: disable=g-import-not-at-top
      self._split = device_normalize.split_pixel_tail(self.pipeline)
      require(self._split is not None, "data.device_normalize",
              f"{self.field} {self.spec!r} has no trailing per-pixel map "
              "the device can apply")
    return self._split

  @property
  def decodes(self) -> bool:
    """Whether the pipeline decodes the encoded image itself (the source
    then hands it the bytes)."""
    return self.pipeline.names[0] in ("decode",
                                      "decode_jpeg_and_inception_crop")

  def __call__(self, example: Mapping[str, Any],
               rng: np.random.Generator | None = None
               ) -> dict[str, np.ndarray]:
    """`{"image": [H, W, C], "label": int32}`: float32 pp output, or with
    `device_normalize` the uint8 output of the host part (same draws)."""
    if self.split is None:
      image = np.asarray(self.pipeline(example[self.image_key], rng),
                         np.float32)
    else:
      from vmoe_ext.data.device_normalize import check_host_output  # pylint: disable=g-import-not-at-top
      host = self.split[0]
      image = check_host_output(np.asarray(host(example[self.image_key],
                                                rng)), host.spec)
    return {"image": image, "label": np.int32(example[self.label_key])}


def num_classes(data: Mapping[str, Any]) -> int:
  """The class count of `data.tfds_name` (its TFDS info), checking that
  `data.image_key` / `data.label_key` name its features."""
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  image_key = data.get("image_key") or "image"
  label_key = data.get("label_key") or "label"
  features = tfds.builder(data["tfds_name"], data_dir=data["data_dir"],
                          try_gcs=False).info.features
  require(image_key in features, "data.image_key",
          f"no feature {image_key!r}; features: {list(features)}")
  require(label_key in features
          and hasattr(features[label_key], "num_classes"),
          "data.label_key", f"no class-label feature {label_key!r}; "
          f"features: {list(features)}")
  return int(features[label_key].num_classes)


def check_image_side(image: np.ndarray, side: int, field: str) -> None:
  """A preprocessed image must be `[side, side, C]` (`data.image_size`)."""
  require(image.ndim == 3 and image.shape[:2] == (side, side), field,
          f"gives images of shape {image.shape}; the model and the test "
          f"split expect [{side}, {side}, C] (data.image_size={side})")


class StreamingTrainIterator:
  """Endless training batches streamed from a TFDS split (module doc)."""

  def __init__(self, data: Mapping[str, Any], seed: int, *,
               process_index: int | None = None,
               process_count: int | None = None):
    """Opens `data.train_split` of `data.tfds_name` in `data.data_dir`.

    Args:
      data: a validated streaming data section (`batch_size` is the global
        batch B; each process yields B / P rows).
      seed: fixes every epoch's order and all preprocessing noise.
      process_index: p, default `jax.process_index()`.
      process_count: P, default `jax.process_count()`.

    Raises:
      ConfigError naming `data.tfds_name`, `data.data_dir`,
      `data.train_split`, `data.image_key` / `data.label_key` or
      `data.batch_size`.
    """
    from vmoe_ext.data import streaming  # pylint: disable=g-import-not-at-top
    self._streaming = streaming
    self._preprocess = PreprocessSpec(
        data["pp_train"], data.get("image_key") or "image",
        data.get("label_key") or "label",
        device_normalize=bool(data.get("device_normalize")))
    self._source = streaming.open_source(
        data["tfds_name"], data.get("train_split") or "train",
        data.get("data_dir"), decode_image=not self._preprocess.decodes)
    self.num_classes = num_classes(data)
    self._kwargs = dict(batch_size=data["batch_size"], seed=seed,
                        preprocess=self._preprocess,
                        process_index=process_index,
                        process_count=process_count,
                        worker_count=data.get("worker_count") or 0)
    self._iter = iter(streaming.train_loader(self._source, **self._kwargs))
    self._image_size = data.get("image_size")

  @property
  def num_examples(self) -> int:
    """Records in the train split (all processes together)."""
    return len(self._source)

  def sample_batch(self) -> np.ndarray:
    """A [B/P, H, W, C] float32 batch of record 0's preprocessed image as
    the model sees it (for shapes and `model.init`; with device_normalize
    the pixel map applied on the host), checked against `data.image_size`."""
    image = self._preprocess(self._source[0], np.random.default_rng(0))[
        "image"]
    if self._preprocess.split is not None:
      image = self._preprocess.split[1](image)
    check_image_side(image, self._image_size, PP_FIELD)
    rows = self._kwargs["batch_size"] // self._process()[1]
    return np.broadcast_to(image, (rows,) + image.shape).copy()

  def __iter__(self) -> StreamingTrainIterator:
    return self

  def device_map(self, channels: int):
    """With `data.device_normalize`: the train step's first op
    (`device_normalize.DeviceNormalize`: uint8 batches -> the float32
    images of the host path); else None (batches are float32 already)."""
    if self._preprocess.split is None:
      return None
    from vmoe_ext.data.device_normalize import DeviceNormalize  # pylint: disable=g-import-not-at-top
    return DeviceNormalize(self._preprocess.split[1], channels)

  def __next__(self) -> dict[str, np.ndarray]:
    """`{"image": [B/P, H, W, C], "label": int32 [B/P]}`: float32 images,
    or uint8 with `data.device_normalize` (never copied to another dtype)."""
    batch = next(self._iter)
    dtype = np.uint8 if self._preprocess.split is not None else np.float32
    return {"image": np.asarray(batch["image"], dtype),
            "label": np.asarray(batch["label"], np.int32)}

  def get_state(self) -> dict[str, Any]:
    """Every process's position after the last batch (JSON-able):
    `{"process_count": P, "states": {"p": Grain's JSON state of process p}}`.

    In a multi-process run (`jax.process_count() > 1`) each process's state
    is gathered from all processes (a collective: every process must call
    this at the same step), so the one copy that process 0 writes into the
    checkpoint resumes them all; with simulated processes (an explicit
    `process_count` in a single jax process) only this process's entry is
    there.
    """
    local = bytes(self._streaming.get_state(self._iter)).decode()
    index, count = self._process()
    states = {str(index): local}
    import jax  # pylint: disable=g-import-not-at-top
    if count > 1 and jax.process_count() == count:
      states = {str(p): s for p, s in enumerate(_allgather_text(local))}
    return {"process_count": count, "states": states}

  def set_state(self, state: Any) -> None:
    """Resumes at a state returned by `get_state` (same config and P); a
    bare Grain state (str, written before per-process states) is read as
    the state of a single process."""
    index, count = self._process()
    if isinstance(state, str):
      state = {"process_count": 1, "states": {"0": state}}
    if not (isinstance(state, Mapping) and "states" in state):
      raise InputError("state", "a streaming run resumes from Grain's state "
                       f"(per process); the checkpoint holds {state!r} "
                       "(written by a run with data.streaming=False?)")
    saved = state.get("process_count")
    if saved != count or str(index) not in state["states"]:
      raise InputError("state", f"the checkpoint's data position was saved "
                       f"by {saved} process(es) (entries "
                       f"{sorted(state['states'])}); this run has {count}, "
                       f"this is process {index}: resume with the same "
                       "number of processes")
    self.close()
    self._iter = self._streaming.restore(
        self._source, str(state["states"][str(index)]).encode(),
        **self._kwargs)

  def _process(self) -> tuple[int, int]:
    """`(p, P)` of this iterator."""
    return self._streaming.process_position(self._kwargs["process_index"],
                                            self._kwargs["process_count"])

  def close(self) -> None:
    """Stops the worker processes, if any."""
    self._streaming.close(self._iter)


def _allgather_text(text: str) -> list[str]:
  """`text` of every jax process, in process order (a collective)."""
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  data = np.frombuffer(text.encode(), np.uint8)
  lengths = np.asarray(multihost_utils.process_allgather(
      np.asarray([data.size], np.int32))).reshape(-1)
  padded = np.zeros(int(lengths.max()), np.uint8)
  padded[:data.size] = data
  rows = np.asarray(multihost_utils.process_allgather(padded)).reshape(
      len(lengths), -1)
  return [bytes(row[:n]).decode() for row, n in zip(rows, lengths)]


__all__ = ["PreprocessSpec", "StreamingTrainIterator", "check_image_side",
           "check_streaming_config", "num_classes", "pp_normalization"]
