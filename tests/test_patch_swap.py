"""The patch-swap attack against independent references: a loop over patches
for the image, TextAttack's count rule, binomial / chi-square bounds on the
draw, config errors with their full path, and the evaluation's numbers."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from vmoe_ext.attacks import ATTACKS, make_attack
from vmoe_ext.attacks.patch_swap import (check_patch_swap, patch_swap,
                                         patch_swap_details, swap_count,
                                         swap_mask)
from vmoe_ext.config import validate
from vmoe_ext.errors import ConfigError, InputError
from vmoe_ext.evaluate.config import ATTACK, ROBUSTNESS
from vmoe_ext.evaluate.robustness import Evaluator, attack_metrics
from tiny_evaluation import tiny_digits

# Overall probability that a statistical check below fails for a correct
# sampler (each check splits it over its comparisons, Bonferroni).
ALPHA = 1e-6


def textattack_count(rate: float, n: int) -> int:
  """TextAttack's Augmenter: `max(int(pct_words_to_swap * len(words)), 1)`
  words; a rate of 0 swaps none here."""
  return max(int(rate * n), 1) if rate > 0 else 0


def naive_patch_swap(x: np.ndarray, mask: np.ndarray, ph: int, pw: int,
                     value) -> np.ndarray:
  """Loop over images and patches: patch `n` of image `b` (row-major grid)
  set to `value` where `mask[b, n]`."""
  out = np.array(x, copy=True)
  b_count, h, w, _ = x.shape
  gw = w // pw
  for b in range(b_count):
    for n in range(mask.shape[1]):
      if mask[b, n]:
        i, j = divmod(n, gw)
        out[b, i * ph:(i + 1) * ph, j * pw:(j + 1) * pw, :] = value
  return out


def _images(shape, seed=0):
  return np.asarray(jax.random.uniform(jax.random.key(seed), shape))


def _labels(b):
  return jnp.zeros((b,), jnp.int32)


@pytest.mark.parametrize("n", [1, 4, 7, 16, 49, 64, 196])
def test_count_is_textattacks_rule(n):
  for rate in (0.0, 0.001, 0.025, 0.1, 0.2, 0.25, 0.29, 0.5, 0.7, 0.99, 1.0):
    assert swap_count(rate, n) == textattack_count(rate, n), (rate, n)
  # The default MNIST model's 16 patches (patch 7): the papers' 2.5% is one.
  assert [swap_count(r, 16) for r in (0.025, 0.1, 0.2, 1.0)] == [1, 1, 3, 16]


def test_each_image_gets_exactly_the_count():
  for rate, n in ((0.025, 16), (0.2, 16), (0.4, 8), (1.0, 5), (0.0, 9)):
    mask = np.asarray(swap_mask(jax.random.key(1), 50, n, rate))
    assert mask.shape == (50, n)
    np.testing.assert_array_equal(mask.sum(1), textattack_count(rate, n))


@pytest.mark.parametrize("shape,patch,value", [
    ((3, 6, 8, 2), (3, 2), (0.1, 0.9)),  # per channel, rectangular
    ((4, 8, 8, 1), 4, 0.5),
    ((2, 6, 6, 3), (1, 1), 0.0),         # pixel patches
])
def test_image_matches_a_loop_over_patches(shape, patch, value):
  x = _images(shape)
  ph, pw = (patch, patch) if isinstance(patch, int) else patch
  n = (shape[1] // ph) * (shape[2] // pw)
  key = jax.random.key(7)
  got = patch_swap(None, jnp.asarray(x), _labels(shape[0]), key=key,
                   patch_size=patch, rate=0.4, value=value)
  mask = np.asarray(swap_mask(key, shape[0], n, 0.4))
  assert mask.any() and not mask.all()
  want = naive_patch_swap(x, mask, ph, pw, np.asarray(value, np.float32))
  assert got.dtype == x.dtype and got.shape == x.shape
  np.testing.assert_array_equal(np.asarray(got), want)


def test_rate_zero_is_the_identity_and_rate_one_fills_everything():
  x = jnp.asarray(_images((5, 8, 8, 3)))
  same, diag = patch_swap_details(None, x, _labels(5), key=jax.random.key(0),
                                  patch_size=2, rate=0.0)
  np.testing.assert_array_equal(np.asarray(same), np.asarray(x))
  np.testing.assert_array_equal(diag["swapped_fraction"], 0.0)
  full = patch_swap(None, x, _labels(5), key=jax.random.key(0),
                    patch_size=(4, 2), rate=1.0, value=(0.2, 0.5, 0.7))
  np.testing.assert_array_equal(
      np.asarray(full), np.broadcast_to(np.float32([0.2, 0.5, 0.7]), x.shape))


def test_bfloat16_images_keep_their_dtype():
  x = jnp.asarray(_images((2, 4, 4, 1)), jnp.bfloat16)
  got = patch_swap(None, x, _labels(2), key=jax.random.key(0), patch_size=2,
                   rate=1.0, value=0.25)
  assert got.dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(got, np.float32), 0.25)


def test_each_position_is_swapped_with_probability_count_over_n():
  """Over M independent images, how often patch n is swapped is
  Binomial(M, k / N): every position within the bound that a correct
  sampler exceeds with probability ALPHA (two-sided, Bonferroni over N)."""
  m, n, rate = 4000, 16, 0.2
  k = textattack_count(rate, n)
  mask = np.asarray(swap_mask(jax.random.key(3), m, n, rate))
  p = k / n
  z = stats.norm.isf(ALPHA / (2 * n))
  bound = z * np.sqrt(m * p * (1 - p))
  counts = mask.sum(0)
  assert np.all(np.abs(counts - m * p) <= bound), (counts, m * p, bound)
  # The swapped fraction is exactly k / N, image by image (no Bernoulli
  # spread), and rate itself where rate * N is a whole number.
  x = jnp.asarray(_images((500, 8, 8, 1)))
  _, diag = patch_swap_details(None, x, _labels(500), key=jax.random.key(3),
                               patch_size=2, rate=0.25)
  np.testing.assert_array_equal(diag["swapped_fraction"], 0.25)


def test_the_swapped_set_is_uniform_and_independent_across_images():
  """k = 2 of N = 4 patches: each image's set is one of the 6 pairs, all
  equally likely, and consecutive images' sets are independent (36 joint
  cells): chi-square goodness of fit at ALPHA / 2 each."""
  m = 12000
  mask = np.asarray(swap_mask(jax.random.key(5), m, 4, 0.5))
  codes = [sum(1 << i for i in pair)
           for pair in itertools.combinations(range(4), 2)]
  lookup = np.full(16, -1)
  lookup[codes] = np.arange(6)
  which = lookup[mask @ (1 << np.arange(4))]  # the pair's index, 0..5
  assert np.all(which >= 0)
  single = np.bincount(which, minlength=6)
  assert stats.chisquare(single).pvalue > ALPHA / 2, single
  joint = np.bincount(which[0::2] * 6 + which[1::2], minlength=36)
  assert stats.chisquare(joint).pvalue > ALPHA / 2, joint


def test_deterministic_given_the_key_and_jit_compatible():
  x = jnp.asarray(_images((6, 8, 8, 2)))
  y = _labels(6)
  args = dict(patch_size=(2, 4), rate=0.4, value=(0.3, 0.6))
  eager = patch_swap(None, x, y, key=jax.random.key(2), **args)
  np.testing.assert_array_equal(
      eager, patch_swap(None, x, y, key=jax.random.key(2), **args))
  assert not np.array_equal(
      eager, patch_swap(None, x, y, key=jax.random.key(9), **args))
  jitted = jax.jit(lambda z, k: patch_swap(None, z, y, key=k, **args))
  np.testing.assert_array_equal(jitted(x, jax.random.key(2)), eager)
  # rate and value traced too (0.4 * 8 = 3.2: no float32 edge).
  traced = jax.jit(lambda z, k, r, v: patch_swap(
      None, z, y, key=k, patch_size=(2, 4), rate=r, value=v))
  np.testing.assert_array_equal(
      traced(x, jax.random.key(2), 0.4, jnp.float32([0.3, 0.6])), eager)
  np.testing.assert_array_equal(
      traced(x, jax.random.key(2), 0.0, jnp.float32([0.3, 0.6])), x)


def test_the_registry_entry_and_its_diagnostics():
  spec = ATTACKS.spec("patch_swap")
  assert spec.fn is patch_swap and spec.check is check_patch_swap
  assert spec.details is patch_swap_details
  x = jnp.asarray(_images((3, 28, 28, 1)))
  attack = make_attack({"name": "patch_swap", "patch_size": 7}, details=True)
  got, diag = attack(None, x, _labels(3), jax.random.key(0))
  np.testing.assert_array_equal(diag["swapped_fraction"], 1 / 16)
  changed = np.asarray(got != x)[..., 0].reshape(3, 4, 7, 4, 7)
  assert (changed.any((2, 4)).sum((1, 2)) == 1).all()  # one patch each


@pytest.mark.parametrize("entry,field,message", [
    ({"rate": 1.5}, "rate", "must be a fraction in [0, 1]"),
    ({"rate": -0.1}, "rate", "must be a fraction in [0, 1]"),
    ({"rate": float("nan")}, "rate", "finite"),
    ({"patch_size": 0}, "patch_size", "integer >= 1 or a pair"),
    ({"patch_size": (7, 7, 7)}, "patch_size", "integer >= 1 or a pair"),
    ({"patch_size": 7.0}, "patch_size", "integer >= 1 or a pair"),
    ({"value": 1.5}, "value", "must be a number in [0, 1]"),
    ({"value": (0.5, "grey")}, "value", "must be a number in [0, 1]"),
    ({"value": ()}, "value", "must be a number in [0, 1]"),
    ({"patch_size": None}, "patch_size", "is required"),
    ({"eps": 0.1}, "eps", ""),
])
def test_config_errors_name_the_full_field(entry, field, message):
  attack = {"name": "patch_swap", "patch_size": 7, **entry}
  if attack["patch_size"] is None:
    del attack["patch_size"]
  with pytest.raises(ConfigError) as info:
    validate(ROBUSTNESS, {"attacks": ({"name": "fgsm", "eps": 0.1}, attack)},
             "robustness")
  assert info.value.field == f"robustness.attacks[1].{field}"
  assert message in info.value.reason


def test_the_schema_reads_the_fields_and_defaults():
  validate(ROBUSTNESS, {"attacks": (
      {"name": "patch_swap", "patch_size": (7, 7), "rate": 1,
       "value": [0.5]},)}, "robustness")
  fields = ATTACK.fields_of({"name": "patch_swap"})
  assert sorted(fields) == ["name", "num_examples", "patch_size", "rate",
                            "value"]
  assert fields["rate"].default == 0.025 and fields["value"].default == 0.5


def test_errors_that_need_the_images():
  x, y, key = jnp.zeros((2, 8, 8, 3)), _labels(2), jax.random.key(0)
  with pytest.raises(ConfigError) as info:
    patch_swap(None, x, y, key=key, patch_size=3)
  assert info.value.field == "attack.patch_size" and "8 x 8" in str(info.value)
  with pytest.raises(ConfigError) as info:
    patch_swap(None, x, y, key=key, patch_size=2, value=(0.1, 0.2))
  assert info.value.field == "attack.value"
  with pytest.raises(ConfigError) as info:
    patch_swap(None, x, y, patch_size=2)
  assert info.value.field == "attack.key"
  with pytest.raises(InputError) as info:
    patch_swap(None, jnp.zeros((2, 8, 8)), y, key=key, patch_size=2)
  assert info.value.field == "attack.x"


# -- Through the evaluation ---------------------------------------------------


@pytest.fixture(scope="module")
def tiny():
  model, variables, data = tiny_digits()  # 8 x 8, patch 4: 4 patches
  return Evaluator(model, variables, 0.3, 0.4), data


def test_attack_metrics_match_an_independent_computation(tiny):
  """`attack_metrics` draws batch i's patches from `fold_in(key(seed), i)`:
  the same masks, images built by the loop, the model's own predictions."""
  evaluator, data = tiny
  config = {"name": "patch_swap", "patch_size": 4, "rate": 0.5,
            "value": 0.5}
  got = attack_metrics(evaluator, data, config, batch_size=10, seed=4)
  clean = adv = changed = 0
  for i, start in enumerate((0, 10)):
    xb = data.images[start:start + 10]
    yb = data.labels[start:start + 10]
    mask = np.asarray(swap_mask(jax.random.fold_in(jax.random.key(4), i), 10,
                                4, 0.5))
    xa = naive_patch_swap(xb, mask, 4, 4, 0.5)
    pc = np.argmax(np.asarray(evaluator.forward(jnp.asarray(xb))[0]), -1)
    pa = np.argmax(np.asarray(evaluator.forward(jnp.asarray(xa))[0]), -1)
    clean += int(np.sum(pc == yb))
    adv += int(np.sum(pa == yb))
    changed += int(np.sum(pc != pa))
  assert changed > 0  # The check below can tell a wrong image apart.
  assert got["clean_accuracy"] == pytest.approx(clean / 20)
  assert got["accuracy"] == pytest.approx(adv / 20)
  assert got["prediction_change_rate"] == pytest.approx(changed / 20)
  assert got["swapped_fraction"] == pytest.approx(0.5)
