"""`train.loss`: softmax or vmoe's sigmoid cross-entropy, in the train and
eval steps, against NumPy formulas written out by hand."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from test_mixup_step import B, tiny_config
from vmoe_ext.errors import ConfigError
from vmoe_ext.models import build_model
from vmoe_ext.train import steps
from vmoe_ext.train.optimizer import make_optimizer
from vmoe_ext.train.state import TrainState
from vmoe_ext.app.schema import validate_config


def numpy_loss(logits, targets, loss):
  """Per-example loss `[B]` of float64 logits and targets `[B, C]`."""
  z = np.asarray(logits, np.float64)
  t = np.asarray(targets, np.float64)
  if loss == "sigmoid_xent":
    p = 1 / (1 + np.exp(-z))
    return -np.sum(t * np.log(p) + (1 - t) * np.log(1 - p), -1)
  log_softmax = z - z.max(-1, keepdims=True)
  log_softmax -= np.log(np.exp(log_softmax).sum(-1, keepdims=True))
  return -np.sum(t * log_softmax, -1)


@pytest.mark.parametrize("loss", steps.LOSSES)
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_losses_against_the_formulas(loss, smoothing):
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(4, 5)).astype(np.float32) * 3
  labels = np.array([0, 4, 2, 2], np.int32)
  # Smoothing: t = (1 - s) one_hot + s / C.
  targets = np.eye(5)[labels] * (1 - smoothing) + smoothing / 5
  got = steps.cross_entropy(logits, labels, smoothing, loss)
  np.testing.assert_allclose(got, numpy_loss(logits, targets, loss),
                             rtol=1e-5)
  soft = rng.dirichlet(np.ones(5), 4).astype(np.float32)  # Soft targets.
  np.testing.assert_allclose(steps.cross_entropy(logits, soft, 0.0, loss),
                             numpy_loss(logits, soft, loss), rtol=1e-5)


def test_sigmoid_loss_in_the_train_and_eval_steps():
  config = tiny_config()
  model = build_model(config.model)
  rng = np.random.default_rng(1)
  images = rng.normal(size=(B, 8, 8, 1)).astype(np.float32)
  labels = rng.integers(0, 10, B).astype(np.int32)
  variables = jax.jit(model.init)(jax.random.key(0), images)
  state = TrainState.create(variables, make_optimizer(config.optimizer),
                            jax.random.key(1))
  gating, dropout = jax.random.split(state.step_key())
  logits, metrics = jax.jit(lambda v, x, r: model.apply(
      v, x, deterministic=False, rngs=r))(
          variables, images, {"gating": gating, "dropout": dropout})
  want = numpy_loss(logits, np.eye(10)[labels], "sigmoid_xent").mean()
  step = jax.jit(steps.make_train_step(model, loss_type="sigmoid_xent"))
  _, out = step(state, {"image": images, "label": labels})
  np.testing.assert_allclose(out["cross_entropy"], want, rtol=1e-5)
  np.testing.assert_allclose(out["loss"],
                             want + float(metrics["auxiliary_loss"]),
                             rtol=1e-5)
  # Evaluation sums the same loss over the real (masked) examples.
  mask = np.arange(B) < B - 3
  eval_logits, _ = jax.jit(lambda v, x: model.apply(
      v, x, deterministic=True))(variables, images)
  sums = jax.jit(steps.make_eval_step(model, "sigmoid_xent"))(
      state, {"image": images, "label": labels, "mask": mask})
  want = numpy_loss(eval_logits, np.eye(10)[labels], "sigmoid_xent")
  np.testing.assert_allclose(sums["loss"], want[mask].sum(), rtol=1e-5)


def test_unknown_loss_names_the_field():
  config = tiny_config()
  config.train.loss = "hinge"
  with pytest.raises(ConfigError) as e:
    validate_config(config)
  assert e.value.field == "train.loss", e.value
