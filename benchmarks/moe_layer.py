"""Forward+backward cost of one MoE layer: dispatchers (indices, einsum, dropless) vs dense.

    python benchmarks/moe_layer.py [--quick] [--repeats N]

Full shape (issue "Foundation"): T=2048 tokens, D=384, H=1536, E=8, K=2,
cf=1.25. Candidates, measured side by side in one process (median of the
interleaved repetitions after warm-up), each computing the gradient of a
scalar loss w.r.t. the tokens and all parameters:

* indices      gather/scatter dispatch, one group of all T tokens;
* einsum_all   one-hot einsum dispatch, one group of all T tokens;
* einsum_g256  one-hot einsum dispatch, groups of 256 tokens;
* dropless     every choice computed, no capacity (`moe.dispatcher =
               "dropless"`, its default backend: on CPU the used blocks of
               128 expert-sorted rows, `vmoe_ext.moe.grouped`);
* dropless_ragged  the same through `jax.lax.ragged_dot` (on CPU a masked
               dense product: every row times every expert);
* dense_active a dense FFN `D -> H*K -> D` on all tokens (same active width).

FLOPs are XLA's cost analysis of each compiled step; the ideal count is
`3 * (T*K*4*D*H + 2*T*D*E)` (forward = routed expert matmuls of the K chosen
experts of every token plus the router; backward = 2x forward). XLA cannot
count a loop whose trip count is data (the dropless blocks): for dropless the
figure is instead the rows its grouped matmul computes over the T*K routed
rows, at the benchmark's routing. The last line printed is one JSON object
with the figures.
"""

from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (  # noqa: E402
    machine, parse_args, print_json_last, time_side_by_side, xla_flops)

from vmoe_ext.models.vit import MlpBlock  # noqa: E402
from vmoe_ext.moe import MoeLayer, TokenChoiceRouting  # noqa: E402
from vmoe_ext.moe.dropless import make_dropless_plan  # noqa: E402
from vmoe_ext.routers import RoutingContext, build_router  # noqa: E402

FULL = dict(tokens=2048, d=384, h=1536, e=8, k=2, cf=1.25, small_group=256)
QUICK = dict(tokens=256, d=64, h=256, e=4, k=2, cf=1.25, small_group=64)


def make_step(module, x):
  """Jitted forward+backward: loss and its grads w.r.t. params and x.

  The loss value is returned too, so that no forward computation is dead code
  (with a linear loss the last forward matmul is otherwise not needed).
  """
  variables = dict(module.init(jax.random.key(0), *_call_args(module, x)))
  params = variables.pop("params")
  state = variables  # Non-parameter collections (router state), read only.
  cot = jax.random.normal(jax.random.key(1), x.shape, x.dtype)

  def loss(params, x):
    out = module.apply({"params": params, **state}, *_call_args(module, x))
    y = out[0] if isinstance(out, tuple) else out
    return jnp.sum(y * cot)

  grad_fn = jax.value_and_grad(loss, argnums=(0, 1))
  step = jax.jit(grad_fn)
  return (lambda: step(params, x)), (grad_fn, params, x)


def _call_args(module, x):
  return (x, RoutingContext()) if isinstance(module, MoeLayer) else (x,)


def dropless_rows(module: MoeLayer, x) -> tuple[int, int]:
  """(rows the dropless blocks compute, routed rows T*K) at the routing of
  `module`'s initial parameters on `x`."""
  variables = module.init(jax.random.key(0), x, RoutingContext())
  _, state = module.apply(variables, x, RoutingContext(),
                          mutable=["intermediates"])
  idx = state["intermediates"]["selected_experts"][0]  # [B, T, K]
  routing = TokenChoiceRouting.create(idx, jnp.ones(idx.shape))
  plan = make_dropless_plan(routing, module.num_experts,
                            module.dropless_block_size)
  return int(plan.groups.used_blocks) * plan.block_size, idx.size


def main(argv=None) -> dict:
  args = parse_args(__doc__.splitlines()[0], argv)
  s = QUICK if args.quick else FULL
  t, d, h, e, k, cf = s["tokens"], s["d"], s["h"], s["e"], s["k"], s["cf"]
  x = jax.random.normal(jax.random.key(2), (1, t, d), jnp.float32)

  def moe(dispatcher, group_size, **kwargs):
    router = build_router({"name": "noisy_topk", "num_selected": k},
                          num_experts=e)
    return MoeLayer(router=router, hidden_size=h, group_size=group_size,
                    capacity_factor=cf, dispatcher=dispatcher, **kwargs)

  candidates = {
      "indices": moe("indices", t),
      "einsum_all": moe("einsum", t),
      "einsum_g256" if not args.quick else "einsum_small": moe(
          "einsum", s["small_group"]),
      "dropless": moe("dropless", t),
      "dropless_ragged": moe("dropless", t, dropless_backend="ragged"),
      "dense_active": MlpBlock(mlp_dim=h * k),
  }
  steps, flops = {}, {}
  for name, module in candidates.items():
    steps[name], (grad_fn, params, xx) = make_step(module, x)
    flops[name] = xla_flops(grad_fn, params, xx)
  times = time_side_by_side(steps, repeats=max(5, args.repeats))
  rows, routed = dropless_rows(candidates["dropless"], x)

  ideal = 3 * (t * k * 4 * d * h + 2 * t * d * e)
  small = "einsum_g256" if not args.quick else "einsum_small"
  print(f"machine: {machine()}")
  print(f"shape: T={t} D={d} H={h} E={e} K={k} cf={cf}; ideal fwd+bwd FLOPs "
        f"{ideal / 1e9:.2f} G")
  print(f"{'candidate':<16}{'median ms':>12}{'XLA GFLOPs':>12}{'vs ideal':>10}")
  for name in candidates:
    counted = (f"{flops[name] / 1e9:>12.2f}{flops[name] / ideal:>10.2f}"
               if name != "dropless" else
               f"{'(a loop)':>12}{rows / routed:>10.2f}")
    print(f"{name:<16}{times[name] * 1e3:>12.1f}{counted}")
  print(f"dropless: {rows} rows computed for the {routed} routed (T*K), "
        "its 'vs ideal'")
  figures = {
      "quick": bool(args.quick),
      "indices_vs_einsum_all": times["indices"] / times["einsum_all"],
      "indices_vs_einsum_groups": times["indices"] / times[small],
      "indices_vs_dense_active": times["indices"] / times["dense_active"],
      "indices_flops_vs_ideal": flops["indices"] / ideal,
      "einsum_all_flops_vs_ideal": flops["einsum_all"] / ideal,
      "indices_ms": times["indices"] * 1e3,
      "einsum_all_ms": times["einsum_all"] * 1e3,
      "einsum_groups_ms": times[small] * 1e3,
      "dense_active_ms": times["dense_active"] * 1e3,
      "dropless_vs_dense_active": times["dropless"] / times["dense_active"],
      "dropless_vs_indices": times["dropless"] / times["indices"],
      "dropless_vs_einsum_all": times["dropless"] / times["einsum_all"],
      "dropless_ragged_vs_dropless": (times["dropless_ragged"]
                                      / times["dropless"]),
      "dropless_rows_vs_routed": rows / routed,
      "dropless_ragged_flops_vs_ideal": flops["dropless_ragged"] / ideal,
      "dropless_ms": times["dropless"] * 1e3,
      "dropless_ragged_ms": times["dropless_ragged"] * 1e3,
  }
  print_json_last(figures)
  return figures


if __name__ == "__main__":
  main()
