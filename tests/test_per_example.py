"""`robustness.per_example`: each test image's outcome per evaluation
(`vmoe_ext/evaluate/per_example.py`), checked against the model's own
predictions computed here and against the accuracies the evaluation logs."""

from __future__ import annotations

import json
import os

import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from vmoe_ext.data.corruptions import corrupt
from vmoe_ext.evaluate import per_example
from vmoe_ext.evaluate.evaluator import Evaluator
from vmoe_ext.evaluate.robustness import evaluate_robustness
from vmoe_ext.reporting.writers import MetricWriter
from tiny_evaluation import tiny_digits


def test_subset_index_is_evenly_spaced_and_whole_when_none():
  assert per_example.subset_index(10, 4).tolist() == [0, 3, 6, 9]
  assert per_example.subset_index(5, None).tolist() == [0, 1, 2, 3, 4]
  assert per_example.subset_index(5, 9).tolist() == [0, 1, 2, 3, 4]


def test_a_repeated_evaluation_name_gets_a_suffix_and_shapes_are_checked(
    tmp_path):
  record = per_example.PerExample(np.array([1, 2, 3]), enabled=True)
  one = np.array([True, False])
  record.add("adversarial/pgd/eps=0.1", np.array([0, 2]), one, one)
  record.add("adversarial/pgd/eps=0.1", np.array([0, 2]), ~one, one)
  with pytest.raises(ValueError, match="differ"):
    record.add("clean", np.array([0]), one, one)
  record.write(str(tmp_path))
  out = per_example.load(str(tmp_path))
  assert out["adversarial/pgd/eps=0.1"]["correct"].tolist() == [True, False]
  assert out["adversarial/pgd/eps=0.1#2"]["correct"].tolist() == [False,
                                                                  True]
  assert out["label"]["label"].tolist() == [1, 2, 3]
  off = per_example.PerExample(np.array([1]), enabled=False)
  off.add("clean", np.array([0]), one[:1], one[:1])
  assert off.write(str(tmp_path / "none")) is None


def test_the_evaluation_writes_each_images_outcome(tmp_path):
  model, variables, data = tiny_digits(30)
  data_config = ml_collections.ConfigDict({"mean": 0.3, "std": 0.4})
  writer = MetricWriter(str(tmp_path), tensorboard=False)
  evaluate_robustness(
      model, variables, data, data_config,
      {"num_examples": 20, "per_example": True, "seed": 3,
       "attacks": ({"name": "fgsm", "eps": 0.1},
                   {"name": "fgsm", "eps": 0.2, "num_examples": 7}),
       "corruptions": {"names": ("gaussian_noise",), "severities": (2,)}},
      batch_size=8, writer=writer, step=1, workdir=str(tmp_path))
  writer.close()
  out = per_example.load(str(tmp_path))
  evaluator = Evaluator(model, variables, 0.3, 0.4)

  def outcome(images, labels):
    logits = np.asarray(evaluator.forward(jnp.asarray(images))[0])
    order = np.argsort(-logits, axis=-1, kind="stable")
    return order[:, 0] == labels, (order[:, :5] == labels[:, None]).any(-1)

  index = np.linspace(0, 29, 20).round().astype(int)
  clean = out["clean"]
  assert clean["index"].tolist() == index.tolist()
  top1, top5 = outcome(data.images[index], data.labels[index])
  assert clean["correct"].tolist() == top1.tolist()
  assert clean["top5"].tolist() == top5.tolist()
  # The corrupted images, corrupted here the same way (subset, seed).
  noisy = corrupt(data.images[index], "gaussian_noise", 2, seed=3)
  top1, _ = outcome(noisy, data.labels[index])
  assert out["corruption/gaussian_noise/s2"]["correct"].tolist() == \
      top1.tolist()
  # The attacks: indices of the 7-image subset of the 20; the per-image
  # accuracy is the logged one.
  lines = [json.loads(l) for l in open(os.path.join(tmp_path,
                                                    "metrics.jsonl"))]
  logged = [l for l in lines if l["split"] == "adversarial/fgsm"]
  small = out["adversarial/fgsm/eps=0.2"]
  assert small["index"].tolist() == index[np.linspace(0, 19, 7).round()
                                          .astype(int)].tolist()
  for name, line in zip(("adversarial/fgsm/eps=0.1",
                         "adversarial/fgsm/eps=0.2"), logged):
    assert out[name]["correct"].mean() == pytest.approx(line["accuracy"])
    assert out[name]["top5"].mean() == pytest.approx(line["top5_accuracy"])
  assert out["label"]["label"].tolist() == data.labels.tolist()
