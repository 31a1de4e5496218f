"""Projected gradient descent (Madry et al. 2018), Linf and L2
(docs/robustness.md, "Attacks").

One PGD step on the objective `J(x) = mean_b CE(logits_fn(x)[b], labels[b])`
(targeted: `J = -mean_b CE(., targets)`, i.e. CE to the targets is minimised;
with `include_auxiliary_loss=True`, `J + mean(aux(x))`, the model's auxiliary
loss ascended in both cases, as vmoe's `attack_auxiliary_loss`, see `base`):

    x <- clip_range(proj_eps(x + step_size * dir(grad_x J)))

with `dir = sign` (Linf) or `g / ||g||_2` per example (L2), `proj_eps` the
projection onto the eps-ball around the clean `x0` and `clip_range` the clip to
`[clip_min, clip_max]` — the update rule of foolbox 3's `LinfPGD` / `L2PGD`,
which the tests use as the oracle. The mean (not sum) over the batch does not
change the direction of any example's step.

All `steps` iterations run in one `lax.fori_loop` (restarts in one `lax.scan`)
inside one `jit`; each iteration costs one forward and one backward pass of
`logits_fn` on the `[B, ...]` batch and nothing else of note.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import jax
import jax.numpy as jnp

from vmoe_ext.attacks import base
from vmoe_ext.errors import require

Array = jax.Array
# Default step size, in units of eps / steps (Madry et al.'s 2.5 * eps / steps:
# enough to cross the ball and bounce back while the loss keeps rising).
DEFAULT_STEP_FACTOR = 2.5


def objective(logits_fn: base.LogitsFn, x: Array, labels: Array,
              targeted: bool, include_auxiliary_loss: bool = False) -> Array:
  """Scalar `J(x)` the attack ascends: mean CE (targeted: minus mean CE),
  plus the mean auxiliary loss with `include_auxiliary_loss`."""
  logits, aux = base.split_output(logits_fn(x), include_auxiliary_loss)
  loss = jnp.mean(base.cross_entropy(logits, labels))
  loss = -loss if targeted else loss
  return loss if aux is None else loss + aux


def ascent_step(logits_fn: base.LogitsFn, x: Array, x0: Array, labels: Array,
                *, step_size: Any, eps: Any, norm: str, targeted: bool,
                clip_range: Optional[tuple[Any, Any]],
                include_auxiliary_loss: bool = False) -> Array:
  """One projected steepest-ascent step from `x` (ball around `x0`)."""
  grad = jax.grad(objective, argnums=1)(logits_fn, x, labels, targeted,
                                        include_auxiliary_loss)
  x = x + step_size * base.normalize_gradient(grad, norm).astype(x.dtype)
  x = base.project(x, x0, eps, norm)
  if clip_range is not None:
    x = jnp.clip(x, *clip_range)
  return x.astype(x0.dtype)


def pgd(logits_fn: base.LogitsFn, x: Array, labels: Array, *, eps: float,
        steps: int, step_size: Optional[float] = None, norm: str = "linf",
        random_start: bool = True, restarts: int = 1, targeted: bool = False,
        key: Optional[Array] = None, clip_min: float = 0.0,
        clip_max: float = 1.0, vmoe_compatible: bool = False,
        include_auxiliary_loss: bool = False) -> Array:
  """PGD attack; returns `x_adv [B, ...]` (same shape and dtype as `x`).

  Args:
    logits_fn: `x [B, ...] -> logits [B, C]`, deterministic (see `base`);
      `-> (logits, auxiliary_loss)` with `include_auxiliary_loss`.
    x: `[B, ...]` clean images in `[clip_min, clip_max]`.
    labels: `[B]` int true labels (targeted: target labels).
    eps: radius of the Linf / L2 ball, in the units of `x`; >= 0.
    steps: number of gradient steps, >= 0. `steps=0` is allowed and returns
      the starting point: `x` itself without random start, else the (range
      clipped) random start(s).
    step_size: per-step move (Linf: per pixel; L2: per example norm); default
      `2.5 * eps / steps`.
    norm: "linf" or "l2".
    random_start: start from a uniform point of the eps-ball (clipped to the
      range) instead of `x`. Needs `key`.
    restarts: number of independent random starts (only meaningful with
      `random_start`; without it every restart would be identical, so one run
      is made). Per example the result is the first restart that succeeds
      (misclassified, or classified as the target), else the restart with the
      highest objective (CE; targeted: lowest CE to the target). Selecting costs
      one extra forward pass per restart when `restarts > 1`.
    targeted: minimise CE to `labels` instead of maximising it.
    key: PRNG key for the random starts.
    clip_min, clip_max: the valid range of the images.
    vmoe_compatible: reproduce google-research/vmoe's PGD: step `eps / steps`,
      no random start, no clip to the valid range (the eps projection is kept;
      with that step it is a no-op up to float rounding). `step_size` must be
      None; `random_start` and `restarts` are ignored.
    include_auxiliary_loss: ascend `J + mean(auxiliary_loss)` (vmoe's
      `attack_auxiliary_loss`; combine with `vmoe_compatible` to reproduce
      its attack). Restarts are still ranked by per-example CE (the
      auxiliary loss is a batch-level term).

  Raises:
    ConfigError: invalid argument; the message names the field ("attack.eps").
  """
  check_pgd(eps=eps, steps=steps, step_size=step_size, norm=norm,
            random_start=random_start, restarts=restarts, targeted=targeted,
            clip_min=clip_min, clip_max=clip_max,
            vmoe_compatible=vmoe_compatible,
            include_auxiliary_loss=include_auxiliary_loss)
  base.check_inputs(x, labels)
  if vmoe_compatible:
    step = eps / steps if steps else 0.0
    use_random, restarts, clip = False, 1, False
  else:
    step = (step_size if step_size is not None else
            DEFAULT_STEP_FACTOR * eps / steps if steps else 0.0)
    use_random, clip = bool(random_start), True
    restarts = restarts if use_random else 1
  base.check_key(key, use_random, "for random_start=True")
  static = dict(steps=steps, norm=norm, use_random=use_random,
                restarts=restarts, targeted=bool(targeted), clip=clip,
                aux=include_auxiliary_loss)
  return base.run_jitted(_pgd, logits_fn, static, x, labels, key, eps, step,
                         clip_min, clip_max)


def check_pgd(*, eps, steps, step_size, norm, random_start, restarts,
              targeted, clip_min, clip_max, vmoe_compatible,
              include_auxiliary_loss) -> None:
  """`pgd`'s config check (the attack contract, `attacks.registry`): every
  config field, keyword-only; ConfigError naming "attack.<field>"."""
  del random_start, targeted  # Any truth value.
  base.check_eps(eps)
  base.check_bool(include_auxiliary_loss, "attack.include_auxiliary_loss")
  base.check_int(steps, "attack.steps", 0)
  require(norm in base.NORMS, "attack.norm",
          f"must be one of {base.NORMS}, got {norm!r}")
  base.check_int(restarts, "attack.restarts", 1)
  base.check_range(clip_min, clip_max)
  if step_size is not None:
    require(not vmoe_compatible, "attack.step_size",
            "must be None with vmoe_compatible=True (the step is eps/steps)")
    base.check_positive(step_size, "attack.step_size")


def _pgd(logits_fn, x0, labels, key, eps, step, clip_min, clip_max, *, steps,
         norm, use_random, restarts, targeted, clip, aux):
  clip_range = (clip_min, clip_max) if clip else None

  def run(start):
    step_fn = functools.partial(
        ascent_step, logits_fn, x0=x0, labels=labels, step_size=step, eps=eps,
        norm=norm, targeted=targeted, clip_range=clip_range,
        include_auxiliary_loss=aux)
    return jax.lax.fori_loop(0, steps, lambda _, x: step_fn(x), start)

  def start_from(k):
    if not use_random:
      return x0
    x = base.random_start(k, x0, eps, norm)
    return jnp.clip(x, clip_min, clip_max).astype(x0.dtype)

  if restarts == 1:
    return run(start_from(key))

  def restart(best, k):
    best_x, best_obj, best_success = best
    x = run(start_from(k))
    logits, _ = base.split_output(logits_fn(x), aux)
    obj = base.cross_entropy(logits, labels)
    obj = -obj if targeted else obj
    success = base.is_success(logits, labels, targeted)
    take = ~best_success & (success | (obj > best_obj))
    mask = take.reshape((-1,) + (1,) * (x.ndim - 1))
    return (jnp.where(mask, x, best_x), jnp.where(take, obj, best_obj),
            best_success | success), None

  b = x0.shape[0]
  init = (x0, jnp.full((b,), -jnp.inf, jnp.float32), jnp.zeros((b,), bool))
  (x_adv, _, _), _ = jax.lax.scan(restart, init,
                                  jax.random.split(key, restarts))
  return x_adv
