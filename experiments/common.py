"""Shared by the experiment scripts: mean ± std over seeds, the report file,
and the robustness comparisons' config, figures and table."""

from __future__ import annotations

import argparse
import math
import os
import statistics
from typing import Any, Callable, Optional, Sequence

from vmoe_ext.evaluate.final import after_training_hook
from vmoe_ext.reporting.writers import read_metrics
from vmoe_ext.train.config_files import load_config
from vmoe_ext.app.train import train_and_evaluate


def parse_seeds_and_root(description: str,
                         argv: Optional[Sequence[str]] = None,
                         add_arguments: Optional[Callable[
                             [argparse.ArgumentParser], None]] = None
                         ) -> argparse.Namespace:
  """`--seeds` (default 0 1 2) and `--root` (default runs/exp), plus any
  flags `add_arguments(parser)` adds."""
  parser = argparse.ArgumentParser(description=description)
  parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
  parser.add_argument("--root", default=os.path.join("runs", "exp"))
  if add_arguments is not None:
    add_arguments(parser)
  return parser.parse_args(argv)


def mean_std(values: Sequence[float]) -> tuple[float, float]:
  """Mean and sample standard deviation (0 for a single seed; NaN for both
  if a value is missing)."""
  if any(math.isnan(v) for v in values):
    return float("nan"), float("nan")
  std = statistics.stdev(values) if len(values) > 1 else 0.0
  return statistics.mean(values), std


def write_report(root: str, filename: str, lines: Sequence[str]) -> str:
  """Writes the markdown `lines` to ROOT/FILENAME, prints and returns it."""
  text = "\n".join(lines) + "\n"
  os.makedirs(root, exist_ok=True)
  with open(os.path.join(root, filename), "w") as f:
    f.write(text)
  print(text)
  return text


# ---------------------------------------------------------------------------
# Robustness comparisons (symphony_vs_vmoe.py, momentum_vs_vmoe.py): the same
# after-training evaluation for every candidate, and the table of its figures.

# (column, split of the metrics.jsonl line, key, scale)
COLUMNS = (("clean accuracy %", "test", "accuracy", 100),
           ("FGSM accuracy %", "adversarial/fgsm", "accuracy", 100),
           ("PGD accuracy %", "adversarial/pgd", "accuracy", 100),
           ("mean corruption error %", "corruption", "mean_corruption_error",
            100),
           ("load-balance score", "routing", "load_balance_mean", 1),
           ("router instability", "routing", "instability_mean", 1))


def config_for(name: str, seed: int, arg: Optional[str] = None):
  """`configs/NAME.py[:ARG]` with `seed` and the shared robustness section:
  FGSM and 10-step PGD (random start) at eps 0.05 and the 15 corruptions at
  severities 1-5, on 500 test images; no eps sweep."""
  config = load_config(name, arg)
  config.seed = seed
  config.robustness.num_examples = 500
  config.robustness.attacks = (dict(name="fgsm", eps=0.05),
                               dict(name="pgd", eps=0.05, steps=10,
                                    step_size=0.0125, random_start=True))
  config.robustness.sweep = None
  config.robustness.corruptions = dict(names=None,
                                       severities=(1, 2, 3, 4, 5))
  return config


def describe_evaluation(config) -> str:
  """What `config`'s robustness section evaluates, with its real numbers:
  "FGSM / PGD-2 at eps 0.05 and the corruption suite (severities 3) on 32
  test images, clean accuracy on the whole test split." (e.g. study.py's
  quick-mode report header)."""
  rob = config.get("robustness")
  if rob is None:
    return "Clean accuracy on the whole test split; no robustness evaluation."
  attacks = []
  for a in rob.attacks:
    name = a["name"].upper() + (f"-{a['steps']}" if a.get("steps") else "")
    attacks.append(name + (f" on {a['num_examples']}"
                           if a.get("num_examples") else ""))
  parts = []
  if attacks:
    eps = sorted({a.get("eps") for a in rob.attacks})
    parts.append(" / ".join(attacks)
                 + f" at eps {', '.join(f'{e:g}' for e in eps)}")
  if rob.get("sweep"):
    sweep = rob.sweep
    name = sweep["attack"]["name"].upper()
    steps = sweep["attack"].get("steps")
    parts.append(f"a {name}{f'-{steps}' if steps else ''} eps sweep")
  corr = rob.get("corruptions")
  if corr is not None:
    severities = ", ".join(str(v) for v in corr["severities"])
    names = corr.get("names")
    parts.append(f"{'the corruption suite' if not names else ', '.join(names)}"
                 f" (severities {severities})")
  n = rob.get("num_examples")
  where = f"{n} test images" if n else "the whole test split"
  return (" and ".join(parts) + f" on {where}, " if parts else "") + (
      "clean accuracy on the whole test split.")


def figures(workdir: str):
  """`{column: value}` of a finished run (NaN where a figure is missing), or
  None if the run has not finished."""
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


def train_or_reuse(config_factory: Callable[[], Any], workdir: str):
  """The figures of the run in `workdir`, training it (with the
  after-training evaluation) first unless it has finished; an interrupted run
  resumes from its checkpoint."""
  if figures(workdir) is None:
    config = config_factory()
    train_and_evaluate(config, workdir,
                       after_training=after_training_hook(config, workdir))
  return figures(workdir)


def figures_table(labels: Sequence[str], seeds: Sequence[int],
                  results: dict) -> list[str]:
  """Markdown table of mean ± std over `seeds` of `results[label, seed]`
  (a `figures` dict) per label, then the per-seed values."""
  lines = ["| model | " + " | ".join(c[0] for c in COLUMNS) + " |",
           "|---|" + "---|" * len(COLUMNS)]
  for label in labels:
    cells = []
    for column, *_ in COLUMNS:
      values = [results[label, s][column] for s in seeds]
      cells.append("%.2f ± %.2f" % mean_std(values))
    lines.append(f"| {label} | " + " | ".join(cells) + " |")
  lines += ["", "Per seed:", ""]
  for (label, seed), row in results.items():
    lines.append(f"- {label}, seed {seed}: " + ", ".join(
        f"{c} {v:.3f}" for c, v in row.items()))
  return lines
