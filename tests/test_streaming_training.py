"""The training binary on a streamed train split (`data.streaming`).

A real, tiny array_record `imagenet2012` (`tests/fake_imagenet.py`:
44 train and 16 validation 32x32 JPEGs) under a temporary data_dir; a tiny
V-MoE (patch 8, 1000 classes) trains on batches of 8 streamed through
`data.pp_train` (random crop + flip), so an epoch is 5.5 steps and batches
span epochs; the validation split is evaluated in memory.
"""

from __future__ import annotations

import json

import chex
import numpy as np
import pytest

pytest.importorskip("tensorflow_datasets")
pytest.importorskip("grain.python")

# data_dir: the module-scoped fake ImageNet fixture.
from fake_imagenet import (N_TRAIN, N_VAL, PP_EVAL, SIDE,  # noqa: E402,F401
                           data_dir, stream_config)
from resume_check import straight_vs_resumed  # noqa: E402
from vmoe_ext.data import loader, tfds_adapter  # noqa: E402
from vmoe_ext.data.stream_iterator import StreamingTrainIterator  # noqa: E402
from vmoe_ext.errors import ConfigError  # noqa: E402
from vmoe_ext.app import train as loop  # noqa: E402
from vmoe_ext.app.context import resolved  # noqa: E402
from vmoe_ext.data.source import DataSource  # noqa: E402
from vmoe_ext.app.schema import validate_config  # noqa: E402


def test_streams_end_to_end_without_loading_the_train_split(
    data_dir, tmp_path, monkeypatch):
  read_splits = []
  init = tfds_adapter.TfdsReader.__init__

  def reader(self, config, split, **kwargs):
    assert split != "train", "the train split must not be loaded in memory"
    read_splits.append(split)
    init(self, config, split, **kwargs)

  monkeypatch.setattr(tfds_adapter.TfdsReader, "__init__", reader)
  config = stream_config(data_dir)
  config.train.update(dict(total_steps=2, checkpoint_every=2))
  resolved_config = resolved(config)
  source = DataSource(resolved_config.data, resolved_config.seed)
  final = loop.train_and_evaluate(config, str(tmp_path / "run"), data=source)
  # No split was loaded in memory: the train batches were streamed.
  assert not source.in_memory
  assert isinstance(source.train_iterator(), StreamingTrainIterator)
  assert final["step"] == 2 and final["num_examples"] == N_VAL
  assert np.isfinite(final["loss"])
  assert read_splits == ["validation"]


def test_batches_are_scaled_by_pp_and_the_test_split_matches(data_dir):
  config = stream_config(data_dir)
  it = StreamingTrainIterator(config.data, config.seed)
  assert it.num_classes == 1000
  batch = next(it)
  assert batch["image"].shape == (8, SIDE, SIDE, 3)
  assert batch["image"].dtype == np.float32 and batch["label"].dtype == np.int32
  assert batch["image"].min() >= -1 and batch["image"].max() <= 1
  assert batch["image"].min() < -0.5  # Not squeezed into [0, 1] again.
  # The in-memory test split ([0, 1]) is mapped to [-1, 1] as well.
  assert loader.default_normalization(config.data) == (0.5, 0.5)


def test_resumed_data_order_equals_uninterrupted(data_dir):
  config = stream_config(data_dir)
  straight = StreamingTrainIterator(config.data, config.seed)
  batches = [next(straight) for _ in range(8)]  # Crosses an epoch.
  first = StreamingTrainIterator(config.data, config.seed)
  for _ in range(3):
    next(first)
  state = json.loads(json.dumps(first.get_state()))  # As in the checkpoint.
  resumed = StreamingTrainIterator(config.data, config.seed)
  resumed.set_state(state)
  for expected in batches[3:]:
    chex.assert_trees_all_equal(next(resumed), expected)
  epoch = np.concatenate([b["label"] for b in batches])[:N_TRAIN]
  assert len(set(epoch.tolist())) == N_TRAIN  # One epoch: each record once.


def test_kill_and_resume_gives_identical_params(data_dir, tmp_path):
  final, _ = straight_vs_resumed(lambda: stream_config(data_dir), tmp_path,
                                 stop_at_step=3)
  assert final["step"] == 6


@pytest.mark.parametrize("data, field", [
    (dict(pp_train="decode|no_such_op(3)"), "data.pp_train"),
    (dict(pp_train="decode|resize("), "data.pp_train"),
    (dict(pp_train=None), "data.pp_train"),
    (dict(worker_count=-1), "data.worker_count"),
    (dict(augment=True), "data.augment"),
    (dict(image_size=None), "data.image_size"),
    (dict(train_examples=10), "data.train_examples"),
    (dict(mean=0.2), "data.mean"),
    (dict(streaming=False), "data.pp_train"),  # pp_train without streaming.
    (dict(pp_eval="decode|flip_lr|value_range(-1, 1)"), "data.pp_eval"),
    (dict(pp_eval="decode|central_crop(32)|value_range(0, 1)"),
     "data.pp_eval"),
    (dict(pp_eval="decode|no_such_op"), "data.pp_eval"),
    (dict(pp_eval=PP_EVAL, analysis_examples=0), "data.analysis_examples"),
    (dict(pp_eval=PP_EVAL, streaming=False, pp_train=None), "data.pp_eval"),
])
def test_bad_streaming_config_names_the_field(data_dir, data, field):
  config = stream_config(data_dir)
  config.data.update(data)
  with pytest.raises(ConfigError) as e:
    validate_config(config)
  assert e.value.field == field, e.value


def test_matching_explicit_statistics_are_accepted(data_dir):
  config = stream_config(data_dir)
  config.data.update(dict(mean=0.5, std=(0.5, 0.5, 0.5)))
  validate_config(config)


def test_data_dir_without_the_dataset_names_data_dir(tmp_path):
  config = stream_config(str(tmp_path))
  with pytest.raises(ConfigError) as e:
    loop.setup(config, str(tmp_path / "run"))
  assert e.value.field == "data.data_dir", e.value
  assert "no prepared copy of imagenet2012" in str(e.value)


def test_pp_output_size_must_match_image_size(data_dir, tmp_path):
  config = stream_config(data_dir,)
  config.data.pp_train = "decode|resize(16)|value_range(-1, 1)"
  with pytest.raises(ConfigError) as e:
    loop.setup(config, str(tmp_path / "run"))
  assert e.value.field == "data.pp_train" and "16" in str(e.value)


def test_worker_processes_give_the_same_batches(data_dir):
  config = stream_config(data_dir)
  expected = StreamingTrainIterator(config.data, config.seed)
  config.data.worker_count = 2
  workers = StreamingTrainIterator(config.data, config.seed)
  try:
    for _ in range(3):
      chex.assert_trees_all_equal(next(workers), next(expected))
    state = workers.get_state()
    workers.set_state(state)  # Rebuilds the workers at the same position.
    chex.assert_trees_all_equal(next(workers), next(expected))
  finally:
    workers.close()
