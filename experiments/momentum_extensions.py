"""MomentumSMoE's further extensions (appendix E.4) on the V-MoE.

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
* `momentum_sam`: sharpness-aware, rho 0.05, gamma 1;
* `momentum_negative`: heavy-ball with mu -0.3;
* `momentum_complex`: complex momentum, |mu| 0.7, arg pi / 8.

Time-varying momentum with scheduled restart (SR) needs more MoE layers
than the default's two: `momentum_restart.py` runs it. Writes
ROOT/momentum_extensions.md and ROOT/momentum_extensions_{regime}.png.
51 minutes on the 2-core CPU with `--jobs 2` once `momentum_vmoe.py`'s
runs exist (SAM's two forward passes per MoE layer are the slowest).
"""

from __future__ import annotations

from study import Candidate, Claim, parse_args, run_experiment

CANDIDATES = (
    Candidate("noisy_topk", "V-MoE (plain residual)", "default"),
    Candidate("momentum_heavy_ball", "heavy-ball (mu 0.8)", "momentum",
              "heavy_ball"),
    Candidate("momentum_nag", "NAG", "momentum", "nag"),
    Candidate("momentum_rmsprop", "RMSprop first layer", "momentum",
              "rmsprop"),
    Candidate("momentum_sam", "SAM (rho 0.05)", "momentum", "sam"),
    Candidate("momentum_negative", "negative momentum (mu -0.3)",
              "momentum", "negative"),
    Candidate("momentum_complex", "complex momentum", "momentum",
              "complex"),
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
METRICS = ("clean", "fgsm", "pgd", "mce", "load", "train_loss")


def main(argv=None):
  args = parse_args(__doc__.splitlines()[0], argv)
  return run_experiment(
      "MomentumSMoE's E.4 extensions on the V-MoE (MNIST-5k)",
      ["Each stream on the default V-MoE (two MoE layers), all other "
       "hyper-parameters shared."],
      CANDIDATES, CLAIMS, METRICS, args, "momentum_extensions", QUICK)


if __name__ == "__main__":
  main()
