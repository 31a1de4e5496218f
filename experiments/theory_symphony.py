"""Symphony, Proposition 1 and Theorem 1, checked numerically.

Part of experiments/theory_checks.py (which runs it and writes the report).
Proposition 1: (i) ||A v|| <= rho ||v|| for 1^T v = 0, rho = max_{i>=2}
|lambda_i(A)|, and (ii) TopK(A s) unchanged if ||ds|| < g / (2 rho), on
Sinkhorn-balanced (symmetric doubly stochastic) graphs and on the graph
Algorithm 1 builds (`vmoe_ext.routers.symphony`), which is row- but not
doubly stochastic. Theorem 1 (Hoeffding band on a_jk - mu(C_jk)) at
eps = 0 (its L~ eps term has an unspecified constant: not checkable), for
the joint co-selection frequency of the proof's Eq. 14 and for RowNorm(A')
of Eq. 7. Shapes: N tokens, D features, E experts, K selected experts.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from theory_acmoe import softmax

from vmoe_ext.routers.symphony import (coselection_counts, row_normalize,
                                       symphony_top_k, update_adjacency)

ALPHA = 0.05


def doubly_stochastic(rng: np.random.Generator, m: int) -> np.ndarray:
  """Symmetric positive doubly-stochastic `[m, m]` (symmetric Sinkhorn)."""
  w = rng.uniform(0.05, 1.0, (m, m))
  w, d = w + w.T, np.ones(m)
  for _ in range(2000):
    d = np.sqrt(d / (w @ d))
  return d[:, None] * w * d[None, :]


def second_modulus(a: np.ndarray) -> float:
  """rho = max_{i>=2} |lambda_i(A)| (eigenvalues by decreasing modulus)."""
  return float(np.sort(np.abs(np.linalg.eigvals(a)))[-2])


def contraction(a: np.ndarray) -> float:
  """sup_{1^T v = 0} ||A v|| / ||v|| = ||A P||_2, P = I - 11^T / M."""
  m = a.shape[0]
  return float(np.linalg.norm(a @ (np.eye(m) - 1.0 / m), 2))


def topk_stability(a: np.ndarray, gates: np.ndarray, k: int
                   ) -> tuple[int, float]:
  """(ii) of Proposition 1 for gates `[N, E]`, under worst-case ds.

  The least mean-zero ds moving TopK(A s) has norm min over i in TopK, o
  outside of (r_i - r_o) / ||P A^T (e_o - e_i)||. Returns the TopK changes
  of `symphony_top_k` when each s moves by 0.999 g / (2 rho) along the worst
  such direction, and min over tokens of that least norm / (g / (2 rho)).
  """
  e, rho = a.shape[0], second_modulus(a)
  eye, proj = np.eye(e), np.eye(e) - 1.0 / e
  r = gates @ a.T
  order = np.argsort(-r, axis=1)
  moved, ratios = [], []
  for n in range(len(gates)):
    top, rest = order[n, :k], order[n, k:]
    radius = (r[n, top[-1]] - r[n, rest[0]]) / (2 * rho)
    need, u = min(((r[n, i] - r[n, o]) / np.linalg.norm(v), v / np.linalg.norm(
        v)) for i in top for o in rest
                  for v in [proj @ a.T @ (eye[o] - eye[i])])
    moved.append(gates[n] + 0.999 * radius * u)
    ratios.append(need / radius)
  idx = [np.sort(np.asarray(symphony_top_k(
      jnp.asarray(np.asarray(g)[None], jnp.float32),
      jnp.asarray(a, jnp.float32), num_selected=k)[0].expert_indices)[0],
                 axis=-1) for g in (gates, moved)]
  return int(np.sum(np.any(idx[0] != idx[1], axis=-1))), float(min(ratios))


def router_tokens(seed: int, d: int = 16, e: int = 8
                  ) -> tuple[np.ndarray, Callable[[int], np.ndarray]]:
  """A random linear router `[D, E]` and a sampler of tokens `[n, D]`.

  Tokens are N(m, I) with ||m|| = 1, so that expert loads differ.
  """
  rng = np.random.default_rng([seed, 10])
  w = 2 * rng.standard_normal((d, e)) / np.sqrt(d)
  mean = rng.standard_normal(d)
  mean /= np.linalg.norm(mean)
  return w, lambda size: mean + rng.standard_normal((size, d))


def top_k(x: np.ndarray, w: np.ndarray, k: int = 2) -> np.ndarray:
  """`[..., K]` the clean top-K experts of tokens `[..., D]`."""
  return np.argsort(-(x @ w), axis=-1)[..., :k]


def graph_algorithm1(idx: np.ndarray, e: int, beta: float = 0.9
                     ) -> np.ndarray:
  """Algorithm 1 from zeros over batches of selections `[T, N, K]`."""
  a = jnp.zeros((e, e), jnp.float32)
  for batch in idx:
    a = update_adjacency(a, coselection_counts(
        jnp.asarray(batch), jnp.ones(batch.shape, bool), e), beta)
  return np.asarray(a, np.float64)


def estimators(idx: np.ndarray, e: int) -> tuple[np.ndarray, np.ndarray]:
  """Per trial of selections `[T, N, K]`, `[T, E, E]` estimates of mu(C_jk):

  the joint frequency A'_jk / N (j != k; the proof's Eq. 14) and the graph
  of Eq. 7 / Algorithm 1, RowNorm(A') (`vmoe_ext.routers.symphony`).
  """
  counts = jax.vmap(lambda i: coselection_counts(
      i, jnp.ones(i.shape, bool), e))(jnp.asarray(idx))
  joint = np.asarray(counts, np.float64) / idx.shape[1]
  return (np.where(np.eye(e, dtype=bool), 0.0, joint),
          np.asarray(row_normalize(counts), np.float64))


def symphony_theorem1(seed: int, trials: int = 50, n: int = 4000,
                      e: int = 8, k: int = 2) -> dict[str, float]:
  """Band failure rates at eps = 0 and what RowNorm(A') estimates."""
  w, sample = router_tokens(seed)
  off = ~np.eye(e, dtype=bool)
  ref = top_k(sample(200_000), w, k)[None]
  mu = estimators(ref, e)[0][0]
  pi = np.bincount(ref.ravel(), minlength=e) / ref.shape[1]
  band = np.sqrt(np.log(2 / ALPHA) / (2 * n))
  x = sample(trials * n).reshape(trials, n, -1)
  joint, rownorm = estimators(top_k(x, w, k), e)
  fail = lambda a: (np.abs(a - mu) > band)[:, off].mean(0)
  return {"joint_fail_max": float(fail(joint).max()),
          "rownorm_fail_max": float(fail(rownorm).max()),
          "rownorm_fail_mean": float(fail(rownorm).mean()),
          "band": float(band),
          "rownorm_bias_max": float(np.abs(rownorm.mean(0) - mu)[off].max()),
          "rownorm_vs_mu_over_k_pi": float(np.abs(
              rownorm.mean(0) - mu / (k * pi[:, None]))[off].max())}


def symphony_proposition1(seed: int, e: int = 8, k: int = 2
                          ) -> dict[str, float]:
  """(i) and (ii) on 10 Sinkhorn graphs and on Algorithm 1's graph."""
  rng = np.random.default_rng([seed, 11])
  w, sample = router_tokens(seed)
  gates = softmax(sample(64) @ w)
  ds = [doubly_stochastic(rng, e) for _ in range(10)]
  a = graph_algorithm1(top_k(sample(40 * 512).reshape(40, 512, -1), w, k), e)
  ds_stable = [topk_stability(g, gates, k) for g in ds[:3]]
  alg1_stable = topk_stability(a, gates, k)
  return {"ds_contraction_over_rho": max(contraction(g) / second_modulus(g)
                                         for g in ds),
          "ds_topk_changes": sum(stable[0] for stable in ds_stable),
          "ds_flip_radius_over_bound": min(stable[1] for stable in ds_stable),
          "alg1_contraction_over_rho": contraction(a) / second_modulus(a),
          "alg1_topk_changes": alg1_stable[0],
          "alg1_flip_radius_over_bound": alg1_stable[1],
          "alg1_column_sum_range": float(np.ptp(a.sum(0))),
          "alg1_row_sum": float(a.sum(1).mean()),
          "alg1_asymmetry": float(np.linalg.norm(a - a.T) / np.linalg.norm(a))}
