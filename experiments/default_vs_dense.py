"""The default V-MoE vs a dense ViT of equal active width on MNIST-5k.

    python experiments/default_vs_dense.py [--seeds 0 1 2] [--root runs/exp]

Trains `configs/default.py` and `configs/vit_dense.py` (":active": the MoE
blocks replaced by dense MLPs of width K*H) for each seed (training and clean
evaluation only: the robustness section is dropped), each into
ROOT/r_{config}_{seed} (a finished run there is reused, an interrupted one
resumed), and writes ROOT/default_vs_dense.md with test accuracy mean ± std
over seeds and wall times. Nothing was tuned on the test split: both configs
share every hyper-parameter except the MoE layers.
"""

from __future__ import annotations

import os
import re
import statistics

from common import mean_std, parse_seeds_and_root, write_report
from vmoe_ext.reporting.writers import read_metrics
from vmoe_ext.train.config_files import load_config
from vmoe_ext.app.train import train_and_evaluate

CONFIGS = ("default", "vit_dense")


def final_accuracy(workdir: str):
  path = os.path.join(workdir, "metrics.jsonl")
  if not os.path.exists(path):
    return None
  finals = [r for r in read_metrics(workdir) if r.get("final")]
  return finals[-1]["accuracy"] if finals else None


def wall_time(workdir: str) -> float:
  text = open(os.path.join(workdir, "report.md")).read()
  return float(re.search(r"Wall time: ([0-9.]+) s", text).group(1))


def main(argv=None) -> str:
  args = parse_seeds_and_root(__doc__.splitlines()[0], argv)
  results = {}
  for name in CONFIGS:
    for seed in args.seeds:
      workdir = os.path.join(args.root, f"r_{name}_{seed}")
      if final_accuracy(workdir) is None:
        config = load_config(name)
        del config["robustness"]
        config.seed = seed
        train_and_evaluate(config, workdir)
      results[name, seed] = (final_accuracy(workdir), wall_time(workdir))
  lines = ["# Default V-MoE vs dense ViT of equal active width (MNIST-5k)",
           "", f"Seeds: {args.seeds}. Test accuracy on the 1,000 MNIST-5k "
           "test images after 2,500 steps; wall time of training + clean "
           "evaluation (the first run of each config also pays compilation).",
           "", "| model | accuracy (mean ± std) | per seed | wall s (mean) |",
           "|---|---|---|---|"]
  for name in CONFIGS:
    accs = [results[name, s][0] for s in args.seeds]
    walls = [results[name, s][1] for s in args.seeds]
    mean, std = mean_std(accs)
    lines.append(f"| {name} | {100 * mean:.2f} ± "
                 f"{100 * std:.2f}% | "
                 + ", ".join(f"{100 * a:.1f}" for a in accs)
                 + f" | {statistics.mean(walls):.0f} |")
  return write_report(args.root, "default_vs_dense.md", lines)


if __name__ == "__main__":
  main()
