"""The `robustness` config section: attacks, eps sweep, corruptions,
evaluation datasets, and the evaluation-only modes (`checkpoint_dir`,
`from_init`).

An attack entry is `{name, **the attack function's keyword arguments}`
(`vmoe_ext.attacks.ATTACKS`: its fields are read from the function's
signature) plus `num_examples`; the attack's own checks (its registered
`check`, `vmoe_ext.attacks.registry`) run once, here.
"""

from __future__ import annotations

from typing import Any, Mapping

from vmoe_ext.attacks import ATTACKS, CALL_ARGS, make_attack
from vmoe_ext.config.schema import (REQUIRED, Field, Section, Seq, Spec,
                                    function_fields, renamed_scope)
from vmoe_ext.data.corruptions import CORRUPTION_FUNCTIONS, SEVERITIES
from vmoe_ext.errors import ConfigError, require
from vmoe_ext.evaluate.datasets import check_datasets

# Arguments of an attack function that are not config fields (the attack
# contract's call-time arguments).
_ATTACK_CALL_ARGS = CALL_ARGS


def _attack_fields(extra: Mapping[str, Spec], exclude: tuple[str, ...] = ()):

  def fields(value: Mapping[str, Any]) -> dict[str, Spec]:
    require("name" in value, "name", "is required")
    fn = ATTACKS.get(value["name"], field="name")
    out: dict[str, Spec] = {"name": Field("str", REQUIRED)}
    out.update(function_fields(fn, exclude=_ATTACK_CALL_ARGS + exclude))
    out.update(extra)
    return out

  return fields


def _make_attack(value: Mapping[str, Any]) -> None:
  with renamed_scope("attack", ""):
    make_attack({k: v for k, v in value.items() if k != "num_examples"})


def _check_sweep(value: dict[str, Any]) -> None:
  for i, eps in enumerate(value["eps"]):
    try:
      make_attack({**value["attack"], "eps": eps})
    except ConfigError as e:
      if e.field == "attack.eps":
        raise ConfigError(f"eps[{i}]", e.reason) from e
      raise


ATTACK = Section(
    _attack_fields({"num_examples": Field("int", None, nullable=True, low=1)}),
    check=_make_attack,
    doc="{name: fgsm|pgd|spsa|apgd|fab|square|autoattack|patch_swap, "
        "**its arguments}",
    component=True)
SWEEP = Section({
    "attack": Section(_attack_fields({}, exclude=("eps",)), component=True),
    "eps": Seq(Field("float", low=0.0), REQUIRED, min_length=1),
}, default=None, nullable=True, check=_check_sweep)


CORRUPTIONS = Section({
    "names": Seq(Field("str", choices=CORRUPTION_FUNCTIONS), None,
                 nullable=True, doc="None: all 15"),
    "severities": Seq(Field("int", low=1, high=5), SEVERITIES,
                      min_length=1),
    "num_examples": Field("int", None, nullable=True, low=1),
}, default=None, nullable=True)

def _check_robustness(value: dict[str, Any]) -> None:
  """What spans the section's fields; the evaluation datasets
  (`check_datasets`)."""
  require(value.get("checkpoint_dir") != "", "checkpoint_dir",
          "is empty; give the workdir of the training run to evaluate, or "
          "leave it None to train")
  require(not (value.get("from_init") and value.get("checkpoint_dir")),
          "from_init", "evaluates the params the init section loads; unset "
          "robustness.checkpoint_dir (it names another source)")
  check_datasets(value.get("datasets"), field="datasets")


ROBUSTNESS = Section({
    "num_examples": Field("int", None, nullable=True, low=1),
    "attacks": Seq(ATTACK, ()),
    "sweep": SWEEP,
    "corruptions": CORRUPTIONS,
    "datasets": Field("mapping", None, nullable=True,
                      doc="{name: {kind, source, ...}}: "
                          "vmoe_ext.evaluate.datasets"),
    "seed": Field("int", 0, low=0),
    "per_example": Field("bool", False,
                         doc="also write per_example.npz: each test image's "
                             "top-1 / top-5 correctness per evaluation"),
    "checkpoint_dir": Field("str", None, nullable=True,
                            doc="set: only evaluate that run's checkpoint"),
    "from_init": Field("bool", False,
                       doc="only evaluate the params `init` loads"),
}, default=None, nullable=True, check=_check_robustness)

__all__ = ["ATTACK", "CORRUPTIONS", "ROBUSTNESS", "SWEEP"]
