"""Size, FLOPs and memory of the ImageNet paper configs (`configs/imagenet.py`,
`configs/swin_moe_imagenet.py`).

    python benchmarks/paper_configs.py [--quick] [--configs "a;b;..."]

Issue 14 ("document expected hardware, time and memory"). Nothing is run on
data: every figure comes from `jax.eval_shape` and from XLA's analysis of
executables compiled ahead of time on abstract arguments (the host's CPU
backend, float32 as the configs train), so it works on a laptop. For each
model of `configs/imagenet.py` (a bare name) and of
`configs/swin_moe_imagenet.py` (`swin_moe_imagenet:ARG`):

* `params` (exact, `jax.eval_shape(model.init)`), `expert_params`;
  `param_bytes`, `opt_state_bytes` (`jax.eval_shape` of the config's
  optimizer init: Adam's two moments, SGD's momentum);
* `forward_gflops_per_image`: XLA cost analysis of the deterministic forward
  at batch 8 (one routing group of 8 images), / 8;
* `train_gflops_per_image`: loss + backward in training mode (router noise,
  dropout) at batch 32, / 32; mixup and the optimizer update are left out
  (the full mode measures them: a fixed cost per step, negligible per image
  at the configs' batches);
* memory of that loss + backward step, compiled at batches 32 and 256 (the
  argument + temp bytes of `compiled.memory_analysis()`): a fixed part and
  `activation_bytes_per_image`, the slope (it grows a little with the
  batch: V-MoE S/32 Last-2 reads 28.6 MiB/image between 8 and 32, 33.1
  between 32 and 256, 32.9 between 256 and 1024);
* the same slope with `model.remat` set to each policy of `--remat`
  (default "full,dots_saveable"): `activation_bytes_per_image_remat_POLICY`,
  what XLA plans when each block's activations are recomputed in the
  backward pass (`vmoe_ext.models.stack`);
* without `--quick`, also the project's whole train step
  (`make_train_step`: mixup, the optimizer update, the on-device NaN guard,
  donated state) compiled at batch 32: `step_gflops_per_step`,
  `step_argument_bytes`, `step_temp_bytes` (slow: ~1 min per V-MoE S/32,
  ~5 min for SoftMoE S/16's 128 experts on a 2-core CPU);
* derived: `train_exaflops` = total_steps x batch x train_gflops_per_image;
  `device_bytes_one_device` = the memory one device needs for the config's
  whole batch (the binary trains on one device today); `device_bytes_dp8` /
  `device_bytes_dp32` = the same per device for data parallelism over 8
  GPUs / a TPU v3-32's 32 cores (replicated state; not implemented yet);
  `hours_*`: wall-time estimates `[slow, fast]` at the two utilisations
  vmoe's own reported times imply (`ASSUMPTIONS`): 5 h 50 min for V-MoE
  S/32 Last-2 from scratch on a TPU v3-32 (evaluations included) and 48 min
  for its ILSVRC2012 fine-tuning at 384 px on a TPU v3-8 (whose loss +
  backward FLOPs are measured here too, `finetune_384_gflops_per_image`).

The last line printed is one JSON object: `{"quick", "machine",
"assumptions", "configs": {name: {figure: value}}}`.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import machine, print_json_last  # noqa: E402

from vmoe_ext.models import build_model  # noqa: E402
from vmoe_ext.train.config_files import load_config  # noqa: E402
from vmoe_ext.train.optimizer import (make_learning_rate,  # noqa: E402
                                      make_optimizer)
from vmoe_ext.train.state import TrainState  # noqa: E402
from vmoe_ext.train.steps import cross_entropy, make_train_step  # noqa: E402

CONFIGS = ("vmoe_s32_every2", "vmoe_s32_last2", "vmoe_s32_every2_ft",
           "vmoe_s32_last2_ft", "soft_s16", "vit_s32",
           "swin_moe_imagenet:top1", "swin_moe_imagenet:top2",
           "swin_moe_imagenet:top2,acmoe", "swin_moe_imagenet:top2,symphony",
           "swin_moe_imagenet:dense")
# `model.remat` policies whose activation slope is measured too.
REMAT = ("full", "dots_saveable")
REMAT_KEY = "activation_bytes_per_image_remat_"
FORWARD = 8  # Batch of the forward compile: one routing group of 8 images.
# Batches of the two loss + backward compiles (memory slope between them).
SMALL, LARGE = 32, 256
# Peak dense throughput per device, TFLOP/s, at the precision a float32
# model's matmuls run at by default: bfloat16 passes on TPU, TF32 on GPU.
PEAK_TFLOPS = {"tpu_v3_32": 16 * 123.0,  # 16 chips (32 cores), bf16.
               "a100_x8": 8 * 156.0,     # TF32 dense.
               "h100_x8": 8 * 494.7,     # SXM, TF32 dense.
               "h100_x1": 494.7}
# vmoe configs/vmoe_paper/vmoe_s32_last2_ilsvrc2012_randaug_light1.py:
# "Pre-training takes about 5h50m on a TPUv3-32" (evaluations included) and
# "Fine-tuning takes about 48m on a TPUv3-8" (..._ft_ilsvrc2012.py: 10k steps
# of 1024 images at 384 px, cf 1.5, no pre-logits).
VMOE_S32_LAST2_HOURS_TPU_V3_32 = 5 + 50 / 60
VMOE_S32_LAST2_FT_384_HOURS_TPU_V3_8 = 48 / 60
TPU_V3_8_TFLOPS = 4 * 123.0
ASSUMPTIONS = (
    "FLOPs: XLA cost analysis (float32, CPU compile) of loss+backward per "
    "image; hours [slow, fast]: at the utilisations vmoe's reported times "
    "imply, 5h50m for V-MoE S/32 Last-2 from scratch on a TPU v3-32 (16 "
    "chips x 123 bf16 TFLOP/s, evaluations included) and 48m for its "
    "fine-tuning at 384 px on a TPU v3-8, applied to every device; GPUs at "
    "TF32 dense peak (A100 156, H100 SXM 494.7 TFLOP/s); memory: XLA CPU "
    "compile, float32, state replicated (no expert sharding); input "
    "pipeline not included (~190 images/s per host core, "
    "benchmarks/input_pipeline.py)")


def _cost(compiled) -> dict:
  cost = compiled.cost_analysis()
  return cost[0] if isinstance(cost, (list, tuple)) else cost


def _bytes(tree) -> int:
  return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree)))


def _images(batch: int) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct((batch, 224, 224, 3), jnp.float32)


def _labels(batch: int) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct((batch,), jnp.int32)


def _grad_bytes(model, params, collections) -> tuple[dict[int, int], float]:
  """Argument + temp bytes of the training-mode loss + backward compiled at
  batches `SMALL` and `LARGE`, and the FLOPs at `SMALL`."""

  def loss(p, s, x, y):
    logits, metrics = model.apply(
        {"params": p, **s}, x, deterministic=False,
        rngs={"gating": jax.random.key(1), "dropout": jax.random.key(2)})
    return jnp.mean(cross_entropy(logits, y)) + metrics["auxiliary_loss"]

  grad_bytes, flops = {}, 0.0
  for batch in (SMALL, LARGE):
    compiled = jax.jit(jax.grad(loss)).lower(
        params, collections, _images(batch), _labels(batch)).compile()
    memory = compiled.memory_analysis()
    grad_bytes[batch] = (memory.argument_size_in_bytes
                         + memory.temp_size_in_bytes)
    if batch == SMALL:
      flops = _cost(compiled)["flops"]
  return grad_bytes, flops


def measure(name: str, full: bool, remat: tuple[str, ...] = ()) -> dict:
  """The figures of one config (module docstring)."""
  start = time.perf_counter()
  file, _, arg = name.rpartition(":") if ":" in name else ("", "", name)
  config = load_config(file or "imagenet", arg)
  model = build_model(config.model.to_dict())
  variables = jax.eval_shape(model.init, jax.random.key(0),
                             _images(FORWARD))
  params = variables["params"]
  # Router state (Symphony's graph) as the model reads it; not trained here.
  collections = {k: v for k, v in variables.items() if k != "params"}
  flat = jax.tree_util.tree_flatten_with_path(params)[0]
  experts = sum(leaf.size for path, leaf in flat
                if "/Moe/Mlp/" in "/" + "/".join(
                    str(getattr(k, "key", k)) for k in path) + "/")
  optimizer = config.optimizer.to_dict()
  tx = make_optimizer(optimizer)
  opt_state = jax.eval_shape(tx.init, params)
  out = dict(params=int(sum(leaf.size for _, leaf in flat)),
             expert_params=int(experts), param_bytes=_bytes(params),
             opt_state_bytes=_bytes(opt_state))

  forward = jax.jit(lambda p, s, x: model.apply({"params": p, **s}, x)[0]
                    ).lower(params, collections, _images(FORWARD)).compile()
  out["forward_gflops_per_image"] = _cost(forward)["flops"] / FORWARD / 1e9

  grad_bytes, flops = _grad_bytes(model, params, collections)
  out["train_gflops_per_image"] = flops / SMALL / 1e9
  per_image = (grad_bytes[LARGE] - grad_bytes[SMALL]) / (LARGE - SMALL)
  out["activation_bytes_per_image"] = int(per_image)
  out["grad_step_fixed_bytes"] = int(grad_bytes[SMALL] - per_image * SMALL)
  for policy in remat:  # The same slope with `model.remat` set.
    rematted = build_model({**config.model.to_dict(), "remat": policy})
    remat_bytes, _ = _grad_bytes(rematted, params, collections)
    out[f"activation_bytes_per_image_remat_{policy}"] = int(
        (remat_bytes[LARGE] - remat_bytes[SMALL]) / (LARGE - SMALL))

  # The whole step holds the optimizer state and, with the NaN guard's
  # leaf-by-leaf select, a second copy of the updated params and moments;
  # without the full compile that extra is estimated as params + moments.
  extra = out["param_bytes"] + out["opt_state_bytes"]
  if full:
    mixup = config.train.get("mixup")
    step = make_train_step(
        model, label_smoothing=config.train.label_smoothing,
        learning_rate_fn=make_learning_rate(optimizer),
        mixup=mixup.to_dict() if mixup is not None else None)
    state = jax.eval_shape(lambda v: TrainState.create(
        v, tx, jax.random.key(1)), variables)
    compiled = jax.jit(step, donate_argnums=0).lower(
        state, {"image": _images(SMALL), "label": _labels(SMALL)}).compile()
    memory = compiled.memory_analysis()
    out["step_gflops_per_step"] = _cost(compiled)["flops"] / 1e9
    out["step_argument_bytes"] = int(memory.argument_size_in_bytes)
    out["step_temp_bytes"] = int(memory.temp_size_in_bytes)
    extra = (memory.argument_size_in_bytes + memory.temp_size_in_bytes
             - grad_bytes[SMALL])

  batch, steps = config.data.batch_size, config.train.total_steps
  fixed = out["grad_step_fixed_bytes"] + extra

  def device_bytes(devices: int) -> int:
    return int(fixed + per_image * batch / devices)

  out.update(batch=batch, total_steps=steps,
             device_bytes_one_device=device_bytes(1),
             device_bytes_dp8=device_bytes(8),
             device_bytes_dp32=device_bytes(32))
  out["train_exaflops"] = steps * batch * out["train_gflops_per_image"] / 1e9
  out["seconds"] = time.perf_counter() - start
  return out


def finetune_384_gflops() -> float:
  """Loss + backward GFLOPs per image of vmoe's S/32 Last-2 ILSVRC2012
  fine-tuning at 384 px (the `_ft` model at 145 tokens)."""
  model = load_config("imagenet", "vmoe_s32_last2_ft").model.to_dict()
  model["moe"]["group_size"] = 8 * ((384 // 32) ** 2 + 1)
  model = build_model(model)
  images = jax.ShapeDtypeStruct((SMALL, 384, 384, 3), jnp.float32)
  params = jax.eval_shape(model.init, jax.random.key(0), images)["params"]

  def loss(p, x, y):
    logits, metrics = model.apply(
        {"params": p}, x, deterministic=False,
        rngs={"gating": jax.random.key(1), "dropout": jax.random.key(2)})
    return jnp.mean(cross_entropy(logits, y)) + metrics["auxiliary_loss"]

  compiled = jax.jit(jax.grad(loss)).lower(params, images,
                                           _labels(SMALL)).compile()
  return _cost(compiled)["flops"] / SMALL / 1e9


def add_estimates(figures: dict) -> dict:
  """Wall-time estimates `[slow, fast]` from the utilisations vmoe's two
  reported times imply (the slow one needs vmoe_s32_last2 measured)."""
  reference = figures.get("vmoe_s32_last2")
  if reference is None:
    return {}
  slow = (reference["train_exaflops"] * 1e18
          / (VMOE_S32_LAST2_HOURS_TPU_V3_32 * 3600
             * PEAK_TFLOPS["tpu_v3_32"] * 1e12))
  ft_gflops = finetune_384_gflops()
  fast = (10_000 * 1024 * ft_gflops * 1e9
          / (VMOE_S32_LAST2_FT_384_HOURS_TPU_V3_8 * 3600
             * TPU_V3_8_TFLOPS * 1e12))
  for values in figures.values():
    for device, peak in PEAK_TFLOPS.items():
      values[f"hours_{device}"] = [
          values["train_exaflops"] * 1e18 / (u * peak * 1e12) / 3600
          for u in (slow, fast)]
  return {"implied_utilisation": [slow, fast],
          "finetune_384_gflops_per_image": ft_gflops}


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true",
                      help="skip the whole-train-step compiles")
  parser.add_argument("--remat", default=",".join(REMAT),
                      help="comma-separated model.remat policies whose "
                      "activation bytes per image to measure too (empty: "
                      "none)")
  parser.add_argument("--configs", default=";".join(CONFIGS),
                      help="semicolon-separated models: a name of "
                      "configs/imagenet.py or swin_moe_imagenet:ARG")
  args = parser.parse_args(argv)
  figures = {}
  for name in args.configs.split(";"):
    figures[name] = measure(name, full=not args.quick,
                            remat=tuple(filter(None, args.remat.split(","))))
    f = figures[name]
    gib = lambda key: f[key] / 2**30  # pylint: disable=cell-var-from-loop
    print(f"{name}: {f['params'] / 1e6:.2f} M params "
          f"({f['expert_params'] / 1e6:.2f} M in experts), forward "
          f"{f['forward_gflops_per_image']:.2f} GFLOP/image, train "
          f"{f['train_gflops_per_image']:.2f} GFLOP/image, "
          f"{f['train_exaflops']:.2f} EFLOP in {f['total_steps']} steps of "
          f"{f['batch']}; activations "
          f"{f['activation_bytes_per_image'] / 2**20:.1f} MiB/image ("
          + ", ".join(f"remat {k[len(REMAT_KEY):]} {v / 2**20:.1f}"
                      for k, v in f.items() if k.startswith(REMAT_KEY))
          + "); one "
          f"device {gib('device_bytes_one_device'):.1f} GiB, 8-way "
          f"{gib('device_bytes_dp8'):.1f} GiB ({f['seconds']:.0f} s)",
          flush=True)
  extra = add_estimates(figures)
  for name, f in figures.items():
    if "hours_tpu_v3_32" in f:
      print(f"{name}: est. hours (slow-fast): " + ", ".join(
          f"{f[f'hours_{d}'][0]:.1f}-{f[f'hours_{d}'][1]:.1f} {d}"
          for d in PEAK_TFLOPS))
  if extra:
    print("implied utilisation (slow, fast): "
          f"{extra['implied_utilisation'][0]:.3f}, "
          f"{extra['implied_utilisation'][1]:.3f}")
  result = dict(quick=args.quick, machine=machine(), assumptions=ASSUMPTIONS,
                configs=figures, **extra)
  print_json_last(result)
  return result


if __name__ == "__main__":
  main()
