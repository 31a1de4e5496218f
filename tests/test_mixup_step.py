"""vmoe's mixup in the jitted train step (`make_train_step(mixup=...)`): off
is bit-identical to no mixup, on equals a NumPy reference (weights from the
documented key, a per-example mixing loop, soft-target cross-entropy, a hand
SGD update), the key's derivation, the config checks, kill-and-resume."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from resume_check import short_schedule, straight_vs_resumed
from vmoe_ext.errors import ConfigError
from vmoe_ext.models import build_model
from vmoe_ext.app import context
from vmoe_ext.train import steps
from vmoe_ext.train.config_files import load_config
from vmoe_ext.train.optimizer import make_optimizer
from vmoe_ext.train.state import TrainState
from vmoe_ext.app.schema import validate_config

B, CLASSES, LR = 8, 10, 0.5
MIX_KEY = 0x6d6978  # "mix": folded into the step key for the weights.


def tiny_config(**mixup):
  """`configs/tiny.py` (8x8 digits, 2 experts, noisy top-1) with one MoE
  block (half the compile time), dropout (so the dropout key matters),
  plain SGD at a constant rate and `train.mixup = mixup` (None when empty)."""
  config = load_config("tiny")
  config.model.num_layers = 1
  config.model.moe.every = 1
  config.model.dropout_rate = 0.1
  config.optimizer = ml_collections.ConfigDict(dict(
      name="sgd", learning_rate=LR, warmup_steps=0, decay="constant",
      total_steps=config.train.total_steps))
  config.train.mixup = dict(mixup) if mixup else None
  return config


@pytest.fixture(scope="module")
def setup():
  """The tiny model, its state at step 0 and a batch of B random examples."""
  config = tiny_config()
  model = build_model(config.model)
  rng = np.random.default_rng(0)
  batch = {"image": rng.normal(size=(B, 8, 8, 1)).astype(np.float32),
           "label": rng.integers(0, CLASSES, B).astype(np.int32)}
  variables = jax.jit(model.init)(jax.random.key(0), batch["image"])
  state = TrainState.create(variables, make_optimizer(config.optimizer),
                            jax.random.key(1))
  return model, state, batch


@pytest.fixture(scope="module")
def reference_grad(setup):
  """jitted `(params, images, targets, step key) -> ((loss, logits), grads)`
  with loss = mean(-sum targets * log_softmax(logits)) + auxiliary loss, the
  model applied directly (gating and dropout keys: split of the step key)."""
  model, state, _ = setup

  def loss_fn(params, images, targets, key):
    gating, dropout = jax.random.split(key)
    out = model.apply({"params": params, **state.collections}, images,
                      deterministic=False,
                      rngs={"gating": gating, "dropout": dropout},
                      mutable=list(state.collections) or False,
                      update_state=True)
    logits, metrics = out[0] if state.collections else out
    ce = jnp.mean(-jnp.sum(targets * jax.nn.log_softmax(logits), -1))
    return ce + metrics["auxiliary_loss"], logits

  _, _, batch = setup
  images = np.zeros_like(batch["image"])
  targets = np.zeros((B, CLASSES), np.float32)
  return jax.jit(jax.value_and_grad(loss_fn, has_aux=True)).lower(
      state.params, images, targets, state.step_key()).compile(FAST_COMPILE)


# XLA's backend optimisation level 0 halves the compile time of the reference
# and the recording steps: it changes the machine code, not the HLO program
# (float32 semantics). The bit-identity and end-to-end tests compile as the
# loop does.
FAST_COMPILE = {"xla_backend_optimization_level": 0}
_COMPILED = {}  # Recording steps by (label_smoothing, mixup): one model here.
MIXED = []  # The mixed targets of every call of a recording step.


def jitted_step(model, label_smoothing=0.0, mixup=None):
  return jax.jit(steps.make_train_step(model, label_smoothing=label_smoothing,
                                       mixup=mixup))


def recording_step(setup, label_smoothing, mixup):
  """The compiled step whose `mixup_jax` appends the mixed targets of every
  call to `MIXED` (a host callback, under jit); compiled once per module."""
  model, state, batch = setup
  key = (label_smoothing, tuple(sorted(mixup.items())))
  if key not in _COMPILED:
    real = steps.mixup_jax

    def record(key, images, labels, **kwargs):
      images, targets = real(key, images, labels, **kwargs)
      jax.debug.callback(lambda t: MIXED.append(np.asarray(t)), targets)
      return images, targets

    with pytest.MonkeyPatch.context() as patch:  # Traced here, then undone.
      patch.setattr(steps, "mixup_jax", record)
      _COMPILED[key] = jitted_step(model, label_smoothing, mixup).lower(
          state, batch).compile(FAST_COMPILE)
  MIXED.clear()
  return _COMPILED[key]


def step_key(state):
  return jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)


def reference_weights(state, shape, concentration):
  """Dirichlet weights from fold_in(step key, "mix"), sorted decreasing."""
  key = jax.random.fold_in(step_key(state), MIX_KEY)
  w = np.asarray(jax.random.dirichlet(
      key, jnp.full(shape, concentration, jnp.float32)))
  return -np.sort(-w, axis=-1)


def naive_mix(x, w, groups):
  """out[b] = sum_i w_b[i] x[start + (b - start + i) mod n], one example at
  a time (n = B / groups, start = the first example of b's group)."""
  x = np.asarray(x, np.float32)
  n = x.shape[0] // groups
  out = np.zeros_like(x)
  for b in range(x.shape[0]):
    g, j = divmod(b, n)
    wb = w[0 if w.shape[0] == 1 else g, 0 if w.shape[1] == 1 else j]
    for i in range(w.shape[-1]):
      out[b] += wb[i] * x[g * n + (j + i) % n]
  return out


def reference_mixup(state, batch, *, label_smoothing, concentration, size,
                    granularity, groups):
  """Mixed images and label-smoothed one-hot targets, by `naive_mix`."""
  shape = {"batch": (1, 1, size), "device": (groups, 1, size),
           "example": (groups, B // groups, size)}[granularity]
  w = reference_weights(state, shape, concentration)
  targets = np.eye(CLASSES, dtype=np.float32)[batch["label"]]
  targets = targets * (1 - label_smoothing) + label_smoothing / CLASSES
  return naive_mix(batch["image"], w, groups), naive_mix(targets, w, groups)


def test_mixup_off_is_bit_identical_to_no_mixup(setup):
  model, state, batch = setup
  base_state, base_metrics = jitted_step(model, 0.1)(state, batch)
  for mixup in ({"concentration": None}, {"concentration": 0.0, "size": 3}):
    new_state, metrics = jitted_step(model, 0.1, mixup)(state, batch)
    chex.assert_trees_all_equal(new_state, base_state)
    chex.assert_trees_all_equal(metrics, base_metrics)
  assert steps.mixup_options(None) is None
  assert steps.mixup_options({"concentration": 0.0}) is None


def test_mixup_options_defaults_and_groups_resolution():
  assert steps.mixup_options({"concentration": 0.2}) == dict(
      concentration=0.2, size=2, granularity="device",
      groups=jax.device_count())
  assert steps.mixup_options(ml_collections.ConfigDict(dict(
      concentration=0.5, size=3, granularity="example", groups=4))) == dict(
          concentration=0.5, size=3, granularity="example", groups=4)


EXAMPLE_CASE = (0.1, {"concentration": 0.8, "size": 3,
                      "granularity": "example", "groups": 2})


@pytest.mark.parametrize("label_smoothing,mixup", [
    (0.0, {"concentration": 0.5, "granularity": "batch"}),
    (0.1, {"concentration": 0.2, "granularity": "device", "groups": 2}),
    EXAMPLE_CASE,
])
def test_mixup_step_equals_reference(setup, reference_grad, label_smoothing,
                                     mixup):
  _, state, batch = setup
  step = recording_step(setup, label_smoothing, mixup)
  options = steps.mixup_options(mixup)
  # Step 0, then step 1 from the updated state (other weights and keys).
  for n in range(2):
    new_state, metrics = step(state, batch)
    images, targets = reference_mixup(
        state, batch, label_smoothing=label_smoothing, **options)
    np.testing.assert_allclose(MIXED[n], targets, rtol=1e-6, atol=1e-7)
    assert np.abs(images - batch["image"]).max() > 0.1  # Really mixed.
    (loss, logits), grads = reference_grad(state.params, images, targets,
                                           step_key(state))
    np.testing.assert_allclose(float(metrics["loss"]), float(loss),
                               rtol=1e-6)
    # The SGD update p - lr * g by hand. The step and the reference are
    # different XLA programs (fused differently), so each new param agrees
    # to float32 round-off: 4 ulps of the param, 1e-5 of its leaf's largest
    # update, 1e-8 for the attention key biases (gradient mathematically 0).
    flat = jax.tree_util.tree_leaves_with_path(state.params)
    for (path, p), new, g in zip(flat, jax.tree.leaves(new_state.params),
                                 jax.tree.leaves(grads)):
      g = np.asarray(g)
      np.testing.assert_allclose(
          new, np.asarray(p) - LR * g, rtol=5e-7,
          atol=1e-5 * LR * float(np.abs(g).max()) + 1e-8,
          err_msg=jax.tree_util.keystr(path))
    # Accuracy is against the original labels (each keeps the largest weight).
    assert float(metrics["accuracy"]) == np.mean(
        np.argmax(logits, -1) == batch["label"])
    assert int(new_state.step) == int(state.step) + 1
    state = new_state
  assert len(MIXED) == 2


def test_mixup_weights_change_every_step_and_are_reproducible(setup):
  _, state, batch = setup
  step = recording_step(setup, *EXAMPLE_CASE)
  states = [state]
  for _ in range(3):
    states.append(step(states[-1], batch)[0])
  first = list(MIXED)
  assert len(first) == 3
  for a, b in zip(first, first[1:]):
    assert not np.allclose(a, b)
  # The same states again (the step is a pure function of them): the same
  # mixed targets and the same next state, bit for bit.
  for old in states[:3]:
    again = step(old, batch)[0]
  assert len(MIXED) == 6
  for a, b in zip(first, MIXED[3:]):
    np.testing.assert_array_equal(a, b)
  chex.assert_trees_all_equal(again, states[3])


@pytest.mark.parametrize("mixup,field,message", [
    ({"concentration": 0.2, "groups": 3}, "train.mixup.groups",
     r"data\.batch_size=32 does not split into 3 .*groups=None resolves "
     r"to jax\.device_count\(\) = \d+"),
    ({"concentration": 0.2, "groups": 2, "size": 17}, "train.mixup.size",
     r"17 examples .* exceed the 16 examples of a mixing group "
     r"\(data\.batch_size=32 / 2 groups"),
    ({"concentration": -0.5}, "train.mixup.concentration", "-0.5"),
    ({"concentration": 0.2, "granularity": "token"},
     "train.mixup.granularity", "token"),
    ({"concentration": 0.2, "size": 0}, "train.mixup.size", ">= 1"),
])
def test_config_errors_name_the_field(mixup, field, message):
  config = tiny_config(**mixup)
  with pytest.raises(ConfigError, match=message) as error:
    validate_config(config)
  assert error.value.field == field


def test_config_checks_only_with_mixup_on():
  # groups=None is one group per device; off, nothing beyond the schema.
  validate_config(tiny_config(concentration=0.2, size=32 // jax.device_count()))
  validate_config(tiny_config(concentration=0.0, groups=3, size=64))
  validate_config(tiny_config())


def test_kill_and_resume_with_mixup_is_bit_identical(tmp_path, monkeypatch):
  built = []  # The run builds its step with the config's mixup section.
  real = context.make_train_step
  monkeypatch.setattr(context, "make_train_step", lambda model, **kwargs: (
      built.append(kwargs["mixup"]) or real(model, **kwargs)))

  def config():
    c = short_schedule(load_config("tiny"), total_steps=4)
    c.model.update(dict(num_layers=1, dropout_rate=0.1))
    c.model.moe.every = 1
    # SGD with momentum (optimizer state to resume) compiles 3x faster than
    # the tiny config's AdamW with clipping and decay masks.
    c.optimizer = ml_collections.ConfigDict(dict(
        name="sgd", learning_rate=0.5, momentum=0.9, warmup_steps=2,
        decay="cosine", total_steps=4))
    c.train.label_smoothing = 0.1
    c.train.mixup = dict(concentration=0.5, granularity="example", groups=2)
    return c

  final, state = straight_vs_resumed(config, tmp_path, stop_at_step=2)
  assert int(state.step) == 4 and np.isfinite(final["loss"])
  assert len(built) == 3 and all(
      steps.mixup_options(m) == dict(concentration=0.5, size=2,
                                     granularity="example", groups=2)
      for m in built)
