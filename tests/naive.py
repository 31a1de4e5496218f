"""Independent references: naive per-token loops in NumPy (no JAX tricks)."""

from __future__ import annotations

import math

import numpy as np
import scipy.special


def gelu(x):
  """tanh-approximate GELU, as `flax.linen.gelu` (approximate=True)."""
  return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


def gelu_exact(x):
  """The erf form `x Phi(x)` (torch's `nn.GELU()`), through scipy's erf."""
  return 0.5 * x * (1 + scipy.special.erf(x / math.sqrt(2)))


def silu(x):
  return x / (1 + np.exp(-x))


def relu(x):
  return np.maximum(x, 0)


def mlp(params, v, activation="gelu", expert=None):
  """A dense MLP's params (or expert `expert` of `MlpExperts` params) on one
  token `v[D]`, unit by unit: `sum_i h_i W_1[i] (+ b_1)`."""
  p = {f"{layer}/{k}": np.asarray(a, np.float64)
       for layer, sub in params.items() for k, a in sub.items()}
  if expert is not None:
    p = {k: a[expert] for k, a in p.items()}
  v = np.asarray(v, np.float64)
  out = p.get("Dense_1/bias", np.zeros(p["Dense_1/kernel"].shape[1])).copy()
  for i in range(p["Dense_0/kernel"].shape[1]):
    pre = v @ p["Dense_0/kernel"][:, i] + p["Dense_0/bias"][i]
    if activation == "gelu":
      h = gelu(pre)
    elif activation == "gelu_exact":
      h = gelu_exact(pre)
    elif activation == "relu":
      h = relu(pre)
    else:  # swiglu
      h = silu(pre) * (v @ p["Dense_up/kernel"][:, i] + p["Dense_up/bias"][i])
    out += h * p["Dense_1/kernel"][i]
  return out


def expert_mlp(params, e, v, activation="gelu"):
  """Expert e of `MlpExperts` params applied to one token `v[D]`."""
  return mlp(params, v, activation, expert=e)


def cmoe_route(x, kernel, up_kernel, scale, bias, k, activation):
  """CMoE routing of tokens `x` `[N, D]`, token by token: the K experts of
  largest `softmax(|act(x W)|) + b` (lower index first on ties) and their
  weights `1 + s_e u_e`."""
  acts = {"gelu": gelu, "relu": relu, "swiglu": silu}
  indices, weights = [], []
  for v in np.asarray(x, np.float64):
    pre = v @ np.asarray(kernel, np.float64)
    h = acts[activation](pre)
    if activation == "swiglu":
      h = h * (v @ np.asarray(up_kernel, np.float64))
    a = np.abs(h)
    s = np.exp(a - a.max()) / np.exp(a - a.max()).sum()
    biased = s + bias
    order = sorted(range(len(s)), key=lambda e: (-biased[e], e))[:k]
    indices.append(order)
    weights.append([1 + s[e] * scale[e] for e in order])
  return np.array(indices), np.array(weights)


def token_choice_kept(idx, valid, gates, num_experts, capacity,
                      batch_priority=False):
  """Which `(g, s, k)` choices fit, filling buffers choice-major, one by one."""
  g_, s_, k_ = idx.shape
  kept = np.zeros(idx.shape, bool)
  for g in range(g_):
    counts = np.zeros(num_experts, int)
    order = list(range(s_))
    if batch_priority:
      prio = [max([gates[g, s, k] for k in range(k_) if valid[g, s, k]],
                  default=-np.inf) for s in range(s_)]
      order = sorted(order, key=lambda s: -prio[s])  # Stable sort.
    for k in range(k_):
      for s in order:
        if not valid[g, s, k]:
          continue
        e = idx[g, s, k]
        if counts[e] < capacity:
          kept[g, s, k] = True
          counts[e] += 1
  return kept


def _keep(a):
  return a


def token_choice_moe(x, idx, gates, valid, num_experts, capacity, params,
                     batch_priority=False, round_data=_keep):
  """MoE output `[G, S, D]` of token-choice routing, token by token.

  `round_data` is applied to each token before its expert and to each
  expert output before it is weighted (bfloat16 dispatch); the weights and
  sums stay exact."""
  x = np.asarray(x, np.float64)
  kept = token_choice_kept(idx, valid, gates, num_experts, capacity,
                           batch_priority)
  y = np.zeros_like(x)
  for g, s, k in np.ndindex(*idx.shape):
    if kept[g, s, k]:
      out = expert_mlp(params, idx[g, s, k], round_data(x[g, s]))
      y[g, s] += gates[g, s, k] * round_data(out)
  return y


def expert_choice_moe(x, token_indices, weights, params, round_data=_keep):
  """MoE output of expert-choice routing `[G, E, C]`, pick by pick
  (`round_data` as in `token_choice_moe`)."""
  x = np.asarray(x, np.float64)
  y = np.zeros_like(x)
  for g, e, c in np.ndindex(*token_indices.shape):
    s = token_indices[g, e, c]
    out = expert_mlp(params, e, round_data(x[g, s]))
    y[g, s] += weights[g, e, c] * round_data(out)
  return y


def soft_routing(x, mu, scale, normalize_tokens=True):
  """SoftMoE dispatch (softmax over tokens) and combine (over all E*P slots)
  weights `[G, S, E, P]` of tokens `x[G, S, D]`, slots `mu[D, E, P]`."""
  x = np.asarray(x, np.float64)
  if normalize_tokens:
    x = x / np.sqrt((x**2).sum(-1, keepdims=True) + 1e-6)
  mu = np.asarray(mu, np.float64)
  mu = mu / np.sqrt((mu**2).sum(0, keepdims=True) + 1e-6)
  logits = np.einsum("gsd,dep->gsep", float(scale) * x, mu)
  dispatch = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
  combine = np.exp(logits) / np.exp(logits).sum((2, 3), keepdims=True)
  return dispatch, combine


def soft_moe(x, dispatch, combine, params, round_data=_keep):
  """SoftMoE output: slot inputs as weighted sums, outputs recombined
  (`round_data` on the tokens and on the slot outputs, not the weights)."""
  x = np.asarray(x, np.float64)
  g_, s_, e_, p_ = dispatch.shape
  y = np.zeros_like(x)
  for g in range(g_):
    for e in range(e_):
      for p in range(p_):
        slot_in = sum(dispatch[g, s, e, p] * round_data(x[g, s])
                      for s in range(s_))
        slot_out = round_data(expert_mlp(params, e, slot_in))
        for s in range(s_):
          y[g, s] += combine[g, s, e, p] * slot_out
  return y


def ac_cluster_weights(tokens, clusters, num_clusters, dispersion, eps, clamp,
                       mean):
  """ACMoE feature weights `[E, D]`, cluster by cluster, feature by feature.

  `mean`: "cluster" | "feature" | "global_pre_clamp" | "global_post_clamp" |
  "none" (docs/routers.md, "`acmoe`", presets table).
  """
  x = np.asarray(tokens, np.float64)
  n, d = x.shape
  s = np.zeros((num_clusters, d))
  for k in range(num_clusters):
    members = [i for i in range(n) if clusters[i] == k]
    for q in range(d):
      if not members:
        continue  # Empty cluster: dispersion 0.
      mu = sum(x[i, q] for i in members) / len(members)
      if dispersion == "mad":
        s[k, q] = sum(abs(x[i, q] - mu) for i in members) / len(members)
      else:
        s[k, q] = sum((x[i, q] - mu)**2 for i in members) / len(members)
  w = 1.0 / (s + eps)
  pre = w.mean()
  if clamp is not None:
    w = np.where(w > clamp * pre, clamp * pre, w)
  if mean == "cluster":
    w = np.stack([w[k] / w[k].mean() for k in range(num_clusters)])
  elif mean == "feature":
    w = np.stack([w[:, q] / w[:, q].mean() for q in range(d)], axis=1)
  elif mean == "global_pre_clamp":
    w = w / pre
  elif mean == "global_post_clamp":
    w = w / w.mean()
  return w


def ac_token_scales(weights, indices, gates, valid, mix_k, mix_weights):
  """Each token's scaling `[N, D]`: Mix-1 row, or the gate-weighted Mix-k sum."""
  n = indices.shape[0]
  out = np.ones((n, weights.shape[1]))
  for i in range(n):
    if mix_k == 1:
      if valid[i, 0]:
        out[i] = weights[indices[i, 0]]
      continue
    entries = [j for j in range(mix_k) if valid[i, j]]
    if not entries:
      continue
    g = {j: float(gates[i, j]) for j in entries}
    if mix_weights != "raw":
      total = sum(g.values())
      g = {j: v / total for j, v in g.items()}
    out[i] = sum(g[j] * weights[indices[i, j]] for j in entries)
  return out


def top_p_choices(gates, p, cap):
  """Per token: the experts with gate > p (at least the top-1), at most cap,
  largest gate first."""
  out = []
  for row in np.asarray(gates).reshape(-1, gates.shape[-1]):
    order = sorted(range(len(row)), key=lambda e: -row[e])
    chosen = [e for e in order if row[e] > p][:cap] or order[:1]
    out.append(chosen)
  return out


def top_k_order(row, k):
  """The k largest entries' indices of a 1-D row, ties to the lower index."""
  return sorted(range(len(row)), key=lambda e: (-row[e], e))[:k]


def symphony_step(tokens, kernel, adjacency, *, k, beta, threshold=0.0):
  """One batch of Algorithm 1 (Symphony) with a linear noise-free base.

  Args:
    tokens: `[N, D]` router inputs; kernel `[D, E]`; adjacency `[E, E]`.

  Returns:
    `(indices [N, K], weights [N, K], new adjacency [E, E])`: each token's
    top-K of `A softmax(x W)` (or of the base gates while the sparsified
    `A` is all zero) and the graph after the update from the base top-K.
  """
  tokens = np.asarray(tokens, np.float64)
  a = np.asarray(adjacency, np.float64)
  e = a.shape[0]
  used = np.where(a >= threshold, a, 0.0) if threshold > 0 else a
  counts = np.zeros((e, e))
  indices, weights = [], []
  for x in tokens:
    logits = [sum(x[d] * kernel[d][j] for d in range(len(x)))
              for j in range(e)]
    z = [math.exp(v - max(logits)) for v in logits]
    g = [v / sum(z) for v in z]
    chosen = top_k_order(g, k)                      # lines 5-8
    for i in chosen:
      for j in chosen:
        counts[i, j] += 1
    if np.all(used == 0):
      sym = g
    else:                                           # line 11
      sym = [sum(used[j, m] * g[m] for m in range(e)) for j in range(e)]
    top = top_k_order(sym, k)                       # lines 12-13
    indices.append(top)
    weights.append([sym[j] for j in top])
  normed = np.zeros((e, e))
  for i in range(e):                                # line 15
    total = counts[i].sum()
    if total > 0:
      normed[i] = counts[i] / total
  new = beta * a + (1 - beta) * normed              # line 16
  return np.array(indices), np.array(weights), new


# ----------------------------------------------------------------------------
# Momentum residual streams (docs/streams.md), from the paper's equations
# (paper layout: f = -u, u the MoE output) and from the authors' V-MoE code
# (vmoe_reference: m = mu m + gamma u; LN_2(x - m), robust m = -u + mu m;
# LN_2(x + gamma m), extrapolation after LN_1). One block at a time: the
# caller hands in the stream input x, the MoE outputs u of the block's calls
# in order, and gets back the expected MoE inputs h and the block output.
# ----------------------------------------------------------------------------


def layer_norm(x, scale, bias, eps=1e-6):
  x = np.asarray(x, np.float64)
  mean = x.mean(-1, keepdims=True)
  var = ((x - mean) ** 2).mean(-1, keepdims=True)
  return (x - mean) / np.sqrt(var + eps) * scale + bias


class MomentumReference:
  """NumPy momentum recurrence over the blocks of one forward pass.

  `name`/`fields`: the stream config; `coeffs`: its resolved numbers
  (mu, gamma, alpha, ... as the test computes them independently).
  Call `block(x, us, ln1, ln2, is_moe)` for every block the stream runs in
  (all blocks for vmoe_reference, MoE blocks for paper), where `us(h)`
  returns the next captured MoE output given the expected input `h`.
  """

  def __init__(self, name, layout, coeffs):
    self.name, self.layout, self.c = name, layout, coeffs
    self.t = 0          # MoE blocks seen.
    self.p = 0.0        # Momentum vector (paper p / code m), may be complex.
    self.v = 0.0        # Second moment (Adam, RMSprop).
    self.p_adam = 0.0   # The code form's positive first moment.

  def block(self, x, us, ln1, ln2, is_moe):
    x = np.asarray(x, np.float64)
    c, vm = self.c, self.layout == "vmoe_reference"
    if not is_moe:
      shift = c["alpha"] * c["gamma"] * self.p if self.name == \
          "robust_momentum" else 0.0
      return layer_norm(x + us(layer_norm(x, *ln1) + shift), *ln2)
    self.t += 1
    out = self._moe(x, us, ln1)
    return layer_norm(out, *ln2) if vm else out

  def _at(self, x, shift, ln1):
    """The MoE input for the point x moved by shift (layout rule)."""
    if self.layout == "vmoe_reference":
      return layer_norm(x, *ln1) + shift
    return layer_norm(x + shift, *ln1)

  def _heavy(self, x, u, mu, gamma):
    if self.layout == "vmoe_reference":      # m = mu m + gamma u; x - m
      self.p = mu * self.p + gamma * u
      return x - self.p
    self.p = u + mu * self.p                  # p = -f + mu p, f = -u
    return x + gamma * self.p

  def _moe(self, x, us, ln1):
    c, name, vm = self.c, self.name, self.layout == "vmoe_reference"
    grad = (lambda u: u) if vm else (lambda u: -u)   # the optimiser's f
    if name in ("momentum", "time_varying"):
      mu = c["mu"](self.t) if callable(c["mu"]) else c["mu"]
      return self._heavy(x, us(self._at(x, 0.0, ln1)), mu, c["gamma"])
    if name == "robust_momentum":
      y_shift = c["alpha"] * c["gamma"] * self.p
      f = grad(us(self._at(x, y_shift, ln1)))
      self.p = -f + c["mu"] * self.p
      return x + c["gamma"] * self.p
    if name == "nag":
      f = grad(us(self._at(x, c["sign"] * c["mu"] * self.p, ln1)))
      self.p = c["mu"] * self.p - c["gamma"] * f
      return x + self.p
    if name == "sam":
      f0 = grad(us(self._at(x, 0.0, ln1)))
      norm = np.sqrt((f0 ** 2).sum(-1, keepdims=True))
      f1 = grad(us(self._at(x, c["rho"] * f0 / norm, ln1)))
      return x - c["gamma"] * f1
    if name == "complex_momentum":
      f = grad(us(self._at(x, 0.0, ln1)))
      self.p = -f + c["mu"] * self.p
      return x + c["gamma"] * np.real(self.p)
    if self.t > 1:                            # adam / rmsprop, later blocks
      return self._heavy(x, us(self._at(x, 0.0, ln1)), c["hb_mu"],
                         c["hb_gamma"])
    u = us(self._at(x, 0.0, ln1))
    if name == "rmsprop":
      f = grad(u)
      self.v = c["mu"] * self.v + (1 - c["mu"]) * f * f
      self.p = 0.0
      return x - c["gamma"] * f / np.sqrt(self.v + c["eps"])
    if c["form"] == "code" and vm:            # the authors' code, verbatim
      self.p_adam = c["beta1"] * self.p_adam + (1 - c["beta1"]) * u
      self.v = c["beta"] * self.v + (1 - c["beta"]) * u ** 2
      adam = c["gamma"] / np.sqrt(self.v + c["eps"]) * self.p_adam + x
      self.p = c["hb_mu"] * 0.0 + c["hb_gamma"] * u
      return x - adam
    f = grad(u)
    decay = c["beta1"] if c["form"] == "code" else c["mu"]
    self.p_adam = decay * self.p_adam + (1 - decay) * (-f)
    self.v = c["beta"] * self.v + (1 - c["beta"]) * f * f
    if c["form"] == "code":
      step = c["gamma"] * self.p_adam / np.sqrt(self.v + c["eps"])
      self.p = -f                              # heavy-ball from zero
    else:
      step = c["gamma"] * self.p_adam / (np.sqrt(self.v) + c["eps"])
      self.p = (-c["hb_gamma"] * self.p_adam if vm else self.p_adam)
    return x + step - c["kappa"] * x
