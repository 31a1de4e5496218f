"""Symphony router vs the V-MoE router on MNIST-5k (Symphony paper, Table 1/3).

    python experiments/symphony_vs_vmoe.py [--seeds 0 1 2] [--root runs/exp]

The paper's claim: swapping an SMoE's router for the Symphony router (same
base gating, the graph of Algorithm 1 with beta 0.9, zero init) improves
clean accuracy and, more, robustness to contaminated inputs. Here: the
default V-MoE (`configs/default.py`, noisy top-2 over E = 4) against the
same model with `configs/symphony.py` (Symphony over that router), every
other hyper-parameter shared and nothing tuned on the test split. For each
seed, training and the binary's after-training evaluation (routing analysis;
FGSM and 10-step PGD (random start) at eps 0.05 on 500 test images, as
the default job; the 15 local
corruptions at 5 severities on 500 test images), each into
ROOT/r_{config}_{seed} (a finished run there is reused, an interrupted one
resumed). Writes ROOT/symphony_vs_vmoe.md: mean ± std over seeds.
"""

from __future__ import annotations

import os

from common import mean_std, parse_seeds_and_root, write_report
from vmoe_ext.evaluate.final import after_training_hook
from vmoe_ext.reporting.writers import read_metrics
from vmoe_ext.train.config_files import load_config
from vmoe_ext.train.loop import train_and_evaluate

CONFIGS = {"V-MoE (noisy top-2)": "default",
           "Symphony over noisy top-2": "symphony"}
# (column, split of the metrics.jsonl line, key, scale)
COLUMNS = (("clean accuracy %", "test", "accuracy", 100),
           ("FGSM accuracy %", "adversarial/fgsm", "accuracy", 100),
           ("PGD accuracy %", "adversarial/pgd", "accuracy", 100),
           ("mean corruption error %", "corruption", "mean_corruption_error",
            100),
           ("load-balance score", "routing", "load_balance_mean", 1),
           ("router instability", "routing", "instability_mean", 1))


def config_for(name: str, seed: int):
  config = load_config(name)
  config.seed = seed
  config.robustness.num_examples = 500
  config.robustness.attacks = (dict(name="fgsm", eps=0.05),
                               dict(name="pgd", eps=0.05, steps=10,
                                    step_size=0.0125, random_start=True))
  config.robustness.sweep = None
  config.robustness.corruptions = dict(names=None,
                                       severities=(1, 2, 3, 4, 5))
  return config


def figures(workdir: str):
  """`{column: value}` of a finished run, or None."""
  if not os.path.exists(os.path.join(workdir, "report.md")):
    return None
  records = read_metrics(workdir)
  out = {}
  for column, split, key, scale in COLUMNS:
    rows = [r for r in records if r.get("split") == split and key in r]
    if split == "test":
      rows = [r for r in rows if r.get("final")]
    out[column] = scale * rows[-1][key] if rows else float("nan")
  return out


def main(argv=None) -> str:
  args = parse_seeds_and_root(__doc__.splitlines()[0], argv)
  results = {}
  for label, name in CONFIGS.items():
    for seed in args.seeds:
      workdir = os.path.join(args.root, f"r_{name}_{seed}")
      if figures(workdir) is None:
        config = config_for(name, seed)
        train_and_evaluate(config, workdir,
                           after_training=after_training_hook(config,
                                                              workdir))
      results[label, seed] = figures(workdir)
  lines = ["# Symphony vs V-MoE router (MNIST-5k)", "",
           f"Seeds {args.seeds}; mean ± std (sample std) over seeds. "
           "FGSM / PGD (10 steps) at eps 0.05 and the corruption suite on "
           "500 test images; accuracy on all 1,000.", "",
           "| model | " + " | ".join(c[0] for c in COLUMNS) + " |",
           "|---|" + "---|" * len(COLUMNS)]
  for label in CONFIGS:
    cells = []
    for column, *_ in COLUMNS:
      values = [results[label, s][column] for s in args.seeds]
      cells.append("%.2f ± %.2f" % mean_std(values))
    lines.append(f"| {label} | " + " | ".join(cells) + " |")
  lines += ["", "Per seed:", ""]
  for (label, seed), row in results.items():
    lines.append(f"- {label}, seed {seed}: " + ", ".join(
        f"{c} {v:.3f}" for c, v in row.items()))
  return write_report(args.root, "symphony_vs_vmoe.md", lines)


if __name__ == "__main__":
  main()
