"""Classification outputs, defined once: the cross-entropy and top-k hits.

Every number the framework reports about logits goes through this module:

* `cross_entropy`: the per-example loss of the train step (`train.loss`:
  "softmax_xent" or vmoe's "sigmoid_xent", label smoothing, soft targets),
  of the eval step's `loss`, and (softmax, in float32) of the attacks'
  objective (`vmoe_ext.attacks.base.cross_entropy`).
* `topk_correct`: whether each example's label is among its top-k logits,
  for the train step's `accuracy`, the eval step's `correct_top1` /
  `correct_top5`, the attacks' success test, and every host-side accuracy
  of the evaluation (`vmoe_ext.evaluate`: clean, attacked, corrupted,
  evaluation datasets, `metrics.topk_accuracy`).

Both take jax arrays (traceable: inside the jitted steps and attacks) or
NumPy arrays (`topk_correct` then computes with NumPy and returns NumPy, for
the host metrics). Ranking rule of `topk_correct`, the rule of `argmax`: a
larger logit ranks first, equal logits rank by lower class index, and NaN
counts as the largest value; so `topk_correct(z, y, 1) == (argmax(z) == y)`
for any logits. It is elementwise over `[B, C]` plus a sum over the classes
(no sort, no gather), so XLA's SPMD partitioner splits it over the batch.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

Array = jax.Array

# `train.loss`: vmoe's `get_loss_fn` names.
LOSSES = ("softmax_xent", "sigmoid_xent")


def soft_targets(labels: Array, num_classes: int,
                 label_smoothing: float = 0.0) -> Array:
  """Targets `[B, classes]`: one-hot of integer labels `[B]` (soft targets
  `[B, classes]` are taken as they are), label-smoothed by
  `optax.smooth_labels` when `label_smoothing` > 0."""
  targets = (labels if labels.ndim == 2
             else jax.nn.one_hot(labels, num_classes))
  if label_smoothing:
    targets = optax.smooth_labels(targets, label_smoothing)
  return targets


def cross_entropy(logits: Array, labels: Array,
                  label_smoothing: float = 0.0,
                  loss: str = "softmax_xent") -> Array:
  """Per-example loss `[B]` against integer labels `[B]` or soft targets
  `[B, classes]` (e.g. mixed), with optional label smoothing (see
  `soft_targets`): "softmax_xent" `-sum_c t_c log softmax(z)_c`, or vmoe's
  "sigmoid_xent" `sum_c BCE(sigmoid(z_c), t_c)` (one binary classifier per
  class, summed over the classes, as vmoe trains on ImageNet).

  Computed in the dtype of `logits` (cast them first for float32)."""
  targets = soft_targets(labels, logits.shape[-1], label_smoothing)
  if loss == "sigmoid_xent":
    return jnp.sum(optax.sigmoid_binary_cross_entropy(logits, targets), -1)
  if loss != "softmax_xent":
    raise ValueError(f"unknown loss {loss!r}; expected one of {LOSSES}")
  return optax.softmax_cross_entropy(logits, targets)


def _is_numpy(*arrays: Any) -> bool:
  return all(isinstance(a, (np.ndarray, np.generic)) for a in arrays)


def topk_correct(logits: Any, labels: Any, k: int = 1) -> Any:
  """`[B]` bool: the label is among the `k` best classes of its logits.

  Args:
    logits: `[B, C]` scores (jax or NumPy).
    labels: `[B]` int classes; a label outside `[0, C)` is never correct.
    k: how many of the best classes count, >= 1 (k >= C: every valid label).

  Returns:
    `[B]` bool, NumPy when both inputs are NumPy arrays, else jax. Ranking
    (see the module docstring): larger first, ties to the lower class
    index, NaN largest — `topk_correct(z, y, 1)` is `argmax(z, -1) == y`.
  """
  xp = np if _is_numpy(logits, labels) else jnp
  logits, labels = xp.asarray(logits), xp.asarray(labels)
  classes = xp.arange(logits.shape[-1])
  onehot = classes == labels[:, None]  # [B, C]; all False: invalid label.
  label_logit = xp.sum(xp.where(onehot, logits, 0), axis=-1, keepdims=True)
  before = classes < labels[:, None]
  nan, label_nan = xp.isnan(logits), xp.isnan(label_logit)
  # Classes ranked before the label: NaN first, then larger, ties by index.
  ahead = xp.where(label_nan, nan & before,
                   nan | (logits > label_logit)
                   | ((logits == label_logit) & before))
  return (xp.sum(ahead, axis=-1) < k) & xp.any(onehot, axis=-1)


__all__ = ["LOSSES", "cross_entropy", "soft_targets", "topk_correct"]
