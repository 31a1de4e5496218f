"""MomentumSMoE's further extensions (appendix E.4) on the V-MoE: NAG,
RMSprop and SAM.

    python experiments/momentum_extensions.py [--seeds 0 1 2]
        [--root runs/repro] [--regimes default low_data] [--jobs 2] [--quick]

The paper's Table 9 (language modelling) compares six more descent methods
as residual streams, and its Tables 8 and 10 SAM on the V-MoE. Here each
on the default MNIST-5k V-MoE (`configs/momentum.py` variants,
`vmoe_reference` layout), every other hyper-parameter shared:

* `noisy_topk`: the plain residual; `momentum_heavy_ball`: mu 0.8, gamma 1
  (both `momentum_vmoe.py`'s runs);
* `momentum_nag`: Nesterov, mu 0.7, gamma 1;
* `momentum_rmsprop`: RMSprop in the first MoE layer, heavy-ball after;
* `momentum_sam`: sharpness-aware, rho 0.05, gamma 1.

Negative and complex momentum are `momentum_negative_complex.py`'s;
time-varying momentum with scheduled restart (SR) needs more MoE layers
than the default's two: `momentum_restart.py` runs it. Writes
ROOT/momentum_extensions.md and ROOT/momentum_extensions_{regime}.png.
About 31 minutes on the 2-core CPU with `--jobs 2` once
`momentum_vmoe.py`'s runs exist (SAM's two forward passes per MoE layer
are the slowest: 6.4 min a default run against NAG's 4.9).
"""

from __future__ import annotations

from study import Candidate, Claim, parse_args, run_experiment

BASELINES = (  # Also `momentum_negative_complex.py`'s.
    Candidate("noisy_topk", "V-MoE (plain residual)", "default"),
    Candidate("momentum_heavy_ball", "heavy-ball (mu 0.8)", "momentum",
              "heavy_ball"),
)
CANDIDATES = BASELINES + (
    Candidate("momentum_nag", "NAG", "momentum", "nag"),
    Candidate("momentum_rmsprop", "RMSprop first layer", "momentum",
              "rmsprop"),
    Candidate("momentum_sam", "SAM (rho 0.05)", "momentum", "sam"),
)
QUICK = ("noisy_topk", "momentum_heavy_ball")

CLAIMS = (
    Claim("MomentumSMoE Table 9 (LM test PPL 35.55 → 35.46)",
          "NAG improves over the plain residual", "noisy_topk",
          "momentum_nag", "clean"),
    Claim("MomentumSMoE Table 9 (LM attacked test PPL 44.19 → 43.97; "
          "analogue)", "NAG is more robust to attacked inputs",
          "noisy_topk", "momentum_nag", "pgd"),
    Claim("MomentumSMoE Table 9 (LM test PPL 35.55 → 34.25)",
          "RMSprop improves over the plain residual", "noisy_topk",
          "momentum_rmsprop", "clean"),
    Claim("MomentumSMoE Table 9 (LM test PPL 35.55 → 35.05)",
          "SAM improves over the plain residual", "noisy_topk",
          "momentum_sam", "clean"),
    Claim("MomentumSMoE Tables 8, 10 (V-MoE, IN-C mCE 67.14 → 65.88)",
          "SAM lowers the corruption error", "noisy_topk", "momentum_sam",
          "mce"),
)
METRICS = ("clean", "fgsm", "pgd", "mce", "load", "train_loss")


def main(argv=None):
  args = parse_args(__doc__.splitlines()[0], argv)
  return run_experiment(
      "MomentumSMoE's E.4 extensions on the V-MoE (MNIST-5k): NAG, RMSprop, "
      "SAM",
      ["Each stream on the default V-MoE (two MoE layers), all other "
       "hyper-parameters shared."],
      CANDIDATES, CLAIMS, METRICS, args, "momentum_extensions", QUICK)


if __name__ == "__main__":
  main()
