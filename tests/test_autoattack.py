"""The AutoAttack ensemble: its bookkeeping with stub attacks (a point robust
to one attack and broken by the next counts as broken; later attacks see
the broken points at their adversarial points), the standard and rand
versions on a tiny MLP and on the tiny V-MoE through the robustness
evaluation (metrics, report, plot), and config errors."""

from __future__ import annotations

import functools
import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from vmoe_ext.attacks import autoattack as AA
from vmoe_ext.attacks import base, make_attack
from vmoe_ext.attacks import square as SQ
from vmoe_ext.attacks.progress import listening
from vmoe_ext.data import ArrayDataset, load_dataset
from vmoe_ext.errors import ConfigError
from vmoe_ext.evaluate.robustness import evaluate_robustness
from vmoe_ext.models import build_model
from vmoe_ext.reporting.writers import MetricWriter
from vmoe_ext.train.config_files import load_config

B, SHAPE = 4, (2, 2, 1)


def two_class(x):
  """Class 0 iff the mean pixel is above 0.5 (logits `[s, -s]`)."""
  s = jnp.mean(x.reshape(x.shape[0], -1), -1) - 0.5
  return jnp.stack([s, -s], -1)


def _stub(breaks, value=0.0, seen=None):
  """A stage that moves the examples `breaks` to `value` (misclassified)
  and records the `done` mask and start points it was given."""

  def run(logits_fn, x0, labels, key, x_start, done, eps, lo, hi):
    del logits_fn, labels, key, eps, lo, hi
    if seen is not None:
      seen.append((np.asarray(done), np.asarray(x_start)))
    mask = jnp.zeros((x0.shape[0],), bool).at[jnp.asarray(breaks)].set(True)
    mask = mask & ~done
    return base.where_examples(mask, jnp.full_like(x0, value), x_start), {}

  return run


def test_chain_bookkeeping_with_stub_attacks():
  x0 = jnp.full((B,) + SHAPE, 0.9)
  x0 = x0.at[3].set(0.1)  # Example 3 is misclassified at the clean image.
  labels = jnp.zeros((B,), jnp.int32)
  seen = []
  runs = [("apgd-ce", _stub([0], seen=seen)),
          ("apgd-t", _stub([0, 1], value=0.2, seen=seen)),
          ("square", _stub([2], seen=seen))]
  x_adv, d = AA.run_chain(two_class, x0, labels, jax.random.key(0), 0.1,
                          0.0, 1.0, runs)
  np.testing.assert_array_equal(d["clean_correct"], [1, 1, 1, 0])
  np.testing.assert_array_equal(d["robust_after/apgd-ce"], [0, 1, 1, 0])
  np.testing.assert_array_equal(d["robust_after/apgd-t"], [0, 0, 1, 0])
  np.testing.assert_array_equal(d["robust_after/square"], [0, 0, 0, 0])
  np.testing.assert_array_equal(d["square_only"], [0, 0, 1, 0])
  # The second attack saw example 0 done, at the first attack's point, and
  # left it there (its own move of example 0 was not applied).
  np.testing.assert_array_equal(seen[1][0], [1, 0, 0, 1])
  assert np.all(seen[1][1][0] == 0.0)
  assert np.all(np.asarray(x_adv[0]) == 0.0)
  assert np.all(np.asarray(x_adv[1]) == 0.2)
  np.testing.assert_array_equal(x_adv[3], x0[3])


def test_the_chain_reports_each_stage_to_the_listener_of_the_call():
  """After each stage the compiled chain tells the listener active when it
  runs (not when it was traced) how many examples are still robust: the
  counts of its own `robust_after` details."""
  x0 = jnp.full((B,) + SHAPE, 0.9).at[3].set(0.1)
  labels = jnp.zeros((B,), jnp.int32)
  runs = [("apgd-ce", _stub([0])), ("apgd-t", _stub([0, 1], value=0.2)),
          ("square", _stub([2]))]
  chain = jax.jit(lambda x: AA.run_chain(two_class, x, labels,
                                         jax.random.key(0), 0.1, 0.0, 1.0,
                                         runs))
  x_quiet, d_quiet = chain(x0)  # Compiled with no listener.
  heard = []
  with listening(lambda stage, robust: heard.append((stage, robust))):
    x_adv, d = jax.block_until_ready(chain(x0))
  assert [s for s, _ in heard] == ["apgd-ce", "apgd-t", "square"]
  for (stage, robust), expected in zip(heard, ([0, 1, 1, 0], [0, 0, 1, 0],
                                               [0, 0, 0, 0])):
    np.testing.assert_array_equal(robust, np.array(expected, bool))
    np.testing.assert_array_equal(robust, d[f"robust_after/{stage}"])
  chain(x0)[0].block_until_ready()  # The listener is gone: nothing heard.
  assert len(heard) == 3
  np.testing.assert_array_equal(x_adv, x_quiet)
  for k in d:
    np.testing.assert_array_equal(d[k], d_quiet[k])


def _mlp_params(d=16, hidden=12, classes=5):
  k1, k2 = jax.random.split(jax.random.key(0))
  return (jax.random.normal(k1, (d, hidden)) / 4,
          jax.random.normal(k2, (hidden, classes)) * 2)


W1, W2 = _mlp_params()


def mlp(x, key=None):
  h = x.reshape(x.shape[0], -1)
  if key is not None:  # A stochastic pass: multiplicative input noise.
    h = h * (1 + 0.3 * jax.random.normal(key, h.shape))
  return jnp.tanh(h @ W1) @ W2


X = jax.random.uniform(jax.random.key(3), (8, 4, 4, 1))
Y = jnp.argmax(mlp(X), -1).astype(jnp.int32)
SMALL = dict(steps=6, queries=30, target_classes=3)


def test_standard_version_on_a_tiny_mlp():
  eps = 0.08
  x_adv, d = AA.autoattack_details(mlp, X, Y, eps=eps, key=jax.random.key(1),
                                   **SMALL)
  after = [float(jnp.mean(d[f"robust_after/{s}"]))
           for s in AA.VERSIONS["standard"]]
  assert after == sorted(after, reverse=True)  # Never un-broken.
  assert 0 < after[-1] < 1  # The case is not trivial.
  # No batch coupling here: the bookkeeping equals the final evaluation.
  acc = np.asarray(jnp.argmax(mlp(x_adv), -1) == Y)
  np.testing.assert_array_equal(acc, d["robust_after/square"])
  assert float(jnp.max(jnp.abs(x_adv - X))) <= eps + 1e-6
  assert float(jnp.min(x_adv)) >= 0 and float(jnp.max(x_adv)) <= 1
  # The ensemble is at least as strong as its first attack alone.
  first = make_attack({"name": "apgd", "eps": eps, "steps": 6})
  alone = first(mlp, X, Y, jax.random.key(1))
  assert after[-1] <= float(jnp.mean(jnp.argmax(mlp(alone), -1) == Y))


def test_rand_version_averages_stochastic_passes():
  calls = []

  def counting(x, key=None):
    calls.append(key is not None)
    return mlp(x, key)

  x_adv = AA.autoattack(counting, X, Y, eps=0.08, key=jax.random.key(2),
                        version="rand", steps=4, eot_iter=3)
  assert any(calls)  # The EOT gradients came from stochastic passes.
  assert float(jnp.max(jnp.abs(x_adv - X))) <= 0.08 + 1e-6
  calls.clear()
  AA.autoattack(counting, X, Y, eps=0.08, key=jax.random.key(2),
                attacks=("apgd-ce",), steps=4)
  assert calls and not any(calls)  # The standard version: deterministic.


# -- Square's settings in the ensemble against the released AutoAttack -------


def released_p_selection(it, p_init=0.8):
  """fra31/auto-attack `SquareAttack.p_selection` with `resc_schedule=False`
  (the standard version's), transcribed."""
  if 10 < it <= 50:
    return p_init / 2
  elif 50 < it <= 200:
    return p_init / 4
  elif 200 < it <= 500:
    return p_init / 8
  elif 500 < it <= 1000:
    return p_init / 16
  elif 1000 < it <= 2000:
    return p_init / 32
  elif 2000 < it <= 4000:
    return p_init / 64
  elif 4000 < it <= 6000:
    return p_init / 128
  elif 6000 < it <= 8000:
    return p_init / 256
  elif 8000 < it:
    return p_init / 512
  return p_init


W12 = jax.random.normal(jax.random.key(5), (16, 12))


def linear12(x):
  """12 classes: enough for APGD-T's and FAB-T's 9 target classes."""
  return x.reshape(x.shape[0], -1) @ W12


@pytest.mark.parametrize("config,rescale", [
    ({"name": "autoattack", "eps": 0.03}, False),
    ({"name": "autoattack", "eps": 0.03, "square_rescale_schedule": True},
     True)])
def test_standard_square_runs_the_released_schedule(monkeypatch, config,
                                                    rescale):
  """The config a user writes builds Square as the released standard
  version: p_init 0.8, 5,000 queries, `p` halving after iterations 10, 50,
  200, 500, 1000, 2000, 4000 (`resc_schedule=False`); the option restores
  the stretched schedule (halving after 5, 25, 100, ...)."""
  runs, schedules = [], []
  real_run, real_starts = AA.square_run, SQ.level_starts

  def square_run(*args, **kwargs):
    runs.append(kwargs)
    return real_run(*args, **kwargs)

  def level_starts(queries, rescale_schedule):
    schedules.append(real_starts(queries, rescale_schedule))
    return schedules[-1]

  monkeypatch.setattr(AA, "square_run", square_run)
  monkeypatch.setattr(SQ, "level_starts", level_starts)
  x = jax.random.uniform(jax.random.key(6), (2, 4, 4, 1))
  labels = jnp.argmax(linear12(x), -1).astype(jnp.int32)
  attack = make_attack(config)
  jax.eval_shape(lambda z, y, k: attack(linear12, z, y, k), x, labels,
                 jax.random.key(0))  # Traces the whole standard chain.
  assert len(runs) == 1 and len(schedules) == 1
  assert {k: runs[0][k] for k in ("norm", "queries", "p_init")} == dict(
      norm="linf", queries=5000, p_init=0.8)
  assert runs[0]["rescale_schedule"] is rescale
  # First iteration of each halving (levels never reached start at 4999,
  # the end of the 4,999 iterations after the init).
  hand = ((6, 26, 101, 251, 501, 1001, 2001, 3001, 4001) if rescale else
          (11, 51, 201, 501, 1001, 2001, 4001, 4999, 4999))
  assert schedules[0] == hand
  if not rescale:  # Iteration by iteration, the released p_selection.
    starts = np.asarray(schedules[0])
    got = [0.8 / 2 ** int(np.sum(i >= starts)) for i in range(4999)]
    assert got == [released_p_selection(i) for i in range(4999)]


@pytest.mark.parametrize("field,value", [
    ("version", "plus"), ("attacks", ("apgd-ce", "pgd")),
    ("attacks", ("square", "square")), ("queries", 0), ("schedule", "x"),
    ("square_rescale_schedule", 1)])
def test_config_errors_name_the_field(field, value):
  with pytest.raises(ConfigError) as e:
    make_attack({"name": "autoattack", "eps": 0.1, field: value})
  assert e.value.field.startswith(f"attack.{field}")


def test_target_classes_must_be_below_the_number_of_classes():
  with pytest.raises(ConfigError) as e:
    AA.autoattack(mlp, X, Y, eps=0.1, key=jax.random.key(0), steps=2,
                  queries=2, target_classes=5)
  assert e.value.field == "attack.target_classes"


@pytest.fixture(scope="module")
def tiny_vmoe():
  config = load_config("tiny")
  test = load_dataset(config.data)["test"]
  idx = np.linspace(0, len(test) - 1, 16).round().astype(int)
  data = ArrayDataset(test.images[idx], test.labels[idx], 10, "digits")
  model = build_model(config.model)
  variables = jax.jit(model.init)(jax.random.key(0), jnp.zeros((8, 8, 8, 1)))
  params = dict(variables["params"])  # A non-trivial head.
  params["head"] = {**params["head"], "kernel": jax.random.normal(
      jax.random.key(1), params["head"]["kernel"].shape)}
  return config, model, {"params": params}, data


def test_robustness_evaluation_reports_autoattack(tiny_vmoe, tmp_path,
                                                  capfd):
  config, model, variables, data = tiny_vmoe
  eps = 0.1
  # The full standard chain is tested on the MLP above; on the V-MoE (one
  # compilation per attack) one white-box and the black-box attack, and the
  # rand version's stochastic passes through the model's router noise.
  robustness = {"attacks": (
      {"name": "pgd", "eps": eps, "steps": 3},
      {"name": "autoattack", "eps": eps, "attacks": ("apgd-ce", "square"),
       **SMALL},
      {"name": "autoattack", "eps": eps, "version": "rand", "steps": 3,
       "attacks": ("apgd-dlr",), "eot_iter": 2, "num_examples": 8})}
  with MetricWriter(str(tmp_path)) as writer:
    sections = evaluate_robustness(
        model, variables, data, config.data, robustness, batch_size=8,
        writer=writer, step=0, workdir=str(tmp_path))
  lines = [json.loads(l) for l in open(tmp_path / "metrics.jsonl")]
  aa = [l for l in lines if l["split"] == "adversarial/autoattack"]
  assert len(aa) == 2
  standard = aa[0]
  after = [standard[f"robust_after/{s}"] for s in ("apgd-ce", "square")]
  assert after == sorted(after, reverse=True)
  assert standard["clean_accuracy"] >= after[0]
  # The reported accuracy is the model's on the returned points.
  assert standard["accuracy"] == pytest.approx(after[-1], abs=1 / 16)
  assert len(standard["apgd_loss/apgd-ce"]) == SMALL["steps"] + 1
  assert "robust_after/apgd-dlr" in aa[1]
  # Off a terminal each stage of each batch is a progress line, its count
  # that of the batch's own bookkeeping (16 images: 2 batches of 8).
  err = capfd.readouterr().err
  stages = re.findall(r"evaluate: autoattack batch (\d)/2: "
                      r"(apgd-ce|square) done, (\d) of the batch's 8 images "
                      r"still robust, \S+ elapsed", err)
  assert [(b, s) for b, s, _ in stages] == [
      ("1", "apgd-ce"), ("1", "square"), ("2", "apgd-ce"), ("2", "square")]
  robust_square = sum(int(n) for _, s, n in stages if s == "square") / 16
  assert robust_square == pytest.approx(standard["robust_after/square"])
  report = "\n".join(sections)
  assert "## AutoAttack and APGD" in report
  assert "PGD-3 (attack 0) at the same threat" in report
  assert "Gradient-masking check" in report
  assert os.path.exists(tmp_path / "autoattack_apgd_loss.png")
