"""Machinery shared by the attacks: losses, projections, argument checks.

Conventions of the whole package (docs/robustness.md, "Attacks"):

* Images `x [B, ...]` live in a declared valid range `[clip_min, clip_max]`;
  `eps` is in the same units. Attacks return `x_adv` with `x`'s shape/dtype.
* `logits_fn(x [B, ...]) -> logits [B, C]` is a pure function the attack
  closes over; it must run the model deterministically (no router noise, no
  dropout), e.g. `lambda x: model.apply(variables, x, deterministic=True)[0]`.
* Auxiliary loss (FGSM, PGD with `include_auxiliary_loss=True`): `logits_fn`
  returns `(logits [B, C], auxiliary_loss)` instead, the model's auxiliary
  (load-balancing) loss in the same deterministic call (any shape, e.g. `[]`
  or per group `[G]`; its mean is used), and the attack ascends
  `J + mean(auxiliary_loss)`, as google-research/vmoe's adversarial attacks
  with `loss.attack_auxiliary_loss=True`. Off by default.
* Batching: every call of `logits_fn` made by an attack is on a batch of
  exactly the same `B` images (the attacked batch, never a concatenation of
  several copies). Capacity-based MoE routing makes an image's output depend
  on the other images of its routing group, so clean and attacked evaluations
  are comparable only when they use the same batches; evaluate both with the
  batching the attack saw.
* `labels [B]` int: the true classes, or the target classes when
  `targeted=True`.
"""

from __future__ import annotations

import functools
import math
import numbers
import weakref
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp

from vmoe_ext import classification
from vmoe_ext.errors import check, require

Array = jax.Array
# `x -> logits`, or `x -> (logits, auxiliary_loss)` (see the module docstring).
LogitsFn = Callable[[Array], Any]
NORMS = ("linf", "l2")
# Floor of per-example gradient / perturbation norms (as foolbox): avoids 0/0.
NORM_FLOOR = 1e-12


def cross_entropy(logits: Array, labels: Array) -> Array:
  """Per-example softmax cross-entropy `[B]` in float32; logits `[B, C]`,
  labels `[B]`: the framework's one cross-entropy
  (`vmoe_ext.classification.cross_entropy`) of the float32 logits."""
  return classification.cross_entropy(logits.astype(jnp.float32), labels)


def split_output(out: Any, include_auxiliary_loss: bool
                 ) -> tuple[Array, Optional[Array]]:
  """`(logits, mean auxiliary loss or None)` of a `logits_fn` output.

  With `include_auxiliary_loss` the output must be `(logits, auxiliary_loss)`;
  without it, a plain `logits` array (a pair raises: the flag was forgotten).

  Raises:
    ConfigError naming "attack.include_auxiliary_loss" on a mismatch.
  """
  pair = isinstance(out, (tuple, list)) and len(out) == 2
  if include_auxiliary_loss:
    require(pair, "attack.include_auxiliary_loss",
            "True needs logits_fn(x) -> (logits, auxiliary_loss), got "
            f"{type(out).__name__}")
    return out[0], jnp.mean(jnp.asarray(out[1], jnp.float32))
  require(not pair, "attack.include_auxiliary_loss",
          "logits_fn returned a pair; set include_auxiliary_loss=True to "
          "attack (logits, auxiliary_loss), or return the logits only")
  return out, None


def margin_loss(logits: Array, labels: Array) -> Array:
  """Per-example margin `logit[label] - max_{j != label} logit[j]`, `[B]`.

  Negative iff the example is misclassified (ties count as correct).
  """
  logits = logits.astype(jnp.float32)
  onehot = jax.nn.one_hot(labels, logits.shape[-1], dtype=bool)
  true = jnp.sum(jnp.where(onehot, logits, 0.0), axis=-1)
  other = jnp.max(jnp.where(onehot, -jnp.inf, logits), axis=-1)
  return true - other


def is_success(logits: Array, labels: Array, targeted: bool) -> Array:
  """`[B]` bool: misclassified (untargeted) or classified as the target."""
  correct = classification.topk_correct(logits, labels, 1)  # argmax == y
  return correct if targeted else ~correct


def per_example_norm(x: Array, norm: str) -> Array:
  """`[B, 1, ..., 1]` Linf or L2 norm of each example of `x [B, ...]`."""
  flat = x.reshape(x.shape[0], -1)
  if norm == "linf":
    n = jnp.max(jnp.abs(flat), axis=-1)
  else:
    n = jnp.sqrt(jnp.sum(jnp.square(flat), axis=-1))
  return n.reshape((-1,) + (1,) * (x.ndim - 1))


def normalize_gradient(grad: Array, norm: str) -> Array:
  """Steepest-ascent direction of unit `norm`: `sign(g)` or `g / ||g||_2`."""
  if norm == "linf":
    return jnp.sign(grad)
  return grad / jnp.maximum(per_example_norm(grad, "l2"), NORM_FLOOR)


def project(x: Array, x0: Array, eps: Any, norm: str) -> Array:
  """Projects each `x[b]` onto the `norm` eps-ball around `x0[b]`."""
  delta = x - x0
  if norm == "linf":
    delta = jnp.clip(delta, -eps, eps)
  else:
    n = jnp.maximum(per_example_norm(delta, "l2"), NORM_FLOOR)
    delta = delta * jnp.minimum(1.0, eps / n)
  return x0 + delta


def random_start(key: Array, x0: Array, eps: Any, norm: str) -> Array:
  """A point drawn uniformly from the `norm` eps-ball around each `x0[b]`."""
  if norm == "linf":
    noise = jax.random.uniform(key, x0.shape, x0.dtype, -1.0, 1.0)
    return x0 + eps * noise
  k_dir, k_rad = jax.random.split(key)
  direction = jax.random.normal(k_dir, x0.shape, x0.dtype)
  direction = direction / jnp.maximum(per_example_norm(direction, "l2"),
                                      NORM_FLOOR)
  n = x0[0].size
  radius = jax.random.uniform(k_rad, (x0.shape[0],) + (1,) * (x0.ndim - 1),
                              x0.dtype) ** (1.0 / n)
  return x0 + eps * radius * direction


# -- One jit per attack -----------------------------------------------------

# logits_fn -> {(impl, static args): jitted function}. Weakly keyed, and the
# jitted functions only hold a weak reference to logits_fn, so the compiled
# attack (and any parameters logits_fn closes over) is freed with logits_fn.
# (Passing logits_fn as a static jit argument instead would keep every
# logits_fn ever used, and its parameters, alive in jax's caches.)
_JITTED: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()


def run_jitted(impl: Callable[..., Any], logits_fn: LogitsFn,
               static: dict[str, Any], *args: Any) -> Any:
  """`impl(logits_fn, *args, **static)` inside one `jit`.

  Inside an enclosing trace (the caller jits around the attack, the intended
  use) `impl` is simply inlined. Called eagerly, the compiled function is
  cached per `logits_fn` object and static arguments: pass the same
  `logits_fn` object to reuse it (new closures recompile).
  """
  if any(isinstance(a, jax.core.Tracer) for a in jax.tree.leaves(args)):
    return impl(logits_fn, *args, **static)
  cache_key = (impl, tuple(sorted(static.items())))
  try:
    per_fn = _JITTED.setdefault(logits_fn, {})
  except TypeError:  # Not weak-referenceable or not hashable: no caching.
    return jax.jit(functools.partial(impl, logits_fn, **static))(*args)
  fn = per_fn.get(cache_key)
  if fn is None:
    ref = weakref.ref(logits_fn)
    fn = jax.jit(lambda *a: impl(ref(), *a, **static))
    per_fn[cache_key] = fn
  return fn(*args)


# -- Argument checks (run before tracing; skipped for traced values). --------


def is_concrete(value: Any) -> bool:
  return not isinstance(value, jax.core.Tracer)


def _scalar(value: Any, field: str) -> float:
  """`float(value)` for a real scalar; ConfigError naming `field` otherwise."""
  try:
    ok = not isinstance(value, (bool, str)) and jnp.ndim(value) == 0
    number = float(value) if ok else None
  except (TypeError, ValueError):
    number = None
  require(number is not None, field, f"must be a real scalar, got {value!r}")
  return number


def check_eps(eps: Any) -> None:
  """`eps` must be a finite scalar >= 0 (unchecked when traced)."""
  if is_concrete(eps):
    value = _scalar(eps, "attack.eps")
    require(math.isfinite(value) and value >= 0, "attack.eps",
            f"must be a finite number >= 0, got {eps!r}")


def check_positive(value: Any, field: str) -> None:
  """`value` must be a finite scalar > 0 (unchecked when traced)."""
  if is_concrete(value):
    number = _scalar(value, field)
    require(math.isfinite(number) and number > 0, field,
            f"must be a finite number > 0, got {value!r}")


def check_int(value: Any, field: str, minimum: int) -> None:
  """`value` must be a Python/NumPy integer >= `minimum` (static)."""
  require(isinstance(value, numbers.Integral) and not isinstance(value, bool)
          and value >= minimum, field,
          f"must be an integer >= {minimum}, got {value!r}")


def check_range(clip_min: Any, clip_max: Any) -> None:
  """`clip_min < clip_max` (infinite bounds are allowed: no clip that side)."""
  if is_concrete(clip_min) and is_concrete(clip_max):
    lo = _scalar(clip_min, "attack.clip_min")
    hi = _scalar(clip_max, "attack.clip_max")
    require(lo < hi, "attack.clip_min",
            f"must be < clip_max, got [{clip_min}, {clip_max}]")


def check_inputs(x: Array, labels: Array) -> None:
  """`x [B, ...]` floating point, `labels [B]` integer (else `InputError`)."""
  check(jnp.ndim(x) >= 1, "attack.x", "needs a leading batch axis [B, ...]")
  check(jnp.issubdtype(jnp.result_type(x), jnp.floating), "attack.x",
        f"must be floating point images, got {jnp.result_type(x)}")
  check(jnp.issubdtype(jnp.result_type(labels), jnp.integer),
        "attack.labels",
        f"must be integer classes, got {jnp.result_type(labels)}")
  check(jnp.shape(labels) == jnp.shape(x)[:1], "attack.labels",
        f"must have shape [B] = {jnp.shape(x)[:1]}, got {jnp.shape(labels)}")


def check_bool(value: Any, field: str) -> None:
  """`value` must be a Python bool (static)."""
  require(isinstance(value, bool), field, f"must be True or False, got "
          f"{value!r}")


def check_key(key: Optional[Array], needed: bool, why: str) -> None:
  """A PRNG key must be given when `needed`."""
  require(key is not None or not needed, "attack.key", f"required {why}")


# -- Losses and bookkeeping of the AutoAttack family ------------------------


def _sorted_logits(logits: Array) -> Array:
  """`[B, C]` float32 logits sorted in decreasing order."""
  return -jnp.sort(-logits.astype(jnp.float32), axis=-1)


def dlr_loss(logits: Array, labels: Array) -> Array:
  """Untargeted difference-of-logits-ratio loss `[B]` (Croce & Hein 2020):

      DLR(z, y) = -(z_y - max_{i != y} z_i) / (z_pi1 - z_pi3 + 1e-12)

  with `z_pi1 >= z_pi2 >= ...` the sorted logits; invariant to shifting and
  rescaling the logits, positive iff the example is misclassified. Needs
  C >= 3 classes."""
  z = logits.astype(jnp.float32)
  zs = _sorted_logits(z)
  return -margin_loss(z, labels) / (zs[:, 0] - zs[:, 2] + 1e-12)


def dlr_targeted_loss(logits: Array, labels: Array, targets: Array) -> Array:
  """Targeted DLR loss `[B]` (Croce & Hein 2020, APGD-T):

      -(z_y - z_t) / (z_pi1 - (z_pi3 + z_pi4) / 2 + 1e-12)

  ascended to push the target `t` above the true class `y`. Needs C >= 4."""
  z = logits.astype(jnp.float32)
  zs = _sorted_logits(z)
  pick = lambda c: jnp.take_along_axis(z, c[:, None], axis=-1)[:, 0]  # noqa: E731
  return -(pick(labels) - pick(targets)) / (
      zs[:, 0] - 0.5 * (zs[:, 2] + zs[:, 3]) + 1e-12)


def misclassified(logits: Array, labels: Array) -> Array:
  """`[B]` bool: top-1 prediction differs from `labels` (ties count as
  correct, as `classification.topk_correct`)."""
  return ~classification.topk_correct(logits, labels, 1)


def per_example(mask: Array, x: Array) -> Array:
  """`mask [B]` broadcast against `x [B, ...]`."""
  return mask.reshape((-1,) + (1,) * (x.ndim - 1))


def where_examples(mask: Array, a: Array, b: Array) -> Array:
  """Per example: `a[b]` where `mask[b]`, else `b[b]` (`[B, ...]`)."""
  return jnp.where(per_example(mask, a), a, b)


def top_targets(logits: Array, rank: int) -> Array:
  """`[B]` the class with the `rank`-th largest logit (rank 1 = the top
  class): AutoAttack's target classes are ranks 2..n_target_classes+1 of
  the clean logits."""
  order = jnp.argsort(-logits.astype(jnp.float32), axis=-1, stable=True)
  return order[:, rank - 1].astype(jnp.int32)
