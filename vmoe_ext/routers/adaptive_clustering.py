"""The Adaptive Clustering transform of ACMoE, as pure functions
(docs/routers.md, "`acmoe` — Adaptive Clustering router").

Shape letters: N tokens (the whole batch, token-major), D features, E clusters
(the previous MoE layer's experts), K entries of the previous layer's
assignment (its top-K experts, best first).

For each expert cluster k of the previous MoE layer, the tokens whose previous
top-1 expert is k give a per-feature dispersion `s[k, q]` (mean absolute
deviation from the cluster mean, or the variance as the ablation). The
feature weights are `W = 1 / (s + eps)`, optionally clamped to
`clamp * mean(W)` (global mean over `[E, D]` before the clamp) and normalised
by one of the means below. A token's scaling is the row of its previous top-1
cluster (Mix-1), or the gate-weighted sum of the rows of its previous top-k
clusters (Mix-k). Nothing here is learnable and no gradient flows through the
scaling: the statistics are computed on stop-gradient tokens.

The `normalization` presets follow the paper and the authors' three code bases
(docs/routers.md, "`acmoe`", the presets table); every field can be
overridden:

| preset   | eps  | clamp | mean              | stat tokens | scaled go to | mix |
|----------|------|-------|-------------------|-------------|--------------|-----|
| paper    | 1e-4 | none  | cluster (M_k mean 1) | MoE input | router     | 1, renormalized |
| language | 1e-4 | 10    | feature (over clusters, after clamp) | MoE input | router | 1, renormalized |
| swin     | 1e-4 | 1.5   | global, pre-clamp | MoE input   | experts      | 1, raw |
| softmoe  | 0.35 | 5     | global, post-clamp | L2-normalised MoE input | dispatch | 8, slot_softmax |

With `dispersion="variance"`: paper `1/(var+1e-4)`, mean per cluster; language
`1/(var+0.1)`, no clamp, no normalisation; swin and softmoe `1/(var+1e-4)`,
clamp 10, divided by the global pre-clamp mean.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp

from vmoe_ext.errors import require

Array = jax.Array
Reduce = Optional[Callable[[Array], Array]]

DISPERSIONS = ("mad", "variance")
MEANS = ("cluster", "feature", "global_pre_clamp", "global_post_clamp", "none")
MIX_WEIGHTS = ("renormalized", "raw", "slot_softmax")
SCALED_TO = ("router", "experts", "dispatch")
PRESET = "preset"  # A field left at "preset" takes the preset's value.

# Per preset: the MAD form, the variance-ablation overrides, and the rest.
PRESETS: dict[str, dict[str, Any]] = {
    "paper": dict(eps=1e-4, clamp=None, mean="cluster", l2_normalize=False,
                  scaled_to="router", mix_k=1, mix_weights="renormalized",
                  variance=dict(eps=1e-4, clamp=None, mean="cluster")),
    "language": dict(eps=1e-4, clamp=10.0, mean="feature", l2_normalize=False,
                     scaled_to="router", mix_k=1, mix_weights="renormalized",
                     variance=dict(eps=0.1, clamp=None, mean="none")),
    "swin": dict(eps=1e-4, clamp=1.5, mean="global_pre_clamp",
                 l2_normalize=False, scaled_to="experts", mix_k=1,
                 mix_weights="raw",
                 variance=dict(eps=1e-4, clamp=10.0, mean="global_pre_clamp")),
    "softmoe": dict(eps=0.35, clamp=5.0, mean="global_post_clamp",
                    l2_normalize=True, scaled_to="dispatch", mix_k=8,
                    mix_weights="slot_softmax",
                    variance=dict(eps=1e-4, clamp=10.0,
                                  mean="global_pre_clamp")),
}


@dataclasses.dataclass(frozen=True)
class ACOptions:
  """Resolved options of the transform (no "preset" values left).

  Attributes:
    dispersion: "mad" or "variance".
    eps: added to the dispersion before inverting (>= 0).
    clamp: clamp W at `clamp * mean(W)` (global, pre-clamp mean), or None.
    mean: what W is divided by: "cluster" (each cluster's mean over D, so
      each M_k has mean 1), "feature" (each feature's mean over the
      clusters), "global_pre_clamp" / "global_post_clamp" (the mean over
      [E, D] before / after the clamp) or "none".
    l2_normalize: the statistics (and the scaled tokens) are the
      L2-normalised tokens.
    scaled_to: where the scaled tokens go: "router" only, the router and the
      "experts", or the router and the soft "dispatch".
    mix_k: 1 (Mix-1: the previous top-1 cluster) or k > 1 (Mix-k: the
      previous layer's first k entries).
    mix_weights: the Mix-k weights: "renormalized" (the k gates divided by
      their sum), "raw" (the gates as they are, e.g. raw softmax values) or
      "slot_softmax" (SoftMoE: softmax over the previous top-k slot logits,
      i.e. their combine weights renormalised).
  """
  dispersion: str = "mad"
  eps: float = 1e-4
  clamp: Optional[float] = None
  mean: str = "cluster"
  l2_normalize: bool = False
  scaled_to: str = "router"
  mix_k: int = 1
  mix_weights: str = "renormalized"


def resolve_options(normalization: str, dispersion: str = "mad",
                    **overrides: Any) -> ACOptions:
  """The options of a preset with `overrides` (values "preset" are skipped).

  Raises:
    ConfigError naming `router.<field>` for an unknown preset or value.
  """
  require(normalization in PRESETS, "router.normalization",
          f"unknown preset {normalization!r}; presets: {sorted(PRESETS)}")
  require(dispersion in DISPERSIONS, "router.dispersion",
          f"must be one of {DISPERSIONS}, got {dispersion!r}")
  preset = dict(PRESETS[normalization])
  variance = preset.pop("variance")
  if dispersion == "variance":
    preset.update(variance)
  values = dict(preset, dispersion=dispersion)
  for key, value in overrides.items():
    require(key in values, f"router.{key}", "not an Adaptive Clustering "
            f"option; options: {sorted(values)}")
    if not (isinstance(value, str) and value == PRESET):
      values[key] = value
  opts = ACOptions(**values)
  check_options(opts)
  return opts


def check_options(opts: ACOptions) -> None:
  """Range checks, each naming the `router.<field>` it is about."""
  require(isinstance(opts.eps, (int, float)) and not isinstance(
      opts.eps, bool) and opts.eps >= 0, "router.eps",
          f"must be a number >= 0, got {opts.eps!r}")
  require(opts.clamp is None or (isinstance(opts.clamp, (int, float))
                                 and not isinstance(opts.clamp, bool)
                                 and opts.clamp > 0), "router.clamp",
          f"must be a number > 0 or None (no clamp), got {opts.clamp!r}")
  require(opts.mean in MEANS, "router.mean",
          f"must be one of {MEANS}, got {opts.mean!r}")
  require(isinstance(opts.l2_normalize, bool), "router.l2_normalize",
          f"must be a bool, got {opts.l2_normalize!r}")
  require(opts.scaled_to in SCALED_TO, "router.scaled_to",
          f"must be one of {SCALED_TO}, got {opts.scaled_to!r}")
  require(isinstance(opts.mix_k, int) and not isinstance(opts.mix_k, bool)
          and opts.mix_k >= 1, "router.mix_k",
          f"must be an integer >= 1, got {opts.mix_k!r}")
  require(opts.mix_weights in MIX_WEIGHTS, "router.mix_weights",
          f"must be one of {MIX_WEIGHTS}, got {opts.mix_weights!r}")


def cluster_dispersion(tokens: Array, clusters: Array, num_clusters: int,
                       dispersion: str = "mad", reduce: Reduce = None
                       ) -> tuple[Array, Array]:
  """Per-cluster, per-feature dispersion of the tokens.

  Args:
    tokens: `[N, D]`.
    clusters: `[N]` int, each token's cluster (-1: in no cluster).
    num_clusters: E; the count is static, empty clusters get dispersion 0.
    dispersion: "mad" (mean absolute deviation from the cluster mean) or
      "variance" (population variance).
    reduce: applied to the per-cluster sums and counts before dividing (the
      mean over a data-parallel axis), so the statistic is the global batch's.

  Returns:
    s: `[E, D]` float32; counts: `[E]` tokens per cluster.
  """
  tokens = tokens.astype(jnp.float32)
  one_hot = (clusters[:, None] == jnp.arange(num_clusters)[None, :]
             ).astype(jnp.float32)  # [N, E]; all zero for cluster -1.
  reduce = reduce or (lambda v: v)
  counts = reduce(jnp.sum(one_hot, axis=0))
  # A mean over devices can be < 1 for a non-empty cluster: only empty
  # clusters (sums 0, dispersion 0) divide by 1.
  denom = jnp.where(counts > 0, counts, 1.0)[:, None]
  hi = jax.lax.Precision.HIGHEST
  mean = reduce(jnp.matmul(one_hot.T, tokens, precision=hi)) / denom
  # Each token's cluster mean by a gather (a token in no cluster gets 0):
  # the values of the one-hot matmul without its N x E x D multiply-adds.
  centre = jnp.where((clusters >= 0)[:, None],
                     mean[jnp.maximum(clusters, 0)], 0.0)
  deviation = tokens - centre
  deviation = (jnp.abs(deviation) if dispersion == "mad"
               else jnp.square(deviation))
  s = reduce(jnp.matmul(one_hot.T, deviation, precision=hi)) / denom
  return s, counts


def cluster_weights(s: Array, opts: ACOptions) -> Array:
  """`[E, D]` feature weights from dispersions `s[E, D]` (see module doc)."""
  w = 1.0 / (s + opts.eps)
  pre_mean = jnp.mean(w)
  if opts.clamp is not None:
    w = jnp.minimum(w, opts.clamp * pre_mean)
  if opts.mean == "cluster":
    w = w / jnp.mean(w, axis=1, keepdims=True)
  elif opts.mean == "feature":
    w = w / jnp.mean(w, axis=0, keepdims=True)
  elif opts.mean == "global_pre_clamp":
    w = w / pre_mean
  elif opts.mean == "global_post_clamp":
    w = w / jnp.mean(w)
  return w


def mixing_matrix(indices: Array, gates: Array, valid: Array,
                  num_clusters: int, mix_k: int, mix_weights: str) -> Array:
  """`[N, E]` weight of each cluster's row of W in each token's scaling.

  Mix-1 is the one-hot of the previous top-1 (weight 1). Mix-k weights the
  first k entries by their gates ("raw") or by the gates renormalised over
  the valid entries among them ("renormalized", "slot_softmax"). A token with
  no valid entry gets an all-zero row (the caller scales it by 1).
  """
  k = 1 if mix_k == 1 else mix_k
  idx, valid = indices[:, :k], valid[:, :k]
  if k == 1:
    weights = valid.astype(jnp.float32)
  else:
    weights = jnp.where(valid, gates[:, :k], 0).astype(jnp.float32)
    if mix_weights != "raw":
      total = jnp.sum(weights, axis=-1, keepdims=True)
      weights = weights / jnp.where(total > 0, total, 1.0)
  one_hot = (idx[..., None] == jnp.arange(num_clusters)).astype(jnp.float32)
  return jnp.einsum("nk,nke->ne", weights, one_hot)


def adaptive_scales(tokens: Array, indices: Array, gates: Array, valid: Array,
                    *, num_clusters: int, opts: ACOptions,
                    reduce: Reduce = None) -> Array:
  """Per-token feature scaling `m[N, D]` of the AC router (stop-gradient).

  Args:
    tokens: `[N, D]` the tokens the statistics see (already L2-normalised
      when `opts.l2_normalize`).
    indices, gates, valid: `[N, K]` the previous MoE layer's assignment (its
      experts best first); column 0 is the top-1 that defines the clusters.
    num_clusters: E of the previous layer.
    opts: resolved options.
    reduce: see `cluster_dispersion`.

  Returns:
    `[N, D]` float32: `sum_j w_j W[k_j]`, or ones for a token with no valid
    previous entry (e.g. dropped by an expert-choice layer).
  """
  tokens = jax.lax.stop_gradient(tokens)
  top1 = jnp.where(valid[:, 0], indices[:, 0], -1)
  s, _ = cluster_dispersion(tokens, top1, num_clusters, opts.dispersion,
                            reduce)
  w = cluster_weights(s, opts)
  if opts.mix_k == 1:  # Mix-1: the top-1 cluster's row, gathered.
    return jax.lax.stop_gradient(
        jnp.where(valid[:, :1], w[jnp.maximum(top1, 0)], 1.0))
  mix = mixing_matrix(indices, gates, valid, num_clusters, opts.mix_k,
                      opts.mix_weights)
  m = jnp.matmul(mix, w, precision=jax.lax.Precision.HIGHEST)
  has_any = jnp.any(mix > 0, axis=-1, keepdims=True)
  return jax.lax.stop_gradient(jnp.where(has_any, m, 1.0))


def causal_adaptive_scales(tokens: Array, indices: Array, gates: Array,
                           valid: Array, *, num_clusters: int,
                           opts: ACOptions, reduce: Reduce = None) -> Array:
  """`adaptive_scales` where the token at position t sees only positions
  <= t: `[G, S, D]` tokens (G rows, S positions, e.g. a language model's
  rows of a block), `[G, S, K]` assignment; returns `m [G, S, D]`.

  The statistics of position t pool the tokens of every row at positions
  0..t (cluster means and dispersions from those only), so nothing a token
  is scaled by depends on a later token; at the last position they are the
  whole batch's, as `adaptive_scales`'s. Cost: one pass over the tokens per
  position (O(G S^2 D)), against O(G S D) for the pooled statistics.
  """
  tokens = jax.lax.stop_gradient(tokens).astype(jnp.float32)
  g, s, d = tokens.shape
  k = indices.shape[-1]
  top1 = jnp.where(valid[..., 0], indices[..., 0], -1)  # [G, S]
  one_hot = (top1[..., None] == jnp.arange(num_clusters)).astype(
      jnp.float32)  # [G, S, E]
  reduce = reduce or (lambda v: v)
  hi = jax.lax.Precision.HIGHEST
  counts = reduce(jnp.cumsum(jnp.sum(one_hot, axis=0), axis=0))  # [S, E]
  denom = jnp.where(counts > 0, counts, 1.0)[..., None]  # [S, E, 1]
  sums = reduce(jnp.cumsum(jnp.einsum("gse,gsd->sed", one_hot, tokens,
                                      precision=hi), axis=0))
  mean = sums / denom  # [S, E, D]: cluster means over positions <= t.
  positions = jnp.arange(s)
  segment = jnp.where(top1 < 0, num_clusters, top1).reshape(g * s)

  def spread_at(t: Array) -> Array:  # [E, D] over positions <= t.
    centre = mean[t][jnp.maximum(top1, 0)]  # [G, S, D]; -1 masked below.
    seen = (positions <= t).astype(jnp.float32)[None, :, None]
    deviation = tokens - centre
    deviation = (jnp.abs(deviation) if opts.dispersion == "mad"
                 else jnp.square(deviation)) * seen
    per_cluster = jax.ops.segment_sum(  # Cluster -1 -> segment E, dropped.
        deviation.reshape(g * s, d), segment, num_segments=num_clusters + 1)
    return reduce(per_cluster[:num_clusters]) / denom[t]

  spread = jax.lax.map(spread_at, positions)  # [S, E, D]
  w = jax.vmap(lambda v: cluster_weights(v, opts))(spread)  # [S, E, D]
  mix = mixing_matrix(indices.reshape(g * s, k), gates.reshape(g * s, k),
                      valid.reshape(g * s, k), num_clusters, opts.mix_k,
                      opts.mix_weights).reshape(g, s, num_clusters)
  m = jnp.einsum("gse,sed->gsd", mix, w, precision=hi)
  has_any = jnp.any(mix > 0, axis=-1, keepdims=True)
  return jax.lax.stop_gradient(jnp.where(has_any, m, 1.0))


def random_diagonal(seed: int, layer: int, width: int) -> Array:
  """The random-diagonal ablation: `max(N(1, 0.5), 0)`, `[D]`, fixed per layer.

  Drawn from `fold_in(PRNGKey(seed), layer)`, so it is a constant of the
  config: the same in every step, evaluation and resumed run.
  """
  key = jax.random.fold_in(jax.random.PRNGKey(seed), layer)
  return jnp.maximum(1.0 + 0.5 * jax.random.normal(key, (width,)), 0.0)
