"""`configs/imagenet.py`: the V-MoE / SoftMoE papers' ImageNet-1k settings.

Every value checked here is written from the papers' own files (not read back
from the config): google-research/vmoe `configs/vmoe_paper/common.py`,
`vmoe_s32_last2_ilsvrc2012_randaug_light1.py`,
`vmoe_b16_imagenet21k_randaug_strong_ft_ilsvrc2012.py`,
`pretrain_imagenet21k.py`, `projects/soft_moe/configs/{common,
pretrain_jft4b}.py`, `projects/adversarial_attacks/configs/{common,
attack/ilsvrc2012}.py`, and big_vision `configs/vit_i1k.py`. No training here.
"""

from __future__ import annotations

import math
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import vmoe_reference
from vmoe_layout import write_vmoe_checkpoint
from vmoe_ext.errors import ConfigError
from vmoe_ext.models import build_model
from vmoe_ext.train.config_files import (CONFIG_DIR, load_config,
                                         load_config_flag)
from vmoe_ext.app.context import resolved as resolve
from vmoe_ext.app.schema import validate_config

MODELS = ("vmoe_s32_every2", "vmoe_s32_last2", "vmoe_s32_every2_ft",
          "vmoe_s32_last2_ft", "soft_s16", "vit_s32")
# TFDS imagenet2012 train[:99%]: 1,268,355 of 1,281,167 images.
TRAIN_99 = 1_268_355
VMOE_TRAIN_PP = ("decode_jpeg_and_inception_crop(224)|flip_lr|randaug(2, 10)|"
                 "value_range(-1, 1)")
VMOE_EVAL_PP = "decode|resize_small(256)|central_crop(224)|value_range(-1, 1)"

# vmoe common.py get_randaug / get_mixup_concentration, by hand.
VMOE_AUGMENTATION = {
    "light0": ("randaug(2, 0)", 0.0), "light1": ("randaug(2, 10)", 0.2),
    "medium1": ("randaug(2, 15)", 0.2), "medium2": ("randaug(2, 15)", 0.5),
    "strong1": ("randaug(2, 20)", 0.5), "strong2": ("randaug(2, 20)", 0.8),
    "extreme1": ("randaug(4, 15)", 0.5), "extreme2": ("randaug(4, 20)", 0.8),
}

# The settings table (docs/imagenet.md), one row per recipe.
SCRATCH_S32 = dict(  # vmoe_s32_last2_ilsvrc2012_randaug_light1.py + common.py
    batch_size=8192, total_steps=math.ceil(300 * TRAIN_99 / 8192),
    loss="sigmoid_xent",
    pp_train=VMOE_TRAIN_PP, pp_eval=VMOE_EVAL_PP, mixup=0.2,
    optimizer=dict(name="adamw", learning_rate=3e-3, end_learning_rate=1e-5,
                   warmup_steps=10_000, decay="linear", b1=0.9, b2=0.999,
                   weight_decay=0.1, clip_global_norm=1.0))
FINE_TUNE = dict(  # vmoe_b16_imagenet21k_randaug_strong_ft_ilsvrc2012.py
    batch_size=1024, total_steps=10_000, loss="softmax_xent",
    pp_train="decode_jpeg_and_inception_crop(224)|flip_lr|value_range(-1, 1)",
    pp_eval="decode|resize(224)|value_range(-1, 1)", mixup=None,
    optimizer=dict(name="sgd", momentum=0.9, learning_rate=0.003,
                   end_learning_rate=1e-5, warmup_steps=500, decay="cosine",
                   clip_global_norm=10.0))
SOFT_S16 = dict(  # big_vision vit_i1k.py, S/16 ("medium2"), wd 1e-4 / lr
    batch_size=4096, total_steps=round(300 * TRAIN_99 / 4096),
    loss="softmax_xent",
    pp_train=VMOE_TRAIN_PP.replace("(2, 10)", "(2, 15)"),
    pp_eval=VMOE_EVAL_PP, mixup=0.5,
    optimizer=dict(name="adamw", learning_rate=1e-3, end_learning_rate=0.0,
                   warmup_steps=10_000, decay="cosine", b1=0.9, b2=0.999,
                   weight_decay=1e-4 / 1e-3, clip_global_norm=1.0))
RECIPES = {"vmoe_s32_every2": SCRATCH_S32, "vmoe_s32_last2": SCRATCH_S32,
           "vit_s32": SCRATCH_S32, "vmoe_s32_every2_ft": FINE_TUNE,
           "vmoe_s32_last2_ft": FINE_TUNE, "soft_s16": SOFT_S16}


def _config(arg):
  return load_config("imagenet", arg)


def _count(tree) -> int:
  return int(sum(x.size for x in jax.tree.leaves(tree)))


def _abstract_params(model_config):
  model = build_model(model_config)
  images = jax.ShapeDtypeStruct((8, 224, 224, 3), jnp.float32)
  return model, jax.eval_shape(model.init, jax.random.key(0),
                               images)["params"]


def hand_param_count(d, layers, mlp, heads, patch, classes, moe_layers=(),
                     experts=0, rep=None, cls_token=True, qk_norm=False,
                     soft_slots=None, image=224):
  """ViT / V-MoE / SoftMoE parameters by formula (flax ViT layout)."""
  block = (4 * d * d + 4 * d          # q, k, v, out kernels and biases
           + 4 * d                    # two LayerNorms
           + (2 * (d // heads) if qk_norm else 0))  # q/k LayerNorm scales
  mlp_params = 2 * d * mlp + mlp + d
  if soft_slots is None:
    router = d * experts              # noisy top-k: kernel [D, E]
  else:
    router = d * experts * soft_slots + 1  # SoftMoE: mu [D, E, P], scale
  moe = experts * mlp_params + router
  tokens = (image // patch) ** 2 + (1 if cls_token else 0)
  stem = patch * patch * 3 * d + d + (d if cls_token else 0) + tokens * d
  top = 2 * d + ((d * rep + rep) if rep else 0) + (rep or d) * classes + classes
  return (layers * block + (layers - len(moe_layers)) * mlp_params
          + len(moe_layers) * moe + stem + top)


# ------------------------------------------------------------- validation


@pytest.mark.parametrize("arg", MODELS + (
    "vmoe_s32_every2,randaug=strong2,data_dir=/data/tfds,imagenet_o=/io",
    "soft_s16,randaug=light1", "vit_s32,batch_size=1024",
    "vmoe_s32_last2_ft,checkpoint=/ckpt/x,batch_size=256"))
def test_every_variant_passes_validation(arg):
  config = _config(arg)
  validate_config(config)
  assert config.train.total_steps == config.optimizer.total_steps
  assert config.data.streaming and config.data.tfds_name == "imagenet2012"
  assert config.data.image_size == 224
  assert config.data.test_split == "validation"


# ------------------------------------------------------ model structures


@pytest.mark.parametrize("arg,blocks,cf,eval_cf,rep,dropout", [
    # vmoe evaluates its from-scratch models at cf 4.0 (model_overrides),
    # its fine-tuned ones with the training model.
    ("vmoe_s32_every2", (1, 3, 5, 7), 1.05, 4.0, 512, 0.2),
    ("vmoe_s32_last2", (5, 7), 1.05, 4.0, 512, 0.2),
    ("vmoe_s32_every2_ft", (1, 3, 5, 7), 1.5, None, None, 0.0),
    ("vmoe_s32_last2_ft", (5, 7), 1.5, None, None, 0.0),
])
def test_vmoe_s32_structure_is_the_papers(arg, blocks, cf, eval_cf, rep,
                                          dropout):
  """vmoe common.get_vmoe_config("ViT-S/32, E=8, K=2, {Every|Last} 2", 224,
  1000): 8 blocks of D=512, MLP 2048, 8 heads; MoE blocks range(1, 8, 2)
  (Every 2) or its last two (Last 2); groups of 8 images of 50 tokens."""
  m = _config(arg).model.to_dict()
  assert (m["name"], m["num_layers"], m["hidden_size"], m["mlp_dim"],
          m["num_heads"], tuple(m["patch_size"])) == (
              "vit_moe", 8, 512, 2048, 8, (32, 32))
  assert m["classifier"] == "token" and m["representation_size"] == rep
  assert m["head_bias_init"] == pytest.approx(-math.log(1000))
  assert m["dropout_rate"] == 0.0 and m["attention_dropout_rate"] == 0.0
  moe = m["moe"]
  model, params = _abstract_params(m)
  assert model.moe_layers == blocks
  assert moe["num_experts"] == 8 and moe["router"]["num_selected"] == 2
  assert moe["router"]["name"] == "noisy_topk"
  assert moe["router"]["noise_std"] == 1.0  # vmoe's 1.0, i.e. std 1/E.
  assert moe["router"]["importance_loss_weight"] == 0.005
  assert moe["router"]["load_loss_weight"] == 0.005
  assert moe["capacity_factor"] == cf and moe["dropout_rate"] == dropout
  assert moe["eval_capacity_factor"] == eval_cf
  assert moe["group_size"] == 8 * ((224 // 32) ** 2 + 1) == 400
  assert (moe["dispatcher"], moe["dispatch_dtype"]) == ("einsum", "bfloat16")
  assert (moe["capacity_rounding"], moe["capacity_multiple"]) == ("vmoe", 4)
  # vmoe compute_capacity(400 * 2, 8, cf): ceil of the float product, then a
  # multiple of 4 (1.05: 105.00000000000001 -> 106 -> 108).
  from vmoe_ext.moe.capacity import compute_capacity
  want = math.ceil(400 * 2 * cf / 8)
  want += -want % 4
  assert compute_capacity(400, 2, cf, 8, 4, "vmoe") == want
  assert want == (108 if cf == 1.05 else 152)
  assert _count(params) == hand_param_count(
      512, 8, 2048, 8, 32, 1000, blocks, 8, rep=rep)


def test_soft_s16_structure_is_vmoes_soft_s16():
  """vmoe soft_moe pretrain_jft4b.py 'soft-s16': get_vit_config("S", 16)
  (D=384, 12 blocks, MLP 1536, 6 heads, GAP, qk-norm, head bias -log C) with
  128 experts of 1 slot in the last 6 blocks, one image (196 tokens) per
  group: 128 slots per layer."""
  m = _config("soft_s16").model.to_dict()
  assert (m["name"], m["num_layers"], m["hidden_size"], m["mlp_dim"],
          m["num_heads"], tuple(m["patch_size"])) == (
              "soft_moe_vit", 12, 384, 1536, 6, (16, 16))
  assert m["classifier"] == "gap" and m["attention_qk_norm"]
  assert m["representation_size"] is None
  assert m["head_bias_init"] == pytest.approx(-math.log(1000))
  moe = m["moe"]
  assert moe["num_experts"] == 128 and moe["router"] == dict(name="soft",
                                                              num_slots=1)
  assert moe["group_size"] is None and moe["dispatch_dtype"] == "bfloat16"
  model, params = _abstract_params(m)
  assert model.moe_layers == (6, 7, 8, 9, 10, 11)
  assert _count(params) == hand_param_count(
      384, 12, 1536, 6, 16, 1000, range(6, 12), 128, cls_token=False,
      qk_norm=True, soft_slots=1) == 922_701_166
  assert params["encoderblock_6"]["Moe"]["router"]["mu"].shape == (384, 128,
                                                                   1)


def test_vit_s32_is_the_dense_s32():
  """vmoe adversarial_attacks common.get_vit_config("ViT-S/32"): the V-MoE
  S/32 backbone with dense MLPs only."""
  m = _config("vit_s32").model.to_dict()
  assert m["name"] == "vit" and m.get("moe") is None
  assert (m["num_layers"], m["hidden_size"], m["mlp_dim"], m["num_heads"],
          m["representation_size"]) == (8, 512, 2048, 8, 512)
  model, params = _abstract_params(m)
  assert model.moe_layers == ()
  assert _count(params) == hand_param_count(512, 8, 2048, 8, 32, 1000,
                                            rep=512) == 27_595_240


# ------------------------------------------------ training settings table


@pytest.mark.parametrize("arg", MODELS)
def test_training_settings_equal_the_papers(arg):
  want, config = RECIPES[arg], _config(arg)
  data, train, opt = config.data, config.train, config.optimizer.to_dict()
  assert data.batch_size == want["batch_size"]
  assert train.total_steps == want["total_steps"]
  assert data.train_split == "train[:99%]"
  assert data.pp_train == want["pp_train"] and data.pp_eval == want["pp_eval"]
  assert train.label_smoothing == 0.0
  # vmoe's config.loss: sigmoid_xent from scratch, softmax_xent when
  # fine-tuning; big_vision's vit_i1k.py: softmax_xent.
  assert train.loss == want["loss"]
  for key, value in want["optimizer"].items():
    assert opt[key] == pytest.approx(value) if isinstance(value, float) \
        else opt[key] == value, key
  if want["mixup"] is None:
    assert train.mixup is None
  else:
    # big_vision's utils.mixup with fold_in=None: one weight per batch.
    granularity = "batch" if arg == "soft_s16" else "device"
    assert train.mixup.to_dict() == dict(concentration=want["mixup"], size=2,
                                         granularity=granularity, groups=None)
  assert data.eval_batch_size % 8 == 0 and 50_000 % 8 == 0  # Whole groups.


def test_step_counts_by_hand():
  assert SCRATCH_S32["total_steps"] == 46_449  # ceil(46448.55)
  assert SOFT_S16["total_steps"] == 92_897     # round(92897.09)
  # ceil(300 * 1,268,355 / 2,048) = ceil(185794.2)
  assert _config("vit_s32,batch_size=2048").train.total_steps == 185_795
  assert _config("vit_s32,batch_size=2048").optimizer.warmup_steps == 40_000
  ft = _config("vmoe_s32_last2_ft,batch_size=256")
  assert (ft.train.total_steps, ft.optimizer.warmup_steps) == (40_000, 2_000)


@pytest.mark.parametrize("aug", sorted(VMOE_AUGMENTATION))
def test_randaug_options_are_vmoes_pairs(aug):
  randaug, concentration = VMOE_AUGMENTATION[aug]
  config = _config(f"vmoe_s32_last2,randaug={aug}")
  assert config.data.pp_train == VMOE_TRAIN_PP.replace("randaug(2, 10)",
                                                       randaug)
  assert config.train.mixup.concentration == concentration


@pytest.mark.parametrize("arg", ["vmoe_s32_every2", "vit_s32", "soft_s16"])
def test_weight_decay_falls_on_vmoes_kernels(arg):
  """vmoe/big_vision decay the params matching `.*/kernel` (and nothing
  else); the configs' `no_bias_norm` mask decays the same leaves, except
  SoftMoE's slot parameters `mu` (see docs/imagenet.md)."""
  from vmoe_ext.train.optimizer import weight_decay_mask
  config = _config(arg)
  _, params = _abstract_params(config.model.to_dict())
  mask = weight_decay_mask(params, config.optimizer.weight_decay_mask)
  flat = jax.tree_util.tree_flatten_with_path(mask)[0]
  differ = []
  for path, decays in flat:
    name = "/".join(str(getattr(k, "key", k)) for k in path)
    if bool(decays) != bool(re.search(r".*/kernel", name)):
      differ.append(name)
  if arg == "soft_s16":
    assert sorted(differ) == sorted(f"encoderblock_{i}/Moe/router/mu"
                                    for i in range(6, 12))
  else:
    assert differ == []


# ------------------------------------------------- fine-tuning from 21k


def _vmoe_21k_config(hidden, layers, mlp, heads, patch, experts, moe_layers,
                     classes):
  """vmoe pretrain_imagenet21k.get_vmoe_params: no pre-logits, class token."""
  return dict(num_classes=classes, patch_size=(patch, patch),
              hidden_size=hidden, classifier="token", representation_size=None,
              encoder=dict(num_layers=layers, num_heads=heads, mlp_dim=mlp,
                           moe=dict(layers=moe_layers, num_experts=experts)))


@pytest.mark.parametrize("arg,blocks", [("vmoe_s32_every2_ft", (1, 3, 5, 7)),
                                        ("vmoe_s32_last2_ft", (5, 7))])
def test_fine_tune_rules_map_a_full_size_21k_tree_except_the_head(
    monkeypatch, arg, blocks):
  """Shapes only: the ImageNet-21k V-MoE S/32 tree in vmoe's layout
  (21,843 classes) against the fine-tuned model's params."""
  from vmoe_ext.train.initialization import parse_rules, plan
  monkeypatch.setattr(vmoe_reference, "_normal",
                      lambda rng, shape, std, mean=0.0: jax.ShapeDtypeStruct(
                          tuple(shape), jnp.float32))
  theirs = _vmoe_21k_config(512, 8, 2048, 8, 32, 8, blocks, 21_843)
  tree = vmoe_reference.random_vmoe_params(None, theirs, (224, 224, 3))
  flatten = lambda t: {
      "/".join(str(getattr(k, "key", k)) for k in path): tuple(leaf.shape)
      for path, leaf in jax.tree_util.tree_flatten_with_path(t)[0]}
  sources = flatten(tree)
  config = _config(arg)
  _, params = _abstract_params(config.model.to_dict())
  targets = flatten(params)
  loaded, tiled, fresh, unmatched, _ = plan(
      parse_rules(config.init.rules), targets, sources)
  assert sorted(fresh) == ["head/bias", "head/kernel"]
  assert not unmatched and not tiled
  assert set(loaded) == set(targets) - {"head/bias", "head/kernel"}
  assert set(sources) - set(loaded.values()) == {"head/bias", "head/kernel"}
  assert sources["head/kernel"] == (512, 21_843)
  assert loaded["encoderblock_7/Moe/Mlp/Dense_0/kernel"] == (
      "Encoder/encoderblock_7/Moe/Mlp/Dense_0/kernel")
  assert config.init.layout is None and not config.init.strict


def test_fine_tune_init_loads_a_vmoe_checkpoint_except_the_head(tmp_path):
  """The `_ft` config's init section on a small vmoe-layout "21k" checkpoint
  written in vmoe's file format: every parameter but the head is the
  checkpoint's, the head keeps the values it had (its fresh init)."""
  from vmoe_ext.train.initialization import load_init_params
  config = _config("vmoe_s32_last2_ft")
  ours = config.model.to_dict()
  ours.update(hidden_size=16, mlp_dim=8, num_heads=2)
  ours["moe"]["group_size"] = 8 * 5  # 64 px images: 4 patches + class token.
  theirs = _vmoe_21k_config(16, 8, 8, 2, 32, 8, (5, 7), 50)
  tree = vmoe_reference.random_vmoe_params(np.random.default_rng(0), theirs,
                                           (64, 64, 3))
  prefix = str(tmp_path / "vmoe_s32_last2_imagenet21k")
  write_vmoe_checkpoint(prefix, tree, num_shards=2)
  init = config.init.to_dict()
  init["checkpoint"] = prefix
  model = build_model(ours)
  shapes = jax.eval_shape(model.init, jax.random.key(0),
                          jax.ShapeDtypeStruct((8, 64, 64, 3), jnp.float32))
  fresh = jax.tree.map(lambda s: jnp.full(s.shape, 7.0, s.dtype),
                       shapes["params"])
  params, report = load_init_params(init, fresh)
  assert report.fresh == ("head/bias", "head/kernel")
  assert not report.unmatched
  assert sorted(report.unused_source) == ["head/bias", "head/kernel"]
  np.testing.assert_array_equal(
      params["encoderblock_7"]["Moe"]["Mlp"]["Dense_1"]["kernel"],
      tree["Encoder"]["encoderblock_7"]["Moe"]["Mlp"]["Dense_1"]["kernel"])
  np.testing.assert_array_equal(
      params["encoderblock_5"]["Moe"]["router"]["logits"]["dense"]["kernel"],
      tree["Encoder"]["encoderblock_5"]["Moe"]["Router"]["dense"]["kernel"])
  np.testing.assert_array_equal(
      params["pos_embedding"],
      tree["Encoder"]["posembed_input"]["pos_embedding"])
  assert params["head"]["kernel"].shape == (16, 1000)
  assert params["head"]["kernel"] is fresh["head"]["kernel"]
  assert params["head"]["bias"] is fresh["head"]["bias"]
  loaded = [leaf for path, leaf in jax.tree_util.tree_flatten_with_path(
      params)[0] if path[0].key != "head"]
  assert len(loaded) == len(report.loaded) and not any(
      np.all(np.asarray(leaf) == 7.0) for leaf in loaded)


# ------------------------------------------------------------ robustness


def test_robustness_section_is_the_imagenet_protocol():
  from vmoe_ext.evaluate.datasets import check_datasets
  plain = _config("vmoe_s32_last2").robustness
  assert sorted(plain.datasets) == ["imagenet_a", "imagenet_c", "imagenet_r"]
  config = _config("soft_s16,imagenet_o=/data/imagenet-o")
  r = config.robustness.to_dict()
  entries = check_datasets(r["datasets"])
  assert entries["imagenet_c"]["source"] == dict(
      tfds_name="imagenet2012_corrupted", split="validation")
  assert entries["imagenet_c"]["baseline"] == "auto"  # AlexNet mCE.
  assert len(entries["imagenet_c"]["corruptions"]) == 15
  assert entries["imagenet_c"]["severities"] == (1, 2, 3, 4, 5)
  for name in ("imagenet_a", "imagenet_r"):
    assert entries[name]["kind"] == "accuracy"
    assert len(entries[name]["class_subset"]) == 200
    assert entries[name]["source"] == dict(tfds_name=name, split="test")
  assert entries["imagenet_o"]["kind"] == "ood"
  assert entries["imagenet_o"]["source"] == dict(path="/data/imagenet-o")
  attacks = {a["name"]: a for a in r["attacks"]}
  assert all(a["eps"] == pytest.approx(1 / 255) for a in attacks.values())
  assert attacks["pgd"]["steps"] == 40 and attacks["pgd"]["vmoe_compatible"]
  assert r["sweep"]["eps"] == pytest.approx([e / 255 for e in range(6)])
  assert r["corruptions"] is None and r["num_examples"] == 1024
  assert config.data.analysis_examples == 1024


@pytest.mark.parametrize("arg,batch", [("vmoe_s32_last2,smoke", 16),
                                       ("vit_s32,smoke,batch_size=8", 8),
                                       ("vmoe_s32_every2_ft,smoke", 16)])
def test_the_smoke_option_shrinks_steps_batches_and_attacks_only(arg, batch):
  """Two steps (one warm-up), every batch `batch` images, the three attacks
  cut to a step or two on one batch, no sweep or datasets; the model, the
  preprocessing and the learning rate are the paper config's."""
  model = arg.split(",")[0]
  paper, config = _config(model), _config(arg)
  config.data.data_dir = paper.data.data_dir = "/data"
  resolved = resolve(config)
  assert (resolved.train.total_steps, resolved.optimizer.total_steps,
          resolved.optimizer.warmup_steps) == (2, 2, 1)
  assert (resolved.data.batch_size, resolved.data.eval_batch_size,
          resolved.data.analysis_examples) == (batch, batch, batch)
  assert resolved.robustness.num_examples == batch
  assert resolved.robustness.sweep is None
  assert not resolved.robustness.datasets
  eps = paper.robustness.attacks[0]["eps"]
  assert [(a["name"], a["eps"], a.get("steps")) for a in
          resolved.robustness.attacks] == [("fgsm", eps, None),
                                           ("pgd", eps, 2), ("spsa", eps, 1)]
  assert config.model.to_dict() == paper.model.to_dict()
  assert config.data.pp_train == paper.data.pp_train
  assert config.optimizer.learning_rate == paper.optimizer.learning_rate


# ---------------------------------------------------------- bad arguments


@pytest.mark.parametrize("arg,needle", [
    ("bogus", "unknown model 'bogus'"),
    ("vmoe_s32_last2,randaug=huge", "unknown randaug 'huge'"),
    ("vmoe_s32_last2_ft,randaug=light1", "takes no randaug"),
    ("vit_s32,checkpoint=/x", "checkpoint= is for the _ft models"),
    ("vit_s32,foo=1", "bad option 'foo=1'"),
    ("vit_s32,randaug", "bad option 'randaug'"),
    ("vit_s32,smoke=1", "bad option 'smoke=1'"),
    ("vit_s32,batch_size=12", "batch_size must be a positive multiple of 8"),
])
def test_bad_arguments_are_config_errors_naming_the_argument(arg, needle):
  path = os.path.join(CONFIG_DIR, "imagenet.py")
  with pytest.raises(ConfigError) as info:
    load_config_flag(f"{path}:{arg}")
  assert info.value.field == "--config"
  assert needle in info.value.reason and repr(arg) in info.value.reason
