"""Evaluation metrics: accuracy, routing change, load balance, OOD (§4.10).

Host-side numpy functions: they accept numpy or jax arrays, never trace, and
return Python floats (or dicts of floats / numpy arrays). Shape letters: `N`
examples, `T` tokens per example, `E` experts, `K` selected experts, `C`
classes, `n` tokens (flattened).

Optional masks exclude padded examples/tokens: `mask[N]` (or `token_mask[N,T]`)
is boolean or a 0/1 weight; a metric over an all-masked input is NaN.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from vmoe_ext.classification import topk_correct
from vmoe_ext.errors import InputError

ArrayLike = Any  # numpy array, jax array or nested sequence.


class MetricInputError(InputError):
  """Arrays of the wrong shape, dtype or values handed to a metric."""


def _check(condition: Any, field: str, message: str) -> None:
  """Raises `MetricInputError(field, message)` unless `condition` holds."""
  if not condition:
    raise MetricInputError(field, message)


def _weighted_mean(values: np.ndarray, mask: ArrayLike | None,
                   field: str) -> float:
  """Mean of `values` weighted by `mask` (same shape); NaN when all masked."""
  if mask is None:
    return float(np.mean(values)) if values.size else float("nan")
  weights = np.asarray(mask, np.float64)
  _check(weights.shape == values.shape, field,
         f"must have shape {values.shape}, got {weights.shape}")
  total = weights.sum()
  if total == 0:
    return float("nan")
  return float(np.sum(values * weights) / total)


def _logits_2d(logits: ArrayLike, field: str) -> np.ndarray:
  logits = np.asarray(logits)
  _check(logits.ndim == 2, field,
         f"must be [N, C] logits, got shape {logits.shape}")
  return logits


# ---------------------------------------------------------------------------
# Accuracy and prediction change.
# ---------------------------------------------------------------------------


def topk_accuracy(logits: ArrayLike, labels: ArrayLike, k: int = 1,
                  mask: ArrayLike | None = None) -> float:
  """Fraction of examples whose label is among the top-k logits.

  Ranked by `vmoe_ext.classification.topk_correct`: ties are broken
  towards the lower class index and NaN ranks first (as `argmax` does), so
  `topk_accuracy(logits, labels, 1) == mean(argmax(logits, -1) == labels)`.

  Args:
    logits: `[N, C]` scores.
    labels: `[N]` int class indices in `[0, C)`.
    k: number of top classes that count as a hit, `1 <= k <= C`.
    mask: optional `[N]` validity / weight of each example.
  """
  logits = _logits_2d(logits, "logits")
  labels = np.asarray(labels)
  n, c = logits.shape
  _check(labels.shape == (n,), "labels",
         f"must have shape ({n},), got {labels.shape}")
  _check(isinstance(k, (int, np.integer)) and 1 <= k <= c, "k",
         f"must be an integer in [1, {c}], got {k!r}")
  _check(np.issubdtype(labels.dtype, np.integer)
         and (n == 0 or (labels.min() >= 0 and labels.max() < c)),
         "labels", f"must be integer class indices in [0, {c})")
  correct = topk_correct(logits, labels, k).astype(np.float64)
  return _weighted_mean(correct, mask, "mask")


def prediction_change_rate(logits_clean: ArrayLike, logits_adv: ArrayLike,
                           mask: ArrayLike | None = None) -> float:
  """Fraction of examples whose argmax class differs between two runs.

  Args:
    logits_clean: `[N, C]` logits on the clean inputs.
    logits_adv: `[N, C]` logits on the perturbed inputs.
    mask: optional `[N]` validity / weight of each example.
  """
  a = _logits_2d(logits_clean, "logits_clean")
  b = _logits_2d(logits_adv, "logits_adv")
  _check(a.shape == b.shape, "logits_adv",
         f"must have the shape of logits_clean {a.shape}, got {b.shape}")
  changed = (np.argmax(a, axis=1) != np.argmax(b, axis=1)).astype(np.float64)
  return _weighted_mean(changed, mask, "mask")


# ---------------------------------------------------------------------------
# Routing change (seed appendix F).
# ---------------------------------------------------------------------------


def expert_sets_to_mask(indices: ArrayLike, num_experts: int) -> np.ndarray:
  """Selected-expert indices `[..., K]` -> membership mask `[..., E]` bool.

  Negative entries (e.g. -1 for a slot dropped or unused) are ignored and
  repeated indices count once (set semantics), so a token whose K slots are
  all invalid has the empty set.
  """
  _check(isinstance(num_experts, (int, np.integer)) and num_experts > 0,
         "num_experts", f"must be a positive integer, got {num_experts!r}")
  indices = np.asarray(indices)
  _check(indices.ndim >= 1 and np.issubdtype(indices.dtype, np.integer),
         "indices", f"must be an integer array [..., K], got dtype "
         f"{indices.dtype} shape {indices.shape}")
  _check(indices.size == 0 or indices.max() < num_experts, "indices",
         f"expert indices must be < num_experts={num_experts}")
  valid = indices >= 0
  one_hot = (indices[..., None] == np.arange(num_experts)) & valid[..., None]
  return one_hot.any(axis=-2)


def _as_set_mask(mask: ArrayLike, field: str) -> np.ndarray:
  mask = np.asarray(mask)
  if mask.dtype != bool:
    _check(np.all((mask == 0) | (mask == 1)), field,
           "must be a boolean (or 0/1) expert-membership mask [..., E]; "
           "convert expert indices with expert_sets_to_mask")
    mask = mask.astype(bool)
  return mask


def expert_set_iou(mask_a: ArrayLike, mask_b: ArrayLike) -> np.ndarray:
  """Per-token IoU `|A & B| / |A | B|` of expert sets, `[..., E]` -> `[...]`.

  The IoU of two empty sets is defined as 1 (nothing was selected before or
  after, so the routing did not change); an empty set against a non-empty one
  has IoU 0.
  """
  a = _as_set_mask(mask_a, "mask_clean")
  b = _as_set_mask(mask_b, "mask_adv")
  _check(a.shape == b.shape, "mask_adv",
         f"must have the shape of mask_clean {a.shape}, got {b.shape}")
  inter = np.sum(a & b, axis=-1)
  union = np.sum(a | b, axis=-1)
  return np.where(union == 0, 1.0, inter / np.maximum(union, 1))


def routing_change_rate(mask_clean: ArrayLike, mask_adv: ArrayLike,
                        token_mask: ArrayLike | None = None) -> float:
  """Rate of routing changes `mean_tokens(1 - IoU)` (seed appendix F).

  For every token, IoU of the set of experts it was routed to on the clean
  input versus on the attacked input, `1 - IoU` averaged over tokens. Two
  empty sets have IoU 1 (see `expert_set_iou`). For index arrays
  `[N, T, K]` (with -1 for invalid slots) convert first with
  `expert_sets_to_mask(indices, num_experts)`.

  Args:
    mask_clean: `[N, T, E]` bool, expert membership on clean inputs (any
      leading shape `[..., E]` is accepted).
    mask_adv: `[N, T, E]` bool, the same on attacked inputs.
    token_mask: optional `[N, T]` validity / weight of each token.
  """
  change = 1.0 - expert_set_iou(mask_clean, mask_adv)
  return _weighted_mean(change, token_mask, "token_mask")


# ---------------------------------------------------------------------------
# Load balance (ACMoE Table 6) and router instability (ACMoE C.9).
# ---------------------------------------------------------------------------


def assignment_counts(expert_mask: ArrayLike,
                      token_mask: ArrayLike | None = None) -> np.ndarray:
  """Token->expert assignments per expert `[E]` int64 of a mask `[..., E]`.

  Counts are additive: the counts of an evaluation set are the sum of the
  counts of its batches. `token_mask` `[...]` leaves tokens out (padding).
  """
  mask = _as_set_mask(expert_mask, "expert_mask")
  _check(mask.ndim >= 1, "expert_mask", "must be [..., E]")
  counts_per_token = mask.astype(np.int64)
  if token_mask is not None:
    valid = np.asarray(token_mask).astype(bool)
    _check(valid.shape == mask.shape[:-1], "token_mask",
           f"must have shape {mask.shape[:-1]}, got {valid.shape}")
    counts_per_token = counts_per_token * valid[..., None]
  return counts_per_token.reshape(-1, mask.shape[-1]).sum(axis=0)


def load_balance_from_counts(counts: ArrayLike) -> dict[str, Any]:
  """`load_balance` from per-expert assignment counts `[E]`.

  Returns `{"percent": [E] float64, "std": float, "assignments": [E]
  int64}`; with no assignment at all, `percent` and `std` are NaN.
  """
  counts = np.asarray(counts)
  _check(counts.ndim == 1 and counts.size > 0 and counts.min() >= 0,
         "counts",
         f"must be non-negative counts [E], got shape {counts.shape}")
  counts = counts.astype(np.int64)
  total = counts.sum()
  if total == 0:
    percent = np.full(counts.shape, np.nan)
  else:
    percent = 100.0 * counts / total
  return {"percent": percent, "std": float(np.std(percent)),
          "assignments": counts}


def load_balance(expert_mask: ArrayLike,
                 token_mask: ArrayLike | None = None) -> dict[str, Any]:
  """Share of routed tokens per expert and its spread (ACMoE Table 6).

  `percent[e] = 100 * (tokens routed to e) / (total token->expert
  assignments)`, so the percentages sum to 100 for any K and perfect balance
  is `100 / E` for every expert. The score is the population standard
  deviation (ddof=0) of `percent`; 0 is perfect balance. Pass the router's
  selection to measure the router, or the post-capacity dispatch mask to
  measure what the experts actually processed. Over many batches, add their
  `assignment_counts` and call `load_balance_from_counts`.

  Args:
    expert_mask: `[N, T, E]` bool (any `[..., E]`), expert membership.
    token_mask: optional `[N, T]` validity of each token (padding excluded).

  Returns:
    `{"percent": [E] float64, "std": float, "assignments": [E] int64}`;
    with no assignment at all, `percent` is NaN and `std` is NaN.
  """
  return load_balance_from_counts(assignment_counts(expert_mask, token_mask))


def layer_mean_std(per_layer: Sequence[float]) -> dict[str, float]:
  """`{"mean", "std"}` (population std) of a per-layer score list [L]."""
  values = np.asarray(per_layer, np.float64)
  _check(values.ndim == 1 and values.size > 0, "per_layer",
         "must be a non-empty list of per-layer scores")
  return {"mean": float(values.mean()), "std": float(values.std())}


def router_instability_from_counts(joint: ArrayLike) -> float:
  """Router instability (ACMoE C.9) from a contingency table of top-1s.

  `joint[a, b]` = number of tokens whose top-1 expert is a at layer l-1 and
  b at layer l (`[E_prev, E_cur]`; additive over batches). With
  `S[i, j] = 1` iff tokens i and j share their top-1, summed over all
  `n x n` pairs (diagonal included) `sum |S_prev - S_cur| = sum_a r_a^2 +
  sum_b c_b^2 - 2 sum_ab joint_ab^2` (row sums r, column sums c), because
  `|s - t| = s + t - 2 s t` for bits; `r = that / n^2`, `n = sum(joint)`.
  NaN when the table is empty.
  """
  joint = np.asarray(joint)
  _check(joint.ndim == 2 and (joint.size == 0 or joint.min() >= 0), "joint",
         f"must be non-negative counts [E_prev, E_cur], got shape "
         f"{joint.shape}")
  joint = joint.astype(np.float64)
  n = joint.sum()
  if n == 0:
    return float("nan")
  rows, cols = joint.sum(axis=1), joint.sum(axis=0)
  disagree = (rows**2).sum() + (cols**2).sum() - 2.0 * (joint**2).sum()
  return float(disagree / n**2)


def router_instability(top1_prev: ArrayLike, top1_cur: ArrayLike,
                       token_mask: ArrayLike | None = None) -> float:
  """Router instability `r = mean(|S_prev - S_cur|)` (ACMoE appendix C.9).

  `S[i, j] = 1` iff tokens i and j share their top-1 expert. The mean is over
  all `n x n` entries, the diagonal included (as in the paper's definition;
  the diagonal always agrees). Computed from the contingency table
  `M[a, b] = #{i: prev_i = a, cur_i = b}` without materialising `S`
  (`router_instability_from_counts`). Cost O(n log n) time, O(n) memory.

  Args:
    top1_prev: `[n]` int top-1 expert per token at layer l-1 (any shape,
      flattened; pass `[N, T]` directly).
    top1_cur: `[n]` int top-1 expert per token at layer l, same tokens.
    token_mask: optional `[n]` bool; masked tokens are left out entirely.
  """
  prev = np.asarray(top1_prev).reshape(-1)
  cur = np.asarray(top1_cur).reshape(-1)
  _check(prev.shape == cur.shape, "top1_cur",
         f"must have as many tokens as top1_prev ({prev.size}), got "
         f"{cur.size}")
  if token_mask is not None:
    valid = np.asarray(token_mask).astype(bool).reshape(-1)
    _check(valid.shape == prev.shape, "token_mask",
           f"must have {prev.size} entries, got {valid.size}")
    prev, cur = prev[valid], cur[valid]
  if prev.size == 0:
    return float("nan")
  _, prev_ids = np.unique(prev, return_inverse=True)
  _, cur_ids = np.unique(cur, return_inverse=True)
  shape = (int(prev_ids.max()) + 1, int(cur_ids.max()) + 1)
  joint = np.bincount(np.ravel_multi_index(
      (prev_ids.reshape(-1), cur_ids.reshape(-1)), shape),
                      minlength=shape[0] * shape[1]).reshape(shape)
  return router_instability_from_counts(joint)


# ---------------------------------------------------------------------------
# Out-of-distribution detection (ImageNet-O protocol).
# ---------------------------------------------------------------------------


def max_softmax(logits: ArrayLike) -> np.ndarray:
  """Maximum softmax probability `[N]` of `[N, C]` logits (float64, stable)."""
  logits = _logits_2d(logits, "logits").astype(np.float64)
  shifted = logits - logits.max(axis=1, keepdims=True)
  # max softmax = exp(0) / sum(exp(shifted)).
  return 1.0 / np.exp(shifted).sum(axis=1)


def average_precision(scores: ArrayLike, is_positive: ArrayLike) -> float:
  """Area under the precision-recall curve as average precision.

  `AP = sum_k (R_k - R_{k-1}) P_k` over the distinct score thresholds in
  decreasing order (tied scores form one threshold), the same step-wise
  definition as `sklearn.metrics.average_precision_score`.

  Args:
    scores: `[n]` higher = more likely positive.
    is_positive: `[n]` bool labels; at least one positive is required.
  """
  scores = np.asarray(scores, np.float64).reshape(-1)
  positive = np.asarray(is_positive).astype(bool).reshape(-1)
  _check(scores.shape == positive.shape, "is_positive",
         f"must have {scores.size} entries, got {positive.size}")
  num_pos = int(positive.sum())
  _check(num_pos > 0, "is_positive", "needs at least one positive example")
  order = np.argsort(-scores, kind="stable")
  scores, positive = scores[order], positive[order]
  # Last index of each group of tied scores = one threshold.
  last = np.r_[np.flatnonzero(np.diff(scores) != 0), scores.size - 1]
  tp = np.cumsum(positive)[last].astype(np.float64)
  precision = tp / (last + 1.0)
  recall = tp / num_pos
  return float(np.sum(np.diff(np.r_[0.0, recall]) * precision))


def ood_aupr(logits_in: ArrayLike, logits_out: ArrayLike) -> float:
  """OOD AUPR with OOD as the positive class (ImageNet-O protocol).

  Anomaly score = `-max softmax`; AUPR is computed as average precision
  (`average_precision`). The chance level is the OOD fraction
  `N_out / (N_in + N_out)`.

  Args:
    logits_in: `[N_in, C]` logits on in-distribution examples.
    logits_out: `[N_out, C]` logits on out-of-distribution examples.
  """
  a = _logits_2d(logits_in, "logits_in")
  b = _logits_2d(logits_out, "logits_out")
  _check(a.shape[1] == b.shape[1], "logits_out",
         f"must have {a.shape[1]} classes like logits_in, got {b.shape[1]}")
  scores = -np.concatenate([max_softmax(a), max_softmax(b)])
  labels = np.r_[np.zeros(a.shape[0], bool), np.ones(b.shape[0], bool)]
  return average_precision(scores, labels)


# ---------------------------------------------------------------------------
# 200-class subsets (ImageNet-A / ImageNet-R).
# ---------------------------------------------------------------------------


def _class_subset(class_subset: ArrayLike, num_classes: int) -> np.ndarray:
  subset = np.asarray(class_subset)
  _check(subset.ndim == 1 and subset.size > 0
         and np.issubdtype(subset.dtype, np.integer), "class_subset",
         "must be a non-empty 1-D list of class indices")
  _check(subset.min() >= 0 and subset.max() < num_classes, "class_subset",
         f"indices must lie in [0, {num_classes})")
  _check(np.unique(subset).size == subset.size, "class_subset",
         "indices must be distinct")
  return subset


def mask_logits(logits: ArrayLike, class_subset: ArrayLike,
                keep_shape: bool = False) -> np.ndarray:
  """Restricts `[N, C]` logits to a class subset (ImageNet-A/R protocol).

  Args:
    logits: `[N, C]` logits over the full label space (e.g. C = 1000).
    class_subset: `[S]` distinct class indices (e.g. the 200 ImageNet-A
      classes); `argmax` of the result is a position in this list.
    keep_shape: if True, return `[N, C]` with the logits of classes outside
      the subset set to -inf instead, so `argmax` stays in the full label
      space.

  Returns:
    `[N, S]` logits (`logits[:, class_subset]`) or `[N, C]` if keep_shape.
  """
  logits = _logits_2d(logits, "logits")
  subset = _class_subset(class_subset, logits.shape[1])
  if not keep_shape:
    return logits[:, subset]
  out = np.full(logits.shape, -np.inf,
                np.result_type(logits.dtype, np.float32))
  out[:, subset] = logits[:, subset]
  return out


def subset_labels(labels: ArrayLike, class_subset: ArrayLike,
                  num_classes: int = 1000) -> np.ndarray:
  """Maps full-label-space labels `[N]` to positions `[N]` in `class_subset`.

  Raises MetricInputError if a label is not in the subset.
  """
  subset = _class_subset(class_subset, num_classes)
  labels = np.asarray(labels)
  lookup = np.full(num_classes, -1, np.int64)
  lookup[subset] = np.arange(subset.size)
  _check(labels.size == 0 or (labels.min() >= 0
                              and labels.max() < num_classes),
         "labels", f"must lie in [0, {num_classes})")
  out = lookup[labels]
  _check(np.all(out >= 0), "labels", "contain classes outside class_subset")
  return out
