"""`model.remat` and `model.scan` (`vmoe_ext.models.stack`).

Remat: jitted, values, persistent router state, intermediates and
`jax.grad` equal bit for bit to the same model without remat (ViT with
CMoE's balancing bias, Swin, the language model), compiled with XLA's
default CPU emitters as the binary compiles. Scan (ViT, Swin per stage,
the language model): the segment plan by hand; values, metrics and
gradients equal to the unrolled model on the same parameters (converted
layout), and the conversion exact both ways; Swin's per-block drop-path
rates inside a scan; the language model's per-layer caches threaded
through a scan over two consecutive blocks of text; config errors.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from vmoe_ext.errors import ConfigError
from vmoe_ext.models.language import LanguageModel
from vmoe_ext.models.lm_carved import CarvedLanguageModel
from vmoe_ext.models.stack import (REMAT_CHOICES, Segment, plan_segments,
                                   to_layout, unscan_tree)
from vmoe_ext.models.swin import SwinTransformerMoe
from vmoe_ext.models.swin_attention import DropPath, keep_probability
from vmoe_ext.models.vit import VisionTransformerMoe
from vmoe_ext.moe.expert_parallel import ExpertParallel
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


SWIN_IMAGES = jax.random.normal(jax.random.key(4), (2, 16, 16, 3))
SWIN_DROP_PATH = 0.4


def swin(depths=(4, 5), **fields):
  """8 x 8 then 4 x 4 tokens, windows of 2 x 2 (so both stages shift):
  stage 0 dense (blocks 0-3), stage 1 (4-8) MoE at its blocks 1 and 3."""
  fields = {"moe": {"num_experts": 4, "router": {"name": "cmoe",
                                                 "num_selected": 2}},
            "moe_blocks": ((-1,), (1, 3)), **fields}
  return SwinTransformerMoe(num_classes=3, patch_size=(2, 2), embed_dim=8,
                            depths=depths, num_heads=(2, 2), window_size=2,
                            mlp_ratio=1.0, drop_path_rate=SWIN_DROP_PATH,
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
  assert SwinTransformerMoe(num_classes=3, scan=True).scan_segments
  for router in ({"name": "acmoe", "normalization": "swin",
                  "base": {"name": "swin_moe", "num_selected": 2}},
                 {"name": "symphony", "base": {"name": "noisy_topk",
                                               "num_selected": 2}}):
    with pytest.raises(ConfigError, match="scan") as error:
      swin(scan=True, moe={"num_experts": 4, "router": router})
    assert "cross-layer" in str(error.value)
  with pytest.raises(ConfigError, match="scan"):
    swin(scan=True, stream={"name": "time_varying"})
  with pytest.raises(ConfigError, match="scan"):
    swin(scan=1)
  mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "expert"))
  with pytest.raises(ConfigError, match="expert parallelism"):
    swin(scan=True, expert_parallel=ExpertParallel(mesh))
  with pytest.raises(ConfigError, match="expert parallelism"):
    vit(scan=True, expert_parallel=ExpertParallel(mesh))
  assert LanguageModel(vocab_size=7, scan=True).scan_segments == (
      Segment(0, 1, 3),)
  for fields in ({"architecture": "sgsc"},  # The c layer's ACMoE router.
                 {"architecture": "sasa"},  # AdamSMoE: first-layer stream.
                 {"architecture": "smsm", "stream": {"name": "time_varying"}},
                 {"architecture": "sgsg", "moe": {"router": {
                     "name": "symphony", "base": {"name": "noisy_topk",
                                                  "num_selected": 2}}}}):
    with pytest.raises(ConfigError, match="scan") as error:
      lm(num_layers=2, scan=True, **fields)
    assert "cross-layer" in str(error.value), fields
  with pytest.raises(ConfigError, match="scan"):
    lm(scan=1)
  with pytest.raises(ConfigError, match="expert parallelism"):
    lm(scan=True, expert_parallel=ExpertParallel(mesh))
  with pytest.raises(ConfigError, match="carved") as error:
    CarvedLanguageModel(vocab_size=7, base_arch="glam", num_layers=1,
                        scan=True)
  assert error.value.field.endswith("scan")


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

  assert_step_matches(train_step(scanned, converted, IMAGES),
                      train_step(unrolled, variables, IMAGES), variables)


def assert_step_matches(got, want, variables):
  """`train_step` of a scanned model (`got`) equals the unrolled model's
  (`want`, whose variables are `variables`) to float32 rounding: logits,
  metrics, gradients and the updated collections (MoE intermediates,
  router state if any), compared in the unrolled layout."""
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
  assert ("router_state" in new) == ("router_state" in want[1][2])
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


def test_swin_scan_plan_by_hand():
  """Per stage, over (shifted, MoE): a dense stage scans periods of 2
  (shifted and not), MoE every other block too; a block left over and
  stages too short to repeat stay unrolled; names are global."""
  model = swin(scan=True)
  assert model.scan_segments == (
      (Segment(0, 2, 2),), (Segment(4, 2, 2), Segment(8, 1, 1)))
  shapes = jax.eval_shape(lambda: model.init(RNGS, SWIN_IMAGES))["params"]
  blocks = sorted(k for k in shapes
                  if k.startswith(("scan_", "encoderblock_")))
  assert blocks == ["encoderblock_8", "scan_0_2x2", "scan_4_2x2"]
  # Swin-MoE-S's layout: 18 blocks of stage 2 with MoE every other one.
  big = SwinTransformerMoe(
      num_classes=3, depths=(2, 2, 18, 2), num_heads=(3, 6, 12, 24),
      moe={"num_experts": 4},
      moe_blocks=((-1,), (-1,), tuple(range(1, 18, 2)), (1,)), scan=True)
  unrolled = lambda *blocks: tuple(Segment(b, 1, 1) for b in blocks)
  assert big.scan_segments == (unrolled(0, 1), unrolled(2, 3),
                               (Segment(4, 2, 9),), unrolled(22, 23))
  dense = SwinTransformerMoe(num_classes=3, depths=(3, 8),
                             num_heads=(3, 6), scan=True)
  assert dense.scan_segments == (unrolled(0, 1, 2), (Segment(3, 2, 4),))
  assert swin().scan_segments is None


def test_swin_unscan_gives_the_unrolled_tree():
  """Every collection of the scanned Swin, unscanned: exactly the unrolled
  model's names, shapes and dtypes."""
  scanned = random_variables(swin(scan=True), SWIN_IMAGES)
  want = jax.eval_shape(lambda: swin().init(RNGS, SWIN_IMAGES))
  assert sorted(scanned) == sorted(want)
  spec = lambda a: (a.shape, a.dtype)
  for name, tree in scanned.items():
    assert (jax.tree.map(spec, unscan_tree(tree))
            == jax.tree.map(spec, dict(want[name]))), name


def test_swin_scan_equals_unrolled():
  """Swin-MoE scanned per stage (with remat) on the unrolled model's
  parameters (`to_layout`): logits, metrics, router state, intermediates
  and gradients as the unrolled model's; the conversion exact both ways.
  Stage 0's two blocks stay unrolled, stage 1 is 2 x (regular dense,
  shifted MoE) (the plan of more stages: `test_swin_scan_plan_by_hand`)."""
  unrolled = swin(depths=(2, 4))
  scanned = swin(depths=(2, 4), scan=True, remat="full")
  assert scanned.scan_segments == ((Segment(0, 1, 1), Segment(1, 1, 1)),
                                   (Segment(2, 2, 2),))
  variables = random_variables(unrolled, SWIN_IMAGES)
  like = jax.eval_shape(lambda: scanned.init(RNGS, SWIN_IMAGES))
  converted = to_layout(variables, like)
  assert (jax.tree.map(jnp.shape, converted)
          == jax.tree.map(lambda s: s.shape, dict(like)))
  assert_equal(to_layout(converted, variables), variables)

  got = train_step(scanned, converted, SWIN_IMAGES)
  assert sorted(got[1][1]) == ["auxiliary_loss", "layer_3", "layer_5"]
  assert "router_state" in got[1][2]
  assert_step_matches(got, train_step(unrolled, variables, SWIN_IMAGES),
                      variables)


def test_swin_scan_drop_path_uses_each_blocks_rate():
  """Training mode (`deterministic=False`): every DropPath call of the
  scanned Swin, step by step, draws with its own block's keep probability
  `1 - 0.4 * b / 8` (block 0: 1, untouched); and a traced keep drops and
  scales as the Python rate does, bit for bit."""
  model = swin(scan=True, remat="full")
  variables = random_variables(model, SWIN_IMAGES)
  seen: dict = {}

  def record(next_fun, args, kwargs, context):
    if isinstance(context.module, DropPath):
      path = "/".join(context.module.scope.path)
      if kwargs.get("keep") is None:  # Unrolled: the block's own rate.
        seen.setdefault(path, []).append(1.0 - context.module.rate)
      else:
        jax.debug.callback(
            lambda k, path=path: seen.setdefault(path, []).append(float(k)),
            kwargs["keep"], ordered=True)
    return next_fun(*args, **kwargs)

  with nn.intercept_methods(record):
    logits, _ = jax.jit(lambda v: model.apply(
        v, SWIN_IMAGES, deterministic=False,
        rngs={"dropout": jax.random.key(5), "gating": jax.random.key(6)}))(
            variables)
  jax.effects_barrier()
  assert np.all(np.isfinite(logits))
  keep = lambda b: [1.0 - SWIN_DROP_PATH * b / 8] * 2  # Attention, MLP.
  want = {"scan_0_2x2/period_0/DropPath": keep(0) + keep(2),
          "scan_0_2x2/period_1/DropPath": keep(1) + keep(3),
          "scan_4_2x2/period_0/DropPath": keep(4) + keep(6),
          "scan_4_2x2/period_1/DropPath": keep(5) + keep(7),
          "encoderblock_8/DropPath": keep(8)}
  assert sorted(seen) == sorted(want)
  for path, values in want.items():
    np.testing.assert_allclose(seen[path], values, rtol=1e-6, err_msg=path)

  x = jax.random.normal(jax.random.key(7), (64, 3, 2))
  rngs = {"dropout": jax.random.key(8)}
  for rate in (0.0, 0.3):
    static = jax.jit(lambda: DropPath(rate).apply(
        {}, x, deterministic=False, rngs=rngs))()
    traced = jax.jit(lambda k: DropPath(0.9).apply(
        {}, x, deterministic=False, keep=k, rngs=rngs))(
            keep_probability(rate))
    np.testing.assert_array_equal(traced, static)
    assert (rate == 0) == np.array_equal(traced, x)


LM_TOKENS = jnp.asarray(np.random.default_rng(9).integers(0, 11, (2, 2, 4)))


def lm(**fields):
  """vocab 11, width 8, 2 heads, span 4; top-2 of 4 experts (Switch
  `"sg" * 3` unless `architecture` / `base_arch` say otherwise)."""
  fields = {"num_layers": 3, "moe": {"num_experts": 4,
                                     "dispatcher": "indices"}, **fields}
  return LanguageModel(vocab_size=11, hidden_size=8, inner_hidden_size=8,
                       num_heads=2, attn_span=4, **fields)


def lm_stream(model, variables):
  """Two consecutive blocks `LM_TOKENS[:, k]` (the second fed the first's
  new cache): per block, `(grads, (log_probs, new_cache, metrics,
  intermediates))` of a loss that uses the log-probs, the auxiliary loss
  and every layer's new cache."""
  params = variables["params"]
  rest = {k: v for k, v in variables.items() if k != "params"}

  @jax.jit
  def step(p, tokens, cache):
    def loss(p):
      (log_probs, new_cache, metrics), new = model.apply(
          {"params": p, **rest}, tokens, cache, deterministic=True,
          mutable=["intermediates"])
      value = (jnp.sum(jnp.sin(log_probs)) + metrics["auxiliary_loss"]
               + sum(jnp.sum(jnp.sin(c)) for c in new_cache))
      return value, (log_probs, new_cache, metrics, new["intermediates"])
    return jax.grad(loss, has_aux=True)(p)

  cache, out = model.zero_cache(2), []
  for k in range(LM_TOKENS.shape[1]):
    out.append(step(params, LM_TOKENS[:, k], cache))
    cache = out[-1][1][1]
  return out


def test_lm_scan_plan_by_hand():
  """Over the layers' sub-layer letters: Switch scans all its layers as
  one run, GLaM periods of (g, f); a change of letter starts a new run;
  names are the global layer numbers."""
  assert lm(num_layers=6, scan=True).scan_segments == (Segment(0, 1, 6),)
  assert lm(num_layers=3, base_arch="glam", scan=True).scan_segments == (
      Segment(0, 2, 3),)
  mixed = lm(num_layers=6, architecture="sgsgsmsmsmsg", scan=True)
  assert mixed.scan_segments == (Segment(0, 1, 2), Segment(2, 1, 3),
                                 Segment(5, 1, 1))
  glam = lm(num_layers=4, base_arch="glam", architecture="sgsfsgsfsmsfsmsf",
            scan=True)
  assert glam.scan_segments == (Segment(0, 2, 2), Segment(4, 2, 2))
  shapes = jax.eval_shape(lambda: glam.init(
      RNGS, LM_TOKENS[:, 0], glam.zero_cache(2)))["params"]
  assert sorted(shapes) == ["embedding", "key_pe", "output", "scan_0_2x2",
                            "scan_4_2x2"]
  assert lm(num_layers=6).scan_segments is None


def test_lm_unscan_gives_the_unrolled_tree():
  """Every collection of the scanned language model (GLaM, 2 x (g, f)),
  unscanned: exactly the unrolled model's names, shapes and dtypes."""
  scanned = lm(num_layers=2, base_arch="glam", scan=True)
  cache = scanned.zero_cache(2)
  got = random_variables(scanned, LM_TOKENS[:, 0], cache)
  want = jax.eval_shape(lambda: lm(num_layers=2, base_arch="glam").init(
      RNGS, LM_TOKENS[:, 0], cache))
  assert sorted(got) == sorted(want)
  assert "scan_0_2x2" in got["params"]
  spec = lambda a: (a.shape, a.dtype)
  for name, tree in got.items():
    assert (jax.tree.map(spec, unscan_tree(tree))
            == jax.tree.map(spec, dict(want[name]))), name


@pytest.mark.parametrize("fields,segments", [
    # One scan of 2 x (g, f), remat inside.
    ({"base_arch": "glam", "num_layers": 2, "remat": "full"},
     (Segment(0, 2, 2),)),
    # Layers 0-2 (momentum stream) scanned, layer 3 (g) unrolled.
    ({"num_layers": 4, "architecture": "smsmsmsg"},
     (Segment(0, 1, 3), Segment(3, 1, 1))),
])
def test_lm_scan_equals_unrolled(fields, segments):
  """The scanned language model on the unrolled one's parameters
  (`to_layout`, exact both ways), over two consecutive blocks of text (the
  second fed the first's cache): log-probs, metrics, every layer's new
  cache, MoE intermediates and gradients as the unrolled model's."""
  unrolled = lm(**{k: v for k, v in fields.items() if k != "remat"})
  scanned = lm(**fields, scan=True)
  assert scanned.scan_segments == segments
  cache = unrolled.zero_cache(2)
  variables = random_variables(unrolled, LM_TOKENS[:, 0], cache)
  like = jax.eval_shape(lambda: scanned.init(RNGS, LM_TOKENS[:, 0], cache))
  converted = to_layout(variables, like)
  assert (jax.tree.map(jnp.shape, converted)
          == jax.tree.map(lambda s: s.shape, dict(like)))
  assert_equal(to_layout(converted, variables), variables)

  close = lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5,
                                                  atol=1e-6)
  want = lm_stream(unrolled, variables)
  got = lm_stream(scanned, converted)
  for (grads, (log_probs, new_cache, metrics, sown)), (
      want_grads, (want_log_probs, want_cache, want_metrics, want_sown)
  ) in zip(got, want):
    close(log_probs, want_log_probs)
    assert len(new_cache) == len(want_cache) == unrolled.num_layers * (
        2 if unrolled.base_arch == "glam" else 1)
    for c, w in zip(new_cache, want_cache):
      close(c, w)
    assert sorted(metrics) == sorted(want_metrics)
    jax.tree.map(close, metrics, want_metrics)
    jax.tree.map(close, moe_intermediates(sown), moe_intermediates(want_sown))
    jax.tree.map(close, to_layout({"params": grads}, variables)["params"],
                 want_grads)
  # The second block's caches are the first block's layer inputs, not zero.
  assert all(np.any(np.asarray(c) != 0) for c in got[0][1][1])
