"""The sections of a training run: `seed`, `train`, `optimizer`, `init`.

    seed        int >= 0: seeds parameters, data order, router noise
    train       steps, logging, evaluation and checkpoint cadence, loss,
                label smoothing, mixup
    optimizer   `vmoe_ext.train.optimizer.OPTIMIZER` (its own module)
    init        initialise from another run's or a foreign checkpoint
                (`vmoe_ext.train.initialization`)
"""

from __future__ import annotations

import re
from typing import Any

from vmoe_ext.classification import LOSSES  # vmoe's names
from vmoe_ext.config.schema import REQUIRED, Field, Section, Seq
from vmoe_ext.errors import ConfigError, require
from vmoe_ext.train.optimizer import OPTIMIZER

MIXUP = Section({
    "concentration": Field("float", None, nullable=True, low=0.0,
                           doc="Dirichlet concentration; 0/None: off"),
    "size": Field("int", 2, low=1, doc="examples per mixed example"),
    "granularity": Field("str", "device",
                         choices=("batch", "device", "example")),
    "groups": Field("int", None, nullable=True, low=1,
                    doc="mixing groups; None: jax.device_count()"),
}, default=None, nullable=True,
                doc="vmoe's mixup in the train step (soft labels)")

SEED = Field("int", 0, low=0, doc="seeds parameters, data order, noise")

TRAIN = Section({
    "total_steps": Field("int", REQUIRED, low=1),
    "log_every": Field("int", REQUIRED, low=1),
    "eval_every": Field("int", 0, low=0, doc="0: only at the end"),
    "checkpoint_every": Field("int", REQUIRED, low=1),
    "keep_checkpoints": Field("int", REQUIRED, low=1),
    "label_smoothing": Field("float", 0.0, low=0.0, high=1.0,
                             high_open=True),
    "loss": Field("str", LOSSES[0], choices=LOSSES,
                  doc="vmoe's loss names; also the evaluation loss"),
    "mixup": MIXUP,
})


def _check_init(value: dict[str, Any]) -> None:
  has_file = value.get("checkpoint") is not None
  require(has_file or value.get("workdir"), "workdir",
          "must not be empty (or set init.checkpoint to import a foreign "
          "checkpoint)")
  require(not (has_file and value.get("workdir")), "checkpoint",
          "set only one of init.workdir and init.checkpoint")
  require(value.get("rules") or value.get("layout"), "rules",
          "is empty: give rules, or a layout ('vmoe', 'vit_jax') whose "
          "rules to use")
  require(not value.get("upcycle") or value.get("layout") == "vit_jax",
          "upcycle",
          "only applies to layout 'vit_jax' (experts from dense MLPs)")
  for i, (target, _) in enumerate(value.get("rules") or ()):
    require(target is not None, f"rules[{i}][0]", "must be a regex, not None")
    try:
      re.compile(target)
    except re.error as e:
      raise ConfigError(f"rules[{i}][0]", f"invalid regex {target!r}: {e}"
                        ) from e


INIT = Section({
    "workdir": Field("str", None, nullable=True,
                     doc="the run whose checkpoint to load"),
    "step": Field("int", None, nullable=True, low=0, doc="None: newest"),
    "checkpoint": Field("str", None, nullable=True,
                        doc="a foreign checkpoint file or prefix instead"),
    "format": Field("str", "auto", choices=("auto", "vmoe", "npz",
                                            "msgpack")),
    "layout": Field("str", None, nullable=True, choices=("vmoe", "vit_jax"),
                    doc="the foreign tree's names; its rules if rules=()"),
    "upcycle": Field("bool", False,
                     doc="vit_jax layout: experts from the dense MLPs"),
    "strict": Field("bool", False, doc="every param and leaf must map"),
    # Sources may be None (keep the fresh init); initialization.parse_rules
    # checks each pair's types in detail.
    "rules": Seq(Seq(Field("str", nullable=True), length=2), (),
                 doc="(target_regex, source_replacement or None) pairs"),
}, default=None, nullable=True, check=_check_init)

__all__ = ["INIT", "LOSSES", "MIXUP", "OPTIMIZER", "SEED", "TRAIN"]
