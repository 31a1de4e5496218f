"""Independent NumPy reference of microsoft/tutel's top-K routing as Swin-MoE
runs it (its `moe_layer` routing, `losses.load_importance_loss`,
`losses.gshard_loss`, `fast_dispatch.extract_critical`), written from the
formulas, token by token where it matters, in float64. One call is one
routing group: the `[N, E]` tokens the gate sees at once."""

from __future__ import annotations

import math

import numpy as np

import naive

FLOAT32_EPS = float(np.finfo(np.float32).eps)


def softmax(v):
  v = np.asarray(v, np.float64)
  z = np.exp(v - v.max(-1, keepdims=True))
  return z / z.sum(-1, keepdims=True)


def top_k(row, k):
  """The K largest entries of a vector, largest first, ties to the lower
  index."""
  return sorted(range(len(row)), key=lambda e: (-row[e], e))[:k]


def normal_cdf(x, std):
  """`Phi(x / std)`, the CDF of N(0, std^2), through `math.erf`."""
  return 0.5 * (1.0 + math.erf(x / (std * math.sqrt(2.0))))


def cv2_unbiased(v):
  """torch's `v.var() / (v.mean()**2 + 1e-10)` (unbiased variance)."""
  v = np.asarray(v, np.float64)
  return v.var(ddof=1) / (v.mean() ** 2 + 1e-10)


def route(logits, noise, k, normalize_gate=False):
  """tutel's gate on one group: `(indices [N, K], gates [N, K], scores [N,
  E], noisy_logits [N, E])`. `noise` is the scaled noise or None."""
  logits = np.asarray(logits, np.float64)
  noisy = logits if noise is None else logits + np.asarray(noise, np.float64)
  scores = softmax(noisy)
  idx = np.array([top_k(row, k) for row in scores], np.int64)
  gates = np.take_along_axis(scores, idx, 1)
  if normalize_gate and k > 1:
    gates = gates / np.maximum(gates.sum(1, keepdims=True), FLOAT32_EPS)
  return idx, gates, scores, noisy


def load_importance_loss(logits, noisy_logits, idx, gate_noise):
  """`(l_imp, l_load)` of tutel's `load_importance_loss(softmax(logits),
  noisy_logits.gather(topk_ids), E, gate_noise)`, loop over tokens."""
  logits = np.asarray(logits, np.float64)
  n, e = logits.shape
  probs = softmax(logits)
  l_imp = cv2_unbiased(probs.sum(0))
  std = gate_noise / e
  load = np.zeros(e)
  for s in range(n):
    threshold = noisy_logits[s, idx[s, -1]]  # topk_logits[:, -1]
    for j in range(e):
      # A probability minus a logit, as tutel.
      load[j] += normal_cdf(probs[s, j] - threshold, std)
  return l_imp, cv2_unbiased(load)


def gshard_loss(scores, idx):
  """tutel's `gshard_loss`: `sum_e(sum_s scores[s, e] * count_e * E / N) /
  N` with `count_e` the tokens whose top-1 is e."""
  n, e = scores.shape
  me = scores.sum(0)
  ce = np.zeros(e)
  for s in range(n):
    ce[idx[s, 0]] += e / n
  return float((me * ce).sum() / n)


def capacity(num_tokens, k, capacity_factor, num_experts, alignment=1):
  """`extract_critical`'s capacity for capacity_factor > 0."""
  c = k * int(capacity_factor * ((num_tokens + num_experts - 1)
                                 // num_experts))
  remainder = c % alignment
  return c + alignment - remainder if remainder else c


def locations(scores, idx, batch_prioritized_routing):
  """`extract_critical`'s `locations_s` `[N, K]`, translated line by line:
  per-rank one-hot masks, `cumsum - 1` (in the order of decreasing max
  score with BPR, `compute_sorted_location`), plus the count of all picks
  of lower ranks (`acc_base`)."""
  n, e = scores.shape
  k = idx.shape[1]
  masks = [np.eye(e, dtype=np.int64)[idx[:, r]] for r in range(k)]
  if batch_prioritized_routing:
    importance = -scores.max(1)
    order = np.argsort(importance, kind="stable")

    def location(x):
      sorted_x = x[order]
      cumsum = (np.cumsum(sorted_x, 0) - 1) * sorted_x
      return cumsum[np.argsort(order, kind="stable")]
  else:

    def location(x):
      return np.cumsum(x, 0) - 1

  out = [np.sum(location(masks[0]) * masks[0], 1)]
  acc_base = np.zeros((1, e), np.int64)
  for r in range(1, k):
    acc_base = acc_base + masks[r - 1].sum(0, keepdims=True)
    out.append(np.sum((location(masks[r]) + acc_base) * masks[r], 1))
  return np.stack(out, 1)


def moe(x, idx, gates, locs, cap, params):
  """The layer output of one group: every kept pick's expert output (no
  dropout) times its gate; picks at location >= capacity add nothing."""
  x = np.asarray(x, np.float64)
  y = np.zeros_like(x)
  for s, r in np.ndindex(*idx.shape):
    if locs[s, r] < cap:
      y[s] += gates[s, r] * naive.expert_mlp(params, idx[s, r], x[s])
  return y


def expert_dropout_after_activation(params, x, keep_hidden, rate):
  """tutel's expert `dropout(gelu(x W1 + b1)) W2 (+ b2)` on `[E, N, D]`
  with the given `[E, N, H]` keep mask, unit by unit."""
  p = {f"{layer}/{k}": np.asarray(a, np.float64)
       for layer, sub in params.items() for k, a in sub.items()}
  x = np.asarray(x, np.float64)
  e_, n_, d_ = x.shape
  h_ = p["Dense_0/kernel"].shape[-1]
  y = np.zeros((e_, n_, d_))
  for e, s in np.ndindex(e_, n_):
    if "Dense_1/bias" in p:
      y[e, s] = p["Dense_1/bias"][e]
    for i in range(h_):
      pre = x[e, s] @ p["Dense_0/kernel"][e, :, i] + p["Dense_0/bias"][e, i]
      h = naive.gelu(pre)
      h = h / (1 - rate) if keep_hidden[e, s, i] else 0.0
      y[e, s] += h * p["Dense_1/kernel"][e, i]
  return y


__all__ = ["capacity", "expert_dropout_after_activation", "gshard_loss",
           "load_importance_loss", "locations", "moe", "route", "softmax"]
