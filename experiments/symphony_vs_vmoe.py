"""Symphony router vs the V-MoE router on MNIST-5k (Symphony, Tables 6 and 8).

    python experiments/symphony_vs_vmoe.py [--seeds 0 1 2] [--root runs/exp]

The paper's claim: swapping an SMoE's router for the Symphony router (same
base gating, the graph of Algorithm 1 with beta 0.9, zero init) improves
clean accuracy and, more, robustness to contaminated inputs. Here: the
default V-MoE (`configs/default.py`, noisy top-2 over E = 4) against the
same model with `configs/symphony.py` (Symphony over that router), every
other hyper-parameter shared and nothing tuned on the test split. For each
seed, training and the binary's after-training evaluation (routing analysis;
FGSM and 10-step PGD (random start) at eps 0.05 on 500 test images, as
the default job; the 15 local
corruptions at 5 severities on 500 test images), each into
ROOT/r_{config}_{seed} (a finished run there is reused, an interrupted one
resumed). Writes ROOT/symphony_vs_vmoe.md: mean ± std over seeds.
"""

from __future__ import annotations

import os

from common import (config_for, figures_table, parse_seeds_and_root,
                    train_or_reuse, write_report)

CONFIGS = {"V-MoE (noisy top-2)": "default",
           "Symphony over noisy top-2": "symphony"}


def main(argv=None) -> str:
  args = parse_seeds_and_root(__doc__.splitlines()[0], argv)
  results = {}
  for label, name in CONFIGS.items():
    for seed in args.seeds:
      workdir = os.path.join(args.root, f"r_{name}_{seed}")
      results[label, seed] = train_or_reuse(
          lambda: config_for(name, seed), workdir)
  lines = ["# Symphony vs V-MoE router (MNIST-5k)", "",
           f"Seeds {args.seeds}; mean ± std (sample std) over seeds. "
           "FGSM / PGD (10 steps) at eps 0.05 and the corruption suite on "
           "500 test images; accuracy on all 1,000.", ""]
  lines += figures_table(list(CONFIGS), args.seeds, results)
  return write_report(args.root, "symphony_vs_vmoe.md", lines)


if __name__ == "__main__":
  main()
