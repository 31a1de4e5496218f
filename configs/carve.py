"""CMoE: carve the dense ViT of `configs/vit_dense.py:plain` into a V-MoE.

    # 1. the dense ViT (add ",swiglu" to both configs for SwiGLU MLPs)
    python -m vmoe_ext.main --config=configs/vit_dense.py:plain \
        --workdir=runs/vit_dense
    # 2. carve it (under a minute on 2 CPU cores); a V-MoE checkpoint at step 0
    python -m vmoe_ext.main --config=configs/carve.py:S1A1E8 \
        --workdir=runs/carve_S1A1E8
    # 3. evaluate and attack the carved model as is (training-free)
    python -m vmoe_ext.main --config=configs/carve.py:S1A1E8,evaluate \
        --workdir=runs/carve_S1A1E8
    # 4. fine-tune it briefly, bias balancing on
    python -m vmoe_ext.main --config=configs/carve.py:S1A1E8,finetune \
        --workdir=runs/carve_S1A1E8_ft

ARG, comma-separated:
  S{s}A{a}E{e}   shared experts, activated routed experts, total experts (the
                 paper's notation; default S1A1E8: 2 of 8 experts' width per
                 token, 25% of the dense MLP's hidden units);
  random         the random-split baseline (LLaMA-MoE style) with a fresh
                 noisy top-k router instead of CMoE's grouping and router;
  l1             the authors' L1 (Hamming) clustering distance (default L2);
  swiglu / relu  the dense ViT has SwiGLU / ReLU MLPs (vit_dense.py:plain,...);
  evaluate       (step 3) the carved model with `robustness.checkpoint_dir` =
                 the carve workdir (`--config.robustness.checkpoint_dir`);
  finetune       (step 4) the carved model trained for 300 steps from the
                 carve workdir's checkpoint (`--config.init.workdir`);
  freeze_router  (with finetune) the routers are not trained: router weights
                 and `u` frozen (`optimizer.frozen`), what the authors' code
                 does in effect (PEFT's LoRA marks every non-LoRA parameter
                 untrainable, `u` included, though it is handed to the
                 optimizer with its own lr); the bias still balances;
  freeze_router_kernel  (with finetune) the router weights frozen, `u`
                 trained: the paper's stated setting (u at lr 1e-3).

Every block of the 4-block ViT is carved (`carve.every=1`); the carved layers
are dropless (`carve.capacity_factor=None`), one image per routing group.
`--config.carve.checkpoint_dir` points at the dense run (default
`runs/vit_dense`); the step-3/4 variants read the carve workdir
`runs/carve_{S..A..E..}[_random][_l1][_swiglu]` by default.
"""

import re

import ml_collections

from vmoe_ext.carving.spec import CarveSpec, carved_model_config
from vmoe_ext.train.config_files import load_config
from vmoe_ext.train.initialization import identity_rules

FLAGS = ("random", "l1", "swiglu", "relu")
FREEZES = {"freeze_router": r"encoderblock_\d+/Moe/router/.*",
           "freeze_router_kernel":
               r"encoderblock_\d+/Moe/router/(kernel|up_kernel)"}
MODES = ("evaluate", "finetune")
FINETUNE_STEPS = 300


def get_config(arg=None):
  parts = [p for p in (arg or "").split(",") if p]
  sizes = [p for p in parts if re.fullmatch(r"S\d+A\d+E\d+", p)]
  flags = [p for p in parts if p in FLAGS]
  modes = [p for p in parts if p in MODES]
  freezes = [p for p in parts if p in FREEZES]
  unknown = [p for p in parts if p not in sizes + flags + modes + freezes]
  if unknown or len(sizes) > 1 or len(modes) > 1 or (
      "swiglu" in flags and "relu" in flags) or (
          freezes and (modes != ["finetune"] or len(freezes) > 1)):
    raise ValueError(f"configs/carve.py: bad arg {arg!r}; expected "
                     "S{s}A{a}E{e}, any of " + ", ".join(FLAGS[:2]) +
                     ", one of swiglu/relu, and at most one of "
                     + "/".join(MODES) + " (one of " + "/".join(FREEZES)
                     + " with finetune only)")
  s, a, e = map(int, re.findall(r"\d+", sizes[0] if sizes else "S1A1E8"))
  activation = next((f for f in flags if f in ("swiglu", "relu")), None)
  config = load_config("vit_dense", "plain" + (f",{activation}"
                                               if activation else ""))
  carve = dict(
      checkpoint_dir="runs/vit_dense", num_experts=e, num_shared=s,
      num_activated=a, every=1, last=None, layers=None,
      method="random" if "random" in flags else "cmoe",
      activation_markers=10, distance="l1" if "l1" in flags else "l2",
      iterations=1, normalize=None, num_calibration=256,
      bias_update_rate=1e-3, capacity_factor=None, batch_size=256, seed=0)
  name = f"S{s}A{a}E{e}" + "".join(f"_{f}" for f in flags)
  carve_dir = f"runs/carve_{name}"
  if not modes:
    config.carve = ml_collections.ConfigDict(carve)
    config.carve.checkpoint_dir = ml_collections.FieldReference(
        carve["checkpoint_dir"], field_type=str)
    config.robustness = None  # Carving only; evaluate with ",evaluate".
    return config
  spec = CarveSpec(**carve)
  config.model = ml_collections.ConfigDict(
      carved_model_config(config.model.to_dict(), spec))
  if modes[0] == "evaluate":
    config.robustness.checkpoint_dir = carve_dir
    return config
  config.init = ml_collections.ConfigDict(dict(
      workdir=carve_dir, step=0, rules=identity_rules()))
  config.train.total_steps = FINETUNE_STEPS
  config.optimizer.warmup_steps = 30
  config.optimizer.learning_rate = 1e-3
  config.train.eval_every = 100
  config.train.checkpoint_every = 100
  if freezes:
    config.optimizer.frozen = (FREEZES[freezes[0]],)
  return config
