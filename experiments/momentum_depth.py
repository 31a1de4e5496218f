"""Heavy-ball momentum at 2, 4 and 8 MoE layers, and time-varying
momentum on 4 (MomentumSMoE Tables 6, 7), each against the mu = 0 stream
of its own layout.

    python experiments/momentum_depth.py [--seeds 0 1 2] [--root runs/paired]
        [--regimes low_data] [--jobs 2] [--quick]

The paper's Table 7 finds momentum's gain growing with depth: it hurts
its 3-layer language model (PPL 84.81 → 86.65), helps its 6-layer one
(35.55 → 33.46) and its 12-layer one (30.33 → 29.03). Here the default
V-MoE's heavy-ball stream (mu 0.8, gamma 1, `vmoe_reference` layout) and
its mu = 0 control with an MoE layer in 2 of 4 blocks (the default;
`momentum_layout.py`'s runs, shared through ROOT), in every one of 4 blocks
and in every one of 8 blocks; the time-varying stream (mu_t = (t - 1) /
(t + 2) over the MoE layers) needs several MoE layers, so it is judged on
the 4-MoE-layer model. Claims per image, as `momentum_layout.py`'s; the
depth claim is a contrast: the heavy-ball gain at 8 (or 4) MoE layers
minus its gain at 2, per seed and image. Low data by default (the cheap
regime: 600 steps); `--regimes default low_data` runs both.
"""

from __future__ import annotations

import os

from momentum_layout import CANDIDATES as LAYOUT_CANDIDATES
from paired_claims import Contrast, run_paired_experiment
from study import Candidate, Claim, parse_args

_MU0 = (("model.stream.mu", 0.0),)
_EVERY = (("model.moe.every", 1),)
_EIGHT = (("model.moe.every", 1), ("model.num_layers", 8))
_SHARED = {c.key: c for c in LAYOUT_CANDIDATES}

CANDIDATES = (
    _SHARED["momentum_mu0"],
    _SHARED["momentum_heavy_ball"],
    Candidate("deep4_mu0", "4 MoE layers: reference layout, mu 0",
              "momentum", "heavy_ball", overrides=_EVERY + _MU0),
    Candidate("deep4_heavy_ball", "4 MoE layers: heavy-ball (mu 0.8)",
              "momentum", "heavy_ball", overrides=_EVERY),
    Candidate("deep4_time_varying", "4 MoE layers: time-varying mu (TV)",
              "momentum", "time_varying", overrides=_EVERY),
    Candidate("deep8_mu0", "8 MoE layers: reference layout, mu 0",
              "momentum", "heavy_ball", overrides=_EIGHT + _MU0),
    Candidate("deep8_heavy_ball", "8 MoE layers: heavy-ball (mu 0.8)",
              "momentum", "heavy_ball", overrides=_EIGHT),
)
QUICK = ("momentum_mu0", "momentum_heavy_ball", "deep4_mu0",
         "deep4_heavy_ball")

_T7 = "MomentumSMoE Table 7 (LM: the gain grows with depth; 3 layers hurt)"
CLAIMS = (
    # (2 MoE layers: momentum_layout.py's heavy-ball row, not listed twice.)
    *(Claim(f"MomentumSMoE Table 7 ({n} MoE layers)", "heavy-ball momentum "
            "improves clean accuracy", base, cand, "clean")
      for n, base, cand in ((4, "deep4_mu0", "deep4_heavy_ball"),
                            (8, "deep8_mu0", "deep8_heavy_ball"))),
    Contrast(_T7, "heavy-ball's clean gain is larger at 4 MoE layers than "
             "at 2", ("momentum_mu0", "momentum_heavy_ball"),
             ("deep4_mu0", "deep4_heavy_ball"), "clean"),
    Contrast(_T7, "heavy-ball's clean gain is larger at 8 MoE layers than "
             "at 2", ("momentum_mu0", "momentum_heavy_ball"),
             ("deep8_mu0", "deep8_heavy_ball"), "clean"),
    Contrast(_T7 + " (attacked; word-swap analogue)", "heavy-ball's "
             "word-swap gain is larger at 8 MoE layers than at 2",
             ("momentum_mu0", "momentum_heavy_ball"),
             ("deep8_mu0", "deep8_heavy_ball"), "swap"),
    Claim("MomentumSMoE Table 6 (LM test PPL 35.55 → 35.08)",
          "time-varying momentum improves over the plain residual",
          "deep4_mu0", "deep4_time_varying", "clean",
          paper=(35.55, 35.08, "ppl")),
    Claim("MomentumSMoE Table 6 (LM attacked PPL 44.19 → 43.97; word-swap "
          "analogue)", "time-varying momentum is more robust to attacked "
          "inputs", "deep4_mu0", "deep4_time_varying", "swap",
          paper=(44.19, 43.97, "ppl")),
    Claim("MomentumSMoE Table 6 (LM attacked PPL 44.19 → 43.97; PGD: not "
          "the paper's attack)", "time-varying momentum is more robust to "
          "attacked inputs", "deep4_mu0", "deep4_time_varying", "pgd_mid",
          paper=(44.19, 43.97, "ppl")),
)
METRICS = ("clean", "swap", "pgd_mid", "pgd", "mce")
RECORD_METRICS = ("load", "train_loss", "steps_to_loss")


def main(argv=None):
  args = parse_args(__doc__.splitlines()[0], argv,
                    default_root=os.path.join("runs", "paired"),
                    default_regimes=("low_data",))
  return run_paired_experiment(
      "Momentum and depth: heavy-ball at 2, 4 and 8 MoE layers, "
      "time-varying momentum at 4 (MNIST-5k)",
      ["Each stream against the mu = 0 stream of its own layout and depth; "
       "all other hyper-parameters shared."],
      CANDIDATES, CLAIMS, METRICS, args, "momentum_depth", QUICK,
      record_metrics=RECORD_METRICS)


if __name__ == "__main__":
  main()
