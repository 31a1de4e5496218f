"""`configs/swin_moe_imagenet.py`: Swin-MoE-S as the ACMoE authors' release
trains it.

Every value is written here from the release's files, not read back from the
config: `image-classification/configs/swincosa/R_swin_moe_small_patch4_
window7_192_16expert_4gpu_1k.yaml` (and its `swinmoe/` baseline),
`config.py` defaults (GATE_NOISE 1.0, USE_BPR True, NORMALIZE_GATE False,
adamw eps 1e-8 betas (0.9, 0.999), LABEL_SMOOTHING 0.1, MIXUP 0.8),
`run_acmoe.sh` (4 GPUs x 48 images) and `main_moe.py`'s linear scaling rule
(`BASE_LR * batch / 512`). No training here.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import pytest

from vmoe_ext.app.schema import validate_config
from vmoe_ext.errors import ConfigError
from vmoe_ext.models import build_model
from vmoe_ext.routers.acmoe import resolve_ac_stages
from vmoe_ext.routers.registry import ROUTERS
from vmoe_ext.train.config_files import load_config

TRAIN = 1_281_167  # TFDS imagenet2012 train, all of it (the release's).
YAML = dict(embed_dim=96, depths=(2, 2, 18, 2), num_heads=(3, 6, 12, 24),
            window_size=7, drop_path_rate=0.2, mlp_fc2_bias=False,
            moe_blocks=((-1,), (-1,), (1, 3, 5, 7, 9, 11, 13, 15, 17), (1,)),
            num_experts=16, capacity_factor=1.25, moe_drop=0.1,
            aux_loss_weight=0.01, epochs=90, warmup_epochs=10,
            weight_decay=0.1, base_lr=1.25e-4, min_lr=1.25e-6,
            clip_grad=3.0, batch=4 * 48, cosa_positions=(7, 9, 11, 13, 15,
                                                         17, 19, 21))


def _config(arg):
  return load_config("swin_moe_imagenet", arg)


def hand_param_count(moe=True) -> int:
  """Swin-MoE-S's parameters by hand: conv embedding + its LayerNorm;
  per block two LayerNorms, qkv (with bias), proj, the continuous position
  bias MLP (2 -> 512 with bias, 512 -> heads without), the MLP without its
  fc2 bias (or E experts of it and a bias-free router); the merges'
  LayerNorm(4C) and Dense(4C -> 2C, no bias); final LayerNorm; head."""
  total = 4 * 4 * 3 * 96 + 96 + 2 * 96
  moe_blocks = {2: set(range(1, 18, 2)), 3: {1}} if moe else {}
  for s, (depth, heads) in enumerate(zip(YAML["depths"],
                                         YAML["num_heads"])):
    c = 96 * 2 ** s
    if s:
      total += 2 * (2 * c) + (2 * c) * c  # LayerNorm(4 C_{s-1}), Dense.
    for i in range(depth):
      total += 4 * c + (c * 3 * c + 3 * c) + (c * c + c)
      total += (2 * 512 + 512) + 512 * heads
      mlp = c * 4 * c + 4 * c + 4 * c * c
      if i in moe_blocks.get(s, ()):
        total += 16 * mlp + c * 16
      else:
        total += mlp
  return total + 2 * 768 + 768 * 1000 + 1000


def _params(model_config):
  model = build_model(model_config)
  params = jax.eval_shape(model.init, jax.random.key(0),
                          jnp.zeros((1, 224, 224, 3)))["params"]
  return model, params


@pytest.mark.parametrize("arg", ["top2", "top1", "top2,acmoe",
                                 "top2,symphony", "dense",
                                 "top1,acmoe,batch_size=512,data_dir=/d"])
def test_every_variant_validates(arg):
  config = _config(arg)
  validate_config(config)
  assert config.data.image_size == 224 and config.data.train_split == "train"


@pytest.mark.parametrize("arg,name,k", [
    ("top2", "swin_moe", 2), ("top1", "swin_moe", 1),
    ("top2,acmoe", "acmoe", 2), ("top2,symphony", "symphony", 2)])
def test_model_is_the_release_swin_moe_s(arg, name, k):
  m = _config(arg).model.to_dict()
  assert m["name"] == "swin_moe"
  for key in ("embed_dim", "window_size", "drop_path_rate", "mlp_fc2_bias"):
    assert m[key] == YAML[key], key
  for key in ("depths", "num_heads", "moe_blocks"):
    assert tuple(map(lambda v: tuple(v) if isinstance(v, (list, tuple))
                     else v, m[key])) == YAML[key], key
  assert tuple(m["patch_size"]) == (4, 4) and m["mlp_ratio"] == 4.0
  assert m["relative_position_bias"] == "log_cpb"
  assert m["mlp_activation"] == "gelu_exact"
  moe = m["moe"]
  assert (moe["num_experts"], moe["capacity_factor"], moe["dropout_rate"]) \
      == (YAML["num_experts"], YAML["capacity_factor"], YAML["moe_drop"])
  assert moe.get("eval_capacity_factor") is None  # The same at evaluation.
  assert moe["capacity_rounding"] == "tutel" and moe["batch_priority"]
  assert moe["dropout_output"] is False and moe["output_bias"] == "none"
  router = moe["router"]
  assert router["name"] == name
  gate = router if name == "swin_moe" else router["base"]
  assert gate == dict(name="swin_moe", num_selected=k, gate_noise=1.0,
                      normalize_gate=False, balance_loss="importance_load",
                      aux_loss_weight=YAML["aux_loss_weight"])
  model = build_model(m)
  assert model.moe_layers == (5, 7, 9, 11, 13, 15, 17, 19, 21, 23)
  if name == "acmoe":  # COSA_POSITIONS [[-1],[-1],[3,5,...,17],[-1]].
    assert router["normalization"] == "swin" and router["dispersion"] == "mad"
    ac = ROUTERS.build(router, num_experts=16, parent=None)
    assert resolve_ac_stages(ac.placement,
                             model.moe_stages) == YAML["cosa_positions"]


@pytest.mark.parametrize("moe", [True, False])
def test_parameter_count_by_hand(moe):
  _, params = _params(_config("top2" if moe else "dense").model.to_dict())
  count = sum(x.size for x in jax.tree.leaves(params))
  assert count == hand_param_count(moe=moe)


@pytest.mark.parametrize("batch", [None, 512])
def test_training_settings_are_the_release(batch):
  config = _config("top2" + (f",batch_size={batch}" if batch else ""))
  b = batch or YAML["batch"]
  assert config.data.batch_size == b
  steps = math.ceil(YAML["epochs"] * TRAIN / b)
  assert config.train.total_steps == steps
  opt = config.optimizer.to_dict()
  assert opt["learning_rate"] == pytest.approx(YAML["base_lr"] * b / 512)
  assert opt["end_learning_rate"] == pytest.approx(YAML["min_lr"] * b / 512)
  assert opt["warmup_steps"] == math.ceil(YAML["warmup_epochs"] * TRAIN / b)
  assert (opt["name"], opt["decay"], opt["b1"], opt["b2"], opt["eps"]) == (
      "adamw", "cosine", 0.9, 0.999, 1e-8)
  assert opt["weight_decay"] == YAML["weight_decay"]
  assert opt["clip_global_norm"] == YAML["clip_grad"]
  assert config.train.label_smoothing == 0.1
  assert config.train.loss == "softmax_xent"
  assert config.train.mixup.concentration == 0.8
  assert "randaug(2, 9)" in config.data.pp_train


def test_weight_decay_spares_the_position_bias_norms_and_biases():
  from vmoe_ext.train.optimizer import weight_decay_mask
  _, params = _params(_config("top2").model.to_dict())
  mask = weight_decay_mask(params)
  block = mask["encoderblock_5"]
  assert not block["Attention"]["cpb_mlp_0"]["kernel"]
  assert not block["Attention"]["cpb_mlp_1"]["kernel"]
  assert not block["Attention"]["qkv"]["bias"]
  assert not block["LayerNorm_0"]["scale"]
  assert block["Attention"]["qkv"]["kernel"]
  assert block["Moe"]["Mlp"]["Dense_0"]["kernel"]
  assert mask["merging_1"]["reduction"]["kernel"]


@pytest.mark.parametrize("arg,needle", [
    ("top3", "unknown model"), ("dense,acmoe", "bad token"),
    ("top2,acmoe,symphony", "bad token"), ("top2,batch_size=0", "batch_size"),
    ("top2,foo=1", "bad token")])
def test_bad_arguments_name_the_argument(arg, needle):
  with pytest.raises(ConfigError, match=needle) as e:
    _config(arg)
  assert e.value.field == "--config"
