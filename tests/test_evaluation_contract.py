"""The evaluation contracts: a new attack, or a new kind of evaluation
dataset, plugs into the robustness evaluation with one module and one
registry line (docs/robustness.md, "Add an attack", "Add an evaluation"),
as a router does (tests/test_contract.py).

The toy attack below (random signs of size eps, a key) is registered the
way the recipe says, configured through the `robustness` section (its
fields come from its signature, its check names the full field path), and
run by `evaluate_robustness`, whose numbers are checked against an
independent computation. The toy dataset kind (the docs' calibration
example) is registered and run by `evaluate_datasets` likewise.
"""

from __future__ import annotations

import inspect

import json
import os
import re
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from vmoe_ext import attacks
from vmoe_ext.attacks import ATTACKS, AttackSpec, make_attack
from vmoe_ext.attacks import base
from vmoe_ext.classification import topk_correct
from vmoe_ext.config import validate
from vmoe_ext.data import ArrayDataset, load_dataset
from vmoe_ext.data.readers import ArrayReader
from vmoe_ext.errors import ConfigError, require
from vmoe_ext.evaluate.config import ROBUSTNESS
from vmoe_ext.evaluate.datasets import (DATASET_KINDS, DatasetKind,
                                        check_datasets, evaluate_datasets)
from vmoe_ext.evaluate.evaluator import Evaluator
from vmoe_ext.evaluate.robustness import evaluate_robustness
from vmoe_ext.models import build_model
from vmoe_ext.reporting.writers import MetricWriter, read_metrics
from vmoe_ext.train.config_files import load_config
from tiny_evaluation import tiny_digits


# -- The attack module (what a user writes) ------------------------------


def random_sign(logits_fn: base.LogitsFn, x: jax.Array, labels: jax.Array,
                *, eps: float, key: Any = None, clip_min: float = 0.0,
                clip_max: float = 1.0, flips: int = 1) -> jax.Array:
  """`clip(x + eps * s)`, `s` random signs (`flips` draws, the last kept)."""
  del logits_fn  # A blind attack; gradient attacks call it on x only.
  check_random_sign(eps=eps, clip_min=clip_min, clip_max=clip_max,
                    flips=flips)
  base.check_inputs(x, labels)
  base.check_key(key, True, "(random signs)")
  for _ in range(flips):
    key, sub = jax.random.split(key)
  signs = jax.random.rademacher(sub, x.shape, x.dtype)
  return jnp.clip(x + eps * signs, clip_min, clip_max).astype(x.dtype)


def check_random_sign(*, eps: Any, clip_min: Any, clip_max: Any,
                      flips: Any) -> None:
  base.check_eps(eps)
  base.check_range(clip_min, clip_max)
  base.check_int(flips, "attack.flips", 1)
  require(flips <= 3, "attack.flips", f"at most 3, got {flips}")


# -- The registry line ----------------------------------------------------


@pytest.fixture
def registered():
  ATTACKS.register("random_sign", AttackSpec(
      "test_evaluation_contract:random_sign",
      "test_evaluation_contract:check_random_sign"))
  yield
  del ATTACKS.entries["random_sign"]


def test_a_registered_attack_is_configured_like_the_built_in_ones(
    registered):
  assert ATTACKS.get("random_sign") is random_sign
  assert ATTACKS.spec("random_sign").check is check_random_sign
  robustness = {"attacks": ({"name": "fgsm", "eps": 0.1},
                            {"name": "random_sign", "eps": 0.1,
                             "flips": 2, "num_examples": 10})}
  validate(ROBUSTNESS, robustness, "robustness")
  for attack, field in [
      ({"name": "random_sign", "eps": -0.1}, "robustness.attacks[1].eps"),
      ({"name": "random_sign", "eps": 0.1, "flips": 4},
       "robustness.attacks[1].flips"),
      ({"name": "random_sign", "eps": 0.1, "flips": 1.5},
       "robustness.attacks[1].flips"),
      ({"name": "random_sign", "eps": 0.1, "steps": 3},
       "robustness.attacks[1].steps"),
      ({"name": "random_sign"}, "robustness.attacks[1].eps"),
  ]:
    with pytest.raises(ConfigError, match=re.escape(field)):
      validate(ROBUSTNESS, {"attacks": ({"name": "fgsm", "eps": 0.1},
                                        attack)}, "robustness")
  # The sweep takes it too (eps from the sweep).
  validate(ROBUSTNESS, {"sweep": {"attack": {"name": "random_sign"},
                                  "eps": (0.0, 0.1)}}, "robustness")
  with pytest.raises(ConfigError) as e:
    make_attack({"name": "random_sign", "eps": 0.1, "flips": 9})
  assert e.value.field == "attack.flips"


def test_a_registered_attack_runs_in_the_robustness_evaluation(
    registered, tmp_path):
  model, variables, data = tiny_digits()
  data_config = ml_collections.ConfigDict({"mean": 0.3, "std": 0.4})
  writer = MetricWriter(str(tmp_path), tensorboard=False)
  sections = evaluate_robustness(
      model, variables, data, data_config,
      {"attacks": ({"name": "random_sign", "eps": 0.3},), "seed": 5},
      batch_size=10, writer=writer, step=7, workdir=str(tmp_path))
  writer.close()
  assert "random_sign" in sections[0]
  lines = [json.loads(l) for l in open(os.path.join(tmp_path,
                                                    "metrics.jsonl"))]
  (line,) = [l for l in lines if l["split"] == "adversarial/random_sign"]
  # Independently: the same signs (key fold_in(key(seed), batch)) drawn
  # by hand, the same batches.
  evaluator = Evaluator(model, variables, 0.3, 0.4)
  correct = clean = 0
  for i, start in enumerate((0, 10)):
    x = data.images[start:start + 10]
    y = data.labels[start:start + 10]
    _, sub = jax.random.split(jax.random.fold_in(jax.random.key(5), i))
    x_adv = jnp.clip(x + 0.3 * jax.random.rademacher(sub, x.shape,
                                                       x.dtype), 0, 1)
    correct += int(np.sum(np.argmax(evaluator.forward(x_adv)[0], -1) == y))
    clean += int(np.sum(np.argmax(evaluator.forward(x)[0], -1) == y))
  assert line["accuracy"] == pytest.approx(correct / 20)
  assert line["clean_accuracy"] == pytest.approx(clean / 20)
  assert line["eps"] == 0.3 and line["num_examples"] == 20


def test_the_contract_is_checked_when_the_attack_is_looked_up():

  def no_check_for_flips(*, eps, clip_min, clip_max):
    del eps, clip_min, clip_max

  def positional_check(eps, clip_min, clip_max, flips):
    del eps, clip_min, clip_max, flips

  def wrong_order(x, logits_fn, labels, *, eps):
    del x, logits_fn, labels, eps

  cases = [
      (AttackSpec(random_sign, no_check_for_flips), "exactly the config"),
      (AttackSpec(random_sign, positional_check), "exactly the config"),
      (AttackSpec(wrong_order, base.check_eps), "must take"),
  ]
  for spec, message in cases:
    ATTACKS.entries["broken"] = spec
    try:
      with pytest.raises(TypeError, match=message):
        make_attack({"name": "broken", "eps": 0.1})
    finally:
      del ATTACKS.entries["broken"]
  with pytest.raises(TypeError, match="AttackSpec"):
    ATTACKS.register("bare", random_sign)
  with pytest.raises(ValueError, match="already registered"):
    ATTACKS.register("fgsm", ATTACKS.spec("fgsm"))


def test_every_built_in_attack_follows_the_contract():
  for name in ATTACKS:
    spec = ATTACKS.spec(name)
    # The package exports the original attacks; the AutoAttack family is
    # its modules' function of the same name (`attacks.apgd.apgd`).
    exported = getattr(attacks, name)
    assert spec.fn is (getattr(exported, name) if inspect.ismodule(exported)
                       else exported)
    assert spec.check.__name__ == f"check_{name}"
    if spec.details is not None:
      assert (list(inspect.signature(spec.details).parameters)
              == list(inspect.signature(spec.fn).parameters))


# -- A new kind of evaluation dataset (the docs' example) -----------------


class CalibrationDatasets(DatasetKind):
  """Expected calibration error of a source (`bins` confidence bins)."""
  fields = ("bins",)

  def check(self, entry, field):
    entry.setdefault("bins", 15)
    require(isinstance(entry["bins"], int) and entry["bins"] > 0,
            f"{field}.bins", f"must be a positive integer, got "
            f"{entry['bins']!r}")
    return entry

  def evaluate(self, ctx, name, entry, field):
    reader = ctx.open(entry["source"], f"{field}.source")
    logits, labels = ctx.predict(reader, entry["source"], f"{field}.source",
                                 desc=name)
    z = logits - logits.max(-1, keepdims=True)
    p = np.exp(z) / np.exp(z).sum(-1, keepdims=True)
    conf, hit = p.max(-1), topk_correct(logits, labels, 1)
    bins = np.minimum((conf * entry["bins"]).astype(int), entry["bins"] - 1)
    ece = sum(abs(hit[bins == b].mean() - conf[bins == b].mean())
              * np.mean(bins == b) for b in np.unique(bins))
    return {"ece": float(ece), "num_examples": len(labels)}

  def write(self, result, name, entry, *, writer, step, workdir):
    writer.write(step, f"calibration/{name}", result)
    return f"## Calibration `{name}`\n\nECE {result['ece']:.4f}"

  def row(self, name, result):
    return [name, result["ece"]]

  def table(self, rows):
    return "## Calibration summary\n\n" + repr(rows)


@pytest.fixture
def calibration():
  DATASET_KINDS.register("calibration",
                         "test_evaluation_contract:CalibrationDatasets")
  yield
  del DATASET_KINDS.entries["calibration"]


def test_a_registered_dataset_kind_is_checked_and_run(calibration, tmp_path):
  entries = check_datasets({"a": {"kind": "calibration", "source": "test"}})
  assert entries["a"]["bins"] == 15
  for entry, field in [
      ({"kind": "calibration", "source": "test", "bins": 0},
       "robustness.datasets.a.bins"),
      ({"kind": "calibration", "source": "test", "split": "x"},
       "robustness.datasets.a.split"),
      ({"kind": "calibration"}, "robustness.datasets.a.source"),
      ({"kind": "calibrate", "source": "test"},
       "robustness.datasets.a.kind"),
  ]:
    with pytest.raises(ConfigError) as e:
      check_datasets({"a": entry})
    assert e.value.field == field
  assert "'calibration'" in str(_error({"kind": "x", "source": "test"}))

  config = load_config("tiny")
  test = load_dataset(config.data)["test"]
  data = ArrayDataset(test.images[:12], test.labels[:12], 10, "digits")
  model = build_model(config.model)
  variables = model.init(jax.random.key(0), jnp.zeros((4, 8, 8, 1)))
  evaluator = Evaluator(model, variables, 0.3, 0.4)
  writer = MetricWriter(str(tmp_path), tensorboard=False)
  sections = evaluate_datasets(
      evaluator, data, {"image_size": None, "data_dir": None},
      {"a": {"kind": "calibration", "source": "test", "bins": 4},
       "b": {"kind": "accuracy", "source": "test"}},
      batch_size=4, writer=writer, step=3, workdir=str(tmp_path))
  writer.close()
  records = {r["split"]: r for r in read_metrics(str(tmp_path))}
  # ECE by hand, of the logits of the same padded batches.
  logits, labels = evaluator.predict(ArrayReader(data), 4)
  np.testing.assert_array_equal(labels, data.labels)
  logits = np.asarray(logits, np.float64)
  p = np.exp(logits - logits.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  conf, hit = p.max(-1), p.argmax(-1) == data.labels
  ece = 0.0
  for b in range(4):
    inside = np.minimum((conf * 4).astype(int), 3) == b
    if inside.any():
      ece += abs(hit[inside].mean() - conf[inside].mean()) * inside.mean()
  assert records["calibration/a"]["ece"] == pytest.approx(ece, abs=1e-5)
  assert records["calibration/a"]["num_examples"] == 12
  assert records["dataset/b"]["accuracy"] == pytest.approx(hit.mean())
  # Own section in entry order, then the summary tables in kind order.
  assert [s.splitlines()[0] for s in sections] == [
      "## Calibration `a`", "## Accuracy on evaluation datasets",
      "## Calibration summary"]


def _error(entry):
  with pytest.raises(ConfigError) as e:
    check_datasets({"a": entry})
  return e.value
