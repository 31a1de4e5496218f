"""Independent reference of the language-model backbone: per-token NumPy
loops written from what the authors' LM code computes (rachtsy/MomentumSMoE
`models.py`; the robust form from the ACMoE repo's `models.py`), reading the
parameters of our model by name but none of its code.

Row by row, token by token:
* attention: query i of the block attends to the L positions before it in
  `[cache (L), block (M)]`, score `(q.k + q.key_pe[:, c]) / sqrt(Dh)`;
* post-LayerNorm layers: `LN1(h + attn)`; MoE `LN2(h + LN(h + MoE(h)))`;
  momentum `LN2(h + LN(h - m))`, `m = mu m + gamma MoE(h)`; Adam in layer
  0, heavy-ball after it; robust `LN2(h + LN(h + gamma p))`; dense
  `LN3(h + FFN(h))`;
* the MoE: linear gate with bias, the two largest logits, their softmax as
  combine weights, ReLU experts;
* output: `log_softmax(h W + b)`; the next cache: the last L rows of
  `[cache, layer input]` per layer.
"""

from __future__ import annotations

import math

import numpy as np

from naive import layer_norm, relu

TORCH_EPS = 1e-5      # torch's LayerNorm epsilon (the backbone's norms).
STREAM_LN_EPS = 1e-6  # The momentum streams' post-norm (flax's default).


def _p(tree):
  """A params subtree as float64 NumPy arrays."""
  if isinstance(tree, dict) or hasattr(tree, "items"):
    return {k: _p(v) for k, v in tree.items()}
  return np.asarray(tree, np.float64)


def attention_row(h, cache, key_pe, p, heads):
  """One row: `h [M, D]`, `cache [L, D]` -> `[M, D]` (params `p` of
  `Attention`, kernels `[D, D]`)."""
  m, d = h.shape
  span = cache.shape[0]
  dh = d // heads
  context = np.concatenate([cache, h], 0)
  q = h @ p["query"]["kernel"]
  k = context @ p["key"]["kernel"]
  v = context @ p["value"]["kernel"]
  out = np.zeros((m, d))
  for i in range(m):
    for n in range(heads):
      sl = slice(n * dh, (n + 1) * dh)
      scores = np.array([(q[i, sl] @ k[i + c, sl] + q[i, sl] @ key_pe[:, c])
                         / math.sqrt(dh) for c in range(span)])
      w = np.exp(scores - scores.max())
      w /= w.sum()
      out[i, sl] = sum(w[c] * v[i + c, sl] for c in range(span))
  return out @ p["out"]["kernel"]


def lm_gate_moe(x, p):
  """The authors' SMoE gate and ReLU experts on one token `x [D]`."""
  logits = x @ p["router"]["logits"]["dense"]["kernel"] + (
      p["router"]["logits"]["dense"]["bias"])
  order = sorted(range(len(logits)), key=lambda e: (-logits[e], e))[:2]
  top = np.array([logits[e] for e in order])
  weights = np.exp(top - top.max())
  weights /= weights.sum()
  out = np.zeros_like(x)
  for w, e in zip(weights, order):
    mlp = p["Mlp"]
    hidden = relu(x @ mlp["Dense_0"]["kernel"][e] + mlp["Dense_0"]["bias"][e])
    out += w * (hidden @ mlp["Dense_1"]["kernel"][e]
                + mlp["Dense_1"]["bias"][e])
  return out


def ffn(x, p):
  hidden = relu(x @ p["Dense_0"]["kernel"] + p["Dense_0"]["bias"])
  return hidden @ p["Dense_1"]["kernel"] + p["Dense_1"]["bias"]


def _ln(x, p, eps=TORCH_EPS):
  return layer_norm(x, p["scale"], p["bias"], eps)


def robust_coefficients(p, k, lipschitz=1.0):
  """Cyrus et al.'s (gamma, mu, alpha) from p and k = L/m."""
  gamma = k * (1 - p) ** 2 * (1 + p) / lipschitz
  mu = k * p ** 3 / (k - 1)
  alpha = p ** 3 / ((k - 1) * (1 - p) ** 2 * (1 + p))
  return gamma, mu, alpha


def forward(params, tokens, cache, letters, heads, stream=None):
  """The model on `tokens [B, M]` from `cache` (one `[B, L, D]` per layer).

  Args:
    params: the model's "params" tree.
    letters: the sub-layer letter of each layer (`g`, `m`, `a`, `f`).
    heads: attention heads.
    stream: for `m` layers `("momentum", mu, gamma)` (mu a number, or a
      list with the mu of each MoE layer) or
      `("robust", p, k)`; for `a` layers `("adam", gamma1, gamma2, mu,
      beta1, beta2)`.

  Returns:
    log-probabilities `[B, M, V]` and the next cache (list of `[B, L, D]`).
  """
  p = _p(params)
  tokens = np.asarray(tokens)
  cache = [np.asarray(c, np.float64) for c in cache]
  b, m = tokens.shape
  out = np.zeros((b, m, p["output"]["bias"].shape[0]))
  new_cache = [np.zeros_like(c) for c in cache]
  for row in range(b):
    h = p["embedding"]["embedding"][tokens[row]]
    moment = np.zeros_like(h)  # Zeroed at every block (every call).
    first_moment = np.zeros_like(h)
    second_moment = np.zeros_like(h)
    moe_index = -1
    for layer, letter in enumerate(letters):
      q = p[f"encoderblock_{layer}"]
      moe_index += letter != "f"
      span = cache[layer].shape[1]
      new_cache[layer][row] = np.concatenate([cache[layer][row], h])[-span:]
      a = attention_row(h, cache[layer][row], p["key_pe"], q["Attention"],
                        heads)
      h = _ln(h + a, q["LayerNorm_attention"])
      if letter == "f":
        f = np.stack([ffn(x, q["Mlp"]) for x in h])
        h = _ln(h + f, q["LayerNorm_ffn"])
        continue
      moe = lambda z: np.stack([lm_gate_moe(x, q["Moe"]) for x in z])
      if letter == "g":
        y = _ln(h + moe(h), q["LayerNorm_moe_output"])
      elif letter == "m" and stream[0] == "momentum":
        _, mu, gamma = stream
        if isinstance(mu, (list, tuple)):  # One mu per MoE layer.
          mu = mu[moe_index]
        moment = mu * moment + gamma * moe(h)
        y = _ln(h - moment, q["Stream"]["LayerNorm_2"], STREAM_LN_EPS)
      elif letter == "m" and stream[0] == "robust":
        gamma, mu, alpha = robust_coefficients(*stream[1:])
        f = moe(h + alpha * gamma * moment)
        moment = -f + mu * moment
        y = _ln(h + gamma * moment, q["Stream"]["LayerNorm_2"],
                STREAM_LN_EPS)
      elif letter == "a":
        _, gamma1, gamma2, mu, beta1, beta2 = stream
        f = moe(h)
        moment = mu * moment + gamma2 * f
        if layer == 0:  # The authors' `layerth < 1`.
          first_moment = beta1 * first_moment + (1 - beta1) * f
          second_moment = beta2 * second_moment + (1 - beta2) * f ** 2
          adam = gamma1 / np.sqrt(second_moment + 1e-8) * first_moment + h
          y = _ln(h - adam, q["Stream"]["LayerNorm_2"], STREAM_LN_EPS)
        else:
          y = _ln(h - moment, q["Stream"]["LayerNorm_2"], STREAM_LN_EPS)
      else:
        raise ValueError(f"no reference for letter {letter!r} / {stream}")
      h = _ln(h + y, q["LayerNorm_moe"])
    logits = h @ p["output"]["kernel"] + p["output"]["bias"]
    logits = logits - logits.max(-1, keepdims=True)
    out[row] = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
  return out, new_cache
