"""Symphony on the V-MoE, judged per image: Table 8 (clean, IN-C), Table 6
(accuracy per corruption at the largest severity), Table 1's attacked
perplexity on its word-swap analogue.

    python experiments/symphony_paired.py [--seeds 0 1 2]
        [--root runs/paired] [--regimes default low_data] [--jobs 2]
        [--quick]

* `noisy_topk`: the default MNIST-5k V-MoE (MoE in blocks 1 and 3, E = 4,
  noisy top-2); its runs are `momentum_layout.py`'s, shared through ROOT;
* `symphony`: Symphony's graph-aware router over the same noisy top-2
  (`configs/symphony.py`), every other hyper-parameter shared.

The paper's Table 6 gives Swin-MoE's top-1 accuracy per ImageNet-C
corruption at severity 5 (16 experts, top-2), here each corruption's
severity-5 accuracy on the paired evaluation's 500 images. 3 new runs per
regime: about 15 minutes on the 2-core CPU with `--jobs 2`.
"""

from __future__ import annotations

import os

from momentum_layout import CANDIDATES as LAYOUT_CANDIDATES
from paired_claims import run_paired_experiment
from study import Candidate, Claim, parse_args

CANDIDATES = (
    {c.key: c for c in LAYOUT_CANDIDATES}["noisy_topk"],
    Candidate("symphony", "Symphony over noisy top-2", "symphony"),
)
QUICK = ("noisy_topk", "symphony")

# Symphony Table 6: Swin-MoE and SymphonySwin-MoE top-1 accuracy per
# ImageNet-C corruption at severity 5.
TABLE6 = {"brightness": (58.49, 59.16), "contrast": (22.48, 21.75),
          "defocus_blur": (13.92, 14.35), "elastic_transform": (26.84, 27.26),
          "fog": (32.82, 28.88), "frost": (36.59, 38.04),
          "gaussian_noise": (14.10, 16.69), "glass_blur": (10.79, 11.67),
          "impulse_noise": (13.68, 17.60), "jpeg_compression": (17.10, 18.84),
          "motion_blur": (21.47, 21.68), "pixelate": (8.58, 10.18),
          "shot_noise": (13.42, 16.21), "snow": (31.43, 33.41),
          "zoom_blur": (23.57, 23.60)}
_T1 = (44.19, 42.79, "ppl")  # Table 1: 16 experts top-2, attacked test PPL.

CLAIMS = (
    Claim("Symphony Table 8 (Swin-MoE, IN-1K 75.39 → 75.57)",
          "Symphony improves clean accuracy", "noisy_topk", "symphony",
          "clean", paper=(75.39, 75.57, "accuracy")),
    Claim("Symphony Table 8 (Swin-MoE, IN-C mCE 74.28 → 73.56)",
          "Symphony lowers the corruption error", "noisy_topk", "symphony",
          "mce", paper=(74.28, 73.56, "error")),
    Claim("Symphony Table 1 (LM attacked PPL 44.19 → 42.79; word-swap "
          "analogue)", "Symphony is more robust to attacked inputs",
          "noisy_topk", "symphony", "swap", paper=_T1),
    Claim("Symphony Table 1 (LM attacked PPL 44.19 → 42.79; PGD: not the "
          "paper's attack)", "Symphony is more robust to attacked inputs",
          "noisy_topk", "symphony", "pgd_mid", paper=_T1),
    Claim("Symphony Fig. 5 (LM; analogue at E = 4; the figure is at 16 "
          "experts)", "Symphony balances the expert load better",
          "noisy_topk", "symphony", "load"),
    *(Claim(f"Symphony Table 6 ({name}, severity 5: top-1 {a} → {b})",
            f"Symphony {'raises' if b > a else 'lowers'} the {name} "
            "accuracy", "noisy_topk", "symphony", f"corr5:{name}",
            paper=(a, b, "accuracy"))
      for name, (a, b) in TABLE6.items()),
)
METRICS = ("clean", "top5", "swap", "pgd_mid", "pgd", "mce")
RECORD_METRICS = ("load", "train_loss", "steps_to_loss")


def main(argv=None):
  args = parse_args(__doc__.splitlines()[0], argv,
                    default_root=os.path.join("runs", "paired"))
  return run_paired_experiment(
      "Symphony on the V-MoE, judged per image (MNIST-5k)",
      ["Symphony's router against its noisy top-2 base, all other "
       "hyper-parameters shared."],
      CANDIDATES, CLAIMS, METRICS, args, "symphony_paired", QUICK,
      record_metrics=RECORD_METRICS)


if __name__ == "__main__":
  main()
