"""MomentumSMoE's negative and complex momentum (appendix E.4) on the V-MoE.

    python experiments/momentum_negative_complex.py [--seeds 0 1 2]
        [--root runs/repro] [--regimes default low_data] [--jobs 2] [--quick]

The paper's Table 9 (language modelling) reports heavy-ball momentum with a
negative coefficient and complex momentum (the best of its Table 9, also
the most robust to its attacked test set). Here each on the default
MNIST-5k V-MoE (`configs/momentum.py` variants, `vmoe_reference` layout),
every other hyper-parameter shared:

* `noisy_topk`: the plain residual; `momentum_heavy_ball`: mu 0.8, gamma 1
  (both `momentum_vmoe.py`'s runs);
* `momentum_negative`: heavy-ball with mu -0.3;
* `momentum_complex`: complex momentum, |mu| 0.7, arg pi / 8.

NAG, RMSprop and SAM are `momentum_extensions.py`'s. Writes
ROOT/momentum_negative_complex.md and
ROOT/momentum_negative_complex_{regime}.png. About 19 minutes on the 2-core
CPU with `--jobs 2` once `momentum_vmoe.py`'s runs exist.
"""

from __future__ import annotations

from momentum_extensions import BASELINES, METRICS, QUICK
from study import Candidate, Claim, parse_args, run_experiment

CANDIDATES = BASELINES + (
    Candidate("momentum_negative", "negative momentum (mu -0.3)",
              "momentum", "negative"),
    Candidate("momentum_complex", "complex momentum", "momentum",
              "complex"),
)

CLAIMS = (
    Claim("MomentumSMoE Table 9 (LM test PPL 35.55 → 35.09)",
          "negative momentum improves over the plain residual",
          "noisy_topk", "momentum_negative", "clean"),
    Claim("MomentumSMoE Table 9 (LM test PPL 35.55 → 33.34)",
          "complex momentum improves over the plain residual", "noisy_topk",
          "momentum_complex", "clean"),
    Claim("MomentumSMoE Tables 7, 9 (LM test PPL 33.46 → 33.34)",
          "complex momentum beats heavy-ball", "momentum_heavy_ball",
          "momentum_complex", "clean"),
    Claim("MomentumSMoE Table 9 (LM attacked test PPL 44.19 → 41.66; "
          "analogue)", "complex momentum is more robust to attacked inputs",
          "noisy_topk", "momentum_complex", "pgd"),
)


def main(argv=None):
  args = parse_args(__doc__.splitlines()[0], argv)
  return run_experiment(
      "MomentumSMoE's negative and complex momentum on the V-MoE (MNIST-5k)",
      ["Each stream on the default V-MoE (two MoE layers), all other "
       "hyper-parameters shared."],
      CANDIDATES, CLAIMS, METRICS, args, "momentum_negative_complex", QUICK)


if __name__ == "__main__":
  main()
