"""Auxiliary load-balancing losses of sparse MoE routers (docs/routers.md,
"Auxiliary losses").

Every loss takes per-group arrays `[G, S, E]` (or `[G, S]`) and returns a
scalar: the loss is computed per group and averaged over groups, so a sharded
run whose devices hold whole groups computes the same value as a single device.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from vmoe_ext.moe.select import partitionable_top_k

Array = jax.Array


def cv_squared(values: Array, axis: int = -1) -> Array:
  """Squared coefficient of variation `var(v) / mean(v)^2` along `axis`.

  Computed through the (population) variance, never through `jnp.std`: the
  gradient of `std` at zero spread is `0/0 = NaN`, the gradient of the variance
  is exactly 0, so perfectly balanced routing trains with finite gradients.
  """
  mean = jnp.mean(values, axis=axis)
  var = jnp.mean(jnp.square(values - jnp.expand_dims(mean, axis)), axis=axis)
  return var / jnp.square(mean)


def importance_loss(gates: Array) -> Array:
  """`L_imp = CV^2(imp)` with `imp_e = sum_s gates[g, s, e]`; gates `[G, S, E]`."""
  importance = jnp.sum(gates, axis=-2)  # [G, E]
  return jnp.mean(cv_squared(importance))


def load_loss(logits: Array, noisy_logits: Array, noise_std: float,
              num_selected: int) -> Array:
  """Load loss of Shazeer et al. / V-MoE; logits `[G, S, E]`.

  `thr_s` is the K-th largest *noisy* logit of token s; the probability that
  expert e stays in the top-K when its noise is resampled is
  `p[s, e] = 1 - Phi((thr_s - l[s, e]) / noise_std)`; `load_e = sum_s p[s, e]`.
  """
  # [G, S, 1]: the K-th largest noisy logit.
  threshold = partitionable_top_k(noisy_logits, num_selected)[0][..., -1:]
  z = (threshold - logits) / noise_std
  prob = 1.0 - jax.scipy.stats.norm.cdf(z)
  load = jnp.sum(prob, axis=-2)  # [G, E]
  return jnp.mean(cv_squared(load))


def gshard_loss(gates: Array, top1_expert: Array) -> Array:
  """GShard/Switch loss `E^2 * mean_e(frac_e * mean_prob_e)`.

  Args:
    gates: `[G, S, E]` router probabilities.
    top1_expert: `[G, S]` int, each token's first choice; `frac_e` is the
      fraction of tokens whose first choice is e. Equals 1 at perfect balance.
  """
  num_experts = gates.shape[-1]
  frac = jnp.mean(jax.nn.one_hot(top1_expert, num_experts, dtype=gates.dtype),
                  axis=-2)
  mean_prob = jnp.mean(gates, axis=-2)
  per_group = num_experts**2 * jnp.mean(frac * mean_prob, axis=-1)
  return jnp.mean(per_group)


def fastmoe_balance_loss(scores: Array, top_idx: Array) -> Array:
  """The balance loss of the MoE language-model gates built on fastmoe
  (their `set_load_balance`): `E * sum_e f_e * p_e` over every token of the
  batch (not per group), where `f_e` counts the (token, choice) pairs that
  picked expert e, `p_e` sums the scores of expert e, both divided by the
  number of pairs N K. Equals 1 / K at perfect balance.

  Args:
    scores: `[G, S, E]` the gate's full softmax (of its logits over a
      temperature).
    top_idx: `[G, S, K]` int, the selected experts; `f` is not
      differentiated (it counts).
  """
  num_experts = scores.shape[-1]
  pairs = top_idx.size
  counts = jnp.sum(jax.nn.one_hot(top_idx, num_experts, dtype=scores.dtype),
                   axis=tuple(range(top_idx.ndim)))
  frac = jax.lax.stop_gradient(counts / pairs)
  prob = jnp.sum(scores, axis=tuple(range(scores.ndim - 1))) / pairs
  return num_experts * jnp.sum(frac * prob)


def tutel_cv_squared(values: Array, axis: int = -1) -> Array:
  """tutel's `v.var() / (v.mean()**2 + 1e-10)` along `axis`.

  torch's `var()` is the unbiased one (divides by n - 1; by 1 here when
  n = 1, where torch gives NaN). Written through the centred squares as
  `cv_squared`, so the gradient at zero spread is 0, not NaN.
  """
  n = values.shape[axis]
  mean = jnp.mean(values, axis=axis)
  sq = jnp.sum(jnp.square(values - jnp.expand_dims(mean, axis)), axis=axis)
  return sq / max(n - 1, 1) / (jnp.square(mean) + 1e-10)


def tutel_importance_loss(probs: Array) -> Array:
  """tutel's importance loss, `tutel_cv_squared(sum_s probs[g, s, :])`;
  probs `[G, S, E]` (the clean softmax in `load_importance_loss`)."""
  return jnp.mean(tutel_cv_squared(jnp.sum(probs, axis=-2)))


def tutel_load_loss(probs: Array, noisy_logits: Array, noise_std: float,
                    num_selected: int) -> Array:
  """tutel's load loss (`load_importance_loss`); `[G, S, E]` arrays.

  `thr_s` is the K-th largest *noisy logit* of token s and the clean
  *probability* `probs[s, e]` is compared with it, as tutel does (a
  probability minus a logit, unlike `load_loss`'s logit minus logit):
  `p[s, e] = Phi((probs[s, e] - thr_s) / noise_std)`,
  `load_e = sum_s p[s, e]`, the loss `tutel_cv_squared(load)`.
  """
  threshold = partitionable_top_k(noisy_logits, num_selected)[0][..., -1:]
  prob = jax.scipy.stats.norm.cdf((probs - threshold) / noise_std)
  return jnp.mean(tutel_cv_squared(jnp.sum(prob, axis=-2)))


def z_loss(logits: Array) -> Array:
  """Router z-loss `mean(logsumexp(l)^2)` over all tokens; logits `[G,S,E]`."""
  return jnp.mean(jnp.square(jax.nn.logsumexp(logits, axis=-1)))
