"""A small Swin-MoE on MNIST-5k (trains on a 2-core CPU in minutes).

    python -m vmoe_ext.main --config=configs/swin_moe.py[:ROUTER]

The embedded default job (data, optimizer, schedule, robustness section of
`configs/default.py`) with a two-stage Swin in place of the ViT: patch 2 on
the images resized to 32 x 32 and patches of 4 (8 x 8 tokens, width 32, 2
blocks, windows of 4, the second block's shifted), patch merging to 4 x 4
tokens (width 64, 4 blocks, one window), MoE in blocks 1 and 3 of the second stage as the
papers place them (every second block), E = 4 experts, capacity factor 1.25
(tutel's rounding, batch-prioritised routing, groups of 8 images), expert
dropout only after the activation, no expert output bias, stochastic depth
0.1. ROUTER picks the router (docs/routers.md):

* `swin_moe` (default): the Swin-MoE release's router, top-2 (tutel's gate:
  linear, softmax of the noisy logits, importance + load loss weighted 0.01);
* `top1`: the same, top-1 (the Swin-MoE paper's setting);
* `acmoe`: ACMoE with the `swin` preset over that router, on the second MoE
  block of the stage (the authors' placement);
* `symphony`: Symphony over that router (SymphonySwin-MoE);
* `noisy_topk`: V-MoE's noisy top-2;
* `dense`: the dense Swin of the same shape (no MoE).
"""

from vmoe_ext.train.config_files import load_config

SWIN_MOE = dict(name="swin_moe", num_selected=2, gate_noise=1.0,
                aux_loss_weight=0.01)
ROUTERS = {
    "swin_moe": SWIN_MOE,
    "top1": dict(SWIN_MOE, num_selected=1),
    "acmoe": dict(name="acmoe", normalization="swin", dispersion="mad",
                  layers="preset", base=SWIN_MOE),
    "symphony": dict(name="symphony", beta=0.9, graph_init="zeros",
                     threshold=0.0, base=SWIN_MOE),
    "noisy_topk": dict(name="noisy_topk", num_selected=2, noise_std=1.0,
                       importance_loss_weight=0.005, load_loss_weight=0.005),
}


def get_config(arg=None):
  choice = arg or "swin_moe"
  if choice not in ROUTERS and choice != "dense":
    raise ValueError(f"unknown swin_moe config argument {choice!r}; one of "
                     f"{sorted(ROUTERS) + ['dense']}")
  config = load_config("default")
  config.data.image_size = 32  # 28 / 4 = 7 tokens a side would not merge.
  config.model = dict(
      name="swin" if choice == "dense" else "swin_moe",
      num_classes=10, patch_size=(4, 4), embed_dim=32, depths=(2, 4),
      num_heads=(2, 4), window_size=4, mlp_ratio=2.0,
      relative_position_bias="table", drop_path_rate=0.1,
      dropout_rate=0.0, attention_dropout_rate=0.0)
  if choice != "dense":
    config.model.update(
        moe_blocks=((-1,), (1, 3)),
        moe=dict(num_experts=4, capacity_factor=1.25,
                 capacity_rounding="tutel", batch_priority=True,
                 group_size=16 * 8,  # 8 images of 4 x 4 tokens per group
                 dropout_rate=0.0, dropout_output=False, output_bias="none",
                 router=ROUTERS[choice]))
  return config
