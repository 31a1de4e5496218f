"""Expert parallelism on 8 fake CPU devices: collectives, memory, exactness.

    python benchmarks/sharding.py [--quick] [--repeats N] [--optimizer sgd]

Issue 15 (scale out) targets. Sets `XLA_FLAGS=--xla_force_host_platform_
device_count=8` and `JAX_PLATFORMS=cpu` before jax is imported, so it runs as
is on any machine. A V-MoE ("vit_moe": E=8 experts, noisy top-2 router,
capacity factor 1.25, indices dispatcher, routing groups of 2 images, expert
dropout 0.1 (no other dropout), the classifier head not zero-initialised so
that every gradient is non-zero) on
the mesh `("data", "expert") = (1, 8)` (one expert a device) built with
`Partitioning` (`build_model(..., part.expert_parallel)`, state placed by the
default rules, batch split over all axes), against the same model on one
device (no expert parallelism, plain `jax.jit`). The mesh (4, 2) (4 experts
a device, vmoe's data x expert layout) is measured too, under `*_4x2` keys.

* `all_to_all_per_moe_layer`: `all-to-all` instructions in the compiled
  sharded forward (`jax.jit(model.apply)`, deterministic), divided by the
  number of MoE layers (goal: exactly 2); `train_all_to_all_per_moe_layer`:
  the same in the compiled train step (forward + backward: 4 expected).
* `expert_weight_all_gathers`: `all-gather`s in the compiled forward whose
  result has the global shape of an expert weight (goal: 0);
  `all_gathers_total` counts every all-gather of the forward (the
  `train_*` keys: of the train step; `train_all_reduces_total` counts its
  all-reduces, gradients of replicated weights included).
* `expert_param_bytes_ratio`: bytes of the expert weights one device holds
  (its shard) / their replicated bytes (goal: 1/8 on (1, 8)).
* `max_abs_diff_vs_single_device`: the largest absolute difference between
  sharded and single-device logits (deterministic forward), loss and
  gradients (noisy routing and expert dropout, one key each) and the
  parameters after one step of the project's `make_train_step` (SGD with
  momentum by default, see `OPTIMIZERS`); each part under `max_abs_diff_*`
  (goal: <= 1e-5).
* `step_time_ratio`: median time of the jitted, donated train step on the
  mesh (`Partitioning.jit_train_step`) / on one device, same global batch,
  interleaved repetitions after warm-up (the order rotating from round to
  round); `control_ratio` is an A/A control
  (the single-device step again, on its own state): the timing noise. The
  fake devices share the machine's cores, so this measures the overheads of
  the partitioned program, not a speed-up; reported, no target.

The last line printed is one JSON object with the figures.
"""

from __future__ import annotations

import os
import re
import statistics

_FLAG = "--xla_force_host_platform_device_count"
os.environ["XLA_FLAGS"] = " ".join(
    [f for f in os.environ.get("XLA_FLAGS", "").split()
     if not f.startswith(_FLAG)] + [f"{_FLAG}=8"])
os.environ["JAX_PLATFORMS"] = "cpu"

import argparse  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import machine, print_json_last  # noqa: E402

from vmoe_ext.models import build_model  # noqa: E402
from vmoe_ext.sharding.partitioning import Partitioning  # noqa: E402
from vmoe_ext.sharding.rules import path_name  # noqa: E402
from vmoe_ext.train.optimizer import make_optimizer  # noqa: E402
from vmoe_ext.train.state import TrainState  # noqa: E402
from vmoe_ext.train.steps import cross_entropy, make_train_step  # noqa: E402

NUM_EXPERTS = 8
MESHES = {"": (1, 8), "_4x2": (4, 2)}  # JSON key suffix -> (data, expert).
# image: side of the square 1-channel images (patch 4: (image/4)^2 + 1
# tokens an image); batch: global batch, a multiple of 8 groups of 2 images.
# guard: `make_train_step(guard_weights=...)`; checking every updated weight
# for non-finite values doubles the step's compile time, so --quick checks
# only the loss and gradient norm.
QUICK = dict(image=16, hidden=32, mlp=64, heads=2, layers=2, moe=(0, 1),
             batch=32, steps=10, guard=False)
FULL = dict(image=28, hidden=64, mlp=256, heads=4, layers=6, moe=(1, 3, 5),
            batch=128, steps=2, guard=True)
# The train step's optimizer (`--optimizer`). SGD by default: its update is
# linear in the gradient, so the parameters after a step differ by about
# lr x the gradients' difference. Adam's first update is lr * g / (|g| + eps),
# ~ lr * sign(g): a gradient that is 0 up to rounding (the attention key
# bias's: softmax ignores a per-query shift) becomes a step of +-lr on either
# side, whatever the layout.
_COMMON = dict(learning_rate=0.1, warmup_steps=0, decay="constant",
               weight_decay=1e-4, weight_decay_mask="no_bias_norm",
               clip_global_norm=1.0)
OPTIMIZERS = {"sgd": dict(name="sgd", momentum=0.9, **_COMMON),
              "adamw": dict(name="adamw", **{**_COMMON,
                                             "learning_rate": 1e-3})}
EXPERT = re.compile(r"/Moe/Mlp/")  # The default rule's regex.


def model_config(s) -> dict:
  tokens = (s["image"] // 4) ** 2 + 1
  return dict(
      name="vit_moe", num_classes=10, patch_size=(4, 4),
      hidden_size=s["hidden"], num_layers=s["layers"], num_heads=s["heads"],
      mlp_dim=s["mlp"], dropout_rate=0.0, head_kernel_zero_init=False,
      moe=dict(layers=s["moe"], num_experts=NUM_EXPERTS, capacity_factor=1.25,
               group_size=tokens * 2, dispatcher="indices", dropout_rate=0.1,
               router=dict(name="noisy_topk", num_selected=2, noise_std=1.0,
                           importance_loss_weight=0.005,
                           load_loss_weight=0.005)))


def expert_leaves(tree) -> list:
  """The expert weights of a params tree (paths matching the default rule)."""
  return [leaf for path, leaf in jax.tree_util.tree_leaves_with_path(tree)
          if EXPERT.search("params/" + path_name(path))]


_SHAPE = re.compile(r"\b[a-z]+[0-9]*\[([0-9,]*)\]")


def collectives(hlo: str, expert_shapes: set) -> dict[str, int]:
  """Counts of all-to-all / all-gather instructions in compiled HLO text.

  An all-gather is an expert weight's when one of its result shapes (the
  part of the line before `all-gather(`, a tuple on some backends) is the
  global shape of an expert weight.
  """
  counts = {"all_to_all": 0, "all_gather": 0, "expert_all_gather": 0,
            "all_reduce": 0}
  for line in hlo.splitlines():
    if re.search(r"\sall-to-all(-start)?\(", line):
      counts["all_to_all"] += 1
    if re.search(r"\sall-reduce(-start)?\(", line):
      counts["all_reduce"] += 1
    m = re.search(r"\sall-gather(-start)?\(", line)
    if m:
      counts["all_gather"] += 1
      result = line[:m.start()].split("=", 1)[-1]
      shapes = {tuple(int(d) for d in dims.split(",") if d)
                for dims in _SHAPE.findall(result)}
      if shapes & expert_shapes:
        counts["expert_all_gather"] += 1
  return counts


def max_abs_diff(a, b) -> float:
  return max(float(jnp.max(jnp.abs(jnp.asarray(x, jnp.float32)
                                   - jnp.asarray(y, jnp.float32))))
             for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def time_rotated(fns, repeats: int) -> dict[str, float]:
  """Median wall seconds of each zero-argument function, after one warm-up.

  As `common.time_side_by_side` (interleaved rounds), but round r starts
  with the r-th candidate: with the fixed order, the A/A control here came
  out 10-20% faster than the same step run first in each round (right after
  the sharded steps); rotating spreads such order effects over all.
  """
  names = list(fns)
  for name in names:
    jax.block_until_ready(fns[name]())
  samples: dict[str, list[float]] = {name: [] for name in names}
  for r in range(repeats):
    for name in names[r % len(names):] + names[:r % len(names)]:
      start = time.perf_counter()
      jax.block_until_ready(fns[name]())
      samples[name].append(time.perf_counter() - start)
  return {name: statistics.median(v) for name, v in samples.items()}


def parse(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="small shapes")
  parser.add_argument("--repeats", type=int, default=7,
                      help="interleaved timed repetitions (median reported)")
  parser.add_argument("--optimizer", choices=sorted(OPTIMIZERS),
                      default="sgd", help="the train step's optimizer")
  return parser.parse_args(argv)


def main(argv=None) -> dict:
  args = parse(argv)
  s = QUICK if args.quick else FULL
  repeats = 8 if args.quick else max(4, args.repeats)
  assert jax.device_count() == 8, jax.devices()
  start = time.perf_counter()
  config = model_config(s)
  rng = np.random.default_rng(0)
  batch = {"image": jnp.asarray(rng.random((s["batch"], s["image"],
                                            s["image"], 1), np.float32)),
           "label": jnp.asarray(rng.integers(0, 10, s["batch"]), jnp.int32)}
  tx = make_optimizer(dict(OPTIMIZERS[args.optimizer]))
  init_key, state_key, gating_key, dropout_key = jax.random.split(
      jax.random.key(0), 4)

  # One device: the reference.
  model = build_model(config)
  variables = jax.jit(model.init)(init_key, batch["image"])
  state0 = TrainState.create(variables, tx, state_key)
  expert_shapes = {tuple(x.shape) for x in expert_leaves(variables["params"])}
  num_moe = len(model.moe_layers)

  def forward(m):
    return jax.jit(lambda v, x: m.apply(v, x))

  def loss_and_grads(m):
    def loss(params, batch):
      logits, metrics = m.apply({**variables, "params": params},
                                batch["image"], deterministic=False,
                                rngs={"gating": gating_key,
                                      "dropout": dropout_key})
      return (jnp.mean(cross_entropy(logits, batch["label"]))
              + metrics["auxiliary_loss"])
    return jax.jit(jax.value_and_grad(loss))

  copy = lambda tree: jax.block_until_ready(jax.tree.map(jnp.copy, tree))
  single_step = jax.jit(make_train_step(model, guard_weights=s["guard"]),
                        donate_argnums=0).lower(state0, batch).compile()
  reference = {
      "logits": forward(model)(variables, batch["image"])[0],
      "loss_and_grads": loss_and_grads(model)(variables["params"], batch),
      "step_params": single_step(copy(state0), batch)[0].params,
  }
  steps = {"single": (single_step, copy(state0), batch),
           "control": (single_step, copy(state0), batch)}

  figures: dict = {"quick": bool(args.quick), "optimizer": args.optimizer,
                   "guard_weights": s["guard"], "num_moe_layers": num_moe,
                   "num_experts": NUM_EXPERTS, "global_batch": s["batch"],
                   "device_count": jax.device_count()}
  for suffix, shape in MESHES.items():
    part = Partitioning.from_config({"axes": ("data", "expert"),
                                     "shape": shape})
    sharded = build_model(config, part.expert_parallel)
    sbatch = jax.device_put(batch, part.batch)
    svars = part.shard(variables)
    sstate = part.shard(state0)

    fwd_exe = forward(sharded).lower(svars, sbatch["image"]).compile()
    fwd = collectives(fwd_exe.as_text(), expert_shapes)
    step = part.jit_train_step(make_train_step(
        sharded, guard_weights=s["guard"]), sstate).lower(
        sstate, sbatch).compile()
    train = collectives(step.as_text(), expert_shapes)

    experts = expert_leaves(svars["params"])
    ratio = (sum(x.addressable_shards[0].data.nbytes for x in experts)
             / sum(x.nbytes for x in experts))

    diffs = {
        "logits": max_abs_diff(reference["logits"],
                               fwd_exe(svars, sbatch["image"])[0]),
        "loss_and_grads": max_abs_diff(
            reference["loss_and_grads"],
            loss_and_grads(sharded)(svars["params"], sbatch)),
        "step_params": max_abs_diff(
            reference["step_params"], step(copy(sstate), sbatch)[0].params),
    }
    figures.update({
        f"all_to_all_per_moe_layer{suffix}": fwd["all_to_all"] / num_moe,
        f"expert_weight_all_gathers{suffix}": fwd["expert_all_gather"],
        f"all_gathers_total{suffix}": fwd["all_gather"],
        f"train_all_to_all_per_moe_layer{suffix}":
            train["all_to_all"] / num_moe,
        f"train_expert_weight_all_gathers{suffix}":
            train["expert_all_gather"],
        f"train_all_gathers_total{suffix}": train["all_gather"],
        f"train_all_reduces_total{suffix}": train["all_reduce"],
        f"expert_param_bytes_ratio{suffix}": ratio,
        f"max_abs_diff_vs_single_device{suffix}": max(diffs.values()),
        **{f"max_abs_diff_{k}{suffix}": v for k, v in diffs.items()},
    })
    steps[f"sharded{suffix}"] = (step, copy(sstate), sbatch)
  figures["setup_seconds"] = time.perf_counter() - start  # Mostly compiling.

  # Step time: `steps` consecutive donated steps a sample, each candidate on
  # its own state, carried from sample to sample.
  def run(name):
    fn, state, b = steps[name]
    for _ in range(s["steps"]):
      state, _ = fn(state, b)
    steps[name] = (fn, state, b)
    return state.params

  load = [os.getloadavg()[0]]
  seconds = time_rotated({n: (lambda n=n: run(n)) for n in steps}, repeats)
  load.append(os.getloadavg()[0])
  ms = {n: v / s["steps"] * 1e3 for n, v in seconds.items()}
  for suffix in MESHES:
    figures[f"step_time_ratio{suffix}"] = ms[f"sharded{suffix}"] / ms["single"]
  figures["control_ratio"] = ms["control"] / ms["single"]
  figures.update({f"{n}_ms_per_step": v for n, v in ms.items()})
  figures["load_average"] = load

  print(f"machine: {machine()}, {jax.device_count()} XLA host devices")
  print(f"model: {s['layers']} blocks, MoE in {s['moe']}, D={s['hidden']}, "
        f"H={s['mlp']}, E={NUM_EXPERTS}, top-2, images {s['image']}x"
        f"{s['image']}, global batch {s['batch']}, {args.optimizer}; median "
        f"of {repeats}; setup (compiles) {figures['setup_seconds']:.0f} s")
  for suffix, shape in MESHES.items():
    print(f"mesh {shape}: all-to-all/MoE layer fwd "
          f"{figures['all_to_all_per_moe_layer' + suffix]:g}, train "
          f"{figures['train_all_to_all_per_moe_layer' + suffix]:g}; expert "
          f"all-gathers {figures['expert_weight_all_gathers' + suffix]} "
          f"(all {figures['all_gathers_total' + suffix]}); expert bytes "
          f"{figures['expert_param_bytes_ratio' + suffix]:.4f}; max diff "
          f"{figures['max_abs_diff_vs_single_device' + suffix]:.2e}; "
          f"{ms['sharded' + suffix]:.1f} ms/step = "
          f"{figures['step_time_ratio' + suffix]:.2f}x one device "
          f"({ms['single']:.1f} ms)")
  print_json_last(figures)
  return figures


if __name__ == "__main__":
  main()
