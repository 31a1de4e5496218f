"""CMoE carving: wall time, and the carved layer's train-step cost.

    python benchmarks/carving.py [--quick] [--repeats N]

Issue "CMoE", Targets.

1. Carving wall time of the default-size dense ViT (`configs/vit_dense.py:
   plain`: D = 64, H = 128, 4 blocks; weights of a fresh init, timing does
   not depend on them) into S1A1E8 (E = 8), every block, calibrated on 256
   MNIST-5k training images (4,352 tokens) — the binary's carve mode minus
   checkpoint I/O: `carve_seconds` (first run, jit compilation of the
   calibration forward passes included: it is most of the time, one
   compilation per block, as the carve mode pays it).
   Also one ViT-S-size MLP (D = 384, H = 1,536, S1A1E8) profiled on 16,384
   tokens: `carve_vit_s_layer_seconds` (full run only).
2. One layer, forward + backward w.r.t. params and tokens (as
   `benchmarks/moe_layer.py`), T = 2,048 tokens, D = 384, one routing group:
   * dense         the dense MLP that is carved, H = 6,144;
   * carved        it carved S2A2E8: 2 shared experts (1,536 units) + top-2
                   of 6 routed experts of 768 units: 3,072 active units;
                   cf 1.25;
   * carved_dropless  the same at the carve mode's default capacity, C = S
                   (cf = 6/2 = 3), where no token is ever dropped;
   * vmoe          the router-overhead benchmark's V-MoE layer: top-2 of 8
                   experts of 1,536 units, 3,072 active units, cf 1.25;
   * dense_active  a dense MLP of the active width, H = 3,072.
3. The full train step (`benchmarks/router_overhead.py`'s V-MoE, its jitted
   donated step: B*T = 2,048, D = 384, MoE in blocks 1 and 3) with those
   blocks as the router-overhead V-MoE (`baseline`) and as the carved
   S2A2E8 layer (`carved_step`), plus the A/A `control`.

The last line is one JSON object: `carve_seconds`,
`carved_vs_dense`, `carved_vs_vmoe`, `carved_dropless_vs_dense`,
`dense_active_vs_dense` (layer time ratios), `carved_step_vs_vmoe_step`,
`control_overhead`, and the milliseconds of each candidate.
`--quick`: T = 256, D = 64, dense H = 1,024 (carved S2A2E8: 2 x 128 shared
+ 2 x 128 routed), one calibration batch of 64 images; no ViT-S layer.
"""

from __future__ import annotations

import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (compile_train_steps, image_batch, machine,  # noqa: E402
                    parse_args, print_json_last, time_side_by_side,
                    time_train_steps)
from moe_layer import make_step  # noqa: E402
from router_overhead import OPTIMIZER, model_config, shapes  # noqa: E402

from vmoe_ext.carving.layer import carve_mlp  # noqa: E402
from vmoe_ext.carving.dense_source import calibration_images  # noqa: E402
from vmoe_ext.carving.model import carve_vit  # noqa: E402
from vmoe_ext.carving.spec import CarveSpec  # noqa: E402
from vmoe_ext.data import load_dataset  # noqa: E402
from vmoe_ext.models import build_model  # noqa: E402
from vmoe_ext.moe import MoeLayer  # noqa: E402
from vmoe_ext.moe.experts import DenseMlp  # noqa: E402
from vmoe_ext.routers import build_router  # noqa: E402
from vmoe_ext.train.config_files import load_config  # noqa: E402

STEPS = 4  # Train steps per timed sample of part 3 (2 with --quick).


def carving_times(quick: bool) -> dict[str, float]:
  """Part 1: carve the default dense ViT; a ViT-S MLP (full run only)."""
  config = load_config("vit_dense", "plain")
  n = 64 if quick else 256
  model = config.model.to_dict()
  spec = CarveSpec(checkpoint_dir="-", num_experts=8, num_shared=1,
                   num_activated=1, num_calibration=n)
  images = calibration_images(load_dataset(config.data)["train"], spec,
                              config.data)
  params = build_model(model).init(jax.random.key(0), images[:1])["params"]
  spec.check(model)
  result = carve_vit(model, params, images, spec)
  out = {"carve_seconds": result.total_seconds,
         "carve_calibration_tokens": int(n * 17)}
  print(f"carving the default dense ViT (D=64, H=128, 4 blocks) S1A1E8 on "
        f"{n} images: {result.total_seconds:.2f} s; per block: "
        + ", ".join(f"{b}: {s:.2f} s" for b, s in result.seconds.items()))
  if not quick:
    rng = np.random.default_rng(0)
    mlp = DenseMlp(1536).init(jax.random.key(1), jnp.zeros((1, 384)))
    x = rng.standard_normal((16384, 384)).astype(np.float32)
    start = time.perf_counter()
    carve_mlp(jax.tree.map(np.asarray, mlp["params"]), x, num_experts=8,
              num_shared=1, activation="gelu")
    out["carve_vit_s_layer_seconds"] = time.perf_counter() - start
    print(f"one ViT-S MLP (D=384, H=1536) S1A1E8 on 16,384 tokens: "
          f"{out['carve_vit_s_layer_seconds']:.2f} s")
  return out


def layer_candidates(t: int, d: int, h_dense: int) -> dict:
  """Part 2's modules; the carved layer is S2A2E8 of the `h_dense` MLP."""
  m = h_dense // 8

  def carved(cf: float) -> MoeLayer:
    router = build_router({"name": "cmoe", "num_selected": 2},
                          num_experts=6)
    return MoeLayer(router=router, hidden_size=m, group_size=t,
                    capacity_factor=cf, shared_experts=2,
                    output_bias="once")

  vmoe = MoeLayer(router=build_router({"name": "noisy_topk",
                                       "num_selected": 2}, num_experts=8),
                  hidden_size=2 * m, group_size=t, capacity_factor=1.25)
  return {"dense": DenseMlp(h_dense), "carved": carved(1.25),
          "carved_dropless": carved(3.0), "vmoe": vmoe,
          "dense_active": DenseMlp(4 * m)}


def main(argv=None) -> dict:
  args = parse_args(__doc__.splitlines()[0], argv)
  figures: dict = {"quick": bool(args.quick),
                   "device": jax.devices()[0].device_kind}
  figures.update(carving_times(args.quick))

  t, d, h_dense = (256, 64, 1024) if args.quick else (2048, 384, 6144)
  x = jax.random.normal(jax.random.key(2), (1, t, d), jnp.float32)
  steps = {name: make_step(module, x)[0]
           for name, module in layer_candidates(t, d, h_dense).items()}
  times = time_side_by_side(steps, repeats=max(5, args.repeats))
  ms = {f"{name}_ms": v * 1e3 for name, v in times.items()}
  print(f"machine: {machine()}")
  print(f"one layer, T={t} D={d}, dense H={h_dense}, forward+backward:")
  for name, v in times.items():
    print(f"  {name:<16}{v * 1e3:>10.2f} ms  {v / times['dense']:>6.3f} x "
          "dense")
  figures.update(ms)
  figures["carved_vs_dense"] = times["carved"] / times["dense"]
  figures["carved_vs_vmoe"] = times["carved"] / times["vmoe"]
  figures["carved_dropless_vs_dense"] = (times["carved_dropless"]
                                         / times["dense"])
  figures["dense_active_vs_dense"] = times["dense_active"] / times["dense"]

  s = shapes(args.quick)
  m = (4 * s["mlp"]) // 8  # S2A2E8 of a 4x-wide MLP: 3072 active as K*H.
  carved = model_config({"name": "cmoe", "num_selected": 2}, s)
  carved["moe"].update(num_experts=6, hidden_size=m, shared_experts=2,
                       output_bias="once")
  batch = image_batch(s["batch"], s["image"])
  compiled, states, _ = compile_train_steps(
      {"baseline": model_config({"name": "noisy_topk", "num_selected": 2},
                                s),
       "carved_step": carved}, batch, OPTIMIZER)
  step_ms, load, _ = time_train_steps(
      compiled, states, batch, STEPS // 2 if args.quick else STEPS,
      max(3, args.repeats), control="baseline")
  print(f"full train step (router_overhead's V-MoE): baseline "
        f"{step_ms['baseline']:.1f} ms, carved {step_ms['carved_step']:.1f} "
        f"ms, control {step_ms['control']:.1f} ms; load average "
        f"{load[0]:.2f} -> {load[1]:.2f}")
  figures["vmoe_step_ms"] = step_ms["baseline"]
  figures["carved_step_ms"] = step_ms["carved_step"]
  figures["carved_step_vs_vmoe_step"] = (step_ms["carved_step"]
                                         / step_ms["baseline"])
  figures["control_overhead"] = step_ms["control"] / step_ms["baseline"] - 1
  figures["load_average"] = load
  print_json_last(figures)
  return figures


if __name__ == "__main__":
  main()
