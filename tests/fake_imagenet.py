"""The tiny fake `imagenet2012` and the streaming config the streaming tests
share: 44 train and 16 validation 32x32 JPEGs in 2 array_record files per
split (`fake_tfds.build_fake_imagenet`), a tiny V-MoE (patch 8, 1000
classes) on batches of 8 streamed through `data.pp_train`."""

from __future__ import annotations

import ml_collections
import pytest

from resume_check import short_schedule
from vmoe_ext.data import fake_tfds
from vmoe_ext.train.config_files import load_config

N_TRAIN, N_VAL, SIDE = 44, 16, 32
PP = "decode_jpeg_and_inception_crop(32)|flip_lr|value_range(-1, 1)"
PP_EVAL = "decode|resize_small(36)|central_crop(32)|value_range(-1, 1)"


def build(path: str) -> str:
  """Writes the dataset under `path`; returns `path` (the data_dir)."""
  fake_tfds.build_fake_imagenet(path, num_train=N_TRAIN,
                                num_validation=N_VAL,
                                image_size=(SIDE, SIDE), num_shards=2)
  return path


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
  """A fresh copy of the dataset per test module (import it as a fixture)."""
  return build(str(tmp_path_factory.mktemp("tfds")))


def stream_config(data_dir: str, **data) -> ml_collections.ConfigDict:
  """The tiny streaming config (6 steps, a checkpoint every 2)."""
  config = load_config("tiny")
  config.data = ml_collections.ConfigDict({
      **dict(name="tfds", tfds_name="imagenet2012", data_dir=data_dir,
             train_split="train", test_split="validation", batch_size=8,
             eval_batch_size=8, image_size=SIDE, streaming=True, pp_train=PP,
             worker_count=0), **data})
  config.model.update(dict(patch_size=(8, 8), num_classes=1000))
  config.model.moe.group_size = 17 * 2  # 16 patches + class token.
  config.robustness = None
  config.optimizer.warmup_steps = 1
  return short_schedule(config, total_steps=6)
