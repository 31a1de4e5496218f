"""SPSA: gradient-free Linf attack (Uesato et al. 2018; docs/robustness.md,
"Attacks").

Each example minimises its margin loss
`f(x) = logit[y] - max_{j != y} logit[j]` (targeted: `max_{j != t} logit[j] -
logit[t]`); the attack has succeeded on an example once `f < 0`. Per step:

1. gradient estimate from `samples` mirrored Rademacher directions
   `v_i in {-1, +1}^D` (one per example and sample):
   `g = mean_i (f(x + delta v_i) - f(x - delta v_i)) / (2 delta) * v_i`
   over `i = 1..samples`
   (unbiased for the gradient of a quadratic, since `E[v v^T] = I`);
2. an Adam step (`learning_rate`, betas 0.9 / 0.999, eps 1e-8) down `g`;
3. projection onto the Linf eps-ball around the clean image, then clip to the
   valid range.

Batch semantics: perturbations, estimates and Adam moments are per example
and per pixel. Every model call is on one `[B, ...]` batch (never on
`samples * B` concatenated images, which would change MoE routing groups):
`sample_chunk` mirrored pairs are evaluated at once with `jax.vmap` over
`logits_fn` (each mapped call sees the plain `[B, ...]` batch; memory
`~ 2 * sample_chunk` forward passes), chunks run in a `lax.scan`, steps in a
`lax.while_loop`, all in one `jit`.

Early stop: with `early_stop=True` an example is frozen at the first iterate
where it succeeds (also at the clean image if it is already misclassified)
and the loop ends as soon as every example has succeeded (with capacity-
coupled MoE routing a frozen example's prediction can still change while the
other images of its group move). This costs one
forward pass per step (plus one on the clean batch) on top of the
`2 * samples` passes of the estimate.
"""

from __future__ import annotations

from typing import Any, Optional

import jax
import jax.numpy as jnp

from vmoe_ext.attacks import base
from vmoe_ext.errors import require

Array = jax.Array
ADAM_BETA1, ADAM_BETA2, ADAM_EPS = 0.9, 0.999, 1e-8
DEFAULT_SAMPLES = 64  # Mirrored pairs, i.e. 128 model evaluations per step.
MAX_DEFAULT_CHUNK = 8


def spsa_gradient(loss_fn, x: Array, key: Array, *, delta: Any, samples: int,
                  sample_chunk: Optional[int] = None) -> Array:
  """SPSA estimate `[B, ...]` of the gradient of each example's loss.

  Args:
    loss_fn: `x [B, ...] -> [B]` per-example losses.
    x: `[B, ...]` point of the estimate.
    key: PRNG key of the Rademacher directions.
    delta: finite-difference scale (> 0).
    samples: number of mirrored Rademacher directions per example.
    sample_chunk: directions evaluated per (vmapped) call; must divide
      `samples`; default: the largest divisor of `samples` <= 8.
  """
  chunk = default_chunk(samples) if sample_chunk is None else sample_chunk
  bcast = (slice(None), slice(None)) + (None,) * (x.ndim - 1)

  def body(acc, k):
    v = jax.random.rademacher(k, (chunk,) + x.shape, x.dtype)  # [c, B, ...]
    xs = jnp.concatenate([x[None] + delta * v, x[None] - delta * v])
    losses = jax.vmap(loss_fn)(xs).astype(jnp.float32)  # [2c, B]
    diff = (losses[:chunk] - losses[chunk:]) / (2.0 * delta)  # [c, B]
    return acc + jnp.sum(diff[bcast] * v, axis=0), None

  acc = jnp.zeros(x.shape, jnp.float32)
  acc, _ = jax.lax.scan(body, acc, jax.random.split(key, samples // chunk))
  return acc / samples


def default_chunk(samples: int) -> int:
  return max(d for d in range(1, min(samples, MAX_DEFAULT_CHUNK) + 1)
             if samples % d == 0)


def spsa_loss(logits: Array, labels: Array, targeted: bool) -> Array:
  """Per-example loss `[B]` SPSA minimises; `< 0` iff the attack succeeded."""
  margin = base.margin_loss(logits, labels)
  return -margin if targeted else margin


def spsa(logits_fn: base.LogitsFn, x: Array, labels: Array, *, eps: float,
         steps: int = 20, samples: int = DEFAULT_SAMPLES,
         delta: float = 0.01, learning_rate: float = 0.01,
         key: Optional[Array] = None, early_stop: bool = True,
         clip_min: float = 0.0, clip_max: float = 1.0,
         targeted: bool = False,
         sample_chunk: Optional[int] = None) -> Array:
  """SPSA (Linf); returns `x_adv [B, ...]` (same shape and dtype as `x`).

  Args:
    logits_fn: `x [B, ...] -> logits [B, C]`, deterministic (see `base`).
    x: `[B, ...]` clean images in `[clip_min, clip_max]`.
    labels: `[B]` int true labels (targeted: target labels).
    eps: Linf radius (>= 0) in the units of `x`.
    steps: Adam iterations (>= 1).
    samples: mirrored Rademacher directions per step (>= 1); each costs two
      model calls on the batch.
    delta: finite-difference scale (> 0).
    learning_rate: Adam step size (> 0).
    key: PRNG key (required).
    early_stop: freeze examples once they succeed; stop when all have.
    clip_min, clip_max: the valid range of the images.
    targeted: make `labels` the top class instead of leaving the true class.
    sample_chunk: directions evaluated per vmapped call (memory knob); must
      divide `samples`; default the largest divisor of `samples` <= 8.

  Raises:
    ConfigError: invalid argument; the message names the field ("attack.eps").
  """
  check_spsa(eps=eps, steps=steps, samples=samples, delta=delta,
             learning_rate=learning_rate, early_stop=early_stop,
             clip_min=clip_min, clip_max=clip_max, targeted=targeted,
             sample_chunk=sample_chunk)
  base.check_inputs(x, labels)
  base.check_key(key, True, "(SPSA samples random directions)")
  chunk = default_chunk(samples) if sample_chunk is None else sample_chunk
  static = dict(steps=steps, samples=samples, chunk=chunk,
                early_stop=bool(early_stop), targeted=bool(targeted))
  return base.run_jitted(_spsa, logits_fn, static, x, labels, key, eps, delta,
                         learning_rate, clip_min, clip_max)


def check_spsa(*, eps, steps, samples, delta, learning_rate, early_stop,
               clip_min, clip_max, targeted, sample_chunk) -> None:
  """`spsa`'s config check (the attack contract, `attacks.registry`): every
  config field, keyword-only; ConfigError naming "attack.<field>"."""
  del early_stop, targeted  # Any truth value.
  base.check_eps(eps)
  base.check_int(steps, "attack.steps", 1)
  base.check_int(samples, "attack.samples", 1)
  base.check_positive(delta, "attack.delta")
  base.check_positive(learning_rate, "attack.learning_rate")
  base.check_range(clip_min, clip_max)
  if sample_chunk is not None:
    base.check_int(sample_chunk, "attack.sample_chunk", 1)
    require(samples % sample_chunk == 0, "attack.sample_chunk",
            f"must divide samples={samples}, got {sample_chunk}")


def _spsa(logits_fn, x0, labels, key, eps, delta, lr, clip_min, clip_max, *,
          steps, samples, chunk, early_stop, targeted):
  loss_fn = lambda x: spsa_loss(logits_fn(x), labels, targeted)  # noqa: E731
  frozen_shape = (-1,) + (1,) * (x0.ndim - 1)

  def body(state):
    i, x, m, v, done = state
    g = spsa_gradient(loss_fn, x, jax.random.fold_in(key, i), delta=delta,
                      samples=samples, sample_chunk=chunk)
    m = ADAM_BETA1 * m + (1 - ADAM_BETA1) * g
    v = ADAM_BETA2 * v + (1 - ADAM_BETA2) * jnp.square(g)
    t = (i + 1).astype(jnp.float32)
    m_hat = m / (1 - ADAM_BETA1 ** t)
    v_hat = v / (1 - ADAM_BETA2 ** t)
    update = lr * m_hat / (jnp.sqrt(v_hat) + ADAM_EPS)
    new_x = base.project(x - update.astype(x.dtype), x0, eps, "linf")
    new_x = jnp.clip(new_x, clip_min, clip_max).astype(x0.dtype)
    if early_stop:
      new_x = jnp.where(done.reshape(frozen_shape), x, new_x)
      done = done | (loss_fn(new_x) < 0)
    return i + 1, new_x, m, v, done

  def cond(state):
    i, done = state[0], state[-1]
    return (i < steps) & ~jnp.all(done) if early_stop else i < steps

  zeros = jnp.zeros(x0.shape, jnp.float32)
  b = x0.shape[0]
  done = loss_fn(x0) < 0 if early_stop else jnp.zeros((b,), bool)
  state = (jnp.zeros((), jnp.int32), x0, zeros, zeros, done)
  return jax.lax.while_loop(cond, body, state)[1]
