"""Symphony's ablations on the V-MoE: beta, graph init, sparse threshold.

    python experiments/symphony_ablations.py [--seeds 0 1 2]
        [--root runs/repro] [--regimes default low_data] [--jobs 2] [--quick]

The paper's ablations (appendix G, Tables 13-15, on WikiText-103) on the
default MNIST-5k V-MoE with the Symphony router over noisy top-2
(`configs/symphony.py`), every other hyper-parameter shared:

* `symphony`: beta 0.9, zero init, dense graph (the paper's choice);
* `symphony_beta05`, `symphony_beta07`: beta 0.5 / 0.7 (Table 14);
* `symphony_sparse`: the graph thresholded at t = 0.05 (Table 15);
* `symphony_init_random`: the graph initialised standard uniform (Table 13's
  "Uniform"; `init=random` here);
* `noisy_topk`: the base router without Symphony.

`noisy_topk` and `symphony` are `routers_vmoe.py`'s runs (same ROOT: they
are reused). Kaiming and Xavier inits (also in Table 13) are left out of the
45-minute budget: `configs/symphony.py:init=kaiming|xavier`. Writes
ROOT/symphony_ablations.md and ROOT/symphony_ablations_{regime}.png.
38 minutes on the 2-core CPU with `--jobs 2` once those runs exist.
"""

from __future__ import annotations

from study import Candidate, Claim, parse_args, run_experiment

CANDIDATES = (
    Candidate("noisy_topk", "V-MoE noisy top-2", "default"),
    Candidate("symphony", "Symphony (beta 0.9, zero init, dense)",
              "symphony"),
    Candidate("symphony_beta05", "Symphony beta 0.5", "symphony",
              "beta=0.5"),
    Candidate("symphony_beta07", "Symphony beta 0.7", "symphony",
              "beta=0.7"),
    Candidate("symphony_sparse", "Symphony, threshold 0.05", "symphony",
              "sparse"),
    Candidate("symphony_init_random", "Symphony, standard uniform init",
              "symphony", "init=random"),
)
QUICK = ("symphony", "symphony_sparse")

_LM = "(WikiText-103 test PPL; analogue)"
CLAIMS = (
    Claim(f"Symphony Table 14 {_LM}: beta 0.9 34.29, 0.7 35.2",
          "beta 0.9 beats beta 0.7", "symphony_beta07", "symphony",
          "clean"),
    Claim(f"Symphony Table 14 {_LM}: beta 0.9 34.29, 0.5 34.41",
          "beta 0.9 beats beta 0.5", "symphony_beta05", "symphony",
          "clean"),
    Claim(f"Symphony Table 15 {_LM}: dense 34.29, sparse 34.53",
          "the dense graph beats the sparsified one", "symphony_sparse",
          "symphony", "clean"),
    Claim(f"Symphony Table 15 {_LM}: sparse 34.53, baseline 35.55",
          "the sparsified graph still beats the base router", "noisy_topk",
          "symphony_sparse", "clean"),
    Claim(f"Symphony Table 13 {_LM}: zero 34.29, uniform 35.40",
          "zero init beats the standard uniform init",
          "symphony_init_random", "symphony", "clean"),
    Claim(f"Symphony Table 13 {_LM}: uniform 35.40, baseline 35.55",
          "every init beats the base router (uniform)", "noisy_topk",
          "symphony_init_random", "clean"),
)
METRICS = ("clean", "fgsm", "pgd", "mce", "load", "train_loss")


def main(argv=None):
  args = parse_args(__doc__.splitlines()[0], argv)
  return run_experiment(
      "Symphony ablations on the V-MoE (MNIST-5k)",
      ["The Symphony router over the default V-MoE's noisy top-2 with one "
       "ablation each, all other hyper-parameters shared."],
      CANDIDATES, CLAIMS, METRICS, args, "symphony_ablations", QUICK)


if __name__ == "__main__":
  main()
