"""Shared benchmark helpers: side-by-side timing and XLA cost analysis."""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from typing import Any, Callable, Mapping

import jax


def xla_flops(fn: Callable, *args: Any) -> float:
  """FLOPs XLA counts for the compiled `fn(*args)` (cost analysis)."""
  cost = jax.jit(fn).lower(*args).compile().cost_analysis()
  if isinstance(cost, (list, tuple)):  # Older jax returned one dict per device.
    cost = cost[0]
  return float(cost.get("flops", float("nan")))


def time_side_by_side(fns: Mapping[str, Callable[[], Any]], repeats: int,
                      warmup: int = 2) -> dict[str, float]:
  """Median wall seconds of each zero-argument function.

  Runs are interleaved (round-robin over the functions, `repeats` rounds) so
  that drifts of the machine's speed affect every candidate alike.
  """
  for fn in fns.values():
    for _ in range(warmup):
      jax.block_until_ready(fn())
  samples: dict[str, list[float]] = {name: [] for name in fns}
  for _ in range(repeats):
    for name, fn in fns.items():
      start = time.perf_counter()
      jax.block_until_ready(fn())
      samples[name].append(time.perf_counter() - start)
  return {name: statistics.median(s) for name, s in samples.items()}


def machine() -> str:
  dev = jax.devices()[0]
  return (f"{platform.machine()} {os.cpu_count()} cpus, "
          f"jax {jax.__version__} on {dev.platform} ({dev.device_kind})")


def print_json_last(figures: Mapping[str, Any]) -> None:
  print(json.dumps(dict(figures), sort_keys=True))


def parse_args(description: str, argv=None) -> argparse.Namespace:
  """The flags every benchmark takes: `--quick` and `--repeats`."""
  parser = argparse.ArgumentParser(description=description)
  parser.add_argument("--quick", action="store_true", help="small shapes")
  parser.add_argument("--repeats", type=int, default=7,
                      help="interleaved timed repetitions (median reported)")
  return parser.parse_args(argv)
