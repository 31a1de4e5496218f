"""Input pipeline vs train step: images/s produced vs images/s consumed.

    python benchmarks/input_pipeline.py [--quick] [--workers W] [--repeats N]
        [--input-only]

Issues 14 (streaming ImageNet input) and 48 (a host pipeline that keeps
up), benchmark. In one process:

1. A fake `imagenet2012` (`vmoe_ext.data.fake_tfds.build_fake_imagenet`,
   in a temporary directory): 512 train JPEGs of 256x320 (about 49 KB each,
   quality 95, noisy gradients), 4 array_record files; `--quick`: 128 of
   128x160.
2. Input side (`measure_input`): `vmoe_ext.data.streaming.train_loader`
   over that split, opened with `decode_image=False` so that decoding is
   part of the preprocessing, with the V-MoE paper's train preprocessing
   `decode_jpeg_and_inception_crop(224)|flip_lr|randaug(2, 10)|
   value_range(-1, 1)` (`vmoe_ext.data.pp`), global batch 64 (`--quick`:
   16), one process, each of: float32 [224, 224, 3] output (today's host
   path) and uint8 output (`data.device_normalize`: the trailing
   value_range runs in the train step), with 0, 1, ..., `--workers` worker
   processes (default 2, the cores of the project's machine). Measured over
   `INPUT_BATCHES` batches (`--quick`: fewer) after `WARMUP_BATCHES`
   warm-up batches (worker start-up and the first reads excluded): wall
   images/s, and images per CPU-second, the CPU time (user + system) of
   this process and its worker processes over the timed span (psutil):
   the per-core rate, which does not depend on how loaded the machine is
   nor on how many threads grain's readers spread over. Workers prefetch 2
   batches each, so the first timed batches may already be waiting.
3. Train side: the V-MoE S/32 of `configs/vmoe_import.py:S32,last2,E8,K2`
   (8 blocks, D = 512, MoE in blocks 5 and 7, E = 8, K = 2, groups of 8
   images = 400 tokens, 1000 classes) with training settings (capacity
   factor 1.05, no bfloat16 dispatch), AdamW with clipping, trained by the
   project's jitted, donated step (`common.compile_train_steps`:
   `make_train_step`, `TrainState.create`; compiled ahead of time, not
   timed) on a fixed batch of 64 (`--quick`: 8) random 224x224 images:
   `common.time_train_steps`, `TRAIN_STEPS` steps per sample, median of
   `--repeats` samples after one warm-up sample.

The two sides are timed one after the other, not concurrently (the loader's
workers are stopped before the train step runs). The last line is one JSON
object: `input_images_per_s` (uint8 output, `--workers`),
`input_images_per_s_w0`, `input_images_per_cpu_s` (the best per-core rate,
used by `needed_cores`), `input` (every measurement: `{"float32"|"uint8":
{"w0": ..., "w1": ..., ...}}` of `measure_input`'s dicts),
`train_images_per_s`, `input_over_train` (goal >= 2), `cores_to_feed_train`
(`needed_cores` of the measured step; the three None with `--input-only`),
`workers`, `input_batch`, `train_batch`. On a CPU-only machine the train step shares the cores with
the input pipeline and is far slower than on an accelerator, so
`input_over_train` there says little about a TPU/GPU host; the per-core
rate and `needed_cores` are the figures to scale by the host's cores.

For another benchmark (`benchmarks/accelerator.py`): `measure_host(quick,
step_images_per_s, cores=16)` measures and judges in one call;
`measure_input(quick, workers, uint8)` times the host pipeline on its own
fake split, and `needed_cores(step_images_per_s)` / `host_verdict(
step_images_per_s, cores=16)` say how many host cores feed a step.
"""

from __future__ import annotations

import argparse
import atexit
import gc
import math
import os
import shutil
import sys
import tempfile
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import machine, print_json_last  # noqa: E402
from vmoe_ext.data.stream_iterator import PreprocessSpec  # noqa: E402

PP = ("decode_jpeg_and_inception_crop(224)|flip_lr|randaug(2, 10)|"
      "value_range(-1, 1)")
WARMUP_BATCHES = 2
INPUT_BATCHES = 16  # Timed batches (6 with --quick).
TRAIN_STEPS = 2  # Train steps per timed sample.
OPTIMIZER = {"name": "adamw", "learning_rate": 1e-3, "warmup_steps": 0,
             "decay": "cosine", "total_steps": 10_000, "weight_decay": 1e-4,
             "weight_decay_mask": "no_bias_norm", "clip_global_norm": 1.0}
# Images per CPU-second of this pp with uint8 output, measured on the
# project's CPU machine (150-168; benchmarks/RESULTS.md, input_pipeline.py,
# issue 48); `needed_cores`' default. Real ImageNet JPEGs (about 400x350, 110 KB on
# average) decode slower than these 256x320 ones.
PER_CORE_IMAGES_PER_S = 150.0
# A host core kept for the training process itself (the jitted steps'
# dispatch, the batch transfer, logging); the rest run loader workers.
TRAINER_CORES = 1
_FAKE: dict[bool, tuple[str, Any, dict]] = {}


def fake_source(quick: bool) -> tuple[Any, dict]:
  """`(source, info)`: the fake split of this size, built once per process
  in a temporary directory (removed at exit)."""
  if quick not in _FAKE:
    import tensorflow_datasets as tfds

    from vmoe_ext.data import fake_tfds, streaming
    tfds.disable_progress_bar()
    num_train, size = (128, (128, 160)) if quick else (512, (256, 320))
    data_dir = tempfile.mkdtemp(prefix="fake_imagenet_")
    atexit.register(shutil.rmtree, data_dir, True)
    start = time.perf_counter()
    fake_tfds.build_fake_imagenet(data_dir, num_train=num_train,
                                  num_validation=8, image_size=size)
    source = streaming.open_source("imagenet2012", "train", data_dir,
                                   decode_image=False)
    info = {"num_train": num_train, "size": size,
            "build_s": time.perf_counter() - start,
            "jpeg_kb": float(np.mean([len(source[i]["image"])
                                      for i in range(16)]) / 1024)}
    _FAKE[quick] = (data_dir, source, info)
  return _FAKE[quick][1], _FAKE[quick][2]


def _close(iterator) -> None:
  """Stops the loader's worker processes now."""
  from vmoe_ext.data import streaming
  streaming.close(iterator)
  gc.collect()


def _cpu_seconds() -> float:
  """User + system CPU seconds of this process and its live children."""
  import psutil
  me = psutil.Process()
  total = 0.0
  for proc in [me] + me.children(recursive=True):
    try:
      times = proc.cpu_times()
    except psutil.NoSuchProcess:
      continue
    total += times.user + times.system
  return total


def measure_input(quick: bool = True, workers: int = 0, uint8: bool = True,
                  batches: int | None = None) -> dict[str, Any]:
  """Times the streamed V-MoE train pp on the fake split (module doc, 2).

  Args:
    quick: the small split (128 JPEGs of 128x160, batch 16) instead of
      512 of 256x320, batch 64.
    workers: loader worker processes (0: all in this process).
    uint8: uint8 output (`data.device_normalize`) instead of float32.
    batches: timed batches (default 6 quick, else `INPUT_BATCHES`).

  Returns:
    `{"images_per_s": wall rate, "images_per_cpu_s": per-core rate,
    "cpu_cores_busy": CPU-seconds per second, "workers", "uint8", "batch",
    "dtype", "mb_per_batch"}`.
  """
  from vmoe_ext.data import streaming
  source, _ = fake_source(quick)
  batch = 16 if quick else 64
  batches = batches or (6 if quick else INPUT_BATCHES)
  loader = streaming.train_loader(
      source, batch_size=batch, seed=0,
      preprocess=PreprocessSpec(PP, device_normalize=uint8),
      process_index=0, process_count=1, worker_count=workers)
  it = iter(loader)
  try:
    for _ in range(WARMUP_BATCHES):
      b = next(it)
    want = np.uint8 if uint8 else np.float32
    assert b["image"].shape == (batch, 224, 224, 3), b["image"].shape
    assert b["image"].dtype == want, b["image"].dtype
    cpu, start = _cpu_seconds(), time.perf_counter()
    for _ in range(batches):
      next(it)
    wall = time.perf_counter() - start
    cpu = _cpu_seconds() - cpu
  finally:
    _close(it)
  images = batches * batch
  return {"images_per_s": images / wall,
          "images_per_cpu_s": images / max(cpu, 1e-9),
          "cpu_cores_busy": cpu / wall, "workers": workers, "uint8": uint8,
          "batch": batch, "dtype": np.dtype(want).name,
          "mb_per_batch": b["image"].nbytes / 2**20}


def needed_cores(step_images_per_s: float,
                 per_core_images_per_s: float = PER_CORE_IMAGES_PER_S
                 ) -> int:
  """Host cores that feed a train step consuming `step_images_per_s`
  images/s (one host; for P hosts pass the per-host share):
  `ceil(step / per_core)` loader workers plus `TRAINER_CORES`."""
  if not (step_images_per_s > 0 and per_core_images_per_s > 0):
    raise ValueError(f"rates must be positive, got {step_images_per_s!r}, "
                     f"{per_core_images_per_s!r}")
  return math.ceil(step_images_per_s / per_core_images_per_s) + TRAINER_CORES


def host_verdict(step_images_per_s: float, cores: int = 16,
                 per_core_images_per_s: float = PER_CORE_IMAGES_PER_S
                 ) -> dict[str, Any]:
  """Whether a host of `cores` cores feeds the step: `{"cores",
  "needed_cores", "host_images_per_s" (what its workers make),
  "host_over_step" (>= 1: it keeps up; below, by how much it cannot),
  "feeds"}`."""
  supply = max(cores - TRAINER_CORES, 0) * per_core_images_per_s
  return {"cores": cores,
          "needed_cores": needed_cores(step_images_per_s,
                                       per_core_images_per_s),
          "host_images_per_s": supply,
          "host_over_step": supply / step_images_per_s,
          "feeds": supply >= step_images_per_s}


def train_images_per_s(batch: int, repeats: int) -> tuple[float, float]:
  """(images/s, ms per step) of the V-MoE S/32 train step."""
  from common import compile_train_steps, image_batch, time_train_steps

  from vmoe_ext.train.config_files import load_config

  model = load_config("vmoe_import", "S32,last2,E8,K2").model.to_dict()
  model["num_classes"] = 1000
  model["moe"].update(capacity_factor=1.05, dispatch_dtype=None)
  data = image_batch(batch, 224, num_classes=1000)
  compiled, states, _ = compile_train_steps({"s32": model}, data, OPTIMIZER)
  ms, _, skipped = time_train_steps(compiled, states, data, TRAIN_STEPS,
                                    repeats, control=None)
  assert skipped["s32"] == 0, skipped
  return batch / (ms["s32"] / 1e3), ms["s32"]


def measure_host(quick: bool = True, step_images_per_s: float | None = None,
                 cores: int = 16, workers: int | None = None
                 ) -> dict[str, Any]:
  """The host pipeline's figures for `benchmarks/accelerator.py`.

  Measures uint8 and float32 output (`measure_input`) with `workers`
  processes (default: none with `quick`, else one per host core but one),
  takes the uint8 run's images per CPU-second as the per-core rate, and,
  given a train step's `step_images_per_s`, says whether `cores` host cores
  and this host's cores feed it (`host_verdict`).

  Returns:
    `{"workers", "host_cores", "uint8": measure_input dict, "float32": ...,
    "images_per_cpu_s", "needed_cores" (None without a step), "verdict"
    {"<cores>": host_verdict, "this_host": ...} (empty without a step)}`.
  """
  host_cores = os.cpu_count() or 1
  if workers is None:
    workers = 0 if quick else max(host_cores - TRAINER_CORES, 1)
  runs = {dtype: measure_input(quick, workers, dtype == "uint8")
          for dtype in ("uint8", "float32")}
  per_core = runs["uint8"]["images_per_cpu_s"]
  out: dict[str, Any] = {"workers": workers, "host_cores": host_cores,
                         **runs, "images_per_cpu_s": per_core,
                         "needed_cores": None, "verdict": {}}
  if step_images_per_s:
    out["needed_cores"] = needed_cores(step_images_per_s, per_core)
    out["verdict"] = {
        str(cores): host_verdict(step_images_per_s, cores, per_core),
        "this_host": host_verdict(step_images_per_s, host_cores, per_core)}
  return out


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="small shapes")
  parser.add_argument("--repeats", type=int, default=3,
                      help="timed train-step samples (median reported)")
  parser.add_argument("--workers", type=int, default=2,
                      help="most loader worker processes (0..W measured)")
  parser.add_argument("--input-only", action="store_true",
                      help="skip the train step (its figures are None)")
  args = parser.parse_args(argv)
  quick = args.quick
  train_batch = 8 if quick else 64
  _, info = fake_source(quick)
  runs = {dtype: {f"w{w}": measure_input(quick, w, dtype == "uint8")
                  for w in range(args.workers + 1)}
          for dtype in ("float32", "uint8")}
  train_rate = step_ms = None
  if not args.input_only:
    train_rate, step_ms = train_images_per_s(train_batch,
                                             max(1, args.repeats))
  top = runs["uint8"][f"w{args.workers}"]
  per_core = max(r["images_per_cpu_s"] for r in runs["uint8"].values())
  figures: dict = {
      "quick": quick, "workers": args.workers, "input_batch": top["batch"],
      "train_batch": train_batch, "input": runs,
      "input_images_per_s": top["images_per_s"],
      "input_images_per_s_w0": runs["uint8"]["w0"]["images_per_s"],
      "input_images_per_cpu_s": per_core,
      "train_images_per_s": train_rate, "train_ms_per_step": step_ms,
      "input_over_train": (top["images_per_s"] / train_rate
                           if train_rate else None),
      "cores_to_feed_train": (needed_cores(train_rate, per_core)
                              if train_rate else None),
      "load_average": os.getloadavg()[0]}

  print(f"machine: {machine()}")
  print(f"fake imagenet2012: {info['num_train']} train JPEGs "
        f"{info['size'][0]}x{info['size'][1]}, mean {info['jpeg_kb']:.1f} "
        f"KB, built in {info['build_s']:.1f} s")
  print(f"pp: {PP}")
  print(f"{'input':<22}{'batch':>6}{'MB/batch':>10}{'images/s':>10}"
        f"{'per CPU-s':>11}{'cores busy':>12}")
  for dtype, by_workers in runs.items():
    for r in by_workers.values():
      label = f"{dtype}, {r['workers']} workers"
      print(f"{label:<22}{r['batch']:>6}"
            f"{r['mb_per_batch']:>10.1f}{r['images_per_s']:>10.1f}"
            f"{r['images_per_cpu_s']:>11.1f}{r['cpu_cores_busy']:>12.2f}")
  if train_rate:
    print(f"{'train step V-MoE S/32 (E8 K2)':<34}{train_batch:>6}"
          f"{train_rate:>11.1f}   ({step_ms:.0f} ms/step)")
    print(f"input / train = {figures['input_over_train']:.2f} (goal >= 2)")
  print(f"input per CPU-second = {per_core:.1f} images; cores to feed "
        f"1000 images/s: {needed_cores(1000.0, per_core)}, 16 cores make "
        f"{host_verdict(1.0, 16, per_core)['host_images_per_s']:.0f} "
        "images/s")
  print_json_last(figures)
  return figures


if __name__ == "__main__":
  main()
