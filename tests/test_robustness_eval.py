"""Robustness evaluation: metrics against independent per-token/per-example
computations, the evaluation-only binary, and its config errors."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from vmoe_ext.data import ArrayDataset
from vmoe_ext.errors import ConfigError
from vmoe_ext.config import validate
from vmoe_ext.evaluate.config import ROBUSTNESS
from vmoe_ext.evaluate.robustness import Evaluator, attack_metrics
from vmoe_ext.models import build_model
from vmoe_ext.train.config_files import CONFIG_DIR
from tiny_evaluation import tiny_digits

ROOT = os.path.dirname(CONFIG_DIR)


@pytest.fixture(scope="module")
def setup():
  model, variables, data = tiny_digits()
  return Evaluator(model, variables, 0.3, 0.4), data


def test_attack_metrics_match_an_independent_computation(setup):
  evaluator, data = setup
  attack = {"name": "fgsm", "eps": 0.2}
  got = attack_metrics(evaluator, data, attack, batch_size=10, seed=0)
  # Independent: FGSM by hand (sign of the input gradient of the mean
  # cross-entropy), then per token set IoU with Python sets.
  x = jnp.asarray(data.images)
  y = jnp.asarray(data.labels)
  changes, clean, adv, pred_change = [], 0, 0, 0

  @jax.jit  # One compilation for both batches, not op-by-op eager ones.
  @jax.grad
  def grad(z, yb):
    logits = evaluator.logits_fn(z)
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits),
                                         yb[:, None], 1))

  for start in (0, 10):
    xb, yb = x[start:start + 10], y[start:start + 10]
    xa = jnp.clip(xb + 0.2 * jnp.sign(grad(xb, yb)), 0, 1)
    lc, mc = evaluator.forward(xb)
    la, ma = evaluator.forward(xa)
    clean += int(np.sum(np.argmax(lc, -1) == yb))
    adv += int(np.sum(np.argmax(la, -1) == yb))
    pred_change += int(np.sum(np.argmax(lc, -1) != np.argmax(la, -1)))
    (block,) = mc  # one MoE block in the tiny model
    a, b = np.asarray(mc[block]), np.asarray(ma[block])
    for n, t in np.ndindex(a.shape[:2]):
      sa, sb = set(np.flatnonzero(a[n, t])), set(np.flatnonzero(b[n, t]))
      union = sa | sb
      changes.append(1 - (len(sa & sb) / len(union) if union else 1.0))
  assert got["clean_accuracy"] == pytest.approx(clean / 20)
  assert got["accuracy"] == pytest.approx(adv / 20)
  assert got["prediction_change_rate"] == pytest.approx(pred_change / 20)
  assert got["layer_1/routing_change_rate"] == pytest.approx(
      np.mean(changes), abs=1e-6)
  assert got["layer_1/routing_change_rate"] > 0


def test_zero_eps_changes_nothing(setup):
  evaluator, data = setup
  got = attack_metrics(evaluator, data, {"name": "pgd", "eps": 0.0,
                                         "steps": 3}, batch_size=10, seed=0)
  assert got["accuracy"] == got["clean_accuracy"]
  assert got["prediction_change_rate"] == 0.0
  assert got["layer_1/routing_change_rate"] == 0.0


def test_padding_does_not_count(setup):
  evaluator, data = setup
  # 20 examples in batches of 8: the last batch has 4 padded rows.
  a = attack_metrics(evaluator, data, {"name": "fgsm", "eps": 0.1},
                     batch_size=10, seed=0)
  subset = ArrayDataset(data.images[:10], data.labels[:10], 10, "digits")
  b = attack_metrics(evaluator, subset, {"name": "fgsm", "eps": 0.1},
                     batch_size=10, seed=0)
  c = attack_metrics(evaluator, ArrayDataset(data.images[10:],
                                             data.labels[10:], 10, "digits"),
                     {"name": "fgsm", "eps": 0.1}, batch_size=10, seed=0)
  assert a["accuracy"] == pytest.approx((b["accuracy"] + c["accuracy"]) / 2)


@pytest.mark.parametrize("robustness,field", [
    ({"attacks": ({"name": "deepfool", "eps": 0.1},)},
     "robustness.attacks[0].name"),
    ({"attacks": ({"name": "fgsm", "eps": -0.1},)},
     "robustness.attacks[0].eps"),
    ({"attacks": ({"name": "pgd", "eps": 0.1, "steps": -1},)},
     "robustness.attacks[0].steps"),
    ({"sweep": {"attack": {"name": "pgd", "steps": 2}, "eps": (0.1, -1.0)}},
     "robustness.sweep.eps"),
    ({"corruptions": {"names": ("rain",)}}, "robustness.corruptions.names"),
    ({"corruptions": {"severities": (0,)}},
     "robustness.corruptions.severities"),
    ({"num_examples": 0}, "robustness.num_examples"),
    ({"epsilon": 0.1}, "robustness.epsilon"),
    ({"attacks": ({"name": "autoattack", "eps": 0.1, "version": "plus"},)},
     "robustness.attacks[0].version"),
    ({"attacks": ({"name": "autoattack", "eps": 0.1,
                   "attacks": ("apgd-ce", "cw")},)},
     "robustness.attacks[0].attacks[1]"),
    ({"attacks": ({"name": "apgd", "eps": 0.1, "schedule": "fast"},)},
     "robustness.attacks[0].schedule"),
    ({"attacks": ({"name": "square", "eps": 0.1, "p_init": 2.0},)},
     "robustness.attacks[0].p_init"),
    ({"attacks": ({"name": "fab", "eps": 0.1, "beta": 0.0},)},
     "robustness.attacks[0].beta"),
])
def test_robustness_config_errors(robustness, field):
  with pytest.raises(ConfigError, match=re.escape(field)):
    validate(ROBUSTNESS, robustness, "robustness")


def _run(args):
  return subprocess.run([sys.executable, "-m", "vmoe_ext.main", *args],
                        cwd=ROOT, capture_output=True, text=True, timeout=900)


def test_evaluation_binary_without_checkpoint_is_a_clear_error(tmp_path):
  proc = _run(["--config=configs/tiny.py", f"--workdir={tmp_path / 'e'}",
               f"--config.robustness.checkpoint_dir={tmp_path / 'none'}"])
  assert proc.returncode == 2
  assert "config error: robustness.checkpoint_dir" in proc.stderr


def test_attacks_differing_only_in_eps_share_one_compilation(setup):
  """An eps sweep compiles once: eps is an argument of the compiled attack;
  each eps gives what the attack computes with that eps as a constant."""
  from vmoe_ext.attacks import pgd
  evaluator, data = setup
  x, y = jnp.asarray(data.images[:10]), jnp.asarray(data.labels[:10])
  key = jax.random.key(3)
  before = len(evaluator._attacks)
  for eps in (0.05, 0.2):
    got = evaluator.attack({"name": "pgd", "eps": eps, "steps": 2})(x, y, key)
    want = jax.jit(lambda z, w, k, eps=eps: pgd(
        evaluator.logits_fn, z, w, eps=eps, steps=2, key=k))(x, y, key)
    np.testing.assert_allclose(got, want, atol=1e-6)
    assert float(jnp.max(jnp.abs(got - x))) <= eps + 1e-6
  assert len(evaluator._attacks) == before + 1
  with pytest.raises(ConfigError, match="attack.eps"):
    evaluator.attack({"name": "pgd", "eps": -1.0, "steps": 2})


def test_a_resizing_run_attacks_the_stored_images():
  """`data.image_size`: the evaluator resizes the stored 8 x 8 images as the
  pipeline does (`preprocessing.resize`) inside the forward pass, so its
  clean logits are the model's on the pipeline's 12 x 12 images, and an
  attack perturbs the stored images within eps of them."""
  from vmoe_ext.data.preprocessing import resize
  model = build_model(dict(name="vit", num_classes=3, patch_size=(6, 6),
                           hidden_size=8, num_layers=1, num_heads=2,
                           mlp_dim=8, head_kernel_zero_init=False))
  images = np.asarray(jax.random.uniform(jax.random.key(0), (4, 8, 8, 1)))
  labels = np.array([0, 1, 2, 0])
  variables = model.init(jax.random.key(1), np.zeros((1, 12, 12, 1)))
  evaluator = Evaluator(model, variables, 0.5, 0.25, image_size=12)
  want = model.apply(variables, (resize(images, 12) - 0.5) / 0.25)[0]
  np.testing.assert_allclose(evaluator.logits_fn(images), want, atol=1e-5)
  adv = np.asarray(evaluator.attack({"name": "fgsm", "eps": 0.1})(
      images, labels, jax.random.key(2)))
  assert adv.shape == images.shape
  assert np.abs(adv - images).max() == pytest.approx(0.1, abs=1e-6)
