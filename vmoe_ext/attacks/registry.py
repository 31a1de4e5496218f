"""Config name -> attack function, and `make_attack` from a config dict."""

from __future__ import annotations

import inspect
from typing import Any, Callable, Mapping, Optional

import jax

from vmoe_ext.attacks.base import LogitsFn
from vmoe_ext.errors import ConfigError, require
from vmoe_ext.registry import Registry

Array = jax.Array
Attack = Callable[[LogitsFn, Array, Array, Optional[Array]], Array]

ATTACKS = Registry("attack", {
    "fgsm": "vmoe_ext.attacks.fast_gradient:fgsm",
    "pgd": "vmoe_ext.attacks.projected_gradient:pgd",
    "spsa": "vmoe_ext.attacks.gradient_free:spsa",
})
# Each attack's argument checks (keyword-only, every argument explicit): the
# `_validate` function of the module that defines the attack.
_VALIDATOR = "_validate"
# Call-time arguments, not config fields.
_CALL_ARGS = ("logits_fn", "x", "labels", "key")


def get_attack(name: str) -> Callable[..., Array]:
  """The attack function registered under `name`; ConfigError if none."""
  return ATTACKS.get(name)


def make_attack(config: Mapping[str, Any]) -> Attack:
  """`attack(logits_fn, x, labels, key=None) -> x_adv` from a config dict.

  `config = {"name": "fgsm" | "pgd" | "spsa", **keyword arguments of that
  function}` (an ml_collections ConfigDict works too). Everything is checked
  now, before tracing: unknown names and fields, missing required fields and
  invalid values raise ConfigError naming the field ("attack.steps"). The
  returned function is pure and traceable; jit it together with the model,
  e.g. `jax.jit(lambda p, x, y, k: attack(lambda z: apply(p, z), x, y, k))`.
  `key` is ignored by FGSM.
  """
  config = dict(config.to_dict() if hasattr(config, "to_dict") else config)
  require("name" in config, "attack.name", "missing")
  name = config.pop("name")
  fn = get_attack(name)
  params = {p.name: p for p in inspect.signature(fn).parameters.values()
            if p.name not in _CALL_ARGS}
  for field in sorted(config):
    if field not in params:
      raise ConfigError(f"attack.{field}",
                        f"not an argument of {name!r}; settable: "
                        f"{sorted(params)}")
  resolved = {}
  for field, p in params.items():
    if field in config:
      resolved[field] = config[field]
    elif p.default is inspect.Parameter.empty:
      raise ConfigError(f"attack.{field}", f"missing (required by {name!r})")
    else:
      resolved[field] = p.default
  validator = getattr(inspect.getmodule(fn), _VALIDATOR)
  wanted = inspect.signature(validator).parameters
  validator(**{k: v for k, v in resolved.items() if k in wanted})
  takes_key = "key" in inspect.signature(fn).parameters

  def attack(logits_fn: LogitsFn, x: Array, labels: Array,
             key: Optional[Array] = None) -> Array:
    if takes_key:
      return fn(logits_fn, x, labels, key=key, **config)
    return fn(logits_fn, x, labels, **config)

  attack.__name__ = f"{name}_attack"
  attack.__doc__ = f"{name} attack with {config!r}."
  return attack
