"""XMoE cosine router (Chi et al. 2022) and the ACMoE authors' LM base router
(docs/routers.md, "`cosine` — XMoE" and "`cosine_lm`").

Scores are cosine similarities in a low-dimensional space:
`l[s, e] = <normalize(x_s P), normalize(e_e)> / tau` with a projection
`P[D, R]` (no bias), expert embeddings `e[E, R]` and a temperature `tau`, then
the V-MoE top-k selection (`vmoe_ext.routers.noisy_top_k`). `normalize` is
torch's `F.normalize` (`v / max(||v||, 1e-4)`), as in the X-MoE gate of
torchscale.

Registered names:

* "cosine" — XMoE: R = 16 and `e` initialised orthogonal with gain 0.32 (the
  X-MoE gate in torchscale), learnable temperature initialised at 0.07 (the
  paper makes tau learnable; 0.07 is our default, set `temperature`), no
  router noise.
* "cosine_lm" — the base router of the ACMoE authors' language-model code:
  `l[s, e] = <x_s, normalize(e_e)>` (no projection, tokens not normalised,
  no temperature) and combine weights `softmax(top-K logits)`
  (`renormalize_gates=True`), no noise.
"""

from __future__ import annotations

from typing import Any, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from vmoe_ext.errors import require
from vmoe_ext.moe.contract import RoutingContext
from vmoe_ext.routers.noisy_top_k import NoisyTopKRouter

Array = jax.Array
NORMALIZE_EPS = 1e-4


def torch_normalize(v: Array, eps: float = NORMALIZE_EPS) -> Array:
  """`v / max(||v||_2, eps)` over the last axis (torch `F.normalize`)."""
  norm = jnp.sqrt(jnp.sum(jnp.square(v), axis=-1, keepdims=True))
  return v / jnp.maximum(norm, eps)


def cosine_logits(x: Array, projection: Optional[Array], embeddings: Array,
                  temperature: Array | float, normalize_tokens: bool = True
                  ) -> Array:
  """Cosine router logits.

  Args:
    x: `[G, S, D]` tokens.
    projection: `[D, R]` or None (R = D: no projection).
    embeddings: `[E, R]` expert embeddings.
    temperature: scalar tau (logits are divided by it).
    normalize_tokens: L2-normalise the (projected) tokens.

  Returns:
    `[G, S, E]` logits (float32).
  """
  h = x.astype(jnp.float32)
  if projection is not None:
    h = jnp.einsum("gsd,dr->gsr", h, projection)
  if normalize_tokens:
    h = torch_normalize(h)
  e = torch_normalize(embeddings.astype(jnp.float32))
  return jnp.einsum("gsr,er->gse", h, e) / temperature


class CosineRouter(NoisyTopKRouter):
  """XMoE cosine router: top-k over `softmax(cos(x P, e) / tau)`.

  Attributes (besides `NoisyTopKRouter`'s: K, noise, gate renormalisation,
  auxiliary losses):
    projection_dim: R, or None for no projection (scores in the model width).
    normalize_tokens: L2-normalise the projected tokens (False: dot product
      of raw tokens with normalised expert embeddings).
    temperature: tau (the initial value when learnable); > 0.
    learnable_temperature: tau is the parameter "temperature".
    embedding_gain: gain of the orthogonal initialiser of `e`.
  """
  projection_dim: Optional[int] = 16
  normalize_tokens: bool = True
  temperature: float = 0.07
  learnable_temperature: bool = True
  embedding_gain: float = 0.32
  noise_std: float = 0.0

  def __post_init__(self):
    require(self.projection_dim is None or (
        isinstance(self.projection_dim, int)
        and not isinstance(self.projection_dim, bool)
        and self.projection_dim > 0), "router.projection_dim",
            f"must be a positive integer or None, got {self.projection_dim!r}")
    require(isinstance(self.temperature, (int, float))
            and not isinstance(self.temperature, bool)
            and self.temperature > 0, "router.temperature",
            f"must be a number > 0, got {self.temperature!r}")
    require(self.embedding_gain > 0, "router.embedding_gain",
            f"must be > 0, got {self.embedding_gain}")
    require(not self.logits_bias, "router.logits_bias",
            "the cosine router's logits `cos(x P, e) / tau` have no bias; "
            "it is an option of the linear routers (noisy_topk, top_p)")
    super().__post_init__()

  def compute_logits(self, x: Array, ctx: RoutingContext) -> Array:
    del ctx
    d = x.shape[-1]
    projection = None
    if self.projection_dim is not None:
      projection = self.param("projection", nn.initializers.lecun_normal(),
                              (d, self.projection_dim))
    r = d if self.projection_dim is None else self.projection_dim
    embeddings = self.param(
        "embeddings", nn.initializers.orthogonal(scale=self.embedding_gain),
        (self.num_experts, r))
    tau: Any = float(self.temperature)
    if self.learnable_temperature:
      tau = self.param("temperature", nn.initializers.constant(tau), ())
    return cosine_logits(x, projection, embeddings, tau,
                         self.normalize_tokens)


class CosineLMRouter(CosineRouter):
  """The ACMoE authors' LM base router: `<x, normalize(e)>`, softmax(top-K)."""
  projection_dim: Optional[int] = None
  normalize_tokens: bool = False
  temperature: float = 1.0
  learnable_temperature: bool = False
  renormalize_gates: bool = True
