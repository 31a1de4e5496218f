"""Neuron grouping: the shared expert and balanced routed experts (CMoE steps 2-4).

Given the activation markers `A` `[N, H]` (`vmoe_ext.carving.profiling`) and
rates `mu` `[H]`, with `m = H / E_total` neurons per expert:

* shared expert: the `N_s * m` units of highest rate (Eq. 8; ties: the lower
  unit index first);
* routed experts: balanced K-means of the remaining units' marker columns
  `c_i` `[N]` into `N_r` clusters of exactly `m` units. The initial
  centroids are the columns of the `N_r` remaining units of highest rate
  (cluster p's is the p-th highest). Each iteration solves the balanced
  assignment exactly: the cost of unit i in cluster p is the distance
  `d(c_i, ĉ_p)`, L2 (the paper, Eq. 10) or L1 (the authors' code, `cdist(p=1)`
  on 0/1 markers: the Hamming distance); repeating every cluster's column `m`
  times makes it a square linear assignment problem (Eq. 13), solved by
  `scipy.optimize.linear_sum_assignment` (the authors use `lap.lapjv`: equal
  optimal cost, possibly another of the many tied partitions). The centroids
  then move to their clusters' means (Eq. 14). `iterations` bounds the
  rounds (the authors run 1; the paper iterates to convergence), stopping
  early when an assignment repeats;
* representative of each routed expert: its member nearest the *updated*
  centroid under the same distance (first in unit order on ties).

Routed expert p keeps its units in increasing index order; so does the
shared expert.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from vmoe_ext.errors import require

DISTANCES = ("l2", "l1")


def top_rate_units(rates: np.ndarray, count: int,
                   candidates: np.ndarray | None = None) -> np.ndarray:
  """The `count` candidate units of highest rate, highest first (ties: the
  lower unit index first). `candidates`: unit indices (default: all)."""
  if candidates is None:
    candidates = np.arange(rates.shape[0])
  order = np.argsort(-rates[candidates], kind="stable")
  return candidates[order[:count]]


def distances(points: np.ndarray, centroids: np.ndarray,
              metric: str) -> np.ndarray:
  """`[n, k]` distances of points `[n, q]` to centroids `[k, q]`."""
  require(metric in DISTANCES, "carve.distance",
          f"must be one of {DISTANCES}, got {metric!r}")
  diff = points[:, None, :].astype(np.float64) - centroids[None].astype(
      np.float64)
  if metric == "l1":
    return np.abs(diff).sum(-1)
  return np.sqrt((diff ** 2).sum(-1))


def balanced_assignment(cost: np.ndarray, size: int
                        ) -> tuple[np.ndarray, float]:
  """Labels `[n]` (each of the k clusters exactly `size` times) minimising
  the summed cost `[n, k]`, and that minimum.

  `n` must be `k * size`: cluster p's column is repeated `size` times into
  an `[n, n]` square problem (Eq. 13).
  """
  n, k = cost.shape
  require(n == k * size, "carve.num_experts",
          f"{n} units do not fill {k} clusters of {size}")
  # Imported here: scipy.optimize takes ~0.4 s to import, and every run of
  # the binary imports this module (the carve mode), carving or not.
  from scipy.optimize import linear_sum_assignment
  square = np.repeat(cost, size, axis=1)
  rows, cols = linear_sum_assignment(square)
  labels = np.empty(n, np.int64)
  labels[rows] = cols // size
  return labels, float(cost[np.arange(n), labels].sum())


@dataclasses.dataclass(frozen=True)
class Clusters:
  """Balanced clusters of units.

  Attributes:
    units: `[k, m]` unit indices of each cluster, increasing.
    centroids: `[k, q]` the updated centroids (cluster means).
    cost: the assignment cost of the last iteration (against the centroids
      it was solved for).
    iterations: assignment rounds run.
  """
  units: np.ndarray
  centroids: np.ndarray
  cost: float
  iterations: int


def balanced_clusters(markers: np.ndarray, rates: np.ndarray,
                      candidates: np.ndarray, num_clusters: int, *,
                      metric: str = "l2", iterations: int = 1) -> Clusters:
  """Balanced K-means of the marker columns of `candidates` (module doc).

  Args:
    markers: `[N, H]` activation markers (0/1).
    rates: `[H]` activation rates.
    candidates: `[k*m]` the unit indices to cluster.
    num_clusters: k (`N_r`).
    metric: "l2" or "l1".
    iterations: maximum assignment rounds (>= 1).
  """
  require(isinstance(iterations, int) and iterations >= 1,
          "carve.iterations", f"must be an integer >= 1, got {iterations!r}")
  candidates = np.sort(np.asarray(candidates))
  size = len(candidates) // num_clusters
  points = markers[:, candidates].T.astype(np.float64)  # [n, N]
  seeds = top_rate_units(rates, num_clusters, candidates)
  centroids = markers[:, seeds].T.astype(np.float64)
  labels, cost, previous, rounds = None, 0.0, None, 0
  for rounds in range(1, iterations + 1):
    labels, cost = balanced_assignment(
        distances(points, centroids, metric), size)
    centroids = np.stack([points[labels == p].mean(0)
                          for p in range(num_clusters)])
    if previous is not None and np.array_equal(labels, previous):
      break
    previous = labels
  units = np.stack([candidates[labels == p] for p in range(num_clusters)])
  return Clusters(units, centroids, cost, rounds)


def representatives(markers: np.ndarray, clusters: Clusters,
                    metric: str = "l2") -> np.ndarray:
  """`[k]` the member of each cluster nearest its updated centroid (first
  in unit order on ties)."""
  out = []
  for units, centroid in zip(clusters.units, clusters.centroids):
    d = distances(markers[:, units].T, centroid[None], metric)[:, 0]
    out.append(units[int(np.argmin(d))])
  return np.asarray(out)
