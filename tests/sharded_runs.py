"""Expert-parallel runs on a mesh of 8 fake CPU devices vs one device.

`start(shapes)` launches this file as a script in a subprocess with
`XLA_FLAGS=--xla_force_host_platform_device_count=8` (set before jax is
imported, so it cannot run in the pytest process) for the mesh shapes
`(data, expert)`; `result(proc)` waits for it and returns its JSON report
of each mesh.

For every case of `cases()` the mesh runs (`MESH_CASES`; tiny 2-block
V-MoEs, both blocks MoE, E=8 experts, 16 images of 17 tokens, one routing
group each: top-k, expert choice, SoftMoE, ACMoE, Symphony, the heavy-ball
momentum stream, a CMoE-carved model; and a two-stage Swin-MoE) the script runs, once with `build_model(cfg)` and plain
`jax.jit` on one device and once with `build_model(cfg,
part.expert_parallel)` and `part.jit_train_step` on the mesh (the state
placed by `part.shard`, the batch split by `part.batch`), one train step
(`make_train_step`) whose program also evaluates a training-mode forward
(gating noise, dropout 0.1) with the step's rngs and parameters, and
reports, per case and quantity, the largest absolute difference, the leaf
where it occurs and the one-device value's largest magnitude:

  * "forward/...": the forward's logits and every metric (auxiliary loss,
    per-layer drop rate, expert usage, expert load, router losses);
  * "step/grads": the gradients of the step's loss (cross-entropy +
    auxiliary loss) wrt the params: the momentum trace after one SGD step;
  * "step/params", "step/collections" (router state: Symphony's graph,
    CMoE's bias), "step/counters" and "step/<metric>" for the step's
    metrics.

It also compiles the deterministic forward on the mesh and reports the
number of `all-to-all`s and the `all-gather`s of the compiled HLO (their
result shapes, and how many have the shape of an expert weight), and how
the expert weights are split after the step.

One program per case and placement (the forward, the gradients and the step
together) keeps the compile time, most of the run, down. Each case's
initial variables and one-device results are computed once and compared
with every mesh that runs the case.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any, Sequence

from fake_devices import fake_devices_env

MESHES = ((8, 1), (4, 2), (1, 8))
# The cases each mesh runs. (4, 2) splits both the batch (over all 8
# devices: the batch axes are data and expert) and the experts: every case
# but the plain top-k one, so every router's batch statistics and state
# (ACMoE's dispersions, in the Swin-MoE case; Symphony's graph; CMoE's
# balancing bias) are reduced over 8 shards there, and the noisy top-k
# router runs there under the momentum stream. (8, 1), the default layout
# (pure data parallelism, an expert axis of size 1), runs Symphony, the
# router with the most state; (1, 8), one expert a device, runs the plain
# top-k case through the all-to-alls (expert choice and SoftMoE go through
# them on (4, 2)). A case is ~5-10 s of compilation a mesh, so the suite
# does not run every pair; `XLA_FLAGS=--xla_force_host_platform_device_count=8
# python tests/sharded_runs.py --all` runs every case (ACMoE over the ViT's
# top-k and the plain top-k included) on every mesh and prints the report.
MESH_CASES = {
    (8, 1): ("symphony",),
    (4, 2): ("expert_choice", "soft_moe", "symphony", "momentum", "carved",
             "swin_moe"),
    (1, 8): ("topk",),
}
NUM_EXPERTS = 8
MOE_BLOCKS = (0, 1)
BATCH = 16  # 16 images, one routing group each: G=16 splits over 8 shards.
IMAGE = 16  # 16x16 images, 4x4 patches: 16 + 1 (class) tokens an image.

_BASE = dict(name="vit_moe", num_classes=5, patch_size=(4, 4),
             hidden_size=16, num_layers=2, num_heads=2, mlp_dim=16,
             dropout_rate=0.1)
_TOPK = dict(name="noisy_topk", num_selected=2, noise_std=1.0)


def _moe(**fields: Any) -> dict[str, Any]:
  # cf=1 with K=2: C = ceil(17 * 2 / 8) = 5 slots, some tokens dropped.
  return dict(layers=MOE_BLOCKS, num_experts=NUM_EXPERTS,
              capacity_factor=1.0, group_size=None, **fields)


def _carved() -> dict[str, Any]:
  """What CMoE carving of a dense ViT makes: 1 shared + 8 routed experts,
  router "cmoe", `output_bias="once"`, dropless capacity."""
  from vmoe_ext.carving.spec import CarveSpec, carved_model_config
  dense = {**_BASE, "name": "vit", "mlp_dim": 36}
  spec = CarveSpec(num_experts=NUM_EXPERTS + 1, num_shared=1,
                   num_activated=2, layers=MOE_BLOCKS, every=None)
  return carved_model_config(dense, spec)


def cases() -> dict[str, dict[str, Any]]:
  """Case name -> model config."""
  return {
      "topk": {**_BASE, "moe": _moe(router=dict(_TOPK))},
      "expert_choice": {**_BASE, "moe": _moe(router=dict(
          name="expert_choice", noise_std=1.0, z_loss_weight=0.01))},
      "soft_moe": {**_BASE, "name": "soft_moe_vit",
                   "moe": _moe(router=dict(name="soft", num_slots=1))},
      "acmoe": {**_BASE, "moe": _moe(router=dict(
          name="acmoe", base=dict(_TOPK)))},
      "symphony": {**_BASE, "moe": _moe(router=dict(
          name="symphony", base=dict(_TOPK), graph_init="random"))},
      "momentum": {**_BASE, "stream": dict(name="momentum", mu=0.7),
                   "moe": _moe(router=dict(_TOPK))},
      "carved": _carved(),
      # A two-stage Swin-MoE (16 x 16 images, patch 2: 8 x 8 shifted
      # windows of 4, then 4 x 4), MoE in block 1 of stage 0 and both blocks
      # of stage 1: the Swin-MoE router under ACMoE's swin preset (AC on
      # block 3), drop path.
      "swin_moe": dict(
          name="swin_moe", num_classes=5, patch_size=(2, 2), embed_dim=8,
          depths=(2, 2), num_heads=(2, 2), window_size=4, mlp_ratio=2.0,
          dropout_rate=0.1, drop_path_rate=0.1, head_kernel_zero_init=False,
          moe_blocks=((1,), (0, 1)),
          moe=_moe(router=dict(
              name="acmoe", normalization="swin",
              base=dict(name="swin_moe", num_selected=2)),
              capacity_rounding="tutel", batch_priority=True,
              dropout_output=False) | {"layers": None}),
  }


def start(shapes: Sequence[tuple[int, int]] = MESHES) -> subprocess.Popen:
  """Runs this script for the meshes `shapes` in one subprocess (not waited).

  One process runs every mesh: jax starts once and each case's one-device
  program compiles and runs once. It inherits the environment, so the test
  suite's XLA flags (LLVM's optimisation level 0 more than halves the compile
  time, most of this script's) and its persistent compilation cache; the
  one-device and mesh programs are compiled alike.
  """
  return subprocess.Popen(
      [sys.executable, os.path.abspath(__file__),
       json.dumps([list(s) for s in shapes])],
      env=fake_devices_env(8), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
      text=True)


def result(proc: subprocess.Popen, timeout: float = 600
           ) -> dict[tuple[int, int], dict[str, Any]]:
  """The reports of a `start`ed subprocess, by mesh shape (AssertionError
  on failure)."""
  try:
    out, err = proc.communicate(timeout=timeout)
  except subprocess.TimeoutExpired:
    proc.kill()
    out, err = proc.communicate()
    raise AssertionError(f"timed out after {timeout}s:\n{err[-3000:]}")
  assert proc.returncode == 0, err[-5000:]
  reports = json.loads(out.strip().splitlines()[-1])
  return {tuple(r["mesh"]): r for r in reports}


# --------------------------------------------------------------------------
# The subprocess.


def _main(shapes: Sequence[tuple[int, int]],
          mesh_cases: dict[tuple[int, int], Sequence[str]] = MESH_CASES
          ) -> list[dict[str, Any]]:
  import re
  import time

  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax

  from vmoe_ext.models import build_model
  from vmoe_ext.sharding.partitioning import Partitioning
  from vmoe_ext.sharding.rules import path_name
  from vmoe_ext.train.state import TrainState
  from vmoe_ext.train.steps import make_train_step

  jax.config.update("jax_default_matmul_precision", "highest")
  assert jax.device_count() == 8, jax.devices()
  parts = {shape: Partitioning.from_config({"axes": ("data", "expert"),
                                            "shape": shape})
           for shape in shapes}
  assert all(p.expert_parallel is not None for p in parts.values())

  images = np.asarray(jax.random.uniform(jax.random.key(0),
                                         (BATCH, IMAGE, IMAGE, 3)))
  labels = np.asarray(jax.random.randint(jax.random.key(1), (BATCH,), 0,
                                         _BASE["num_classes"]))
  batch = {"image": images, "label": labels}
  # SGD with momentum, not Adam: Adam's first step moves every parameter
  # by about lr * sign(g), so a gradient that is 0 up to float noise (sums
  # that cancel) would move by +-lr on either side: a difference of 2*lr
  # that says nothing about the sharding. SGD's update is linear in g, and
  # after one step its momentum trace *is* the gradient of the step's loss
  # (cross-entropy + auxiliary loss): "step/grads" below.
  tx = optax.sgd(0.1, momentum=0.9)

  def with_forward(model):
    """The train step, whose metrics also carry a training-mode forward
    (logits and all metrics) with the step's own rngs and parameters: one
    program (one compilation) for the forward, the gradients and the step."""
    # guard_weights=False: the weight check (an isfinite reduction per
    # leaf of the new state) doubles the compile time of these tiny steps
    # and decides nothing here (all values are finite); the loss and
    # gradient-norm check and the commit's per-leaf select still run.
    train_step = make_train_step(model, guard_weights=False)

    def step(state, batch):
      gating, dropout = jax.random.split(state.step_key())
      logits, metrics = model.apply(
          state.variables(), batch["image"], deterministic=False,
          rngs={"gating": gating, "dropout": dropout})
      new_state, step_metrics = train_step(state, batch)
      return new_state, {"step": step_metrics, "forward": {
          "logits": logits, "metrics": metrics}}
    return step

  def flat(tree) -> dict[str, np.ndarray]:
    leaves = jax.tree_util.tree_leaves_with_path(jax.device_get(tree))
    return {path_name(p): np.asarray(v) for p, v in leaves}

  def diff(one, many) -> dict[str, Any]:
    """Largest |one - many| over the leaves, where, and the scale."""
    a, b = flat(one), flat(many)
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    worst = {"max": 0.0, "leaf": None, "scale": 0.0}
    for k in a:
      x = a[k].astype(np.float64)
      if not x.size:
        continue
      d = float(np.max(np.abs(x - b[k])))
      worst["scale"] = max(worst["scale"], float(np.max(np.abs(x))))
      if worst["leaf"] is None or not d <= worst["max"]:  # NaN wins.
        worst.update(max=d, leaf=k)
    return worst

  def perturbed(variables):
    leaves, tree = jax.tree.flatten(variables["params"])
    leaves = [v + 0.3 * jax.random.normal(jax.random.fold_in(
        jax.random.key(2), i), v.shape, v.dtype)
              for i, v in enumerate(leaves)]
    return {**variables, "params": jax.tree.unflatten(tree, leaves)}

  def hlo_report(text: str, expert_shapes: set) -> dict[str, Any]:
    """all-to-alls and all-gathers (result shapes) of a compiled module."""
    gathers = re.findall(r"=\s*(\S+)\s+all-gather(?:-start)?\(", text)
    dims = lambda s: tuple(int(d) for d in re.findall(
        r"\d+", s.split("[", 1)[1].split("]", 1)[0])) if "[" in s else ()
    return {
        "all_to_all": len(re.findall(r"\sall-to-all(?:-start)?\(", text)),
        "all_gather": len(gathers),
        "all_gather_shapes": gathers,
        # A gathered expert weight: the full [E, ...] shape of one.
        "all_gather_of_expert_weights": sum(
            dims(g)[-len(s):] == s for g in gathers for s in expert_shapes),
    }

  last = [time.perf_counter()]

  def lap(label: str) -> None:  # Progress on stderr.
    now = time.perf_counter()
    print(f"{label}: {now - last[0]:.2f}s", file=sys.stderr, flush=True)
    last[0] = now

  reports = {shape: {"mesh": list(shape), "cases": {}, "seconds": {}}
             for shape in shapes}
  for name, cfg in cases().items():
    meshes = [shape for shape in shapes if name in mesh_cases[shape]]
    if not meshes:
      continue
    t0 = time.perf_counter()
    one_model = build_model(cfg)
    variables = jax.jit(one_model.init)(jax.random.key(3), images[:2])
    variables.pop("intermediates", None)
    state = TrainState.create(perturbed(variables), tx, jax.random.key(6))
    s1, m1 = jax.jit(with_forward(one_model))(state, batch)
    one_metrics = flat(m1)
    reference = {
        "drop_rate": {k: float(v) for k, v in one_metrics.items()
                      if k.endswith("drop_rate")},
        "collections": sorted(flat(s1.collections))}
    expert_shapes = {tuple(v.shape) for k, v in flat(state.params).items()
                     if "/Moe/Mlp/" in "/" + k}
    lap(f"{name} one device")
    for shape in meshes:
      part = parts[shape]
      many_model = build_model(cfg, expert_parallel=part.expert_parallel)
      step_many = part.jit_train_step(with_forward(many_model), state)
      # A copy first: `part.shard` leaves device 0's shard of replicated
      # leaves aliasing the input's buffer, and the step donates its state.
      sn, mn = step_many(part.shard(jax.tree.map(jnp.copy, state)),
                         part.global_batch(batch))
      lap(f"{name} mesh {shape}")

      diffs: dict[str, Any] = {}
      diffs["forward/logits"] = diff(m1["forward"]["logits"],
                                     mn["forward"]["logits"])
      many_metrics = flat(mn)
      for k, v in one_metrics.items():
        if k != "forward/logits":
          diffs[k] = diff(v, many_metrics[k])
      diffs["step/grads"] = diff(s1.opt_state, sn.opt_state)
      diffs["step/params"] = diff(s1.params, sn.params)
      diffs["step/collections"] = diff(s1.collections, sn.collections)
      diffs["step/counters"] = diff(
          (s1.step, s1.nonfinite_count, s1.first_nonfinite_step),
          (sn.step, sn.nonfinite_count, sn.first_nonfinite_step))

      # The compiled (deterministic) forward on the mesh.
      many_vars = part.shard(state.variables())
      compiled = jax.jit(lambda v, x, m=many_model: m.apply(v, x)).lower(
          many_vars, jax.device_put(images, part.batch)).compile()
      hlo = hlo_report(compiled.as_text(), expert_shapes)
      hlo["moe_layers"] = len(many_model.moe_layers)
      hlo["expert_weight_specs"] = sorted({
          str(tuple(v.sharding.spec)) for k, v in
          jax.tree_util.tree_leaves_with_path(sn.params)
          if "/Moe/Mlp/" in "/" + path_name(k)})
      lap(f"{name} forward hlo {shape}")
      reports[shape]["cases"][name] = {
          "diffs": diffs, "hlo": hlo, "reference": reference}
    for shape in meshes:  # The whole case (one device and all its meshes).
      reports[shape]["seconds"][name] = round(time.perf_counter() - t0, 2)
  return list(reports.values())

if __name__ == "__main__":
  if sys.argv[1] == "--all":
    print(json.dumps(_main(MESHES, {s: tuple(cases()) for s in MESHES}),
                     indent=1))
  else:
    print(json.dumps(_main([tuple(s) for s in json.loads(sys.argv[1])])))
