"""MomentumSMoE's gradient-descent picture on our trained models: the MoE
output norm over layers (Fig. 3) and the choice of experts by their output
norm (Fig. 5, left).

    python experiments/momentum_norms.py [--seeds 0 1 2] [--root runs/paired]
        [--regimes default low_data] [--quick]

Reads the finished runs of `momentum_layout.py` and `momentum_depth.py`
(ROOT shared; a missing run is trained first) and measures each on the
1,000 test images with `vmoe_ext.evaluate.expert_norms`:

* Fig. 3: the mean MoE output norm `||f(x)||` at the first and the last MoE
  layer (2 MoE layers by default; 4 and 8 in the depth study's models):
  the picture has it fall along the layers as a gradient's norm along a
  descent; the arms of that claim are the two layers of one model;
* Fig. 5 (left, A): the share of the selections that go to the expert with
  the smallest output norm on the token, against the largest (an SMoE picks
  small-norm experts most);
* Fig. 5 (left, B): the imbalance of that norm-rank share (std over ranks),
  momentum against the mu = 0 stream of its layout.

* Fig. 2: the output norm of the first and the last MoE layer over
  training, on runs of the plain V-MoE of their own (`noisy_topk_along`:
  the layout study's V-MoE keeping 10 checkpoints evenly along training,
  clean evaluation only): the picture has each fall during training; the
  arms are the checkpoint at 10% of the steps and the last one.

Each claim is judged over seeds (`paired_stats.paired_seeds`: a
model-level value, no per-image term). About 3 minutes on the 2-core CPU
once the layout and depth runs exist, plus the Fig. 2 runs (about 1 minute
each in low data, 3 by default) and their 10 checkpoints' measurements.
"""

from __future__ import annotations

import os
from typing import Optional

import numpy as np

import study
from common import write_report
from momentum_depth import CANDIDATES as DEPTH_CANDIDATES
from momentum_layout import CANDIDATES as LAYOUT_CANDIDATES
from paired_claims import claims_rows, write_json
from study import Candidate, Claim, parse_args
from vmoe_ext.app.context import RunContext
from vmoe_ext.evaluate.expert_norms import expert_norms

_ALL = {c.key: c for c in LAYOUT_CANDIDATES + DEPTH_CANDIDATES}
# Fig. 2's runs: the plain V-MoE keeping checkpoints along training, with
# the clean evaluation only (the norms are measured afterwards).
ALONG = Candidate(
    "noisy_topk_along", "V-MoE (checkpoints along training)", "default",
    overrides=(("robustness.attacks", ()), ("robustness.corruptions", None)),
    checkpoints_along=10)
# Per regime, the models measured (the depth study runs in low data).
MODELS = {"default": ("noisy_topk", "momentum_mu0", "momentum_heavy_ball"),
          "low_data": ("noisy_topk", "momentum_mu0", "momentum_heavy_ball",
                       "deep4_mu0",
                       "deep4_heavy_ball", "deep8_mu0", "deep8_heavy_ball")}
QUICK = ("momentum_mu0", "momentum_heavy_ball")
_F3 = ("MomentumSMoE Fig. 3 (LM: the (S)MoE output norm falls over the "
       "layers, as a gradient's along a descent; no numbers)")
_F5A = ("MomentumSMoE Fig. 5 left, A (LM: an SMoE picks its smallest-norm "
        "experts most; no numbers)")
_F2 = ("MomentumSMoE Fig. 2, Figs. 6-7 (LM: the (S)MoE output norm of "
       "each layer falls during training; no numbers)")
_F5B = ("MomentumSMoE Fig. 5 left, B (LM: momentum balances the choice of "
        "experts by norm; no numbers)")


def claims_for(models) -> list[Claim]:
  """The claims on the measured `models` (pairs where both were run)."""
  out = [Claim(_F3, "the MoE output norm falls from the first to the last "
               "MoE layer", f"{k}:first", f"{k}:last", "output_norm")
         for k in models]
  out += [Claim(_F5A, "the smallest-norm expert is selected more often "
                "than the largest-norm one", f"{k}:largest", f"{k}:smallest",
                "rank_share") for k in models if "heavy_ball" not in k]
  out += [Claim(_F5B, "heavy-ball momentum lowers the norm-rank selection "
                "imbalance", base, base.replace("mu0", "heavy_ball"),
                "rank_imbalance")
          for base in models if base.endswith("mu0")
          and base.replace("mu0", "heavy_ball") in models]
  return out


def along_claims(key: str) -> list[Claim]:
  """Fig. 2 on the run `key`: each end MoE layer's norm, early vs last."""
  return [Claim(_F2, f"the {layer} MoE layer's output norm falls during "
                "training (checkpoint at 10% of the steps → the last)",
                f"{key}:{layer}_early", f"{key}:{layer}_final", "output_norm")
          for layer in ("first", "last")]


def measure(workdir: str, config, ctx: Optional[RunContext] = None,
            step: Optional[int] = None) -> dict[str, float]:
  """The run's expert-norm values (`ANALYSIS_METRICS`), from its last
  checkpoint (or the one of `step`) on the whole test split; `ctx`: an
  assembled context of `config` to reuse."""
  ctx = ctx or RunContext.assemble(config)
  ctx.open_evaluation(workdir, step=step)
  batches = ((b["image"], b["mask"]) for b in ctx.eval_batches())
  stats = expert_norms(ctx.model, ctx.state.variables(), batches,
                       config.model.moe.get("activation", "gelu"))
  layers = list(stats.values())  # In depth order.
  share = np.mean([s["rank_share"] for s in layers], axis=0)
  return {"first/output_norm": layers[0]["output_norm"],
          "last/output_norm": layers[-1]["output_norm"],
          "largest/rank_share": float(share[0]),
          "smallest/rank_share": float(share[-1]),
          "rank_imbalance": float(np.mean([s["rank_imbalance"]
                                           for s in layers])),
          "layers": [s["output_norm"] for s in layers]}


def kept_steps(workdir: str) -> list[int]:
  """The steps of the checkpoints a run kept, ascending."""
  return sorted(int(d) for d in os.listdir(os.path.join(workdir,
                                                        "checkpoints"))
                if d.isdigit())


def along_training(root: str, regime: study.Regime, seeds, quick: bool,
                   jobs: int) -> tuple[dict, list[str], list]:
  """Fig. 2 in `regime`: the outcomes `{(pseudo-key, "output_norm"):
  per-seed values}` of `along_claims`, the table's lines, and per seed
  `(steps, norms [checkpoints, MoE layers])`."""
  study.run_grid([ALONG], [regime], seeds, root, quick, jobs)
  curves = []
  for seed in seeds:
    workdir = study.run_dir(root, regime, ALONG, seed)
    config = study.build_config(ALONG, seed, regime, quick)
    steps = kept_steps(workdir)
    expected = config.train.total_steps // ALONG.checkpoints_along
    if steps != [expected * (i + 1)
                 for i in range(ALONG.checkpoints_along)]:
      raise RuntimeError(f"{workdir}: checkpoints of steps {steps}, not "
                         f"every {expected} steps")
    ctx = RunContext.assemble(config)
    curves.append((steps, np.array([
        measure(workdir, config, ctx, step)["layers"] for step in steps])))
  norms = np.stack([c[1] for c in curves])  # [seeds, checkpoints, layers]
  outcomes = {}
  for layer, column in (("first", 0), ("last", -1)):
    for when, row in (("early", 0), ("final", -1)):
      outcomes[f"{ALONG.key}:{layer}_{when}", "output_norm"] = (
          norms[:, row, column])
  table = ["| step | " + " | ".join(
      f"MoE layer {i + 1} output norm" for i in range(norms.shape[2]))
           + " |", "|---|" + "---|" * norms.shape[2]]
  for i, step in enumerate(curves[0][0]):
    table.append(f"| {step} | " + " | ".join(
        f"{m:.2f} ± {s:.2f}" for m, s in zip(
            norms[:, i].mean(0), norms[:, i].std(0, ddof=1)
            if len(seeds) > 1 else np.zeros(norms.shape[2]))) + " |")
  _plot_along(os.path.join(root, f"momentum_norms_{regime.name}.png"),
              curves[0][0], norms, regime.name)
  return outcomes, table, curves


def _plot_along(path: str, steps, norms: np.ndarray, regime: str) -> None:
  """Fig. 2's picture: each MoE layer's norm over training (mean over
  seeds, the band one std)."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(5, 3.5))
  for layer in range(norms.shape[2]):
    mean = norms[:, :, layer].mean(0)
    std = norms[:, :, layer].std(0)
    ax.plot(steps, mean, marker="o", label=f"MoE layer {layer + 1}")
    ax.fill_between(steps, mean - std, mean + std, alpha=0.2)
  ax.set(xlabel="training step", ylabel="mean MoE output norm",
         title=f"V-MoE output norm over training ({regime})")
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def main(argv=None):
  args = parse_args(__doc__.splitlines()[0], argv,
                    default_root=os.path.join("runs", "paired"))
  regimes = [(study.QUICK_REGIMES if args.quick else study.REGIMES)[r]
             for r in args.regimes]
  lines = ["# MomentumSMoE's gradient-descent picture: expert output norms "
           "(MNIST-5k)", "", __doc__.split("\n\n")[2].replace("\n", " "), "",
           f"Seeds {list(args.seeds)}; claims judged over seeds."
           + (" QUICK MODE: the numbers mean nothing." if args.quick else ""),
           ""]
  records, per_seed, along_curves = {}, {}, {}
  for regime in regimes:
    models = [k for k in MODELS[regime.name]
              if not args.quick or k in QUICK]
    candidates = [_ALL[k] for k in models]
    study.run_grid(candidates, [regime], args.seeds, args.root, args.quick,
                   args.jobs, per_image=True)
    outcomes, table = {}, ["| model | MoE output norm per layer | largest-"
                           "norm share % | smallest-norm share % | "
                           "norm-rank imbalance |", "|---|---|---|---|---|"]
    for c in candidates:
      values = [measure(study.run_dir(args.root, regime, c, s),
                        study.build_config(c, s, regime, args.quick, True))
                for s in args.seeds]
      for field in ("first/output_norm", "last/output_norm",
                    "largest/rank_share", "smallest/rank_share"):
        arm, metric = field.split("/")
        outcomes[f"{c.key}:{arm}", metric] = np.array(
            [v[field] for v in values])
      outcomes[c.key, "rank_imbalance"] = np.array(
          [v["rank_imbalance"] for v in values])
      for (key, metric), seeds in outcomes.items():
        if key.split(":")[0] == c.key:
          per_seed.setdefault(f"{regime.name}/{key}", {})[metric] = list(
              map(float, seeds))
      norms = np.array([v["layers"] for v in values])
      table.append(
          f"| {c.label} | " + ", ".join(
              f"{m:.2f} ± {s:.2f}" for m, s in zip(norms.mean(0),
                                                  norms.std(0, ddof=1)))
          + " | " + " | ".join(
              f"{np.mean(x):.2f} ± {np.std(x, ddof=1):.2f}" for x in (
                  outcomes[f"{c.key}:largest", "rank_share"],
                  outcomes[f"{c.key}:smallest", "rank_share"],
                  outcomes[c.key, "rank_imbalance"])) + " |")
    labels = {}
    for c in candidates:
      for arm in ("", ":first", ":last", ":largest", ":smallest"):
        labels[c.key + arm] = c.label + {
            "": "", ":first": ", first MoE layer",
            ":last": ", last MoE layer",
            ":largest": ", largest-norm expert",
            ":smallest": ", smallest-norm expert"}[arm]
    along, along_table, curves = along_training(
        args.root, regime, args.seeds, args.quick, args.jobs)
    outcomes.update(along)
    for (key, metric), seeds in along.items():
      per_seed.setdefault(f"{regime.name}/{key}", {})[metric] = list(
          map(float, seeds))
    along_curves[regime.name] = {"steps": curves[0][0], "output_norm": [
        c[1].tolist() for c in curves]}
    for layer in ("first", "last"):
      for when, text in (("early", "at 10% of training"),
                         ("final", "at the end of training")):
        labels[f"{ALONG.key}:{layer}_{when}"] = (
            f"V-MoE {layer} MoE layer {text}")
    claim_lines, records[regime.name] = claims_rows(
        outcomes, regime.name, claims_for(models) + along_claims(ALONG.key),
        labels)
    lines += [f"## Regime `{regime.name}`: {regime.description}", "",
              *table, "", "Fig. 2: the V-MoE's MoE output norms over "
              "training (mean ± std over seeds; "
              f"`momentum_norms_{regime.name}.png`):", "", *along_table, "",
              "Claims:", "", *claim_lines, ""]
  write_json(os.path.join(args.root, "momentum_norms.json"),
             dict(seeds=list(args.seeds), claims=records, per_seed=per_seed,
                  along_training=along_curves, quick=bool(args.quick)))
  return write_report(args.root, "momentum_norms.md", lines)


if __name__ == "__main__":
  main()
