"""The streamed test split (`data.pp_eval`) and per-process data states.

On the tiny fake `imagenet2012` (`tests/fake_imagenet.py`): the batches of
`StreamingEvalSplit` against the records read directly from TFDS and
preprocessed one by one; simulated processes; worker processes; the
in-memory analysis subset; bounded host memory; the training binary, the
evaluation mode and the carve mode on a streaming config with `pp_eval`
against a direct evaluation of the records; the per-process Grain states
of a streaming run's checkpoint; errors naming their field.
"""

from __future__ import annotations

import json
import tracemalloc

import jax
import ml_collections
import numpy as np
import optax
import pytest

pytest.importorskip("tensorflow_datasets")
pytest.importorskip("grain.python")

import tensorflow_datasets as tfds  # noqa: E402

# data_dir: the module-scoped fake ImageNet fixture.
from fake_imagenet import (N_TRAIN, N_VAL, PP_EVAL, SIDE,  # noqa: E402,F401
                           data_dir, stream_config)
from vmoe_ext import main  # noqa: E402
from vmoe_ext.data import pp  # noqa: E402
from vmoe_ext.data import stream_iterator  # noqa: E402
from vmoe_ext.data.stream_eval import StreamingEvalSplit  # noqa: E402
from vmoe_ext.data.stream_iterator import StreamingTrainIterator  # noqa: E402
from vmoe_ext.errors import ConfigError, InputError  # noqa: E402
from vmoe_ext.models import build_model  # noqa: E402
from vmoe_ext.app import train as loop  # noqa: E402
from vmoe_ext.data import source as data_source  # noqa: E402


def eval_data(data_dir, **data):
  return dict(stream_config(data_dir, pp_eval=PP_EVAL, **data).data)


def direct(data_dir, split="validation", spec=PP_EVAL):
  """Every record of `split`, read with TFDS and preprocessed one by one:
  `(images [N, S, S, 3], labels [N])`."""
  source = tfds.data_source("imagenet2012", split=split, data_dir=data_dir,
                            download=False, try_gcs=False,
                            decoders={"image": tfds.decode.SkipDecoding()})
  pipeline = pp.parse(spec)
  images = [pipeline(source[i]["image"]) for i in range(len(source))]
  labels = [int(source[i]["label"]) for i in range(len(source))]
  return np.stack(images).astype(np.float32), np.asarray(labels, np.int32)


def concat(batches):
  """`(images, labels)` of the real rows of padded batches, in order."""
  images = np.concatenate([b["image"][b["mask"]] for b in batches])
  labels = np.concatenate([b["label"][b["mask"]] for b in batches])
  return images, labels


def test_batches_are_every_record_once_in_order_padded(data_dir):
  images, labels = direct(data_dir)
  split = StreamingEvalSplit(eval_data(data_dir))
  assert len(split) == N_VAL and split.num_classes == 1000
  batches = list(split.batches(6))
  assert [b["image"].shape for b in batches] == [(6, SIDE, SIDE, 3)] * 3
  assert [b["mask"].tolist() for b in batches][-1] == [True] * 4 + [False] * 2
  assert batches[-1]["label"][4:].tolist() == [0, 0]
  assert not batches[-1]["image"][4:].any()
  got_images, got_labels = concat(batches)
  np.testing.assert_array_equal(got_labels, labels)
  np.testing.assert_array_equal(got_images, images)
  assert all(b["label"].dtype == np.int32 and b["image"].dtype == np.float32
             for b in batches)


def test_max_examples_limits_the_split_to_its_first_records(data_dir):
  images, labels = direct(data_dir)
  split = StreamingEvalSplit(eval_data(data_dir, max_examples=5))
  assert len(split) == 5
  got_images, got_labels = concat(list(split.batches(4)))
  np.testing.assert_array_equal(got_labels, labels[:5])
  np.testing.assert_array_equal(got_images, images[:5])


@pytest.mark.parametrize("count, batch", [(2, 8), (3, 6), (5, 5)])
def test_simulated_processes_share_the_split_in_equal_steps(data_dir, count,
                                                            batch):
  images, labels = direct(data_dir)
  shares = [StreamingEvalSplit(eval_data(data_dir), process_index=p,
                               process_count=count) for p in range(count)]
  per_process = [list(s.batches(batch)) for s in shares]
  rows = batch // count
  m = -(-N_VAL // count)  # Records per process (the last has fewer).
  assert {len(b) for b in per_process} == {-(-m // rows)}
  assert all(b["image"].shape[0] == rows for bs in per_process for b in bs)
  got = [concat(bs) for bs in per_process]
  np.testing.assert_array_equal(np.concatenate([g[1] for g in got]), labels)
  np.testing.assert_array_equal(np.concatenate([g[0] for g in got]), images)
  assert [s.share() for s in shares][0] == (0, m)


def test_worker_processes_give_the_same_batches(data_dir):
  expected = list(StreamingEvalSplit(eval_data(data_dir)).batches(6))
  got = list(StreamingEvalSplit(eval_data(data_dir, worker_count=2)).batches(
      6))
  assert len(got) == len(expected)
  for g, e in zip(got, expected):
    for key in ("image", "label", "mask"):
      np.testing.assert_array_equal(np.asarray(g[key]), e[key])


def test_analysis_subset_is_evenly_spaced_and_rescales_exactly(data_dir):
  images, labels = direct(data_dir)
  split = StreamingEvalSplit(eval_data(data_dir))
  subset = split.analysis_dataset(5)
  picks = [0, 4, 8, 11, 15]  # round(linspace(0, 15, 5))
  np.testing.assert_array_equal(subset.labels, labels[picks])
  assert subset.images.min() >= 0 and subset.images.max() <= 1
  # (x - 0.5) / 0.5, the trainer's normalisation for value_range(-1, 1),
  # gives pp_eval's output back.
  np.testing.assert_allclose((subset.images - 0.5) / 0.5, images[picks],
                             atol=1e-6)


def test_host_memory_stays_bounded_while_streaming(data_dir):
  # The 44-image train split upsampled to 256 px (so that images dominate
  # the bookkeeping) and read as an evaluation split 3 times, 2 images read
  # ahead, batches of 2: the memory held never approaches the split's.
  data = eval_data(data_dir)
  data["pp_eval"] = "decode|resize(256)|value_range(-1, 1)"
  split = StreamingEvalSplit(data, split="train", prefetch=2)
  image_bytes = 256 * 256 * 3 * 4
  tracemalloc.start()
  base = tracemalloc.get_traced_memory()[0]
  seen = 0
  for _ in range(3):
    for batch in split.batches(2):
      seen += int(batch["mask"].sum())
  held, peak = (m - base for m in tracemalloc.get_traced_memory())
  tracemalloc.stop()
  del batch
  assert seen == 3 * N_TRAIN
  assert peak < N_TRAIN // 2 * image_bytes, peak / image_bytes
  assert held < 4 * image_bytes, held / image_bytes


# ------------------------------------------------------------ the binary


def direct_loss(config, params, data_dir):
  """Mean cross-entropy and accuracy of `params` on the whole validation
  split, preprocessed one record at a time (no batching code shared)."""
  images, labels = direct(data_dir)
  model = build_model(config.model)
  logits = np.concatenate([
      np.asarray(model.apply({"params": params}, images[i:i + 8],
                             deterministic=True)[0])
      for i in range(0, N_VAL, 8)])
  loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
  return float(np.mean(loss)), float(np.mean(logits.argmax(-1) == labels))


@pytest.fixture(scope="module")
def trained(data_dir, tmp_path_factory):
  """A 4-step streaming run whose test split streams through pp_eval, with
  the routing analysis and a small robustness section; loading the test
  split whole would fail it."""

  def forbidden(*args, **kwargs):
    raise AssertionError("the test split must stream")

  workdir = str(tmp_path_factory.mktemp("run"))
  config = stream_config(data_dir, pp_eval=PP_EVAL, analysis_examples=8)
  config.train.update(dict(total_steps=4, eval_every=2))
  config.robustness = ml_collections.ConfigDict(dict(
      num_examples=8, attacks=[dict(name="fgsm", eps=0.01)]))
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(data_source, "load_tfds_split", forbidden)
    main.run(config, workdir)
  run = loop.setup(config, workdir)
  assert run.restore() == 4
  run.checkpoints.close()
  return config, workdir, run


def _records(workdir):
  with open(f"{workdir}/metrics.jsonl") as f:
    return [json.loads(line) for line in f]


def test_training_evaluates_the_whole_streamed_split(data_dir, trained):
  config, workdir, run = trained
  final = [r for r in _records(workdir) if r.get("final")]
  assert len(final) == 1 and final[0]["num_examples"] == N_VAL
  loss, accuracy = direct_loss(config, run.state.params, data_dir)
  np.testing.assert_allclose(final[0]["loss"], loss, rtol=1e-5)
  assert final[0]["accuracy"] == pytest.approx(accuracy)
  # The in-memory split is the analysis subset of data.analysis_examples.
  assert len(run.data.test) == 8
  assert run.data.local_eval
  routing = [r for r in _records(workdir) if r["split"] == "routing"]
  attacks = [r for r in _records(workdir)
             if r["split"].startswith("adversarial/")]
  assert routing and attacks


def test_evaluation_mode_streams_the_split(data_dir, trained, tmp_path):
  config, workdir, run = trained
  config = ml_collections.ConfigDict(config.to_dict())
  config.robustness = ml_collections.ConfigDict(dict(
      checkpoint_dir=workdir, num_examples=8))
  main.run(config, str(tmp_path / "eval"))
  final = [r for r in _records(str(tmp_path / "eval")) if r.get("final")][0]
  loss, _ = direct_loss(config, run.state.params, data_dir)
  assert final["num_examples"] == N_VAL
  np.testing.assert_allclose(final["loss"], loss, rtol=1e-5)


def test_carve_mode_calibrates_on_the_streamed_train_split(data_dir,
                                                           tmp_path):
  config = stream_config(data_dir, pp_eval=PP_EVAL)
  config.model.name = "vit"
  config.model.moe = None
  config.train.update(dict(total_steps=2, checkpoint_every=2))
  dense = str(tmp_path / "dense")
  loop.train_and_evaluate(config, dense)
  config.carve = ml_collections.ConfigDict(dict(
      num_experts=4, num_shared=1, num_activated=1, every=1,
      activation_markers=3, num_calibration=12, batch_size=8,
      checkpoint_dir=dense))
  main.run(config, str(tmp_path / "carve"))
  records = _records(str(tmp_path / "carve"))
  final = [r for r in records if r.get("final")][0]
  assert final["num_examples"] == N_VAL
  dense_test = [r for r in records if r["split"] == "dense_test"][0]
  assert dense_test["num_examples"] == N_VAL
  # The carved checkpoint resumes as a streaming run at the fresh position.
  from vmoe_ext.carving.dense_source import carved_config
  target = carved_config(config)
  run = loop.setup(target, str(tmp_path / "carve"))
  assert run.restore() == 0
  run.checkpoints.close()
  fresh = StreamingTrainIterator(target.data, target.seed)
  np.testing.assert_array_equal(next(run.data.train_iterator())["label"],
                                next(fresh)["label"])


def test_carve_mode_on_a_streaming_config_needs_pp_eval(data_dir, tmp_path):
  config = stream_config(data_dir)
  config.model.name = "vit"
  config.model.moe = None
  config.carve = ml_collections.ConfigDict(dict(
      num_experts=4, num_shared=1, num_activated=1, every=1,
      checkpoint_dir=str(tmp_path)))
  from vmoe_ext.app.schema import validate_config
  with pytest.raises(ConfigError) as e:
    validate_config(config)
  assert e.value.field == "data.pp_eval", e.value


# ---------------------------------------------------- per-process states


def test_simulated_process_states_resume_only_with_the_same_processes(
    data_dir):
  data = stream_config(data_dir).data
  first = StreamingTrainIterator(data, 0, process_index=1, process_count=2)
  batches = [next(first) for _ in range(3)]
  state = json.loads(json.dumps(first.get_state()))
  assert state["process_count"] == 2 and list(state["states"]) == ["1"]
  resumed = StreamingTrainIterator(data, 0, process_index=1, process_count=2)
  resumed.set_state(state)
  straight = StreamingTrainIterator(data, 0, process_index=1,
                                    process_count=2)
  for _ in range(3):
    next(straight)
  np.testing.assert_array_equal(next(resumed)["label"],
                                next(straight)["label"])
  assert batches[0]["image"].shape[0] == 4  # B / P rows.
  other = StreamingTrainIterator(data, 0, process_index=0, process_count=2)
  with pytest.raises(InputError, match="process 0"):
    other.set_state(state)
  single = StreamingTrainIterator(data, 0)
  with pytest.raises(InputError, match="saved by 2 process"):
    single.set_state(state)


def test_a_bare_grain_state_resumes_a_single_process(data_dir):
  data = stream_config(data_dir).data
  first = StreamingTrainIterator(data, 0)
  next(first)
  bare = first.get_state()["states"]["0"]  # Checkpoints before this change.
  resumed = StreamingTrainIterator(data, 0)
  resumed.set_state(bare)
  np.testing.assert_array_equal(next(resumed)["label"],
                                next(first)["label"])


def test_allgather_of_one_process_is_its_own_text():
  assert jax.process_count() == 1
  assert stream_iterator._allgather_text('{"a": 1}') == ['{"a": 1}']


# ------------------------------------------------------------------ errors


def test_pp_eval_output_size_and_batch_are_checked_at_setup(data_dir,
                                                            tmp_path):
  config = stream_config(data_dir, pp_eval="decode|central_crop(24)|"
                         "value_range(-1, 1)")
  with pytest.raises(ConfigError) as e:
    loop.setup(config, str(tmp_path / "a"))
  assert e.value.field == "data.pp_eval" and "24" in str(e.value)
  split = StreamingEvalSplit(eval_data(data_dir), process_index=0,
                             process_count=3)
  with pytest.raises(ConfigError) as e:
    split.batches(8)
  assert e.value.field == "data.eval_batch_size", e.value
  config = stream_config(data_dir, pp_eval=PP_EVAL,
                         test_split="no_such_split")
  with pytest.raises(ConfigError) as e:
    loop.setup(config, str(tmp_path / "b"))
  assert e.value.field == "data.test_split", e.value


# ------------------------------------------- evaluation datasets via pp_eval


def test_eval_fit_of_a_decoded_image_equals_pp_eval_of_its_bytes(data_dir):
  from vmoe_ext.data.stream_eval import EvalFit
  from vmoe_ext.data.tfds_adapter import TfdsReader
  images, _ = direct(data_dir)  # pp_eval of the JPEG bytes, in [-1, 1].
  reader = TfdsReader({"tfds_name": "imagenet2012", "data_dir": data_dir},
                      "validation")
  fit = EvalFit(PP_EVAL)
  got, _ = reader.read(np.arange(N_VAL), fit)  # Decoded, then pp_eval.
  np.testing.assert_allclose(got * 2 - 1, images, atol=1e-6)
  square, _ = reader.read(np.arange(N_VAL), SIDE)  # The square resize.
  assert np.abs(square * 2 - 1 - images).max() > 0.1


def test_accuracy_datasets_of_a_streaming_run_go_through_pp_eval(
    data_dir, trained):
  from vmoe_ext.evaluate import datasets as eval_datasets
  from vmoe_ext.evaluate.evaluator import Evaluator
  config, _, run = trained
  images, labels = direct(data_dir)
  model = build_model(config.model)
  want = np.asarray(model.apply(run.state.variables(), images,
                                deterministic=True)[0])
  ctx = eval_datasets._Context(
      Evaluator(model, run.state.variables(), 0.5, 0.5),
      run.data.test, config.data, batch_size=8)
  source = {"tfds_name": "imagenet2012", "split": "validation",
            "max_examples": None}
  reader = ctx.open(source, "robustness.datasets.x.source")
  logits, got_labels = ctx.predict(reader, source, "f", desc="x", fit=True)
  np.testing.assert_array_equal(got_labels, labels)
  np.testing.assert_allclose(logits, want, atol=2e-5)


# ------------------------------------------------- a paper config, shrunk


def test_a_paper_imagenet_config_runs_end_to_end(data_dir, tmp_path):
  """`configs/imagenet.py:vmoe_s32_every2` (streaming with pp_eval, mixup,
  sigmoid cross-entropy, eval capacity 4.0, the attacks) on the fake
  ImageNet, at 32 px with a narrow 2-block model: 2 steps, then the
  evaluation, the routing analysis and FGSM."""
  from vmoe_ext.train.config_files import load_config
  config = load_config("imagenet", "vmoe_s32_every2,batch_size=8")
  assert config.data.pp_train.startswith("decode_jpeg_and_inception_crop")
  assert config.train.loss == "sigmoid_xent" and config.train.mixup
  config.data.update(dict(
      data_dir=data_dir, train_split="train", image_size=SIDE,
      eval_batch_size=8, worker_count=0, analysis_examples=8,
      pp_train=config.data.pp_train.replace("224", str(SIDE)),
      pp_eval=config.data.pp_eval.replace("256", "36").replace(
          "224", str(SIDE))))
  # 2 blocks, block 1 an MoE (every 2), to keep the compile short.
  assert tuple(config.model.moe.layers) == (1, 3, 5, 7)
  config.model.update(dict(patch_size=(8, 8), hidden_size=32, mlp_dim=64,
                           num_heads=2, representation_size=32, num_layers=2))
  config.model.moe.update(dict(group_size=8 * 17, layers=(1,)))
  config.train.update(dict(total_steps=2, log_every=1, eval_every=0,
                           checkpoint_every=2))
  config.optimizer.warmup_steps = 1
  config.robustness.num_examples = 8
  config.robustness.attacks = config.robustness.attacks[:1]
  config.robustness.sweep = None  # (update() would merge into the dicts.)
  config.robustness.datasets = None
  workdir = str(tmp_path / "run")
  main.run(config, workdir)
  records = _records(workdir)
  final = [r for r in records if r.get("final")][0]
  assert final["step"] == 2 and final["num_examples"] == N_VAL
  train = [r for r in records if r["split"] == "train"]
  assert len(train) == 2 and all(np.isfinite(r["loss"]) for r in train)
  # Sigmoid cross-entropy over 1000 classes starts near 1000 log 2 with a
  # zero head and bias -log(1000) (about 1000 * log(1 + 1/1000) + log 1000).
  assert 5 < train[0]["cross_entropy"] < 10
  assert [r for r in records if r["split"].startswith("adversarial/")]
