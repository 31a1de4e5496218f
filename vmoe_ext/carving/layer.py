"""Carving one dense MLP into an MoE layer's parameters (CMoE; docs/carving.md,
"The algorithm").

`carve_mlp` profiles the MLP on calibration tokens, groups its hidden units
into a shared expert and balanced routed experts, and picks each routed
expert's representative; `random_split` is the LLaMA-MoE-style baseline (a
seeded random partition, no profiling). `moe_params` turns either grouping
into the parameters of an `MoeLayer` with `shared_experts=N_s`,
`output_bias="once"`, `hidden_size=m` and, for CMoE, the `cmoe` router:

    Moe/Mlp/Dense_0/kernel [N_r, D, m] = W_0[:, units_p]   (bias: b_0[units_p])
    Moe/Mlp/Dense_up/...                 (gated MLPs, sliced like Dense_0)
    Moe/Mlp/Dense_1/kernel [N_r, m, D] = W_1[units_p, :]   (no bias)
    Moe/SharedMlp/...                    the shared units, sliced alike
    Moe/bias [D]                         = b_1, added once
    Moe/router/kernel [D, N_r]           = W_0[:, rep_p] / |W_0[:, rep_p]|
    Moe/router/up_kernel                 (gated: from W_up likewise)
    Moe/router/scale [N_r]               = 0

Experts are exact slices (no rescaling), so with every routed expert active
and `scale = 0` (combine weights 1) the layer computes the dense MLP: the sum
over a partition of the hidden units of their contributions, plus `b_1` once.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional

import numpy as np

from vmoe_ext.carving.grouping import (balanced_clusters, representatives,
                                       top_rate_units)
from vmoe_ext.carving.profiling import (activation_markers, activation_rates,
                                        hidden_states)
from vmoe_ext.errors import require
from vmoe_ext.moe.experts import GATED

Params = dict[str, Any]


@dataclasses.dataclass(frozen=True)
class CarvedLayer:
  """The grouping of one MLP's hidden units.

  Attributes:
    shared: `[N_s * m]` units of the shared expert, increasing.
    experts: `[N_r, m]` units of each routed expert, increasing.
    representatives: `[N_r]` each routed expert's representative unit (None
      for a random split, whose router is fresh).
    rates: `[H]` activation rates (None for a random split).
    cost: the balanced assignment's cost (None for a random split).
    iterations: assignment rounds run (0 for a random split).
  """
  shared: np.ndarray
  experts: np.ndarray
  representatives: Optional[np.ndarray] = None
  rates: Optional[np.ndarray] = None
  cost: Optional[float] = None
  iterations: int = 0


def check_sizes(hidden: int, num_experts: int, num_shared: int,
                hidden_field: str = "model.mlp_dim") -> int:
  """`m = H / E`; errors name the carve fields (`hidden_field`: what the
  message calls the MLP's hidden width H)."""
  require(isinstance(num_experts, int) and num_experts >= 1,
          "carve.num_experts", f"must be an integer >= 1, got {num_experts!r}")
  require(hidden % num_experts == 0, "carve.num_experts",
          f"the MLP's hidden width {hidden_field}={hidden} is not divisible "
          f"by {num_experts} experts (the authors' code drops the remainder "
          "units, which breaks exactness)")
  require(isinstance(num_shared, int) and 0 <= num_shared < num_experts,
          "carve.num_shared", f"must be an integer in 0..{num_experts - 1} "
          f"(fewer than carve.num_experts={num_experts}), got {num_shared!r}")
  return hidden // num_experts


def check_activation_markers(k_a: int, hidden: int,
                             hidden_field: str = "model.mlp_dim") -> None:
  """K_a in [1, H]; the error names `carve.activation_markers`."""
  require(isinstance(k_a, int) and 1 <= k_a <= hidden,
          "carve.activation_markers",
          f"K_a must be an integer in [1, {hidden_field}={hidden}], got "
          f"{k_a!r}")


def carve_mlp(mlp: Mapping[str, Mapping[str, np.ndarray]], x: np.ndarray, *,
              num_experts: int, num_shared: int, activation: str,
              activation_markers_k: int = 10, distance: str = "l2",
              iterations: int = 1,
              normalize: Optional[bool] = None) -> CarvedLayer:
  """CMoE grouping of the dense MLP `mlp` on calibration tokens `x` `[N, D]`.

  Args:
    mlp: the dense MLP's params (`Dense_0`, `Dense_up` if gated, `Dense_1`).
    x: the MLP's inputs (after the block's pre-LayerNorm).
    num_experts: E, shared included (`m = H / E`).
    num_shared: N_s.
    activation: the MLP's activation.
    activation_markers_k: K_a.
    distance: "l2" (paper) or "l1" (authors' code).
    iterations: balanced K-means rounds.
    normalize: normalised profiling (None: for gated activations only).
  """
  hidden = np.shape(mlp["Dense_0"]["kernel"])[-1]
  m = check_sizes(hidden, num_experts, num_shared)
  check_activation_markers(activation_markers_k, hidden)
  require(np.ndim(x) == 2 and np.shape(x)[0] > 0, "carve.num_calibration",
          f"no calibration tokens (got an array of shape {np.shape(x)})")
  if normalize is None:
    normalize = activation in GATED
  h = hidden_states(mlp, x, activation, normalize=normalize)
  markers = activation_markers(h, activation_markers_k)
  rates = activation_rates(markers)
  shared = np.sort(top_rate_units(rates, num_shared * m))
  remaining = np.setdiff1d(np.arange(hidden), shared)
  clusters = balanced_clusters(markers, rates, remaining,
                               num_experts - num_shared, metric=distance,
                               iterations=iterations)
  return CarvedLayer(shared=shared, experts=clusters.units,
                     representatives=representatives(markers, clusters,
                                                     distance),
                     rates=rates, cost=clusters.cost,
                     iterations=clusters.iterations)


def random_split(hidden: int, *, num_experts: int, num_shared: int,
                 seed: int) -> CarvedLayer:
  """A uniformly random partition of the H units (LLaMA-MoE's baseline):
  the first `N_s * m` of a seeded permutation are shared, the rest routed in
  consecutive blocks of m."""
  m = check_sizes(hidden, num_experts, num_shared)
  perm = np.random.default_rng(seed).permutation(hidden)
  shared = np.sort(perm[:num_shared * m])
  experts = np.sort(perm[num_shared * m:].reshape(-1, m), axis=1)
  return CarvedLayer(shared=shared, experts=experts)


def _slice(mlp: Mapping[str, Mapping[str, np.ndarray]], units: np.ndarray,
           activation: str) -> Params:
  """The MLP restricted to hidden `units` (`[..., k]` index arrays give a
  leading expert axis), without the output bias."""
  names = ("Dense_0", "Dense_up") if activation in GATED else ("Dense_0",)
  out: Params = {}
  for name in names:
    layer = mlp[name]
    kernel = np.asarray(layer["kernel"])
    out[name] = {"kernel": np.moveaxis(kernel[:, units], 0, -2)}
    if "bias" in layer:
      out[name]["bias"] = np.asarray(layer["bias"])[units]
  out["Dense_1"] = {"kernel": np.asarray(mlp["Dense_1"]["kernel"])[units]}
  return out


def _unit_rows(kernel: np.ndarray, units: np.ndarray) -> np.ndarray:
  """`[D, k]` the input weights of `units`, each L2-normalised."""
  w = np.asarray(kernel)[:, units]
  return w / np.maximum(np.linalg.norm(w, axis=0, keepdims=True), 1e-12)


def moe_params(mlp: Mapping[str, Mapping[str, np.ndarray]],
               layer: CarvedLayer, activation: str) -> Params:
  """The `Moe` params of a carved layer (module doc); no `router` entry for
  a random split (its router keeps its fresh initialisation)."""
  out: Params = {"Mlp": _slice(mlp, layer.experts, activation)}
  if layer.shared.size:
    out["SharedMlp"] = _slice(mlp, layer.shared, activation)
  d = np.shape(mlp["Dense_1"]["kernel"])[-1]
  dtype = np.asarray(mlp["Dense_1"]["kernel"]).dtype
  out["bias"] = np.asarray(mlp["Dense_1"].get("bias", np.zeros(d, dtype)))
  if layer.representatives is not None:
    reps = layer.representatives
    router = {"kernel": _unit_rows(mlp["Dense_0"]["kernel"], reps),
              "scale": np.zeros(len(reps), dtype)}
    if activation in GATED:
      router["up_kernel"] = _unit_rows(mlp["Dense_up"]["kernel"], reps)
    out["router"] = router
  return out
