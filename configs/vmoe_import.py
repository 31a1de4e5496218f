r"""Evaluate and attack a V-MoE imported from google's vmoe checkpoints.

    # A released V-MoE (vmoe's partitioned format: PREFIX.index and
    # PREFIX.data-00000-of-00001, e.g. copied from gs://vmoe_checkpoints/):
    python -m vmoe_ext.main --config=configs/vmoe_import.py:S32,last2,E8,K2 \
        --config.init.checkpoint=/ckpts/vmoe_s32_last2_ilsvrc2012_randaug_light1 \
        --config.data.data_dir=/data/tensorflow_datasets --workdir=runs/vmoe_s32
    # The tiny offline variant (MNIST-5k; a vmoe-layout checkpoint of the
    # tiny model, e.g. one the tests write):
    python -m vmoe_ext.main --config=configs/vmoe_import.py:tiny \
        --config.init.checkpoint=/tmp/tiny_vmoe --workdir=runs/vmoe_tiny

ARG: `tiny`, or vmoe's V-MoE paper description as comma-separated parts:
`{S,B,L,H}{patch}` (S/32 = `S32`), `every{n}` or `last{n}` (MoE placement),
`E{experts}`, `K{selected}`, optional `classes{n}` (default 1000) and
`image{px}` (default 224). The model is the one vmoe's
`configs/vmoe_paper/common.py` `get_vmoe_config` builds for that description
(hidden 512/768/1024/1280, 8/12/24/32 blocks, MLP 2048/3072/4096/5120, 8/12/16/16
heads, class token, pre-logits of the hidden size, head bias -log(classes),
routing groups of 8 images, noise std 1/E, no renormalisation), evaluated as
vmoe evaluates it: capacity factor 4, vmoe's capacity rounding (ceil, then a
multiple of 4), bfloat16 dispatch, inputs in [-1, 1].

Nothing is trained (`robustness.from_init`): the `init` section reads the
checkpoint with the "vmoe" layout's rules, strictly (every parameter and
every checkpoint leaf must map; a mismatch names the leaf and the model field
to change), and the binary writes the clean accuracy, FGSM and PGD at
eps 1/255 and 2/255 and the routing analysis to the workdir's `report.md`.
ImageNet needs the `imagenet2012` TFDS data prepared in `data.data_dir`; the
image is resized to 224 (vmoe's own eval crop, resize_small(256) +
central_crop(224), is the streaming pipeline's, docs/importing.md).
"""

import math
import re

import ml_collections

from vmoe_ext.train.config_files import load_config

# vmoe configs/vmoe_paper/common.py, by variant.
VARIANTS = {"S": (512, 8, 2048, 8), "B": (768, 12, 3072, 12),
            "L": (1024, 24, 4096, 16), "H": (1280, 32, 5120, 16)}
PART = re.compile(r"(?P<arch>[SBLH])(?P<patch>\d+)|(?P<where>every|last)"
                  r"(?P<n>\d+)|E(?P<e>\d+)|K(?P<k>\d+)|classes(?P<c>\d+)|"
                  r"image(?P<px>\d+)")


def parse_description(arg: str) -> dict:
  """vmoe's paper description (`S32,last2,E8,K2`, ...) as a dict of parts.

  Shared with `configs/imagenet.py`. Raises ValueError for unknown parts.
  """
  spec = dict(arch=None, patch=None, where=None, n=None, e=8, k=2, c=1000,
              px=224)
  for part in arg.split(","):
    m = PART.fullmatch(part.strip())
    if m is None:
      raise ValueError(f"configs/vmoe_import.py: unknown part {part!r} of "
                       f"{arg!r}; expected e.g. S32,last2,E8,K2")
    spec.update({k: v for k, v in m.groupdict().items() if v is not None})
  if spec["arch"] is None or spec["where"] is None:
    raise ValueError(f"configs/vmoe_import.py: {arg!r} needs an architecture "
                     "(e.g. S32) and a placement (every2 or last2)")
  return spec


def vmoe_model(spec: dict) -> dict:
  """The model vmoe's `get_vmoe_config` builds for a parsed description,
  with vmoe's evaluation overrides (capacity factor 4); shared with
  `configs/imagenet.py`, which sets the training values."""
  hidden, layers, mlp, heads = VARIANTS[spec["arch"]]
  patch, n, classes = int(spec["patch"]), int(spec["n"]), int(spec["c"])
  tokens = (int(spec["px"]) // patch) ** 2 + 1
  moe_layers = (tuple(range(n - 1, layers, n)) if spec["where"] == "every"
                else tuple(range(1, layers, 2))[-n:])
  return dict(
      name="vit_moe", num_classes=classes, patch_size=(patch, patch),
      hidden_size=hidden, num_layers=layers, num_heads=heads, mlp_dim=mlp,
      classifier="token", representation_size=hidden,
      head_bias_init=-math.log(classes),
      moe=dict(layers=moe_layers, num_experts=int(spec["e"]),
               group_size=8 * tokens, capacity_factor=4.0,
               capacity_rounding="vmoe", capacity_multiple=4,
               dispatcher="einsum", dispatch_dtype="bfloat16",
               router=dict(name="noisy_topk", num_selected=int(spec["k"]),
                           noise_std=1.0)))


def get_config(arg=None):
  config = load_config("default")
  config.train.total_steps = 1  # Not trained: robustness.from_init.
  config.optimizer.warmup_steps = 0
  config.init = ml_collections.ConfigDict(dict(
      workdir=None, step=None, format="auto", layout="vmoe", rules=(),
      upcycle=False, strict=True,
      checkpoint=ml_collections.FieldReference(None, field_type=str)))
  config.robustness.from_init = True
  config.robustness.corruptions = None
  config.robustness.sweep = None
  if arg == "tiny":  # The default job's shapes; MNIST-5k, offline.
    config.init.checkpoint = "./vmoe_checkpoints/tiny"
    config.model.moe.capacity_rounding = "vmoe"
    config.model.moe.capacity_multiple = 4
    config.model.representation_size = 32
    config.data.mean, config.data.std = 0.5, 0.5
    config.data.analysis_tsne_tokens = 200  # A smoke run: 0.3 s, not 3 s.
    config.robustness.num_examples = 200
    config.robustness.attacks = (dict(name="fgsm", eps=0.05),)
    return config
  spec = parse_description(arg or "S32,last2,E8,K2")
  config.model = ml_collections.ConfigDict(vmoe_model(spec))
  config.init.checkpoint = (
      "./vmoe_checkpoints/vmoe_s32_last2_ilsvrc2012_randaug_light1")
  config.data = ml_collections.ConfigDict(dict(
      name="tfds", tfds_name="imagenet2012", data_dir=None,
      test_split="validation", image_size=int(spec["px"]),
      batch_size=64, eval_batch_size=64, mean=0.5, std=0.5))
  config.robustness.num_examples = 1000
  config.robustness.attacks = (
      dict(name="fgsm", eps=1 / 255), dict(name="fgsm", eps=2 / 255),
      dict(name="pgd", eps=1 / 255, steps=10, step_size=0.25 / 255),
      dict(name="pgd", eps=2 / 255, steps=10, step_size=0.5 / 255))
  return config
