"""The default job trained in float32 and in bfloat16 compute: test accuracy.

    python benchmarks/precision.py [--quick] [--steps N]

Issue "Accelerator-ready compute", item 1: the default job (`python -m
vmoe_ext.main` with its embedded config, `configs/default.py`: a 4-block
V-MoE on MNIST-5k, 2,500 AdamW steps) is trained twice from the same seed,
with `model.dtype="float32"` (today's job) and `model.dtype="bfloat16"`
(float32 parameters and optimizer state, `vmoe_ext.models.precision`); the
robustness section is off (only the clean test accuracy is compared). The
goal is a bfloat16 accuracy within 0.5 points of the float32 one.

On a CPU bfloat16 is emulated (slower than float32, not faster): the wall
times say nothing about an accelerator. `--quick` trains 60 steps (CI);
`--steps N` any other length. The last line printed is one JSON object:
`accuracy_float32`, `accuracy_bfloat16` (fractions), `gap_points`
(100 x (bfloat16 - float32)), `within_goal` (|gap| <= 0.5), the steps and
the seconds of each run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import machine, print_json_last  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FULL_STEPS = 2500  # `configs/default.py`'s total_steps.
QUICK_STEPS = 60
GOAL_POINTS = 0.5
DTYPES = ("float32", "bfloat16")


def final_accuracy(workdir: str) -> float:
  """The clean test accuracy of the run's final evaluation
  (`metrics.jsonl`: the line with `"final": true` and `accuracy`)."""
  accuracy = None
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    for line in f:
      record = json.loads(line)
      if record.get("final") and "accuracy" in record:
        accuracy = float(record["accuracy"])
  if accuracy is None:
    raise RuntimeError(f"no final accuracy in {workdir}/metrics.jsonl")
  return accuracy


def train(dtype: str, steps: int, workdir: str) -> tuple[float, float]:
  """`(test accuracy, seconds)` of the default job in `dtype` compute."""
  command = [sys.executable, "-m", "vmoe_ext.main", f"--workdir={workdir}",
             f"--config.train.total_steps={steps}",
             "--config.robustness=None", f"--config.model.dtype={dtype}"]
  start = time.perf_counter()
  subprocess.run(command, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
  return final_accuracy(workdir), time.perf_counter() - start


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true",
                      help=f"{QUICK_STEPS} steps instead of {FULL_STEPS}")
  parser.add_argument("--steps", type=int, default=None,
                      help="training steps (overrides --quick)")
  args = parser.parse_args(argv)
  steps = args.steps or (QUICK_STEPS if args.quick else FULL_STEPS)
  figures: dict = {"steps": steps, "machine": machine(),
                   "load_average_1min": os.getloadavg()[0]}
  with tempfile.TemporaryDirectory() as tmp:
    for dtype in DTYPES:
      accuracy, seconds = train(dtype, steps, os.path.join(tmp, dtype))
      figures[f"accuracy_{dtype}"] = accuracy
      figures[f"seconds_{dtype}"] = round(seconds, 1)
      print(f"{dtype}: test accuracy {accuracy:.4f} after {steps} steps "
            f"({seconds:.0f} s)", flush=True)
  gap = 100.0 * (figures["accuracy_bfloat16"] - figures["accuracy_float32"])
  figures["gap_points"] = round(gap, 2)
  figures["within_goal"] = abs(gap) <= GOAL_POINTS
  print_json_last(figures)


if __name__ == "__main__":
  main()
