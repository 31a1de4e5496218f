"""Compile time of the train step, unrolled blocks vs `model.scan`.

    python benchmarks/compile_time.py [--quick] [--backbone vit|swin]

Issue 48 (deliverable 3). A deep, narrow V-MoE (every second block an MoE
layer, V-MoE Every-2; tiny width so that compilation, not the program's
size, dominates) or, with `--backbone swin`, a narrow Swin-MoE whose third
stage has the depth (Swin-S's deep stage: every second block MoE, 2 + 2 +
depth + 2 blocks in all, the first two and the last stage unrolled since a
2-block stage is no repeated period) is built twice: with its blocks unrolled (`model.scan`
False, today's layout) and with them applied by one `nn.scan` over periods
of (dense, MoE) blocks (`vmoe_ext.models.stack`). For each depth, the
project's whole train step (`make_train_step`: forward, backward, AdamW
update, NaN guard; state donated) is lowered and compiled ahead of time on
abstract shapes, each with a fresh jit and the persistent compilation cache
off (after one untimed warm-up compile of a 2-block model), and timed (`lower_s`: tracing + lowering, `compile_s`: XLA); the
median of `--repeats` compiles per candidate, interleaved. Also
`remat="full"` with scan, which the deep configs on a GPU would use.

The last line printed is one JSON object: per depth and candidate
`{depth}_{candidate}_lower_s` / `_compile_s` / `_total_s`, and
`{depth}_scan_speedup` (unrolled total / scanned total).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import machine, print_json_last  # noqa: E402

from vmoe_ext.models import build_model  # noqa: E402
from vmoe_ext.train.optimizer import (make_learning_rate,  # noqa: E402
                                      make_optimizer)
from vmoe_ext.train.state import TrainState  # noqa: E402
from vmoe_ext.train.steps import make_train_step  # noqa: E402

OPTIMIZER = {"name": "adamw", "learning_rate": 1e-3, "warmup_steps": 0,
             "decay": "cosine", "total_steps": 10_000, "weight_decay": 1e-4,
             "clip_global_norm": 1.0}
CANDIDATES = {"unrolled": {}, "scan": {"scan": True},
              "scan_remat": {"scan": True, "remat": "full"}}


def model_config(depth: int, **fields) -> dict:
  return dict(name="vit_moe", num_classes=10, patch_size=(4, 4),
              hidden_size=32, num_layers=depth, num_heads=2, mlp_dim=64,
              classifier="gap",
              moe=dict(every=2, num_experts=4,
                       router={"name": "noisy_topk", "num_selected": 2}),
              **fields)


def swin_config(depth: int, **fields) -> dict:
  """A narrow Swin-MoE on 32 x 32 images (patch 2: stage grids 16, 8, 4, 2,
  windows of 4), stage 2 of `depth` blocks, every second one MoE."""
  return dict(name="swin_moe", num_classes=10, patch_size=(2, 2),
              embed_dim=16, depths=(2, 2, depth, 2), num_heads=(2, 2, 2, 2),
              window_size=4, mlp_ratio=2.0, drop_path_rate=0.1,
              moe_blocks=((-1,), (-1,), tuple(range(1, depth, 2)), (1,)),
              moe=dict(num_experts=4, group_size=None, router=dict(
                  name="swin_moe", num_selected=2, gate_noise=1.0)),
              **fields)


BACKBONES = {"vit": (model_config, 16), "swin": (swin_config, 32)}


def compile_seconds(config: dict, batch: int, image: int = 16
                    ) -> tuple[float, float]:
  """`(lower_s, compile_s)` of one fresh train-step compile."""
  model = build_model(config)
  tx = make_optimizer(dict(OPTIMIZER))
  images = jax.ShapeDtypeStruct((batch, image, image, 3), jnp.float32)
  variables = jax.eval_shape(model.init, jax.random.key(0), images)
  state = jax.eval_shape(
      lambda v: TrainState.create(v, tx, jax.random.key(1)), variables)
  data = {"image": images,
          "label": jax.ShapeDtypeStruct((batch,), jnp.int32)}
  step = make_train_step(model,
                         learning_rate_fn=make_learning_rate(OPTIMIZER))
  start = time.perf_counter()
  lowered = jax.jit(step, donate_argnums=0).lower(state, data)
  lowered_at = time.perf_counter()
  lowered.compile()
  return lowered_at - start, time.perf_counter() - lowered_at


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true",
                      help="depths 8 and 24, one compile per candidate")
  parser.add_argument("--repeats", type=int, default=3,
                      help="interleaved compiles per candidate (median)")
  parser.add_argument("--backbone", choices=tuple(BACKBONES), default="vit")
  args = parser.parse_args(argv)
  config_of, image = BACKBONES[args.backbone]
  jax.config.update("jax_enable_compilation_cache", False)
  depths = (8, 24) if args.quick else (12, 24, 48)
  repeats = 1 if args.quick else max(1, min(args.repeats, 3))
  batch = 8
  figures: dict = {"quick": args.quick, "backbone": args.backbone,
                   "machine": machine(), "depths": list(depths),
                   "repeats": repeats,
                   "load_average": list(os.getloadavg())}
  compile_seconds(config_of(2), batch, image)  # Warm-up, not reported.
  for depth in depths:
    samples = {name: [] for name in CANDIDATES}
    for _ in range(repeats):
      for name, fields in CANDIDATES.items():
        samples[name].append(compile_seconds(config_of(depth, **fields),
                                             batch, image))
    for name, runs in samples.items():
      lower = statistics.median(r[0] for r in runs)
      comp = statistics.median(r[1] for r in runs)
      figures[f"{depth}_{name}_lower_s"] = lower
      figures[f"{depth}_{name}_compile_s"] = comp
      figures[f"{depth}_{name}_total_s"] = lower + comp
    figures[f"{depth}_scan_speedup"] = (figures[f"{depth}_unrolled_total_s"]
                                        / figures[f"{depth}_scan_total_s"])
    print(f"{depth} blocks: " + ", ".join(
        f"{name} {figures[f'{depth}_{name}_lower_s']:.1f} s lower + "
        f"{figures[f'{depth}_{name}_compile_s']:.1f} s compile"
        for name in CANDIDATES), flush=True)
  print(f"machine: {machine()}")
  print_json_last(figures)
  return figures


if __name__ == "__main__":
  main()
