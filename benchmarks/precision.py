"""The default job trained in float32 and in bfloat16 compute: test accuracy.

    python benchmarks/precision.py [--quick] [--steps N] [--seeds S ...]

Issue "Accelerator-ready compute", item 1: the default job (`python -m
vmoe_ext.main` with its embedded config, `configs/default.py`: a 4-block
V-MoE on MNIST-5k, 2,500 AdamW steps) is trained on each seed twice, with
`model.dtype="float32"` (today's job) and `model.dtype="bfloat16"` (float32
parameters and optimizer state, `vmoe_ext.models.precision`). The
robustness section keeps only the clean evaluation, on all 1,000 test
images, with `per_example` on: each image's top-1 correctness, so the two
precisions are compared image by image and seed by seed
(`experiments/paired_stats.py`: the gap's standard error has the seeds'
and the test sample's parts).

The goal is a bfloat16 accuracy within 0.5 points of the float32 one: a
claim of no effect with margin 0.5, "reproduced" when the gap's 95%
interval lies within +-0.5 points, "contradicted" when it lies wholly
outside, else "undecidable here" (`paired_stats.judge`; three seeds or
more).

On a CPU bfloat16 is emulated (slower than float32, not faster): the wall
times say nothing about an accelerator. `--quick` trains 60 steps on seed
0 (CI); `--steps N` any other length; `--seeds` (default 0 1 2; seed 0
alone with `--quick`). The last line printed is one JSON object: per seed
the two accuracies and the gap (points, bfloat16 - float32), the gap's
mean, seed std, standard error, 95% half-width, the minimum detectable
difference, the verdict, and the seconds of each run.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.join(ROOT, "experiments"))
from common import machine, print_json_last  # noqa: E402
import numpy as np  # noqa: E402
from paired_stats import judge, paired_images  # noqa: E402

from vmoe_ext.evaluate import per_example  # noqa: E402

FULL_STEPS = 2500  # `configs/default.py`'s total_steps.
QUICK_STEPS = 60
GOAL_POINTS = 0.5
DTYPES = ("float32", "bfloat16")
SEEDS = (0, 1, 2)


def clean_outcomes(workdir: str) -> np.ndarray:
  """`[1000]` bool: each test image's top-1 correctness in the run's final
  clean evaluation (`per_example.npz`, in test-split order)."""
  clean = per_example.load(workdir)["clean"]
  order = np.argsort(clean["index"])
  return clean["correct"][order]


def train(dtype: str, steps: int, seed: int, workdir: str
          ) -> tuple[np.ndarray, float]:
  """`(per-image correctness, seconds)` of the default job on `seed` in
  `dtype` compute."""
  command = [sys.executable, "-m", "vmoe_ext.main", f"--workdir={workdir}",
             f"--config.train.total_steps={steps}", f"--config.seed={seed}",
             "--config.robustness.attacks=()",
             "--config.robustness.sweep=None",
             "--config.robustness.corruptions=None",
             "--config.robustness.num_examples=None",
             "--config.robustness.per_example=True",
             f"--config.model.dtype={dtype}"]
  start = time.perf_counter()
  subprocess.run(command, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
  return clean_outcomes(workdir), time.perf_counter() - start


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true",
                      help=f"{QUICK_STEPS} steps on seed 0 instead of "
                           f"{FULL_STEPS} on seeds {SEEDS}")
  parser.add_argument("--steps", type=int, default=None,
                      help="training steps (overrides --quick)")
  parser.add_argument("--seeds", type=int, nargs="+", default=None,
                      help="the seeds (config.seed) to train")
  args = parser.parse_args(argv)
  steps = args.steps or (QUICK_STEPS if args.quick else FULL_STEPS)
  seeds = args.seeds or ((0,) if args.quick else SEEDS)
  figures: dict = {"steps": steps, "seeds": list(seeds),
                   "machine": machine(),
                   "load_average_1min": os.getloadavg()[0]}
  outcomes: dict = {dtype: [] for dtype in DTYPES}
  with tempfile.TemporaryDirectory() as tmp:
    for seed in seeds:
      row = {}
      for dtype in DTYPES:
        correct, seconds = train(dtype, steps, seed,
                                 os.path.join(tmp, f"{dtype}_{seed}"))
        outcomes[dtype].append(correct)
        row[f"accuracy_{dtype}"] = float(correct.mean())
        row[f"seconds_{dtype}"] = round(seconds, 1)
        print(f"seed {seed}, {dtype}: test accuracy {correct.mean():.4f} "
              f"after {steps} steps ({seconds:.0f} s)", flush=True)
      row["gap_points"] = round(100.0 * (row["accuracy_bfloat16"]
                                         - row["accuracy_float32"]), 2)
      figures[f"seed_{seed}"] = row
  diff = paired_images(np.stack(outcomes["float32"]),
                       np.stack(outcomes["bfloat16"]))
  figures.update(
      gap_points_mean=round(diff.mean, 3),
      gap_points_seed_std=round(diff.seed_std, 3),
      gap_se=round(diff.se, 3), gap_df=round(diff.df, 1),
      gap_half_width_95=round(diff.critical * diff.se, 3),
      mdd_points=round(diff.mdd, 3),
      discordant_bfloat16_right_float32_right=diff.discordant,
      verdict=judge(diff, better=+1, margin=GOAL_POINTS))
  print_json_last(figures)


if __name__ == "__main__":
  main()
