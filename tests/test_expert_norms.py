"""`expert_norms` against a NumPy loop over tokens and experts."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from vmoe_ext.evaluate.expert_norms import expert_norms
from vmoe_ext.models import build_model
from vmoe_ext.train.config_files import load_config
from vmoe_ext.train.forward import forward_pass


def _gelu(x):  # The tanh approximation (flax's `nn.gelu` default).
  return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))


@pytest.fixture(scope="module")
def setup():
  config = load_config("tiny")
  config.model.num_layers = 4
  config.model.moe = dict(every=2, num_experts=4, capacity_factor=4.0,
                          group_size=5,
                          router=dict(name="noisy_topk", num_selected=2))
  model = build_model(config.model)
  images = jax.random.uniform(jax.random.key(3), (6, 8, 8, 1))
  variables = jax.jit(model.init)(jax.random.key(0), images)
  params = jax.tree.map(  # Experts that differ clearly.
      lambda p: p + 0.3 * jax.random.normal(jax.random.key(p.size), p.shape),
      dict(variables["params"]))
  return model, {"params": params}, images


def _naive(x, mask, params):
  """Per token, every expert's MLP output norm, ranked largest first."""
  n_tok, e = mask.shape
  counts = np.zeros(e)
  for n in range(n_tok):
    norms = []
    for i in range(e):
      h = _gelu(x[n] @ params["Dense_0"]["kernel"][i]
                + params["Dense_0"]["bias"][i])
      out = h @ params["Dense_1"]["kernel"][i] + params["Dense_1"]["bias"][i]
      norms.append(np.linalg.norm(out))
    by_norm = sorted(range(e), key=lambda i: (-norms[i], i))
    for r, i in enumerate(by_norm):
      counts[r] += mask[n, i]
  return counts


def test_rank_shares_and_output_norms_match_a_loop(setup):
  model, variables, images = setup
  valid = np.array([True] * 5 + [False])  # The last example is padding.
  got = expert_norms(model, variables, [(images[:3], valid[:3]),
                                        (images[3:], valid[3:])])
  moe = jax.jit(lambda v, x: forward_pass(model, v, x, intermediates=True)
                )(variables, images).moe
  assert sorted(got) == sorted(moe) == ["encoderblock_1", "encoderblock_3"]
  for block, sown in moe.items():
    x = np.asarray(sown["moe_input"], np.float64)[:5].reshape(-1, 16)
    y = np.asarray(sown["moe_output"], np.float64)[:5].reshape(-1, 16)
    mask = np.asarray(sown["expert_mask"])[:5].reshape(-1, 4)
    p = jax.tree.map(lambda a: np.asarray(a, np.float64),
                     variables["params"][block]["Moe"]["Mlp"])
    counts = _naive(x, mask, p)
    np.testing.assert_allclose(got[block]["rank_share"],
                               100 * counts / counts.sum(), atol=1e-9)
    assert got[block]["rank_imbalance"] == pytest.approx(
        np.std(100 * counts / counts.sum()))
    assert got[block]["output_norm"] == pytest.approx(
        np.linalg.norm(y, axis=-1).mean(), rel=1e-5)


def test_the_sown_output_is_the_gated_expert_output(setup):
  """The sown MoE output is the gate-weighted sum of the selected
  experts' outputs on the token."""
  model, variables, images = setup
  moe = jax.jit(lambda v, x: forward_pass(model, v, x, intermediates=True)
                )(variables, images).moe
  sown = moe["encoderblock_1"]
  x = np.asarray(sown["moe_input"], np.float64).reshape(-1, 16)
  y = np.asarray(sown["moe_output"], np.float64).reshape(-1, 16)
  mask = np.asarray(sown["expert_mask"]).reshape(-1, 4)
  p = jax.tree.map(lambda a: np.asarray(a, np.float64),
                   variables["params"]["encoderblock_1"]["Moe"]["Mlp"])
  outs = np.stack([
      _gelu(x @ p["Dense_0"]["kernel"][i] + p["Dense_0"]["bias"][i])
      @ p["Dense_1"]["kernel"][i] + p["Dense_1"]["bias"][i]
      for i in range(4)], axis=1)  # [N, E, D]
  # y lies in the span of the selected experts' outputs (top-2, no drops
  # at capacity factor 4): the least-squares residual is ~0.
  for n in range(len(x)):
    basis = outs[n, mask[n]].T  # [D, K]
    coef, *_ = np.linalg.lstsq(basis, y[n], rcond=None)
    assert np.linalg.norm(basis @ coef - y[n]) < 1e-4 * np.linalg.norm(y[n])
    assert np.all(coef > 0)  # Positive gates.
