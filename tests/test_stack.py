"""`model.remat` and `model.scan` (`vmoe_ext.models.stack`).

Remat: jitted, values, persistent router state, intermediates and
`jax.grad` equal bit for bit to the same model without remat (ViT with
CMoE's balancing bias, Swin, the language model), compiled with XLA's
default CPU emitters as the binary compiles. Scan: the segment plan by
hand; values, metrics and gradients equal to the unrolled model on the
same parameters (converted layout), and the conversion exact both ways;
config errors.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from vmoe_ext.errors import ConfigError
from vmoe_ext.models.language import LanguageModel
from vmoe_ext.models.stack import (REMAT_CHOICES, Segment, plan_segments,
                                   to_layout)
from vmoe_ext.models.swin import SwinTransformerMoe
from vmoe_ext.models.vit import VisionTransformerMoe
from vmoe_ext.train.forward import moe_intermediates

IMAGES = jax.random.normal(jax.random.key(0), (2, 8, 8, 3))
RNGS = {"params": jax.random.key(1), "gating": jax.random.key(2),
        "dropout": jax.random.key(3)}


def vit(**fields):
  moe = fields.pop("moe", {"every": 2, "num_experts": 4, "router": {
      "name": "cmoe", "num_selected": 2}})
  fields = {"num_layers": 4, **fields}
  return VisionTransformerMoe(num_classes=3, patch_size=(4, 4),
                              hidden_size=8, num_heads=2, mlp_dim=8, moe=moe,
                              **fields)


def random_variables(model, *args, seed=0):
  """Every variable drawn from NumPy on the model's shapes (the router
  state too, so a bias that starts at zero is not trivially equal)."""
  rng = np.random.default_rng(seed)
  shapes = jax.eval_shape(lambda: model.init(RNGS, *args))
  return jax.tree.map(
      lambda s: jnp.asarray(rng.normal(size=s.shape) * 0.5, s.dtype),
      dict(shapes))


# The suite compiles with CPU's older elemental emitters (conftest.py, for
# speed); under them XLA fuses a rematted backward differently from the
# plain one and the gradients move by an ulp. The binary compiles with
# XLA's defaults, the fusion emitters, under which remat changes no bit:
# the remat comparisons compile with those.
XLA_DEFAULTS = {"xla_cpu_use_fusion_emitters": True}


def jit_as_the_binary(fn):
  """`fn` jitted and compiled with XLA's default CPU emitters."""
  def call(*args):
    return jax.jit(fn).lower(*args).compile(
        compiler_options=XLA_DEFAULTS)(*args)
  return call


def train_step(model, variables, *args, compile=jax.jit):
  """`(grads, (logits, metrics, new collections))` of a training call."""
  params = variables["params"]
  rest = {k: v for k, v in variables.items() if k != "params"}

  def loss(p):
    (logits, metrics), new = model.apply(
        {"params": p, **rest}, *args, deterministic=True, update_state=True,
        mutable=["router_state", "intermediates"])
    value = jnp.sum(jnp.sin(logits)) + metrics["auxiliary_loss"]
    return value, (logits, metrics, new)

  grad = jax.grad(loss, has_aux=True)
  return compile(grad)(params)


def assert_equal(got, want):
  assert jax.tree.structure(got) == jax.tree.structure(want)
  jax.tree.map(np.testing.assert_array_equal, got, want)


@pytest.mark.parametrize("remat", ["full", "dots_saveable"])
def test_vit_remat_is_bit_identical(remat):
  """Values, router state, intermediates and gradients of a training call,
  bit for bit; the CMoE bias did move (`update_state` reached the rematted
  block)."""
  plain = vit(num_layers=2)
  variables = random_variables(plain, IMAGES)
  assert "router_state" in variables
  want = train_step(plain, variables, IMAGES, compile=jit_as_the_binary)
  got = train_step(vit(num_layers=2, remat=remat), variables, IMAGES,
                   compile=jit_as_the_binary)
  assert_equal(got, want)
  bias = lambda v: v["router_state"]["encoderblock_1"]["Moe"]["router"]
  assert not np.array_equal(bias(got[1][2])["bias"], bias(variables)["bias"])
  assert "moe_output" in got[1][2]["intermediates"]["encoderblock_1"]["Moe"]


def test_swin_and_lm_remat_are_bit_identical():
  """Jitted: values and gradients bit for bit."""
  swin = dict(num_classes=3, patch_size=(2, 2), embed_dim=4, depths=(2,),
              num_heads=(2,), window_size=2, drop_path_rate=0.0,
              moe={"num_experts": 2}, moe_blocks=((1,),))
  plain = SwinTransformerMoe(**swin)
  variables = random_variables(plain, IMAGES)
  want = train_step(plain, variables, IMAGES, compile=jit_as_the_binary)
  got = train_step(SwinTransformerMoe(**swin, remat="full"), variables,
                   IMAGES, compile=jit_as_the_binary)
  assert_equal(got, want)

  lm = dict(vocab_size=7, hidden_size=4, inner_hidden_size=4, num_heads=2,
            num_layers=2, attn_span=3, architecture="sgsg",
            moe={"num_experts": 2, "dispatcher": "indices"})
  tokens = jnp.asarray([[1, 2, 3], [4, 5, 6]])
  cache = LanguageModel(**lm).zero_cache(2)

  def lm_step(remat, variables):
    model = LanguageModel(**lm, remat=remat)

    def loss(p):
      log_probs, new_cache, metrics = model.apply(
          {**variables, "params": p}, tokens, cache, deterministic=True)
      value = jnp.sum(log_probs[..., 0]) + metrics["auxiliary_loss"]
      return value, (log_probs, new_cache, metrics)
    grad = jax.grad(loss, has_aux=True)
    return jit_as_the_binary(grad)(variables["params"])

  variables = random_variables(LanguageModel(**lm), tokens, cache)
  assert_equal(lm_step("dots_saveable", variables),
               lm_step("none", variables))


def test_remat_and_scan_config_errors():
  with pytest.raises(ConfigError) as error:
    vit(remat="save_everything")
  assert error.value.field.endswith("remat")
  for name in REMAT_CHOICES:
    assert repr(name) in str(error.value)
  with pytest.raises(ConfigError, match="scan"):
    vit(scan=True, moe={"every": 2, "num_experts": 4, "router": {
        "name": "symphony", "base": {"name": "noisy_topk",
                                     "num_selected": 2}}})
  with pytest.raises(ConfigError, match="scan"):
    vit(scan=True, stream={"name": "time_varying"})
  with pytest.raises(ConfigError, match="scan"):
    vit(scan="yes")
  with pytest.raises(ConfigError, match="scan"):
    SwinTransformerMoe(num_classes=3, scan=True)
  with pytest.raises(ConfigError, match="scan"):
    LanguageModel(vocab_size=7, scan=True)


def test_plan_segments_by_hand():
  every2 = [b % 2 == 1 for b in range(12)]
  assert plan_segments(every2) == (Segment(0, 2, 6),)
  last2 = [b in (9, 11) for b in range(12)]
  assert plan_segments(last2) == (Segment(0, 1, 9), Segment(9, 1, 1),
                                  Segment(10, 1, 1), Segment(11, 1, 1))
  assert plan_segments([False] * 5) == (Segment(0, 1, 5),)
  assert plan_segments([True]) == (Segment(0, 1, 1),)


@pytest.mark.parametrize("moe,remat", [
    # One scan of 2 x (dense, MoE), with remat inside.
    ({"every": 2, "num_experts": 4, "router": {"name": "cmoe",
                                               "num_selected": 2}}, "full"),
    ({"layers": (3,), "num_experts": 4}, "none"),  # 0-2 scanned, 3 not.
])
def test_scan_equals_unrolled(moe, remat):
  unrolled = vit(moe=moe)
  scanned = vit(moe=moe, scan=True, remat=remat)
  assert any(s.scanned for s in scanned.scan_segments)
  variables = random_variables(unrolled, IMAGES)
  like = jax.eval_shape(lambda: scanned.init(RNGS, IMAGES))
  converted = to_layout(variables, like)
  assert (jax.tree.map(jnp.shape, converted)
          == jax.tree.map(lambda s: s.shape, dict(like)))
  back = to_layout(converted, variables)
  assert jax.tree.structure(back) == jax.tree.structure(variables)
  jax.tree.map(np.testing.assert_array_equal, back, variables)

  want = train_step(unrolled, variables, IMAGES)
  got = train_step(scanned, converted, IMAGES)
  grads, (logits, metrics, new) = got
  close = lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5,
                                                  atol=1e-6)
  close(logits, want[1][0])
  assert sorted(metrics) == sorted(want[1][1])
  jax.tree.map(close, metrics, want[1][1])
  jax.tree.map(close, to_layout({"params": grads}, variables)["params"],
               want[0])
  jax.tree.map(close, moe_intermediates(new["intermediates"]),
               moe_intermediates(want[1][2]["intermediates"]))
  if "router_state" in new:
    jax.tree.map(close, to_layout(new, want[1][2])["router_state"],
                 want[1][2]["router_state"])


def test_a_checkpoint_evaluates_in_the_other_layout(tmp_path):
  """A run's checkpoint written with `model.scan` True (stacked blocks)
  evaluates in the unrolled model and the other way round: the restored
  variables are exactly `to_layout` of the saved ones (that the two layouts
  then compute the same is `test_scan_equals_unrolled`); `model.remat` may
  differ too. A genuinely different model still names its field."""
  from vmoe_ext.app.context import RunContext  # pylint: disable=import-outside-toplevel
  from vmoe_ext.train.config_files import load_config  # pylint: disable=import-outside-toplevel

  def config(scan, remat="none", layers=4):
    c = load_config("tiny")
    c.model.num_layers, c.model.scan, c.model.remat = layers, scan, remat
    c.robustness = None
    return c

  for saved_scan in (True, False):
    workdir = str(tmp_path / f"scan_{saved_scan}")
    saver = RunContext.assemble(config(saved_scan))
    saver.open_training(workdir)
    saver.save()
    saver.checkpoints.close()
    saved = jax.device_get(saver.state.variables())
    reader = RunContext.assemble(config(not saved_scan, remat="full"))
    reader.open_evaluation(workdir)
    got = jax.device_get(reader.state.variables())
    want = to_layout(saved, got)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      np.testing.assert_array_equal(a, b)
    assert int(reader.state.step) == 0
  with pytest.raises(ConfigError) as error:
    RunContext.assemble(config(False, layers=6)).open_evaluation(workdir)
  assert error.value.field == "model.num_layers"
