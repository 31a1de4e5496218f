r"""Swin-MoE-S on ImageNet-1k: the setting of the ACMoE and Symphony Swin tables.

    python -m vmoe_ext.main --config=configs/swin_moe_imagenet.py:top2,acmoe \
        --config.data.data_dir=/data/tfds --workdir=runs/swin_moe_s_acmoe

ARG: `top1`, `top2` (default) or `dense`, then optional comma-separated
tokens: a router variant `acmoe` or `symphony`, and options
`data_dir=DIR`, `imagenet_o=DIR`, `batch_size=N`, `smoke`.

Models (every value and where it comes from: docs/imagenet.md, "Swin-MoE"):
  top1, top2  Swin-MoE-S as the ACMoE authors' release trains it
      (`configs/swinmoe/R_swin_moe_small_patch4_window7_192_16expert_4gpu_
      1k.yaml`, model `swin_cosa`, on microsoft/Swin-Transformer's
      Swin-MoE): patch 4, embed 96, depths [2, 2, 18, 2], heads [3, 6, 12,
      24], window 7, 224 px, the release's log-spaced continuous position
      bias, MoE in every second block of stage 3 and block 1 of stage 4
      (MOE_BLOCKS [[-1], [-1], [1, 3, ..., 17], [1]]), 16 experts, top-1 or
      top-2 (the yaml: 2), capacity factor 1.25 (tutel's rounding, the same
      at evaluation), batch-prioritised routing, gate noise 1.0, importance
      + load loss weighted 0.01, expert dropout 0.1 after the activation,
      no fc2 bias, drop path 0.2; AdamW (0.9, 0.999, eps 1e-8) with weight
      decay 0.1 (not on norms, biases, the position-bias MLP), clipping 3.0,
      90 epochs with 10 of linear warm-up and cosine decay to 1.25e-6 x
      B / 512 from a peak of 1.25e-4 x B / 512 (the release's linear scaling
      rule), batch 192 (4 GPUs x 48), label smoothing 0.1, RandAugment
      (2, 9) and mixup 0.8.
  dense  the dense Swin-S of the same shape and recipe (the Swin baseline).
Variants:
  acmoe     ACMoE's `swin` preset over the same router, AC on every MoE
            block of stage 3 but its first (the authors' COSA_POSITIONS
            [[-1], [-1], [3, 5, ..., 17], [-1]]); MAD, no mixing.
  symphony  Symphony over the same router (beta 0.9, zero init, dense):
            SymphonySwin-MoE; the Symphony paper publishes no Swin config,
            so the recipe is this one.
Options:
  data_dir=DIR, imagenet_o=DIR, smoke: as `configs/imagenet.py`'s;
  batch_size=N  another global batch: the learning rates follow the
      release's linear scaling rule (x N / 512), the epochs stay.

DERIVED where the release differs from what this framework offers (listed in
docs/imagenet.md): routing groups of one image (the release routes each
GPU's 48 images as one group); mixup with vmoe's sorted Dirichlet weights
and the next example (timm mixes Beta(0.8, 0.8) with the reversed batch and
switches to CutMix half of the time; no CutMix and no random erasing here);
the warm-up starts at 0 (the release: 1.25e-7 x B / 512).
"""

import importlib.util
import os

import ml_collections

from vmoe_ext.errors import ConfigError

FIELD = "--config"
NUM_CLASSES = 1000
TRAIN_EXAMPLES = 1_281_167  # The release trains on all of train.
PAPER_BATCH = 192
MODELS = ("top1", "top2", "dense")
VARIANTS = ("acmoe", "symphony")
OPTIONS = ("data_dir", "imagenet_o", "batch_size")
FLAGS = ("smoke",)
SMOKE_BATCH = 8


def _imagenet():
  """configs/imagenet.py as a module (configs/ is not a package)."""
  path = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                      "imagenet.py")
  spec = importlib.util.spec_from_file_location("vmoe_ext_config_imagenet",
                                                path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def parse_arg(arg):
  """`MODEL[,VARIANT][,key=value,...]` -> (model, variant, options)."""
  usage = (f"expected MODEL[,VARIANT][,data_dir=...,imagenet_o=...,"
           f"batch_size=...,smoke] with MODEL one of {list(MODELS)} and "
           f"VARIANT one of {list(VARIANTS)}")
  parts = [p.strip() for p in (arg or "top2").split(",") if p.strip()]
  model, variant, options = parts[0], None, {}
  if model not in MODELS:
    raise ConfigError(FIELD, f"configs/swin_moe_imagenet.py: unknown model "
                      f"{model!r} in {arg!r}; {usage}")
  for part in parts[1:]:
    key, eq, value = part.partition("=")
    if part in VARIANTS and variant is None and model != "dense":
      variant = part
    elif part in FLAGS:
      options[part] = True
    elif eq and key in OPTIONS and value:
      options[key] = value
    else:
      raise ConfigError(FIELD, f"configs/swin_moe_imagenet.py: bad token "
                        f"{part!r} in {arg!r} (one variant, not on "
                        f"'dense'); {usage}")
  if "batch_size" in options:
    value = options["batch_size"]
    if not (value.isdigit() and int(value) > 0):
      raise ConfigError(FIELD, f"configs/swin_moe_imagenet.py: batch_size "
                        f"must be a positive integer, got {value!r}")
    options["batch_size"] = int(value)
  return model, variant, options


def router(k: int, variant=None) -> dict:
  """The release's router (tutel's top-k gate) or a variant over it."""
  gate = dict(name="swin_moe", num_selected=k, gate_noise=1.0,
              normalize_gate=False, balance_loss="importance_load",
              aux_loss_weight=0.01)
  if variant == "acmoe":
    return dict(name="acmoe", normalization="swin", dispersion="mad",
                layers="preset", base=gate)
  if variant == "symphony":
    return dict(name="symphony", beta=0.9, graph_init="zeros",
                threshold=0.0, base=gate)
  return gate


def swin_s(model: str = "top2", variant=None) -> dict:
  """Swin(-MoE)-S of the release (module docstring)."""
  config = dict(
      name="swin" if model == "dense" else "swin_moe",
      num_classes=NUM_CLASSES, patch_size=(4, 4), embed_dim=96,
      depths=(2, 2, 18, 2), num_heads=(3, 6, 12, 24), window_size=7,
      mlp_ratio=4.0, qkv_bias=True, relative_position_bias="log_cpb",
      patch_norm=True, absolute_position_emb=False, dropout_rate=0.0,
      attention_dropout_rate=0.0, drop_path_rate=0.2,
      mlp_activation="gelu_exact", mlp_fc2_bias=False,
      layer_norm_epsilon=1e-5, head_kernel_zero_init=False)
  if model != "dense":
    config.update(
        moe_blocks=((-1,), (-1,), tuple(range(1, 18, 2)), (1,)),
        moe=dict(num_experts=16, capacity_factor=1.25,
                 capacity_rounding="tutel", group_size=None,
                 batch_priority=True, dropout_rate=0.1,
                 dropout_output=False, output_bias="none",
                 router=router(int(model[-1]), variant)))
  return config


def get_config(arg=None):
  model, variant, options = parse_arg(arg)
  imagenet = _imagenet()
  batch = options.get("batch_size",
                      SMOKE_BATCH if options.get("smoke") else PAPER_BATCH)
  scale = batch / 512  # The release's linear scaling rule.
  steps = ml_collections.FieldReference(
      -(-90 * TRAIN_EXAMPLES // batch))
  config = ml_collections.ConfigDict()
  config.seed = 0
  pp_train = imagenet.PP_TRAIN.format(randaug="randaug(2, 9)|")
  config.data = imagenet._data(batch, pp_train, imagenet.PP_EVAL,  # pylint: disable=protected-access
                               options.get("data_dir"))
  config.data.train_split = "train"
  config.model = swin_s(model, variant)
  config.optimizer = dict(
      name="adamw", learning_rate=1.25e-4 * scale,
      warmup_steps=-(-10 * TRAIN_EXAMPLES // batch), decay="cosine",
      end_learning_rate=1.25e-6 * scale, total_steps=steps, b1=0.9,
      b2=0.999, eps=1e-8, weight_decay=0.1,
      weight_decay_mask="no_bias_norm", clip_global_norm=3.0)
  config.train = dict(
      total_steps=steps, log_every=100, eval_every=5000,
      checkpoint_every=2000, keep_checkpoints=2, label_smoothing=0.1,
      loss="softmax_xent",
      mixup=dict(concentration=0.8, size=2, granularity="batch",
                 groups=None))
  config.robustness = imagenet.imagenet_robustness(
      options.get("imagenet_o"))
  if options.get("smoke"):
    imagenet.smoke(config, steps)
  return config
