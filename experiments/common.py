"""Shared by the experiment scripts: mean ± std over seeds, the report file."""

from __future__ import annotations

import argparse
import os
import statistics
from typing import Optional, Sequence


def parse_seeds_and_root(description: str,
                         argv: Optional[Sequence[str]] = None
                         ) -> argparse.Namespace:
  """`--seeds` (default 0 1 2) and `--root` (default runs/exp)."""
  parser = argparse.ArgumentParser(description=description)
  parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
  parser.add_argument("--root", default=os.path.join("runs", "exp"))
  return parser.parse_args(argv)


def mean_std(values: Sequence[float]) -> tuple[float, float]:
  """Mean and sample standard deviation (0 for a single seed)."""
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
