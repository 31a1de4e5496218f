"""AutoAttack (Croce & Hein, ICML 2020): a parameter-free ensemble of
complementary attacks (docs/robustness.md, "AutoAttack").

    standard: APGD-CE -> APGD-T -> FAB-T -> Square
    rand:     APGD-CE -> APGD-DLR, each with EOT over `eot_iter` stochastic
              forward passes (router noise and dropout)

Each attack runs only on the examples still robust (correctly classified at
the clean image and not broken by an earlier attack); the examples already
broken sit at their adversarial points in every model call (capacity-based
MoE routing couples the images of a batch: the batch is never split). After
each attack the batch is evaluated once (deterministically); an example
counts as broken from the first attack under which it is misclassified, and
robust accuracy is the fraction correct under all of them.

The settings are the released AutoAttack's (fra31/auto-attack,
`AutoAttack.__init__` and `set_version`, what RobustBench runs): APGD 100
iterations, 1 restart; APGD-T and FAB-T over the 9 classes ranked 2..10 by
the clean logits, 100 iterations each, 1 restart; Square with `p_init` 0.8,
1 restart, 5,000 queries and `resc_schedule=False`: its `p` halves after
iterations 10, 50, 200, 500, 1000, 2000, 4000 (6000, 8000: beyond the
budget), not on the schedule stretched to the budget (square attack's own
default, `square(rescale_schedule=True)`). `square_rescale_schedule=True`
runs the ensemble's Square on that stretched schedule instead (halving
after iterations 5, 25, 100, ... of 5,000). Square's draws are per image
(`vmoe_ext.attacks.square`, its differences from the released code). The
rand version runs no Square (APGD-CE, APGD-DLR, 1 restart, EOT 20).

`x_adv` per example: the point of the attack that broke it, else the last
attack's best point (APGD: the highest loss; Square: the lowest margin; FAB
keeps the point it was given), so that routing statistics under attack see a
perturbed image for every example.

After each attack the ensemble reports how many examples are still robust
to the active `vmoe_ext.attacks.progress` listener (the evaluation prints it).

The result's `details` (`autoattack_details`): per example, whether it was
broken after each attack, and APGD's best-loss trajectories; a point broken
by the black-box Square attack but by none of the white-box ones flags
gradient masking.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp

from vmoe_ext.attacks import base, progress
from vmoe_ext.attacks.apgd import (SCHEDULES, apgd_run, check_apgd,
                                   check_classes)
from vmoe_ext.attacks.fab import fab_run
from vmoe_ext.attacks.square import square_run
from vmoe_ext.errors import require

Array = jax.Array
VERSIONS = {"standard": ("apgd-ce", "apgd-t", "fab-t", "square"),
            "rand": ("apgd-ce", "apgd-dlr")}
STAGES = ("apgd-ce", "apgd-dlr", "apgd-t", "fab-t", "square")
WHITE_BOX = ("apgd-ce", "apgd-dlr", "apgd-t", "fab-t")
# FAB-T's and Square's settings in the standard version (the released
# `SquareAttack(p_init=.8, n_queries=5000, n_restarts=1, resc_schedule=False)`:
# `rescale_schedule` is the `square_rescale_schedule` field, False there).
FAB = dict(restarts=1, alpha_max=0.1, eta=1.05, beta=0.9)
SQUARE = dict(p_init=0.8)


def stages_of(version: str, attacks: Optional[tuple[str, ...]]
              ) -> tuple[str, ...]:
  """The attacks run, in order: `attacks` if given, else the version's."""
  return tuple(attacks) if attacks is not None else VERSIONS[version]


def _stage(name: str, *, norm, steps, target_classes, queries, eot_iter,
           schedule, square_rescale_schedule
           ) -> Callable[..., tuple[Array, dict]]:
  """`run(logits_fn, x0, labels, key, x_start, done, eps, clip_min,
  clip_max) -> (x_out, info)` of one attack of the ensemble."""
  if name.startswith("apgd"):
    loss = {"apgd-ce": "ce", "apgd-dlr": "dlr", "apgd-t": "dlr-targeted"}[name]
    return functools.partial(
        apgd_run, norm=norm, loss=loss, steps=steps, restarts=1,
        target_classes=target_classes, rho=0.75, eot_iter=eot_iter,
        schedule=schedule)
  if name == "fab-t":
    return functools.partial(fab_run, norm=norm, steps=steps,
                             target_classes=target_classes, **FAB)
  return functools.partial(square_run, norm=norm, queries=queries,
                           rescale_schedule=square_rescale_schedule, **SQUARE)


def autoattack_run(logits_fn: base.LogitsFn, x0: Array, labels: Array,
                   key: Array, eps: Any, clip_min: Any, clip_max: Any, *,
                   stages: tuple[str, ...], norm: str, steps: int,
                   target_classes: int, queries: int, eot_iter: int,
                   schedule: str, square_rescale_schedule: bool = False
                   ) -> tuple[Array, dict[str, Array]]:
  """The ensemble on one batch; returns `(x_adv [B, ...], details)` (see
  `run_chain`). `eot_iter > 1`: the APGD attacks average their gradients
  over that many stochastic passes."""
  runs = []
  for name in stages:
    eot = eot_iter if name.startswith("apgd") else 1
    runs.append((name, _stage(name, norm=norm, steps=steps,
                              target_classes=target_classes, queries=queries,
                              eot_iter=eot, schedule=schedule,
                              square_rescale_schedule=square_rescale_schedule
                              )))
  return run_chain(logits_fn, x0, labels, key, eps, clip_min, clip_max, runs)


def run_chain(logits_fn: base.LogitsFn, x0: Array, labels: Array,
              key: Array, eps: Any, clip_min: Any, clip_max: Any,
              runs: Sequence[tuple[str, Callable[..., Any]]]
              ) -> tuple[Array, dict[str, Array]]:
  """Runs the attacks `runs` (`(name, run)`, `run(logits_fn, x0, labels,
  key, x_start, done, eps, clip_min, clip_max) -> (x_out, info)`) in
  order, each on the examples still robust; returns `(x_adv, details)`.

  `details`: `clean_correct [B]`; per attack `robust_after/<name> [B]`
  (correct at the clean image and under this attack and every earlier one:
  its mean is the robust accuracy after it); `square_only [B]` (broken by
  Square after every white-box attack of the run failed: a sign of
  gradient masking; all False without Square); per APGD attack
  `apgd_loss/<name> [B, steps + 1]`, the best loss of its first run at each
  iteration (NaN for examples it did not attack).
  """
  done = base.misclassified(logits_fn(x0), labels)
  details = {"clean_correct": ~done}
  x_cur = x0
  white_done = done
  for i, (name, run) in enumerate(runs):
    x_out, info = run(logits_fn, x0, labels, jax.random.fold_in(key, i),
                      x_cur, done, eps, clip_min, clip_max)
    attacked = ~done
    broken = done | base.misclassified(logits_fn(x_out), labels)
    if "trace" in info:
      best = info["trace"]["loss_best"][0]  # [steps + 1, B] of the first run.
      details[f"apgd_loss/{name}"] = jnp.where(attacked[:, None], best.T,
                                               jnp.nan)
    if name in WHITE_BOX:
      white_done = white_done | broken
    done, x_cur = broken, x_out
    details[f"robust_after/{name}"] = ~done
    progress.stage_done(name, ~done)
  names = [name for name, _ in runs]
  details["square_only"] = (done & ~white_done if "square" in names
                            else jnp.zeros_like(done))
  return x_cur, details


def autoattack(logits_fn: base.LogitsFn, x: Array, labels: Array, *,
               eps: float, key: Optional[Array] = None, norm: str = "linf",
               version: str = "standard",
               attacks: Optional[tuple[str, ...]] = None, steps: int = 100,
               target_classes: int = 9, queries: int = 5000,
               eot_iter: int = 20, schedule: str = "paper",
               square_rescale_schedule: bool = False,
               clip_min: float = 0.0, clip_max: float = 1.0) -> Array:
  """AutoAttack; returns `x_adv [B, ...]` (same shape and dtype as `x`).

  Args:
    logits_fn: `x [B, ...] -> logits [B, C]`, deterministic (see `base`); the
      "rand" version also calls `logits_fn(x, key=k)`, a stochastic pass
      (`Evaluator.logits_fn` takes it: training-mode router noise and
      dropout).
    x: `[B, ...]` clean images in `[clip_min, clip_max]`.
    labels: `[B]` int true labels.
    eps: radius of the Linf / L2 ball (>= 0).
    key: PRNG key (required).
    norm: "linf" or "l2".
    version: "standard" (APGD-CE, APGD-T, FAB-T, Square) or "rand" (APGD-CE,
      APGD-DLR with EOT).
    attacks: the attacks to run, in order, from "apgd-ce", "apgd-dlr",
      "apgd-t", "fab-t", "square" (None: the version's).
    steps: APGD and FAB iterations (100).
    target_classes: APGD-T's and FAB-T's target classes (9); < the number of
      classes.
    queries: Square's query budget (5,000).
    eot_iter: EOT samples per APGD gradient in the "rand" version (20).
    schedule: APGD's checkpoint schedule, "paper" or "autoattack" (see
      `vmoe_ext.attacks.apgd`).
    square_rescale_schedule: Square's `p` schedule stretched to `queries`
      (the square attack's own default); False (the released AutoAttack's
      standard version): halving after iterations 10, 50, 200, ...
    clip_min, clip_max: the valid range of the images.

  Raises:
    ConfigError naming the field ("attack.version").
  """
  attacks = None if attacks is None else tuple(attacks)
  check_autoattack(eps=eps, norm=norm, version=version, attacks=attacks,
                   steps=steps, target_classes=target_classes,
                   queries=queries, eot_iter=eot_iter, schedule=schedule,
                   square_rescale_schedule=square_rescale_schedule,
                   clip_min=clip_min, clip_max=clip_max)
  return autoattack_details(logits_fn, x, labels, key=key, eps=eps, norm=norm,
                            version=version, attacks=attacks, steps=steps,
                            target_classes=target_classes, queries=queries,
                            eot_iter=eot_iter, schedule=schedule,
                            square_rescale_schedule=square_rescale_schedule,
                            clip_min=clip_min, clip_max=clip_max)[0]


def autoattack_details(logits_fn: base.LogitsFn, x: Array, labels: Array, *,
                       eps: float, key: Optional[Array] = None,
                       norm: str = "linf", version: str = "standard",
                       attacks: Optional[tuple[str, ...]] = None,
                       steps: int = 100, target_classes: int = 9,
                       queries: int = 5000, eot_iter: int = 20,
                       schedule: str = "paper",
                       square_rescale_schedule: bool = False,
                       clip_min: float = 0.0, clip_max: float = 1.0
                       ) -> tuple[Array, dict]:
  """`autoattack` with its per-example details (see `autoattack_run`)."""
  attacks = None if attacks is None else tuple(attacks)
  check_autoattack(eps=eps, norm=norm, version=version, attacks=attacks,
                   steps=steps, target_classes=target_classes,
                   queries=queries, eot_iter=eot_iter, schedule=schedule,
                   square_rescale_schedule=square_rescale_schedule,
                   clip_min=clip_min, clip_max=clip_max)
  base.check_inputs(x, labels)
  base.check_key(key, True, "(random starts and Square's draws)")
  stages = stages_of(version, attacks)
  static = dict(stages=stages, norm=norm, steps=steps,
                target_classes=target_classes, queries=queries,
                eot_iter=eot_iter if version == "rand" else 1,
                schedule=schedule,
                square_rescale_schedule=square_rescale_schedule)
  return base.run_jitted(_autoattack, logits_fn, static, x, labels, key, eps,
                         clip_min, clip_max)


def _autoattack(logits_fn, x, labels, key, eps, clip_min, clip_max,
                **static):
  stages = static["stages"]
  for name in stages:
    if name in ("apgd-dlr", "apgd-t"):
      check_classes("dlr" if name == "apgd-dlr" else "dlr-targeted",
                    logits_fn, x)
  if any(s in ("apgd-t", "fab-t") for s in stages):
    num_classes = jax.eval_shape(logits_fn, x).shape[-1]
    require(static["target_classes"] < num_classes, "attack.target_classes",
            f"must be < the number of classes ({num_classes}), got "
            f"{static['target_classes']}")
  return autoattack_run(logits_fn, x, labels, key, eps, clip_min, clip_max,
                        **static)


def check_autoattack(*, eps, norm, version, attacks, steps, target_classes,
                     queries, eot_iter, schedule, square_rescale_schedule,
                     clip_min, clip_max) -> None:
  """`autoattack`'s config check (the attack contract, `attacks.registry`):
  every config field, keyword-only; ConfigError naming "attack.<field>"."""
  require(version in VERSIONS, "attack.version",
          f"must be one of {tuple(VERSIONS)}, got {version!r}")
  if attacks is not None:
    require(isinstance(attacks, (tuple, list)) and len(attacks) > 0,
            "attack.attacks", f"must be a non-empty list of {STAGES} or "
            f"None, got {attacks!r}")
    for i, name in enumerate(attacks):
      require(name in STAGES, f"attack.attacks[{i}]",
              f"must be one of {STAGES}, got {name!r}")
    require(len(set(attacks)) == len(attacks), "attack.attacks",
            f"lists an attack twice: {list(attacks)}")
  check_apgd(eps=eps, norm=norm, loss="ce", steps=steps, restarts=1,
             target_classes=target_classes, rho=0.75, eot_iter=eot_iter,
             schedule=schedule, clip_min=clip_min, clip_max=clip_max)
  base.check_int(queries, "attack.queries", 1)
  base.check_bool(square_rescale_schedule, "attack.square_rescale_schedule")
  require(schedule in SCHEDULES, "attack.schedule",
          f"must be one of {SCHEDULES}, got {schedule!r}")


__all__ = ["STAGES", "VERSIONS", "autoattack", "autoattack_details",
           "autoattack_run", "check_autoattack", "run_chain", "stages_of"]
