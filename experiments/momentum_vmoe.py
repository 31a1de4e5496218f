"""MomentumSMoE streams on the V-MoE: heavy-ball, robust, AdamSMoE.

    python experiments/momentum_vmoe.py [--seeds 0 1 2] [--root runs/repro]
        [--regimes default low_data] [--jobs 2] [--quick]

The MomentumSMoE paper's V-MoE comparison (Tables 2 and 8) and its
AdamSMoE (Table 7, language) on the default MNIST-5k V-MoE (MoE in blocks
1 and 3, E = 4, top-2), every other hyper-parameter shared:

* `noisy_topk`: the plain residual (the baseline; `acmoe_vmoe.py`'s runs);
* `momentum_heavy_ball`: heavy-ball, mu 0.8, gamma 1 (the authors' V-MoE
  config; `configs/momentum.py:heavy_ball`);
* `momentum_robust`: robust momentum, p 0.2, kappa 1.25, L 1
  (`configs/momentum.py:robust`);
* `momentum_adam` / `momentum_adam_code`: AdamSMoE in the first MoE layer
  and heavy-ball after it, in the paper's form / the authors' code form
  (`configs/momentum.py:adam` / `:adam_code`).

The streams use the `vmoe_reference` layout (the authors' V-MoE code: a
post-LayerNorm in every block, the MoE output subtracted), so they differ
from the plain baseline by the layout as well, as in the paper. The default
has two MoE layers: the paper's Table 7 finds momentum *hurts* its shallow
(3-layer) language model, so both directions are listed as claims.
Writes ROOT/momentum_vmoe.md and ROOT/momentum_vmoe_{regime}.png. 34 minutes
on the 2-core CPU with `--jobs 2` once `acmoe_vmoe.py`'s `noisy_topk` runs
exist.
"""

from __future__ import annotations

from study import Candidate, Claim, parse_args, run_experiment

CANDIDATES = (
    Candidate("noisy_topk", "V-MoE (plain residual)", "default"),
    Candidate("momentum_heavy_ball", "MomentumV-MoE (mu 0.8)", "momentum",
              "heavy_ball"),
    Candidate("momentum_robust", "Robust MomentumV-MoE", "momentum",
              "robust"),
    Candidate("momentum_adam", "AdamV-MoE (paper form)", "momentum",
              "adam"),
    Candidate("momentum_adam_code", "AdamV-MoE (code form)", "momentum",
              "adam_code"),
)
QUICK = ("noisy_topk", "momentum_heavy_ball")

CLAIMS = (
    Claim("MomentumSMoE Table 2 (IN-1K 73.16 → 73.26)",
          "momentum improves clean accuracy", "noisy_topk",
          "momentum_heavy_ball", "clean"),
    Claim("MomentumSMoE Table 2 (IN-C mCE 67.14 → 65.77)",
          "momentum lowers the corruption error", "noisy_topk",
          "momentum_heavy_ball", "mce"),
    Claim("MomentumSMoE Table 2 (IN-C mCE 67.14 → 64.92)",
          "robust momentum lowers the corruption error", "noisy_topk",
          "momentum_robust", "mce"),
    Claim("MomentumSMoE Table 2 (mCE 65.77 → 64.92)",
          "robust momentum is more robust than heavy-ball (corruptions)",
          "momentum_heavy_ball", "momentum_robust", "mce"),
    Claim("MomentumSMoE Table 1 (LM, attacked PPL 44.19 → 42.33; analogue)",
          "momentum is more robust to attacked inputs", "noisy_topk",
          "momentum_heavy_ball", "pgd"),
    Claim("MomentumSMoE Table 7 (LM medium, PPL 33.46 → 33.25)",
          "AdamSMoE beats heavy-ball", "momentum_heavy_ball",
          "momentum_adam", "clean"),
    Claim("MomentumSMoE Table 7 (LM small, 3 layers: PPL 84.81 → 86.65)",
          "momentum hurts a shallow model", "momentum_heavy_ball",
          "noisy_topk", "clean"),
)
METRICS = ("clean", "fgsm", "pgd", "mce", "load", "routing_change",
           "train_loss")


def main(argv=None):
  args = parse_args(__doc__.splitlines()[0], argv)
  return run_experiment(
      "MomentumSMoE streams on the V-MoE (MNIST-5k)",
      ["Each stream on the default V-MoE (two MoE layers), all other "
       "hyper-parameters shared."],
      CANDIDATES, CLAIMS, METRICS, args, "momentum_vmoe", QUICK)


if __name__ == "__main__":
  main()
