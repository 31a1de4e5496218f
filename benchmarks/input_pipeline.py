"""Input pipeline vs train step: images/s produced vs images/s consumed.

    python benchmarks/input_pipeline.py [--quick] [--workers W] [--repeats N]

Issue 14 (streaming ImageNet input), benchmark. In one process:

1. A fake `imagenet2012` (`vmoe_ext.data.fake_tfds.build_fake_imagenet`,
   in a temporary directory): 512 train JPEGs of 256x320 (about 49 KB each,
   quality 95, noisy gradients), 4 array_record files; `--quick`: 128 of
   128x160.
2. Input side: `vmoe_ext.data.streaming.train_loader` over that split,
   opened with `decode_image=False` so that decoding is part of the
   preprocessing, with the V-MoE paper's train preprocessing
   `decode_jpeg_and_inception_crop(224)|flip_lr|randaug(2, 10)|
   value_range(-1, 1)` (`vmoe_ext.data.pp`), global batch 64 (`--quick`: 16)
   of float32 [224, 224, 3] images and int32 labels, one process. Measured
   with `--workers` worker processes (default 2, the cores of the project's
   machine) and with 0 (everything in this process): images/s over
   `INPUT_BATCHES` batches (`--quick`: fewer) after `WARMUP_BATCHES`
   warm-up batches (worker start-up and the first reads excluded). Workers
   prefetch 2 batches each, so the first timed batches may already be
   waiting; the timed span is long enough for that to matter little.
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
object: `input_images_per_s` (with `--workers`), `input_images_per_s_w0`,
`input_images_per_s_per_core` (`input_images_per_s / max(workers, 1)`),
`train_images_per_s`, `input_over_train` (goal >= 2: the input keeps up
with the step with room to spare), `workers`, `input_batch`, `train_batch`.
On a CPU-only machine the train step shares the same cores as the input
pipeline and is far slower than on an accelerator, so `input_over_train`
there says little about a TPU/GPU host; `input_images_per_s_per_core` is
the figure to scale by the host's cores.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile
import time

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


def _close(iterator) -> None:
  """Stops the loader's worker processes now."""
  from vmoe_ext.data import streaming
  streaming.close(iterator)
  gc.collect()


def input_images_per_s(source, batch: int, workers: int, batches: int
                       ) -> float:
  from vmoe_ext.data import streaming
  loader = streaming.train_loader(
      source, batch_size=batch, seed=0, preprocess=PreprocessSpec(PP),
      process_index=0, process_count=1, worker_count=workers)
  it = iter(loader)
  try:
    for _ in range(WARMUP_BATCHES):
      b = next(it)
    assert b["image"].shape == (batch, 224, 224, 3), b["image"].shape
    start = time.perf_counter()
    for _ in range(batches):
      next(it)
    return batches * batch / (time.perf_counter() - start)
  finally:
    _close(it)


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


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="small shapes")
  parser.add_argument("--repeats", type=int, default=3,
                      help="timed train-step samples (median reported)")
  parser.add_argument("--workers", type=int, default=2,
                      help="loader worker processes (0 is also measured)")
  args = parser.parse_args(argv)
  quick = args.quick
  num_train, size = (128, (128, 160)) if quick else (512, (256, 320))
  input_batch, train_batch = (16, 8) if quick else (64, 64)
  batches = 6 if quick else INPUT_BATCHES

  import tensorflow_datasets as tfds

  from vmoe_ext.data import fake_tfds, streaming

  tfds.disable_progress_bar()
  figures: dict = {"quick": quick, "workers": args.workers,
                   "input_batch": input_batch, "train_batch": train_batch}
  with tempfile.TemporaryDirectory() as data_dir:
    start = time.perf_counter()
    fake_tfds.build_fake_imagenet(data_dir, num_train=num_train,
                                  num_validation=8, image_size=size)
    build_s = time.perf_counter() - start
    source = streaming.open_source("imagenet2012", "train", data_dir,
                                   decode_image=False)
    jpeg_kb = np.mean([len(source[i]["image"]) for i in range(16)]) / 1024
    rates = {w: input_images_per_s(source, input_batch, w, batches)
             for w in dict.fromkeys((args.workers, 0))}
  train_rate, step_ms = train_images_per_s(train_batch,
                                           max(1, args.repeats))

  figures["input_images_per_s"] = rates[args.workers]
  figures["input_images_per_s_w0"] = rates[0]
  figures["input_images_per_s_per_core"] = (rates[args.workers]
                                            / max(args.workers, 1))
  figures["train_images_per_s"] = train_rate
  figures["train_ms_per_step"] = step_ms
  figures["input_over_train"] = rates[args.workers] / train_rate
  figures["load_average"] = os.getloadavg()[0]

  print(f"machine: {machine()}")
  print(f"fake imagenet2012: {num_train} train JPEGs {size[0]}x{size[1]}, "
        f"mean {jpeg_kb:.1f} KB, built in {build_s:.1f} s")
  print(f"pp: {PP}")
  print(f"{'side':<34}{'batch':>6}{'images/s':>11}")
  for w, rate in rates.items():
    print(f"{f'input, {w} workers':<34}{input_batch:>6}{rate:>11.1f}")
  print(f"{'train step V-MoE S/32 (E8 K2)':<34}{train_batch:>6}"
        f"{train_rate:>11.1f}   ({step_ms:.0f} ms/step)")
  print(f"input / train = {figures['input_over_train']:.2f} (goal >= 2); "
        f"input per core = {figures['input_images_per_s_per_core']:.1f} "
        "images/s")
  print_json_last(figures)
  return figures


if __name__ == "__main__":
  main()
