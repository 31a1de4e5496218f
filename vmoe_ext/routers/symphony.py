"""The Symphony router (SymphonySMoE) over any token-choice router
(docs/routers.md, "`symphony` — Symphony router").

Algorithm 1 of the paper, for the N tokens of a batch (N = G*S here):

1. the base router gives gates `g_i = softmax(gamma(x_i))` `[E]` (any base:
   V-MoE linear, XMoE cosine, ACMoE, ...; in training the base's noise is
   part of gamma) and its own top-K selection `s_i` (K-hot);
2. smoothed gates `g_sym_i = A g_i` (`g_sym_ij = sum_k a_jk g_ik`) with the
   expert co-selection graph `A` `[E, E]` *as it was before this batch*;
   the token goes to `TopK(g_sym_i)`, weighted by those `g_sym` values
   (Switch-style, Eq. 8; `renormalize_gates` divides them by their sum);
3. training only, without gradient: co-selection counts
   `A' = sum_i s_i s_i^T` of the base's selections, summed over the
   data-parallel axis, row-normalised, `A <- beta A + (1 - beta) A'`.

`A` lives in the "router_state" collection (variable "adjacency"), is saved
with checkpoints and is only read in evaluation and attacks.

Defined behaviour the paper leaves open (docs/routers.md):

* while `A` (after sparsification) is all zero — the first training step
  with the paper's zero init — `A g = 0` would make TopK pick experts
  0..K-1 for every token: the router uses the base gates `g` instead
  (metric `symphony_fallback` is 1 then);
* a row of `A'` of an expert no token selected stays 0 (0/0 := 0);
* `threshold` t > 0 sparsifies the graph used for smoothing (entries < t
  become 0, paper appendix G.3); the stored EMA stays dense;
* ties in TopK go to the lower expert index (`lax.top_k`, and our
  `vmoe_ext.moe.select.partitionable_top_k`).

`symphony_soft` (`vmoe_ext.routers.symphony_soft`) applies the same graph to
SoftMoE.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar, Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp

from vmoe_ext.errors import require
from vmoe_ext.moe.select import partitionable_top_k
from vmoe_ext.moe.contract import (ROUTER_STATE, TOKEN_CHOICE, Metrics,
                                   RouterOutput, RoutingContext)
from vmoe_ext.moe.routing import TokenChoiceRouting
from vmoe_ext.routers.wrapper import WrapperRouter

Array = jax.Array
# "uniform": every entry 1/E; "random": iid U(0, 1) entries (the paper's
# "standard uniform", Table 13); "kaiming"/"xavier": torch's
# kaiming_uniform_ / xavier_uniform_ of an [E, E] matrix (Table 13).
INITS = ("zeros", "uniform", "identity", "random", "kaiming", "xavier")


def init_adjacency(init: str, num_experts: int, key: Array) -> Array:
  """The initial graph `[E, E]` float32 (`key` is used by the random inits)."""
  e = num_experts
  if init == "zeros":
    return jnp.zeros((e, e), jnp.float32)
  if init == "uniform":
    return jnp.full((e, e), 1.0 / e, jnp.float32)
  if init == "identity":
    return jnp.eye(e, dtype=jnp.float32)
  bound = {"random": None, "kaiming": math.sqrt(6.0 / e),
           "xavier": math.sqrt(3.0 / e)}[init]
  if bound is None:
    return jax.random.uniform(key, (e, e), jnp.float32)
  return jax.random.uniform(key, (e, e), jnp.float32, -bound, bound)


def coselection_counts(indices: Array, valid: Array, num_experts: int
                       ) -> Array:
  """`A' = sum_i s_i s_i^T` `[E, E]` from selections `[..., K]`.

  `s_i` is the K-hot set of token i's valid choices (an expert listed twice
  counts once), so `A'[j, j]` is how many tokens chose j and `A'[j, k]` how
  many chose both.
  """
  one_hot = jax.nn.one_hot(indices, num_experts, dtype=jnp.float32)
  s = jnp.max(one_hot * valid[..., None].astype(jnp.float32), axis=-2)
  s = s.reshape(-1, num_experts)
  return jnp.einsum("nj,nk->jk", s, s, precision=jax.lax.Precision.HIGHEST)


def row_normalize(counts: Array) -> Array:
  """Rows divided by their sums; all-zero rows stay zero."""
  total = jnp.sum(counts, axis=-1, keepdims=True)
  return jnp.where(total > 0, counts / jnp.where(total > 0, total, 1.0), 0.0)


def update_adjacency(adjacency: Array, counts: Array, beta: float) -> Array:
  """Algorithm 1 lines 15-16: `beta A + (1 - beta) RowNorm(A')`."""
  return beta * adjacency + (1.0 - beta) * row_normalize(counts)


def smoothing_graph(adjacency: Array, threshold: float = 0.0
                    ) -> tuple[Array, Array]:
  """The graph used for smoothing and whether to fall back to the base.

  Returns `(A_used [E, E], fallback)`: entries below `threshold` zeroed
  (when `threshold > 0`), and the bool scalar "A_used is all zero".
  """
  graph = adjacency
  if threshold > 0:
    graph = jnp.where(adjacency >= threshold, adjacency, 0.0)
  return graph, jnp.all(graph == 0)


def smooth_gates(gates: Array, adjacency: Array, threshold: float = 0.0
                 ) -> tuple[Array, Array]:
  """`g_sym = A g` per token: `[..., E] -> [..., E]`, and the fallback flag.

  No gradient flows into the graph. Where the (sparsified) graph is all
  zero the base gates are returned unchanged.
  """
  graph, fallback = smoothing_graph(
      jax.lax.stop_gradient(adjacency.astype(jnp.float32)), threshold)
  smoothed = jnp.einsum("...k,jk->...j", gates, graph,
                        precision=jax.lax.Precision.HIGHEST)
  return jnp.where(fallback, gates, smoothed), fallback


def symphony_top_k(gates: Array, adjacency: Array, *, num_selected: int,
                   threshold: float = 0.0, renormalize_gates: bool = False
                   ) -> tuple[TokenChoiceRouting, Array, Array]:
  """Eq. 8: TopK of the smoothed gates, combined with their values.

  Args:
    gates: `[G, S, E]` base gates `softmax(gamma(x))`.
    adjacency: `[E, E]` the graph before this batch's update.
    num_selected: K.
    threshold: sparsification threshold of the graph (0: dense).
    renormalize_gates: divide the K combine weights by their sum.

  Returns:
    the routing (`[G, S, K]`), the smoothed gates `[G, S, E]` and the
    fallback flag.
  """
  smoothed, fallback = smooth_gates(gates, adjacency, threshold)
  top, idx = partitionable_top_k(smoothed, num_selected)
  if renormalize_gates:
    top = top / jnp.maximum(jnp.sum(top, axis=-1, keepdims=True), 1e-30)
  return TokenChoiceRouting.create(idx, top), smoothed, fallback


class SymphonyRouter(WrapperRouter):
  """Symphony router over a token-choice base router (module doc).

  Attributes:
    base: the base router's config (E is this router's); token choice with
      a fixed K (noisy_topk, cosine, cosine_lm, acmoe over those). Its K is
      Symphony's K; its auxiliary losses (on its own gates) are kept.
    beta: EMA coefficient of the graph update, in [0, 1] (paper: 0.9).
    graph_init: initial graph, one of `INITS` (paper's best: "zeros").
    init_seed: seed of the random inits (folded with the block index).
    threshold: sparsification threshold t in [0, 1) of the graph used for
      smoothing (0: dense, the paper's default; its ablation uses 0.05).
    renormalize_gates: combine with the K smoothed gates divided by their
      sum instead of their raw values (Eq. 8).
  """
  scan_safe: ClassVar[bool] = False  # Reads the block's position.
  base: Mapping[str, Any] = dataclasses.field(
      default_factory=lambda: {"name": "noisy_topk", "num_selected": 2})
  beta: float = 0.9
  graph_init: str = "zeros"
  init_seed: int = 0
  threshold: float = 0.0
  renormalize_gates: bool = False

  def __post_init__(self):
    _check_number(self.beta, "router.beta", 0.0, 1.0, "[0, 1]",
                  closed_right=True)
    _check_number(self.threshold, "router.threshold", 0.0, 1.0, "[0, 1)",
                  closed_right=False)
    require(self.graph_init in INITS, "router.graph_init",
            f"unknown graph init {self.graph_init!r}; one of {INITS}")
    require(isinstance(self.init_seed, int) and self.init_seed >= 0,
            "router.init_seed",
            f"must be an integer >= 0, got {self.init_seed!r}")
    require(isinstance(self.renormalize_gates, bool),
            "router.renormalize_gates",
            f"must be True or False, got {self.renormalize_gates!r}")
    self.check_base(self.base_prototype())
    super().__post_init__()

  def check_base(self, base) -> None:
    """Raises ConfigError on `router.base.name` for a base it cannot wrap."""
    name = self.base.get("name")
    require(base.kind == TOKEN_CHOICE, "router.base.name",
            f"Symphony re-selects the top K of a token-choice router's "
            f"gates; base {name!r} is {base.kind} (for SoftMoE use the "
            "'symphony_soft' router)")
    require(base.fixed_top_k, "router.base.name",
            f"Symphony re-selects the top K of the smoothed gates (Eq. 8); "
            f"base {name!r} selects a varying number of experts per token")

  def graph(self, ctx: RoutingContext) -> Any:
    """The "adjacency" variable `[E, E]` in the router-state collection."""
    key = jax.random.fold_in(jax.random.key(self.init_seed), ctx.block)
    return self.variable(ROUTER_STATE, "adjacency", init_adjacency,
                         self.graph_init, self.num_experts, key)

  def route_base(self, x: Array, ctx: RoutingContext, **kwargs: Any
                 ) -> RouterOutput:
    """The base router's output on `x` (submodule "base")."""
    return self.build_base(name="base")(x, ctx, **kwargs)

  def update_graph(self, graph: Any, ctx: RoutingContext, indices: Array,
                   valid: Array) -> None:
    """Algorithm 1's update from the base's selections `[..., K]`."""
    counts = jax.lax.stop_gradient(
        coselection_counts(indices, valid, self.num_experts))
    # The mean over devices normalises to the same rows as the sum.
    graph.value = update_adjacency(graph.value, ctx.reduce_mean(counts),
                                   self.beta)

  @nn.compact
  def __call__(self, x: Array, ctx: RoutingContext, *, capacity: int,
               deterministic: bool, update_state: bool = False
               ) -> RouterOutput:
    """x: `[G, S, D]` -> top-K of `A softmax(gamma(x))` (module doc)."""
    out = self.route_base(x, ctx, capacity=capacity,
                          deterministic=deterministic,
                          update_state=update_state)
    require(out.gates is not None, "router.base.name",
            f"base router {self.base.get('name')!r} does not return its "
            "gates (RouterOutput.gates), which Symphony smooths")
    graph = self.graph(ctx)
    routing, smoothed, fallback = symphony_top_k(
        out.gates.astype(jnp.float32), graph.value,
        num_selected=out.routing.num_selected, threshold=self.threshold,
        renormalize_gates=self.renormalize_gates)
    if update_state:
      self.update_graph(graph, ctx, out.routing.expert_indices,
                        out.routing.valid)
    return RouterOutput(routing, _metrics(out.metrics, fallback),
                        expert_inputs=out.expert_inputs, forward=out.forward,
                        gates=smoothed)


def _metrics(base: Metrics, fallback: Array) -> Metrics:
  return {**base, "symphony_fallback": fallback.astype(jnp.float32)}


def _check_number(value: Any, field: str, low: float, high: float,
                  interval: str, closed_right: bool) -> None:
  ok = (isinstance(value, (int, float)) and not isinstance(value, bool)
        and low <= value and (value <= high if closed_right else value < high))
  require(ok, field, f"must be a number in {interval}, got {value!r}")
