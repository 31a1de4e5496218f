"""The theory checks (experiments/theory_checks.py and its per-paper modules
theory_acmoe.py, theory_symphony.py, theory_vmoe.py) against independent
references: jax.hessian, hand-computed 2x2 and scalar cases, a naive MoE,
closed forms; and seed 0 re-run against the committed JSON.
"""

from __future__ import annotations

import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

_ROOT = os.path.join(os.path.dirname(__file__), os.pardir)
sys.path.insert(0, os.path.join(_ROOT, "experiments"))
import theory_acmoe as ac  # noqa: E402  pylint: disable=g-import-not-at-top
import theory_checks as tc  # noqa: E402  pylint: disable=g-import-not-at-top
import theory_symphony as sy  # noqa: E402  pylint: disable=g-import-not-at-top
import theory_vmoe as vm  # noqa: E402  pylint: disable=g-import-not-at-top

_COMMITTED = os.path.join(_ROOT, "experiments", "results",
                          "theory_checks.json")
# float32 jax in the Lemma 1 search (gradient ascent): a looser match.
_RTOL = {"acmoe": 1e-3, "symphony_p1": 1e-3, "symphony_t1": 1e-3,
         "lemma1": 2e-2, "theorems": 1e-3}


def test_seed_0_reproduces_the_committed_json():
  with open(_COMMITTED, encoding="utf-8") as f:
    committed = json.load(f)
  assert 0 in committed["seeds"]
  rerun = tc.run_checks([0])
  assert [c["statement"] for c in rerun["checks"]] == [
      c["statement"] for c in committed["checks"]]
  for new, old in zip(rerun["checks"], committed["checks"]):
    np.testing.assert_allclose(new["per_seed"]["0"], old["per_seed"]["0"],
                               rtol=_RTOL[new["section"]], atol=1e-6,
                               err_msg=new["statement"])
  for section, seeds in rerun["details"].items():
    for key, value in seeds["0"].items():
      np.testing.assert_allclose(
          value, committed["details"][section]["0"][key],
          rtol=_RTOL[section], atol=1e-6, err_msg=f"{section}.{key}")


def test_router_hessian_matches_jax_hessian():
  rng = np.random.default_rng(0)
  u = rng.normal(size=(40, 5))
  e = rng.normal(size=(3, 5))
  y = rng.integers(0, 3, 40)

  def loss(e_i, i):
    logits = jnp.asarray(u) @ e.at[i].set(e_i).T
    logp = jax.nn.log_softmax(logits)
    return -jnp.mean(logp[jnp.arange(40), y])

  e = jnp.asarray(e)
  hessian = jax.jit(jax.hessian(loss), static_argnums=1)
  for i in range(3):
    want = np.asarray(hessian(e[i], i))
    np.testing.assert_allclose(ac.router_hessian(u, np.asarray(e), i), want,
                               rtol=1e-4, atol=1e-6)


def test_ac_weights_sphere_a_hand_computed_2x2_cluster():
  # Per-feature MADs 1 and 2: M = diag(1/1, 1/2) up to the 1e-4 and the
  # mean-1 scaling, so E[h h^T] = diag(1, 4) (kappa 4) becomes ~I.
  h = np.array([[1.0, 2.0], [1.0, -2.0], [-1.0, 2.0], [-1.0, -2.0]])
  m = ac.ac_weights(h, np.zeros(4, np.int32), 1)[0]
  np.testing.assert_allclose(m, [1 / 1.0001, 1 / 2.0001] / np.mean(
      [1 / 1.0001, 1 / 2.0001]), rtol=1e-5)
  e = np.zeros((4, 2))  # uniform p: the Hessian is B E[u u^T]
  assert ac.kappa(ac.router_hessian(h, e, 0)) == pytest.approx(4.0)
  np.testing.assert_allclose(ac.kappa_ratios(h, m, e), 0.25, rtol=1e-3)


def test_contraction_closed_forms_2x2():
  # Symmetric doubly stochastic: rho = |1 - 2a| and (i) is tight.
  a = np.array([[0.7, 0.3], [0.3, 0.7]])
  assert sy.second_modulus(a) == pytest.approx(0.4)
  assert sy.contraction(a) == pytest.approx(0.4)
  # Row-stochastic, not symmetric: rho = |1 - a - b| = 0.5 but v = (1, -1)
  # is stretched by sqrt(((1 - 2a)^2 + (1 - 2b)^2) / 2) = sqrt(0.34).
  a = np.array([[0.9, 0.1], [0.4, 0.6]])
  assert sy.second_modulus(a) == pytest.approx(0.5)
  assert sy.contraction(a) == pytest.approx(np.sqrt(0.34))


def test_sinkhorn_graph_is_doubly_stochastic_and_keeps_topk():
  rng = np.random.default_rng(1)
  a = sy.doubly_stochastic(rng, 6)
  np.testing.assert_allclose(a, a.T)
  np.testing.assert_allclose(a.sum(0), 1, atol=1e-10)
  gates = ac.softmax(rng.normal(size=(16, 6)) * 2)
  changes, ratio = sy.topk_stability(a, gates, 2)
  assert changes == 0 and ratio >= 1


def test_topk_stability_closed_form():
  # A = (1 - c) I + c 11^T / E: rho = 1 - c, r = (1 - c) s + c / E. The
  # least mean-zero ds swapping i and o has norm (s_i - s_o) / sqrt(2), the
  # guaranteed radius g / (2 rho) = (s_i - s_o) / 2: ratio sqrt(2).
  e, c = 5, 0.3
  a = (1 - c) * np.eye(e) + c / e
  gates = ac.softmax(np.random.default_rng(2).normal(size=(8, e)))
  changes, ratio = sy.topk_stability(a, gates, 2)
  assert changes == 0
  assert ratio == pytest.approx(np.sqrt(2), rel=1e-9)


def test_estimators_on_hand_counted_selections():
  # Top-2 sets {0,1}, {0,1}, {0,2}, {1,2}: mu(C_01) = 1/2, the joint
  # frequency; Algorithm 1's row of expert 0 is (3, 2, 1) / 6, so
  # a_01 = 1/3 = mu(C_01) / (K pi_0) with pi_0 = 3/4.
  idx = np.array([[[0, 1], [1, 0], [0, 2], [2, 1]]])
  joint, rownorm = sy.estimators(idx, 3)
  np.testing.assert_allclose(joint[0], [[0, .5, .25], [.5, 0, .25],
                                        [.25, .25, 0]])
  np.testing.assert_allclose(rownorm[0, 0], [0.5, 1 / 3, 1 / 6], rtol=1e-6)
  assert rownorm[0, 0, 1] == pytest.approx(0.5 / (2 * 0.75))
  graph = sy.graph_algorithm1(np.repeat(idx, 40, axis=0), 3)
  np.testing.assert_allclose(graph.sum(1), 1 - 0.9 ** 40, rtol=1e-5)


def test_dense_moe_layer_is_the_softmax_mixture():
  p = vm.moe_params(3)
  x = np.random.default_rng(2).normal(size=(5, vm.DL))
  got = np.asarray(vm.moe_apply_jit(p, jnp.asarray(x, jnp.float32), vm.EL))
  q = jax.tree.map(lambda v: np.asarray(v, np.float64), p)
  gates = ac.softmax(x @ q["router"]["logits"]["dense"]["kernel"])
  want = np.zeros_like(x)
  for i in range(vm.EL):
    d0, d1 = q["Mlp"]["Dense_0"], q["Mlp"]["Dense_1"]
    hidden = np.asarray(jax.nn.gelu(x @ d0["kernel"][i] + d0["bias"][i]))
    want += gates[:, i:i + 1] * (hidden @ d1["kernel"][i] + d1["bias"][i])
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_lemma1_router_term_vanishes_for_identical_experts():
  # f_i = f for all i: sum_i p_i f (s_i - sbar)^T = 0, so the bound is L_f
  # and the layer's Jacobian (jax.jacfwd) is the expert's. Same shapes as
  # the script's search, so its compiled form is reused.
  p = vm.moe_params(4)
  p = {**p, "Mlp": jax.tree.map(lambda v: jnp.broadcast_to(v[:1], v.shape),
                                p["Mlp"])}
  lips = vm.expert_lipschitz(p)
  np.testing.assert_allclose(lips, lips[0], rtol=1e-6)
  x0 = vm.project(np.random.default_rng(3).normal(size=(16, vm.DL)))
  pairs = np.concatenate([x0, vm.project(x0[::-1])], axis=1)
  jn, bound, bn, ratios = (np.asarray(v) for v in vm.lemma1_search(
      p, jnp.asarray(lips, jnp.float32), jnp.asarray(x0, jnp.float32),
      jnp.asarray(pairs, jnp.float32)))
  assert bn.max() < 1e-5
  np.testing.assert_allclose(bound, lips[0], rtol=1e-5)
  assert jn.max() <= lips[0] and ratios.max() <= lips[0]
  assert jn.max() > 0.2 * lips[0]  # not a vacuous comparison


def test_theorem1_is_an_equality_for_orthogonal_experts():
  # Tilt 0: X^T X is block diagonal, eps1 = eps2 = 0, ||w*||^2 =
  # sum_i ||w_i*||^2.
  rng = np.random.default_rng(5)
  for _ in range(5):
    lhs, rhs = vm.theorem1_instance(rng, 0.0)
    assert rhs == pytest.approx(lhs, rel=1e-9)
  lhs, rhs = vm.theorem1_instance(rng, 0.5)
  assert rhs < lhs


def test_theorem2_scalar_case_by_hand():
  # D = 1: Z_1 = 2, Z_2 = 4, beta = (1, 3), no residual. w* = 14/6,
  # ratio 9 / (7/3)^2 = 81/49; ||Delta_1|| = 4/3 leaves 1/3 over
  # ||beta_1|| (gamma_1 = 9) and ||Delta_2|| = 2/3 < ||beta_2||: gamma* = inf.
  xs = [np.ones((2, 1)), np.full((1, 1), 2.0)]
  gamma, ratio, err = vm.theorem2_quantities(
      xs, [np.ones(1), np.full(1, 3.0)], [np.zeros(2), np.zeros(1)])
  assert gamma == np.inf
  assert ratio == pytest.approx(81 / 49)
  assert err < 1e-12
