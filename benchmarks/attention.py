"""Forward+backward of one attention layer: `model.attention` plain vs fused.

    python benchmarks/attention.py [--quick] [--repeats N]

Two layers, each timed with every `model.attention` value the backend runs,
side by side in one process (median of the interleaved repetitions after
warm-up), each computing the gradient of a scalar loss w.r.t. the layer's
input and all its parameters:

* vit   the ViT/V-MoE encoder block's attention (flax's
        `MultiHeadDotProductAttention` with the option's `attention_fn`),
        ViT-S/16 shapes: batch 8, T = 197 tokens, D = 384, 6 heads;
* swin  Swin's `WindowAttention` with the shifted-window mask and the
        position table, Swin-S stage 0 shapes: batch 8, a 56 x 56 grid in
        7 x 7 windows (512 windows of N = 49), C = 96, 3 heads.

Candidates: "plain" and "fused" in float32; on a GPU also "plain", "fused"
and "cudnn" in bfloat16 (cuDNN's flash attention needs half precision; the
Swin layer only where its window token count is even). `--quick` shrinks
every shape. Per candidate: milliseconds per step, XLA's FLOPs and the
temporary bytes XLA plans for the compiled step. The last line printed is
one JSON object with the figures.
"""

from __future__ import annotations

import os
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (  # noqa: E402
    machine, parse_args, print_json_last, time_side_by_side, xla_flops)

from vmoe_ext.models.attention import flax_attention_fn  # noqa: E402
from vmoe_ext.models.swin_attention import WindowAttention  # noqa: E402
from vmoe_ext.models.swin_window import shift_attention_mask  # noqa: E402

FULL = dict(batch=8, tokens=197, d=384, heads=6,
            grid=56, window=7, c=96, swin_heads=3)
QUICK = dict(batch=2, tokens=65, d=64, heads=4,
             grid=8, window=4, c=16, swin_heads=2)


def vit_layer(shape, attention: str, dtype) -> tuple[nn.Module, tuple]:
  module = nn.MultiHeadDotProductAttention(
      num_heads=shape["heads"], attention_fn=flax_attention_fn(attention),
      deterministic=True, dtype=dtype)
  x = jax.random.normal(jax.random.key(0),
                        (shape["batch"], shape["tokens"], shape["d"]))
  return module, (x,)


def swin_layer(shape, attention: str, dtype) -> tuple[nn.Module, tuple]:
  g, m = shape["grid"], shape["window"]
  module = WindowAttention(shape["swin_heads"], m, dtype=dtype,
                           attention=attention)
  windows = shape["batch"] * (g // m) ** 2
  x = jax.random.normal(jax.random.key(0), (windows, m * m, shape["c"]))
  return module, (x, jnp.asarray(shift_attention_mask(g, g, m, m // 2)))


def make_step(module: nn.Module, args: tuple):
  """Jitted loss, grads w.r.t. params and the input, and its arguments."""
  x, *rest = args
  params = module.init(jax.random.key(1), x, *rest)["params"]
  cot = jax.random.normal(jax.random.key(2), x.shape)

  def loss(p, x):
    y = module.apply({"params": p}, x, *rest) if rest else module.apply(
        {"params": p}, x, x)
    return jnp.sum(y.astype(jnp.float32) * cot)

  fn = jax.value_and_grad(loss, argnums=(0, 1))
  return jax.jit(fn), (params, x)


def candidates(shape) -> dict[str, tuple]:
  out = {}
  gpu = jax.default_backend() == "gpu"
  for layer, build in (("vit", vit_layer), ("swin", swin_layer)):
    out[f"{layer}_plain"] = build(shape, "plain", jnp.float32)
    out[f"{layer}_fused"] = build(shape, "fused", jnp.float32)
    if gpu:
      for attention in ("plain", "fused", "cudnn"):
        if attention == "cudnn" and layer == "swin" and (
            shape["window"] ** 2) % 2:
          continue
        out[f"{layer}_{attention}_bf16"] = build(shape, attention,
                                                 jnp.bfloat16)
  return out


def main(argv=None) -> dict:
  args = parse_args(__doc__.splitlines()[0], argv)
  shape = QUICK if args.quick else FULL
  steps = {name: make_step(*spec) for name, spec in candidates(shape).items()}
  figures = {"quick": bool(args.quick), "machine": machine(), **shape}
  for name, (fn, fn_args) in steps.items():
    compiled = fn.lower(*fn_args).compile()
    memory = compiled.memory_analysis()
    figures[f"{name}_gflops"] = xla_flops(fn, *fn_args) / 1e9
    if memory is not None:
      figures[f"{name}_temp_mib"] = memory.temp_size_in_bytes / 2 ** 20
  seconds = time_side_by_side(
      {name: (lambda fn=fn, a=fn_args: fn(*a))
       for name, (fn, fn_args) in steps.items()}, args.repeats)
  for name, s in seconds.items():
    figures[f"{name}_ms"] = 1e3 * s
  for layer in ("vit", "swin"):
    figures[f"{layer}_fused_over_plain"] = (
        seconds[f"{layer}_fused"] / seconds[f"{layer}_plain"])
    for attention in ("fused", "cudnn"):
      name = f"{layer}_{attention}_bf16"
      if name in seconds:
        figures[f"{name}_over_plain_bf16"] = (
            seconds[name] / seconds[f"{layer}_plain_bf16"])
  for name, value in figures.items():
    if name.endswith("_ms") or name.endswith("_over_plain"):
      print(f"{name:28s} {value:10.3f}")
  print_json_last({k: (float(v) if isinstance(v, (np.floating,)) else v)
                   for k, v in figures.items()})
  return figures


if __name__ == "__main__":
  main()
