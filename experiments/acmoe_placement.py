"""ACMoE's layer placement on a V-MoE with an MoE layer in every block.

    python experiments/acmoe_placement.py [--seeds 0 1 2] [--root runs/repro]
        [--regimes default low_data] [--jobs 2] [--quick]

The default V-MoE has two MoE layers, so only one can be an AC layer (it
needs the previous MoE layer's assignments). Here the default model with an
MoE layer in each of its 4 blocks (`model.moe.every = 1`, the Switch
layout; every other hyper-parameter the default's), and ACMoE's `paper`
preset placed as the paper's appendix C.5.2 places it (Tables 10, 12):

* `deep_noisy_topk`: noisy top-2 in every MoE layer (no AC layer);
* `deep_acmoe_full`: AC on every MoE layer after the first (blocks 1-3);
* `deep_acmoe_skip1`: two plain MoE layers first, AC on blocks 2-3 (with 4
  MoE layers this is also the paper's "back half");
* `deep_acmoe_alternating`: AC on every second MoE layer (blocks 1, 3).

"Skip 2" (block 3 only) is the one-layer setting `acmoe_vmoe.py` runs.
Writes ROOT/acmoe_placement.md and ROOT/acmoe_placement_{regime}.png.
43 minutes on the 2-core CPU with `--jobs 2`, alone, from an empty ROOT
(its report then equals the committed one to the last digit).
"""

from __future__ import annotations

from study import Candidate, Claim, parse_args, run_experiment

_EVERY_BLOCK = (("model.moe.every", 1),)


def _acmoe(placement: str, label: str) -> Candidate:
  return Candidate(f"deep_acmoe_{placement}", label, "acmoe", "paper",
                   overrides=_EVERY_BLOCK + (
                       ("model.moe.router.layers", placement),))


CANDIDATES = (
    Candidate("deep_noisy_topk", "noisy top-2, 4 MoE layers", "default",
              overrides=_EVERY_BLOCK),
    _acmoe("full", "ACMoE full (blocks 1-3)"),
    _acmoe("skip1", "ACMoE skip 1 (blocks 2-3)"),
    _acmoe("alternating", "ACMoE alternating (blocks 1, 3)"),
)
QUICK = ("deep_noisy_topk", "deep_acmoe_full")

CLAIMS = (
    Claim("ACMoE Table 12 (Swin top-2: 76.10 → 76.31; Table 4)",
          "ACMoE (full) beats its base router", "deep_noisy_topk",
          "deep_acmoe_full", "clean"),
    Claim("ACMoE Table 4 analogue (attacked accuracy)",
          "ACMoE (full) is more robust to PGD", "deep_noisy_topk",
          "deep_acmoe_full", "pgd"),
    Claim("ACMoE Table 10 (Switch: skip 1 34.42, full 34.88 PPL)",
          "skip 1 beats full", "deep_acmoe_full", "deep_acmoe_skip1",
          "clean"),
    Claim("ACMoE Table 12 (Swin top-2: skip 1 76.29, full 76.31; back "
          "half 76.16)", "full beats skip 1 / back half", "deep_acmoe_skip1",
          "deep_acmoe_full", "clean"),
    Claim("ACMoE Table 10 (Switch: skip 1 34.42, alternating 34.80 PPL)",
          "skip 1 beats alternating", "deep_acmoe_alternating",
          "deep_acmoe_skip1", "clean"),
)
METRICS = ("clean", "fgsm", "pgd", "mce", "load", "instability",
           "train_loss")


def main(argv=None):
  args = parse_args(__doc__.splitlines()[0], argv)
  return run_experiment(
      "ACMoE layer placement on a V-MoE with 4 MoE layers (MNIST-5k)",
      ["The default V-MoE with an MoE layer in every block; ACMoE's `paper` "
       "preset at each placement, all other hyper-parameters shared."],
      CANDIDATES, CLAIMS, METRICS, args, "acmoe_placement", QUICK)


if __name__ == "__main__":
  main()
