"""A synthetic check of the ACMoE theory (Lemma 1, Lemma 2, Proposition 1).

    python experiments/acmoe_synthetic.py [--seeds 0 1 2 3 4]
        [--out runs/acmoe_synthetic]

Claims (ACMoE §3.2; docs/routers.md, "`acmoe`"), tested on the mixture of
`vmoe_ext.data.synthetic`: K=4 clusters, D=64 features, each cluster tight
(std 0.05) on its own 16 features, where its mean is higher by 0.1 (the
dataset's 0.35 leaves no errors below noise 0.3), and loose (std 0.15)
elsewhere. Shapes: N tokens, D features, K (= E) clusters. The previous
layer's assignment of the 1024 training tokens is their true label; the AC
weights W[E, D] come from `cluster_dispersion` / `cluster_weights`; the
centroids mu_k are the training cluster means.

- Lemma 1: (mu_b - mu_a)^T M_a (mu_b - mu_a) >= ||mu_b - mu_a||^2, as the
  ratio over ordered pairs, for the mean-1 M_a we implement (paper preset,
  the §3.1 scaling its proof assumes) and the unnormalised 1/(s + 1e-4) of
  the statement. The latter is > 1 for a unit reason (pixels in [0, 1], so
  s <= 0.5); the former is not guaranteed in general (a pair differing only
  where a is loose gives < 1); here it should be (r+1) D / (2 (m r + D - m)).
- Proposition 1: noisy tokens h' = h + N(0, noise^2 I) are mis-assigned by
  the AC router no more often than by the plain one. Nearest centroid:
  plain argmin_k ||h' - mu_k||^2, AC argmin_k (h' - mu_k)^T M_{k*} (h' - mu_k)
  with k* the token's true cluster (the paper's ideal previous layer) or,
  as a realistic variant, the plain router's choice. Dot-product routing
  (argmax_k h'^T M mu_k, unnormalised centroids) is run on features centred
  by the training mean: uncentred, M_{k*} alone picks k* (0% error even
  with no separation), a label leak. Routing ignores the scale of M.
- Lemma 2, two clusters: P(closer to mu_k than to mu_k*) =
  1 - Phi(dmu^T M dmu / (2 sqrt(dmu^T M S M dmu))), S = Sigma_k* + noise^2 I,
  measured per ordered pair. The paper's proof of Proposition 1 leaves M out
  of the variance; with it, plain routing wins once noise dominates.
- Control: at noise 10 (no signal) plain routing is at chance (75%); any AC
  gain there is the label leaking through M_{k*}.

Writes OUT/acmoe_synthetic.md (mean ± std over seeds) and prints it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Mapping, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np
from scipy.stats import norm

from vmoe_ext.data.synthetic import cluster_spec, sample_clusters
from vmoe_ext.routers.adaptive_clustering import (cluster_dispersion,
                                                  cluster_weights,
                                                  resolve_options)

CONFIG = {"num_classes": 4, "image_size": 8, "channels": 1, "base": 0.5,
          "separation": 0.1, "tight_std": 0.05, "loose_std": 0.15}
NOISE_LEVELS = (0.0, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 10.0)
ROUTERS = ("plain", "ac_mad", "ac_var", "ac_prev_plain", "dot_plain", "dot_ac")
PAIRWISE = ("pair_plain", "pred_plain", "pair_ac", "pred_ac")
LEMMA1 = ("mad_mean1", "mad_mean1_min", "mad_raw_min", "var_mean1")


def expected_lemma1_ratio(config: Mapping[str, Any] = CONFIG) -> float:
  """Mean-1 MAD M_a ratio (r + 1) D / (2 (m r + D - m)), r = loose / tight."""
  d, k = config["image_size"] ** 2 * config["channels"], config["num_classes"]
  r, m = config["loose_std"] / config["tight_std"], d // k
  return (r + 1) * d / (2 * (m * r + d - m))


def pairwise_crossover(config: Mapping[str, Any] = CONFIG) -> float:
  """Noise std above which Lemma 2 (with M) favours plain over AC routing.

  Two clusters differing by `separation` on S_a and S_b (m features each),
  M_a = r on S_a and 1 on S_b (r = loose / tight, the MAD ratio): AC wins iff
  noise^2 < ((r + 1)^2 (t^2 + l^2) - 8 l^2) / (2 (r - 1)^2).
  """
  t, l = config["tight_std"], config["loose_std"]
  r = l / t
  return float(np.sqrt(((r + 1) ** 2 * (t * t + l * l) - 8 * l * l)
                       / (2 * (r - 1) ** 2)))


def ac_weights(tokens: np.ndarray, labels: np.ndarray, num_clusters: int,
               dispersion: str = "mad", mean: str = "cluster") -> np.ndarray:
  """`[E, D]` AC weights of tokens `[N, D]` grouped by `labels [N]`."""
  opts = resolve_options("paper", dispersion, mean=mean)
  s, _ = cluster_dispersion(jnp.asarray(tokens), jnp.asarray(labels),
                            num_clusters, dispersion)
  return np.asarray(cluster_weights(s, opts), np.float64)


def lemma1_ratios(mu: np.ndarray, w: np.ndarray) -> np.ndarray:
  """`[K, K]` ratio `||mu_b - mu_a||^2_{M_a} / ||mu_b - mu_a||^2` at [a, b].

  Args:
    mu: `[K, D]` cluster means; w: `[K, D]` the diagonals of M_a.
  Returns: the ratios, NaN on the diagonal.
  """
  diff2 = np.square(mu[None, :, :] - mu[:, None, :])  # [a, b, D]
  with np.errstate(invalid="ignore", divide="ignore"):
    return np.einsum("ad,abd->ab", w, diff2) / diff2.sum(-1)


def distances(h: np.ndarray, mu: np.ndarray, m: np.ndarray) -> np.ndarray:
  """`[N, K]` sum_q m[n, q] (h[n, q] - mu[k, q])^2; h, m `[N, D]`."""
  d2 = np.square(h[:, None, :] - mu[None, :, :])  # [N, K, D]
  return np.einsum("nd,nkd->nk", m, d2)


def pairwise_error(dist: np.ndarray, labels: np.ndarray) -> float:
  """Mean over ordered pairs (a, b) of P(dist to b < dist to a | label a)."""
  k = dist.shape[1]
  closer = dist < dist[np.arange(len(labels)), labels][:, None]  # [N, K]
  return float(np.mean([closer[labels == a, b].mean() for a in range(k)
                        for b in range(k) if b != a]))


def route_dot(h: np.ndarray, mu: np.ndarray, m: np.ndarray) -> np.ndarray:
  """`[N]` argmax_k h[n]^T diag(m[n]) mu[k]; h, m `[N, D]`, mu `[K, D]`."""
  return np.argmax((h * m) @ mu.T, axis=1)


def predicted_pairwise(mu: np.ndarray, var: np.ndarray, w: np.ndarray,
                       noise: float) -> float:
  """Lemma 2 with M, mean over ordered pairs (a, b) of clusters.

  Args:
    mu: `[K, D]` means; var: `[K, D]` per-cluster feature variances;
    w: `[K, D]` row a is M_a (ones for the plain router).
  """
  k = mu.shape[0]
  probs = []
  for a in range(k):
    for b in range(k):
      if b != a:
        d2 = np.square(mu[b] - mu[a])
        s = np.sum(w[a] ** 2 * d2 * (var[a] + noise ** 2))
        probs.append(norm.sf((w[a] @ d2) / (2 * np.sqrt(s))))
  return float(np.mean(probs))


def run_seed(seed: int, noise_levels: Sequence[float] = NOISE_LEVELS,
             num_train: int = 1024, num_test: int = 4096,
             config: Mapping[str, Any] = CONFIG) -> dict[str, Any]:
  """One seed: Lemma-1 ratios and mis-assignment rates per noise level.

  Returns:
    {"lemma1": {name: float}, "ratios_mean1" / "ratios_raw": [K, K],
     "errors": {noise: {router: rate}}, "w_mad": [K, D],
     "train": (x [N, D], y [N])}.
  """
  spec = cluster_spec(dict(config, seed=seed))
  k = spec.num_classes
  x, y = sample_clusters(spec, num_train, np.random.default_rng([seed, 1]))
  x = x.reshape(num_train, -1)
  xt, yt = sample_clusters(spec, num_test, np.random.default_rng([seed, 2]))
  xt = xt.reshape(num_test, -1).astype(np.float64)
  z = np.random.default_rng([seed, 3]).standard_normal(xt.shape)

  w_mad = ac_weights(x, y, k)
  w_raw = ac_weights(x, y, k, mean="none")
  w_var = ac_weights(x, y, k, "variance")
  var, _ = cluster_dispersion(jnp.asarray(x), jnp.asarray(y), k, "variance")
  var = np.asarray(var, np.float64)
  mu = np.stack([x[y == c].mean(0) for c in range(k)]).astype(np.float64)
  r_mean1, r_raw = lemma1_ratios(mu, w_mad), lemma1_ratios(mu, w_raw)
  lemma1 = {"mad_mean1": float(np.nanmean(r_mean1)),
            "mad_mean1_min": float(np.nanmin(r_mean1)),
            "mad_raw_min": float(np.nanmin(r_raw)),
            "var_mean1": float(np.nanmean(lemma1_ratios(mu, w_var)))}

  center = x.mean(0).astype(np.float64)
  ones = np.ones_like(xt)
  errors = {}
  for noise in noise_levels:
    h = xt + noise * z
    d_plain, d_ac = distances(h, mu, ones), distances(h, mu, w_mad[yt])
    plain = np.argmin(d_plain, axis=1)
    routed = {
        "plain": plain,
        "ac_mad": np.argmin(d_ac, axis=1),
        "ac_var": np.argmin(distances(h, mu, w_var[yt]), axis=1),
        "ac_prev_plain": np.argmin(distances(h, mu, w_mad[plain]), axis=1),
        "dot_plain": route_dot(h - center, mu - center, ones),
        "dot_ac": route_dot(h - center, mu - center, w_mad[yt]),
    }
    errors[noise] = {name: float(np.mean(r != yt))
                     for name, r in routed.items()}
    errors[noise].update(
        pair_plain=pairwise_error(d_plain, yt),
        pair_ac=pairwise_error(d_ac, yt),
        pred_plain=predicted_pairwise(mu, var, np.ones_like(mu), noise),
        pred_ac=predicted_pairwise(mu, var, w_mad, noise))
  return {"lemma1": lemma1, "ratios_mean1": r_mean1, "ratios_raw": r_raw,
          "errors": errors, "w_mad": w_mad, "train": (x, y)}


def _ms(values: list[float], pct: bool = False) -> str:
  scale = 100.0 if pct else 1.0
  mean = statistics.fmean(values) * scale
  std = (statistics.stdev(values) if len(values) > 1 else 0.0) * scale
  return f"{mean:.2f} ± {std:.2f}" if pct else f"{mean:.3f} ± {std:.3f}"


def report(results: list[dict[str, Any]], seeds: list[int],
           wall: float) -> str:
  """The markdown report of `run_seed` results (one per seed)."""
  noises = list(results[0]["errors"])
  err = {n: {r: [res["errors"][n][r] for res in results]
             for r in ROUTERS + PAIRWISE} for n in noises}

  def row(n: float, names: tuple[str, ...]) -> str:
    return f"| {n} | " + " | ".join(_ms(err[n][r], True) for r in names) + " |"

  def where(a: str, b: str) -> list[float]:
    return [n for n in noises if statistics.fmean(err[n][a])
            < statistics.fmean(err[n][b])]

  lines = [
      "# ACMoE theory on a synthetic Gaussian mixture",
      "",
      f"Seeds {seeds}; config {CONFIG}; 1024 training tokens (AC weights "
      "and centroids, labels as the previous layer's assignment), 4096 test "
      "tokens per seed and noise level. Error rates in %, mean ± std over "
      f"seeds. Wall time {wall:.1f} s.",
      "",
      "## Proposition 1: 4-way mis-assignment of h' = h + N(0, noise^2 I)",
      "",
      "k* = the true cluster unless said. AC (MAD) is the implemented router "
      "(paper preset); dot: argmax of h'^T M mu_k on centred features.",
      "",
      "| noise | plain | AC (MAD) | AC (var) | AC, k* = plain's | "
      "dot plain | dot AC |",
      "|---" * 7 + "|",
  ] + [row(n, ROUTERS) for n in noises] + [
      "",
      "## Lemma 2: two-cluster error, mean over ordered pairs",
      "",
      "| noise | plain | Lemma 2 plain | AC (MAD) | Lemma 2 AC (M in the "
      "variance) |",
      "|---" * 5 + "|",
  ] + [row(n, PAIRWISE) for n in noises]
  l1 = {name: [res["lemma1"][name] for res in results] for name in LEMMA1}
  gap = 100 * max(abs(statistics.fmean(err[n][f"pair_{r}"])
                      - statistics.fmean(err[n][f"pred_{r}"]))
                  for n in noises for r in ("plain", "ac"))
  low = {name: min(l1[name]) for name in ("mad_mean1_min", "mad_raw_min")}
  holds = {name: "holds" if v >= 1 else "FAILS" for name, v in low.items()}
  lines += [
      "",
      "## Lemma 1: ||mu_b - mu_a||^2_{M_a} / ||mu_b - mu_a||^2",
      "",
      "| M | ratio over ordered pairs |",
      "|---|---|",
      f"| MAD, mean 1 (implemented), mean over pairs | "
      f"{_ms(l1['mad_mean1'])} |",
      f"| MAD, mean 1, min over pairs | {_ms(l1['mad_mean1_min'])} |",
      f"| MAD, 1/(s+1e-4) unnormalised (Lemma 1 as stated), min | "
      f"{_ms(l1['mad_raw_min'])} |",
      f"| variance, mean 1, mean over pairs | {_ms(l1['var_mean1'])} |",
      "",
      "## Verdict",
      "",
      f"- Lemma 1 {holds['mad_mean1_min']} for every pair and seed with the "
      f"mean-1 M (smallest ratio {low['mad_mean1_min']:.3f}; expected "
      f"{expected_lemma1_ratio():.3f} in this mixture) and "
      f"{holds['mad_raw_min']} with the unnormalised M (smallest "
      f"{low['mad_raw_min']:.2f}), the latter for a unit reason "
      "(dispersions < 1). The mean-1 form holds because each pair differs "
      "on as many features where a is tight as where it is loose; it fails "
      "for a pair differing only where a is loose (tests/"
      "test_acmoe_theory.py).",
      f"- Lemma 2: two-cluster error within {gap:.2f} points of the formula "
      "with M in the variance as well as the mean.",
      "- Proposition 1, in the two-cluster form the paper proves, holds at "
      f"noise {where('pair_ac', 'pair_plain')} and fails at "
      f"{where('pair_plain', 'pair_ac')}; Lemma 2 with M puts the crossover "
      f"at {pairwise_crossover():.3f}. The paper's proof scales the "
      "distance by M but not the noise.",
      f"- 4-way, the AC router errs less at noise {where('ac_mad', 'plain')}"
      f" and more at {where('plain', 'ac_mad')}, but at noise {noises[-1]} "
      f"(no signal; plain {_ms(err[noises[-1]]['plain'], True)}%, chance "
      f"75%) it errs {_ms(err[noises[-1]]['ac_mad'], True)}%: M_{{k*}} from "
      "the true previous cluster leaks the label. With k* = the plain "
      "router's choice on the same noisy token, AC errs less at "
      f"{where('ac_prev_plain', 'plain')} and more at "
      f"{where('plain', 'ac_prev_plain')}: the gain needs a previous "
      "assignment more reliable than the current router.",
  ]
  return "\n".join(lines) + "\n"


def main(argv=None) -> str:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
  parser.add_argument("--out", default=os.path.join("runs", "acmoe_synthetic"))
  args = parser.parse_args(argv)
  start = time.time()
  results = [run_seed(seed) for seed in args.seeds]
  text = report(results, args.seeds, time.time() - start)
  os.makedirs(args.out, exist_ok=True)
  path = os.path.join(args.out, "acmoe_synthetic.md")
  with open(path, "w") as f:
    f.write(text)
  print(text)
  print(f"Wrote {path}")
  return path


if __name__ == "__main__":
  main()
