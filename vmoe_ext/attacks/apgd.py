"""Auto-PGD (Croce & Hein, ICML 2020, Algorithm 1): APGD-CE, APGD-DLR and
APGD-T, Linf and L2 (docs/robustness.md, "AutoAttack").

Per example, from a random start `x^(0)` (Linf: `x + eps * t / max|t|`,
`t ~ U[-1, 1]^D`; L2: `x + eps * t / ||t||_2`, `t ~ N(0, I)`; clipped to the
range), with the step size `eta^(0) = 2 eps`, momentum `alpha = 0.75` and
`P` the projection onto the eps-ball then the range:

    z^(k+1) = P(x^(k) + eta^(k) * dir(grad f(x^(k))))          dir: sign | g / ||g||_2
    x^(k+1) = P(x^(k) + alpha (z^(k+1) - x^(k)) + (1 - alpha)(x^(k) - x^(k-1)))

(`x^(1) = z^(1)`: no momentum on the first step), keeping the best point
`x_max` (highest loss `f_max`). At the checkpoints `w_j = ceil(p_j N)`,
`p_0 = 0`, `p_1 = 0.22`, `p_{j+1} = p_j + max(p_j - p_{j-1} - 0.03, 0.06)`,
the step size is halved and the iterate restarted from `x_max` when

1. fewer than `rho (w_j - w_{j-1})` steps since the last checkpoint increased
   the loss (`rho = 0.75`), or
2. neither the step size nor `f_max` changed since the last checkpoint.

Losses (`loss`): "ce" (cross-entropy), "dlr" (untargeted difference of logits
ratio), "dlr-targeted" (APGD-T: the DLR-targeted loss towards each of the
`target_classes` classes ranked 2, 3, ... by the clean logits, in turn, each
run on the examples still robust). Restarts run on the examples still
robust, each from a new random start. An example is frozen at its first
misclassified iterate (early stop) and the loop stops once every example is
misclassified. With `eot_iter > 1` the gradient is the mean over `eot_iter`
stochastic forward passes (`logits_fn(x, key=k)`: router noise and dropout,
see `Evaluator`), AutoAttack's "rand" version.

`schedule`: "paper" is Algorithm 1 above (the check at iteration `k = w_j`,
after `x^(k+1)` is computed, counts the increases up to `x^(w_j)`, and after a
restart the next increase is counted against `f_max`). "autoattack" is the
authors' released code (fra31/auto-attack, `APGDAttack`), whose numbers
RobustBench reports: checkpoint intervals `k_0 = max(int(0.22 N), 1)`, then
`k_{j+1} = max(k_j - max(int(0.03 N), 1), max(int(0.06 N), 1))`; the check
after `x^(w_j)` restarts `x^(w_j)` itself; condition 1 with `<=`; condition 2
off at the first checkpoint; the first increase counted against 0 (not
`f(x^(0))`), and increases always against the pre-restart loss. For N = 100
both check at iterations 22, 41, 57, 70, 80, 87, 93, 99.

Every `logits_fn` call is on the whole `[B, ...]` batch (done examples sit at
their points): one forward and one backward pass per iteration (times
`eot_iter`), all iterations in one `lax.scan` inside one `jit`.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp

from vmoe_ext.attacks import base
from vmoe_ext.errors import ConfigError, require

Array = jax.Array
LOSSES = ("ce", "dlr", "dlr-targeted")
SCHEDULES = ("paper", "autoattack")
STEP_FACTOR = 2.0  # eta^(0) = 2 eps.
MOMENTUM = 0.75


# -- The checkpoints ----------------------------------------------------------


def checkpoints(steps: int, schedule: str) -> list[tuple[int, int]]:
  """`[(k, length)]`: the loop iterations `k` (0-based; iteration `k`
  computes `x^(k+1)`) after which the step size is checked, and the number of
  steps the check counts increases over."""
  out = []
  if schedule == "paper":
    # p_j in hundredths, integer arithmetic: w_j = ceil(p_j N / 100).
    prev_p, p, prev_w = 0, 22, 0
    while True:
      w = -(-p * steps // 100)
      if w > steps - 1:
        return out
      if w > prev_w:
        out.append((w, w - prev_w))
        prev_w = w
      prev_p, p = p, p + max(p - prev_p - 3, 6)
  k = max(int(0.22 * steps), 1)
  decrease, minimum = max(int(0.03 * steps), 1), max(int(0.06 * steps), 1)
  i = k - 1
  while i <= steps - 1:
    out.append((i, k))
    k = max(k - decrease, minimum)
    i += k
  return out


# -- One run --------------------------------------------------------------------


def start_point(key: Array, x0: Array, eps: Any, norm: str, clip_min: Any,
                clip_max: Any) -> Array:
  """AutoAttack's random start, clipped to the range (see the module
  docstring)."""
  if norm == "linf":
    t = jax.random.uniform(key, x0.shape, jnp.float32, -1.0, 1.0)
    t = t / (base.per_example_norm(t, "linf") + 1e-12)
  else:
    t = jax.random.normal(key, x0.shape, jnp.float32)
    t = t / (base.per_example_norm(t, "l2") + 1e-12)
  return jnp.clip(x0 + eps * t.astype(x0.dtype), clip_min, clip_max)


def _project(x: Array, x0: Array, eps: Any, norm: str, clip_min: Any,
             clip_max: Any) -> Array:
  """The eps-ball then the range, as AutoAttack (L2: `d / (||d|| + 1e-12) *
  min(eps, ||d||)`)."""
  if norm == "linf":
    x = jnp.clip(x, x0 - eps, x0 + eps)
  else:
    d = x - x0
    n = base.per_example_norm(d, "l2")
    x = x0 + d / (n + 1e-12) * jnp.minimum(eps, n)
  return jnp.clip(x, clip_min, clip_max)


def _direction(grad: Array, norm: str) -> Array:
  if norm == "linf":
    return jnp.sign(grad)
  return grad / (base.per_example_norm(grad, "l2") + 1e-12)


def loss_of(loss: str, logits: Array, labels: Array,
            targets: Optional[Array]) -> Array:
  """Per-example loss `[B]` APGD ascends."""
  if loss == "ce":
    return base.cross_entropy(logits, labels)
  if loss == "dlr":
    return base.dlr_loss(logits, labels)
  return base.dlr_targeted_loss(logits, labels, targets)


def _loss_and_grad(logits_fn, x, labels, targets, active, key, *, loss,
                   eot_iter):
  """`(logits, loss [B], grad [B, ...])`: the gradient of each active
  example's loss (mean over `eot_iter` stochastic passes; the logits and
  loss of the last pass, as AutoAttack)."""

  def one(k):
    def total(z):
      logits = logits_fn(z) if k is None else logits_fn(z, key=k)
      per = loss_of(loss, logits, labels, targets)
      return jnp.sum(jnp.where(active, per, 0.0)), (logits, per)
    (_, aux), g = jax.value_and_grad(total, has_aux=True)(x)
    return aux, g

  if eot_iter == 1:
    (logits, per), g = one(None)
    return logits, per, g
  keys = jax.random.split(key, eot_iter)
  (logits, per), g = one(keys[0])

  def body(acc, k):
    (lg, pr), gk = one(k)
    return (acc[0] + gk, lg, pr), None

  (g, logits, per), _ = jax.lax.scan(body, (g, logits, per), keys[1:])
  return logits, per, g / eot_iter


def single_run(logits_fn, x0, labels, targets, key, x_start, done, eps,
               clip_min, clip_max, *, norm, loss, steps, rho, eot_iter,
               schedule, record_iterates=False):
  """One APGD run from a random start on the examples not `done`.

  Args:
    x0: `[B, ...]` clean images (ball centres); `x_start [B, ...]` the
      batch's current points (done examples stay there); `done [B]` bool;
    targets: `[B]` target classes (loss "dlr-targeted"), else None.

  Returns:
    `(x_out [B, ...], broken [B], x_best [B, ...], loss_best [B], trace)`:
    `x_out` the first misclassified iterate of examples broken here and
    `x_start` elsewhere; `broken` the examples broken here (not `done`);
    `x_best`/`loss_best` the highest-loss iterate; `trace` per iteration
    `[steps + 1, B]`, entry k for the iterate `x^(k)`: `loss` (its loss as
    computed, before any restart), `loss_best`, `step` (the step size that
    computes `x^(k+1)`), `reset` (the iterate was replaced by `x_max` at a
    checkpoint), and `x [steps + 1, B, ...]` (after any restart) with
    `record_iterates`.
  """
  dtype = x0.dtype
  k_start, k_eot = jax.random.split(key)
  x = jnp.where(base.per_example(done, x0), x_start,
                start_point(k_start, x0, eps, norm, clip_min, clip_max))
  active = ~done
  logits, f, g = _loss_and_grad(logits_fn, x, labels, targets, active,
                                jax.random.fold_in(k_eot, 0), loss=loss,
                                eot_iter=eot_iter)
  broken0 = active & base.misclassified(logits, labels)
  b = x0.shape[0]
  step = jnp.full((b,), STEP_FACTOR, jnp.float32) * eps
  checks = checkpoints(steps, schedule)
  is_check = [False] * steps
  length = [0] * steps
  for k, n in checks:
    is_check[k], length[k] = True, n
  paper = schedule == "paper"
  state = dict(
      x=x, x_prev=x, g=g, f=f, x_best=x, g_best=g, f_best=f, step=step,
      frozen=done | broken0, broken=broken0,
      # Loss the next increase is counted against.
      f_prev=f if paper else jnp.full((b,), 0.0 if steps > 1 else jnp.inf),
      count=jnp.zeros((b,), jnp.int32),
      f_best_last=f, reduced_last=jnp.full((b,), not paper))

  def iteration(s, xs):
    k, check, n = xs
    frozen = s["frozen"]
    a = jnp.where(k == 0, 1.0, MOMENTUM).astype(dtype)
    proj = functools.partial(_project, x0=x0, eps=eps, norm=norm,
                             clip_min=clip_min, clip_max=clip_max)
    x, step = s["x"], base.per_example(s["step"], x0).astype(dtype)
    z = proj(x + step * _direction(s["g"], norm).astype(dtype))
    x_new = proj(x + a * (z - x) + (1 - a) * (x - s["x_prev"]))
    x_new = jnp.where(base.per_example(frozen, x0), x, x_new).astype(dtype)
    logits, f_new, g_new = _loss_and_grad(
        logits_fn, x_new, labels, targets, active,
        jax.random.fold_in(k_eot, k + 1), loss=loss, eot_iter=eot_iter)
    newly = ~frozen & base.misclassified(logits, labels)
    better = ~frozen & (f_new > s["f_best"])
    x_best = base.where_examples(better, x_new, s["x_best"])
    g_best = base.where_examples(better, g_new, s["g_best"])
    f_best = jnp.where(better, f_new, s["f_best"])
    increase = (f_new > s["f_prev"]).astype(jnp.int32)
    count = s["count"] if paper else s["count"] + increase

    # The checkpoint (a no-op elsewhere).
    if paper:
      cond1 = count < rho * n
    else:
      cond1 = count <= rho * n
    cond2 = ~s["reduced_last"] & (s["f_best_last"] >= f_best)
    reduce = check & ~frozen & ~newly & (cond1 | cond2)
    step_out = jnp.where(reduce, s["step"] / 2, s["step"])
    x_next = base.where_examples(reduce, x_best, x_new)
    g_next = base.where_examples(reduce, g_best, g_new)
    f_next = jnp.where(reduce, f_best, f_new)
    reduced_last = jnp.where(check, reduce, s["reduced_last"])
    f_best_last = jnp.where(check, f_best, s["f_best_last"])
    count = jnp.where(check, 0, count)
    if paper:  # The step k -> k+1 opens the next interval.
      count = count + (f_next > s["f"]).astype(jnp.int32)
    out = dict(x=x_next, x_prev=x, g=g_next, f=f_next, x_best=x_best,
               g_best=g_best, f_best=f_best, step=step_out,
               frozen=frozen | newly, broken=s["broken"] | newly,
               f_prev=f_next if paper else f_new, count=count,
               f_best_last=f_best_last, reduced_last=reduced_last)
    trace = dict(loss=f_new, loss_best=f_best, step=step_out, reset=reduce)
    if record_iterates:
      trace["x"] = x_next
    return out, trace

  def skip(s, xs):
    del xs
    trace = dict(loss=s["f"], loss_best=s["f_best"], step=s["step"],
                 reset=jnp.zeros((b,), bool))
    if record_iterates:
      trace["x"] = s["x"]
    return s, trace

  def body(s, xs):
    return jax.lax.cond(jnp.all(s["frozen"]), skip, iteration, s, xs)

  xs = (jnp.arange(steps), jnp.asarray(is_check, bool),
        jnp.asarray(length, jnp.float32))
  state, trace = jax.lax.scan(body, state, xs)
  head = dict(loss=f, loss_best=f, step=step, reset=jnp.zeros((b,), bool))
  if record_iterates:
    head["x"] = x
  trace = {name: jnp.concatenate([head[name][None], v])
           for name, v in trace.items()}
  x_out = base.where_examples(state["broken"], state["x"], x_start)
  return x_out, state["broken"], state["x_best"], state["f_best"], trace


# -- Restarts and target classes -------------------------------------------------


def apgd_run(logits_fn, x0, labels, key, x_start, done, eps, clip_min,
             clip_max, *, norm, loss, steps, restarts, target_classes, rho,
             eot_iter, schedule, record_iterates=False):
  """APGD on the examples not `done` (the AutoAttack ensemble's interface).

  Runs `restarts` runs (APGD-T: for each of the `target_classes` targets in
  turn, `restarts` runs), each on the examples still robust.

  Returns:
    `(x_out [B, ...], info)`: `x_out` is `x_start` for `done` examples, the
    first misclassified iterate for examples broken here, and the
    highest-loss point found for the others. `info`: `broken [B]`, `trace`
    of the runs, stacked `[runs, steps + 1, B]` (see `single_run`).
  """
  b = x0.shape[0]
  targets_of = None
  ranks = [None]
  if loss == "dlr-targeted":
    ctx = base.where_examples(done, x_start, x0)
    clean_logits = logits_fn(ctx) if eot_iter == 1 else logits_fn(
        ctx, key=jax.random.fold_in(key, -1))
    num_classes = clean_logits.shape[-1]
    require(target_classes < num_classes, "attack.target_classes",
            f"must be < the number of classes ({num_classes}), got "
            f"{target_classes}")
    ranks = list(range(2, target_classes + 2))
    targets_of = jnp.stack([base.top_targets(clean_logits, r) for r in ranks])
  runs = [(i, r) for i in range(len(ranks)) for r in range(restarts)]

  def body(carry, xs):
    x_cur, broken, x_best, f_best = carry
    index, target_index = xs
    targets = None if targets_of is None else targets_of[target_index]
    out, newly, xb, fb, trace = single_run(
        logits_fn, x0, labels, targets, jax.random.fold_in(key, index),
        x_cur, done | broken, eps, clip_min, clip_max, norm=norm, loss=loss,
        steps=steps, rho=rho, eot_iter=eot_iter, schedule=schedule,
        record_iterates=record_iterates)
    # Robust examples keep the highest-loss point over the runs (losses of
    # different targets are not comparable: the latest run's point wins).
    take = ~done & ~broken & ~newly & ((fb > f_best) | (targets is not None))
    x_best = base.where_examples(take, xb, x_best)
    f_best = jnp.where(take, fb, f_best)
    return (out, broken | newly, x_best, f_best), trace

  init = (x_start, jnp.zeros((b,), bool), x_start,
          jnp.full((b,), -jnp.inf, jnp.float32))
  xs = (jnp.arange(len(runs)), jnp.asarray([t for t, _ in runs]))
  (x_cur, broken, x_best, _), trace = jax.lax.scan(body, init, xs)
  robust = ~done & ~broken
  x_out = base.where_examples(robust, x_best, x_cur)
  return x_out, dict(broken=broken, trace=trace)


# -- The attack contract ---------------------------------------------------------


def apgd(logits_fn: base.LogitsFn, x: Array, labels: Array, *, eps: float,
         key: Optional[Array] = None, norm: str = "linf", loss: str = "ce",
         steps: int = 100, restarts: int = 1, target_classes: int = 9,
         rho: float = 0.75, eot_iter: int = 1, schedule: str = "paper",
         clip_min: float = 0.0, clip_max: float = 1.0) -> Array:
  """Auto-PGD; returns `x_adv [B, ...]` (same shape and dtype as `x`).

  Args:
    logits_fn: `x [B, ...] -> logits [B, C]`, deterministic (see `base`); with
      `eot_iter > 1` it must also take `key=` and then run stochastically
      (`Evaluator.logits_fn` does: training-mode router noise and dropout).
    x: `[B, ...]` clean images in `[clip_min, clip_max]`.
    labels: `[B]` int true labels.
    eps: radius of the Linf / L2 ball (>= 0), in the units of `x`.
    key: PRNG key (random starts; EOT samples). Required.
    norm: "linf" or "l2".
    loss: "ce" (APGD-CE), "dlr" (APGD-DLR) or "dlr-targeted" (APGD-T).
    steps: iterations per run (>= 1); AutoAttack uses 100.
    restarts: runs per target (>= 1), each on the examples still robust.
    target_classes: APGD-T's number of target classes (ranks 2, 3, ... of the
      clean logits); must be < the number of classes. Ignored otherwise.
    rho: condition 1's fraction of increasing steps, in (0, 1].
    eot_iter: gradient samples per iteration (>= 1; > 1: EOT over the
      model's noise).
    schedule: "paper" (Algorithm 1) or "autoattack" (the authors' code); see
      the module docstring.
    clip_min, clip_max: the valid range of the images.

  Examples misclassified at the clean image are returned unchanged; the others
  as the first misclassified iterate, else the highest-loss point found.

  Raises:
    ConfigError naming the field ("attack.loss").
  """
  return apgd_details(logits_fn, x, labels, eps=eps, key=key, norm=norm,
                      loss=loss, steps=steps, restarts=restarts,
                      target_classes=target_classes, rho=rho,
                      eot_iter=eot_iter, schedule=schedule,
                      clip_min=clip_min, clip_max=clip_max)[0]


def apgd_details(logits_fn: base.LogitsFn, x: Array, labels: Array, *,
                 eps: float, key: Optional[Array] = None, norm: str = "linf",
                 loss: str = "ce", steps: int = 100, restarts: int = 1,
                 target_classes: int = 9, rho: float = 0.75,
                 eot_iter: int = 1, schedule: str = "paper",
                 clip_min: float = 0.0, clip_max: float = 1.0
                 ) -> tuple[Array, dict[str, Array]]:
  """`apgd` with its loss trajectory: `(x_adv, {"apgd_loss/apgd": [B,
  steps + 1]})`, the best loss of the first run at each iteration (NaN for
  examples misclassified at the clean image, which are not attacked)."""
  check_apgd(eps=eps, norm=norm, loss=loss, steps=steps, restarts=restarts,
             target_classes=target_classes, rho=rho, eot_iter=eot_iter,
             schedule=schedule, clip_min=clip_min, clip_max=clip_max)
  base.check_inputs(x, labels)
  base.check_key(key, True, "(APGD starts from a random point)")
  static = dict(norm=norm, loss=loss, steps=steps, restarts=restarts,
                target_classes=target_classes, rho=rho, eot_iter=eot_iter,
                schedule=schedule)
  return base.run_jitted(_apgd_details, logits_fn, static, x, labels, key,
                         eps, clip_min, clip_max)


def _apgd_details(logits_fn, x, labels, key, eps, clip_min, clip_max,
                  **static):
  check_classes(static["loss"], logits_fn, x)
  done = base.misclassified(logits_fn(x), labels)
  x_adv, info = apgd_run(logits_fn, x, labels, key, x, done, eps, clip_min,
                         clip_max, **static)
  best = info["trace"]["loss_best"][0].T  # [B, steps + 1]
  return x_adv, {"apgd_loss/apgd": jnp.where(done[:, None], jnp.nan, best)}



def check_classes(loss: str, logits_fn: Callable[..., Any], x: Array
                  ) -> None:
  """The DLR losses need 3 (untargeted) / 4 (targeted) classes (static)."""
  if loss == "ce":
    return
  num_classes = jax.eval_shape(logits_fn, x).shape[-1]
  need = 3 if loss == "dlr" else 4
  if num_classes < need:
    raise ConfigError("attack.loss", f"{loss!r} needs >= {need} classes, "
                      f"the model has {num_classes}")


def check_apgd(*, eps, norm, loss, steps, restarts, target_classes, rho,
               eot_iter, schedule, clip_min, clip_max) -> None:
  """`apgd`'s config check (the attack contract, `attacks.registry`): every
  config field, keyword-only; ConfigError naming "attack.<field>"."""
  base.check_eps(eps)
  require(norm in base.NORMS, "attack.norm",
          f"must be one of {base.NORMS}, got {norm!r}")
  require(loss in LOSSES, "attack.loss",
          f"must be one of {LOSSES}, got {loss!r}")
  require(schedule in SCHEDULES, "attack.schedule",
          f"must be one of {SCHEDULES}, got {schedule!r}")
  base.check_int(steps, "attack.steps", 1)
  base.check_int(restarts, "attack.restarts", 1)
  base.check_int(target_classes, "attack.target_classes", 1)
  base.check_int(eot_iter, "attack.eot_iter", 1)
  base.check_positive(rho, "attack.rho")
  if base.is_concrete(rho):
    require(float(rho) <= 1.0, "attack.rho", f"must be <= 1, got {rho!r}")
  base.check_range(clip_min, clip_max)


__all__ = ["LOSSES", "SCHEDULES", "apgd", "apgd_details", "apgd_run",
           "check_apgd", "checkpoints", "single_run", "start_point"]
