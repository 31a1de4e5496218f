"""Shared by the experiment scripts: mean ± std over seeds, the report file,
and the robustness comparisons' config, figures and table."""

from __future__ import annotations

import argparse
import math
import os
import statistics
from typing import Callable, Optional, Sequence

from vmoe_ext.train.config_files import load_config


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


def config_for(name: str, seed: int, arg: Optional[str] = None):
  """`configs/NAME.py[:ARG]` with `seed` and the shared robustness section:
  FGSM and 10-step PGD (random start) at eps 0.05 and the 15 corruptions at
  severities 1-5, on 500 test images; no eps sweep. A config without a
  robustness section (a language model: its attack is the word swap) gets
  only the seed."""
  config = load_config(name, arg)
  config.seed = seed
  if "robustness" not in config:
    return config
  config.robustness.num_examples = 500
  config.robustness.attacks = (dict(name="fgsm", eps=0.05),
                               dict(name="pgd", eps=0.05, steps=10,
                                    step_size=0.0125, random_start=True))
  config.robustness.sweep = None
  config.robustness.corruptions = dict(names=None,
                                       severities=(1, 2, 3, 4, 5))
  return config


# The paired evaluation's PGD-10 radii: 0.05 as before, and the radii at
# which the default V-MoE's PGD accuracy is within 30-70% (MNIST-5k's PGD
# sweep, experiments/results/moe_robustness.md: 65.9% at 0.03 by default,
# 60.8% at 0.01 in low data).
PAIRED_PGD_EPS = (0.01, 0.03, 0.05)


def paired_evaluation(config):
  """`config`'s robustness section for per-image paired statistics: every
  attack on all 1,000 test images (FGSM at eps 0.05, PGD-10 with random
  start at each of `PAIRED_PGD_EPS`, step eps / 4; the word-swap analogue
  `patch_swap`: 2.5% of the patches, at least one, replaced by a grey
  patch, the papers' attacked-PPL setting), the 15 corruptions at
  severities 1-5 on 500 of them, and `per_example` (each image's outcome,
  `vmoe_ext.evaluate.per_example`)."""
  config.robustness.num_examples = None
  config.robustness.attacks = (dict(name="fgsm", eps=0.05),) + tuple(
      dict(name="pgd", eps=e, steps=10, step_size=e / 4, random_start=True)
      for e in PAIRED_PGD_EPS)
  config.robustness.attacks += (dict(
      name="patch_swap", patch_size=tuple(config.model.patch_size),
      rate=0.025, value=0.5),)
  config.robustness.corruptions = dict(names=None,
                                       severities=(1, 2, 3, 4, 5),
                                       num_examples=500)
  config.robustness.per_example = True
  return config


def describe_evaluation(config) -> str:
  """What `config`'s robustness section evaluates, with its real numbers:
  "FGSM / PGD-2 at eps 0.05 and the corruption suite (severities 1, 5) on 32
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
    eps = sorted({a["eps"] for a in rob.attacks
                  if a.get("eps") is not None})
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
