"""Shared benchmark helpers: side-by-side timing and XLA cost analysis.

Also the full-train-step harness shared by `router_overhead.py` and
`stream_overhead.py`: `image_batch`, `compile_train_steps` (the project's
jitted, donated step compiled ahead of time, with its XLA FLOP count) and
`time_train_steps` (interleaved timing of those steps plus an A/A control).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from typing import Any, Callable, Mapping, Optional

import jax
import jax.numpy as jnp
import numpy as np


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


def overhead_figures(quick: bool, load: Any, ms: Mapping[str, float],
                     flops: Mapping[str, float],
                     references: Mapping[str, str]) -> dict[str, Any]:
  """The JSON figures of a train-step overhead benchmark.

  `references` maps each candidate to the one it is compared with; gives
  `{name}_overhead` (time ratio - 1) and `{name}_flops_overhead` for each,
  `control_overhead` (the A/A control vs "baseline"), and every
  candidate's `_ms_per_step` / `_gflops_per_step`.
  """
  figures: dict[str, Any] = {"quick": bool(quick),
                             "device": jax.devices()[0].device_kind,
                             "load_average": load}
  for name, ref in references.items():
    figures[f"{name}_overhead"] = ms[name] / ms[ref] - 1
    figures[f"{name}_flops_overhead"] = flops[name] / flops[ref] - 1
  figures["control_overhead"] = ms["control"] / ms["baseline"] - 1
  figures.update({f"{n}_ms_per_step": v for n, v in ms.items()})
  figures.update({f"{n}_gflops_per_step": v / 1e9 for n, v in flops.items()})
  return figures


def parse_args(description: str, argv=None) -> argparse.Namespace:
  """The flags every benchmark takes: `--quick` and `--repeats`."""
  parser = argparse.ArgumentParser(description=description)
  parser.add_argument("--quick", action="store_true", help="small shapes")
  parser.add_argument("--repeats", type=int, default=7,
                      help="interleaved timed repetitions (median reported)")
  return parser.parse_args(argv)


def image_batch(batch: int, image: int, num_classes: int = 10,
                seed: int = 0) -> dict[str, jax.Array]:
  """A fixed random batch of `batch` RGB images `image x image` and labels."""
  rng = np.random.default_rng(seed)
  return {"image": jnp.asarray(rng.random((batch, image, image, 3),
                                          np.float32)),
          "label": jnp.asarray(rng.integers(0, num_classes, batch),
                               jnp.int32)}


def compile_train_steps(model_configs: Mapping[str, Mapping[str, Any]],
                        batch: Mapping[str, jax.Array],
                        optimizer: Mapping[str, Any]
                        ) -> tuple[dict[str, Any], dict[str, Any],
                                   dict[str, float]]:
  """The project's train step for each model config, compiled ahead of time.

  For each `name -> model config`: the model is built and initialised (the
  same keys for every candidate), and `make_train_step` (forward, backward,
  optimizer update, NaN guard) is jitted with the state donated, lowered on
  `batch` and compiled once. Returns `(compiled, states, flops)`, each keyed
  by name; `flops` is the XLA cost analysis of that executable (as
  `xla_flops`, without a second compile).
  """
  from vmoe_ext.models import build_model
  from vmoe_ext.train.optimizer import make_learning_rate, make_optimizer
  from vmoe_ext.train.state import TrainState
  from vmoe_ext.train.steps import make_train_step

  tx = make_optimizer(dict(optimizer))
  lr = make_learning_rate(dict(optimizer))
  compiled, states, flops = {}, {}, {}
  for name, config in model_configs.items():
    model = build_model(dict(config))
    init_key, state_key = jax.random.split(jax.random.key(0))
    variables = jax.jit(model.init)(init_key, batch["image"])
    states[name] = TrainState.create(variables, tx, state_key)
    compiled[name], flops[name] = compile_donated(
        make_train_step(model, learning_rate_fn=lr), states[name], batch)
  return compiled, states, flops


def compile_donated(step: Any, state: Any, batch: Any) -> tuple[Any, float]:
  """`step(state, batch)` jitted with the state donated, compiled ahead of
  time, and its XLA FLOPs (cost analysis of that executable)."""
  compiled = jax.jit(step, donate_argnums=0).lower(state, batch).compile()
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  return compiled, float(cost.get("flops", float("nan")))


def time_train_steps(compiled: dict[str, Any], states: dict[str, Any],
                     batch: Mapping[str, jax.Array], steps: int, repeats: int,
                     control: Optional[str] = "baseline"
                     ) -> tuple[dict[str, float], list[float],
                                dict[str, int]]:
  """Milliseconds per train step of each compiled step, side by side.

  `control`: when set, adds the A/A candidate "control" (that candidate's
  executable again, on its own copy of the state), whose deviation from it
  is the timing noise of the run. One sample is `steps` consecutive steps on
  the candidate's own state, carried over from sample to sample (the old
  buffers are donated; no copy in the timed region); `time_side_by_side`
  with one warm-up. `compiled` and `states` are updated in place. Returns
  `(ms per step, [load average before, after], non-finite steps skipped)`.
  """
  if control is not None:
    compiled["control"] = compiled[control]
    states["control"] = jax.tree.map(jnp.copy, states[control])

  def run(name):
    state = states[name]
    for _ in range(steps):
      state, _ = compiled[name](state, batch)
    states[name] = state  # The old buffers were donated.
    return state.params

  load = [os.getloadavg()[0]]  # Other jobs on the machine skew the timings.
  seconds = time_side_by_side({n: (lambda n=n: run(n)) for n in compiled},
                              repeats, warmup=1)
  load.append(os.getloadavg()[0])
  ms = {n: v / steps * 1e3 for n, v in seconds.items()}
  skipped = {n: int(jax.device_get(st.nonfinite_count))
             for n, st in states.items()}
  return ms, load, skipped
