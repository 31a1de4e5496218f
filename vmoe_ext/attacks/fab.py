"""FAB-T: the targeted Fast Adaptive Boundary attack (Croce & Hein, ICML 2020,
"Minimally distorted adversarial examples with a fast adaptive boundary
attack"), Linf and L2, as AutoAttack's standard version runs it ("fab-t").

FAB looks for the misclassified point closest to the clean image `x0` in the
attack's norm. For each target class `t` in turn (ranks 2, ...,
`target_classes + 1` of the clean logits: the batch with the done examples
at their points, the others at `x0`) and each restart, from
`x^(0) = x0` (restart `r > 0`: `x0 + (eps / 2) u / ||u||` clipped to the
range, `u ~ U[-1, 1]^D` for Linf, `N(0, I)` for L2), every step, with
`g = f_t - f_y` (`f` the logits, `y` the label):

1. linearise `g` at the iterate `x`: the hyperplane
   `pi = {z : grad g(x).z = grad g(x).x - g(x)}`;
2. project the iterate and the clean image onto `pi` within the box
   `[clip_min, clip_max]^D` (`fab_projection`: the minimal-norm `d` with
   `t + d` on `pi` and in the box): `d1 = P(x) - x`, `d2 = P(x0) - x0`;
3. the biased step with overshoot `eta`, norms floored at 1e-8:

       alpha = min(max(||d1|| / (||d1|| + ||d2||), 0), alpha_max)
       x <- clip((1 - alpha) (x + eta d1) + alpha (x0 + eta d2))

4. if `x` is misclassified (`argmax f(x) != y`, ties to the lower class), it
   becomes the run's best point when closer to `x0` than the best so far,
   and the backward step `x <- x0 + beta (x - x0)` follows.

After a run, its best point breaks an example when it is misclassified (the
batch evaluated again with the runs' best points) and within `eps` of `x0`;
the next runs attack only the examples not yet broken (as
fra31/auto-attack's `FABAttack.perturb`: target classes outer, restarts
inner). An example misclassified
at `x0` is broken at distance 0 before any run.

Batching: every `logits_fn` call is on the whole `[B, ...]` batch; examples
not attacked by a run (done, or already broken) sit at their current points
(`x_start`, or their adversarial point); images `[B, H, W, C]` (any
`[B, ...]`) are flattened per example. Per step: one forward and backward
pass (the gradient of `sum_b g_b` over the attacked examples, via `vjp`) and
one forward pass; plus one pass on the clean batch and one per run. All
loops are `lax` loops in one `jit`.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import jax
import jax.numpy as jnp

from vmoe_ext.attacks import base
from vmoe_ext.attacks.fab_projection import project_onto_hyperplane
from vmoe_ext.errors import ConfigError, require

Array = jax.Array
NORM_FLOOR = 1e-8  # Floor of ||d1||, ||d2|| in alpha (as the reference).
START_RADIUS = 0.5  # Random starts at eps / 2 from x0 (as the reference).


def _flat(x: Array) -> Array:
  return x.reshape(x.shape[0], -1).astype(jnp.float32)


def distance(x: Array, x0: Array, norm: str) -> Array:
  """`[B]` float32 `norm` distance between each `x[b]` and `x0[b]`."""
  return base.per_example_norm(_flat(x) - _flat(x0), norm)[:, 0]


def fab_step(x: Array, x0: Array, g: Array, grad: Array, *, norm: str,
             alpha_max: Any, eta: Any, clip_min: Any, clip_max: Any) -> Array:
  """Steps 1-3 of the module docstring: the next iterate, float32.

  Args:
    x: `[B, ...]` iterates (in the box).
    x0: `[B, ...]` clean images (in the box).
    g: `[B]` `f_t(x) - f_y(x)`.
    grad: `[B, ...]` its gradient at `x`.
    norm, alpha_max, eta, clip_min, clip_max: see `fab`.

  Returns:
    `[B, ...]` float32, before the adversarial check and backward step.
  """
  n = x.shape[0]
  w, xf, x0f = _flat(grad), _flat(x), _flat(x0)
  offset = jnp.sum(w * xf, axis=-1) - g.astype(jnp.float32)
  d = project_onto_hyperplane(
      jnp.concatenate([xf, x0f]), jnp.concatenate([w, w]),
      jnp.concatenate([offset, offset]), clip_min, clip_max, norm)
  lengths = jnp.maximum(base.per_example_norm(d, norm), NORM_FLOOR)  # [2N, 1]
  a1, a2 = lengths[:n], lengths[n:]
  alpha = jnp.clip(a1 / (a1 + a2), 0.0, alpha_max)
  new = ((xf + eta * d[:n]) * (1.0 - alpha)
         + (x0f + eta * d[n:]) * alpha)
  return jnp.clip(new, clip_min, clip_max).reshape(x.shape)


def start_point(key: Array, x0: Array, eps: Any, norm: str, clip_min: Any,
                clip_max: Any) -> Array:
  """A restart's first iterate: `x0 + (eps / 2) u / ||u||`, clipped."""
  if norm == "linf":
    u = jax.random.uniform(key, x0.shape, jnp.float32, -1.0, 1.0)
  else:
    u = jax.random.normal(key, x0.shape, jnp.float32)
  u = u / jnp.maximum(base.per_example_norm(u, norm), base.NORM_FLOOR)
  x = x0.astype(jnp.float32) + START_RADIUS * eps * u
  return jnp.clip(x, clip_min, clip_max).astype(x0.dtype)


def _single_run(logits_fn, x0, labels, targets, x_init, x_cur, active,
                clip_min, clip_max, *, num_classes, norm, steps, alpha_max,
                eta, beta):
  """`steps` FAB steps towards `targets [B]` on the `active` examples.

  Returns `(x_best [B, ...], d_best [B])`: the run's closest misclassified
  iterate (`x_cur` and inf where none).
  """
  cot = (jax.nn.one_hot(targets, num_classes)
         - jax.nn.one_hot(labels, num_classes))
  cot = cot * active[:, None]  # d(f_t - f_y) of the attacked examples only.
  x0f = x0.astype(jnp.float32)

  def step(_, state):
    x, x_best, d_best = state
    logits, pullback = jax.vjp(logits_fn, x)
    (grad,) = pullback(cot.astype(logits.dtype))
    g = jnp.sum(logits.astype(jnp.float32) * cot, axis=-1)
    new = fab_step(x, x0, g, grad, norm=norm, alpha_max=alpha_max, eta=eta,
                   clip_min=clip_min, clip_max=clip_max)
    x = base.where_examples(active, new.astype(x.dtype), x)
    adv = active & base.misclassified(logits_fn(x), labels)
    dist = distance(x, x0, norm)
    better = adv & (dist < d_best)
    x_best = base.where_examples(better, x, x_best)
    d_best = jnp.where(better, dist, d_best)
    back = (x0f + beta * (x.astype(jnp.float32) - x0f)).astype(x.dtype)
    return base.where_examples(adv, back, x), x_best, d_best

  init = (base.where_examples(active, x_init, x_cur), x_cur,
          jnp.full(active.shape, jnp.inf, jnp.float32))
  _, x_best, d_best = jax.lax.fori_loop(0, steps, step, init)
  return x_best, d_best


def fab_run(logits_fn: base.LogitsFn, x0: Array, labels: Array,
            key: Optional[Array], x_start: Array, done: Array, eps: Any,
            clip_min: Any, clip_max: Any, *, norm: str, steps: Any,
            target_classes: int, restarts: int, alpha_max: Any, eta: Any,
            beta: Any) -> tuple[Array, dict[str, Array]]:
  """FAB-T on the examples not `done` (the AutoAttack ensemble's interface).

  Traceable (call it inside a `jit`); `norm`, `target_classes` and
  `restarts` are static, the other arguments may be traced.

  Args:
    logits_fn: `x [B, ...] -> logits [B, C]`, deterministic (see `base`).
    x0: `[B, ...]` clean images in `[clip_min, clip_max]`.
    labels: `[B]` int true labels.
    key: PRNG key of the random starts (unused, may be None, if
      `restarts == 1`).
    x_start: `[B, ...]` the batch's current points.
    done: `[B]` bool: examples broken earlier: never modified, they sit at
      `x_start` in every `logits_fn` call.
    eps, clip_min, clip_max, norm, steps, target_classes, restarts,
    alpha_max, eta, beta: see `fab`.

  Returns:
    `(x_out [B, ...], info)`: `x_out` is, for the examples broken here
    (misclassified within `eps` of `x0`), the closest misclassified point
    found, and `x_start` for all others. `info["distance"] [B]` float32: the
    distance to `x0` of the broken examples' points, else that of the closest
    misclassified point found (inf if none; done examples: inf);
    `info["broken"] [B]` bool: the examples broken here.

  Raises:
    ConfigError("attack.target_classes") unless `target_classes` < the
    number of classes (while tracing, before the loops).
  """
  b = x0.shape[0]
  x_start = x_start.astype(x0.dtype)
  x_cur = base.where_examples(done, x_start, x0)
  clean = logits_fn(x_cur)
  num_classes = clean.shape[-1]
  if target_classes >= num_classes:
    raise ConfigError("attack.target_classes",
                      f"must be < the number of classes ({num_classes}), "
                      f"got {target_classes}")
  targets = jnp.stack([base.top_targets(clean, rank)
                       for rank in range(2, target_classes + 2)])  # [T, B]
  broken = ~done & base.misclassified(clean, labels)
  runs = target_classes * restarts

  def run(carry):
    i, x_cur, broken, d_min = carry
    active = ~done & ~broken
    x_init = x0
    if restarts > 1:
      x_rand = start_point(jax.random.fold_in(key, i), x0, eps, norm,
                           clip_min, clip_max)
      x_init = jnp.where(i % restarts > 0, x_rand, x0)
    x_best, d_best = _single_run(
        logits_fn, x0, labels, targets[i // restarts], x_init, x_cur, active,
        clip_min, clip_max, num_classes=num_classes, norm=norm, steps=steps,
        alpha_max=alpha_max, eta=eta, beta=beta)
    found = active & (d_best <= eps)
    candidates = base.where_examples(found, x_best, x_cur)
    newly = found & base.misclassified(logits_fn(candidates), labels)
    x_cur = base.where_examples(newly, x_best, x_cur)
    d_min = jnp.where(active, jnp.minimum(d_min, d_best), d_min)
    return i + 1, x_cur, broken | newly, d_min

  def cond(carry):
    i, _, broken, _ = carry
    return (i < runs) & jnp.any(~done & ~broken)

  init = (jnp.zeros((), jnp.int32), x_cur, broken,
          jnp.full((b,), jnp.inf, jnp.float32))
  _, x_cur, broken, d_min = jax.lax.while_loop(cond, run, init)
  x_out = base.where_examples(broken, x_cur, x_start)
  dist = jnp.where(broken, distance(x_cur, x0, norm), d_min)
  return x_out, dict(distance=dist, broken=broken)


def fab(logits_fn: base.LogitsFn, x: Array, labels: Array, *, eps: float,
        key: Optional[Array] = None, norm: str = "linf", steps: int = 100,
        target_classes: int = 9, restarts: int = 1, alpha_max: float = 0.1,
        eta: float = 1.05, beta: float = 0.9, clip_min: float = 0.0,
        clip_max: float = 1.0) -> Array:
  """FAB-T (Linf or L2); returns `x_adv [B, ...]` (shape and dtype of `x`).

  Examples misclassified at `x` are returned unchanged; the others are
  returned at the closest misclassified point found if it lies within `eps`
  of `x`, else unchanged (FAB minimises the distance; `eps` only decides
  what counts as broken, and the radius of random starts).

  Args:
    logits_fn: `x [B, ...] -> logits [B, C]`, deterministic (see `base`).
    x: `[B, ...]` clean images in `[clip_min, clip_max]`.
    labels: `[B]` int true labels.
    eps: radius (>= 0) in the units of `x`.
    key: PRNG key (required if `restarts > 1`).
    norm: "linf" or "l2".
    steps: FAB steps per run (>= 1).
    target_classes: target classes, ranks 2.. of the clean logits (>= 1,
      < the number of classes).
    restarts: runs per target class (>= 1); runs after the first start from
      random points at distance `eps / 2`.
    alpha_max: the largest weight of the step from `x0`, in [0, 1].
    eta: overshoot (>= 1).
    beta: backward step factor, in (0, 1].
    clip_min, clip_max: the valid range of the images.

  Raises:
    ConfigError: invalid argument; the message names the field ("attack.eps").
  """
  check_fab(eps=eps, norm=norm, steps=steps, target_classes=target_classes,
            restarts=restarts, alpha_max=alpha_max, eta=eta, beta=beta,
            clip_min=clip_min, clip_max=clip_max)
  base.check_inputs(x, labels)
  base.check_key(key, restarts > 1, "(restarts > 1 start from random points)")
  static = dict(norm=norm, target_classes=target_classes, restarts=restarts)
  return base.run_jitted(_fab, logits_fn, static, x, labels, key, eps,
                         clip_min, clip_max, steps, alpha_max, eta, beta)


def _fab(logits_fn, x, labels, key, eps, clip_min, clip_max, steps,
         alpha_max, eta, beta, **static):
  done = base.misclassified(logits_fn(x), labels)
  return fab_run(logits_fn, x, labels, key, x, done, eps, clip_min, clip_max,
                 steps=steps, alpha_max=alpha_max, eta=eta, beta=beta,
                 **static)[0]


def _check_between(value: Any, field: str, lo: float, hi: float, *,
                   open_lo: bool = False) -> None:
  """`value` must be a finite real scalar in `[lo, hi]` (`(lo, hi]` with
  `open_lo`; unchecked when traced)."""
  if not base.is_concrete(value):
    return
  try:
    scalar = not isinstance(value, (bool, str)) and jnp.ndim(value) == 0
    number = float(value) if scalar else math.nan
  except (TypeError, ValueError):
    number = math.nan
  above = number > lo if open_lo else number >= lo
  bounds = (f">= {lo}" if math.isinf(hi) else
            f"in {'(' if open_lo else '['}{lo}, {hi}]")
  require(math.isfinite(number) and above and number <= hi, field,
          f"must be a finite number {bounds}, got {value!r}")


def check_fab(*, eps, norm, steps, target_classes, restarts, alpha_max, eta,
              beta, clip_min, clip_max) -> None:
  """`fab`'s config check (the attack contract, `attacks.registry`): every
  config field, keyword-only; ConfigError naming "attack.<field>".
  (`target_classes < the number of classes` is checked at call time.)"""
  base.check_eps(eps)
  require(norm in base.NORMS, "attack.norm",
          f"must be one of {base.NORMS}, got {norm!r}")
  base.check_int(steps, "attack.steps", 1)
  base.check_int(target_classes, "attack.target_classes", 1)
  base.check_int(restarts, "attack.restarts", 1)
  _check_between(alpha_max, "attack.alpha_max", 0.0, 1.0)
  _check_between(eta, "attack.eta", 1.0, math.inf)
  _check_between(beta, "attack.beta", 0.0, 1.0, open_lo=True)
  base.check_range(clip_min, clip_max)


__all__ = ["check_fab", "distance", "fab", "fab_run", "fab_step",
           "start_point"]
