"""Stream overhead: a full V-MoE train step with each momentum stream vs plain.

    python benchmarks/stream_overhead.py [--quick] [--repeats N]

Issue "MomentumSMoE family", Targets. The V-MoE of `router_overhead.py`
(its `shapes`, `model_config`, `OPTIMIZER` and `STEPS`): B*T = 2,048 tokens
(B = 32 images of 32x32x3, patch 4: T = 64 tokens, GAP classifier),
D = 384, H = 1,536, E = 8, K = 2, 4 blocks with MoE in blocks 1 and 3,
cf 1.25, one routing group per 8 images, router noisy top-2 in every
candidate — trained by the project's jitted, donated step
(`vmoe_ext.train.steps.make_train_step`: forward, backward, AdamW update,
NaN guard) with each residual stream (`model.stream`, `vmoe_ext.streams`):

* baseline         `plain`: `x + f(x)` in every block;
* momentum         heavy-ball, mu = 0.8, gamma = 1 (the authors' V-MoE
                   config), layout `vmoe_reference`;
* adam             AdamSMoE, paper form (an Adam step in MoE block 1,
                   heavy-ball in block 3), `vmoe_reference`;
* robust_momentum  robust momentum, p = 0.2, k = 1.25 (the MoE evaluated at
                   an extrapolated point; dense blocks' MLP input shifted
                   too), `vmoe_reference`;
* momentum_paper, adam_paper, robust_momentum_paper: the same with
                   `layout="paper"`: the update on the MoE blocks only, no
                   extra LayerNorm, so the step differs from plain by the
                   momentum update alone;
* layout_only      (information) heavy-ball with mu = 0 in the
                   `vmoe_reference` layout: `LN_2(x - u)` in MoE blocks,
                   `LN_2(x + Mlp)` in dense ones, i.e. that layout's
                   architecture (a post-LayerNorm `LayerNorm_2` in each of
                   the 4 blocks) without momentum.

The `vmoe_reference` layout is a different architecture from the plain
V-MoE (one more LayerNorm per block, forward and backward), so its figures
are "the authors' model vs ours"; the `_paper` figures and
`momentum - layout_only` are the momentum update's own cost.

Each candidate's step is compiled once (ahead of time, state donated) and
its XLA FLOP count read from that executable
(`common.compile_train_steps`). Timing is `common.time_train_steps`:
`common.time_side_by_side`, interleaved rounds, median of `--repeats`, after
one warm-up; one sample is `STEPS` consecutive steps of the candidate's own
state, carried over from sample to sample (no state copy in the timed
region). The last line is one JSON object with `momentum_overhead`,
`adam_overhead`, `robust_momentum_overhead` = step time / plain - 1 (target
<= 0.02 each; the paper calls the cost negligible), the same for the
`_paper` variants and `layout_only`, the ms per step of each and the XLA
FLOPs of each step relative to plain (`*_flops_overhead`, noise-free).
`control_overhead` is an A/A control: the baseline's executable timed again
as one more candidate on its own copy of the state, so its deviation from 0
is the timing noise of the run.

`--quick`: B*T = 256 tokens (16 images of 16x16x3, T = 16), D = 64, H = 256,
E = 8, 5 steps per sample, for a smoke run; there the streams' elementwise
ops and LayerNorms are a larger share of a much smaller step.
"""

from __future__ import annotations

import os
import sys


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (compile_train_steps, image_batch,  # noqa: E402
                    machine, overhead_figures, parse_args, print_json_last, time_train_steps)
from router_overhead import (OPTIMIZER, ROUTERS, STEPS,  # noqa: E402
                             model_config, shapes)

PAPER = {"layout": "paper"}
MOMENTUM = {"name": "momentum", "mu": 0.8, "gamma": 1.0}
ADAM = {"name": "adam"}
ROBUST = {"name": "robust_momentum"}
STREAMS = {
    "baseline": {"name": "plain"},
    "momentum": MOMENTUM,
    "adam": ADAM,
    "robust_momentum": ROBUST,
    "momentum_paper": {**MOMENTUM, **PAPER},
    "adam_paper": {**ADAM, **PAPER},
    "robust_momentum_paper": {**ROBUST, **PAPER},
    "layout_only": {"name": "momentum", "mu": 0.0, "gamma": 1.0},
}
ROUTER = ROUTERS["baseline"]  # Noisy top-2 in every candidate.
TARGET = 0.02  # Step time / plain - 1, for the three streams of the issue.
TARGETED = ("momentum", "adam", "robust_momentum")


def main(argv=None) -> dict:
  args = parse_args(__doc__.splitlines()[0], argv)
  s = shapes(args.quick)
  steps = STEPS // 2 if args.quick else STEPS
  repeats = max(3, args.repeats)
  batch = image_batch(s["batch"], s["image"])
  steps_fns, states, flops = compile_train_steps(
      {name: dict(model_config(ROUTER, s), stream=stream)
       for name, stream in STREAMS.items()}, batch, OPTIMIZER)
  # A/A control: the baseline's executable again on its own copy of the
  # state; its "overhead" is the timing noise of this run.
  ms, load, skipped = time_train_steps(steps_fns, states, batch, steps,
                                       repeats, control="baseline")
  print(f"machine: {machine()}")
  print(f"B*T = {s['batch'] * (s['image'] // 4)**2} tokens, D={s['hidden']}, "
        f"H={s['mlp']}, E={s['experts']}, K=2 noisy top-k, MoE blocks 1 and "
        f"3; {steps} steps per sample, median of {repeats}; non-finite steps "
        f"skipped: {skipped}; load average {load[0]:.2f} -> {load[1]:.2f}")
  for name in STREAMS:
    target = ""
    if name in TARGETED:
      met = ms[name] / ms["baseline"] - 1 <= TARGET
      target = f"  target <= {TARGET:.0%}: {'met' if met else 'MISSED'}"
    more_flops = flops[name] / flops["baseline"] - 1
    print(f"{name:<22}{ms[name]:>10.2f} ms/step  "
          f"{flops[name] / 1e9:>8.3f} GFLOPs ({more_flops:+.4%})  "
          f"{ms[name] / ms['baseline'] - 1:+7.2%} vs plain{target}")
  print(f"{'control':<22}{ms['control']:>10.2f} ms/step  (baseline again: "
        f"noise {ms['control'] / ms['baseline'] - 1:+.2%})")
  print(f"momentum update within the vmoe_reference layout: momentum / "
        f"layout_only - 1 = {ms['momentum'] / ms['layout_only'] - 1:+.2%}")
  figures = overhead_figures(
      args.quick, load, ms, flops,
      {n: "baseline" for n in STREAMS if n != "baseline"})
  figures["target"] = TARGET
  figures["momentum_vs_layout_only"] = ms["momentum"] / ms["layout_only"] - 1
  figures["targets_met"] = {n: figures[f"{n}_overhead"] <= TARGET
                            for n in TARGETED}
  print_json_last(figures)
  return figures


if __name__ == "__main__":
  main()
