"""CMoE's training-free router with bias load balancing (Pei et al. 2025;
docs/routers.md, "`cmoe`", and docs/carving.md, "The algorithm").

A carved MoE layer routes each token with the hidden units of one
representative neuron per routed expert (`vmoe_ext.carving` builds the
weights; here they are ordinary parameters):

    s = softmax(|act(x W_R)|)                      scores          [G, S, E]
        (gated: |silu(x W_R) * (x W_R,up)|, the authors' LLaMA router)
    experts = top_K(s + b)                          selection
    weights = 1 + s_e * u_e   at the selected e     combine weights

`W_R` (`kernel`, and `up_kernel` for a gated activation) holds the
representatives' L2-normalised input rows, applied to un-normalised tokens,
without bias (the authors' router). `u` (`scale` `[E]`) is learnable and
starts at 0, so a freshly carved layer combines every selected expert with
weight 1, exactly as in the dense MLP. `b` (`bias` `[E]`, in the
"router_state" collection, not a parameter) only shifts the selection; it
starts at 0 and, in training steps (`update_state=True`), moves by
`bias_update_rate` (gamma) after the forward pass: down for every expert that
received more selections than the mean, up for every one that received
fewer (DeepSeek-V3's auxiliary-loss-free balancing, as the authors' code
does it after each training forward). The counts are of the K selections of
every token of the batch, before capacity, summed over the data-parallel
axis (`ctx.reduce_sum`); an expert exactly at the mean keeps its bias, a
comparison made exactly in whole counts. Ties in `top_K` go to the lower
expert index. There is no auxiliary loss.

The pure functions `cmoe_scores`, `cmoe_top_k` and `balance_bias` are the
method; `CMoERouter` is the thin linen wrapper that owns the weights and the
state.
"""

from __future__ import annotations

from typing import Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from vmoe_ext.errors import require
from vmoe_ext.moe.select import partitionable_top_k
from vmoe_ext.moe.contract import (ROUTER_STATE, Router, RouterOutput,
                                   RoutingContext, at_least_float32)
from vmoe_ext.moe.experts import GATED, check_activation, hidden_activation
from vmoe_ext.moe.routing import TokenChoiceRouting

Array = jax.Array
_KERNEL_INIT = nn.initializers.lecun_normal()


def cmoe_scores(x: Array, kernel: Array, up_kernel: Optional[Array],
                activation: str) -> Array:
  """`|act(x W_R)|` `[G, S, E]` of tokens `x` `[G, S, D]`, kernels `[D, E]`."""
  x = x.astype(jnp.float32)
  pre = jnp.einsum("gsd,de->gse", x, kernel.astype(jnp.float32))
  up = None
  if activation in GATED:
    up = jnp.einsum("gsd,de->gse", x, up_kernel.astype(jnp.float32))
  return jnp.abs(hidden_activation(activation, pre, up))


def cmoe_top_k(scores: Array, bias: Array, scale: Array, num_selected: int
               ) -> tuple[TokenChoiceRouting, Array]:
  """Selection by `softmax(scores) + bias`, weights `1 + s * scale`.

  Args:
    scores: `[G, S, E]` the `|act(x W_R)|` of `cmoe_scores`.
    bias: `[E]` the balancing bias (selection only; no gradient flows to it).
    scale: `[E]` the learnable `u`.
    num_selected: K.

  Returns:
    The routing (`[G, S, K]` indices and weights `1 + s_e u_e`) and the
    unbiased `s = softmax(scores)` `[G, S, E]`.
  """
  s = jax.nn.softmax(scores, axis=-1)
  biased = s + jax.lax.stop_gradient(bias).astype(s.dtype)
  _, indices = partitionable_top_k(biased, num_selected)
  # `jnp.take`, not `scale[indices]`: a NumPy `scale` (e.g. a restored
  # param closed over by a jitted function) cannot be indexed by a tracer.
  weights = 1.0 + jnp.take_along_axis(s, indices, axis=-1) * jnp.take(
      jnp.asarray(scale), indices)
  return TokenChoiceRouting.create(indices, weights), s


def balance_bias(bias: Array, counts: Array, rate: float) -> Array:
  """`b_e - rate` where `counts_e > mean(counts)`, `+ rate` where below.

  `counts` `[E]` are whole selection counts (summed over the batch and the
  devices). An expert exactly at the mean keeps its bias: the comparison is
  `E * counts_e` against `sum(counts)`, exact for integer counts, never
  against a rounded float mean (with E = 7 and counts summing to 168,
  `mean` computes 24.000002 and would move an expert holding 24).
  """
  total = jnp.sum(counts)
  scaled = counts * counts.shape[-1]
  step = jnp.where(scaled > total, -rate,
                   jnp.where(scaled < total, rate, 0.0))
  return bias + step.astype(bias.dtype)


def selection_counts(indices: Array, num_experts: int) -> Array:
  """`[E]` float32: how many of the `[..., K]` selections went to each expert."""
  one_hot = jax.nn.one_hot(indices.reshape(-1), num_experts,
                           dtype=jnp.float32)
  return jnp.sum(one_hot, axis=0)


class CMoERouter(Router):
  """CMoE router: top-K of `softmax(|act(x W_R)|) + b`, weights `1 + s u`.

  Attributes:
    num_selected: K, routed experts per token (CMoE's "A" in S{S}A{A}E{E}).
    activation: the score's activation, that of the carved MLP (`gelu`,
      `gelu_exact`, `relu`, or `swiglu`, which adds `up_kernel`).
    bias_update_rate: gamma of the balancing bias (1e-3, the paper's and the
      authors' default); 0 turns balancing off (the bias stays 0).

  `kernel`/`up_kernel` `[D, E]` start LeCun-normal when the router is not
  carved (e.g. a V-MoE trained from scratch with this router).
  """
  num_selected: int = 1
  activation: str = "gelu"
  bias_update_rate: float = 1e-3

  def __post_init__(self):
    require(isinstance(self.num_selected, int) and 0 < self.num_selected
            <= self.num_experts, "router.num_selected",
            f"must be an integer in 1..E={self.num_experts}, got "
            f"{self.num_selected!r}")
    check_activation(self.activation, "router.activation")
    require(isinstance(self.bias_update_rate, (int, float))
            and self.bias_update_rate >= 0, "router.bias_update_rate",
            f"must be >= 0, got {self.bias_update_rate!r}")
    super().__post_init__()

  @property
  def slots_per_token(self) -> int:
    return self.num_selected

  @nn.compact
  def __call__(self, x: Array, ctx: RoutingContext, *, capacity: int,
               deterministic: bool, update_state: bool = False
               ) -> RouterOutput:
    """x: `[G, S, D]` -> the routing of the module doc."""
    del capacity, deterministic  # No noise; capacity is the dispatcher's.
    d, e = x.shape[-1], self.num_experts
    # Read in float32 whatever `model.param_dtype` stores them in.
    f32 = lambda name, init, shape: at_least_float32(self.param(
        name, init, shape, jnp.float32))
    kernel = f32("kernel", _KERNEL_INIT, (d, e))
    up_kernel = (f32("up_kernel", _KERNEL_INIT, (d, e))
                 if self.activation in GATED else None)
    scale = f32("scale", nn.initializers.zeros, (e,))
    bias = self.variable(ROUTER_STATE, "bias", jnp.zeros, (e,), jnp.float32)
    scores = cmoe_scores(x, kernel, up_kernel, self.activation)
    routing, s = cmoe_top_k(scores, bias.value, scale, self.num_selected)
    counts = selection_counts(routing.expert_indices, e)
    if update_state and self.bias_update_rate > 0:
      bias.value = balance_bias(bias.value, ctx.reduce_sum(counts),
                                self.bias_update_rate)
    metrics = {"auxiliary_loss": jnp.zeros((), jnp.float32),
               "bias_spread": jnp.max(bias.value) - jnp.min(bias.value)}
    return RouterOutput(routing, metrics, gates=s)
