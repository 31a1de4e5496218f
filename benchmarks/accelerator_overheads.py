"""Router and stream overheads at Swin-MoE-S, next to the papers' tables.

Part of `benchmarks/accelerator.py`. The candidates are Swin-MoE-S top-2
(`configs/swin_moe_imagenet.py:top2`, its release gate) with each router
over that gate and each momentum stream (`layout="paper"`: the update on
the MoE blocks only), trained by the project's step at the config's
per-device batch; `overhead` = step time / baseline - 1, with an A/A
control (the baseline's executable again). `PAPER_TABLES` holds the raw
figures the papers report for the same comparison (their ratio is computed,
not copied): ACMoE Table 7 (ms per training iteration, Swin
Transformer, Switch and GLaM), Symphony Table 11 (test-time ms on
Switch-medium, A100, batch 8, top-2: E = 16 at 256 and 4096 tokens) and
MomentumSMoE Table 11 (training seconds per sample, Switch-medium).
"""

from __future__ import annotations

from typing import Any, Mapping

# Candidate -> its router from the baseline's gate (the base of the routers
# that have one).
ROUTERS: dict[str, Any] = {
    "acmoe": lambda gate: dict(name="acmoe", normalization="swin",
                               dispersion="mad", layers="preset", base=gate),
    "symphony": lambda gate: dict(name="symphony", beta=0.9,
                                  graph_init="zeros", threshold=0.0,
                                  base=gate),
    "acmoe_symphony": lambda gate: dict(
        name="symphony", beta=0.9, graph_init="zeros", threshold=0.0,
        base=ROUTERS["acmoe"](gate)),
    "xmoe": lambda gate: dict(name="cosine", num_selected=2),
    "topp": lambda gate: dict(name="top_p", num_selected=2, threshold=0.05,
                              load_loss_weight=0.0),
}
STREAMS: dict[str, dict] = {
    "momentum": {"name": "momentum", "mu": 0.8, "gamma": 1.0,
                 "layout": "paper"},
    "adam": {"name": "adam", "layout": "paper"},
    "robust_momentum": {"name": "robust_momentum", "layout": "paper"},
}
QUICK = ("acmoe", "momentum")  # --quick: one router and one stream.
# Raw figures: (baseline, method) in the table's unit.
PAPER_TABLES: dict[str, dict[str, tuple[float, float]]] = {
    "acmoe_table7_ms_per_it": {"swin": (403.36, 408.56),
                               "switch": (391.93, 393.29),
                               "glam": (422.62, 425.15)},
    "symphony_table11_test_ms": {"switch_e16_256": (27.19, 27.29),
                                 "switch_e16_4096": (413.52, 413.35)},
    "momentum_table11_train_s_per_sample": {"momentum": (0.0315, 0.0317),
                                            "adam": (0.0315, 0.0321)},
}


def paper_overheads() -> dict[str, dict[str, float]]:
  """Each paper row's method / baseline - 1."""
  return {table: {row: method / base - 1
                  for row, (base, method) in rows.items()}
          for table, rows in PAPER_TABLES.items()}


def candidates(base: Mapping[str, Any]) -> dict[str, dict]:
  """name -> Swin-MoE model config: the baseline, each router, each
  stream."""
  gate = dict(base["moe"]["router"])
  out = {"baseline": dict(base)}
  for name, router in ROUTERS.items():
    out[name] = {**base, "moe": {**base["moe"], "router": router(gate)}}
  for name, stream in STREAMS.items():
    out[name] = {**base, "stream": dict(stream)}
  return out


def reference(name: str) -> str:
  """The candidate `name` is compared with."""
  return "acmoe" if name == "acmoe_symphony" else "baseline"
