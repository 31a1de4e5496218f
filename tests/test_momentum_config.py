"""MomentumSMoE streams: coefficients, bad input, Proposition 1, learnable
coefficients, configs, and training + bit-identical resume of every stream."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest

from eval_check import assert_final_metrics_match
from grad_check import assert_grads_match_differences
from resume_check import short_schedule, straight_vs_resumed
from vmoe_ext.errors import ConfigError
from vmoe_ext.models import build_model
from vmoe_ext.moe.contract import RoutingContext
from vmoe_ext.streams import STREAMS
from vmoe_ext.streams.heavy_ball import HeavyBall
from vmoe_ext.streams.robust import RobustMomentum, p_range
from vmoe_ext.streams.time_varying import time_varying_mu
from vmoe_ext.train.config_files import load_config
from vmoe_ext.app.schema import validate_config

# ------------------------------------------------------------ robust momentum


@pytest.mark.parametrize("fields", [
    {}, {"p": 0.2, "kappa": 1.25}, {"rho": 0.2, "kappa": 1.25},
    {"p": 0.2, "L": 1.0, "m": 0.8}])
def test_robust_coefficients_closed_form(fields):
  """p = 0.2, k = 1.25, L = 1: alpha = 0.041667, gamma = 0.96, mu = 0.04
  (by hand: gamma = 1.25 * 0.64 * 1.2, mu = 1.25 * 0.008 / 0.25,
  alpha = 0.008 / (0.25 * 0.64 * 1.2))."""
  c = RobustMomentum(**fields).coefficients
  assert c.gamma == pytest.approx(0.96, abs=1e-12)
  assert c.mu == pytest.approx(0.04, abs=1e-12)
  assert c.alpha == pytest.approx(0.041667, abs=5e-7)


def test_robust_coefficients_scale_with_L():
  c = RobustMomentum(p=0.2, L=2.0, m=1.6).coefficients  # k = 1.25.
  assert (c.gamma, c.mu) == pytest.approx((0.48, 0.04))
  assert p_range(4.0) == pytest.approx((0.5, 0.75))


@pytest.mark.parametrize("fields,field", [
    ({"p": 0.1}, "p"),            # Below 1 - 1/sqrt(1.25) = 0.1056.
    ({"p": 0.21}, "p"),           # Above 1 - 1/1.25 = 0.2.
    ({"rho": 0.3}, "rho"),
    ({"kappa": 1.0}, "kappa"),    # k = 1 divides by zero.
    ({"kappa": 0.5}, "kappa"),
    ({"L": 1.0, "m": 1.0}, "m"),
    ({"m": -1.0}, "m"),
    ({"p": 0.2, "rho": 0.2}, "rho"),
    ({"m": 0.8, "kappa": 1.25}, "kappa"),
])
def test_robust_bad_input_names_the_field(fields, field):
  with pytest.raises(ConfigError) as e:
    _model(dict(name="robust_momentum", **fields))
  assert e.value.field == f"model.stream.{field}", str(e.value)


# ----------------------------------------------------------------- bad input

def _model(stream, **moe):
  return build_model(dict(
      name="vit_moe", num_classes=3, patch_size=(4, 4), hidden_size=8,
      num_layers=4, num_heads=2, mlp_dim=8,
      moe=dict(dict(every=2, num_experts=2), **moe), stream=stream))


@pytest.mark.parametrize("stream,field", [
    ({"name": "momentum", "mu": 1.0}, "mu"),
    ({"name": "momentum", "mu": -1.0}, "mu"),
    ({"name": "momentum", "gamma": 0.0}, "gamma"),
    ({"name": "momentum", "gamma": -1.0}, "gamma"),
    ({"name": "momentum", "learn": "mu"}, "learn"),
    ({"name": "momentum", "learn": "gamma_linear", "gamma": 1.0}, "gamma"),
    ({"name": "momentum", "layout": "vmoe"}, "layout"),
    ({"name": "momentum", "layout": "paper", "blocks": "all"}, "blocks"),
    ({"name": "momentum", "blocks": "moe"}, "blocks"),
    ({"name": "adam", "beta": 1.0}, "beta"),
    ({"name": "adam", "beta": -0.1}, "beta"),
    ({"name": "adam", "eps": 0.0}, "eps"),
    ({"name": "adam", "gamma": 0.0}, "gamma"),
    ({"name": "adam", "mu": 1.0}, "mu"),
    ({"name": "adam", "beta1": 0.9}, "beta1"),
    ({"name": "adam", "form": "code", "kappa": 0.5}, "kappa"),
    ({"name": "adam", "form": "pytorch"}, "form"),
    ({"name": "adam", "block": 3}, "block"),   # The first MoE block is 1.
    ({"name": "adam", "momentum_mu": 1.5}, "momentum_mu"),
    ({"name": "rmsprop", "block": 3}, "block"),
    ({"name": "rmsprop", "eps": -1.0}, "eps"),
    ({"name": "nag", "mu": 1.0}, "mu"),
    ({"name": "nag", "lookahead": "behind"}, "lookahead"),
    ({"name": "time_varying", "restart_every": 0}, "restart_every"),
    ({"name": "sam", "rho": -0.1}, "rho"),
    ({"name": "complex_momentum", "mu_abs": 1.0}, "mu_abs"),
    ({"name": "robust_momentum", "layout": "code"}, "layout"),
])
def test_bad_input_names_the_full_field(stream, field):
  with pytest.raises(ConfigError) as e:
    _model(stream)
  assert e.value.field == f"model.stream.{field}", str(e.value)


def test_adam_on_the_first_moe_block_is_accepted():
  assert _model({"name": "adam", "block": 1}).stream["block"] == 1


def test_bad_config_file_input_fails_validation_before_compiling():
  config = load_config("momentum", "adam")
  config.model.stream = dict(config.model.stream, beta=1.0)
  with pytest.raises(ConfigError) as e:
    validate_config(config)
    build_model(config.model)
  assert e.value.field == "model.stream.beta"


# -------------------------------------------------------------- Proposition 1

def _heavy_ball_jacobian(mu, gamma, sigma):
  """Jacobian of one paper-layout heavy-ball block on (x, p) for the
  linearised MoE u(x) = -sigma x (f = sigma x), D = 1: the 2x2 iteration
  (sigma may be traced: one compilation for all sigmas of a (mu, gamma))."""
  stream = HeavyBall(mu=mu, gamma=gamma, layout="paper")

  def ffn(z, *, shift=None, primary=True):
    del shift, primary
    return -sigma * z, None

  def step(v):
    x, p = v[0].reshape(1, 1, 1), v[1].reshape(1, 1, 1)
    x, state = stream.apply({}, x, ffn, {"p": p}, ctx=RoutingContext(),
                            is_moe=True)
    return jnp.stack([x.reshape(()), state["p"].reshape(())])

  return jax.jacobian(step)(jnp.zeros(2))


def _heavy_ball_matrices(mu: float, gamma: float, sigmas) -> np.ndarray:
  """`[N, 2, 2]`: the iteration for each of the sigmas."""
  return np.asarray(jax.jit(jax.vmap(
      lambda s: _heavy_ball_jacobian(mu, gamma, s)))(
          jnp.asarray(sigmas, jnp.float32)))


def _heavy_ball_matrix(mu: float, gamma: float, sigma: float) -> np.ndarray:
  return _heavy_ball_matrices(mu, gamma, [sigma])[0]


def test_proposition_1_on_a_grid():
  """Spectral radius of the heavy-ball iteration < 1 exactly when
  mu in (-1, 1) and gamma sigma in (0, 2 + 2 mu); plain SMoE (mu = 0):
  (0, 2). Grid points within 1e-3 of the boundary are skipped."""
  checked = 0
  for mu in np.linspace(-0.95, 0.95, 15):
    for gamma in (0.5, 1.0):
      bound = 2 + 2 * mu
      products = [float(gs) for gs in np.linspace(-0.5, 4.5, 23)
                  if min(abs(gs), abs(gs - bound)) >= 1e-3]
      matrices = _heavy_ball_matrices(float(mu), gamma,
                                      np.asarray(products) / gamma)
      for gs, a in zip(products, matrices):
        stable = max(abs(np.linalg.eigvals(a))) < 1
        assert stable == (0 < gs < bound), (mu, gamma, gs)
        checked += 1
  assert checked > 600
  # The matrix is the paper's A = [[0, 1], [-mu, 1 + mu - gamma sigma]] up to
  # a change of basis: same trace and determinant.
  a = _heavy_ball_matrix(0.7, 1.0, 0.3)
  assert np.trace(a) == pytest.approx(1 + 0.7 - 0.3)
  assert np.linalg.det(a) == pytest.approx(0.7)


# ------------------------------------------------------ learnable mu / gamma

def _one_step(stream, variables, x, u, p):
  def ffn(z, *, shift=None, primary=True):
    del z, shift, primary
    return u, None
  return stream.apply(variables, x, ffn, {"p": p}, ctx=RoutingContext(),
                      is_moe=True)


@pytest.mark.parametrize("layout", ["paper", "vmoe_reference"])
def test_learnable_coefficients_follow_their_maps_and_ranges(layout):
  """mu = tanh(mu_raw), gamma = softplus(gamma_raw) for any raw value:
  the step equals heavy-ball with those numbers; mu stays in (-1, 1),
  gamma > 0; the initial values are the fields'."""
  rng = np.random.default_rng(0)
  x, u, p = (jnp.asarray(rng.normal(size=(2, 3, 4)), jnp.float32)
             for _ in range(3))
  stream = HeavyBall(mu=0.7, gamma=1.3, learn="both", layout=layout)
  variables = jax.jit(lambda k: stream.init(
      k, x, lambda z, **kw: (u, None), {"p": p}, ctx=RoutingContext(),
      is_moe=True))(jax.random.key(0))
  step = jax.jit(lambda v: _one_step(stream, v, x, u, p))
  params = variables["params"]
  assert math.tanh(float(params["mu_raw"])) == pytest.approx(0.7)
  assert float(jax.nn.softplus(params["gamma_raw"])) == pytest.approx(1.3)
  for mu_raw, gamma_raw in [(2.5, -8.0), (-2.5, 4.0), (0.1, 0.0)]:
    mu, gamma = math.tanh(mu_raw), math.log1p(math.exp(gamma_raw))
    assert -1 < mu < 1 and gamma > 0
    new = {"params": dict(params, mu_raw=jnp.float32(mu_raw),
                          gamma_raw=jnp.float32(gamma_raw))}
    got_x, got = step(new)
    if layout == "paper":
      want_p = u + mu * p
      want_x = x + gamma * want_p
    else:
      want_p = mu * p + gamma * u
      ln = new["params"]["LayerNorm_2"]
      z = x - want_p
      z = (z - z.mean(-1, keepdims=True)) / jnp.sqrt(
          z.var(-1, keepdims=True) + 1e-6) * ln["scale"] + ln["bias"]
      want_x = z
    np.testing.assert_allclose(got["p"], want_p, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got_x, want_x, rtol=1e-4, atol=1e-5)


def test_gamma_linear_is_a_per_token_sigmoid():
  rng = np.random.default_rng(1)
  x, u, p = (jnp.asarray(rng.normal(size=(2, 3, 4)), jnp.float32)
             for _ in range(3))
  stream = HeavyBall(mu=0.7, learn="gamma_linear", layout="paper")
  variables = jax.jit(lambda k: stream.init(
      k, x, lambda z, **kw: (u, None), {"p": p}, ctx=RoutingContext(),
      is_moe=True))(jax.random.key(0))
  dense = variables["params"]["Dense_1"]
  np.testing.assert_allclose(jax.nn.sigmoid(dense["bias"]), 0.5)  # Init.
  kernel = jnp.asarray(rng.normal(size=(4, 1)) * 3, jnp.float32)
  bias = jnp.asarray([0.4], jnp.float32)
  new = {"params": {"Dense_1": {"kernel": kernel, "bias": bias}}}
  got_x, _ = jax.jit(lambda v: _one_step(stream, v, x, u, p))(new)
  gamma = 1 / (1 + np.exp(-(np.asarray(x) @ np.asarray(kernel) + 0.4)))
  assert gamma.min() > 0 and gamma.max() < 1
  assert gamma.std() > 0.1  # Differs between tokens.
  np.testing.assert_allclose(got_x, x + gamma * (u + 0.7 * p), rtol=1e-5,
                             atol=1e-6)


@pytest.mark.parametrize("learn,names", [
    ("both", {"mu_raw", "gamma_raw"}), ("gamma", {"gamma_raw"}),
    ("gamma_linear", {"kernel", "bias"})])
def test_learnable_coefficients_receive_gradients(learn, names):
  model = _model({"name": "momentum", "learn": learn, "layout": "paper"},
                 every=1)
  images = jax.random.normal(jax.random.key(1), (2, 8, 8, 1))
  variables = jax.jit(model.init)(jax.random.key(0), images)
  labels = jnp.array([0, 2])

  def loss(params):
    logits, _ = model.apply({"params": params}, images)
    # The head is initialised at zero: use the logits' input through it.
    return jnp.mean((logits - jax.nn.one_hot(labels, 3)) ** 2)

  params = dict(variables["params"])
  params["head"] = jax.tree.map(lambda w: w + 0.3, params["head"])
  grads = jax.jit(jax.grad(loss))(params)
  for i in range(4):
    leaves = jax.tree_util.tree_leaves_with_path(
        grads[f"encoderblock_{i}"]["Stream"])
    got = {jax.tree_util.keystr(k[-1:]).strip("[]'") for k, _ in leaves}
    assert got == names
    for path, g in leaves:
      assert np.all(np.isfinite(g))
      # mu multiplies p_0 = 0 in the first block: no gradient there.
      if i > 0 or "mu_raw" not in jax.tree_util.keystr(path):
        assert float(jnp.abs(g).sum()) > 0, (i, path)


# ----------------------------------------------------------------- schedules

def test_time_varying_schedule_and_restart():
  assert [time_varying_mu(t) for t in (1, 2, 3, 4)] == [0, 0.25, 0.4, 0.5]
  # SR-SMoE: (t mod 3) / (t mod 3 + 3) for 0-based t over six layers.
  assert [time_varying_mu(t, 3) for t in range(1, 7)] == [
      (t % 3) / (t % 3 + 3) for t in range(6)]


# ------------------------------------------------------------------- configs

VARIANTS = ["heavy_ball", "learn_both", "learn_gamma", "gamma_linear",
            "negative", "adam", "adam_code", "robust", "nag", "time_varying",
            "restart", "rmsprop", "sam", "complex"]


@pytest.mark.parametrize("backbone", ["", ",soft"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_configs_validate_and_build(variant, backbone):
  config = load_config("momentum", variant + backbone)
  validate_config(config)
  model = build_model(config.model)
  assert model.stream["layout"] == "vmoe_reference"
  assert model.stream["name"] in STREAMS
  assert (model.moe["router"]["name"] == "soft") == bool(backbone)
  paper = build_model(load_config("momentum", variant + ",paper").model)
  assert paper.stream["layout"] == "paper"


def test_unknown_config_argument():
  with pytest.raises(ValueError, match="momentum config argument"):
    load_config("momentum", "heavy")


# ---------------------------------------------- training and resume (jitted)

STREAM_RUNS = {
    "momentum": {"name": "momentum", "learn": "both"},
    "momentum_gamma_linear": {"name": "momentum", "learn": "gamma_linear",
                              "layout": "paper"},
    "adam": {"name": "adam"},
    "adam_code_soft": {"name": "adam", "form": "code"},
    "robust_momentum": {"name": "robust_momentum"},
    "nag": {"name": "nag", "layout": "paper"},
    "time_varying": {"name": "time_varying", "restart_every": 1},
    "rmsprop": {"name": "rmsprop"},
    "sam": {"name": "sam", "rho": 0.1},
    "complex_momentum": {"name": "complex_momentum", "layout": "paper"},
}


def _stream_config(run):
  """The tiny config with MoE in both blocks and the stream of `run`."""
  c = load_config("tiny")
  c.model.moe.every = 1
  if run.endswith("_soft"):
    c.model.name = "soft_moe_vit"
    c.model.moe = dict(every=1, num_experts=2, group_size=None,
                       router=dict(name="soft", num_slots=2))
  c.model.stream = dict(STREAM_RUNS[run])
  return c


@pytest.mark.parametrize("run", sorted(STREAM_RUNS))
def test_every_stream_trains_under_jit_with_the_true_gradient(run):
  """The training loss (cross-entropy + auxiliary loss, router noise on) of
  the tiny model with MoE in both blocks: jit(value_and_grad) against the
  same loss in float64, value and central differences along a random
  direction of every parameter leaf, the stream's own included
  (`grad_check`)."""
  config = _stream_config(run)
  if config.model.stream["name"] in ("adam", "rmsprop"):
    # At eps = 1e-8 the first block's step u / (sqrt(u^2) + eps) is nearly
    # sign(u), whose curvature ~1/|u| no finite difference resolves; a
    # larger eps keeps the code path and makes the function smooth.
    config.model.stream = dict(config.model.stream, eps=1e-2)
  model = build_model(config.model)
  images = jax.random.uniform(jax.random.key(1), (2, 8, 8, 1))
  labels = jnp.array([3, 7])
  rngs = {"gating": jax.random.key(2), "dropout": jax.random.key(3)}
  params = dict(jax.jit(model.init)(jax.random.key(0), images)["params"])
  # The head starts at zero: a random one makes every leaf matter.
  params["head"] = dict(params["head"], kernel=jax.random.normal(
      jax.random.key(4), params["head"]["kernel"].shape))

  def loss(p, m=model):
    logits, metrics = m.apply({"params": p}, images, deterministic=False,
                              rngs=rngs)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    return ce.mean() + metrics["auxiliary_loss"]

  value, grads = jax.jit(jax.value_and_grad(loss))(params)
  model64 = model.clone(dtype=jnp.float64)
  checked, value64 = assert_grads_match_differences(
      lambda p: loss(p, model64), params, grads)
  assert checked == len(jax.tree.leaves(params))
  np.testing.assert_allclose(float(value), value64, rtol=1e-6)
  own = {"momentum": {"mu_raw", "gamma_raw", "LayerNorm_2"},
         "momentum_gamma_linear": {"Dense_1"}}.get(run)
  reference = STREAM_RUNS[run].get("layout", "vmoe_reference") == (
      "vmoe_reference")
  for i in (0, 1):
    stream = grads[f"encoderblock_{i}"].get("Stream", {})
    assert set(stream) == (own or ({"LayerNorm_2"} if reference else set()))


# Resume: the streams keep no state of their own outside their parameters
# (no collection, no RNG; the in-forward state p is rebuilt every forward),
# and every parameter is checkpointed and restored by one mechanism (the
# train loop's resume tests). The checkpoint content a stream adds is one
# of: learnable scalars (`momentum`, learn="both": `mu_raw`, `gamma_raw`,
# parameters like any other, whose gradients are
# test_learnable_coefficients_receive_gradients), a per-token linear step
# in the paper layout (`momentum_gamma_linear`, whose paper layout also has
# no LayerNorm_2), or nothing beyond the vmoe_reference LayerNorm_2 (every
# other stream: adam, rmsprop, robust_momentum, nag, time_varying, sam,
# complex_momentum). The two runs cover the paper layout's own parameter
# and, on the SoftMoE backbone, a first-layer-then-heavy-ball stream (adam,
# form="code") with LayerNorm_2. That every other stream trains under jit
# with the true gradient is the test above; its forward is checked against
# a NumPy recurrence in test_momentum_streams.py.
RESUME_RUNS = ("momentum_gamma_linear", "adam_code_soft")


@pytest.mark.parametrize("run", RESUME_RUNS)
def test_stream_state_trains_and_resumes_bit_identically(run, tmp_path):
  """Jitted train steps (forward, grad, update) of the tiny model with MoE
  in both blocks; stopping after 3 steps and resuming gives the same
  params, collections and final metrics as a straight run."""
  def config():
    c = short_schedule(_stream_config(run))
    # SGD with momentum (optimizer state to resume) compiles ~1/3 faster
    # than the tiny config's AdamW; AdamW's resume is test_train_loop's.
    c.optimizer = ml_collections.ConfigDict(dict(
        name="sgd", learning_rate=0.1, momentum=0.9, warmup_steps=2,
        decay="cosine", total_steps=c.train.total_steps))
    return c

  final, state = straight_vs_resumed(config, tmp_path, stop_at_step=3)
  # The final metrics against an independent evaluation of the restored
  # state: the model on every test example, NumPy cross-entropy and argmax.
  assert_final_metrics_match(final, config(), state, str(tmp_path / "eval"))
  assert final["num_examples"] == 355  # sklearn's digits test split.
  streams = [state.params[f"encoderblock_{i}"].get("Stream", {})
             for i in (0, 1)]
  own = {"momentum_gamma_linear": {"Dense_1"},
         "adam_code_soft": {"LayerNorm_2"}}[run]
  assert all(set(s) == own for s in streams), streams
