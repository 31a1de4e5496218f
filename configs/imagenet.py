r"""The V-MoE / SoftMoE papers' ImageNet-1k (ILSVRC2012) settings.

    python -m vmoe_ext.main --config=configs/imagenet.py:vmoe_s32_every2 \
        --config.data.data_dir=/data/tfds --workdir=runs/vmoe_s32_every2
    # fine-tuning a V-MoE pre-trained on ImageNet-21k (vmoe's file format):
    python -m vmoe_ext.main --config=configs/imagenet.py:vmoe_s32_last2_ft \
        --config.init.checkpoint=/ckpts/vmoe_s32_last2_imagenet21k \
        --config.data.data_dir=/data/tfds --workdir=runs/vmoe_s32_last2_ft

ARG: a model, then optional comma-separated `key=value` options.

Models (every value and where it comes from: docs/imagenet.md):
  vmoe_s32_every2, vmoe_s32_last2  V-MoE S/32 (8 blocks, D=512, MLP 2048, 8
      heads, E=8, K=2; MoE in blocks 1,3,5,7 / 5,7) from scratch, exactly
      google-research/vmoe `configs/vmoe_paper/vmoe_s32_last2_ilsvrc2012_
      randaug_light1.py` (Every-2: the same file with the description
      "Every 2"): batch 8192, 300 epochs of train[:99%], Adam with decoupled
      weight decay 0.1 on kernels, peak LR 3e-3, 10k warmup steps, linear
      decay to 1e-5, clipping 1.0, expert dropout 0.2, cf 1.05 (4.0 at
      evaluation), routing groups of 8 images, RandAugment(2, 10) + mixup
      0.2 ("light1"), sigmoid cross-entropy.
  vmoe_s32_every2_ft, vmoe_s32_last2_ft  the same V-MoE fine-tuned on
      ILSVRC2012 from an ImageNet-21k V-MoE S/32 (`init.checkpoint`, vmoe's
      layout; the head is re-initialised for 1000 classes): vmoe's
      `vmoe_b16_imagenet21k_randaug_strong_ft_ilsvrc2012.py` recipe (SGD
      momentum 0.9, LR 0.003 with 500 warmup steps and cosine decay, clip
      10, 10k steps of 1024 images, cf 1.5, no pre-logits, no RandAugment or
      mixup) at 224 px instead of 384 px (the position embedding is not
      resized here). vmoe publishes no S/32 ImageNet-21k checkpoint: train
      one with vmoe's `configs/vmoe_paper/pretrain_imagenet21k.py`.
  soft_s16  SoftMoE S/16 (12 blocks, D=384, MLP 1536, 6 heads, qk-norm, GAP
      head, 128 experts of 1 slot in the last 6 blocks: vmoe's
      `projects/soft_moe/configs/pretrain_jft4b.py:soft-s16`). DERIVED: the
      SoftMoE paper trains on JFT-4B only, so the ImageNet-1k recipe is
      big_vision's `configs/vit_i1k.py` for S/16 (AugReg): batch 4096, 300
      epochs, Adam, LR 1e-3, 10k warmup, cosine, decoupled decay 1e-4 (0.1 x
      LR here), clip 1.0, RandAugment(2, 15) + mixup 0.5 ("medium2").
  vit_s32  the dense ViT-S/32 baseline (vmoe's `projects/adversarial_attacks/
      configs/common.py` `get_vit_config("ViT-S/32")`: the V-MoE S/32 without
      MoE layers), DERIVED: trained with the V-MoE S/32 recipe above.

Options:
  randaug=light0|light1|medium1|medium2|strong1|strong2|extreme1|extreme2
      vmoe's `common.get_randaug` / `get_mixup_concentration` pairs (not for
      the _ft models, which use neither);
  data_dir=DIR      the TFDS data directory (or --config.data.data_dir);
  imagenet_o=DIR    the released ImageNet-O folder (class sub-folders): adds
      the OOD evaluation (it is not in TFDS);
  checkpoint=PREFIX (_ft only) the ImageNet-21k checkpoint;
  batch_size=N      NOT the papers' setting: a smaller global batch for
      hardware that cannot hold the papers' (the binary trains on one
      device today): the same epochs (total and warmup steps scaled by
      paper batch / N), the same learning rate.
  smoke             NOT the papers' setting: a smoke test of the whole
      config on small batches (`python -m vmoe_ext.data.fake_tfds` data,
      docs/imagenet.md): 2 training steps of `batch_size` images (default
      16, one warm-up step), evaluation, routing analysis and each attack on
      one batch (PGD 2 steps, SPSA 1 step of 2 directions), no sweep and no
      robustness datasets.

Every config ends with the ImageNet robustness section: FGSM, vmoe's PGD
(40 steps) and SPSA at eps 1/255, a PGD sweep over 0..5/255, ImageNet-C
(mCE), ImageNet-A/R (200-class protocol) and, with `imagenet_o`, ImageNet-O.
Differences from the papers that remain are listed in docs/imagenet.md.
"""

import importlib.util
import math
import os

import ml_collections

from vmoe_ext.errors import ConfigError

FIELD = "--config"
NUM_CLASSES = 1000
IMAGE_SIZE = 224
# TFDS imagenet2012: 1,281,167 train images; vmoe and big_vision train on
# train[:99%] (TFDS rounds 1% boundaries to the closest example).
TRAIN_SPLIT = "train[:99%]"
TRAIN_EXAMPLES = round(1_281_167 * 99 / 100)  # 1,268,355
PP_TRAIN = ("decode_jpeg_and_inception_crop(224)|flip_lr|{randaug}"
            "value_range(-1, 1)")
PP_EVAL = "decode|resize_small(256)|central_crop(224)|value_range(-1, 1)"
# vmoe's fine-tuning configs evaluate with a plain resize (no crop).
PP_TRAIN_FT = "decode_jpeg_and_inception_crop(224)|flip_lr|value_range(-1, 1)"
PP_EVAL_FT = "decode|resize(224)|value_range(-1, 1)"

# vmoe configs/vmoe_paper/common.py: get_randaug, get_mixup_concentration.
RANDAUG = {"light0": (2, 0), "light1": (2, 10), "medium1": (2, 15),
           "medium2": (2, 15), "strong1": (2, 20), "strong2": (2, 20),
           "extreme1": (4, 15), "extreme2": (4, 20)}
MIXUP = {"light0": 0.0, "light1": 0.2, "medium1": 0.2, "medium2": 0.5,
         "strong1": 0.5, "strong2": 0.8, "extreme1": 0.5, "extreme2": 0.8}
# vmoe projects/soft_moe/configs/common.py get_vit_config, variant "S".
SOFT_S = dict(hidden_size=384, num_layers=12, mlp_dim=1536, num_heads=6)

MODELS = ("vmoe_s32_every2", "vmoe_s32_last2", "vmoe_s32_every2_ft",
          "vmoe_s32_last2_ft", "soft_s16", "vit_s32")
OPTIONS = ("randaug", "data_dir", "imagenet_o", "checkpoint", "batch_size")
FLAGS = ("smoke",)  # Options without a value.
SMOKE_BATCH = 16


def _sibling(name: str):
  """Another file of configs/ as a module (configs/ is not a package)."""
  path = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                      f"{name}.py")
  spec = importlib.util.spec_from_file_location(f"vmoe_ext_config_{name}",
                                                path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def parse_arg(arg):
  """`MODEL[,key=value,...]` -> (model, options); ConfigError("--config")."""
  usage = (f"expected MODEL[,randaug=...,data_dir=...,imagenet_o=...,"
           f"checkpoint=...,batch_size=...,smoke] with MODEL one of "
           f"{list(MODELS)}")
  parts = [p.strip() for p in (arg or "").split(",")]
  model, options = parts[0], {}
  if model not in MODELS:
    raise ConfigError(FIELD, f"configs/imagenet.py: unknown model {model!r} "
                      f"in {arg!r}; {usage}")
  for part in parts[1:]:
    if part in FLAGS:
      options[part] = True
      continue
    key, eq, value = part.partition("=")
    if not eq or key not in OPTIONS or not value:
      raise ConfigError(FIELD, f"configs/imagenet.py: bad option {part!r} in "
                        f"{arg!r}; options are {list(OPTIONS)} as key=value "
                        f"and {list(FLAGS)}")
    options[key] = value
  fine_tune = model.endswith("_ft")
  if "randaug" in options:
    if fine_tune:
      raise ConfigError(FIELD, f"configs/imagenet.py: {model} takes no "
                        "randaug (vmoe fine-tunes without RandAugment or "
                        f"mixup), got {arg!r}")
    if options["randaug"] not in RANDAUG:
      raise ConfigError(FIELD, f"configs/imagenet.py: unknown randaug "
                        f"{options['randaug']!r} in {arg!r}; one of "
                        f"{list(RANDAUG)}")
  if "batch_size" in options:
    value = options["batch_size"]
    if not (value.isdigit() and int(value) > 0 and int(value) % 8 == 0):
      raise ConfigError(FIELD, f"configs/imagenet.py: batch_size must be a "
                        f"positive multiple of 8 (whole routing groups), got "
                        f"{value!r} in {arg!r}")
    options["batch_size"] = int(value)
  if "checkpoint" in options and not fine_tune:
    raise ConfigError(FIELD, f"configs/imagenet.py: checkpoint= is for the "
                      f"_ft models, not {model!r} (in {arg!r})")
  return model, options


def train_steps(epochs: float, batch_size: int, rounding=math.ceil) -> int:
  """Steps of `epochs` over train[:99%]: vmoe's `ceil(epochs * n / B)`
  (`trainer.get_train_steps_and_epochs`); big_vision rounds (`round`)."""
  return int(rounding(epochs * TRAIN_EXAMPLES / batch_size))


def vmoe_s32(where: str) -> dict:
  """V-MoE S/32, E=8, K=2 as vmoe's ILSVRC2012 from-scratch config trains
  it: `common.get_vmoe_config(desc, 224, 1000)` with expert dropout 0.2 and
  capacity factor 1.05, evaluated at 4.0 (vmoe's `evaluate.model_overrides`:
  `moe.eval_capacity_factor`)."""
  vmoe_import = _sibling("vmoe_import")
  model = vmoe_import.vmoe_model(
      vmoe_import.parse_description(f"S32,{where},E8,K2"))
  model["moe"].update(capacity_factor=1.05, eval_capacity_factor=4.0,
                      dropout_rate=0.2)
  model["moe"]["router"].update(importance_loss_weight=0.005,
                                load_loss_weight=0.005)
  model.update(dropout_rate=0.0, attention_dropout_rate=0.0)
  return model


def vit_s32() -> dict:
  """Dense ViT-S/32: vmoe's adversarial_attacks `get_vit_config("ViT-S/32")`
  (D=512, 8 blocks, MLP 2048, 8 heads, class token, pre-logits 512, head
  bias -log(1000))."""
  hidden, layers, mlp, heads = _sibling("vmoe_import").VARIANTS["S"]
  return dict(name="vit", num_classes=NUM_CLASSES, patch_size=(32, 32),
              hidden_size=hidden, num_layers=layers, num_heads=heads,
              mlp_dim=mlp, classifier="token", representation_size=hidden,
              head_bias_init=-math.log(NUM_CLASSES), dropout_rate=0.0,
              attention_dropout_rate=0.0)


def soft_s16() -> dict:
  """SoftMoE S/16 of vmoe's soft_moe `pretrain_jft4b.py:soft-s16`
  (`get_vmoe_soft_router_config("S", 16, ..., num_experts=128, last_n=6,
  num_slots=1)`) with 1000 classes: GAP head without pre-logits, qk
  LayerNorm, one image per routing group, bfloat16 dispatch (vmoe's soft
  router always wraps its dispatcher in bfloat16)."""
  return dict(name="soft_moe_vit", num_classes=NUM_CLASSES,
              patch_size=(16, 16), classifier="gap",
              representation_size=None,
              head_bias_init=-math.log(NUM_CLASSES), attention_qk_norm=True,
              dropout_rate=0.0, attention_dropout_rate=0.0, **SOFT_S,
              moe=dict(last=6, num_experts=128, group_size=None,
                       dispatch_dtype="bfloat16",
                       router=dict(name="soft", num_slots=1)))


def fine_tune_model(where: str) -> dict:
  """The V-MoE S/32 of vmoe's ImageNet-21k -> ILSVRC2012 fine-tuning
  (`vmoe_b16_imagenet21k_randaug_strong_ft_ilsvrc2012.get_vmoe_config`):
  no pre-logits (the ImageNet-21k models have none), capacity factor 1.5,
  no expert dropout, evaluated with the training model (no override)."""
  model = vmoe_s32(where)
  model["representation_size"] = None
  model["moe"].update(capacity_factor=1.5, eval_capacity_factor=None,
                      dropout_rate=0.0)
  return model


def fine_tune_rules() -> list:
  """`init.rules`: the head stays fresh (1000 classes instead of 21,843);
  every other parameter from the vmoe-layout checkpoint."""
  from vmoe_ext.interop.layouts import vmoe_rules
  return [(r"head/.+", None)] + [tuple(r) for r in vmoe_rules()]


def imagenet_robustness(imagenet_o=None) -> dict:
  """The ImageNet robustness section (docs/robustness.md, docs/imagenet.md).

  Attacks in [0, 1] pixel units on 1024 evenly spaced validation images:
  FGSM at 1/255 (ACMoE appendix C), vmoe's PGD at 1/255 (40 updates of
  eps/40, no random start: `adversarial_attacks/configs/attack/
  ilsvrc2012.py`), SPSA at 1/255 (20 iterations, ACMoE) on 256 images and a
  vmoe-PGD sweep over eps 0..5/255 (ACMoE Fig. 3). The local corruption
  suite (made for 28-32 px images) is off: ImageNet-C replaces it.
  """
  eps = 1 / 255
  datasets = dict(
      imagenet_c=dict(kind="corrupted", source=dict(
          tfds_name="imagenet2012_corrupted", split="validation")),
      imagenet_a=dict(kind="accuracy", class_subset="imagenet_a",
                      source=dict(tfds_name="imagenet_a", split="test")),
      imagenet_r=dict(kind="accuracy", class_subset="imagenet_r",
                      source=dict(tfds_name="imagenet_r", split="test")),
  )
  if imagenet_o:
    datasets["imagenet_o"] = dict(
        kind="ood", source=dict(path=imagenet_o),
        in_source=dict(tfds_name="imagenet2012", split="validation"))
  return dict(
      num_examples=1024,
      attacks=(
          dict(name="fgsm", eps=eps),
          dict(name="pgd", eps=eps, steps=40, vmoe_compatible=True),
          dict(name="spsa", eps=eps, steps=20, samples=32, num_examples=256),
      ),
      sweep=dict(attack=dict(name="pgd", steps=40, vmoe_compatible=True),
                 eps=tuple(e / 255 for e in range(6))),
      corruptions=None,
      datasets=datasets,
      seed=0,
      checkpoint_dir=ml_collections.FieldReference(None, field_type=str))


def _data(batch_size, pp_train, pp_eval, data_dir):
  return dict(
      name="tfds", tfds_name="imagenet2012",
      data_dir=ml_collections.FieldReference(data_dir, field_type=str),
      train_split=TRAIN_SPLIT, test_split="validation",
      batch_size=batch_size, eval_batch_size=1024, image_size=IMAGE_SIZE,
      streaming=True, pp_train=pp_train, pp_eval=pp_eval,
      worker_count=16, device_normalize=True, analysis_examples=1024)


def get_config(arg=None):
  model, options = parse_arg(arg or "vmoe_s32_last2")
  fine_tune = model.endswith("_ft")
  config = ml_collections.ConfigDict()
  config.seed = 0
  if fine_tune:  # vmoe: 10k steps of 1024 images, 500 warmup steps.
    batch = options.get("batch_size",
                        SMOKE_BATCH if options.get("smoke") else 1024)
    steps = ml_collections.FieldReference(round(10_000 * 1024 / batch))
    config.data = _data(batch, PP_TRAIN_FT, PP_EVAL_FT,
                        options.get("data_dir"))
    config.model = fine_tune_model(model.split("_")[2])
    config.optimizer = dict(
        name="sgd", momentum=0.9, learning_rate=0.003,
        warmup_steps=round(500 * 1024 / batch),
        decay="cosine", end_learning_rate=1e-5, total_steps=steps,
        clip_global_norm=10.0)
    config.train = dict(total_steps=steps, log_every=100, eval_every=1000,
                        checkpoint_every=1000, keep_checkpoints=2,
                        label_smoothing=0.0, mixup=None,
                        loss="softmax_xent")
    config.init = dict(
        checkpoint=ml_collections.FieldReference(options.get(
            "checkpoint", "./vmoe_checkpoints/vmoe_s32_imagenet21k"),
            field_type=str),
        format="auto", layout=None, rules=fine_tune_rules(), strict=False)
  else:
    aug = options.get("randaug", "medium2" if model == "soft_s16"
                      else "light1")
    layers, magnitude = RANDAUG[aug]
    pp_train = PP_TRAIN.format(randaug=f"randaug({layers}, {magnitude})|")
    if model == "soft_s16":  # big_vision vit_i1k.py (AugReg), S/16.
      paper, peak, end, decay, rounding = 4096, 1e-3, 0.0, "cosine", round
      loss = "softmax_xent"
      config.model = soft_s16()
    else:  # vmoe vmoe_s32_last2_ilsvrc2012_randaug_light1.py.
      paper, peak, end, decay = 8192, 3e-3, 1e-5, "linear"
      rounding, loss = math.ceil, "sigmoid_xent"
      config.model = (vit_s32() if model == "vit_s32"
                      else vmoe_s32(model.split("_")[2]))
    # big_vision's mixup (fold_in=None) draws one weight per batch; vmoe's
    # one per device group.
    granularity = "batch" if model == "soft_s16" else "device"
    batch = options.get("batch_size",
                        SMOKE_BATCH if options.get("smoke") else paper)
    steps = ml_collections.FieldReference(train_steps(300, batch, rounding))
    config.data = _data(batch, pp_train, PP_EVAL, options.get("data_dir"))
    config.optimizer = dict(
        name="adamw", learning_rate=peak,
        warmup_steps=round(10_000 * paper / batch), decay=decay,
        end_learning_rate=end, total_steps=steps, b1=0.9, b2=0.999,
        weight_decay=0.1, weight_decay_mask="no_bias_norm",
        clip_global_norm=1.0)
    config.train = dict(
        total_steps=steps, log_every=100, eval_every=1000,
        checkpoint_every=1000, keep_checkpoints=2, label_smoothing=0.0,
        loss=loss,
        mixup=dict(concentration=MIXUP[aug], size=2, granularity=granularity,
                   groups=None))
  config.robustness = imagenet_robustness(options.get("imagenet_o"))
  if options.get("smoke"):
    smoke(config, steps)
  return config


def smoke(config: ml_collections.ConfigDict,
          steps: ml_collections.FieldReference) -> None:
  """The `smoke` option (module docstring), in place."""
  batch = config.data.batch_size
  steps.set(2)
  config.optimizer.warmup_steps = 1
  config.data.update(eval_batch_size=batch, analysis_examples=batch,
                     worker_count=0)
  config.train.update(log_every=1, eval_every=0, checkpoint_every=2)
  eps = config.robustness.attacks[0]["eps"]
  config.robustness.num_examples = batch
  config.robustness.sweep = None
  config.robustness.datasets = None
  config.robustness.attacks = (
      dict(name="fgsm", eps=eps),
      dict(name="pgd", eps=eps, steps=2, vmoe_compatible=True),
      dict(name="spsa", eps=eps, steps=1, samples=2))
