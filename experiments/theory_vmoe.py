"""V-MoE robustness appendix: Lemma 1 and Theorems 1-2, checked numerically.

Part of experiments/theory_checks.py (which runs it and writes the report).
Our copy of the paper has the proofs, not the main text, so the statements
are those the proofs establish. Lemma 1 (the MoE layer's Lipschitz constant
is at most max_i L_i + max_x ||sum_i p_i f_i(x) (s_i - sbar(x))^T||) on
`MoeLayer` with K = E in the ball ||x|| <= sqrt(D), by random and
gradient-ascended points and pairs; the top-K layer (K < E) for contrast.
Theorems 1-2 on least squares, with the tightest eps1, eps2 of Definitions
1-2 for block subspaces U_i. Shapes: N tokens, D features, E experts.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from theory_symphony import top_k

from vmoe_ext.moe import MoeLayer
from vmoe_ext.moe.contract import RoutingContext
from vmoe_ext.moe.experts import hidden_activation, mlp_experts
from vmoe_ext.routers import build_router

# V-MoE robustness appendix: Lemma 1 on the library's MoE layer.
DL, EL, HL = 8, 4, 16
RADIUS = float(np.sqrt(DL))  # the ball ||x|| <= sqrt(D) of LN-scale tokens


@functools.lru_cache(maxsize=None)
def moe_layer(k: int) -> MoeLayer:
  """`MoeLayer` with the V-MoE router, E = 4 experts of width 16, top-k."""
  return MoeLayer(router=build_router(
      {"name": "noisy_topk", "num_selected": k}, EL), hidden_size=HL)


def moe_params(seed: int) -> dict[str, Any]:
  """Random layer parameters (router logits of std ~1.5 per unit input)."""
  n = np.random.default_rng([seed, 20]).standard_normal
  p = {"Mlp": {"Dense_0": {"kernel": n((EL, DL, HL)) / np.sqrt(DL),
                           "bias": 0.1 * n((EL, HL))},
               "Dense_1": {"kernel": n((EL, HL, DL)) / np.sqrt(HL),
                           "bias": 0.1 * n((EL, DL))}},
       "router": {"logits": {"dense": {"kernel": 1.5 * n((DL, EL))
                                       / np.sqrt(DL)}}}}
  return jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), p)


def moe_apply(p: dict[str, Any], x: jax.Array, k: int = EL) -> jax.Array:
  """`[N, D] -> [N, D]`: the layer, each token its own group (no drops)."""
  return moe_layer(k).apply({"params": p}, x[:, None, :],
                            RoutingContext())[0][:, 0]


moe_apply_jit = jax.jit(moe_apply, static_argnums=2)


def lemma1_terms(p: dict[str, Any], x: jax.Array
                 ) -> tuple[jax.Array, jax.Array]:
  """Gates p(x) `[E]` and sum_i p_i f_i(x) (s_i - sbar(x))^T `[D, D]`."""
  s = p["router"]["logits"]["dense"]["kernel"]
  g = jax.nn.softmax(x @ s)
  f = mlp_experts(p["Mlp"], jnp.broadcast_to(x, (EL, 1, DL)))[:, 0]
  return g, (f * g[:, None]).T @ (s.T - (s @ g)[None])


def expert_lipschitz(p: dict[str, Any]) -> np.ndarray:
  """`[E]` L_i <= max|act'| ||W0_i||_2 ||W1_i||_2 (an upper bound)."""
  grid = jnp.linspace(-8.0, 8.0, 160_001)
  slope = float(jnp.max(jax.vmap(jax.grad(
      lambda z: hidden_activation("gelu", z)))(grid))) + 1e-6
  w0, w1 = (np.asarray(p["Mlp"][n]["kernel"], np.float64)
            for n in ("Dense_0", "Dense_1"))
  return np.array([slope * np.linalg.norm(a, 2) * np.linalg.norm(b, 2)
                   for a, b in zip(w0, w1)])


def opnorm(m: jax.Array) -> jax.Array:
  return jnp.sqrt(jnp.max(jnp.linalg.eigvalsh(m.T @ m)))


def project(z: Any) -> Any:
  """Each D-block of `[N, j*D]` points onto the ball ||x|| <= RADIUS."""
  xp = jnp if isinstance(z, jax.Array) else np
  b = z.reshape(z.shape[0], -1, DL)
  norm = xp.linalg.norm(b, axis=-1, keepdims=True)
  return (b * xp.minimum(1.0, RADIUS / norm)).reshape(z.shape)


def ascend(objective: Callable[[jax.Array], jax.Array], z: jax.Array,
           steps: int, lr: float) -> jax.Array:
  """Projected normalised-gradient ascent of `objective` from `[N, .]`."""
  grad = jax.vmap(jax.grad(objective))

  def step(_, z):
    g = grad(z)
    return project(z + lr * g / (jnp.linalg.norm(g, axis=-1,
                                                 keepdims=True) + 1e-12))
  return jax.lax.fori_loop(0, steps, step, z)


@jax.jit
def lemma1_search(p: dict[str, Any], lips: jax.Array, x0: jax.Array,
                  pairs: jax.Array) -> tuple[jax.Array, ...]:
  """Adversarial points and pairs in the ball, and Lemma 1's terms there.

  Returns ||J_f(x)||, sum_i p_i L_i + ||B(x)||, ||B(x)|| at x0 `[N, D]`, at
  the maximisers of ||B|| and at the ascended pairs' ends; and
  ||f(x) - f(y)|| / ||x - y|| of the pairs `[M, 2D]` before and after ascent.
  """
  def log_ratio(z):
    x, y = z[:DL], z[DL:]
    return (jnp.log(jnp.linalg.norm(moe_apply(p, x[None])
                                    - moe_apply(p, y[None])))
            - jnp.log(jnp.linalg.norm(x - y)))

  def terms(x):
    g, b = lemma1_terms(p, x)
    jac = jax.jacfwd(lambda v: moe_apply(p, v[None])[0])(x)
    return opnorm(jac), g @ lips + opnorm(b), opnorm(b)

  xb = ascend(lambda x: opnorm(lemma1_terms(p, x)[1]), x0, 60, 0.2)
  z = ascend(log_ratio, pairs, 80, 0.05)
  points = jnp.concatenate([x0, xb, z[:, :DL], z[:, DL:]])
  return (*jax.vmap(terms)(points),
          jnp.exp(jax.vmap(log_ratio)(jnp.concatenate([pairs, z]))))


def topk_jump(p: dict[str, Any], rng: np.random.Generator,
              delta: float, k: int = 2) -> float:
  """Max ||f(a) - f(b)|| / delta over pairs straddling a top-k switch.

  a, b = the switch point -/+ delta/2 along 32 random segments in the ball
  (bisection on the router's top-k set, then the top-k layer).
  """
  s = np.asarray(p["router"]["logits"]["dense"]["kernel"], np.float64)
  x, y = (project(rng.standard_normal((32, DL))) for _ in range(2))
  sets = lambda z: np.sort(top_k(z, s, k), axis=-1)
  keep = np.any(sets(x) != sets(y), axis=-1)
  x, y = x[keep], y[keep]
  lo, hi = np.zeros(len(x)), np.ones(len(x))
  for _ in range(50):
    mid = (lo + hi) / 2
    same = np.all(sets(x + mid[:, None] * (y - x)) == sets(x), axis=-1)
    lo, hi = np.where(same, mid, lo), np.where(same, hi, mid)
  u = (y - x) / np.linalg.norm(y - x, axis=-1, keepdims=True)
  mid = x + lo[:, None] * (y - x)
  fa, fb = (np.asarray(moe_apply_jit(p, jnp.asarray(
      mid + c * delta / 2 * u, jnp.float32), k), np.float64)
            for c in (-1, 1))
  return float(np.max(np.linalg.norm(fa - fb, axis=-1)) / delta)


def lemma1(seed: int) -> dict[str, float]:
  """Lemma 1 on the K = E layer; the top-2 layer's jump for contrast."""
  p = moe_params(seed)
  lips = expert_lipschitz(p)
  rng = np.random.default_rng([seed, 21])
  x0 = project(rng.standard_normal((16, DL)))
  pairs = np.concatenate(
      [x0, project(x0 + 0.3 * rng.standard_normal(x0.shape))], axis=1)
  jn, bound, bn, ratios = (np.asarray(v, np.float64) for v in lemma1_search(
      p, jnp.asarray(lips, jnp.float32), jnp.asarray(x0, jnp.float32),
      jnp.asarray(pairs, jnp.float32)))
  rhs = lips.max() + bn.max()
  return {"pointwise_max": float(np.max(jn / bound)),
          "jacobian_max": float(jn.max()), "empirical_lipschitz":
          float(ratios.max()), "random_pairs_max":
          float(ratios[:len(pairs)].max()), "rhs": float(rhs),
          "global_ratio": float(ratios.max() / rhs),
          "topk_ratio_over_rhs": topk_jump(p, rng, 1e-3) / rhs,
          "topk_ratio_over_rhs_delta_1e-2": topk_jump(p, rng, 1e-2) / rhs}


# V-MoE robustness appendix: Theorems 1 and 2 (least squares, numpy).
def theorem1_instance(rng: np.random.Generator, theta: float, e: int = 3,
                      b: int = 3, n: int = 12) -> tuple[float, float]:
  """(||w*||^2, Theorem 1's right side) for one draw.

  U_i = coordinate block i of R^{e b}; expert i's data X_i `[n, D]` spans
  block i tilted by theta; y_i = X_i beta_i + 0.1 noise.
  """
  d = e * b
  xs, ys, us = [], [], []
  for i in range(e):
    u = np.eye(d)[:, i * b:(i + 1) * b]
    v = np.linalg.qr(u + theta * rng.standard_normal((d, b)))[0]
    x = rng.standard_normal((n, b)) @ v.T
    xs.append(x), us.append(u)
    ys.append(x @ rng.standard_normal(d) + 0.1 * rng.standard_normal(n))
  x, y = np.concatenate(xs), np.concatenate(ys)
  z_pinv = np.linalg.pinv(x.T @ x)
  zi_pinv = [np.linalg.pinv(xi.T @ xi) for xi in xs]
  w = z_pinv @ x.T @ y
  xty = [xi.T @ yi for xi, yi in zip(xs, ys)]
  eps1 = max(np.linalg.norm(u @ u.T @ z_pinv - zp, 2)
             for u, zp in zip(us, zi_pinv))
  eps2 = max(np.linalg.norm(zi_pinv[i] @ xty[j]) / np.linalg.norm(xty[j])
             for i in range(e) for j in range(e) if i != j)
  rhs = sum(max(0.0, np.linalg.norm(zi_pinv[i] @ xty[i])
                - eps1 * np.linalg.norm(x.T @ y)
                - eps2 * sum(np.linalg.norm(xty[j]) for j in range(e)
                             if j != i)) ** 2 for i in range(e))
  return float(w @ w), float(rhs)


def theorem2_quantities(xs: Sequence[np.ndarray], betas: Sequence[np.ndarray],
                        rs: Sequence[np.ndarray]) -> tuple[float, float, float]:
  """(gamma*, max_i ||w_i*||^2 / ||w*||^2, error of the proof's identity).

  xs[i] `[N_i, D]`, betas[i] `[D]`, rs[i] `[N_i]`: y_i = X_i beta_i + r_i.
  gamma* = max_i (||beta_i + eta_i|| / (||Delta_i|| - ||beta_i + eta||))^2
  is the least gamma meeting Theorem 2's condition (inf: none does).
  """
  e = len(xs)
  zs = [x.T @ x for x in xs]
  z = sum(zs)
  ys = [x @ bt + r for x, bt, r in zip(xs, betas, rs)]
  w_i = [np.linalg.solve(zi, x.T @ y) for zi, x, y in zip(zs, xs, ys)]
  w = np.linalg.lstsq(np.concatenate(xs), np.concatenate(ys), rcond=None)[0]
  eta = np.linalg.solve(z, sum(x.T @ r for x, r in zip(xs, rs)))
  eta_i = [np.linalg.solve(zi, x.T @ r) for zi, x, r in zip(zs, xs, rs)]
  gamma, err = 0.0, 0.0
  for i in range(e):
    delta = sum(np.linalg.solve(z, zs[j] @ (betas[i] - betas[j]))
                for j in range(e) if j != i)
    err = max(err, np.abs(w - (w_i[i] - delta + eta - eta_i[i])).max())
    gap = np.linalg.norm(delta) - np.linalg.norm(betas[i] + eta)
    gamma = max(gamma, (np.linalg.norm(betas[i] + eta_i[i]) / gap) ** 2
                if gap > 0 else np.inf)
  return float(gamma), float(max(v @ v for v in w_i) / (w @ w)), float(err)


def theorem2_instance(rng: np.random.Generator, t: float = 0.1, e: int = 3,
                      d: int = 4, n: int = 20) -> tuple[float, float, float]:
  """`theorem2_quantities` of one draw: expert i's data is strong along a_i
  (a common direction tilted by t), weak (0.1) elsewhere; r_i ~ 0.01 N(0, I).
  """
  base = rng.standard_normal(d)
  xs, betas, rs = [], [], []
  for _ in range(e):
    a = base / np.linalg.norm(base) + t * rng.standard_normal(d)
    xs.append(np.outer(rng.standard_normal(n), a / np.linalg.norm(a))
              + 0.1 * rng.standard_normal((n, d)))
    betas.append(rng.standard_normal(d))
    rs.append(0.01 * rng.standard_normal(n))
  return theorem2_quantities(xs, betas, rs)



def theorem_checks(rng: np.random.Generator) -> dict[str, float]:
  """The "theorems" section of one seed: 50 Theorem 1 draws per tilt
  (0, 0.01, 0.03, 0.1), then 400 Theorem 2 draws, all from `rng`."""
  thm1 = {th: [theorem1_instance(rng, th) for _ in range(50)]
          for th in (0.0, 0.01, 0.03, 0.1)}
  thm2 = np.array([theorem2_instance(rng) for _ in range(400)])
  holds = thm2[:, 0] <= 1
  return {
      "t1_max_rhs_over_lhs": max(r / l for v in thm1.values() for l, r in v),
      **{f"t1_nonvacuous_theta_{th}": float(np.mean([r > 0 for _, r in v]))
         for th, v in thm1.items()},
      "t2_max_ratio_over_gamma": float(np.max(
          thm2[holds, 1] / thm2[holds, 0], initial=0.0)),
      "t2_condition_holds": int(holds.sum()),
      "t2_identity_error": float(thm2[:, 2].max()),
      "t2_share_expert_norm_larger": float(np.mean(thm2[~holds, 1] > 1))}
