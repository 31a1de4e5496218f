"""`data.device_normalize`: uint8 batches, pp_train's trailing pixel map in
the train step. References: today's host path (the whole pp string in numpy,
float32), compared bit for bit; a hand-computed table; the train step fed
the host path's float32 batch (mixup on)."""

from __future__ import annotations

import jax
import ml_collections
import numpy as np
import pytest

from vmoe_ext.app.schema import validate_config
from vmoe_ext.data import pp
from vmoe_ext.data.device_normalize import (DeviceNormalize, PixelMap,
                                            apply_table, split_pixel_tail)
from vmoe_ext.data.stream_iterator import PreprocessSpec
from vmoe_ext.errors import ConfigError
from vmoe_ext.models import build_model
from vmoe_ext.train import steps
from vmoe_ext.train.config_files import load_config
from vmoe_ext.train.optimizer import make_optimizer
from vmoe_ext.train.state import TrainState

TAILS = (
    "value_range(-1, 1)",
    "value_range(0, 1)",
    "value_range(-2.5, 3, [10, 20, 30], [200, 210, 250], clip_values=True)",
    "value_range(0, 1)|value_range(-1, 1, 0, 1)",
)


def bits(x: np.ndarray) -> np.ndarray:
  """float32 as its bit patterns (so -0.0 != 0.0 and NaN == NaN)."""
  return np.asarray(x, np.float32).view(np.uint32)


@pytest.mark.parametrize("tail", TAILS + ("",))
def test_uint8_then_device_table_is_bit_identical_to_the_host_path(tail):
  """Random ops (crop, flip, randaug) on the host with the same draws, the
  tail on the device: the float32 images equal today's, bit for bit."""
  head = "inception_crop(12)|flip_lr|randaug(2, 10)"
  spec = f"{head}|{tail}" if tail else head
  rng = np.random.default_rng(0)
  records = [{"image": rng.integers(0, 256, (20, 17, 3), np.uint8),
              "label": i} for i in range(4)]
  host = PreprocessSpec(spec)
  device = PreprocessSpec(spec, device_normalize=True)
  want = np.stack([host(r, np.random.default_rng(i))["image"]
                   for i, r in enumerate(records)])
  got = np.stack([device(r, np.random.default_rng(i))["image"]
                  for i, r in enumerate(records)])
  assert want.dtype == np.float32 and want.shape == (4, 12, 12, 3)
  assert got.dtype == np.uint8 and got.shape == (4, 12, 12, 3)
  assert device.split[0].spec == pp.parse(head).spec
  normalize = DeviceNormalize(device.split[1], channels=3)
  out = jax.jit(normalize)(got)
  assert out.dtype == np.float32
  np.testing.assert_array_equal(bits(out), bits(want))


def test_table_by_hand():
  """value_range(-1, 1): v -> -1 + (v / 255) * 2 in float32; per-channel
  in_min/in_max and clipping as the formula says."""
  (_, tail) = split_pixel_tail(pp.parse("flip_lr|value_range(-1, 1)"))
  v = np.arange(256, dtype=np.float32)
  table = tail.table(3)
  want = np.float32(-1) + (v / np.float32(255)) * np.float32(2)
  np.testing.assert_array_equal(bits(table), bits(np.stack([want] * 3, 1)))
  (_, tail) = split_pixel_tail(pp.parse(
      "flip_lr|value_range(0, 1, [0, 100], [255, 200], clip_values=True)"))
  table = tail.table(2)
  col1 = np.clip((v - np.float32(100)) / np.float32(100), 0, 1)
  np.testing.assert_array_equal(bits(table[:, 1]), bits(col1))
  images = np.array([[[[0, 150], [255, 99]]]], np.uint8)  # [1, 1, 2, 2]
  out = np.asarray(apply_table(images, table))
  np.testing.assert_array_equal(out, [[[[0.0, 0.5], [1.0, 0.0]]]])


@pytest.mark.parametrize("spec", [
    "value_range(-1, 1)",                    # Nothing left for the host.
    "flip_lr|value_range(0, 1)|flip_lr",     # A geometric op after it.
    "value_range(0, 1)|flip_lr|value_range(-1, 1, 0, 1)",  # Float before.
])
def test_tails_that_are_not_a_trailing_pixel_map_keep_float32(spec):
  pipeline = pp.parse(spec)
  assert split_pixel_tail(pipeline) is None
  image = np.full((4, 4, 3), 7, np.uint8)
  out = PreprocessSpec(spec)({"image": image, "label": 0},
                             np.random.default_rng(0))["image"]
  assert out.dtype == np.float32  # The host path is unchanged.
  with pytest.raises(ConfigError) as e:
    PreprocessSpec(spec, device_normalize=True).split
  assert e.value.field == "data.device_normalize"


def stream_data(**fields) -> ml_collections.ConfigDict:
  config = load_config("tiny")
  config.data = ml_collections.ConfigDict({**dict(
      name="tfds", tfds_name="imagenet2012", data_dir="/nonexistent",
      train_split="train", test_split="validation", batch_size=8,
      eval_batch_size=8, image_size=32, streaming=True,
      pp_train="decode_jpeg_and_inception_crop(32)|flip_lr|"
               "value_range(-1, 1)", worker_count=0), **fields})
  config.model.update(dict(patch_size=(8, 8), num_classes=1000))
  config.model.moe.group_size = 34
  config.robustness = None
  return config


@pytest.mark.parametrize("fields", [
    dict(device_normalize="yes"),
    dict(device_normalize=True, pp_train="decode|value_range(0, 1)|flip_lr"),
    dict(device_normalize=True, pp_eval="decode|value_range(0, 1)|flip_lr"),
    dict(device_normalize=True, streaming=False, pp_train=None),
])
def test_bad_device_normalize_names_the_field(fields):
  config = stream_data(**fields)
  with pytest.raises(ConfigError) as e:
    validate_config(config)
  assert e.value.field == "data.device_normalize", e.value


def test_device_normalize_is_accepted_and_off_by_default():
  validate_config(stream_data(device_normalize=True))
  from vmoe_ext.data.config import DATA_TFDS
  assert DATA_TFDS["device_normalize"].default is False


@pytest.fixture(scope="module")
def tiny():
  """`(model, state, uint8 pixels [8, 8, 8, 1], labels, pixel map)`: the
  tiny config's model with one MoE block, its state at step 0."""
  config = load_config("tiny")
  config.model.num_layers = 1
  config.model.moe.every = 1
  model = build_model(config.model)
  rng = np.random.default_rng(0)
  pixels = rng.integers(0, 256, (8, 8, 8, 1), np.uint8)
  labels = rng.integers(0, 10, 8).astype(np.int32)
  (_, tail) = split_pixel_tail(pp.parse("flip_lr|value_range(-1, 1)"))
  variables = jax.jit(model.init)(jax.random.key(0), tail(pixels))
  state = TrainState.create(variables, make_optimizer(config.optimizer),
                            jax.random.key(1))
  return model, state, pixels, labels, tail


def test_train_step_with_mixup_on_uint8_equals_the_float32_batch(tiny):
  """The step's first op maps uint8 to pp's float32 before mixup: the new
  state and metrics equal those of the step fed the host path's batch."""
  model, state, pixels, labels, tail = tiny
  host_images = tail(pixels)
  mixup = dict(concentration=0.2, size=2, groups=2)
  want_step = jax.jit(steps.make_train_step(model, mixup=mixup))
  got_step = jax.jit(steps.make_train_step(
      model, mixup=mixup, input_map=DeviceNormalize(tail, 1)))
  want = want_step(state, {"image": host_images, "label": labels})
  got = got_step(state, {"image": pixels, "label": labels})
  for w, g in zip(jax.tree.leaves(jax.device_get(want)),
                  jax.tree.leaves(jax.device_get(got))):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_pixel_map_without_ops_is_the_float32_cast():
  tail = PixelMap(())
  np.testing.assert_array_equal(tail.table(1)[:, 0], np.arange(256))


def test_streamed_uint8_batches_map_to_the_float32_batches(tmp_path):
  """The real loader over a tiny fake ImageNet: uint8 [8, 32, 32, 3]
  batches whose device map is the float32 iterator's batches, bit for bit;
  `DataSource.train_input_map` is that map, None when off; the same for
  the streamed evaluation batches (padded) and `eval_input_map`."""
  pytest.importorskip("tensorflow_datasets")
  pytest.importorskip("grain.python")
  from fake_imagenet import PP_EVAL, build, stream_config
  from vmoe_ext.app.context import resolved
  from vmoe_ext.data.source import DataSource
  from vmoe_ext.data.stream_iterator import StreamingTrainIterator
  data_dir = build(str(tmp_path))
  fields = dict(pp_eval=PP_EVAL, eval_batch_size=6)  # 16 = 6 + 6 + 4.
  host = resolved(stream_config(data_dir, **fields)).data
  device = resolved(stream_config(data_dir, device_normalize=True,
                                  **fields)).data
  want_it = StreamingTrainIterator(host, 0)
  got_source = DataSource(device, 0)
  normalize = jax.jit(got_source.train_input_map())
  assert DataSource(host, 0).train_input_map() is None
  got_it = got_source.train_iterator()
  np.testing.assert_array_equal(got_source.sample_batch(),
                                want_it.sample_batch())
  for _ in range(2):
    want, got = next(want_it), next(got_it)
    assert got["image"].dtype == np.uint8
    assert got["image"].shape == want["image"].shape == (8, 32, 32, 3)
    np.testing.assert_array_equal(got["label"], want["label"])
    np.testing.assert_array_equal(bits(normalize(got["image"])),
                                  bits(want["image"]))
  assert DataSource(host, 0).eval_input_map() is None
  eval_map = jax.jit(got_source.eval_input_map())
  pairs = list(zip(DataSource(host, 0).eval_batches(),
                   got_source.eval_batches()))
  assert len(pairs) == 3 and not pairs[-1][1]["mask"][4:].any()
  for want, got in pairs:
    assert got["image"].dtype == np.uint8
    np.testing.assert_array_equal(got["mask"], want["mask"])
    real = got["mask"][:, None, None, None]
    mapped = np.where(real, eval_map(got["image"]), 0.0)
    np.testing.assert_array_equal(bits(mapped), bits(want["image"]))


def test_eval_step_on_padded_uint8_equals_the_float32_batch(tiny):
  """Padding rows are zeros in a float32 batch and must be after the map
  too (they count in the per-batch routing metrics)."""
  model, state, pixels, labels, tail = tiny
  mask = np.arange(8) < 5
  pixels = np.where(mask[:, None, None, None], pixels, 0).astype(np.uint8)
  host_images = np.where(mask[:, None, None, None], tail(pixels), 0.0)
  want = jax.jit(steps.make_eval_step(model))(
      state, {"image": host_images, "label": labels, "mask": mask})
  got = jax.jit(steps.make_eval_step(
      model, input_map=DeviceNormalize(tail, 1)))(
          state, {"image": pixels, "label": labels, "mask": mask})
  assert float(got["count"]) == 5
  for w, g in zip(jax.tree.leaves(jax.device_get(want)),
                  jax.tree.leaves(jax.device_get(got))):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
