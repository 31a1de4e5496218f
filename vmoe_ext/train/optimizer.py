"""Optimizer factory: learning-rate schedules, Adam/AdamW/SGD, decay masks.

The `optimizer` config section (an ml_collections ConfigDict or any Mapping)
has these fields; anything else is an error (catches typos):

  name:               "adam" | "adamw" | "sgd" (required).
  learning_rate:      peak learning rate, >= 0 (required).
  warmup_steps:       linear warmup from 0 to the peak, >= 0 (default 0).
  decay:              "cosine" | "linear" | "constant" (default "cosine").
  total_steps:        steps of the whole run, > 0; required unless decay is
                      "constant". warmup_steps <= total_steps.
  end_learning_rate:  value reached at total_steps by "cosine"/"linear",
                      0 <= end <= peak (default 0; ignored by "constant").
  b1, b2, eps:        Adam moments (defaults 0.9, 0.999, 1e-8); adam/adamw.
  momentum:           SGD momentum in [0, 1) (default 0: plain SGD); sgd only.
  nesterov:           Nesterov momentum (default False); sgd with momentum>0.
  weight_decay:       decoupled weight decay, >= 0 (default 0). Allowed for
                      "adamw" and "sgd"; "adam" with a nonzero value is an
                      error (that optimizer is "adamw").
  weight_decay_mask:  which parameters decay: "all" or "no_bias_norm"
                      (default; see `weight_decay_mask`).
  clip_global_norm:   clip gradients to this global L2 norm before anything
                      else; None or 0 disables (default None).
  frozen:             regexes (full match on "/"-joined param paths, e.g.
                      ".*/Moe/router/.*") of params that are never updated:
                      their gradients are zeroed before clipping (so they
                      do not count in the global norm) and their updates,
                      weight decay included, are zero (default ()). A regex
                      that matches no param is an error when the optimizer
                      is initialised.

The update applied to a parameter `w` at step `s` (optax counts the first
update as step 0) is

  u = -lr(s) * (direction(g) + weight_decay * mask(w) * w)

where `direction` is Adam's bias-corrected `m / (sqrt(v) + eps)` or SGD's
(momentum-accumulated) gradient, computed on the clipped gradient `g`. The
decay is *decoupled* (Loshchilov & Hutter; optax.adamw, PyTorch AdamW): it
never enters the Adam moments and is scaled by the scheduled learning rate.
For SGD without momentum it equals an L2 penalty of weight_decay / 2 * |w|^2.
"""

from __future__ import annotations

import math
import numbers
import re
from typing import Any, Callable, Mapping, Optional

import jax
import jax.numpy as jnp
import optax

from vmoe_ext.config.defaults import fill_defaults
from vmoe_ext.config.schema import REQUIRED, Field, Section, Seq
from vmoe_ext.errors import ConfigError, require
from vmoe_ext.registry import Registry

# Config name -> the function `(filled config) -> the optimizer's update
# direction` (None: the plain gradient).
OPTIMIZERS = Registry("optimizer", {
    "adam": "vmoe_ext.train.optimizer:adam_direction",
    "adamw": "vmoe_ext.train.optimizer:adam_direction",
    "sgd": "vmoe_ext.train.optimizer:sgd_direction",
})
NAMES = tuple(OPTIMIZERS)
DECAYS = ("cosine", "linear", "constant")
MASKS = ("all", "no_bias_norm")
# Leaf names that never decay under "no_bias_norm", whatever their rank:
# biases (flax "bias", the MoE experts' stacked "bi"/"bo" [E, H]/[E, D]),
# LayerNorm and SoftMoE "scale", and the ViT position embedding and class
# token.
NO_DECAY_NAMES = frozenset({"bias", "scale", "pos_embedding", "cls",
                            "relative_position_bias_table"})
# Modules none of whose parameters decay: the Swin-MoE release's continuous
# position-bias MLP (its `no_weight_decay_keywords`).
NO_DECAY_MODULES = ("cpb_mlp_",)

_PREFIX = "optimizer"


def _field(name: str) -> str:
  return f"{_PREFIX}.{name}"


def _to_dict(config: Any) -> dict[str, Any]:
  if hasattr(config, "to_dict"):
    config = config.to_dict()
  require(isinstance(config, Mapping), _PREFIX,
          f"must be a mapping (ConfigDict or dict), got "
          f"{type(config).__name__}")
  return dict(config)


def _is_real(x: Any) -> bool:
  return (isinstance(x, numbers.Real) and not isinstance(x, bool)
          and math.isfinite(float(x)))


def _is_int(x: Any) -> bool:
  return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _real(cfg: Mapping[str, Any], name: str, lo: float,
          hi: float | None = None, lo_open: bool = False,
          hi_open: bool = False) -> float:
  """Checks a finite float field in [lo, hi] (bounds optionally open)."""
  value = cfg.get(name)
  lo_ok = _is_real(value) and (value > lo if lo_open else value >= lo)
  hi_ok = hi is None or (_is_real(value) and
                         (value < hi if hi_open else value <= hi))
  lo_s = "(" if lo_open else "["
  hi_s = "inf)" if hi is None else (f"{hi})" if hi_open else f"{hi}]")
  require(lo_ok and hi_ok, name,
          f"must be a finite number in {lo_s}{lo}, {hi_s}, got {value!r}")
  return float(value)


def check_optimizer(cfg: Mapping[str, Any]) -> None:
  """The ranges and combinations of an `optimizer` section (its types are
  checked by the schema first): the `OPTIMIZER` section's check, run once
  when the config is resolved. Fields are named relative to the section, as
  every section check names them."""
  cfg = fill_defaults(OPTIMIZER, _to_dict(cfg))
  name = cfg.get("name")
  OPTIMIZERS.check(name, field="name")
  require("learning_rate" in cfg, "learning_rate", "is required")
  _real(cfg, "learning_rate", 0.0)
  decay, warmup, total = cfg["decay"], cfg["warmup_steps"], cfg["total_steps"]
  require(decay in DECAYS, "decay",
          f"unknown decay {decay!r}; expected one of {DECAYS}")
  require(_is_int(warmup) and warmup >= 0, "warmup_steps",
          f"must be an integer >= 0, got {warmup!r}")
  if total is None:
    require(decay == "constant" and warmup == 0, "total_steps",
            f"is required with decay={decay!r} and warmup_steps={warmup}")
  else:
    require(_is_int(total) and total > 0, "total_steps",
            f"must be a positive integer, got {total!r}")
    require(warmup <= total, "warmup_steps",
            f"warmup_steps={warmup} exceeds total_steps={total}")
  _real(cfg, "end_learning_rate", 0.0, float(cfg["learning_rate"]))
  if name == "sgd":  # The schema rejects Adam's fields for SGD and back.
    momentum = _real(cfg, "momentum", 0.0, 1.0, hi_open=True)
    require(not cfg["nesterov"] or momentum > 0, "nesterov",
            "needs momentum > 0")
  else:
    _real(cfg, "b1", 0.0, 1.0, hi_open=True)
    _real(cfg, "b2", 0.0, 1.0, hi_open=True)
    _real(cfg, "eps", 0.0)
  weight_decay = _real(cfg, "weight_decay", 0.0)
  require(name != "adam" or weight_decay == 0.0, "weight_decay",
          "optimizer 'adam' takes no weight decay; use name='adamw' for "
          "decoupled weight decay")
  mask = cfg["weight_decay_mask"]
  require(mask in MASKS, "weight_decay_mask",
          f"unknown mask {mask!r}; expected one of {MASKS}")
  clip = cfg["clip_global_norm"]
  require(clip is None or (_is_real(clip) and clip >= 0),
          "clip_global_norm",
          f"must be None or a finite number >= 0, got {clip!r}")
  for i, pattern in enumerate(cfg["frozen"] or ()):
    try:
      re.compile(pattern)
    except (re.error, TypeError) as e:
      raise ConfigError(f"frozen[{i}]",
                        f"invalid regex {pattern!r}: {e}") from e


_COMMON_FIELDS = {
    "name": Field("str", REQUIRED, choices=OPTIMIZERS),
    "learning_rate": Field("float", REQUIRED, doc="peak, >= 0"),
    "warmup_steps": Field("int", 0),
    "decay": Field("str", "cosine", doc=f"one of {DECAYS}"),
    "total_steps": Field("int", None, nullable=True),
    "end_learning_rate": Field("float", 0.0),
    "weight_decay": Field("float", 0.0),
    "weight_decay_mask": Field("str", "no_bias_norm"),
    "clip_global_norm": Field("float", None, nullable=True),
    "frozen": Seq(Field("str"), (), doc="regexes of params never updated"),
}
_ADAM_FIELDS = {"b1": Field("float", 0.9), "b2": Field("float", 0.999),
                "eps": Field("float", 1e-8)}
_SGD_FIELDS = {"momentum": Field("float", 0.0),
               "nesterov": Field("bool", False)}


def _optimizer_fields(value: Mapping[str, Any]) -> dict[str, Any]:
  """The common fields, and Adam's moments or SGD's momentum by `name`
  (both sets while the name is unknown, so that `check_optimizer` names
  a field of the other optimizer as such)."""
  name = value.get("name")
  extra = ({**_ADAM_FIELDS, **_SGD_FIELDS} if name not in OPTIMIZERS
           else _SGD_FIELDS if name == "sgd" else _ADAM_FIELDS)
  return {**_COMMON_FIELDS, **extra}


OPTIMIZER = Section(_optimizer_fields, check=check_optimizer,
                    doc="the optimizer and its schedule (module docstring)")
FIELDS = (*_COMMON_FIELDS, *_ADAM_FIELDS, *_SGD_FIELDS)


def _settings(config: Any) -> dict[str, Any]:
  """A checked `optimizer` section with its defaults filled (the schema's),
  numbers as Python floats/ints."""
  cfg = fill_defaults(OPTIMIZER, _to_dict(config))
  out = dict(cfg)
  for key in ("learning_rate", "end_learning_rate", "weight_decay", "b1",
              "b2", "eps", "momentum"):
    if key in cfg:
      out[key] = float(cfg[key])
  out["warmup_steps"] = int(cfg["warmup_steps"])
  clip = cfg["clip_global_norm"]
  out["clip_global_norm"] = float(clip) if clip else None
  out["frozen"] = tuple(cfg["frozen"] or ())
  return out


def _schedule(peak: float, end: float, warmup: int, total: int | None,
              decay: str) -> optax.Schedule:
  """Warmup-then-decay schedule; see `make_learning_rate`."""

  def schedule(step):
    step = jnp.asarray(step, jnp.float32)
    if decay == "constant":
      after = jnp.full_like(step, peak)
    else:
      frac = jnp.clip((step - warmup) / max(total - warmup, 1), 0.0, 1.0)
      if decay == "cosine":
        after = end + (peak - end) * 0.5 * (1.0 + jnp.cos(jnp.pi * frac))
      else:
        after = peak + (end - peak) * frac
    if warmup == 0:
      return after
    return jnp.where(step < warmup, peak * step / warmup, after)

  return schedule


def make_learning_rate(config: Any) -> optax.Schedule:
  """Returns the learning-rate schedule `lr(step)` of an optimizer config.

  With peak `p = learning_rate`, end `e = end_learning_rate`, `W =
  warmup_steps`, `N = total_steps` and `t = clip((s - W) / max(N - W, 1), 0,
  1)`:

    s < W:     lr = p * s / W                       (linear warmup from 0)
    s >= W:    cosine:   e + (p - e) * (1 + cos(pi * t)) / 2
               linear:   p + (e - p) * t
               constant: p

  so the schedule reaches `e` at step N and stays there. The returned
  function accepts Python or traced integer steps and returns float32.

  `config` is a checked section (the run assembly checks it once, when the
  config is resolved; alone: `validate(OPTIMIZER, config, "optimizer")`).
  """
  cfg = _settings(config)
  return _schedule(cfg["learning_rate"], cfg["end_learning_rate"],
                   cfg["warmup_steps"], cfg["total_steps"], cfg["decay"])


def _leaf_name(path: tuple[Any, ...]) -> str:
  return _key_name(path[-1]) if path else ""


def weight_decay_mask(params: Any, mode: str = "no_bias_norm") -> Any:
  """Boolean pytree (same structure as `params`): True where a leaf decays.

  * "all": every leaf decays.
  * "no_bias_norm": a leaf decays iff it has rank >= 2 *and* its own name
    (the last key of its path) is not one of `NO_DECAY_NAMES`: bias,
    scale, pos_embedding, cls, relative_position_bias_table, and it is not
    in a module named `cpb_mlp_*`. So dense/conv/attention/expert kernels
    and router weights decay; biases (including 2-D attention and expert
    biases), LayerNorm scales, any 0-D/1-D parameter, the position
    embedding, the class token and a Swin's relative position bias (its
    table, or the release's position-bias MLP, as the Swin releases
    exclude them) do not.

  Raises:
    ConfigError("optimizer.weight_decay_mask") for an unknown mode.
  """
  require(mode in MASKS, _field("weight_decay_mask"),
          f"unknown mask {mode!r}; expected one of {MASKS}")

  def decays(path, leaf) -> bool:
    if mode == "all":
      return True
    return (jnp.ndim(leaf) >= 2 and _leaf_name(path) not in NO_DECAY_NAMES
            and not any(_key_name(k).startswith(NO_DECAY_MODULES)
                        for k in path[:-1]))

  return jax.tree_util.tree_map_with_path(decays, params)


def make_optimizer(config: Any,
                   params: Any = None) -> optax.GradientTransformation:
  """Builds the optimizer of an `optimizer` config section.

  The chain is: clip by global norm (if enabled) -> Adam scaling (adam,
  adamw) or momentum trace (sgd with momentum > 0) -> decoupled weight decay
  (masked; adamw/sgd with weight_decay > 0) -> scale by -lr(step). See the
  module docstring for the fields and the exact update.

  Args:
    config: the `optimizer` section (ConfigDict or Mapping).
    params: optional parameter pytree. When given, the weight-decay mask is
      computed from it right away (so a bad tree fails here, not at `init`)
      and the optimizer must then be used with trees of that structure;
      otherwise the mask is computed from the tree passed to `init`/`update`.

  `config` is a checked section (see `make_learning_rate`); a `frozen`
  regex that matches no param is an error at `init`.
  """
  cfg = _settings(config)
  schedule = _schedule(cfg["learning_rate"], cfg["end_learning_rate"],
                       cfg["warmup_steps"], cfg["total_steps"], cfg["decay"])
  chain = []
  if cfg["frozen"]:
    chain.append(freeze(cfg["frozen"]))
  if cfg["clip_global_norm"]:
    chain.append(optax.clip_by_global_norm(cfg["clip_global_norm"]))
  direction = OPTIMIZERS.get(cfg["name"])(cfg)
  if direction is not None:
    chain.append(direction)
  if cfg["weight_decay"] > 0:
    mode = cfg["weight_decay_mask"]
    mask: Any
    if params is not None:
      mask = weight_decay_mask(params, mode)
    else:
      mask = _mask_fn(mode)
    chain.append(optax.add_decayed_weights(cfg["weight_decay"], mask=mask))
  chain.append(optax.scale_by_learning_rate(schedule))
  if cfg["frozen"]:
    chain.append(freeze(cfg["frozen"]))
  return optax.chain(*chain)


def frozen_mask(params: Any, patterns: tuple[str, ...]) -> Any:
  """Boolean pytree: True where a param's "/"-joined path fully matches one
  of `patterns`. Raises ConfigError("optimizer.frozen[i]") for a pattern
  that matches no param."""
  paths = jax.tree_util.tree_map_with_path(
      lambda path, _: "/".join(_key_name(k) for k in path), params)
  names = jax.tree.leaves(paths)
  for i, pattern in enumerate(patterns):
    require(any(re.fullmatch(pattern, n) for n in names),
            _field(f"frozen[{i}]"), f"{pattern!r} matches no parameter")
  return jax.tree.map(
      lambda n: any(re.fullmatch(p, n) for p in patterns), paths)


def freeze(patterns: tuple[str, ...]) -> optax.GradientTransformation:
  """Zeroes the gradients/updates of the params matching `patterns`."""

  def init(params):
    frozen_mask(params, patterns)  # Errors now, before training.
    return optax.EmptyState()

  def update(updates, state, params=None):
    del params
    mask = frozen_mask(updates, patterns)
    return jax.tree.map(lambda u, m: jnp.zeros_like(u) if m else u, updates,
                        mask), state

  return optax.GradientTransformation(init, update)


def _key_name(key: Any) -> str:
  for attr in ("key", "name", "idx"):
    if hasattr(key, attr):
      return str(getattr(key, attr))
  return str(key)


def adam_direction(cfg: Mapping[str, Any]
                   ) -> Optional[optax.GradientTransformation]:
  """Adam's bias-corrected `m / (sqrt(v) + eps)` (adam and adamw)."""
  return optax.scale_by_adam(b1=cfg["b1"], b2=cfg["b2"], eps=cfg["eps"])


def sgd_direction(cfg: Mapping[str, Any]
                  ) -> Optional[optax.GradientTransformation]:
  """SGD's momentum trace, or None (the plain gradient) without momentum."""
  if cfg["momentum"] > 0:
    return optax.trace(decay=cfg["momentum"], nesterov=cfg["nesterov"])
  return None


def _mask_fn(mode: str) -> Callable[[Any], Any]:
  return lambda params: weight_decay_mask(params, mode)


__all__ = ["DECAYS", "FIELDS", "MASKS", "NAMES", "NO_DECAY_NAMES",
           "OPTIMIZER", "OPTIMIZERS", "check_optimizer",
           "adam_direction", "freeze", "frozen_mask", "make_learning_rate", "make_optimizer",
           "sgd_direction", "weight_decay_mask"]
