"""PGD-10 vs APGD-CE vs AutoAttack on the default model and each router /
stream config (MNIST-5k).

    python experiments/autoattack_eval.py [--configs default symphony ...]
        [--seeds 0] [--root runs/autoattack] [--num-examples 500] [--quick]
    python experiments/autoattack_eval.py --report-only --root runs/autoattack

The question (Croce & Hein 2020): does fixed-step PGD with cross-entropy
overestimate the robustness of sparse-MoE models, and does sparse routing
mask gradients (Square, black-box, breaking points every white-box attack
failed on)? For each config and seed: training with the config's own budget
(2,500 steps), then, on the same `num_examples` test images and batches, for
eps 0.05 and 0.1 (Linf, [0, 1] images): PGD-10 (random start, step 2.5 eps /
10, as the default job), APGD-CE (100 iterations) and the AutoAttack standard
version (APGD-CE, APGD-T, FAB-T, Square 5,000 queries), each into
ROOT/r_{config}_{seed}. Writes ROOT/autoattack_eval.md: the accuracy under
each attack (mean ± std over seeds), robust accuracy after each attack of
the ensemble, the PGD overestimate and the Square-only breaks.
`--quick`: 30 training steps, 16 images, 5 iterations, 20 queries (a smoke
test of the script, seconds per config).
"""

from __future__ import annotations

import os
import sys

from common import mean_std, parse_seeds_and_root, write_report

from vmoe_ext.app.train import train_and_evaluate
from vmoe_ext.evaluate.final import after_training_hook
from vmoe_ext.reporting.writers import read_metrics
from vmoe_ext.train.config_files import load_config

CONFIGS = ("default", "xmoe", "top_p", "acmoe", "symphony", "momentum",
           "soft_moe")
EPS = (0.05, 0.1)
STAGES = ("apgd-ce", "apgd-t", "fab-t", "square")


def config_for(name: str, seed: int, num_examples: int, quick: bool):
  config = load_config(name)
  config.seed = seed
  small = dict(steps=5, queries=20) if quick else {}
  attacks = []
  for eps in EPS:
    attacks += [
        dict(name="pgd", eps=eps, steps=10, step_size=0.25 * eps,
             random_start=True),
        dict(name="apgd", eps=eps, steps=small.get("steps", 100)),
        dict(name="autoattack", eps=eps, **small)]
  r = config.robustness
  r.num_examples = num_examples
  r.attacks = tuple(attacks)
  r.sweep = None
  r.corruptions = None
  r.datasets = None
  if quick:
    config.train.total_steps = 30
  return config


def figures(workdir: str):
  """`{(attack, eps): metrics line}` of a finished run, or None."""
  if not os.path.exists(os.path.join(workdir, "report.md")):
    return None
  out = {}
  for r in read_metrics(workdir):
    split = r.get("split", "")
    if split.startswith("adversarial/"):
      out[split.split("/", 1)[1], r["eps"]] = r
    elif split == "test" and r.get("final"):
      out["clean", None] = r
  return out


def table(results: dict, seeds) -> list[str]:
  fmt = lambda v: "%.1f ± %.1f" % mean_std([100 * x for x in v])  # noqa
  lines = []
  for eps in EPS:
    lines += [f"### eps = {eps} (Linf)", "",
              "| config | clean (attacked images) | PGD-10 | APGD-CE | "
              + " | ".join(f"AA after {s}" for s in STAGES)
              + " | PGD − AA (points) | Square-only breaks |",
              "|---|" + "---|" * (5 + len(STAGES))]
    for name in results:
      runs = [results[name][s] for s in seeds]
      pgd = [r["pgd", eps]["accuracy"] for r in runs]
      apgd = [r["apgd", eps]["accuracy"] for r in runs]
      aa = [r["autoattack", eps] for r in runs]
      cells = [fmt([a["clean_accuracy"] for a in aa]), fmt(pgd), fmt(apgd)]
      cells += [fmt([a[f"robust_after/{s}"] for a in aa]) for s in STAGES]
      cells.append(fmt([p - a["robust_after/square"]
                        for p, a in zip(pgd, aa)]))
      cells.append(fmt([a["square_only"] for a in aa]) + " %")
      lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines.append("")
  return lines


def main(argv=None) -> str:
  def flags(parser):
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS))
    parser.add_argument("--num-examples", type=int, default=500)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--report-only", action="store_true")

  args = parse_seeds_and_root(__doc__.splitlines()[0], argv, flags)
  given = sys.argv[1:] if argv is None else argv
  args.seeds = args.seeds if "--seeds" in given else [0]  # Default: seed 0.
  n = 16 if args.quick else args.num_examples
  results = {}
  for name in args.configs:
    for seed in args.seeds:
      workdir = os.path.join(args.root, f"r_{name}_{seed}")
      if figures(workdir) is None and not args.report_only:
        config = config_for(name, seed, n, args.quick)
        train_and_evaluate(config, workdir,
                           after_training=after_training_hook(config,
                                                              workdir))
      got = figures(workdir)
      if got is not None:
        results.setdefault(name, {})[seed] = got
  done = {k: v for k, v in results.items()
          if all(s in v for s in args.seeds)}
  lines = ["# PGD vs APGD vs AutoAttack (MNIST-5k)", "",
           f"Seeds {args.seeds}; accuracy % (mean ± std over seeds) on "
           f"{n} test images; AutoAttack standard version; robust accuracy "
           "after each attack of the ensemble; the last two columns: how "
           "many points PGD-10 overestimates robust accuracy by, and the "
           "images only Square (black-box) broke (gradient masking).", ""]
  lines += table(done, args.seeds)
  return write_report(args.root, "autoattack_eval.md", lines)


if __name__ == "__main__":
  main()
