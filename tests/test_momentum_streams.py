"""The MomentumSMoE streams against NumPy recurrences on the model's own MoE
outputs, and against the plain residual (issue "Momentum residual streams")."""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import numpy as np
import pytest

from naive import MomentumReference
from vmoe_ext.models import build_model
from vmoe_ext.models.vit import MlpBlock
from vmoe_ext.moe.layer import MoeLayer
from vmoe_ext.streams.time_varying import time_varying_mu

MOE_BLOCKS = (1, 2, 4)  # Blocks 0 and 3 dense: state passes through them.


def _model(stream, router=None, name="vit_moe", **moe):
  moe = dict(dict(layers=MOE_BLOCKS, num_experts=3, capacity_factor=4.0,
                  router=router or {"name": "noisy_topk",
                                    "num_selected": 2}), **moe)
  return build_model(dict(
      name=name, num_classes=3, patch_size=(4, 4), hidden_size=8,
      num_layers=5, num_heads=2, mlp_dim=8, classifier="token", moe=moe,
      stream=stream))


@pytest.fixture(scope="module")
def images():
  return jax.random.normal(jax.random.key(1), (2, 8, 8, 1))


def _perturbed(variables, seed=2):
  """Random LayerNorm scales/biases etc., so that LN_1 vs LN_2 matter."""
  leaves, tree = jax.tree.flatten(variables["params"])
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  leaves = [v + 0.2 * jax.random.normal(k, v.shape, v.dtype)
            for v, k in zip(leaves, keys)]
  return dict(variables, params=jax.tree.unflatten(tree, leaves))


def _trace(model, variables, images):
  """Applies the model, recording per block the stream's input/output and
  every MoE/MLP call's input h and output u, in call order."""
  blocks: dict[str, dict] = {}

  def interceptor(next_fun, args, kwargs, context):
    out = next_fun(*args, **kwargs)
    if context.method_name != "__call__":
      return out
    path = context.module.scope.path
    if len(path) == 2 and path[0].startswith("encoderblock_"):
      rec = blocks.setdefault(path[0], {"calls": []})
      if path[1] == "Stream":
        rec["x"], rec["out"] = np.asarray(args[0]), np.asarray(out[0])
      elif isinstance(context.module, (MoeLayer, MlpBlock)):
        rec["calls"].append((np.asarray(args[0]), np.asarray(
            out[0] if isinstance(out, tuple) else out)))
    return out

  with nn.intercept_methods(interceptor):
    logits, _ = model.apply(variables, images)
  return blocks, logits


def _check_against_reference(model, name, layout, coeffs, images):
  variables = _perturbed(model.init(jax.random.key(0), images))
  blocks, _ = _trace(model, variables, images)
  ref = MomentumReference(name, layout, coeffs)
  params = variables["params"]
  applied = 0
  for i in range(model.num_layers):
    rec = blocks[f"encoderblock_{i}"]
    is_moe = i in MOE_BLOCKS
    if "x" not in rec:  # The stream skipped this dense block (paper).
      assert layout == "paper" and not is_moe
      continue
    p = params[f"encoderblock_{i}"]
    ln1 = (np.asarray(p["LayerNorm_1"]["scale"]),
           np.asarray(p["LayerNorm_1"]["bias"]))
    ln2 = ((np.asarray(p["Stream"]["LayerNorm_2"]["scale"]),
            np.asarray(p["Stream"]["LayerNorm_2"]["bias"]))
           if layout == "vmoe_reference" else None)
    calls = iter(rec["calls"])

    def us(h_expected):
      h, u = next(calls)
      np.testing.assert_allclose(h, h_expected, rtol=1e-5, atol=1e-5)
      return np.asarray(u, np.float64)

    expected = ref.block(rec["x"], us, ln1, ln2, is_moe)
    assert next(calls, None) is None  # Every call was checked.
    np.testing.assert_allclose(rec["out"], expected, rtol=1e-4, atol=1e-5)
    applied += 1
  assert applied == (5 if layout == "vmoe_reference" else len(MOE_BLOCKS))
  assert ref.t == len(MOE_BLOCKS)


ROBUST = dict(gamma=0.96, mu=0.04, alpha=1 / 24)  # p = 0.2, k = 1.25, L = 1.
CASES = {
    "momentum": ({"mu": 0.8, "gamma": 0.9}, dict(mu=0.8, gamma=0.9)),
    "robust_momentum": ({}, ROBUST),
    "nag": ({"mu": 0.6, "gamma": 0.8}, dict(mu=0.6, gamma=0.8, sign=1.0)),
    "nag_as_printed": ({"name": "nag", "lookahead": "as_printed"},
                       dict(mu=0.7, gamma=1.0, sign=-1.0)),
    "time_varying": ({"restart_every": 2, "gamma": 0.9},
                     dict(mu=lambda t: time_varying_mu(t, 2), gamma=0.9)),
    "rmsprop": ({"mu": 0.5, "gamma": 0.7, "eps": 1e-3, "momentum_mu": 0.6},
                dict(mu=0.5, gamma=0.7, eps=1e-3, hb_mu=0.6, hb_gamma=0.7)),
    "sam": ({"rho": 0.3, "gamma": 0.9}, dict(rho=0.3, gamma=0.9)),
    "complex_momentum": (
        {"mu_abs": 0.6, "mu_angle": 0.5},
        dict(mu=0.6 * complex(math.cos(0.5), math.sin(0.5)), gamma=1.0)),
    "adam": ({"mu": 0.6, "beta": 0.5, "gamma": 0.8, "eps": 1e-3,
              "kappa": 0.1, "momentum_gamma": 0.9},
             dict(form="paper", mu=0.6, beta=0.5, gamma=0.8, eps=1e-3,
                  kappa=0.1, hb_mu=0.6, hb_gamma=0.9)),
    "adam_code": ({"name": "adam", "form": "code", "mu": 0.6, "beta": 0.5,
                   "gamma": 0.8, "eps": 1e-3, "momentum_gamma": 0.9},
                  dict(form="code", beta1=0.9, beta=0.5, gamma=0.8, eps=1e-3,
                       kappa=1.0, hb_mu=0.6, hb_gamma=0.9)),
}


@pytest.mark.parametrize("layout", ["paper", "vmoe_reference"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_stream_equals_numpy_recurrence_on_the_models_moe_outputs(
    case, layout, images):
  """Over 5 blocks (MoE in 1, 2, 4): the MoE inputs (shifted points
  included) and every block's output equal the paper's / the authors' code's
  recurrence unrolled in NumPy on the MoE outputs the model computed."""
  fields, coeffs = CASES[case]
  fields = dict(fields)
  name = fields.pop("name", case)
  model = _model(dict(name=name, layout=layout, **fields))
  _check_against_reference(model, name, layout, coeffs, images)


@pytest.mark.parametrize("stream", [
    {"name": "momentum", "mu": 0.0, "gamma": 1.0},
    {"name": "nag", "mu": 0.0, "gamma": 1.0},
    {"name": "time_varying", "restart_every": 1},
    {"name": "sam", "rho": 0.0},
    {"name": "complex_momentum", "mu_abs": 0.0},
], ids=lambda s: s["name"])
def test_paper_layout_without_momentum_is_the_plain_residual(stream, images):
  """mu = 0, gamma = 1 (paper layout): same parameters, same logits, bit for
  bit, as the plain residual, with dense blocks in between."""
  plain = _model({"name": "plain"})
  variables = _perturbed(plain.init(jax.random.key(0), images))
  other = _model(dict(stream, layout="paper"))
  assert (jax.tree.structure(other.init(jax.random.key(0), images))
          == jax.tree.structure(variables))
  want, _ = plain.apply(variables, images)
  got, _ = other.apply(variables, images)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_vmoe_reference_layout_adds_a_post_layernorm_to_every_block(images):
  model = _model({"name": "momentum"})
  params = model.init(jax.random.key(0), images)["params"]
  for i in range(5):
    assert set(params[f"encoderblock_{i}"]["Stream"]) == {"LayerNorm_2"}
  assert "encoder_norm" in params  # The final LayerNorm still follows.


@pytest.mark.parametrize("router", [
    {"name": "expert_choice"},
    {"name": "acmoe", "layers": "full",
     "base": {"name": "noisy_topk", "num_selected": 2}},
    {"name": "symphony", "base": {"name": "noisy_topk", "num_selected": 2}},
    {"name": "cosine", "num_selected": 2},
], ids=lambda r: r["name"])
def test_robust_momentum_with_every_router(router, images):
  """The recurrence holds whatever routes the MoE, and the routing the block
  records is the one at the extrapolated point (ACMoE reads it)."""
  model = _model({"name": "robust_momentum"}, router=router,
                 capacity_factor=1.0 if router["name"] == "expert_choice"
                 else 4.0)
  _check_against_reference(model, "robust_momentum", "vmoe_reference",
                           ROBUST, images)


ALL_STREAMS = [
    {"name": "momentum", "learn": "gamma"}, {"name": "adam"},
    {"name": "robust_momentum"}, {"name": "nag"}, {"name": "time_varying"},
    {"name": "rmsprop"}, {"name": "sam"}, {"name": "complex_momentum"}]


SYMPHONY_ACMOE = {
    "vit_moe": {"name": "symphony", "beta": 0.5, "base": {
        "name": "acmoe", "layers": "full",
        "base": {"name": "noisy_topk", "num_selected": 2}}},
    "soft_moe_vit": {"name": "symphony_soft", "beta": 0.5, "base": {
        "name": "acmoe", "normalization": "softmoe", "layers": "full",
        "base": {"name": "soft", "num_slots": 3}}},
}


@pytest.mark.parametrize("backbone", sorted(SYMPHONY_ACMOE))
@pytest.mark.parametrize("stream", ALL_STREAMS, ids=lambda s: s["name"])
def test_every_stream_composes_with_acmoe_and_symphony_in_training(
    stream, backbone, images):
  """A training-mode forward (router noise, state updates) with Symphony
  (SymphonySoftMoE) over ACMoE on V-MoE (SoftMoE): the graph is updated
  exactly once per MoE block per step (the primary call), whatever the
  number of MoE calls the stream makes."""
  model = _model(stream, router=SYMPHONY_ACMOE[backbone], name=backbone,
                 **({"group_size": None} if backbone == "soft_moe_vit"
                    else {}))
  variables = model.init(jax.random.key(0), images)
  (logits, metrics), state = model.apply(
      variables, images, deterministic=False, update_state=True,
      mutable=["router_state"], rngs={"gating": jax.random.key(3),
                                      "dropout": jax.random.key(4)})
  assert np.all(np.isfinite(np.asarray(logits)))
  assert np.isfinite(float(metrics["auxiliary_loss"]))
  for i in MOE_BLOCKS:
    graph = np.asarray(state["router_state"][f"encoderblock_{i}"]["Moe"][
        "router"]["adjacency"])
    # One EMA step from zeros: a row sums to (1 - beta) = 0.5 (0 for an
    # expert nobody co-selected); two updates would give 0.75.
    rows = graph.sum(1)
    assert np.any(np.isclose(rows, 0.5, rtol=1e-5)), rows
    assert np.all(np.isclose(rows, 0.5, rtol=1e-5) | (rows == 0)), rows


def test_soft_moe_backbone(images):
  model = _model({"name": "adam", "form": "code", "layout": "paper"},
                 router={"name": "soft", "num_slots": 2},
                 name="soft_moe_vit", group_size=None)
  _check_against_reference(
      model, "adam", "paper", dict(form="code", beta1=0.9, beta=0.999,
                                   gamma=1.0, eps=1e-8, kappa=1.0, hb_mu=0.7,
                                   hb_gamma=1.0), images)


def test_robust_routing_record_is_taken_at_the_extrapolated_point(images):
  """The sown `moe_input` and `selected_experts` of an MoE block come from
  the call at LN_1(x) + alpha gamma m: re-routing that input gives them."""
  model = _model({"name": "robust_momentum"})
  variables = _perturbed(model.init(jax.random.key(0), images))
  blocks, _ = _trace(model, variables, images)
  _, state = model.apply(variables, images, mutable=["intermediates"])
  inter = state["intermediates"]
  for i in MOE_BLOCKS[1:]:  # From the second MoE block m != 0.
    h, _ = blocks[f"encoderblock_{i}"]["calls"][0]
    sown = inter[f"encoderblock_{i}"]["Moe"]
    np.testing.assert_allclose(np.asarray(sown["moe_input"][0]), h,
                               rtol=1e-6)
    x = blocks[f"encoderblock_{i}"]["x"]
    p = variables["params"][f"encoderblock_{i}"]["LayerNorm_1"]
    plain_h = np.asarray(nn.LayerNorm().apply({"params": p}, x))
    assert not np.allclose(h, plain_h, atol=1e-4)  # It did move.
