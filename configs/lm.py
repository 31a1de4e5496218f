r"""The language models of the ACMoE, Symphony and MomentumSMoE papers
(WikiText-103, EnWik-8), and a tiny one on the shipped text.

    python -m vmoe_ext.main --config=configs/lm.py:tiny --workdir=runs/lm_tiny
    python -m vmoe_ext.main --config=configs/lm.py:switch_medium,acmoe \
        --config.data.path=/data/wikitext-103 --workdir=runs/acmoe_m

ARG: a setting, then optional comma-separated methods.

Settings (`vmoe_ext.models.lm_settings.SETTINGS`; docs/language_model.md):
  switch_small, switch_medium, smoe_large  Switch-style: every layer an MoE
      layer (3 / 6 / 12 layers of width 128 / 352 / 512), WikiText-103.
  glam_small, glam_medium  GLaM: MoE and dense layers alternate (3 / 6
      pairs of width 144 / 352), WikiText-103.
  enwik8   8 Switch layers of width 352 on EnWik-8 (bytes; bits per
      character).
  tiny     NOT a paper setting: 2 Switch layers of width 64 (4 experts) on
      the Python Language Reference shipped with Python (`python_docs`,
      about 95,000 training words): trains in about two minutes on 2 CPU
      cores, for smoke runs and tests.

  The paper settings train as the authors' scripts do: Adam, learning rate
  7e-4 after a linear warm-up of 3,000 (small) / 4,000 steps, then
  constant; 60,000 (small), 80,000 (medium, large, EnWik-8) or 120,000
  (GLaM-medium) steps of `SETTINGS[...].batch_size` rows of
  `block_size` tokens; the validation PPL every 1,000 steps (the authors'
  "epoch"), the test PPL and the attacked PPL (2.5% of the words swapped
  for "AAA") at the end. `data.path` must name the corpus: WikiText-103's
  directory (`train.txt`, `valid.txt`, `test.txt` or `wiki.*.tokens`) or
  the `enwik8` file (a missing one is a `config error: data.path`).

Methods (any that combine):
  acmoe     the ACMoE authors' layers: the Adaptive Clustering router
            (`c` letters) after the first MoE layers, their placement per
            setting (`ACMOE_ARCHITECTURES`); non-causal as theirs, the
            causal variant with `--config.model.ac_router.causal=True`.
  momentum  MomentumSMoE: every MoE layer through the heavy-ball stream
            (`m` letters; mu 0.7, gamma 1.0).
  adam      AdamSMoE: `a` letters (Adam in the first MoE layer, heavy-ball
            after it); not with momentum.
  symphony  SymphonySMoE: the Symphony router over the layers' gate.
  xmoe      the XMoE gate (cosine scores in an 8-dimensional space) as the
            layers' gate.
Example: `:glam_medium,momentum`, `:switch_medium,xmoe,symphony`.

Mode:
  evaluate  evaluate only (the authors' `--full-eval-mode`): score the newest
            checkpoint of `--config.robustness.checkpoint_dir=RUN` (a
            training workdir of the same setting and methods), nothing
            trained; the numbers go to WORKDIR/evaluation when WORKDIR holds
            a training run.
Example: `:tiny,evaluate --config.robustness.checkpoint_dir=runs/lm_tiny`.
"""

import ml_collections

from vmoe_ext.errors import ConfigError
from vmoe_ext.models.lm_arch import default_architecture
from vmoe_ext.models.lm_config import (LM_AC_ROUTER, LM_ROUTER,
                                       LM_XMOE_ROUTER)
from vmoe_ext.models.lm_settings import SETTINGS

FIELD = "--config"
PAPER = ("switch_small", "switch_medium", "glam_small", "glam_medium",
         "smoe_large", "enwik8")
METHODS = ("acmoe", "momentum", "adam", "symphony", "xmoe")
# The ACMoE authors' architecture strings (their scripts; smoe_large has
# none: the medium placement, two plain MoE layers first, continued).
ACMOE_ARCHITECTURES = {
    "switch_small": "sgsgsc",
    "switch_medium": "sgsgscscscsc",
    "smoe_large": "sgsg" + "sc" * 10,
    "glam_small": "sgsfscsfscsf",
    "glam_medium": "sgsfsgsfscsfscsfscsfscsf",
    "enwik8": "sgsgscscscscscsc",
    "tiny": "sgsc",
}
# (training steps, warm-up steps) of the authors' scripts: `--niter` x
# `--nbatches 1000`, `--lr-warmup`.
SCHEDULES = {
    "switch_small": (60_000, 3_000),
    "glam_small": (60_000, 3_000),
    "switch_medium": (80_000, 4_000),
    "smoe_large": (80_000, 4_000),
    "enwik8": (80_000, 4_000),
    "glam_medium": (120_000, 4_000),
}
TINY_MODEL = dict(hidden_size=64, inner_hidden_size=64, num_heads=4,
                  num_layers=2, attn_span=64, base_arch="transformer",
                  dropout_rate=0.1, moe={"num_experts": 4})


def parse_arg(arg):
  """`SETTING[,METHOD...]` -> (setting, methods); ConfigError("--config")."""
  parts = [p.strip() for p in (arg or "tiny").split(",") if p.strip()]
  usage = (f"expected SETTING[,METHOD...][,evaluate] with SETTING one of "
           f"{['tiny', *PAPER]} and METHODs of {list(METHODS)}")
  if not parts or parts[0] not in ("tiny",) + PAPER:
    raise ConfigError(FIELD, f"configs/lm.py: unknown setting "
                      f"{parts[0] if parts else ''!r} in {arg!r}; {usage}")
  methods = [p for p in parts[1:] if p != "evaluate"]
  for method in methods:
    if method not in METHODS:
      raise ConfigError(FIELD, f"configs/lm.py: unknown method {method!r} "
                        f"in {arg!r}; {usage}")
  if {"momentum", "adam"} <= set(methods):
    raise ConfigError(FIELD, f"configs/lm.py: momentum and adam are two "
                      f"residual streams; give one (in {arg!r})")
  return parts[0], tuple(methods)


def evaluate_only(arg):
  """Whether `arg` asks for the evaluate-only mode (`,evaluate`)."""
  return "evaluate" in [p.strip() for p in (arg or "").split(",")][1:]


def model_config(setting, methods):
  """The `model` section of a setting with its methods."""
  if setting == "tiny":
    model = dict(TINY_MODEL, vocab_size=None)  # The corpus's.
  else:
    model = dict(SETTINGS[setting].model)
  model["moe"] = dict(model["moe"])
  architecture = (ACMOE_ARCHITECTURES[setting] if "acmoe" in methods else
                  None)
  letter = "m" if "momentum" in methods else "a" if "adam" in methods else "g"
  if letter != "g":
    if architecture is None:
      architecture = default_architecture(model["base_arch"],
                                          model["num_layers"])
    architecture = architecture.replace("g", letter)
  model["architecture"] = architecture
  if "acmoe" in methods:  # The authors' AC gate, its fields overridable.
    model["ac_router"] = {**LM_AC_ROUTER, "causal": False}
  router = dict(LM_XMOE_ROUTER if "xmoe" in methods else LM_ROUTER)
  if "symphony" in methods:
    router = {"name": "symphony", "base": router}
  model["moe"]["router"] = router
  return dict(name="language_model", **model)


def get_config(arg=None):
  setting, methods = parse_arg(arg)
  config = ml_collections.ConfigDict()
  config.seed = 0
  config.model = ml_collections.ConfigDict(model_config(setting, methods))
  if setting == "tiny":
    config.data = ml_collections.ConfigDict(dict(
        name="text", corpus="python_docs", block_size=32, batch_size=16))
    total, rate = 600, 2e-3
    log_every, eval_every, checkpoint_every = 50, 300, 300
  else:
    paper = SETTINGS[setting]
    config.data = ml_collections.ConfigDict(dict(
        name="text", corpus="enwik8" if setting == "enwik8" else
        "wikitext103",
        path=ml_collections.FieldReference(None, field_type=str),
        block_size=paper.block_size, batch_size=paper.batch_size))
    (total, warmup), rate = SCHEDULES[setting], 7e-4
    log_every, eval_every, checkpoint_every = 100, 1_000, 1_000
  total_steps = ml_collections.FieldReference(total)
  if setting == "tiny":  # 10% of the run, also when it is shortened.
    warmup = total_steps // 10
  config.optimizer = ml_collections.ConfigDict(dict(
      name="adam", learning_rate=rate, warmup_steps=warmup,
      decay="constant", total_steps=total_steps))
  config.train = ml_collections.ConfigDict(dict(
      total_steps=total_steps, log_every=log_every, eval_every=eval_every,
      checkpoint_every=checkpoint_every, keep_checkpoints=2))
  if evaluate_only(arg):
    config.robustness = ml_collections.ConfigDict(dict(
        checkpoint_dir=ml_collections.FieldReference(None, field_type=str)))
  return config
