"""Routers on the V-MoE: XMoE, top-p, Symphony and ACMoE + Symphony.

    python experiments/routers_vmoe.py [--seeds 0 1 2] [--root runs/repro]
        [--regimes default low_data] [--jobs 2] [--quick]

Every candidate is the default MNIST-5k V-MoE (`configs/default.py`: MoE in
blocks 1 and 3, E = 4, top-2, capacity 1.25) with its router swapped and
every other hyper-parameter shared (nothing tuned, so no validation split):

* `noisy_topk`: V-MoE's noisy top-2 (the baseline);
* `xmoe`: XMoE cosine routing (`configs/xmoe.py`);
* `top_p`: top-p dynamic routing, p = 0.2 (`configs/top_p.py`);
* `symphony`: Symphony over noisy top-2 (`configs/symphony.py`);
* `acmoe_symphony`: ACMoE (paper preset) and Symphony together
  (`configs/symphony.py:acmoe`).

The ACMoE presets are `acmoe_vmoe.py`'s (the two share ROOT and the
baseline's runs). Each run: clean accuracy, FGSM and 10-step PGD at
eps 0.05 and the 15 corruptions x 5 severities on 500 test images, load
imbalance and router instability, the routing change under PGD and the
training-loss curve, in the two regimes of `study.REGIMES`. Writes
ROOT/routers_vmoe.md and ROOT/routers_vmoe_{regime}.png. About 45 minutes
on the 2-core CPU with `--jobs 2`.
"""

from __future__ import annotations

from study import Candidate, Claim, parse_args, run_experiment

CANDIDATES = (
    Candidate("noisy_topk", "V-MoE noisy top-2", "default"),
    Candidate("xmoe", "XMoE (cosine, R 16)", "xmoe"),
    Candidate("top_p", "top-p (p 0.2)", "top_p"),
    Candidate("symphony", "Symphony over noisy top-2", "symphony"),
    Candidate("acmoe_symphony", "ACMoE + Symphony", "symphony", "acmoe"),
)
QUICK = ("noisy_topk", "symphony")

CLAIMS = (
    Claim("Symphony Table 8 (Swin-MoE, IN-1K 75.39 → 75.57)",
          "Symphony improves clean accuracy", "noisy_topk", "symphony",
          "clean"),
    Claim("Symphony Table 8 (IN-C mCE 74.28 → 73.56)",
          "Symphony lowers the corruption error", "noisy_topk", "symphony",
          "mce"),
    Claim("Symphony Table 1 (LM, attacked PPL; analogue)",
          "Symphony is more robust to attacked inputs", "noisy_topk",
          "symphony", "pgd"),
    Claim("Symphony Fig. 5 (LM; analogue)",
          "Symphony balances the expert load better", "noisy_topk",
          "symphony", "load"),
    Claim("ACMoE + Symphony (composition)", "ACMoE adds to Symphony",
          "symphony", "acmoe_symphony", "clean"),
    Claim("ACMoE Table 20 (LM, PPL 35.48 → 35.20; analogue)",
          "top-p improves over top-k", "noisy_topk", "top_p", "clean"),
    Claim("ACMoE Table 3 (LM: XMoE 87.21 vs SMoE 87.94 small, 35.88 vs "
          "35.48 medium; analogue)", "cosine routing improves over linear "
          "top-k", "noisy_topk", "xmoe", "clean"),
)
METRICS = ("clean", "fgsm", "pgd", "mce", "load", "instability",
           "routing_change", "train_loss")


def main(argv=None):
  args = parse_args(__doc__.splitlines()[0], argv)
  return run_experiment(
      "Routers on the V-MoE (MNIST-5k): XMoE, top-p, Symphony",
      ["Every router swapped into the default V-MoE, all other "
       "hyper-parameters shared."],
      CANDIDATES, CLAIMS, METRICS, args, "routers_vmoe",
      QUICK)


if __name__ == "__main__":
  main()
