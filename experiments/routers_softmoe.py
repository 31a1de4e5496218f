"""Routers on the SoftMoE: ACMoE's softmoe preset and SymphonySoftMoE.

    python experiments/routers_softmoe.py [--seeds 0 1 2] [--root runs/repro]
        [--regimes default low_data] [--jobs 2] [--quick]

The SoftMoE ViT of `configs/soft_moe.py` (MoE in blocks 1 and 3, E = 4
experts of 4 slots, one image per group) with the routers that apply to it,
every other hyper-parameter shared (nothing tuned):

* `soft_moe`: plain SoftMoE (the baseline);
* `acmoe_soft`: ACMoE's `softmoe` preset on block 3 (`configs/acmoe_soft.py`,
  the authors' SoftMoE code: statistics on the L2-normalised input, weights
  mixed over each token's previous top-8 slots);
* `symphony_soft`: SymphonySoftMoE (`configs/symphony_soft.py`).

Evaluation and regimes as `routers_vmoe.py`. Load imbalance counts each
token's 8 slots of largest combine weight, so it is not comparable with the
top-2 routers' numbers. Writes ROOT/routers_softmoe.md and
ROOT/routers_softmoe_{regime}.png. 21 minutes on the 2-core CPU with
`--jobs 2`.
"""

from __future__ import annotations

from study import Candidate, Claim, parse_args, run_experiment

CANDIDATES = (
    Candidate("soft_moe", "SoftMoE", "soft_moe"),
    Candidate("acmoe_soft", "ACMoE (softmoe preset)", "acmoe_soft"),
    Candidate("symphony_soft", "SymphonySoftMoE", "symphony_soft"),
)
QUICK = ("soft_moe", "acmoe_soft")

_T17 = "ACMoE Table 17 (SoftMoE on ImageNet"
CLAIMS = (
    Claim(f"{_T17}: 72.86 → 73.21)", "ACMoE improves SoftMoE's clean "
          "accuracy", "soft_moe", "acmoe_soft", "clean"),
    Claim(f"{_T17}: PGD 45.29 → 48.25)", "ACMoE raises SoftMoE's PGD "
          "accuracy", "soft_moe", "acmoe_soft", "pgd"),
    Claim(f"{_T17}: FGSM 56.95 → 59.01)", "ACMoE raises SoftMoE's FGSM "
          "accuracy", "soft_moe", "acmoe_soft", "fgsm"),
    Claim("Symphony Table 9 / E.4 (top-5 and IN-R / IN-O; top-1 not "
          "claimed)", "Symphony improves SoftMoE (clean)", "soft_moe",
          "symphony_soft", "clean"),
    Claim("Symphony Table 9 / E.4 (robustness)", "Symphony lowers SoftMoE's "
          "corruption error", "soft_moe", "symphony_soft", "mce"),
)
METRICS = ("clean", "fgsm", "pgd", "mce", "routing_change", "train_loss")


def main(argv=None):
  args = parse_args(__doc__.splitlines()[0], argv)
  return run_experiment(
      "Routers on the SoftMoE (MNIST-5k)",
      ["The SoftMoE ViT with each router that applies to it, all other "
       "hyper-parameters shared."],
      CANDIDATES, CLAIMS, METRICS, args, "routers_softmoe", QUICK)


if __name__ == "__main__":
  main()
