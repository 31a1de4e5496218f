"""MomentumSMoE residual streams vs the plain residual on MNIST-5k.

    python experiments/momentum_vs_vmoe.py [--seeds 0 1 2] [--root runs/exp]
        [--only KEY ...]

The paper (MomentumSMoE, Teo & Nguyen, NeurIPS 2024, Tables 2, 3 and 10)
claims that on ImageNet-1K MomentumV-MoE and Robust MomentumV-MoE gain
marginally on clean accuracy but by 1% or more on ImageNet-R, -A and -C,
with Robust MomentumV-MoE reducing the mean corruption error (mCE) by about
2 points; and that Momentum-SoftMoE gains about 2% clean top-1 over SoftMoE.

Here, five candidates, each the default MNIST V-MoE job of
`configs/default.py` (2,500 steps; every other hyper-parameter shared,
nothing tuned on the test split):

* `default`: V-MoE with the plain residual (`configs/default.py`);
* `momentum_heavy_ball`: `configs/momentum.py:heavy_ball` (mu 0.8, gamma 1);
* `momentum_robust`: `configs/momentum.py:robust` (p 0.2, k 1.25, L 1);
* `soft_moe`: SoftMoE with the plain residual (`configs/soft_moe.py`);
* `momentum_heavy_ball_soft`: `configs/momentum.py:heavy_ball,soft`.

The momentum candidates use the `vmoe_reference` layout (the authors' V-MoE
code: a post-LayerNorm in every block and the MoE output subtracted;
docs/streams.md), so they differ from the plain baselines by that layout as
well as by the momentum, as in the paper's comparison. The evaluation is
symphony_vs_vmoe.py's (`common.config_for`): routing analysis, FGSM and
10-step PGD (random start) at eps 0.05 on 500 test images, the 15 local
corruptions at 5 severities on 500 test images; clean accuracy on all 1,000.
Each run goes into ROOT/r_{KEY}_{seed} (a finished run is reused, an
interrupted one resumed; `r_default_{seed}` is shared with
symphony_vs_vmoe.py, whose config it is). `--only` restricts to some KEYs
(e.g. to train two processes side by side). Writes ROOT/momentum_vs_vmoe.md:
mean ± std over seeds, per-seed values and each run's wall time.
"""

from __future__ import annotations

import os
import re

from common import (config_for, figures_table, parse_seeds_and_root,
                    train_or_reuse, write_report)

# key (run folder name): (label, config file, config argument)
CONFIGS = {
    "default": ("V-MoE (plain residual)", "default", None),
    "momentum_heavy_ball": (
        "MomentumV-MoE (heavy-ball, mu 0.8, vmoe_reference)", "momentum",
        "heavy_ball"),
    "momentum_robust": (
        "Robust MomentumV-MoE (p 0.2, k 1.25, vmoe_reference)", "momentum",
        "robust"),
    "soft_moe": ("SoftMoE (plain residual)", "soft_moe", None),
    "momentum_heavy_ball_soft": (
        "Momentum-SoftMoE (heavy-ball, vmoe_reference)", "momentum",
        "heavy_ball,soft"),
}


def wall_seconds(workdir: str) -> float:
  """The training wall time recorded in the run's report.md (NaN if none)."""
  text = open(os.path.join(workdir, "report.md")).read()
  match = re.search(r"Wall time: ([0-9.]+) s", text)
  return float(match.group(1)) if match else float("nan")


def main(argv=None) -> str:
  def add_only(parser):
    parser.add_argument("--only", nargs="+", choices=sorted(CONFIGS),
                        default=list(CONFIGS), metavar="KEY",
                        help="train / report only these candidates")
  args = parse_seeds_and_root(__doc__.splitlines()[0], argv, add_only)
  keys = [k for k in CONFIGS if k in args.only]
  results, walls = {}, {}
  for key in keys:
    label, name, arg = CONFIGS[key]
    for seed in args.seeds:
      workdir = os.path.join(args.root, f"r_{key}_{seed}")
      results[label, seed] = train_or_reuse(
          lambda: config_for(name, seed, arg), workdir)
      walls[label, seed] = wall_seconds(workdir)
  labels = [CONFIGS[k][0] for k in keys]
  lines = ["# MomentumSMoE streams vs the plain residual (MNIST-5k)", "",
           f"Seeds {args.seeds}; mean ± std (sample std) over seeds. "
           "FGSM / PGD (10 steps) at eps 0.05 and the corruption suite on "
           "500 test images; accuracy on all 1,000. Momentum candidates in "
           "the vmoe_reference layout.", ""]
  lines += figures_table(labels, args.seeds, results)
  lines += ["", "Training wall time per run (s, as recorded in report.md; "
            "runs may have shared the CPU):", ""]
  for label in labels:
    lines.append(f"- {label}: " + ", ".join(
        f"seed {s} {walls[label, s]:.0f}" for s in args.seeds))
  return write_report(args.root, "momentum_vs_vmoe.md", lines)


if __name__ == "__main__":
  main()
