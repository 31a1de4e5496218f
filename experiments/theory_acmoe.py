"""ACMoE (tight clusters), Proposition 2 (Eq. 11), checked numerically.

Part of experiments/theory_checks.py (which runs it and writes the report).
L is the router's cross-entropy with logits h^T M e_k (M = I, or M_{k*} of
`cluster_weights`, k* the true cluster); its Hessian in e_i is
(1/N) sum_n p_ni (1 - p_ni) (M h_n)(M h_n)^T. Proposition 2 claims
kappa(Hessian with M_{k*}) <= kappa(Hessian with I). Checked on one centred
Gaussian cluster (near-diagonal covariance, Lemma 4's assumption, or randomly
rotated: the assumption dropped) and on the acmoe_synthetic.py mixture (at
a small random e and at e = the cluster means). Shapes: N tokens, D
features, E experts.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from scipy.linalg import expm
from scipy.stats import special_ortho_group

from vmoe_ext.data.synthetic import cluster_spec, sample_clusters
from vmoe_ext.routers.adaptive_clustering import (cluster_dispersion,
                                                  cluster_weights,
                                                  resolve_options)

MIXTURE = {"num_classes": 4, "image_size": 8, "channels": 1, "base": 0.5,
           "separation": 0.1, "tight_std": 0.05, "loose_std": 0.15}


def softmax(z: np.ndarray) -> np.ndarray:
  """Softmax over the last axis (numpy, shifted by the max)."""
  z = z - z.max(-1, keepdims=True)
  p = np.exp(z)
  return p / p.sum(-1, keepdims=True)


def kappa(h: np.ndarray) -> float:
  """lambda_max / lambda_min of a symmetric positive definite `[D, D]`."""
  w = np.linalg.eigvalsh(h)
  return float(w[-1] / w[0])


def ac_weights(h: np.ndarray, labels: np.ndarray, k: int) -> np.ndarray:
  """`[E, D]` diagonals of M_k (paper preset: 1/(MAD + 1e-4), mean 1)."""
  s, _ = cluster_dispersion(jnp.asarray(h, jnp.float32), jnp.asarray(labels),
                            k, "mad")
  return np.asarray(cluster_weights(s, resolve_options("paper")), np.float64)


def router_hessian(u: np.ndarray, e: np.ndarray, i: int) -> np.ndarray:
  """`[D, D]` Hessian in e_i of mean_n CE(softmax(u_n e^T), y_n).

  u: `[N, D]` router inputs (M h); e: `[E, D]` expert embeddings. The labels
  drop out: the logits are linear in e_i.
  """
  p = softmax(u @ e.T)[:, i]
  return (u * (p * (1 - p))[:, None]).T @ u / len(u)


def kappa_ratios(h: np.ndarray, m: np.ndarray, e: np.ndarray) -> np.ndarray:
  """`[E]` kappa(H_i) with router inputs h * m over kappa(H_i) with h."""
  return np.array([kappa(router_hessian(h * m, e, i))
                   / kappa(router_hessian(h, e, i)) for i in range(len(e))])


def one_cluster_ratio(rng: np.random.Generator, angle: float | None,
                      d: int = 8, n: int = 2048) -> float:
  """Max over 4 experts of kappa ratios, one centred Gaussian cluster.

  Covariance Q diag(lambda) Q^T, lambda log-uniform in [e^-2, e^2], Q =
  expm(angle * skew) (near-diagonal for a small angle) or Haar (None).
  """
  if angle is None:
    q = special_ortho_group.rvs(d, random_state=rng)
  else:
    a = rng.standard_normal((d, d))
    q = expm(angle * (a - a.T) / 2)
  cov = q @ np.diag(np.exp(rng.uniform(-2, 2, d))) @ q.T
  h = rng.multivariate_normal(np.zeros(d), cov, size=n)
  m = ac_weights(h, np.zeros(n, np.int32), 1)[0]
  return float(kappa_ratios(h, m, 0.01 * rng.standard_normal((4, d))).max())


def mixture_ratios(seed: int) -> dict[str, float]:
  """Max over 4 experts of kappa ratios on the acmoe_synthetic.py mixture.

  At a small random e and at e = the cluster means (logit std 2); at the
  small e also with each cluster centred on its own mean and uncentred.
  """
  spec = cluster_spec(dict(MIXTURE, seed=seed))
  x, y = sample_clusters(spec, 1024, np.random.default_rng([seed, 1]))
  x = x.reshape(1024, -1).astype(np.float64)
  m = ac_weights(x, y, 4)[y]
  h = x - x.mean(0)
  mu = np.stack([h[y == c].mean(0) for c in range(4)])
  e0 = 0.01 * np.random.default_rng([seed, 2]).standard_normal(mu.shape)
  ratio = lambda h, e: float(kappa_ratios(h, m, e).max())
  return {"mixture_init": ratio(h, e0),
          "mixture_centroids": ratio(h, 2 * mu / (h @ mu.T).std()),
          "mixture_cluster_centred": ratio(h - mu[y], e0),
          "mixture_uncentred": ratio(x, e0)}



def acmoe_checks(seed: int, rng: np.random.Generator) -> dict[str, float]:
  """The "acmoe" section of one seed: 20 near-diagonal then 20 rotated
  one-cluster draws from `rng`, and `mixture_ratios(seed)`."""
  near = [one_cluster_ratio(rng, 0.1) for _ in range(20)]
  haar = [one_cluster_ratio(rng, None) for _ in range(20)]
  return {"near_diagonal_max": max(near),
          "rotated_share_worse": float(np.mean(np.array(haar) > 1)),
          "rotated_max": max(haar), **mixture_ratios(seed)}
