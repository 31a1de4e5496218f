"""Accelerator benchmark: train-step time, MFU and memory of the paper models.

    python benchmarks/accelerator.py [--quick] [--repeats N] [--budget-s S]
        [--models A,B] [--overheads all|swin|lm|none] [--json-out F]

Issue 48, deliverable 6. Runs on whatever backend JAX finds
(`jax.default_backend()`, `jax.devices()[0].device_kind`), one device. For
V-MoE S/32 Every-2, V-MoE B/16 Last-2, SoftMoE S/16, Swin-MoE-S top-2 and
the dense ViT-S/32 and B/16 (`accelerator_models.MODELS`: their ImageNet
configs at the per-device batch of the recipe's hardware, 224 px), each is
trained by the project's jitted, donated step (`common.compile_train_steps`:
forward, backward, AdamW update with clipping, NaN guard; no mixup) on a
fixed random batch, and for each candidate the JSON has:

* `ms_per_step`, `images_per_s` (`common.time_train_steps`: interleaved
  candidates of one model, median of `--repeats` samples of `STEPS` steps);
* `gflops_per_step`: XLA's cost analysis of the compiled step
  (`compiled.cost_analysis()["flops"]`; XLA counts a multiply-add as 2);
* `mfu`: those FLOPs per second over the device's dense peak in the
  candidate's compute dtype (`accelerator_models.PEAK_TFLOPS`; null on a
  CPU or an unknown device); for a remat candidate the FLOPs of the same
  candidate without remat (model FLOPs), `hfu` with its own count;
* `peak_bytes`: `compiled.memory_analysis().peak_memory_in_bytes` (XLA's
  plan), `compile_s`; on a GPU also `device_peak_bytes_in_use`
  (`device.memory_stats()`, the process' peak so far: it only grows).

Candidates per model (`accelerator_models.AXES`, each a config override):
the config as it is (float32), `model.dtype` bfloat16 with float32
parameters, `model.remat` full (in bfloat16 where it exists),
`model.attention` "cudnn" (on a GPU), each `model.moe.dispatcher` (V-MoE
only), and for the two V-MoEs the dense ViT of
equal active FLOPs (`dense_equivalent_mlp_dim`): `moe_over_dense` = the MoE
step time over that dense step's in the same dtype (goal <= 1.25 on one
H100 in bfloat16). An axis whose model field does not exist yet is listed
in `skipped` with the reason instead of being measured.

Then the host input pipeline (`input_pipeline.measure_host`: images/s per
core of the V-MoE paper's train preprocessing on this host, and the cores
needed to feed the fastest measured V-MoE S/32 step), and the router and
stream overheads at Swin-MoE-S (`accelerator_overheads`) and the language
model's at Switch-medium (`accelerator_lm`; not with `--quick`), next to
the papers' own efficiency tables. `--budget-s` stops starting new groups once
that many seconds have passed (the rest are listed in `skipped`);
`--models` / `--overheads` choose the groups (a later run can measure the
ones a budget cut); `--json-out PATH` also writes the figures to PATH, after each model too
(`"partial": true` until the end).

`--quick` (CI on a CPU, where one train-step compile takes seconds):
V-MoE S/32 Every-2 and its dense equivalent only, at small shapes
(`accelerator_models.QUICK`: 32x32 images, patch 8, 2 blocks of D = 64),
batch 16, and the overheads of `accelerator_overheads.QUICK` on that
V-MoE instead of Swin-MoE-S.
The last line is one JSON object: `backend`, `device_kind`, `jax`,
`models` {model: {candidate: figures}}, `moe_over_dense`, `host_pipeline`,
`overheads`, `paper_overheads`, `goals`, `skipped`.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from typing import Any, Callable, Mapping, Optional

import jax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import accelerator_lm  # noqa: E402
import accelerator_models as am  # noqa: E402
import accelerator_overheads as ao  # noqa: E402
from common import (compile_train_steps, image_batch,  # noqa: E402
                    machine, print_json_last, time_train_steps)
from router_overhead import OPTIMIZER  # noqa: E402

STEPS = 5  # Train steps per timed sample (2 with --quick).
GOALS = {"vmoe_b16_last2_bf16_mfu_min": 0.35, "moe_over_dense_max": 1.25,
         "host_over_step_min_16_cores": 1.0,
         "where": "one H100, bfloat16"}


def _dtype(candidate_config: Mapping[str, Any]) -> str:
  return str(candidate_config.get("dtype", "float32"))


def candidates(name: str, config: dict, skipped: dict) -> dict[str, dict]:
  """Candidate label -> model config of one model (module docstring)."""
  out = {"float32": config}
  dtypes, why = am.axis_overrides("dtype", config)
  if why:
    skipped.setdefault("dtype", why)
  else:
    out["bfloat16"] = dtypes["bfloat16"]
  best = out.get("bfloat16", config)
  remats, why = am.axis_overrides("remat", best)
  if why:
    skipped.setdefault("remat", why)
  else:
    out[f"{_dtype(best)}_remat_full"] = remats["full"]
  if jax.default_backend() != "gpu":
    skipped.setdefault("attention", "the cuDNN candidate runs on a GPU only "
                       "(benchmarks/attention.py: plain vs fused on a CPU)")
  else:
    attention, why = am.axis_overrides("attention", best)
    if why:
      skipped.setdefault("attention", why)
    else:
      out[f"{_dtype(best)}_cudnn"] = attention["cudnn"]
  if name in am.DENSE_EQUIVALENT:
    dispatchers, _ = am.axis_overrides("dispatcher", best)
    for label, c in dispatchers.items():
      if c["moe"]["dispatcher"] != config["moe"].get("dispatcher"):
        out[f"{_dtype(best)}_{label}"] = c
  return out


def measure(configs: Mapping[str, dict], batch: int, image: int, steps: int,
            repeats: int, control: Optional[str] = None
            ) -> dict[str, dict[str, Any]]:
  """The figures of each candidate of one group, timed side by side."""
  data = image_batch(batch, image, num_classes=next(
      iter(configs.values()))["num_classes"])
  compiled, states, flops, compile_s, failed = {}, {}, {}, {}, {}
  for label, config in configs.items():
    start = time.perf_counter()
    try:
      c, s, f = compile_train_steps({label: config}, data, OPTIMIZER)
    except Exception as e:  # pylint: disable=broad-except
      # E.g. out of device memory at a paper batch: the others still run.
      failed[label] = f"{type(e).__name__}: {str(e)[:300]}"
      print(f"  {label}: {failed[label]}", flush=True)
      continue
    compile_s[label] = time.perf_counter() - start
    compiled.update(c)
    states.update(s)
    flops.update(f)
  ms, load, skipped = time_train_steps(compiled, states, data, steps,
                                       repeats, control=control)
  kind = jax.devices()[0].device_kind
  out = {}
  for label in compiled:
    config = configs.get(label, configs.get(control or "", {}))
    memory = compiled[label].memory_analysis()
    f = flops[label] if label in flops else flops[control]
    out[label] = {
        "ms_per_step": ms[label], "images_per_s": batch / ms[label] * 1e3,
        "gflops_per_step": f / 1e9,
        "mfu": am.mfu(f, ms[label] / 1e3, am.peak_flops(kind,
                                                          _dtype(config))),
        "peak_bytes": int(getattr(memory, "peak_memory_in_bytes", 0)),
        "compile_s": compile_s.get(label), "nonfinite_steps": skipped[label],
        "batch": batch, "load_average": load}
  stats = jax.devices()[0].memory_stats()  # None on a CPU.
  if stats and "peak_bytes_in_use" in stats:
    for figures in out.values():
      figures["device_peak_bytes_in_use"] = int(stats["peak_bytes_in_use"])
  out.update({label: {"error": why} for label, why in failed.items()})
  del compiled, states
  gc.collect()
  return out


def model_figures(quick: bool, steps: int, repeats: int, deadline: float,
                  skipped: dict, save: Callable[[dict], None],
                  wanted: Optional[list[str]] = None) -> tuple[dict, dict]:
  """({model: {candidate: figures}}, {moe model: {dtype: ratio}});
  `save(models)` after each model; `wanted`: these models only."""
  models, ratios = {}, {}
  for name in am.MODELS:
    if quick and name not in am.QUICK_MODELS:
      skipped[f"model:{name}"] = "--quick"
      continue
    if wanted is not None and name not in wanted:
      skipped[f"model:{name}"] = "--models"
      continue
    if time.perf_counter() > deadline:
      skipped[f"model:{name}"] = "time budget"
      continue
    config, batch, image = am.model_config(name, quick)
    group = candidates(name, config, skipped)
    dense = am.DENSE_EQUIVALENT.get(name)
    if dense:  # The dense ViT of equal active FLOPs, in each dtype.
      dense_config = am.dense_equivalent(config, am.model_config(dense,
                                                                 quick)[0])
      for label in [l for l in group if l in ("float32", "bfloat16")]:
        extra = am.axis_overrides("dtype", dense_config)[0].get(label, {})
        group[f"dense_eq_{label}"] = extra or dense_config
    print(f"{name} (batch {batch}, {image} px):", flush=True)
    try:
      models[name] = measure(group, batch, image, steps, repeats)
    except Exception as e:  # pylint: disable=broad-except
      skipped[f"model:{name}"] = f"{type(e).__name__}: {str(e)[:300]}"
      print(f"  {skipped[f'model:{name}']}", flush=True)
      continue
    am.remat_model_flops(models[name])
    for label, f in models[name].items():
      if "error" in f:
        continue
      mfu = "-" if f["mfu"] is None else f"{f['mfu']:.1%}"
      print(f"  {label:<22}{f['ms_per_step']:>10.1f} ms {f['images_per_s']:>9.1f}"
            f" img/s {f['gflops_per_step']:>9.1f} GFLOP  MFU {mfu:>6}  "
            f"peak {f['peak_bytes'] / 2**20:>8.0f} MiB", flush=True)
    if dense:
      ratios[name] = {
          label: models[name][label]["ms_per_step"]
          / models[name][f"dense_eq_{label}"]["ms_per_step"]
          for label in ("float32", "bfloat16")
          if "ms_per_step" in models[name].get(label, {})
          and "ms_per_step" in models[name].get(f"dense_eq_{label}", {})}
    save(models)
  return models, ratios


def host_pipeline(quick: bool, models: dict, skipped: dict) -> dict:
  """Host input figures against the fastest V-MoE S/32 step measured."""
  import input_pipeline
  measure_host = getattr(input_pipeline, "measure_host", None)
  if measure_host is None:
    skipped["host_pipeline"] = ("input_pipeline.measure_host not present")
    return {}
  step = max((f["images_per_s"] for label, f in
              models.get("vmoe_s32_every2", {}).items()
              if not label.startswith("dense_eq") and "images_per_s" in f),
             default=None)
  try:
    return measure_host(quick=quick, step_images_per_s=step)
  except Exception as e:  # pylint: disable=broad-except
    skipped["host_pipeline"] = f"{type(e).__name__}: {str(e)[:300]}"
    return {}


def overhead_figures(model: str, quick: bool, steps: int, repeats: int
                     ) -> dict:
  """Each router's / stream's step time over `model`'s (module docstring;
  `--quick`: `ao.QUICK`'s candidates only)."""
  config, batch, image = am.model_config(model, quick)
  group = {n: c for n, c in ao.candidates(config).items()
           if not quick or n == "baseline" or n in ao.QUICK}
  figures = measure(group, batch, image, steps, repeats, control="baseline")
  ms = {n: f["ms_per_step"] for n, f in figures.items() if "error" not in f}
  out = {n: {"overhead": ms[n] / ms[ao.reference(n)] - 1,
             "flops_overhead": figures[n]["gflops_per_step"]
             / figures[ao.reference(n)]["gflops_per_step"] - 1,
             "reference": ao.reference(n), "ms_per_step": ms[n]}
         for n in ms if n not in ("baseline", "control")
         and ao.reference(n) in ms}
  out.update({n: f for n, f in figures.items() if "error" in f})
  out["control"] = {"overhead": ms["control"] / ms["baseline"] - 1}
  out["baseline"] = {"ms_per_step": ms["baseline"], "batch": batch}
  for name, f in out.items():
    if "overhead" in f:
      print(f"  {model} {name:<16}{f['overhead']:+7.2%}"
            + (f" (FLOPs {f['flops_overhead']:+.2%})"
               if "flops_overhead" in f else ""), flush=True)
  return out


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="small shapes")
  parser.add_argument("--repeats", type=int, default=5,
                      help="interleaved timed samples (median reported)")
  parser.add_argument("--budget-s", type=float, default=float("inf"),
                      help="start no new group after this many seconds")
  parser.add_argument("--models", default=None,
                      help="comma-separated names of accelerator_models."
                      "MODELS to measure (default: all)")
  parser.add_argument("--overheads", default="all",
                      choices=("all", "swin", "lm", "none"),
                      help="which overhead groups to measure")
  parser.add_argument("--json-out", default=None,
                      help="also write the figures there, after each model")
  args = parser.parse_args(argv)

  def save(figures: dict) -> None:
    if args.json_out:
      with open(args.json_out, "w") as f:
        json.dump(figures, f, sort_keys=True)

  start = time.perf_counter()
  deadline = start + args.budget_s
  steps = 2 if args.quick else STEPS
  repeats = 3 if args.quick else max(3, args.repeats)
  print(f"machine: {machine()}", flush=True)
  skipped: dict[str, str] = {}
  wanted = args.models.split(",") if args.models else None
  unknown = set(wanted or ()) - set(am.MODELS)
  if unknown:
    parser.error(f"unknown models {sorted(unknown)}; one of {list(am.MODELS)}")
  models, ratios = model_figures(
      args.quick, steps, repeats, deadline, skipped,
      lambda models: save({"partial": True, "models": models,
                           "device_kind": jax.devices()[0].device_kind}),
      wanted)
  host = host_pipeline(args.quick, models, skipped)
  overheads = {}
  if args.overheads not in ("all", "swin"):
    skipped["overheads"] = "--overheads"
  elif time.perf_counter() > deadline:
    skipped["overheads"] = "time budget"
  else:
    model = am.QUICK_MODELS[0] if args.quick else "swin_moe_s_top2"
    print(f"router and stream overheads ({model}):", flush=True)
    try:
      overheads = {model: overhead_figures(model, args.quick, steps,
                                           repeats)}
    except Exception as e:  # pylint: disable=broad-except
      skipped["overheads"] = f"{type(e).__name__}: {str(e)[:300]}"
  if args.quick:
    skipped["overheads_switch_medium"] = "--quick (full runs only)"
  elif args.overheads not in ("all", "lm"):
    skipped["overheads_switch_medium"] = "--overheads"
  elif time.perf_counter() > deadline:
    skipped["overheads_switch_medium"] = "time budget"
  else:
    print("language-model method overheads (switch_medium):", flush=True)
    try:
      overheads["switch_medium"] = accelerator_lm.lm_overheads(steps,
                                                               repeats)
      for name, f in overheads["switch_medium"].items():
        if "overhead" in f:
          print(f"  switch_medium {name:<12}{f['overhead']:+7.2%}",
                flush=True)
    except Exception as e:  # pylint: disable=broad-except
      skipped["overheads_switch_medium"] = (f"{type(e).__name__}: "
                                            f"{str(e)[:300]}")
  figures = dict(
      quick=args.quick, backend=jax.default_backend(),
      device_kind=jax.devices()[0].device_kind, jax=jax.__version__,
      machine=machine(), models=models, moe_over_dense=ratios,
      host_pipeline=host, overheads=overheads,
      paper_overheads=ao.paper_overheads(), goals=GOALS, skipped=skipped,
      seconds=time.perf_counter() - start)
  save(figures)
  print_json_last(figures)
  return figures


if __name__ == "__main__":
  main()
