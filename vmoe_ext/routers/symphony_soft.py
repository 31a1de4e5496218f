"""SymphonySoftMoE (Symphony paper appendix E.4): the expert graph on SoftMoE.

SoftMoE has no top-K, so "selection" and "gates" are defined on its combine
weights `c[s, e, p]` (softmax over all `E*P` slots of token s):

* the token's expert gates are the combine mass per expert,
  `q[s, e] = sum_p c[s, e, p]` (a distribution over experts, the soft
  counterpart of `softmax(gamma(x))`);
* smoothing is Symphony's `q_sym = A q` (graph before this batch, base
  gates while it is all zero), spread over each expert's slots in the
  proportions SoftMoE gave them: `c_sym[s, e, p] = c[s, e, p] q_sym[s, e] /
  q[s, e]` (`renormalize_gates` divides by the token's total so it sums to
  1 again); dispatch weights (how slots mix tokens) are unchanged;
* a token co-selects the `num_selected` experts of largest `q` (before
  smoothing; default 2, the paper's top-2), and the graph update is
  Algorithm 1's on those K-hot sets over all tokens of the batch.

The base is any soft router config (`soft`, or `acmoe` over `soft`), so the
slots can also see ACMoE-scaled tokens.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp

from vmoe_ext.errors import require
from vmoe_ext.moe.select import partitionable_top_k
from vmoe_ext.moe.contract import SOFT, RouterOutput, RoutingContext
from vmoe_ext.moe.routing import SoftRouting
from vmoe_ext.routers.symphony import SymphonyRouter, _metrics, smooth_gates

Array = jax.Array


def symphony_soft_combine(combine: Array, adjacency: Array, *,
                          threshold: float = 0.0,
                          renormalize_gates: bool = False
                          ) -> tuple[Array, Array, Array]:
  """Smoothed combine weights.

  Args:
    combine: `[G, S, E, P]` SoftMoE combine weights.
    adjacency: `[E, E]` the graph before this batch's update.
    threshold: sparsification threshold (0: dense).
    renormalize_gates: make each token's weights sum to 1 again.

  Returns:
    `c_sym [G, S, E, P]`, the base expert gates `q [G, S, E]` and the
    fallback flag.
  """
  q = jnp.sum(combine, axis=-1)
  q_sym, fallback = smooth_gates(q, adjacency, threshold)
  ratio = jnp.where(q > 0, q_sym / jnp.where(q > 0, q, 1.0), 0.0)
  out = combine * ratio[..., None]
  if renormalize_gates:
    total = jnp.sum(out, axis=(-2, -1), keepdims=True)
    out = out / jnp.maximum(total, 1e-30)
  return out, q, fallback


class SymphonySoftRouter(SymphonyRouter):
  """Symphony's expert graph on a SoftMoE router (module doc).

  Attributes (besides `SymphonyRouter`'s beta, graph_init, init_seed, threshold,
  renormalize_gates):
    base: a soft router config (default `{"name": "soft"}`).
    num_selected: K of the co-selection counts: each token's K experts of
      largest combine mass (1 <= K <= E).
  """
  base: Mapping[str, Any] = dataclasses.field(
      default_factory=lambda: {"name": "soft"})
  num_selected: int = 2

  def check_base(self, base) -> None:
    require(base.kind == SOFT, "router.base.name",
            f"symphony_soft smooths SoftMoE's combine weights; base "
            f"{self.base.get('name')!r} is {base.kind} (use 'symphony')")
    require(isinstance(self.num_selected, int)
            and not isinstance(self.num_selected, bool)
            and 1 <= self.num_selected <= self.num_experts,
            "router.num_selected", f"K={self.num_selected!r} must be an "
            f"integer in [1, num_experts E={self.num_experts}]")

  @nn.compact
  def __call__(self, x: Array, ctx: RoutingContext, *, capacity: int,
               deterministic: bool, update_state: bool = False
               ) -> RouterOutput:
    """x: `[G, S, D]` -> SoftMoE routing with smoothed combine weights."""
    out = self.route_base(x, ctx, capacity=capacity,
                          deterministic=deterministic,
                          update_state=update_state)
    routing: SoftRouting = out.routing
    graph = self.graph(ctx)
    combine, q, fallback = symphony_soft_combine(
        routing.combine_weights.astype(jnp.float32), graph.value,
        threshold=self.threshold, renormalize_gates=self.renormalize_gates)
    if update_state:
      _, top = partitionable_top_k(q, self.num_selected)
      self.update_graph(graph, ctx, top, jnp.ones(top.shape, bool))
    return out.replace(routing=routing.replace(combine_weights=combine),
                       metrics=_metrics(out.metrics, fallback))
