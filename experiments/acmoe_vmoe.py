"""ACMoE on the V-MoE: its three presets against their base routers.

    python experiments/acmoe_vmoe.py [--seeds 0 1 2] [--root runs/repro]
        [--regimes default low_data] [--jobs 2] [--quick]

Every candidate is the default MNIST-5k V-MoE (`configs/default.py`: MoE in
blocks 1 and 3, E = 4, top-2, capacity 1.25; ACMoE on block 3, the only MoE
layer with one before it) with its router swapped and every other
hyper-parameter shared (nothing tuned, so no validation split):

* `noisy_topk`: V-MoE's noisy top-2, the base of the paper and swin presets;
* `acmoe_paper`: ACMoE as the paper defines it (`configs/acmoe.py:paper`);
* `acmoe_swin`: as the authors' Swin code computes it (`:swin`);
* `cosine_lm`: the authors' language-model router, the language preset's
  base;
* `acmoe_language`: ACMoE as the authors' language-model code (`:language`).

Evaluation and regimes as `routers_vmoe.py` (which shares ROOT and the
baseline's runs). Writes ROOT/acmoe_vmoe.md and ROOT/acmoe_vmoe_{regime}.png.
About 45 minutes on the 2-core CPU with `--jobs 2`.
"""

from __future__ import annotations

from study import Candidate, Claim, parse_args, run_experiment

CANDIDATES = (
    Candidate("noisy_topk", "V-MoE noisy top-2", "default"),
    Candidate("acmoe_paper", "ACMoE (paper preset)", "acmoe", "paper"),
    Candidate("acmoe_swin", "ACMoE (swin preset)", "acmoe", "swin"),
    Candidate("cosine_lm", "cosine_lm (the language preset's base)",
              "default", overrides=(
                  ("model.moe.router", dict(name="cosine_lm",
                                            num_selected=2)),)),
    Candidate("acmoe_language", "ACMoE (language preset)", "acmoe",
              "language"),
)
QUICK = ("noisy_topk", "acmoe_paper")

_T4 = "ACMoE Table 4 (Swin-MoE top-2"
CLAIMS = (
    Claim(f"{_T4}: 76.10 → 76.31)", "ACMoE improves clean accuracy",
          "noisy_topk", "acmoe_paper", "clean"),
    Claim(f"{_T4}: PGD 40.85 → 43.74)", "ACMoE raises PGD accuracy",
          "noisy_topk", "acmoe_paper", "pgd"),
    Claim(f"{_T4}: FGSM 54.70 → 55.78)", "ACMoE raises FGSM accuracy",
          "noisy_topk", "acmoe_paper", "fgsm"),
    Claim(f"{_T4}), the authors' Swin code",
          "ACMoE (swin preset) improves clean accuracy", "noisy_topk",
          "acmoe_swin", "clean"),
    Claim(f"{_T4}), the authors' Swin code",
          "ACMoE (swin preset) raises PGD accuracy", "noisy_topk",
          "acmoe_swin", "pgd"),
    Claim("ACMoE Table 3 (LM; analogue)", "ACMoE (language preset) "
          "improves over its base", "cosine_lm", "acmoe_language", "clean"),
    Claim("ACMoE Table 6 (Swin load std 2.134 → 2.127)",
          "ACMoE balances the expert load better", "noisy_topk",
          "acmoe_paper", "load"),
    Claim("ACMoE Fig. 5 / C.9 (LM; analogue)",
          "ACMoE lowers router instability across layers", "noisy_topk",
          "acmoe_paper", "instability"),
    Claim("ACMoE Fig. 2 (LM; analogue)",
          "ACMoE converges faster (lower final training loss)",
          "noisy_topk", "acmoe_paper", "train_loss"),
    Claim("ACMoE Proposition 1 (analogue)", "the AC router's assignment "
          "changes less under attack", "noisy_topk", "acmoe_paper",
          "routing_change"),
)
METRICS = ("clean", "fgsm", "pgd", "mce", "load", "instability",
           "routing_change", "train_loss")


def main(argv=None):
  args = parse_args(__doc__.splitlines()[0], argv)
  return run_experiment(
      "ACMoE on the V-MoE (MNIST-5k): presets vs base routers",
      ["ACMoE's presets swapped into the default V-MoE, all other "
       "hyper-parameters shared."
       " The metrics of block 3 (the AC layer) are averaged with block 1's "
       "where a metric is per layer."],
      CANDIDATES, CLAIMS, METRICS, args, "acmoe_vmoe",
      QUICK)


if __name__ == "__main__":
  main()
