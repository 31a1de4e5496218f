"""Config name -> attack function, and `make_attack` from a config dict."""

from __future__ import annotations

import inspect
from typing import Any, Callable, Mapping, Optional

import jax

from vmoe_ext.attacks import fast_gradient as fgsm_lib
from vmoe_ext.attacks import projected_gradient as pgd_lib
from vmoe_ext.attacks import gradient_free as spsa_lib
from vmoe_ext.attacks.base import LogitsFn
from vmoe_ext.errors import ConfigError, require

Array = jax.Array
Attack = Callable[[LogitsFn, Array, Array, Optional[Array]], Array]

ATTACKS: dict[str, Callable[..., Array]] = {
    "fgsm": fgsm_lib.fgsm,
    "pgd": pgd_lib.pgd,
    "spsa": spsa_lib.spsa,
}
# Each attack's argument checks (keyword-only, every argument explicit).
_VALIDATORS = {
    "fgsm": fgsm_lib._validate,  # pylint: disable=protected-access
    "pgd": pgd_lib._validate,  # pylint: disable=protected-access
    "spsa": spsa_lib._validate,  # pylint: disable=protected-access
}
# Call-time arguments, not config fields.
_CALL_ARGS = ("logits_fn", "x", "labels", "key")


def get_attack(name: str) -> Callable[..., Array]:
  """The attack function registered under `name`; ConfigError if none."""
  require(isinstance(name, str) and name in ATTACKS, "attack.name",
          f"unknown attack {name!r}; registered: {sorted(ATTACKS)}")
  return ATTACKS[name]


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
  validator = _VALIDATORS[name]
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
