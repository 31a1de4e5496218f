"""Importing google vmoe / vit_jax checkpoints (`vmoe_ext.interop`).

Random weights in vmoe's layout are written in vmoe's partitioned format
(`tests/vmoe_layout.py`), imported through the `init` section with the
layout's rules, and the model's logits are compared with an independent
NumPy forward over the vmoe-layout tree (`tests/vmoe_reference.py`, written
from vmoe's sources, not from the mapping code).
"""

from __future__ import annotations

import copy
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from vmoe_layout import write_msgpack, write_npz, write_vmoe_checkpoint
from vmoe_reference import (random_vit_jax_params, random_vmoe_params,
                                  vit_jax_forward, vmoe_forward)
from vmoe_ext.errors import ConfigError
from vmoe_ext.models import build_model
from vmoe_ext.train.initialization import load_init_params

IMAGE = (8, 8, 3)
B = 4


def vmoe_config(classifier="token", representation_size=6, qk_norm=False,
                position_emb="learned", layers=(1, 2), experts=4, k=2,
                cf=0.5, multiple=4, batch_priority=False, group_images=2):
  """A vmoe model config (vmoe's own keys) and ours for the same model."""
  tokens = 4 + (classifier == "token")
  theirs = dict(
      num_classes=5, patch_size=(4, 4), hidden_size=16, classifier=classifier,
      representation_size=representation_size,
      encoder=dict(num_layers=3, num_heads=2, mlp_dim=12,
                   attention_qk_norm=qk_norm,
                   position_emb=dict(name=position_emb, temperature=50.0),
                   moe=dict(layers=layers, num_experts=experts,
                            group_size=group_images * tokens,
                            router=dict(num_selected_experts=k, dispatcher=dict(
                                capacity_factor=cf, batch_priority=batch_priority,
                                capacity_ceil_or_round="ceil",
                                multiple_of=multiple)))))
  ours = dict(
      name="vit_moe", num_classes=5, patch_size=(4, 4), hidden_size=16,
      num_layers=3, num_heads=2, mlp_dim=12, classifier=classifier,
      representation_size=representation_size, attention_qk_norm=qk_norm,
      position_emb=position_emb, position_emb_temperature=50.0,
      moe=dict(layers=layers, num_experts=experts,
               group_size=group_images * tokens, capacity_factor=cf,
               capacity_rounding="vmoe", capacity_multiple=multiple,
               batch_priority=batch_priority,
               router=dict(name="noisy_topk", num_selected=k)))
  return theirs, ours


def _import(ours, init, seed=0):
  model = build_model(ours)
  images = np.random.default_rng(seed + 1).normal(size=(B,) + IMAGE)
  params = model.init(jax.random.key(0), jnp.zeros((B,) + IMAGE))["params"]
  params, report = load_init_params(init, params)
  logits, _ = jax.jit(model.apply)({"params": params}, images)
  return np.asarray(logits), images, report


CASES = {
    "token_pre_logits_drops": dict(),
    "map_qk_norm_sincos2d": dict(classifier="map", qk_norm=True,
                                 position_emb="sincos2d",
                                 representation_size=None, cf=1.0),
    "first_token_no_posemb_bpr": dict(classifier="0", position_emb="none",
                                      batch_priority=True, k=1, multiple=1),
    "gap_every_block_one_image_groups": dict(classifier="gap", layers=(0, 1, 2),
                                             group_images=1, cf=2.0),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_imported_vmoe_logits_equal_the_vmoe_reference(tmp_path, case):
  theirs, ours = vmoe_config(**CASES[case])
  tree = random_vmoe_params(np.random.default_rng(0), theirs, IMAGE)
  prefix = os.path.join(tmp_path, "vmoe_ckpt")
  write_vmoe_checkpoint(prefix, tree, num_shards=2, split_axis0=True)
  logits, images, report = _import(ours, dict(
      checkpoint=prefix, format="vmoe", layout="vmoe", rules=(), strict=True))
  expected = vmoe_forward(tree, theirs, images)
  np.testing.assert_allclose(logits, expected, rtol=1e-5, atol=1e-5)
  assert not report.unmatched and not report.fresh
  assert not report.unused_source and report.step is None
  # Not a vacuous match: the logits depend on the image.
  assert np.ptp(expected, axis=0).max() > 1e-2


def test_capacity_drops_happen_in_the_dropping_case():
  """The first case routes with capacity below need (tokens are dropped), so
  the comparison above covers vmoe's dropping order."""
  from vmoe_reference import compute_capacity
  theirs, _ = vmoe_config()
  moe = theirs["encoder"]["moe"]
  capacity = compute_capacity(moe["group_size"] * 2, 4, 0.5, "ceil", 4)
  assert capacity == 4 and 2 * moe["group_size"] > capacity * 4


@pytest.mark.parametrize("fmt,writer", [("npz", write_npz),
                                        ("msgpack", write_msgpack)])
def test_other_formats_and_a_train_state_tree(tmp_path, fmt, writer):
  """The same tree as .npz / flax msgpack, nested under `params/` beside an
  optimizer state, as vmoe's training checkpoints hold it."""
  theirs, ours = vmoe_config()
  tree = random_vmoe_params(np.random.default_rng(3), theirs, IMAGE)
  state = {"params": tree, "opt_state": {"mu": {"x": np.ones(3, np.float32)}},
           "step": np.asarray(7)}
  path = os.path.join(tmp_path, f"state.{fmt}")
  writer(path, state)
  logits, images, _ = _import(ours, dict(checkpoint=path, layout="vmoe",
                                         rules=(), strict=True), seed=3)
  np.testing.assert_allclose(logits, vmoe_forward(tree, theirs, images),
                             rtol=1e-5, atol=1e-5)


def test_vit_jax_npz_imports_into_a_dense_vit_and_upcycles(tmp_path):
  config = dict(num_classes=5, patch_size=(4, 4), hidden_size=16,
                classifier="token", representation_size=6,
                transformer=dict(num_layers=2, num_heads=2, mlp_dim=12))
  tree = random_vit_jax_params(np.random.default_rng(5), config, IMAGE)
  path = os.path.join(tmp_path, "vit.npz")
  write_npz(path, tree)
  dense = dict(name="vit", num_classes=5, patch_size=(4, 4), hidden_size=16,
               num_layers=2, num_heads=2, mlp_dim=12, representation_size=6)
  logits, images, _ = _import(dense, dict(checkpoint=path, layout="vit_jax",
                                          rules=(), strict=True), seed=5)
  expected = vit_jax_forward(tree, config, images)
  np.testing.assert_allclose(logits, expected, rtol=1e-5, atol=1e-5)
  # Upcycled: a V-MoE whose every expert is the dense MLP, K=1 and no
  # dropping: each token's output is gate * MLP(x), not the dense model's,
  # so only the loaded values are checked, expert by expert.
  moe = dict(dense, name="vit_moe", moe=dict(
      layers=(1,), num_experts=3, capacity_factor=4.0,
      router=dict(name="noisy_topk", num_selected=1)))
  model = build_model(moe)
  params = model.init(jax.random.key(0), jnp.zeros((1,) + IMAGE))["params"]
  params, report = load_init_params(dict(
      checkpoint=path, layout="vit_jax", upcycle=True, rules=()), params)
  kernel = tree["Transformer"]["encoderblock_1"]["MlpBlock_3"]["Dense_0"][
      "kernel"]
  got = np.asarray(params["encoderblock_1"]["Moe"]["Mlp"]["Dense_0"]["kernel"])
  for e in range(3):
    np.testing.assert_array_equal(got[e], kernel)
  assert report.fresh == ("encoderblock_1/Moe/router/logits/dense/kernel",)


def _drop(tree, path):
  tree = copy.deepcopy(tree)
  *parents, leaf = path.split("/")
  node = tree
  for key in parents:
    node = node[key]
  del node[leaf]
  return tree


def _add(tree, path, value):
  tree = copy.deepcopy(tree)
  *parents, leaf = path.split("/")
  node = tree
  for key in parents:
    node = node.setdefault(key, {})
  node[leaf] = value
  return tree


BAD = {
    # tree edit, our config change, expected field, text in the message
    "missing_leaf": (lambda t: _drop(t, "Encoder/encoderblock_0/LayerNorm_1/"
                                        "bias"), {}, "init.layout rule 4",
                     "Encoder/encoderblock_0/LayerNorm_1/bias"),
    "extra_leaf": (lambda t: _add(t, "Encoder/encoderblock_0/extra/kernel",
                                  np.ones((2, 2), np.float32)), {},
                   "init.rules", "Encoder/encoderblock_0/extra/kernel"),
    "shape_mismatch": (lambda t: _add(
        t, "Encoder/encoderblock_0/Mlp/Dense_0/bias",
        np.ones(11, np.float32)), {}, "init.layout rule 4",
        "encoderblock_0/Mlp/Dense_0/bias"),
    "expert_count": (None, dict(moe_experts=2), "model.moe.num_experts",
                     "Encoder/encoderblock_1/Moe/Mlp/Dense_0/kernel"),
    "moe_placement": (None, dict(moe_layers=(2,)), "model.moe.layers",
                      "(1, 2)"),
    "hidden_size": (None, dict(hidden_size=8), "model.hidden_size",
                    "embedding/kernel"),
    "num_layers": (None, dict(num_layers=4, moe_layers=(1, 2)),
                   "model.num_layers", "3"),
    "classifier": (None, dict(classifier="gap", moe_group=8),
                   "model.classifier",
                   "'token'"),
    "representation": (None, dict(representation_size=None),
                       "model.representation_size", "pre_logits"),
    "qk_norm": (None, dict(attention_qk_norm=True),
                "model.attention_qk_norm", "query_ln"),
    "num_classes": (None, dict(num_classes=7), "model.num_classes",
                    "head/kernel"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_mismatched_checkpoint_names_the_leaf_and_the_field(tmp_path, case):
  edit, change, field, text = BAD[case]
  theirs, ours = vmoe_config()
  tree = random_vmoe_params(np.random.default_rng(0), theirs, IMAGE)
  if edit is not None:
    tree = edit(tree)
  prefix = os.path.join(tmp_path, "ckpt")
  write_vmoe_checkpoint(prefix, tree)
  change = dict(change)
  if "moe_experts" in change:
    ours["moe"]["num_experts"] = change.pop("moe_experts")
  if "moe_group" in change:
    ours["moe"]["group_size"] = change.pop("moe_group")
  if "moe_layers" in change:
    ours["moe"]["layers"] = change.pop("moe_layers")
  ours.update(change)
  model = build_model(ours)
  abstract = jax.eval_shape(model.init, jax.random.key(0),
                            jnp.zeros((B,) + IMAGE))["params"]
  from vmoe_ext.train.initialization import check_init
  with pytest.raises(ConfigError) as info:
    check_init(dict(checkpoint=prefix, layout="vmoe", rules=(), strict=True),
               abstract)
  assert info.value.field == field, str(info.value)
  assert text in str(info.value), str(info.value)


# ------------------------------------------------- the binary, end to end


def _tiny_import_reference_config():
  """vmoe's config of the model `configs/vmoe_import.py:tiny` describes."""
  return dict(
      num_classes=10, patch_size=(7, 7), hidden_size=64, classifier="token",
      representation_size=32,
      encoder=dict(num_layers=4, num_heads=4, mlp_dim=128,
                   moe=dict(layers=(1, 3), num_experts=4, group_size=136,
                            router=dict(num_selected_experts=2, dispatcher=dict(
                                capacity_factor=1.25, multiple_of=4,
                                capacity_ceil_or_round="ceil")))))


def test_the_import_config_evaluates_and_attacks_an_imported_vmoe(tmp_path):
  """`configs/vmoe_import.py:tiny` on a random vmoe-layout checkpoint: the
  binary's clean test accuracy equals the NumPy vmoe forward's on the same
  preprocessed test images, and the attack ran."""
  import json

  from vmoe_ext import main
  from vmoe_ext.data import default_normalization, eval_batches
  from vmoe_ext.app.context import resolved
  from vmoe_ext.data.source import DataSource
  from vmoe_ext.train.config_files import load_config

  theirs = _tiny_import_reference_config()
  tree = random_vmoe_params(np.random.default_rng(11), theirs, (28, 28, 1))
  prefix = str(tmp_path / "tiny_vmoe")
  write_vmoe_checkpoint(prefix, tree)
  config = load_config("vmoe_import", "tiny")
  config.init.checkpoint = prefix
  config.robustness.num_examples = 50
  workdir = str(tmp_path / "run")
  main.run(config, workdir)
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    records = [json.loads(line) for line in f]
  final = [r for r in records if r.get("final")][0]
  assert final["step"] == 0
  assert any(r["split"].startswith("adversarial") for r in records)
  assert "Evaluated the params initialised from" in open(
      os.path.join(workdir, "report.md")).read()

  test = DataSource(resolved(config).data, config.seed).test
  mean, std = default_normalization(config.data)
  correct = total = 0
  for batch in eval_batches(test, 200, mean=mean, std=std):
    logits = vmoe_forward(tree, theirs, batch["image"])
    hit = (logits.argmax(-1) == batch["label"]) & batch["mask"]
    correct += int(hit.sum())
    total += int(batch["mask"].sum())
  assert total == 1000
  assert final["accuracy"] == pytest.approx(correct / total, abs=1e-9)


@pytest.mark.parametrize("arg,expected", [
    # vmoe configs/vmoe_paper/common.py get_vmoe_config, by hand.
    ("S32,last2,E8,K2", dict(hidden_size=512, num_layers=8, mlp_dim=2048,
                             num_heads=8, layers=(5, 7), group_size=8 * 50,
                             representation_size=512)),
    ("B16,every2,E8,K2", dict(hidden_size=768, num_layers=12, mlp_dim=3072,
                              num_heads=12, layers=(1, 3, 5, 7, 9, 11),
                              group_size=8 * 197, representation_size=768)),
    ("H14,last5,E32,K1,classes21843,image224", dict(
        hidden_size=1280, num_layers=32, mlp_dim=5120, num_heads=16,
        layers=(23, 25, 27, 29, 31), group_size=8 * 257,
        representation_size=1280)),
])
def test_import_configs_build_vmoes_paper_models(arg, expected):
  import math

  from vmoe_ext.train.config_files import load_config
  from vmoe_ext.app.schema import validate_config
  config = load_config("vmoe_import", arg)
  validate_config(config)
  model = config.model
  for key in ("hidden_size", "num_layers", "mlp_dim", "num_heads",
              "representation_size"):
    assert model[key] == expected[key], key
  assert tuple(model.moe.layers) == expected["layers"]
  assert model.moe.group_size == expected["group_size"]
  classes = 21843 if "classes" in arg else 1000
  assert model.head_bias_init == pytest.approx(-math.log(classes))
  assert config.init.layout == "vmoe" and config.init.strict
  assert config.robustness.from_init


def test_import_config_rejects_a_bad_description():
  from vmoe_ext.train.config_files import load_config
  with pytest.raises(ValueError, match="unknown part"):
    load_config("vmoe_import", "S32,last2,Q9")
  with pytest.raises(ValueError, match="placement"):
    load_config("vmoe_import", "S32")
