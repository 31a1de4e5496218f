"""The pure parts of benchmarks/accelerator.py (the benchmark itself runs in
CI through .ci/run): the peak table's lookup, MFU arithmetic, the width of
the dense ViT of equal active FLOPs, the axes' overrides, the papers'
overhead ratios."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))), "benchmarks"))
import accelerator_models as am  # noqa: E402
import accelerator_overheads as ao  # noqa: E402


def test_peak_lookup_by_device_kind():
  # H100 SXM: 989.4 TFLOP/s bf16, 494.7 TF32; the PCIe card is slower.
  assert am.peak_flops("NVIDIA H100 80GB HBM3", "bfloat16") == 989.4e12
  assert am.peak_flops("NVIDIA H100 80GB HBM3", "float32") == 494.7e12
  assert am.peak_flops("NVIDIA H100 PCIe", "bfloat16") == 756.5e12
  assert am.peak_flops("NVIDIA A100-SXM4-80GB", "bfloat16") == 312e12
  assert am.peak_flops("TPU v5 lite", "bfloat16") == 197e12
  assert am.peak_flops("TPU v5p", "bfloat16") == 459e12
  assert am.peak_flops("cpu", "float32") is None
  assert am.peak_flops("NVIDIA L40S", "bfloat16") is None  # Not an L4.
  assert am.peak_flops("NVIDIA L4", "bfloat16") == 121e12


def test_mfu_arithmetic():
  # 1.2 PFLOP per step in 2 s = 600 TFLOP/s, over an H100's 989.4 bf16 peak.
  assert am.mfu(1.2e15, 2.0, 989.4e12) == pytest.approx(600 / 989.4)
  assert am.mfu(1.2e15, 2.0, None) is None


def test_dense_equivalent_width():
  # V-MoE S/32 Every-2: 8 blocks, 4 MoE of top-2 experts of 2048: per token
  # 4 * 2048 + 4 * 2 * 2048 = 12 * 2048 = 8 * 3072.
  assert am.dense_equivalent_mlp_dim(2048, 8, 4, 2) == 3072
  # B/16 Last-2: 10 * 3072 + 2 * 2 * 3072 = 14 * 3072 = 12 * 3584.
  assert am.dense_equivalent_mlp_dim(3072, 12, 2, 2) == 3584
  assert am.dense_equivalent_mlp_dim(2048, 8, 0, 2) == 2048  # No MoE.
  with pytest.raises(ValueError):
    am.dense_equivalent_mlp_dim(100, 3, 1, 2)  # 400 / 3.


def test_dense_equivalent_config():
  moe = {"name": "vit_moe", "mlp_dim": 2048, "num_layers": 8,
         "moe": {"layers": (1, 3, 5, 7), "router": {"num_selected": 2}}}
  dense = {"name": "vit", "mlp_dim": 2048, "num_layers": 8}
  assert am.dense_equivalent(moe, dense) == {"name": "vit", "mlp_dim": 3072,
                                             "num_layers": 8}
  assert dense["mlp_dim"] == 2048  # Not modified in place.


def test_axis_overrides_and_missing_field():
  config = {"name": "vit_moe", "hidden_size": 8,
            "moe": {"dispatcher": "einsum", "router": {"name": "noisy_topk"}}}
  values, why = am.axis_overrides("dispatcher", config)
  assert why is None
  assert values["indices"]["moe"] == {"dispatcher": "indices",
                                      "router": {"name": "noisy_topk"}}
  assert values["einsum"] == config and config["moe"]["dispatcher"] == "einsum"
  am.AXES["_probe"] = ("no_such_field", {"a": {}})
  try:
    assert am.axis_overrides("_probe", config) == (
        {}, "field model.no_such_field not present")
  finally:
    del am.AXES["_probe"]
  soft = {"name": "soft_moe_vit", "moe": {"router": {"name": "soft"}}}
  assert am.axis_overrides("dispatcher", soft) == ({}, "no top-k MoE layer")


def test_paper_overheads_from_raw_figures():
  got = ao.paper_overheads()
  # ACMoE Table 7, Swin: 408.56 / 403.36 ms per iteration.
  assert got["acmoe_table7_ms_per_it"]["swin"] == pytest.approx(0.012892,
                                                                abs=1e-6)
  # MomentumSMoE Table 11: AdamSMoE 0.0321 vs 0.0315 s per sample.
  assert got["momentum_table11_train_s_per_sample"]["adam"] == (
      pytest.approx(0.0190476, abs=1e-6))


def test_overhead_candidates_keep_the_gate_as_base():
  gate = {"name": "swin_moe", "num_selected": 2}
  base = {"name": "swin_moe", "moe": {"num_experts": 16, "router": gate}}
  got = ao.candidates(base)
  assert got["acmoe_symphony"]["moe"]["router"]["base"]["base"] == gate
  assert got["momentum"]["stream"]["layout"] == "paper"
  assert got["momentum"]["moe"] == base["moe"]
  assert base["moe"]["router"] == gate  # Not modified in place.
  assert ao.reference("acmoe_symphony") == "acmoe"
  assert ao.reference("xmoe") == "baseline"


def test_remat_mfu_uses_model_flops():
  # Remat recomputes the forward: 150 GFLOP counted, 100 of them the model's.
  group = {"bfloat16": {"gflops_per_step": 100.0, "mfu": 0.4},
           "bfloat16_remat_full": {"gflops_per_step": 150.0, "mfu": 0.45}}
  am.remat_model_flops(group)
  assert group["bfloat16_remat_full"]["hfu"] == 0.45
  assert group["bfloat16_remat_full"]["mfu"] == pytest.approx(0.3)
  assert group["bfloat16"] == {"gflops_per_step": 100.0, "mfu": 0.4}
