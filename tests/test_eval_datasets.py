"""Robustness on external datasets (`robustness.datasets`): corrupted datasets
and mCE, class-subset accuracy, OOD AUPR; TFDS sources mocked with
`tfds.testing.mock_data` and image folders written here.

The fake data are built so the answers are known by hand: each example's label
is set to the model's own prediction (computed independently: resize +
normalise + `model.apply`) for the first k examples of a split and to another
class for the rest, so the accuracy must be exactly k / n. A pipeline that read
the wrong split, resized or normalised differently, or mixed up labels would
miss it.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import PIL.Image
import pytest
import sklearn.metrics
import tensorflow_datasets as tfds

from tiny_configs import tiny_cifar10
from vmoe_ext.data import ArrayDataset, resize
from vmoe_ext.errors import ConfigError
from vmoe_ext.evaluate.corruption_metrics import ALEXNET_ERRORS
from vmoe_ext.evaluate.datasets import check_datasets, evaluate_datasets
from vmoe_ext.evaluate.evaluator import Evaluator
from vmoe_ext.evaluate.imagenet_subsets import IMAGENET_R_CLASSES
from vmoe_ext.config import validate
from vmoe_ext.evaluate.config import ROBUSTNESS
from vmoe_ext.evaluate.robustness import robustness_config
from vmoe_ext.models import build_model
from vmoe_ext.reporting.writers import MetricWriter, read_metrics

MEAN, STD = 0.45, 0.25
SIDE = 8      # model input side
STORED = 12   # stored side of the fake images (resized to SIDE when read)
N = 6         # examples per fake split


def _model(num_classes):
  config = ml_collections.ConfigDict(dict(
      name="vit", num_classes=num_classes, patch_size=(4, 4), hidden_size=8,
      num_layers=1, num_heads=2, mlp_dim=8, classifier="token",
      dropout_rate=0.0, attention_dropout_rate=0.0, moe=None))
  model = build_model(config)
  variables = model.init(jax.random.key(0), jnp.zeros((2, SIDE, SIDE, 3)))
  params = dict(variables["params"])  # A spread-out head: distinct argmaxes.
  params["head"] = {**params["head"], "kernel": 3.0 * jax.random.normal(
      jax.random.key(1), params["head"]["kernel"].shape)}
  return model, {"params": params}


@pytest.fixture(scope="module")
def models():
  return {c: _model(c) for c in (2, 10, 1000)}


def _images(seed, n=N, side=STORED):
  return np.random.default_rng(seed).integers(0, 256, (n, side, side, 3),
                                              dtype=np.uint8)


def _reference_logits(model_vars, images_uint8):
  """Independent path: resize the uint8 images, normalise, apply."""
  model, variables = model_vars
  x = resize(images_uint8.astype(np.float32) / 255.0, SIDE)
  logits, _ = model.apply(variables, (x - MEAN) / STD, deterministic=True)
  return np.asarray(logits, np.float64)


def _labels_with_k_correct(logits, k, classes=None):
  """Label = predicted class for the first k examples, the runner-up for the
  rest (so top-1 accuracy is k / n and top-5 accuracy 1)."""
  scores = logits if classes is None else logits[:, list(classes)]
  order = np.argsort(-scores, axis=1, kind="stable")
  pick = np.where(np.arange(len(scores)) < k, order[:, 0], order[:, 1])
  return pick if classes is None else np.asarray(classes)[pick]


def _test_split(channels=3, n=10):
  rng = np.random.default_rng(7)
  images = rng.uniform(0, 1, (n, SIDE, SIDE, channels)).astype(np.float32)
  return ArrayDataset(images, (np.arange(n) % 2).astype(np.int32), 2, "test")


def _evaluate(tmp_path, model_vars, datasets, test=None, data_dir=None):
  model, variables = model_vars
  evaluator = Evaluator(model, variables, MEAN, STD)
  writer = MetricWriter(str(tmp_path))
  data_config = {"image_size": None, "data_dir": data_dir}
  sections = evaluate_datasets(
      evaluator, test if test is not None else _test_split(), data_config,
      datasets, batch_size=4, writer=writer, step=3, workdir=str(tmp_path))
  writer.close()
  records = {r["split"]: r for r in read_metrics(str(tmp_path))}
  return records, "\n".join(sections)


def _k(corruption, severity):
  """A per-(corruption, severity) number of correct examples in [0, N]."""
  return (sum(map(ord, corruption)) + 3 * severity) % (N + 1)


def _fake_corrupted_source(logits_by_config, images):
  def as_data_source(builder, split, **kwargs):
    del split, kwargs
    name = builder.builder_config.name  # e.g. "fog_3"
    corruption, severity = name.rsplit("_", 1)
    labels = _labels_with_k_correct(logits_by_config,
                                    _k(corruption, int(severity)))
    return [{"image": images[i], "label": int(labels[i])}
            for i in range(len(images))]
  return as_data_source


def test_imagenet_c_mce_matches_the_hand_computation(tmp_path, models):
  images = _images(0)
  logits = _reference_logits(models[1000], images)
  datasets = {"imagenet_c": dict(
      kind="corrupted", source=dict(tfds_name="imagenet2012_corrupted",
                                    split="validation"))}
  with tfds.testing.mock_data(
      as_data_source_fn=_fake_corrupted_source(logits, images)):
    records, report = _evaluate(tmp_path, models[1000], datasets,
                                data_dir=str(tmp_path))
  got = records["corrupted/imagenet_c"]
  errors = {}
  for c, alexnet in ALEXNET_ERRORS.items():
    for s in range(1, 6):
      assert got[f"{c}/s{s}/accuracy"] == pytest.approx(_k(c, s) / N)
    errors[c] = np.mean([1 - _k(c, s) / N for s in range(1, 6)])
    assert got[f"{c}/error"] == pytest.approx(errors[c])
    assert got[f"{c}/ce"] == pytest.approx(errors[c] / alexnet)
  assert got["mce"] == pytest.approx(
      np.mean([errors[c] / ALEXNET_ERRORS[c] for c in errors]))
  assert got["mean_corruption_error"] == pytest.approx(
      np.mean(list(errors.values())))
  assert got["num_examples"] == N and got["step"] == 3
  assert "ImageNet-C mCE" in report and f"{got['mce']:.4f}" in report
  assert os.path.exists(tmp_path / "corrupted_imagenet_c.png")


def test_cifar10_c_reports_the_unnormalised_mean(tmp_path, models):
  images = _images(1)
  logits = _reference_logits(models[10], images)
  names, severities = ("speckle_noise", "fog", "saturate"), (2, 5)
  datasets = {"c10c": dict(
      kind="corrupted", corruptions=names, severities=severities,
      source=dict(tfds_name="cifar10_corrupted", split="test",
                  max_examples=4))}
  with tfds.testing.mock_data(
      as_data_source_fn=_fake_corrupted_source(logits, images)):
    records, report = _evaluate(tmp_path, models[10], datasets,
                                data_dir=str(tmp_path))
  got = records["corrupted/c10c"]
  # max_examples=4 of 6: evenly spaced examples 0, 2, 3, 5.
  kept = np.array([0, 2, 3, 5])
  errors = []
  for c in names:
    for s in severities:
      want = np.mean(kept < _k(c, s))
      assert got[f"{c}/s{s}/accuracy"] == pytest.approx(want)
    errors.append(np.mean([1 - np.mean(kept < _k(c, s))
                           for s in severities]))
  assert got["mean_corruption_error"] == pytest.approx(np.mean(errors))
  assert "mce" not in got and "fog/ce" not in got
  assert got["num_examples"] == 4
  assert "unnormalised" in report


def _write_png(path, image_uint8):
  os.makedirs(os.path.dirname(path), exist_ok=True)
  PIL.Image.fromarray(image_uint8).save(path)


def test_imagenet_c_folder_with_alexnet_baseline(tmp_path, models):
  # Layout path/CORRUPTION/SEVERITY/CLASS/FILE; a 2-class model, so each image
  # goes into the folder of its predicted class or of the other class.
  images = _images(2, n=4)
  logits = _reference_logits(models[2], images)
  pred = logits.argmax(-1)
  root = tmp_path / "imagenet-c"
  for c in ALEXNET_ERRORS:
    k = _k(c, 1) % 5
    for i, image in enumerate(images):
      label = pred[i] if i < k else 1 - pred[i]
      _write_png(str(root / c / "1" / f"class{label}" / f"{i}.png"), image)
    # Both class folders must exist for a 2-class reader.
    for label in (0, 1):
      os.makedirs(root / c / "1" / f"class{label}", exist_ok=True)
  datasets = {"inc": dict(kind="corrupted", severities=(1,),
                          baseline="alexnet", source=dict(path=str(root)))}
  records, _ = _evaluate(tmp_path / "out", models[2], datasets)
  got = records["corrupted/inc"]
  want = np.mean([(1 - (_k(c, 1) % 5) / 4) / ALEXNET_ERRORS[c]
                  for c in ALEXNET_ERRORS])
  assert got["mce"] == pytest.approx(want)


def test_subset_accuracy_on_tfds_imagenet_r(tmp_path, models):
  images = _images(3)
  logits = _reference_logits(models[1000], images)
  k = 4
  labels = _labels_with_k_correct(logits, k, IMAGENET_R_CLASSES)

  def as_data_source(builder, split, **kwargs):
    del builder, split, kwargs
    return [{"image": images[i], "label": int(labels[i])} for i in range(N)]

  datasets = {"imagenet_r": dict(
      kind="accuracy", class_subset="imagenet_r",
      source=dict(tfds_name="imagenet_r", split="test"))}
  with tfds.testing.mock_data(as_data_source_fn=as_data_source):
    records, report = _evaluate(tmp_path, models[1000], datasets,
                                data_dir=str(tmp_path))
  got = records["dataset/imagenet_r"]
  assert got["accuracy"] == pytest.approx(k / N)
  assert got["top5_accuracy"] == pytest.approx(1.0)
  assert got["class_subset_size"] == 200 and got["num_examples"] == N
  # Without the subset the full 1000-way argmax is scored: a hand check.
  full = np.mean(logits.argmax(-1) == labels)
  with tfds.testing.mock_data(as_data_source_fn=as_data_source):
    records, _ = _evaluate(tmp_path / "full", models[1000], {
        "r": dict(kind="accuracy", source=dict(tfds_name="imagenet_r",
                                               split="test"))},
                           data_dir=str(tmp_path))
  assert records["dataset/r"]["accuracy"] == pytest.approx(full)
  assert "Accuracy on evaluation datasets" in report


def test_labels_outside_the_subset_are_an_error(tmp_path, models):
  images = _images(4)

  def as_data_source(builder, split, **kwargs):
    del builder, split, kwargs
    return [{"image": images[i], "label": 0} for i in range(N)]  # 0 not in R

  datasets = {"r": dict(kind="accuracy", class_subset="imagenet_r",
                        source=dict(tfds_name="imagenet_r", split="test"))}
  with tfds.testing.mock_data(as_data_source_fn=as_data_source):
    with pytest.raises(ConfigError) as e:
      _evaluate(tmp_path, models[1000], datasets, data_dir=str(tmp_path))
  assert e.value.field == "robustness.datasets.r.class_subset"


def test_subset_label_space_on_a_folder(tmp_path, models):
  # Sorted class folders label positions in the subset (released ImageNet-R
  # layout); here a 3-class subset of the 10-class model.
  subset = (7, 2, 5)
  images = _images(5)
  logits = _reference_logits(models[10], images)
  labels = _labels_with_k_correct(logits, 2, subset)
  for position in range(3):  # Every subset class has a folder.
    os.makedirs(tmp_path / "r" / f"wnid{position}", exist_ok=True)
  for i, label in enumerate(labels):
    position = subset.index(int(label))
    _write_png(str(tmp_path / "r" / f"wnid{position}" / f"{i:02d}.png"),
               images[i])
  # Files are read class by class: the model sees them in folder order.
  datasets = {"r": dict(kind="accuracy", class_subset=subset,
                        label_space="subset",
                        source=dict(path=str(tmp_path / "r")))}
  records, _ = _evaluate(tmp_path / "out", models[10], datasets)
  assert records["dataset/r"]["accuracy"] == pytest.approx(2 / N)
  assert records["dataset/r"]["top5_accuracy"] == pytest.approx(1.0)


def _softmax_max(logits):
  z = logits - logits.max(-1, keepdims=True)
  p = np.exp(z) / np.exp(z).sum(-1, keepdims=True)
  return p.max(-1)


def test_ood_aupr_matches_sklearn(tmp_path, models):
  out_images = _images(6, n=5)

  def as_data_source(builder, split, **kwargs):
    del builder, split, kwargs
    return [{"image": out_images[i], "label": 0} for i in range(5)]

  test = _test_split()
  datasets = {"o": dict(kind="ood", source=dict(tfds_name="imagenet_a",
                                                split="test"))}
  with tfds.testing.mock_data(as_data_source_fn=as_data_source):
    records, report = _evaluate(tmp_path, models[1000], datasets, test=test,
                                data_dir=str(tmp_path))
  logits_out = _reference_logits(models[1000], out_images)
  model, variables = models[1000]
  logits_in = np.asarray(model.apply(variables, (test.images - MEAN) / STD,
                                     deterministic=True)[0], np.float64)
  scores = -np.r_[_softmax_max(logits_in), _softmax_max(logits_out)]
  want = sklearn.metrics.average_precision_score(
      np.r_[np.zeros(10), np.ones(5)], scores)
  got = records["ood/o"]
  assert got["aupr"] == pytest.approx(want, rel=1e-6)
  assert got["chance_aupr"] == pytest.approx(5 / 15)
  assert got["num_in"] == 10 and got["num_out"] == 5
  assert "Out-of-distribution detection" in report


def test_ood_class_subset_filters_and_masks(tmp_path, models):
  test = _test_split()  # labels 0, 1, 0, 1, ...
  out = test.images[:3] * 0.5
  os.makedirs(tmp_path / "o" / "x")
  for i, image in enumerate(out):
    _write_png(str(tmp_path / "o" / "x" / f"{i}.png"),
               np.round(image * 255).astype(np.uint8))
  datasets = {"o": dict(kind="ood", class_subset=(1, 7),
                        source=dict(path=str(tmp_path / "o")))}
  records, _ = _evaluate(tmp_path / "out", models[10], datasets, test=test)
  model, variables = models[10]
  apply = lambda x: np.asarray(model.apply(
      variables, (x - MEAN) / STD, deterministic=True)[0], np.float64)
  out_read = np.round(out * 255).astype(np.uint8) / 255.0
  logits_in = apply(test.images[test.labels == 1])[:, [1, 7]]
  logits_out = apply(out_read.astype(np.float32))[:, [1, 7]]
  scores = -np.r_[_softmax_max(logits_in), _softmax_max(logits_out)]
  want = sklearn.metrics.average_precision_score(
      np.r_[np.zeros(len(logits_in)), np.ones(3)], scores)
  assert records["ood/o"]["aupr"] == pytest.approx(want, rel=1e-5)
  assert records["ood/o"]["num_in"] == 5


@pytest.mark.parametrize("datasets, field", [
    ({"a": dict(kind="mystery", source="test")}, "robustness.datasets.a.kind"),
    ({"a": dict(kind="accuracy")}, "robustness.datasets.a.source"),
    ({"a": dict(kind="accuracy", source="test", eps=1)},
     "robustness.datasets.a.eps"),
    ({"a": dict(kind="accuracy", source=dict(tfds_name="x"))},
     "robustness.datasets.a.source.split"),
    ({"a": dict(kind="accuracy", source=dict(path="/x", split="test"))},
     "robustness.datasets.a.source.split"),
    ({"a": dict(kind="accuracy", source=dict(tfds_name="x", split="t",
                                             max_examples=0))},
     "robustness.datasets.a.source.max_examples"),
    ({"a": dict(kind="accuracy", source="test", class_subset="imagenet_z")},
     "robustness.datasets.a.class_subset"),
    ({"a": dict(kind="accuracy", source="test", class_subset=(1, 1))},
     "robustness.datasets.a.class_subset"),
    ({"a": dict(kind="accuracy", source="test", label_space="subset")},
     "robustness.datasets.a.label_space"),
    ({"a": dict(kind="corrupted", source="test")},
     "robustness.datasets.a.source"),
    ({"a": dict(kind="corrupted", source=dict(
        tfds_name="imagenet2012_corrupted/fog_1", split="validation"))},
     "robustness.datasets.a.source.tfds_name"),
    ({"a": dict(kind="corrupted", severities=(0,), source=dict(path="/x"))},
     "robustness.datasets.a.severities"),
    ({"a": dict(kind="corrupted", baseline="resnet", source=dict(path="/x"))},
     "robustness.datasets.a.baseline"),
    ({"a": dict(kind="corrupted", baseline="alexnet", corruptions=("fog",),
                source=dict(path="/x"))},
     "robustness.datasets.a.corruptions"),
    ({"a b": dict(kind="accuracy", source="test")}, "robustness.datasets.a b"),
])
def test_dataset_config_errors_name_the_field(datasets, field):
  with pytest.raises(ConfigError) as e:
    validate(ROBUSTNESS, {"datasets": datasets}, "robustness")
  assert e.value.field == field


def test_defaults_are_filled():
  got = check_datasets({"c": dict(kind="corrupted", source=dict(path="/x")),
                        "o": dict(kind="ood", source=dict(path="/y"))})
  assert got["c"]["severities"] == (1, 2, 3, 4, 5)
  assert got["c"]["corruptions"] == tuple(ALEXNET_ERRORS)
  assert got["c"]["baseline"] == "auto"
  assert got["o"]["in_source"] == "test" and got["o"]["class_subset"] is None


def test_evaluation_time_errors(tmp_path, models):
  # A missing folder, a channel mismatch, a class-count mismatch.
  with pytest.raises(ConfigError) as e:
    _evaluate(tmp_path, models[10], {"a": dict(
        kind="accuracy", source=dict(path=str(tmp_path / "none")))})
  assert e.value.field == "robustness.datasets.a.source.path"
  images = _images(8, n=2)

  def as_data_source(builder, split, **kwargs):
    del builder, split, kwargs
    return [{"image": images[i], "label": 0} for i in range(2)]

  with tfds.testing.mock_data(as_data_source_fn=as_data_source):
    with pytest.raises(ConfigError) as e:  # RGB TFDS images, a grey model.
      _evaluate(tmp_path, models[10], {"a": dict(
          kind="accuracy", source=dict(tfds_name="cifar10", split="test"))},
                test=_test_split(channels=1), data_dir=str(tmp_path))
  assert e.value.field == "robustness.datasets.a.source"
  assert "3-channel images; the model takes 1" in str(e.value)
  _write_png(str(tmp_path / "f" / "c0" / "0.png"), images[0])
  with pytest.raises(ConfigError) as e:
    _evaluate(tmp_path, models[10], {"a": dict(
        kind="accuracy", source=dict(path=str(tmp_path / "f")))})
  assert e.value.field == "robustness.datasets.a.source"
  assert "1 classes, the model 10" in str(e.value)
  with pytest.raises(ConfigError) as e:
    _evaluate(tmp_path, models[10], {"c": dict(
        kind="corrupted", corruptions=("fog",), source=dict(
            path=str(tmp_path / "f")))})
  assert e.value.field == "robustness.datasets.c.source.path"


def test_robustness_cifar10_config_evaluates_a_mock_run(tmp_path):
  from vmoe_ext.app.evaluate import evaluate_checkpoint
  from vmoe_ext.app import train as loop
  from vmoe_ext.train.config_files import load_config

  data_dir, run, out = (str(tmp_path / d) for d in ("tfds", "run", "eval"))
  os.makedirs(data_dir)
  with tfds.testing.mock_data(num_examples=6):
    loop.train_and_evaluate(tiny_cifar10(load_config("cifar10_tfds"),
                                          data_dir), run)
  config = tiny_cifar10(load_config("robustness_cifar10", run), data_dir)
  config.robustness.update(dict(
      num_examples=4,
      attacks=(dict(name="fgsm", eps=8 / 255),
               dict(name="spsa", eps=8 / 255, steps=1, samples=2,
                    num_examples=2)),
      sweep=dict(attack=dict(name="pgd", steps=1), eps=(0.0, 8 / 255))))
  config.robustness.datasets.cifar10_c.update(dict(
      corruptions=("fog", "speckle_noise"), severities=(1, 5)))
  with tfds.testing.mock_data(num_examples=6):
    evaluate_checkpoint(config, out)
  records = {r["split"]: r for r in read_metrics(out)}
  assert {"adversarial/fgsm", "adversarial/spsa", "sweep/pgd",
          "corrupted/cifar10_c", "ood/svhn"} <= set(records)
  assert records["sweep/pgd"]["num_examples"] == 4  # The last eps's line.
  c10c = records["corrupted/cifar10_c"]
  assert c10c["num_examples"] == 6 and "mce" not in c10c
  for key in ("fog/s1/accuracy", "speckle_noise/s5/accuracy"):
    assert 0.0 <= c10c[key] <= 1.0 and c10c[key] * 6 == round(c10c[key] * 6)
  assert records["ood/svhn"]["num_in"] == 6
  assert records["ood/svhn"]["num_out"] == 6
  assert 0.0 < records["ood/svhn"]["aupr"] <= 1.0
  report = open(os.path.join(out, "report.md")).read()
  for title in ("Corrupted dataset `cifar10_c`",
                "Out-of-distribution detection", "Adversarial robustness"):
    assert title in report
  assert os.path.getsize(os.path.join(out, "corrupted_cifar10_c.png")) > 0


def test_a_missing_evaluation_set_is_reported_before_training(tmp_path):
  """The binary's run checks that every evaluation set is on disk before it
  trains (the check reads directories only): a TFDS set without a prepared
  copy, a folder that is not there. A prepared one passes."""
  from vmoe_ext import main
  from vmoe_ext.evaluate.datasets import check_prepared
  from vmoe_ext.train.config_files import load_config

  config = load_config("tiny")
  config.robustness.datasets = {"imagenet_a": dict(
      kind="accuracy", class_subset="imagenet_a",
      source=dict(tfds_name="imagenet_a", split="test",
                  data_dir=str(tmp_path / "tfds")))}
  workdir = str(tmp_path / "run")
  with pytest.raises(ConfigError) as e:
    main.run(config, workdir)
  assert e.value.field == "robustness.datasets.imagenet_a.source.data_dir"
  assert "no prepared copy of imagenet_a under" in str(e.value)
  assert not os.path.exists(workdir)  # Nothing trained, nothing written.
  folder = {"f": dict(kind="accuracy", source=dict(path=str(tmp_path / "f")))}
  with pytest.raises(ConfigError) as e:
    check_prepared(folder, {})
  assert e.value.field == "robustness.datasets.f.source.path"
  ood = {"o": dict(kind="ood", source="test", in_source=dict(
      tfds_name="cifar10_corrupted/fog_1", split="test"))}
  with pytest.raises(ConfigError) as e:  # data.data_dir is the default.
    check_prepared(ood, {"data_dir": str(tmp_path)})
  assert e.value.field == "robustness.datasets.o.in_source.data_dir"
  assert "no prepared copy of cifar10_corrupted under" in str(e.value)
  os.makedirs(tmp_path / "cifar10_corrupted" / "fog_1" / "1.0.0")
  os.makedirs(tmp_path / "f")
  check_prepared({**ood, **folder}, {"data_dir": str(tmp_path)})
