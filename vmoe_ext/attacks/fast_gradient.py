"""Fast gradient sign method (Goodfellow et al. 2015; docs/robustness.md,
"Attacks").

    x_adv = clip_range(x + eps * sign(grad_x J(x)))

with `J` the mean cross-entropy (targeted: minus the mean CE to the targets;
plus the mean auxiliary loss with `include_auxiliary_loss=True`, see `base`),
i.e. one Linf PGD step of size eps from the clean image (foolbox 3's `FGSM`).
"""

from __future__ import annotations

from typing import Any

import jax

from vmoe_ext.attacks import base
from vmoe_ext.attacks.projected_gradient import ascent_step

Array = jax.Array


def fgsm(logits_fn: base.LogitsFn, x: Array, labels: Array, *, eps: float,
         clip_min: float = 0.0, clip_max: float = 1.0,
         targeted: bool = False,
         include_auxiliary_loss: bool = False) -> Array:
  """FGSM; returns `x_adv [B, ...]` (same shape and dtype as `x`).

  Args:
    logits_fn: `x [B, ...] -> logits [B, C]`, deterministic (see `base`);
      `-> (logits, auxiliary_loss)` with `include_auxiliary_loss`.
    x: `[B, ...]` clean images in `[clip_min, clip_max]`.
    labels: `[B]` int true labels (targeted: target labels).
    eps: Linf size of the step, >= 0, in the units of `x`.
    clip_min, clip_max: the valid range of the images.
    targeted: step down the CE to `labels` instead of up.
    include_auxiliary_loss: also step up the model's mean auxiliary loss.

  Raises:
    ConfigError: invalid argument; the message names the field ("attack.eps").
  """
  check_fgsm(eps=eps, clip_min=clip_min, clip_max=clip_max,
             targeted=targeted, include_auxiliary_loss=include_auxiliary_loss)
  base.check_inputs(x, labels)
  static = dict(targeted=bool(targeted), aux=include_auxiliary_loss)
  return base.run_jitted(_fgsm, logits_fn, static, x, labels, eps, clip_min,
                         clip_max)


def check_fgsm(*, eps: Any, clip_min: Any, clip_max: Any, targeted: Any,
               include_auxiliary_loss: Any) -> None:
  """`fgsm`'s config check (the attack contract, `attacks.registry`): every
  config field, keyword-only; ConfigError naming "attack.<field>"."""
  del targeted  # Any truth value.
  base.check_eps(eps)
  base.check_range(clip_min, clip_max)
  base.check_bool(include_auxiliary_loss, "attack.include_auxiliary_loss")


def _fgsm(logits_fn, x, labels, eps, clip_min, clip_max, *, targeted, aux):
  return ascent_step(logits_fn, x, x, labels, step_size=eps, eps=eps,
                     norm="linf", targeted=targeted,
                     clip_range=(clip_min, clip_max),
                     include_auxiliary_loss=aux)
