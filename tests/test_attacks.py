"""Attacks: foolbox 3 as the FGSM/PGD oracle, eps-ball and range properties
(hypothesis), the SPSA estimator against `jax.grad`, and argument errors."""

from __future__ import annotations

import functools
import gc
import weakref

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vmoe_ext import attacks
from vmoe_ext.attacks import base
from vmoe_ext.errors import ConfigError
from vmoe_ext.models import build_model

B, SHAPE, C = 6, (4, 4, 1), 5
D = int(np.prod(SHAPE))


def _mlp_params(seed=0, hidden=16):
  k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
  return dict(w1=jax.random.normal(k1, (D, hidden)) / np.sqrt(D),
              b1=jax.random.normal(k2, (hidden,)) * 0.1,
              w2=jax.random.normal(k3, (hidden, C)) * 2.0)


def mlp_apply(params, x):
  """2-layer tanh MLP `[B, 4, 4, 1] -> [B, C]`."""
  h = jnp.tanh(x.reshape(x.shape[0], -1) @ params["w1"] + params["b1"])
  return h @ params["w2"]


PARAMS = _mlp_params()
# One module-level function object, so jitted attacks compile once per
# static configuration across tests and hypothesis examples.
logits_fn = functools.partial(mlp_apply, PARAMS)


def _images(seed, b=B, lo=0.0, hi=1.0):
  """Images in [lo, hi] with some pixels exactly on the range's bounds."""
  rng = np.random.default_rng(seed)
  x = rng.uniform(lo, hi, size=(b,) + SHAPE)
  mask = rng.uniform(size=x.shape)
  x = np.where(mask < 0.1, lo, np.where(mask > 0.9, hi, x))
  return jnp.asarray(x, jnp.float32)


def _labels(seed, b=B):
  return jnp.asarray(np.random.default_rng(seed + 1).integers(0, C, b),
                     jnp.int32)


# --- foolbox 3 oracle (random start off) ------------------------------------


@pytest.fixture(scope="module")
def fb():
  # A dev dependency: a missing oracle must fail the suite, not skip it.
  import foolbox
  return foolbox


def _fb_model(fb):
  return fb.models.JAXModel(logits_fn, bounds=(0.0, 1.0))


def test_fgsm_matches_foolbox(fb):
  x, y = _images(0), _labels(0)
  for eps in (0.0, 0.03, 0.3):
    expected, _, _ = fb.attacks.FGSM()(_fb_model(fb), x, y, epsilons=eps)
    got = attacks.fgsm(logits_fn, x, y, eps=eps)
    chex.assert_trees_all_close(got, expected, atol=1e-5, rtol=0)
  assert float(jnp.max(jnp.abs(got - x))) > 0.29  # The attack moved.


@pytest.mark.parametrize("norm,eps,step", [("linf", 0.1, 0.03),
                                           ("l2", 0.5, 0.2)])
def test_pgd_matches_foolbox(fb, norm, eps, step):
  x, y = _images(1), _labels(1)
  cls = fb.attacks.LinfPGD if norm == "linf" else fb.attacks.L2PGD
  oracle = cls(random_start=False, abs_stepsize=step, steps=7)
  expected, _, _ = oracle(_fb_model(fb), x, y, epsilons=eps)
  got = attacks.pgd(logits_fn, x, y, eps=eps, steps=7, step_size=step,
                    norm=norm, random_start=False)
  chex.assert_trees_all_close(got, expected, atol=1e-5, rtol=0)
  # The attack went far: the eps projection (and the range clip) were active.
  dist = base.per_example_norm(got - x, norm)
  assert float(jnp.max(dist)) > 0.99 * eps


def test_pgd_relative_step_and_targeted_match_foolbox(fb):
  x, targets = _images(2), _labels(2)
  criterion = fb.criteria.TargetedMisclassification(targets)
  oracle = fb.attacks.LinfPGD(random_start=False, rel_stepsize=0.25, steps=5)
  expected, _, _ = oracle(_fb_model(fb), x, criterion, epsilons=0.2)
  got = attacks.pgd(logits_fn, x, targets, eps=0.2, steps=5,
                    step_size=0.25 * 0.2, random_start=False, targeted=True)
  chex.assert_trees_all_close(got, expected, atol=1e-5, rtol=0)


# --- Properties: eps-ball and valid range (hypothesis) ----------------------

RANGES = st.sampled_from([(0.0, 1.0), (-1.0, 1.0)])
SETTINGS = settings(max_examples=8, deadline=None, derandomize=True)


def _assert_in_ball_and_range(x_adv, x, eps, norm, lo, hi, check_range=True):
  assert x_adv.shape == x.shape and x_adv.dtype == x.dtype
  dist = np.asarray(base.per_example_norm(x_adv - x, norm)).ravel()
  assert np.all(dist <= eps * (1 + 1e-5) + 1e-6), (dist, eps)
  if check_range:
    assert float(jnp.min(x_adv)) >= lo and float(jnp.max(x_adv)) <= hi


@SETTINGS
@given(seed=st.integers(0, 2**16), eps=st.floats(0.0, 0.6), rng=RANGES,
       targeted=st.booleans())
def test_fgsm_stays_in_ball_and_range(seed, eps, rng, targeted):
  lo, hi = rng
  x, y = _images(seed, lo=lo, hi=hi), _labels(seed)
  x_adv = attacks.fgsm(logits_fn, x, y, eps=eps, clip_min=lo, clip_max=hi,
                       targeted=targeted)
  _assert_in_ball_and_range(x_adv, x, eps, "linf", lo, hi)


@SETTINGS
@given(seed=st.integers(0, 2**16), eps=st.floats(0.0, 2.0), rng=RANGES,
       norm=st.sampled_from(base.NORMS), steps=st.sampled_from([0, 1, 3]),
       random_start=st.booleans(), restarts=st.sampled_from([1, 2]),
       step_factor=st.sampled_from([None, 0.1, 1.5]),
       vmoe_compatible=st.booleans())
def test_pgd_stays_in_ball_and_range(seed, eps, rng, norm, steps, random_start,
                                     restarts, step_factor, vmoe_compatible):
  lo, hi = rng
  x, y = _images(seed, lo=lo, hi=hi), _labels(seed)
  step = None if step_factor is None or vmoe_compatible else step_factor * eps
  x_adv = attacks.pgd(
      logits_fn, x, y, eps=eps, steps=steps, norm=norm,
      step_size=step if step else None, random_start=random_start,
      restarts=restarts, key=jax.random.key(seed), clip_min=lo, clip_max=hi,
      vmoe_compatible=vmoe_compatible)
  # vmoe-compatible mode does not clip to the valid range (by design).
  _assert_in_ball_and_range(x_adv, x, eps, norm, lo, hi,
                            check_range=not vmoe_compatible)


@settings(max_examples=5, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2**16), eps=st.floats(0.0, 0.5), rng=RANGES,
       early_stop=st.booleans(), targeted=st.booleans())
def test_spsa_stays_in_ball_and_range(seed, eps, rng, early_stop, targeted):
  lo, hi = rng
  x, y = _images(seed, lo=lo, hi=hi), _labels(seed)
  x_adv = attacks.spsa(logits_fn, x, y, eps=eps, steps=3, samples=4,
                       learning_rate=0.2, key=jax.random.key(seed),
                       early_stop=early_stop, targeted=targeted, clip_min=lo,
                       clip_max=hi)
  _assert_in_ball_and_range(x_adv, x, eps, "linf", lo, hi)


# --- PGD specifics ----------------------------------------------------------


@pytest.mark.parametrize("norm", base.NORMS)
def test_pgd_zero_steps_is_identity(norm):
  x, y = _images(3), _labels(3)
  for vmoe_compatible in (False, True):
    got = attacks.pgd(logits_fn, x, y, eps=0.3, steps=0, norm=norm,
                      random_start=False, vmoe_compatible=vmoe_compatible)
    np.testing.assert_array_equal(got, x)


def test_pgd_vmoe_compatible_matches_vmoe_loop():
  """vmoe: `x <- x + eps/steps * sign(grad mean CE)`, no start, no clip."""
  x, y = _images(4), _labels(4)
  eps, steps = 0.2, 4
  grad = jax.grad(lambda z: jnp.mean(attacks.cross_entropy(logits_fn(z), y)))
  expected = x
  for _ in range(steps):
    expected = expected + eps / steps * jnp.sign(grad(expected))
  got = attacks.pgd(logits_fn, x, y, eps=eps, steps=steps,
                    vmoe_compatible=True)  # random_start=True is ignored.
  chex.assert_trees_all_close(got, expected, atol=1e-6, rtol=0)
  assert float(jnp.max(got)) > 1.0 or float(jnp.min(got)) < 0.0  # No clip.


def test_pgd_restarts_keep_first_success_else_highest_loss():
  x, y = _images(5), _labels(5)
  key, restarts = jax.random.key(7), 3
  kw = dict(eps=0.05, steps=2, step_size=0.02)
  got = attacks.pgd(logits_fn, x, y, restarts=restarts, key=key, **kw)
  runs = [attacks.pgd(logits_fn, x, y, key=k, **kw)
          for k in jax.random.split(key, restarts)]
  logits = [logits_fn(r) for r in runs]
  loss = np.stack([attacks.cross_entropy(l, y) for l in logits])  # [R, B]
  success = np.stack([np.argmax(l, -1) != np.asarray(y) for l in logits])
  for b in range(B):
    hits = np.flatnonzero(success[:, b])
    pick = hits[0] if hits.size else int(np.argmax(loss[:, b]))
    np.testing.assert_allclose(got[b], runs[pick][b], atol=1e-6)
  # Restarts help, or at least do not hurt, each example.
  ce_got = np.asarray(attacks.cross_entropy(logits_fn(got), y))
  assert np.all(success.any(0) | (ce_got >= loss.max(0) - 1e-6))


def test_pgd_raises_loss_and_jits_with_traced_params():
  x, y = _images(6), _labels(6)
  attack = attacks.make_attack(dict(name="pgd", eps=0.1, steps=5))

  @jax.jit
  def run(params, x, y, key):
    x_adv = attack(lambda z: mlp_apply(params, z), x, y, key)
    return x_adv, jnp.mean(attacks.cross_entropy(mlp_apply(params, x_adv), y))

  x_adv, loss_adv = run(PARAMS, x, y, jax.random.key(0))
  eager = attack(logits_fn, x, y, jax.random.key(0))
  chex.assert_trees_all_close(x_adv, eager, atol=1e-6)
  clean = jnp.mean(attacks.cross_entropy(logits_fn(x), y))
  assert float(loss_adv) > float(clean) + 0.1


# --- SPSA -------------------------------------------------------------------


def test_spsa_gradient_averages_to_jax_grad_on_quadratic():
  rng = np.random.default_rng(0)
  b, d, n = 3, 8, 8192
  a = rng.normal(size=(d, d))
  a = jnp.asarray(a @ a.T / d, jnp.float32)
  c = jnp.asarray(rng.normal(size=(d,)), jnp.float32)
  loss_fn = lambda z: 0.5 * jnp.einsum("bi,ij,bj->b", z, a, z) + z @ c
  x = jnp.asarray(rng.normal(size=(b, d)), jnp.float32)
  est = attacks.spsa_gradient(loss_fn, x, jax.random.key(1), delta=0.01,
                              samples=n, sample_chunk=512)
  grad = jax.grad(lambda z: jnp.sum(loss_fn(z)))(x)
  # Central differences are exact on a quadratic, so each sample is
  # (g . v) v, whose coordinate j has variance sum_{k != j} g_k^2.
  g2 = np.asarray(grad) ** 2
  std = np.sqrt((g2.sum(-1, keepdims=True) - g2) / n)
  err = np.abs(np.asarray(est) - np.asarray(grad))
  assert np.all(err <= 5 * std + 1e-3), (err / std).max()
  assert np.mean(err / std) < 1.5  # Roughly |N(0, 1)|, mean ~0.8.


def test_spsa_lowers_margin_of_linear_model():
  rng = np.random.default_rng(1)
  w = jnp.asarray(rng.normal(size=(D, C)), jnp.float32)
  linear = lambda z: z.reshape(z.shape[0], -1) @ w  # noqa: E731
  x = _images(8)
  y = jnp.argmax(linear(x), -1)  # Correctly classified: margin > 0.
  before = attacks.margin_loss(linear(x), y)
  eps = 0.02
  x_adv = attacks.spsa(linear, x, y, eps=eps, steps=10, samples=16,
                       key=jax.random.key(0), early_stop=False)
  after = attacks.margin_loss(linear(x_adv), y)
  assert np.all(np.asarray(before) > 0)
  assert np.all(np.asarray(after) < np.asarray(before) - 0.5 * eps)
  _assert_in_ball_and_range(x_adv, x, eps, "linf", 0.0, 1.0)


def test_spsa_early_stop_freezes_successful_examples():
  rng = np.random.default_rng(2)
  w = jnp.asarray(rng.normal(size=(D, C)), jnp.float32)
  linear = lambda z: z.reshape(z.shape[0], -1) @ w  # noqa: E731
  x = _images(9)
  y = jnp.argmax(linear(x), -1)
  y = y.at[0].set((y[0] + 1) % C)  # Example 0 is misclassified from the start.
  x_adv = attacks.spsa(linear, x, y, eps=0.5, steps=30, samples=8,
                       learning_rate=0.05, key=jax.random.key(0))
  np.testing.assert_array_equal(x_adv[0], x[0])  # Already successful.
  margin = np.asarray(attacks.margin_loss(linear(x_adv), y))
  assert np.all(margin < 0)
  # Frozen at the first success: barely past the decision boundary.
  x_full = attacks.spsa(linear, x, y, eps=0.5, steps=30, samples=8,
                        learning_rate=0.05, key=jax.random.key(0),
                        early_stop=False)
  full = np.asarray(attacks.margin_loss(linear(x_full), y))
  assert np.all(margin[1:] > full[1:])


def test_attacks_on_tiny_vmoe_keep_batching():
  """Every attack runs on a V-MoE; the batch dim the model sees stays B."""
  model = build_model(dict(
      name="vit_moe", num_classes=C, patch_size=(2, 2), hidden_size=8,
      num_layers=1, num_heads=2, mlp_dim=8,
      moe=dict(every=1, num_experts=2, group_size=5 * 2,
               router=dict(name="noisy_topk", num_selected=1))))
  x, y = _images(10, b=4), _labels(10, b=4)
  # Random parameters of the right shapes (no compiled init: faster; and the
  # zero-initialised head of a fresh model would give zero input gradients).
  rng = np.random.default_rng(0)
  shapes = jax.eval_shape(model.init, jax.random.key(0), x)
  variables = jax.tree.map(
      lambda s: jnp.asarray(0.5 * rng.normal(size=s.shape), s.dtype), shapes)
  seen = set()

  def vmoe_logits(z):
    seen.add(z.shape)
    return model.apply(variables, z, deterministic=True)[0]

  for cfg in (dict(name="pgd", eps=0.1, steps=1),
              dict(name="spsa", eps=0.1, steps=1, samples=2, early_stop=False)):
    x_adv = attacks.make_attack(cfg)(vmoe_logits, x, y, jax.random.key(2))
    _assert_in_ball_and_range(x_adv, x, 0.1, "linf", 0.0, 1.0)
  assert seen == {x.shape}


# --- Auxiliary loss in the objective (vmoe's attack_auxiliary_loss) ---------


def _tiny_vmoe(importance_loss_weight=1.0, b=4, seed=0):
  """A 1-layer V-MoE `[b, 4, 4, 1] -> [b, C]` with random parameters, and
  `apply(z) -> (logits, metrics)` (deterministic)."""
  model = build_model(dict(
      name="vit_moe", num_classes=C, patch_size=(2, 2), hidden_size=8,
      num_layers=1, num_heads=2, mlp_dim=8,
      moe=dict(every=1, num_experts=2, group_size=5 * 2,
               router=dict(name="noisy_topk", num_selected=1,
                           importance_loss_weight=importance_loss_weight))))
  shapes = jax.eval_shape(model.init, jax.random.key(0), _images(0, b=b))
  rng = np.random.default_rng(seed)
  variables = jax.tree.map(
      lambda s: jnp.asarray(0.5 * rng.normal(size=s.shape), s.dtype), shapes)
  return model, variables


def test_pgd_auxiliary_loss_gradient_is_grad_of_ce_plus_aux():
  """On: the step follows `grad(mean CE + mean aux)`, vmoe's objective; off
  (the default): `grad(mean CE)`, which differs since aux depends on x."""
  model, variables = _tiny_vmoe()
  x, y = _images(20, b=4), _labels(20, b=4)

  def apply(z):
    logits, metrics = model.apply(variables, z, deterministic=True)
    return logits, metrics["auxiliary_loss"]

  def hand_ce(z):
    return jnp.mean(attacks.cross_entropy(apply(z)[0], y))

  def hand_ce_aux(z):
    logits, aux = apply(z)
    return jnp.mean(attacks.cross_entropy(logits, y)) + jnp.mean(aux)

  obj = jax.grad(attacks.projected_gradient.objective, argnums=1)

  @jax.jit  # One compilation, not op-by-op eager ones.
  def at(z):
    return dict(
        aux=apply(z)[1], on=obj(apply, z, y, False, True),
        off=obj(lambda z: apply(z)[0], z, y, False),
        t=obj(apply, z, y, True, True), ce_aux=jax.grad(hand_ce_aux)(z),
        ce=jax.grad(hand_ce)(z),
        t_ref=jax.grad(lambda z: hand_ce_aux(z) - 2 * hand_ce(z))(z))

  g = at(x)
  assert float(jnp.abs(g["aux"])) > 1e-3
  grad_on, grad_off = g["on"], g["off"]
  chex.assert_trees_all_close(grad_on, g["ce_aux"], atol=1e-6)
  chex.assert_trees_all_close(grad_off, g["ce"], atol=1e-6)
  assert float(jnp.max(jnp.abs(grad_on - grad_off))) > 1e-4
  # Targeted: the CE term flips, the auxiliary loss is still ascended.
  grad_t = g["t"]
  chex.assert_trees_all_close(grad_t, g["t_ref"], atol=1e-6)

  # The attacks themselves: vmoe's loop `x + eps/steps * sign(grad J)`.
  eps, steps = 0.1, 2
  expected = {True: x, False: x}
  grads = jax.jit(lambda a, b: {True: jax.grad(hand_ce_aux)(a),
                                False: jax.grad(hand_ce)(b)})
  for _ in range(steps):
    grad = grads(expected[True], expected[False])
    for aux in (True, False):
      expected[aux] = expected[aux] + eps / steps * jnp.sign(grad[aux])
  for aux in (True, False):
    fn = apply if aux else (lambda z: apply(z)[0])
    got = attacks.pgd(fn, x, y, eps=eps, steps=steps, vmoe_compatible=True,
                      include_auxiliary_loss=aux)
    chex.assert_trees_all_close(got, expected[aux], atol=1e-6)
  assert not np.allclose(expected[True], expected[False])
  fgsm_aux = attacks.make_attack(dict(
      name="fgsm", eps=0.1, include_auxiliary_loss=True))(apply, x, y)
  chex.assert_trees_all_close(fgsm_aux, jnp.clip(
      x + 0.1 * jnp.sign(g["ce_aux"]), 0.0, 1.0), atol=1e-6)


def test_evaluator_passes_auxiliary_loss_to_the_attack():
  from vmoe_ext.evaluate.evaluator import Evaluator  # pylint: disable=g-import-not-at-top
  model, variables = _tiny_vmoe()
  ev = Evaluator(model, variables, mean=0.5, std=0.25)
  x, y = _images(21, b=4), _labels(21, b=4)
  key = jax.random.key(0)
  cfg = dict(name="pgd", eps=0.1, steps=2, vmoe_compatible=True)
  on = ev.attack({**cfg, "include_auxiliary_loss": True})(x, y, key)
  off = ev.attack(cfg)(x, y, key)
  chex.assert_trees_all_close(on, attacks.pgd(
      ev.logits_and_aux_fn, x, y, eps=0.1, steps=2, vmoe_compatible=True,
      include_auxiliary_loss=True), atol=1e-6)
  chex.assert_trees_all_close(off, attacks.pgd(
      ev.logits_fn, x, y, eps=0.1, steps=2, vmoe_compatible=True), atol=1e-6)
  assert not np.allclose(on, off)
  (logits, aux), plain = jax.jit(  # One compilation, not op-by-op eager.
      lambda z: (ev.logits_and_aux_fn(z), ev.logits_fn(z)))(x)
  np.testing.assert_allclose(logits, plain, atol=1e-6)
  assert aux.shape == ()


def test_auxiliary_loss_flag_and_logits_fn_output_must_agree():
  x, y = _images(22), _labels(22)
  pair_fn = lambda z: (logits_fn(z), jnp.zeros(()))
  for fn, aux in ((pair_fn, False), (logits_fn, True)):
    with pytest.raises(ConfigError) as e:
      attacks.pgd(fn, x, y, eps=0.1, steps=1, random_start=False,
                  include_auxiliary_loss=aux)
    assert e.value.field == "attack.include_auxiliary_loss"
  # A zero auxiliary loss leaves the attack unchanged.
  np.testing.assert_array_equal(
      attacks.fgsm(pair_fn, x, y, eps=0.1, include_auxiliary_loss=True),
      attacks.fgsm(logits_fn, x, y, eps=0.1))


# --- Registry and errors ----------------------------------------------------


def test_registry_names_and_make_attack_defaults():
  assert sorted(attacks.ATTACKS) == ["apgd", "autoattack", "fab", "fgsm",
                                     "patch_swap", "pgd", "spsa", "square"]
  assert attacks.get_attack("pgd") is attacks.pgd
  x, y = _images(11), _labels(11)
  got = attacks.make_attack(dict(name="fgsm", eps=0.1))(logits_fn, x, y)
  np.testing.assert_array_equal(got, attacks.fgsm(logits_fn, x, y, eps=0.1))


@pytest.mark.parametrize("config,field", [
    (dict(name="cw", eps=0.1), "attack.name"),
    (dict(eps=0.1), "attack.name"),
    (dict(name="fgsm", eps=-0.1), "attack.eps"),
    (dict(name="fgsm", eps=float("nan")), "attack.eps"),
    (dict(name="fgsm"), "attack.eps"),
    (dict(name="fgsm", eps=0.1, steps=3), "attack.steps"),
    (dict(name="fgsm", eps=0.1, clip_min=1.0, clip_max=0.0), "attack.clip_min"),
    (dict(name="pgd", eps=-1.0, steps=3), "attack.eps"),
    (dict(name="pgd", eps=0.1), "attack.steps"),
    (dict(name="pgd", eps=0.1, steps=-1), "attack.steps"),
    (dict(name="pgd", eps=0.1, steps=2.5), "attack.steps"),
    (dict(name="pgd", eps=0.1, steps=3, norm="l1"), "attack.norm"),
    (dict(name="pgd", eps=0.1, steps=3, restarts=0), "attack.restarts"),
    (dict(name="pgd", eps=0.1, steps=3, step_size=0.0), "attack.step_size"),
    (dict(name="pgd", eps=0.1, steps=3, step_size=0.1, vmoe_compatible=True),
     "attack.step_size"),
    (dict(name="spsa", eps=0.1, steps=0), "attack.steps"),
    (dict(name="spsa", eps=-0.1), "attack.eps"),
    (dict(name="spsa", eps=0.1, samples=0), "attack.samples"),
    (dict(name="spsa", eps=0.1, delta=0.0), "attack.delta"),
    (dict(name="spsa", eps=0.1, learning_rate=-1.0), "attack.learning_rate"),
    (dict(name="spsa", eps=0.1, samples=6, sample_chunk=4),
     "attack.sample_chunk"),
    (dict(name="pgd", eps=0.1, steps=3, include_auxiliary_loss=1),
     "attack.include_auxiliary_loss"),
    (dict(name="fgsm", eps=0.1, include_auxiliary_loss="yes"),
     "attack.include_auxiliary_loss"),
    # SPSA's margin loss is per example: no batch-level auxiliary term.
    (dict(name="spsa", eps=0.1, include_auxiliary_loss=True),
     "attack.include_auxiliary_loss"),
])
def test_make_attack_errors_name_the_field(config, field):
  with pytest.raises(ConfigError) as e:
    attacks.make_attack(config)
  assert e.value.field == field
  assert str(e.value).startswith(field)


def test_call_errors_name_the_field():
  x, y = _images(12), _labels(12)
  cases = [
      (lambda: attacks.fgsm(logits_fn, x, y, eps=-0.01), "attack.eps"),
      (lambda: attacks.pgd(logits_fn, x, y, eps=0.1, steps=-2), "attack.steps"),
      (lambda: attacks.pgd(logits_fn, x, y, eps=0.1, steps=2),  # random start
       "attack.key"),
      (lambda: attacks.spsa(logits_fn, x, y, eps=0.1), "attack.key"),
      (lambda: attacks.spsa(logits_fn, x, y, eps=0.1, steps=0,
                            key=jax.random.key(0)), "attack.steps"),
  ]
  for fn, field in cases:
    with pytest.raises(ConfigError) as e:
      fn()
    assert e.value.field == field
  # Bad data is not a config error.
  data_cases = [
      (lambda: attacks.fgsm(logits_fn, x, y[:2], eps=0.1), "attack.labels"),
      (lambda: attacks.fgsm(logits_fn, (x * 255).astype(jnp.uint8), y,
                            eps=0.1), "attack.x"),
  ]
  for fn, field in data_cases:
    with pytest.raises(ValueError) as e:
      fn()
    assert e.value.field == field and not isinstance(e.value, ConfigError)


def test_eager_calls_cache_per_logits_fn_without_keeping_it_alive():
  x, y = _images(13), _labels(13)
  fn = functools.partial(mlp_apply, _mlp_params(seed=1))
  first = attacks.fgsm(fn, x, y, eps=0.1)
  jitted = base._JITTED[fn]  # pylint: disable=protected-access
  again = attacks.fgsm(fn, x, y, eps=0.2)  # eps is traced: no new entry.
  assert len(jitted) == 1 and not np.array_equal(first, again)
  ref = weakref.ref(fn)
  del fn, jitted
  gc.collect()
  assert ref() is None
