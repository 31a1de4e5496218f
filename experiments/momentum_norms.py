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

Fig. 2 (the norms over training epochs) needs checkpoints kept along
training; the runs keep their last two, so it is not measured. Each claim is
judged over seeds (`paired_stats.paired_seeds`: a model-level value, no
per-image term). About 3 minutes on the 2-core CPU once the runs exist.
"""

from __future__ import annotations

import os

import numpy as np

import study
from common import write_report
from momentum_depth import CANDIDATES as DEPTH_CANDIDATES
from momentum_layout import CANDIDATES as LAYOUT_CANDIDATES
from paired_claims import claims_rows, write_json
from study import Claim, parse_args
from vmoe_ext.app.context import RunContext
from vmoe_ext.evaluate.expert_norms import expert_norms

_ALL = {c.key: c for c in LAYOUT_CANDIDATES + DEPTH_CANDIDATES}
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


def measure(workdir: str, config) -> dict[str, float]:
  """The run's expert-norm values (`ANALYSIS_METRICS`), from its last
  checkpoint on the whole test split."""
  ctx = RunContext.assemble(config)
  ctx.open_evaluation(workdir)
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
  records, per_seed = {}, {}
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
    claim_lines, records[regime.name] = claims_rows(
        outcomes, regime.name, claims_for(models), labels)
    lines += [f"## Regime `{regime.name}`: {regime.description}", "",
              *table, "", "Claims:", "", *claim_lines, ""]
  write_json(os.path.join(args.root, "momentum_norms.json"),
             dict(seeds=list(args.seeds), claims=records, per_seed=per_seed,
                  quick=bool(args.quick)))
  return write_report(args.root, "momentum_norms.md", lines)


if __name__ == "__main__":
  main()
