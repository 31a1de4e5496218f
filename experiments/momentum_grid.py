"""MomentumSMoE's mu and gamma ablation on the V-MoE (the paper's Fig. 5).

    python experiments/momentum_grid.py [--seeds 0 1 2] [--root runs/repro]
        [--regimes default low_data] [--jobs 2] [--quick]

The paper tunes the heavy-ball stream's momentum mu with gamma fixed at 1
and the step size gamma with mu fixed (Fig. 5 right, language modelling)
and reports that the model is robust to mu while too small a gamma hurts.
Here the same one-at-a-time grid around the authors' V-MoE setting
(`configs/momentum.py:heavy_ball`: mu 0.8, gamma 1, `vmoe_reference`
layout) on the default MNIST-5k V-MoE, every other hyper-parameter shared:

* mu in {0.3, 0.8, 0.95} at gamma 1;
* gamma in {0.25, 0.5, 1, 1.5} at mu 0.8;
* `noisy_topk`: the plain residual, for reference.

"Robust to mu" is judged as an equivalence claim with a margin of 1.5
accuracy points fixed before the runs (`study.Claim.margin`).
`momentum_heavy_ball` and `noisy_topk` are `momentum_vmoe.py`'s runs (same
ROOT). Writes ROOT/momentum_grid.md and ROOT/momentum_grid_{regime}.png.
45 minutes on the 2-core CPU with `--jobs 2` once those runs exist.
"""

from __future__ import annotations

from study import Candidate, Claim, parse_args, run_experiment

MARGIN = 1.5  # Accuracy points: "robust to mu" means within this.


def _heavy_ball(key: str, label: str, **stream) -> Candidate:
  return Candidate(key, label, "momentum", "heavy_ball", overrides=tuple(
      (f"model.stream.{name}", value) for name, value in stream.items()))


CANDIDATES = (
    Candidate("noisy_topk", "V-MoE (plain residual)", "default"),
    Candidate("momentum_heavy_ball", "mu 0.8, gamma 1", "momentum",
              "heavy_ball"),
    _heavy_ball("momentum_mu0.3", "mu 0.3, gamma 1", mu=0.3),
    _heavy_ball("momentum_mu0.95", "mu 0.95, gamma 1", mu=0.95),
    _heavy_ball("momentum_gamma0.25", "mu 0.8, gamma 0.25", gamma=0.25),
    _heavy_ball("momentum_gamma0.5", "mu 0.8, gamma 0.5", gamma=0.5),
    _heavy_ball("momentum_gamma1.5", "mu 0.8, gamma 1.5", gamma=1.5),
)
QUICK = ("momentum_heavy_ball", "momentum_mu0.3")

CLAIMS = (
    Claim("MomentumSMoE Fig. 5 right (LM)", "robust to mu (0.3 vs 0.8)",
          "momentum_heavy_ball", "momentum_mu0.3", "clean", margin=MARGIN),
    Claim("MomentumSMoE Fig. 5 right (LM)", "robust to mu (0.95 vs 0.8)",
          "momentum_heavy_ball", "momentum_mu0.95", "clean",
          margin=MARGIN),
    Claim("MomentumSMoE Fig. 5 right (LM)", "too small a gamma hurts "
          "(0.25 vs 1)", "momentum_gamma0.25", "momentum_heavy_ball",
          "clean"),
    Claim("MomentumSMoE Fig. 5 right (LM: validation PPL)", "too small a "
          "gamma hurts the fit (0.25 vs 1)", "momentum_gamma0.25",
          "momentum_heavy_ball", "train_loss"),
    Claim("MomentumSMoE Fig. 5 right (LM)", "too small a gamma hurts "
          "(0.5 vs 1)", "momentum_gamma0.5", "momentum_heavy_ball",
          "clean"),
)
METRICS = ("clean", "pgd", "mce", "load", "train_loss")


def main(argv=None):
  args = parse_args(__doc__.splitlines()[0], argv)
  return run_experiment(
      "MomentumSMoE mu / gamma grid on the V-MoE (MNIST-5k)",
      ["The heavy-ball stream with one of mu, gamma changed at a time; all "
       "other hyper-parameters shared."],
      CANDIDATES, CLAIMS, METRICS, args, "momentum_grid", QUICK)


if __name__ == "__main__":
  main()
