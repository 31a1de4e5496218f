"""Options that reproduce the authors' code exactly: exact-erf GELU, a bias on
the linear router logits. References: scipy's erf, hand-computed logits."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import naive
from vmoe_ext.carving.profiling import activate
from vmoe_ext.errors import ConfigError
from vmoe_ext.models import build_model
from vmoe_ext.moe.experts import DenseMlp, MlpExperts
from vmoe_ext.routers import RoutingContext, build_router

X = np.linspace(-6.0, 6.0, 241).astype(np.float32)


# ----------------------------------------------------------- exact-erf GELU


def test_gelu_exact_is_the_erf_form_and_gelu_stays_tanh():
  x64 = X.astype(np.float64)
  exact = jax.nn.gelu(jnp.asarray(X), approximate=False)
  np.testing.assert_allclose(exact, naive.gelu_exact(x64), rtol=1e-6,
                             atol=1e-7)
  np.testing.assert_allclose(activate("gelu_exact", x64),
                             naive.gelu_exact(x64),
                             rtol=1e-12)  # The carving's NumPy twin.
  np.testing.assert_allclose(activate("gelu", x64), naive.gelu(x64),
                             rtol=1e-12)
  # The two forms differ by up to ~5e-4 (near |x| = 2): a real option.
  assert 1e-4 < np.max(np.abs(naive.gelu_exact(x64) - naive.gelu(x64))) < 1e-3


@pytest.mark.parametrize("activation", ["gelu", "gelu_exact"])
def test_dense_mlp_and_experts_use_the_activation_asked_for(activation):
  rng = np.random.default_rng(0)
  x = rng.standard_normal((5, 4)).astype(np.float32) * 2
  mlp = DenseMlp(7, activation=activation)
  params = mlp.init(jax.random.key(0), x)["params"]
  np.testing.assert_allclose(
      mlp.apply({"params": params}, x),
      np.stack([naive.mlp(params, v, activation) for v in x]), rtol=1e-5,
      atol=1e-6)
  experts = MlpExperts(num_experts=3, hidden_size=7, activation=activation)
  xe = jnp.asarray(np.stack([x, -x, 0.5 * x]))  # [E, N, D]
  ep = experts.init(jax.random.key(1), xe)["params"]
  ye = experts.apply({"params": ep}, xe)
  for e in range(3):
    np.testing.assert_allclose(
        ye[e], np.stack([naive.expert_mlp(ep, e, v, activation)
                         for v in np.asarray(xe[e])]), rtol=1e-5, atol=1e-6)


def test_model_option_changes_dense_and_moe_blocks_only_through_gelu():
  """`model.mlp_activation="gelu_exact"`: the same parameters give a
  different forward (both MLP kinds switch), and the default is tanh."""
  cfg = dict(name="vit_moe", num_classes=3, patch_size=(4, 4), hidden_size=8,
             num_layers=2, num_heads=2, mlp_dim=8,
             moe=dict(layers=(1,), num_experts=2, group_size=None,
                      router=dict(name="noisy_topk", num_selected=1)))
  x = jax.random.normal(jax.random.key(0), (2, 8, 8, 1))
  tanh = build_model(cfg)
  exact = build_model({**cfg, "mlp_activation": "gelu_exact"})
  assert tanh.mlp_activation == "gelu"
  variables = tanh.init(jax.random.key(1), x)
  variables["params"] = jax.tree.map(  # A non-zero head.
      lambda v: v + 0.3 * jax.random.normal(jax.random.key(2), v.shape),
      variables["params"])
  a = tanh.apply(variables, x)[0]
  b = exact.apply(variables, x)[0]
  assert 1e-7 < float(jnp.max(jnp.abs(a - b))) < 1e-2
  with pytest.raises(ConfigError, match="mlp_activation"):
    build_model({**cfg, "mlp_activation": "gelu_erf"})


# ---------------------------------------------------- router logits bias


def test_logits_bias_adds_to_the_hand_computed_logits():
  router = build_router({"name": "noisy_topk", "num_selected": 2,
                         "logits_bias": True}, num_experts=3)
  x = jnp.asarray([[[1.0, 2.0]]])  # [G=1, S=1, D=2]
  variables = router.init(jax.random.key(0), x, RoutingContext(), capacity=1,
                          deterministic=True)
  dense = variables["params"]["logits"]["dense"]
  assert set(dense) == {"kernel", "bias"}
  np.testing.assert_array_equal(dense["bias"], 0.0)  # Starts at 0.
  kernel = jnp.asarray([[0.5, -1.0, 0.25], [0.0, 0.5, 0.25]])
  bias = jnp.asarray([0.1, 1.2, -0.4])
  params = {"logits": {"dense": {"kernel": kernel, "bias": bias}}}
  out = router.apply({"params": params}, x, RoutingContext(), capacity=1,
                     deterministic=True)
  # By hand: x W = [0.5, 0, 0.75]; + b = [0.6, 1.2, 0.35].
  logits = np.asarray([0.6, 1.2, 0.35])
  gates = np.exp(logits) / np.exp(logits).sum()
  np.testing.assert_array_equal(out.routing.expert_indices[0, 0], [1, 0])
  np.testing.assert_allclose(out.routing.gates[0, 0], gates[[1, 0]],
                             rtol=1e-6)
  # Off by default: no bias parameter, the logits of V-MoE's router.
  plain = build_router({"name": "noisy_topk"}, num_experts=3)
  assert set(plain.init(jax.random.key(0), x, RoutingContext(), capacity=1,
                        deterministic=True)["params"]["logits"]["dense"]) == {
                            "kernel"}


def test_top_p_inherits_logits_bias_and_cosine_refuses_it():
  x = jnp.ones((1, 2, 4))
  top_p = build_router({"name": "top_p", "logits_bias": True}, num_experts=4)
  params = top_p.init(jax.random.key(0), x, RoutingContext(), capacity=2,
                      deterministic=True)["params"]
  assert params["logits"]["dense"]["bias"].shape == (4,)
  with pytest.raises(ConfigError, match="router.logits_bias"):
    build_router({"name": "cosine", "logits_bias": True}, num_experts=3)
  with pytest.raises(ConfigError, match="router.logits_bias"):
    build_router({"name": "noisy_topk", "logits_bias": 1}, num_experts=3)
