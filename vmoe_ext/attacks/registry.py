"""The attack contract, the registry of attacks and `make_attack`.

A new attack is one module plus one line in `ATTACKS` (docs/robustness.md,
"Add an attack"). The contract, checked when the attack is looked up:

* `fn(logits_fn, x, labels, *, key=None, **fields) -> x_adv` — `CALL_ARGS`
  are given at call time by the evaluation (`key` only if `fn` takes it:
  attacks without randomness leave it out); every other parameter is a
  config field (`robustness.attacks[i].<field>`; the config schema reads
  their types and defaults from `fn`'s signature; no default: required). It
  must be traceable (the evaluation jits the attack together with the
  model, with `eps` a traced scalar so that an eps sweep compiles once: no
  Python branching on `eps`) and follow `attacks.base`'s conventions
  (batching, valid range).
* `check(**fields) -> None` — keyword-only, exactly `fn`'s config fields;
  `make_attack` calls it with every field (defaults filled in) before
  anything is traced, and it raises `ConfigError("attack.<field>", ...)`
  (`vmoe_ext.attacks.base` has the usual checks; a field that is traced
  stays unchecked). The config schema renames "attack" to the field's path
  (`robustness.attacks[1].eps`). `fn` may call it too, so that direct calls
  are checked as well (the built-in attacks do).
* `details` (optional) — `fn` with per-example diagnostics: the same
  signature, returning `(x_adv, {name: [B] or [B, T] array})`. The
  evaluation averages them over the examples (NaN entries left out) into
  the attack's metrics (`robustness_metrics`), e.g. AutoAttack's robust
  accuracy after each of its attacks and APGD's loss trajectory.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable, Mapping, Optional, Union

import jax

from vmoe_ext.attacks.base import LogitsFn
from vmoe_ext.errors import ConfigError, require
from vmoe_ext.registry import Registry, resolve

Array = jax.Array
Attack = Callable[[LogitsFn, Array, Array, Optional[Array]], Array]
# Call-time arguments of an attack function, not config fields.
CALL_ARGS = ("logits_fn", "x", "labels", "key")


@dataclasses.dataclass(frozen=True)
class AttackSpec:
  """One registered attack (see the module docstring for the contract).

  Attributes:
    fn: the attack function, or its "package.module:attr" path.
    check: its config check, or its "package.module:attr" path.
    details: optional `fn` with diagnostics (see the module docstring), or
      its path.
  """
  fn: Union[Callable[..., Array], str]
  check: Union[Callable[..., None], str]
  details: Union[Callable[..., Any], str, None] = None


def config_fields(fn: Callable[..., Any]) -> dict[str, inspect.Parameter]:
  """An attack function's config fields: its parameters but `CALL_ARGS`."""
  return {p.name: p for p in inspect.signature(fn).parameters.values()
          if p.name not in CALL_ARGS}


def _name(fn: Any) -> str:
  return getattr(fn, "__name__", repr(fn))


def check_contract(name: str, spec: AttackSpec) -> None:
  """TypeError unless `spec` (resolved) follows the attack contract."""
  params = list(inspect.signature(spec.fn).parameters)
  if params[:3] != list(CALL_ARGS[:3]):
    raise TypeError(f"attack {name!r}: {_name(spec.fn)} must take "
                    f"{CALL_ARGS[:3]} first, got {params[:3]}")
  fields = set(config_fields(spec.fn))
  check = inspect.signature(spec.check).parameters.values()
  keyword_only = {p.name for p in check if p.kind == p.KEYWORD_ONLY}
  if keyword_only != fields or len(check) != len(keyword_only):
    raise TypeError(
        f"attack {name!r}: its check {_name(spec.check)} must take "
        f"exactly the config fields of {_name(spec.fn)}, keyword-only: "
        f"{sorted(fields)}; got {[p.name for p in check]}")


class AttackRegistry(Registry):
  """`Registry` of `AttackSpec`s: `get(name)` is the attack function (what
  the config schema reads the fields of), `spec(name)` the function with
  its check, both resolved and checked against the contract."""

  def __init__(self, entries: Mapping[str, AttackSpec]):
    super().__init__("attack", {})
    for name, spec in entries.items():
      self.register(name, spec)

  def register(self, name: str, target: Any) -> None:
    """Adds `name` -> `target`, an `AttackSpec`."""
    if not isinstance(target, AttackSpec):
      raise TypeError(f"attack {name!r}: register an AttackSpec(fn, check), "
                      f"got {type(target).__name__}")
    super().register(name, target)

  def spec(self, name: Any, field: Optional[str] = None) -> AttackSpec:
    """The `AttackSpec` registered under `name`, resolved (ConfigError on
    `field`, default "attack.name", if none; TypeError if it breaks the
    contract)."""
    spec = self.entries[self.check(name, field)]
    spec = AttackSpec(resolve(spec.fn), resolve(spec.check),
                      None if spec.details is None else resolve(spec.details))
    check_contract(name, spec)
    self.entries[name] = spec
    return spec

  def get(self, name: Any, field: Optional[str] = None) -> Any:
    """The attack function registered under `name`."""
    return self.spec(name, field).fn


ATTACKS = AttackRegistry({
    "fgsm": AttackSpec("vmoe_ext.attacks.fast_gradient:fgsm",
                       "vmoe_ext.attacks.fast_gradient:check_fgsm"),
    "pgd": AttackSpec("vmoe_ext.attacks.projected_gradient:pgd",
                      "vmoe_ext.attacks.projected_gradient:check_pgd"),
    "spsa": AttackSpec("vmoe_ext.attacks.gradient_free:spsa",
                       "vmoe_ext.attacks.gradient_free:check_spsa"),
    "apgd": AttackSpec("vmoe_ext.attacks.apgd:apgd",
                       "vmoe_ext.attacks.apgd:check_apgd",
                       "vmoe_ext.attacks.apgd:apgd_details"),
    "fab": AttackSpec("vmoe_ext.attacks.fab:fab",
                      "vmoe_ext.attacks.fab:check_fab"),
    "square": AttackSpec("vmoe_ext.attacks.square:square",
                         "vmoe_ext.attacks.square:check_square"),
    "autoattack": AttackSpec("vmoe_ext.attacks.autoattack:autoattack",
                             "vmoe_ext.attacks.autoattack:check_autoattack",
                             "vmoe_ext.attacks.autoattack:autoattack_details"),
    "patch_swap": AttackSpec("vmoe_ext.attacks.patch_swap:patch_swap",
                             "vmoe_ext.attacks.patch_swap:check_patch_swap",
                             "vmoe_ext.attacks.patch_swap:patch_swap_details"),
})


def get_attack(name: str) -> Callable[..., Array]:
  """The attack function registered under `name`; ConfigError if none."""
  return ATTACKS.get(name)


def make_attack(config: Mapping[str, Any], details: bool = False) -> Attack:
  """`attack(logits_fn, x, labels, key=None) -> x_adv` from a config dict.

  `config = {"name": a registered attack, **its config fields}` (an
  ml_collections ConfigDict works too). Everything is checked now, before
  tracing: unknown names and fields, missing required fields, and the
  attack's `check` on every field (defaults filled in) raise ConfigError
  naming the field ("attack.steps"). The returned function is pure and
  traceable; jit it together with the model, e.g.
  `jax.jit(lambda p, x, y, k: attack(lambda z: apply(p, z), x, y, k))`.
  `key` is not passed to attacks that take none (FGSM). With `details`
  the function returns `(x_adv, diagnostics)`: the attack's `details`
  function, or an empty dict for attacks without one.
  """
  config = dict(config.to_dict() if hasattr(config, "to_dict") else config)
  require("name" in config, "attack.name", "missing")
  name = config.pop("name")
  spec = ATTACKS.spec(name)
  fn = spec.fn
  params = config_fields(fn)
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
  spec.check(**resolved)
  takes_key = "key" in inspect.signature(fn).parameters
  if details and spec.details is not None:
    run = spec.details
  elif details:
    run = lambda *a, **k: (fn(*a, **k), {})  # noqa: E731
  else:
    run = fn

  def attack(logits_fn: LogitsFn, x: Array, labels: Array,
             key: Optional[Array] = None) -> Array:
    if takes_key:
      return run(logits_fn, x, labels, key=key, **config)
    return run(logits_fn, x, labels, **config)

  attack.__name__ = f"{name}_attack"
  attack.__doc__ = f"{name} attack with {config!r}."
  return attack


# -- Attacks from the user's own modules (docs/extending.md) ----------------


def as_attack_spec(attack: Any, check: Any = None,
                   details: Any = None) -> AttackSpec:
  """`attack` as a resolved `AttackSpec` that follows the contract.

  Args:
    attack: an `AttackSpec` (with its check inside), or an attack function
      `fn`.
    check: `fn`'s check; default: the function `check_<fn name>` of `fn`'s
      module (the built-ins' convention: `fgsm` and `check_fgsm`).
    details: `fn` with diagnostics; default: `<fn name>_details` of `fn`'s
      module if it has one (`apgd_details`), else none.

  Raises:
    TypeError: `attack` is neither, has no check, or breaks the contract.
  """
  if isinstance(attack, AttackSpec):
    if check is not None or details is not None:
      raise TypeError("an AttackSpec carries its own check and details; "
                      "pass them inside it")
    spec = attack
  elif inspect.isfunction(attack):
    name = attack.__name__
    module = inspect.getmodule(attack)
    check = check or getattr(module, f"check_{name}", None)
    if check is None:
      raise TypeError(f"attack function {name!r} has no check: define "
                      f"check_{name} beside it in {attack.__module__!r}, or "
                      "give AttackSpec(fn, check)")
    details = details or getattr(module, f"{name}_details", None)
    spec = AttackSpec(attack, check, details)
  else:
    raise TypeError(f"an attack is an AttackSpec(fn, check) or an attack "
                    f"function, got {type(attack).__name__} {attack!r}")
  spec = AttackSpec(resolve(spec.fn), resolve(spec.check),
                    None if spec.details is None else resolve(spec.details))
  check_contract(_name(spec.fn), spec)
  return spec


def register_attack(name: str, attack: Any, check: Any = None,
                    details: Any = None, *, override: bool = False) -> None:
  """Makes `robustness.attacks[i].name=name` select `attack`.

  Args:
    name: the config name (no ":").
    attack, check, details: the attack, as `as_attack_spec` takes them (an
      `AttackSpec`, or a function and its check); checked now.
    override: replace an attack registered under `name` (a built-in too);
      without it a taken name raises ValueError.

  Raises:
    TypeError: the attack breaks the contract or has no check.
    ValueError: `name` is taken (and not `override`) or contains ":".
  """
  spec = as_attack_spec(attack, check, details)
  if override and name in ATTACKS.entries:
    ATTACKS.unregister(name)
  ATTACKS.register(name, spec)


# A "package.module:attr" attack name imports an AttackSpec or a function
# with its `check_<name>` beside it, checked as `register_attack` checks.
ATTACKS.accept = as_attack_spec
