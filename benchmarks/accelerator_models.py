"""The models, axes and arithmetic of `benchmarks/accelerator.py`.

Pure parts (no compile, no timing), tested in
`tests/test_accelerator_bench.py`:

* `PEAK_TFLOPS` / `peak_flops`: the dense peak of known accelerators, per
  device, at the rate a model's matmuls run at in each compute dtype;
* `mfu`: model FLOPs utilisation from an XLA FLOP count and a step time;
  `remat_model_flops`: a remat candidate's MFU from the model's FLOPs;
* `dense_equivalent_mlp_dim`: the MLP width of the dense ViT whose matmul
  FLOPs per token equal the active ones of a top-K V-MoE;
* `MODELS` / `model_configs`: the six ImageNet models at their configs'
  per-device batch (or small shapes with `quick`), their dense equivalents;
* `AXES` / `axis_overrides`: the config overrides of each measured axis
  (compute dtype, rematerialisation, attention, dispatcher), and whether
  the model
  class has the field an axis needs.
"""

from __future__ import annotations

import copy
import dataclasses
import re
from typing import Any, Mapping, Optional

# Dense (no sparsity) peak TFLOP/s per device: "bfloat16" for bfloat16
# matmuls, "float32" for the rate float32 matmuls run at under JAX's default
# precision (TF32 tensor cores on Ampere/Hopper GPUs, one bfloat16 pass on
# TPUs). Matched against `jax.devices()[0].device_kind`, lowercased, as
# whole words (an L40S is not an L4), first match wins (so "h100 pcie"
# before "h100"). Vendors' data
# sheets: H100/H200 SXM 989.4 / 494.7, H100 PCIe 756.5 / 378.0, A100 312 /
# 156, L4 121 / 60 (their sparse figures halved), TPU v4 275, v5e 197, v5p
# 459 (bfloat16; float32 at the bfloat16-pass rate).
PEAK_TFLOPS: tuple[tuple[str, Mapping[str, float]], ...] = (
    ("h100 pcie", {"bfloat16": 756.5, "float32": 378.0}),
    ("h100", {"bfloat16": 989.4, "float32": 494.7}),
    ("h200", {"bfloat16": 989.4, "float32": 494.7}),
    ("a100", {"bfloat16": 312.0, "float32": 156.0}),
    ("l4", {"bfloat16": 121.0, "float32": 60.0}),
    ("tpu v4", {"bfloat16": 275.0, "float32": 275.0}),
    ("tpu v5 lite", {"bfloat16": 197.0, "float32": 197.0}),
    ("tpu v5e", {"bfloat16": 197.0, "float32": 197.0}),
    ("tpu v5p", {"bfloat16": 459.0, "float32": 459.0}),
    ("tpu v5", {"bfloat16": 459.0, "float32": 459.0}),
)


def peak_flops(device_kind: str, dtype: str) -> Optional[float]:
  """Dense peak FLOP/s of one device of `device_kind` computing in `dtype`
  ("float32" or "bfloat16"); None for an unknown device (e.g. a CPU)."""
  kind = device_kind.lower()
  for key, peaks in PEAK_TFLOPS:
    if re.search(rf"\b{re.escape(key)}\b", kind):
      return peaks[dtype] * 1e12
  return None


def mfu(flops_per_step: float, step_seconds: float,
        peak: Optional[float]) -> Optional[float]:
  """Model FLOPs utilisation: achieved FLOP/s over the peak (None without
  a peak)."""
  if peak is None:
    return None
  return flops_per_step / step_seconds / peak


def dense_equivalent_mlp_dim(mlp_dim: int, num_layers: int,
                             num_moe_layers: int, num_selected: int) -> int:
  """The dense ViT MLP width of equal active matmul FLOPs per token.

  A token of a top-K V-MoE runs K experts of width `mlp_dim` in each of its
  `num_moe_layers` MoE blocks and one MLP in the others; attention is the
  same in both models. One width W for every block of the dense model with
  `num_layers * W = (num_layers - M + K * M) * mlp_dim` (M MoE blocks).
  The router's matmul and the capacity buffers' padding are not "active"
  FLOPs: they are the MoE's overhead the step-time ratio measures.
  """
  width = mlp_dim * (num_layers + (num_selected - 1) * num_moe_layers)
  if width % num_layers:
    raise ValueError(f"no integer width: {width} / {num_layers}")
  return width // num_layers


def remat_model_flops(group: dict[str, dict]) -> None:
  """MFU counts model FLOPs: a remat candidate's XLA count includes the
  recomputed forward, so its `mfu` uses the FLOPs of the same candidate
  without remat, and `hfu` (hardware FLOPs utilisation) keeps its own."""
  for label, f in group.items():
    base = group.get(label.split("_remat_")[0], {})
    if "_remat_" in label and "gflops_per_step" in base and "mfu" in f:
      f["hfu"] = f["mfu"]
      if f["mfu"] is not None:
        f["mfu"] *= base["gflops_per_step"] / f["gflops_per_step"]


B16 = dict(patch_size=(16, 16), hidden_size=768, num_layers=12,
           mlp_dim=3072, num_heads=12, representation_size=768)
# name -> (config file, config arg, overrides, per-device batch, source).
# Per-device batch: the config's global batch over the devices its recipe
# ran on: vmoe's and big_vision's ImageNet runs on a TPU v3-32 (32 cores:
# 8192 / 32, 4096 / 32), Swin-MoE's on 4 GPUs (192 / 4).
# In order of priority (a time budget cuts the tail): the models of the
# goals first.
MODELS: dict[str, tuple[str, str, dict, int, str]] = {
    "vmoe_b16_last2": ("imagenet", "vmoe_s32_last2",
                       {**B16, "moe": {"layers": (9, 11),
                                       "group_size": 8 * 197}}, 256,
                       "DERIVED: vmoe_s32_last2's recipe at B/16"),
    "vmoe_s32_every2": ("imagenet", "vmoe_s32_every2", {}, 256,
                        "configs/imagenet.py"),
    "soft_s16": ("imagenet", "soft_s16", {}, 128, "configs/imagenet.py"),
    "swin_moe_s_top2": ("swin_moe_imagenet", "top2", {}, 48,
                        "configs/swin_moe_imagenet.py"),
    "vit_s32": ("imagenet", "vit_s32", {}, 256, "configs/imagenet.py"),
    "vit_b16": ("imagenet", "vit_s32", B16, 256,
                "DERIVED: vit_s32's recipe at B/16"),
}
# MoE model -> the dense model whose MLP width is made that of equal active
# FLOPs (candidates "dense_eq_<dtype>" of the MoE model's group).
DENSE_EQUIVALENT = {"vmoe_s32_every2": "vit_s32", "vmoe_b16_last2": "vit_b16"}

# --quick (CPU, CI; a train-step compile takes seconds to minutes there):
# V-MoE S/32 Every-2 and its dense equivalent only, at small shapes (32x32
# images, patch 8, 2 blocks of D = 64, both MoE: ACMoE's AC layer needs an
# MoE layer before it); the other models'
# small shapes below are for trying one on a CPU by hand.
QUICK_MODELS = ("vmoe_s32_every2",)
QUICK_IMAGE = {"swin_moe_s_top2": 64}
QUICK_BATCH = 16
_QUICK_VIT = dict(patch_size=(8, 8), hidden_size=64, num_layers=2,
                  mlp_dim=128, num_heads=2, representation_size=None)
QUICK = {
    "vmoe_s32_every2": {**_QUICK_VIT, "moe": {"layers": (0, 1),
                                              "group_size": 8 * 17}},
    "vmoe_b16_last2": {**_QUICK_VIT, "moe": {"layers": (1,),
                                             "group_size": 8 * 17}},
    "soft_s16": {**_QUICK_VIT, "moe": {"last": 1, "num_experts": 16}},
    "swin_moe_s_top2": dict(embed_dim=32, depths=(2, 2, 2, 2),
                            num_heads=(1, 2, 4, 8), window_size=4,
                            moe_blocks=((-1,), (-1,), (1,), (1,)),
                            moe={"num_experts": 8}),
    "vit_s32": _QUICK_VIT,
    "vit_b16": _QUICK_VIT,
}


def _merge(base: dict, overrides: Mapping[str, Any]) -> dict:
  out = copy.deepcopy(base)
  for key, value in overrides.items():
    if isinstance(value, Mapping) and isinstance(out.get(key), dict):
      out[key] = _merge(out[key], value)
    else:
      out[key] = copy.deepcopy(value)
  return out


def model_config(name: str, quick: bool) -> tuple[dict, int, int]:
  """(model config, per-device batch, image size) of a `MODELS` name."""
  from vmoe_ext.train.config_files import load_config
  file, arg, overrides, batch, _ = MODELS[name]
  config = _merge(load_config(file, arg).model.to_dict(), overrides)
  if not quick:
    return config, batch, 224
  config = _merge(config, QUICK[name])
  config["num_classes"] = 10
  return config, QUICK_BATCH, QUICK_IMAGE.get(name, 32)


def num_moe_layers(config: Mapping[str, Any]) -> int:
  """The MoE blocks of a V-MoE config (`moe.layers`)."""
  return len(config["moe"]["layers"])


def dense_equivalent(moe_config: Mapping[str, Any],
                     dense_config: Mapping[str, Any]) -> dict:
  """`dense_config` with the MLP width of `moe_config`'s active FLOPs."""
  router = moe_config["moe"]["router"]
  width = dense_equivalent_mlp_dim(
      moe_config["mlp_dim"], moe_config["num_layers"],
      num_moe_layers(moe_config), router["num_selected"])
  return {**copy.deepcopy(dict(dense_config)), "mlp_dim": width}


# Axis -> (model field it needs, {value label: overrides}). The first value
# is the reference of the axis' ratios.
AXES: dict[str, tuple[str, dict[str, dict]]] = {
    "dtype": ("param_dtype", {"float32": {},
                              "bfloat16": {"dtype": "bfloat16",
                                           "param_dtype": "float32"}}),
    "remat": ("remat", {"none": {},
                        "full": {"remat": "full"}}),
    "attention": ("attention", {"plain": {},
                                "cudnn": {"attention": "cudnn"}}),
    "dispatcher": ("moe", {"einsum": {"moe": {"dispatcher": "einsum"}},
                           "indices": {"moe": {"dispatcher": "indices"}},
                           "dropless": {"moe": {"dispatcher": "dropless"}}}),
}


def model_fields(config: Mapping[str, Any]) -> set[str]:
  """The dataclass fields of the module class a model config selects."""
  from vmoe_ext.models import MODELS as KINDS
  cls = KINDS.get(config["name"]).cls
  return {f.name for f in dataclasses.fields(cls)}


def axis_overrides(axis: str, config: Mapping[str, Any]
                   ) -> tuple[dict[str, dict], Optional[str]]:
  """({label: config with that value}, None) or ({}, why it is skipped)."""
  field, values = AXES[axis]
  if field not in model_fields(config):
    return {}, f"field model.{field} not present"
  if axis == "dispatcher" and (config.get("moe") is None or config["moe"].get(
      "router", {}).get("name") == "soft"):
    return {}, "no top-k MoE layer"
  return {label: _merge(dict(config), o) for label, o in values.items()}, None
