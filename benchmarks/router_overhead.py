"""Router overhead: a full V-MoE train step with each new router vs noisy top-k.

    python benchmarks/router_overhead.py [--quick] [--repeats N]

Issue "ACMoE, XMoE cosine and top-p", Targets. One V-MoE — B*T = 2,048
tokens (B = 32 images of 32x32x3, patch 4: T = 64 tokens, GAP classifier),
D = 384, H = 1,536, E = 8, K = 2, 4 blocks with MoE in blocks 1 and 3,
cf 1.25, one routing group per 8 images — trained by the project's jitted,
donated step (`vmoe_ext.train.steps.make_train_step`: forward, backward,
AdamW update, NaN guard) with each router:

* baseline  `noisy_topk`, top-2 (V-MoE);
* xmoe      `cosine` (projection to 16, learnable temperature), top-2;
* acmoe     `acmoe` `swin` preset over noisy top-2: the AC transform (MAD
            statistics of the whole batch, clamp, scaled tokens to the router
            and the experts) in block 3, the plain base router in block 1;
* topp      `top_p` p = 0.05, cap 2 (the cap sets the expert buffers, so the
            expert compute equals top-2's and the figure is the router's);
* symphony  `symphony` over noisy top-2 (issue "Symphony router"): top-2 of
            `A softmax(l)` and the graph update (co-selection counts,
            row-normalisation, EMA) in both MoE layers, every step;
* acmoe_symphony  `symphony` over the `acmoe` candidate above.

Each candidate's step is compiled once (ahead of time, state donated) and
its XLA FLOP count read from that executable. Timing is
`common.time_side_by_side`: interleaved rounds, median of `--repeats`, after
one warm-up; one sample is `STEPS` consecutive steps of the candidate's own
state, carried over from sample to sample (no state copy in the timed
region; the shapes are static, so the cost does not depend on the values).
The last line is one JSON object with `acmoe_overhead`, `xmoe_overhead`,
`topp_overhead`, `symphony_overhead` = step time / baseline - 1 (target
<= 0.02 each; the ACMoE paper reports about 0.01, the Symphony paper < 0.01)
and `acmoe_symphony_overhead` = acmoe_symphony / acmoe - 1 (Symphony's cost
on top of ACMoE; `acmoe_symphony_vs_baseline` is its ratio to the
baseline), the ms per step of each and the XLA FLOPs of each
step relative to the baseline (`*_flops_overhead`, noise-free).
`control_overhead` is an A/A control: the baseline's executable timed again
as one more candidate on its own copy of the state, so its deviation from 0
is the timing noise of the run. `ac_transform_ms` / `ac_transform_mflops`:
ACMoE's AC transform (`adaptive_clustering.adaptive_scales`, the router's
one addition to the step besides a multiply) jitted and timed alone at the
candidate's shape, and `ac_transform_share` its time over the baseline
step's.

`--quick`: B*T = 256 tokens (16 images of 16x16x3, T = 16), D = 64, H = 256,
E = 8, 5 steps per sample, for a smoke run; there the fixed per-op costs of
the routers are not amortised and the overheads are larger.
"""

from __future__ import annotations

import os
import sys

import jax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (compile_train_steps, image_batch,  # noqa: E402
                    machine, overhead_figures, parse_args,
                    print_json_last, time_side_by_side, time_train_steps,
                    xla_flops)

ACMOE = {"name": "acmoe", "normalization": "swin",
         "base": {"name": "noisy_topk", "num_selected": 2}}
ROUTERS = {
    "baseline": {"name": "noisy_topk", "num_selected": 2},
    "xmoe": {"name": "cosine", "num_selected": 2},
    "acmoe": ACMOE,
    "topp": {"name": "top_p", "num_selected": 2, "threshold": 0.05,
             "load_loss_weight": 0.0},
    "symphony": {"name": "symphony",
                 "base": {"name": "noisy_topk", "num_selected": 2}},
    "acmoe_symphony": {"name": "symphony", "base": ACMOE},
}
# Candidate -> the step it is compared with (default: the baseline).
REFERENCE = {"acmoe_symphony": "acmoe"}
STEPS = 10  # Train steps per timed sample (5 with --quick).
OPTIMIZER = {"name": "adamw", "learning_rate": 1e-3, "warmup_steps": 0,
             "decay": "cosine", "total_steps": 10_000, "weight_decay": 1e-4,
             "weight_decay_mask": "no_bias_norm", "clip_global_norm": 1.0}


def shapes(quick: bool) -> dict:
  if quick:  # B*T = 256 tokens, D = 64, H = 256, E = 8.
    return dict(batch=16, image=16, hidden=64, mlp=256, heads=4, experts=8)
  return dict(batch=32, image=32, hidden=384, mlp=1536, heads=6, experts=8)


def model_config(router: dict, s: dict) -> dict:
  tokens_per_image = (s["image"] // 4)**2
  return dict(name="vit_moe", num_classes=10, patch_size=(4, 4),
              hidden_size=s["hidden"], num_layers=4, num_heads=s["heads"],
              mlp_dim=s["mlp"], classifier="gap",
              moe=dict(layers=(1, 3), num_experts=s["experts"],
                       capacity_factor=1.25, group_size=8 * tokens_per_image,
                       router=router))


def ac_transform(s: dict, repeats: int) -> tuple[float, float]:
  """(ms, FLOPs) of ACMoE's `swin` AC transform alone, jitted: the scales
  `adaptive_scales` of the candidate's block 3 (N = B*T tokens of width D,
  E clusters, the previous layer's top-2) on random tokens; forward only
  (the statistics are under stop-gradient)."""
  import jax.numpy as jnp
  import numpy as np

  from vmoe_ext.routers import adaptive_clustering as ac

  n, d, e = s["batch"] * (s["image"] // 4)**2, s["hidden"], s["experts"]
  rng = np.random.default_rng(0)
  args = (jnp.asarray(rng.normal(size=(n, d)), jnp.float32),
          jnp.asarray(rng.integers(0, e, (n, 2)), jnp.int32),
          jnp.asarray(rng.random((n, 2)), jnp.float32),
          jnp.ones((n, 2), bool))
  opts = ac.resolve_options("swin")
  fn = jax.jit(lambda *a: ac.adaptive_scales(*a, num_clusters=e, opts=opts))
  seconds = time_side_by_side({"ac": lambda: fn(*args)}, 10 * repeats)
  return seconds["ac"] * 1e3, xla_flops(fn, *args)


def main(argv=None) -> dict:
  args = parse_args(__doc__.splitlines()[0], argv)
  s = shapes(args.quick)
  steps = STEPS // 2 if args.quick else STEPS
  repeats = max(3, args.repeats)
  batch = image_batch(s["batch"], s["image"])
  steps_fns, states, flops = compile_train_steps(
      {name: model_config(router, s) for name, router in ROUTERS.items()},
      batch, OPTIMIZER)
  # A/A control: the baseline's executable again on its own copy of the
  # state; its "overhead" is the timing noise of this run.
  ms, load, skipped = time_train_steps(steps_fns, states, batch, steps,
                                       repeats, control="baseline")
  print(f"machine: {machine()}")
  print(f"B*T = {s['batch'] * (s['image'] // 4)**2} tokens, D={s['hidden']}, "
        f"H={s['mlp']}, E={s['experts']}, K=2, MoE blocks 1 and 3; {steps} "
        f"steps per sample, median of {repeats}; non-finite steps "
        f"skipped: {skipped}; load average {load[0]:.2f} -> {load[1]:.2f}")
  for name in ROUTERS:
    ref = REFERENCE.get(name, "baseline")
    print(f"{name:<15}{ms[name]:>10.2f} ms/step  "
          f"{flops[name] / 1e9:>8.2f} GFLOPs  "
          f"{ms[name] / ms[ref] - 1:+7.2%} vs {ref}")
  print(f"{'control':<15}{ms['control']:>10.2f} ms/step  (baseline again: "
        f"noise {ms['control'] / ms['baseline'] - 1:+.2%})")
  figures = overhead_figures(
      args.quick, load, ms, flops,
      {n: REFERENCE.get(n, "baseline")
       for n in ("acmoe", "xmoe", "topp", "symphony", "acmoe_symphony")})
  figures["acmoe_symphony_vs_baseline"] = (ms["acmoe_symphony"]
                                           / ms["baseline"] - 1)
  ac_ms, ac_flops = ac_transform(s, repeats)
  figures.update(ac_transform_ms=ac_ms, ac_transform_mflops=ac_flops / 1e6,
                 ac_transform_share=ac_ms / ms["baseline"])
  print(f"ACMoE's AC transform alone: {ac_ms:.3f} ms, "
        f"{ac_flops / 1e6:.1f} MFLOP ({ac_ms / ms['baseline']:.3%} of the "
        "baseline step)")
  print_json_last(figures)
  return figures


if __name__ == "__main__":
  main()
