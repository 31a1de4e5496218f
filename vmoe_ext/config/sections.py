"""The schema of the training binary's config, one `Section` per section.

    seed        int >= 0
    data        dataset name and batching; dataset-specific fields
    model       `VisionTransformerMoe`'s fields; `moe` = `MOE_DEFAULTS`'s
                fields; `moe.router` / `stream` = the selected class's fields
    optimizer   `vmoe_ext.train.optimizer` (types here, ranges there)
    train       steps, logging, evaluation and checkpoint cadence
    robustness  attacks, eps sweep, corruptions, evaluation datasets (optional)
    init        initialise from another run's checkpoint (optional)
    carve       carve mode: a dense ViT checkpoint into a V-MoE (optional)

The model's fields are read from the classes that define them, at call time,
so a new router, stream or MoE field needs no edit here; their range checks
stay in the components' own constructors, run by `Section.check` inside
`field_scope` so that errors carry the full path. Components are imported
lazily: importing this module is cheap and creates no import cycle.
"""

from __future__ import annotations

import re
from typing import Any, Mapping, Optional

from vmoe_ext.config.schema import (REQUIRED, Field, OneOf, Section, Seq,
                                    Spec, dataclass_fields, default_fields,
                                    function_fields, renamed_scope)
from vmoe_ext.errors import ConfigError, require

# ----------------------------------------------------------------- seed, train

SEED = Field("int", 0, low=0, doc="seeds parameters, data order, noise")

TRAIN = Section({
    "total_steps": Field("int", REQUIRED, low=1),
    "log_every": Field("int", REQUIRED, low=1),
    "eval_every": Field("int", 0, low=0, doc="0: only at the end"),
    "checkpoint_every": Field("int", REQUIRED, low=1),
    "keep_checkpoints": Field("int", REQUIRED, low=1),
    "label_smoothing": Field("float", 0.0, low=0.0, high=1.0,
                             high_open=True),
    "loss": Field("str", "softmax_xent",
                  choices=("softmax_xent", "sigmoid_xent"),
                  doc="vmoe's loss names; also the evaluation loss"),
    "mixup": Section({
        "concentration": Field("float", None, nullable=True, low=0.0,
                               doc="Dirichlet concentration; 0/None: off"),
        "size": Field("int", 2, low=1, doc="examples per mixed example"),
        "granularity": Field("str", "device",
                             choices=("batch", "device", "example")),
        "groups": Field("int", None, nullable=True, low=1,
                        doc="mixing groups; None: jax.device_count()"),
    }, default=None, nullable=True,
                     doc="vmoe's mixup in the train step (soft labels)"),
})

# ------------------------------------------------------------------------ data

_STAT = OneOf((Field("float"), Seq(Field("float"), min_length=1)),
              "a number or a list of per-channel numbers", nullable=True)
DATA_COMMON: dict[str, Spec] = {
    "name": Field("str", REQUIRED, choices=lambda: _dataset_names()),
    "batch_size": Field("int", REQUIRED, low=1),
    "eval_batch_size": Field("int", REQUIRED, low=1),
    "image_size": Field("int", None, nullable=True, low=1,
                        doc="resize to this side (None: native)"),
    "augment": Field("bool", False),
    "flip": Field("bool", False),
    "pad": Field("int", None, nullable=True, low=0),
    "mean": _STAT,
    "std": _STAT,
}
DATA_TFDS: dict[str, Spec] = {
    "tfds_name": Field("str", REQUIRED),
    "data_dir": Field("str", None, nullable=True,
                      doc="required to load; checked when loading"),
    "train_split": Field("str", "train"),
    "test_split": Field("str", "test"),
    "max_examples": Field("int", None, nullable=True, low=1),
    "image_key": Field("str", None, nullable=True),
    "label_key": Field("str", None, nullable=True),
    "streaming": Field("bool", False,
                       doc="stream the train split (Grain), not in memory"),
    "pp_train": Field("str", None, nullable=True,
                      doc="train preprocessing string; streaming only"),
    "worker_count": Field("int", 0, low=0,
                          doc="streaming: preprocessing processes (0: none)"),
    "pp_eval": Field("str", None, nullable=True,
                     doc="streaming: eval preprocessing string; set: the "
                         "test split streams too"),
    "analysis_examples": Field("int", 1024, low=1,
                               doc="with pp_eval: test examples held in "
                                   "memory for routing analysis/robustness"),
}


def _dataset_names() -> tuple[str, ...]:
  from vmoe_ext.data.loader import DATASET_NAMES
  return DATASET_NAMES


def _data_fields(value: Mapping[str, Any]) -> dict[str, Spec]:
  name = value.get("name")
  fields = dict(DATA_COMMON)
  if name == "tfds":
    fields.update(DATA_TFDS)
  elif name == "synthetic_clusters":
    from vmoe_ext.data.synthetic import DEFAULTS
    extra = default_fields(DEFAULTS, {"features_per_class": Field("int")})
    fields.update({k: v for k, v in extra.items() if k not in fields})
  return fields


def _check_data(value: dict[str, Any]) -> None:
  """Streaming fields (`vmoe_ext.data.stream_iterator`)."""
  if value.get("name") != "tfds":
    return
  if value.get("streaming"):
    from vmoe_ext.data.stream_iterator import check_streaming_config
    check_streaming_config(value)
  else:
    for key in ("pp_train", "pp_eval"):
      require(value.get(key) is None, key,
              "only used with data.streaming=True (the in-memory path "
              "preprocesses with data.image_size / augment / flip / pad)")


DATA = Section(_data_fields, check=_check_data)

# ----------------------------------------------------------------------- model


def registered(registry: Any, fixed: tuple[str, ...] = (),
               default_name: Optional[str] = None, default: Any = REQUIRED,
               nullable: bool = False) -> Section:
  """The section `{"name": ..., **fields}` of a registered dataclass.

  Its fields are the dataclass fields of the class that `name` selects
  (minus `fixed`, which the builder sets); unknown names list the registry.
  """

  def fields(value: Mapping[str, Any]) -> dict[str, Spec]:
    name = value.get("name", default_name)
    require(name is not None, "name", "is required")
    registry.check(name, field="name")
    out: dict[str, Spec] = {"name": Field("str", default_name or REQUIRED)}
    cls = registry.get(name)
    out.update(dataclass_fields(cls, exclude=fixed))
    for key in getattr(cls, "nested_routers", ()):  # e.g. ACMoE's `base`.
      out[key] = registered(registry, fixed=fixed, default=out[key].default)
    return out

  return Section(fields, default=default, nullable=nullable)


def _registries() -> dict[str, Any]:
  """Sub-sections of the model that select a registered class by name."""
  from vmoe_ext.routers.registry import ROUTERS
  from vmoe_ext.streams import STREAMS
  return {"router": ROUTERS, "stream": STREAMS}


def _subsections(fields: dict[str, Spec], soft: bool) -> dict[str, Spec]:
  registries = _registries()
  for key, spec in fields.items():
    if key == "router":
      fields[key] = registered(registries[key], fixed=("num_experts",),
                               default_name="soft" if soft else None,
                               default={"name": "soft"} if soft
                               else spec.default)
    elif key == "stream":
      fields[key] = registered(registries[key], default=spec.default,
                               nullable=True)
  return fields


def _moe_fields(soft: bool):
  """Fields of `model.moe`: the keys of `MOE_DEFAULTS`, read at call time.

  Types come from where each field is consumed: `resolve_moe_layers`
  (placement), `MoeLayer` (layer fields), `Router` (num_experts).
  """

  def fields(value: Mapping[str, Any]) -> dict[str, Spec]:
    del value
    from vmoe_ext.models.placement import resolve_moe_layers
    from vmoe_ext.models.vit import MOE_DEFAULTS
    from vmoe_ext.moe.contract import Router
    from vmoe_ext.moe.layer import MoeLayer
    types = {**function_fields(resolve_moe_layers), **dataclass_fields(Router),
             **dataclass_fields(MoeLayer)}
    types = {k: v for k, v in types.items() if k in MOE_DEFAULTS}
    types["num_experts"] = Field("int", low=1)
    return _subsections(default_fields(MOE_DEFAULTS, types), soft)

  return fields


def _model_fields(value: Mapping[str, Any]) -> dict[str, Spec]:
  from vmoe_ext.models import MODELS
  from vmoe_ext.models.vit import VisionTransformerMoe
  fields: dict[str, Spec] = {"name": Field("str", REQUIRED, choices=MODELS)}
  fields.update(dataclass_fields(VisionTransformerMoe))
  soft = value.get("name") == "soft_moe_vit"
  if "moe" in fields:
    fields["moe"] = Section(_moe_fields(soft), default=None, nullable=True)
  return _subsections(fields, soft)


def _build_model(value: dict[str, Any]) -> None:
  """The model's own checks (ranges, placement, router `__post_init__`)."""
  from vmoe_ext.models import build_model
  build_model(value)


MODEL = Section(_model_fields, check=_build_model)

# ------------------------------------------------------------------- optimizer

OPTIMIZER = Section({
    "name": Field("str", REQUIRED, choices=lambda: _optimizers()),
    "learning_rate": Field("float", REQUIRED),
    "warmup_steps": Field("int", 0),
    "decay": Field("str", "cosine"),
    "total_steps": Field("int", None, nullable=True),
    "end_learning_rate": Field("float", 0.0),
    "b1": Field("float", 0.9),
    "b2": Field("float", 0.999),
    "eps": Field("float", 1e-8),
    "momentum": Field("float", 0.0),
    "nesterov": Field("bool", False),
    "weight_decay": Field("float", 0.0),
    "weight_decay_mask": Field("str", "no_bias_norm"),
    "clip_global_norm": Field("float", None, nullable=True),
    "frozen": Seq(Field("str"), (), doc="regexes of params never updated"),
}, doc="types only; `vmoe_ext.train.optimizer` checks ranges and "
       "combinations (it validates against this section itself)")


def _optimizers() -> Any:
  from vmoe_ext.train.optimizer import OPTIMIZERS
  return OPTIMIZERS

# ------------------------------------------------------------------ robustness

# Arguments of an attack function that are not config fields.
_ATTACK_CALL_ARGS = ("logits_fn", "x", "labels", "key")


def _attack_fields(extra: Mapping[str, Spec], exclude: tuple[str, ...] = ()):

  def fields(value: Mapping[str, Any]) -> dict[str, Spec]:
    from vmoe_ext.attacks import ATTACKS
    require("name" in value, "name", "is required")
    fn = ATTACKS.get(value["name"], field="name")
    out: dict[str, Spec] = {"name": Field("str", REQUIRED)}
    out.update(function_fields(fn, exclude=_ATTACK_CALL_ARGS + exclude))
    out.update(extra)
    return out

  return fields


def _make_attack(value: Mapping[str, Any]) -> None:
  from vmoe_ext.attacks import make_attack
  with renamed_scope("attack", ""):
    make_attack({k: v for k, v in value.items() if k != "num_examples"})


def _check_sweep(value: dict[str, Any]) -> None:
  from vmoe_ext.attacks import make_attack
  for i, eps in enumerate(value["eps"]):
    try:
      make_attack({**value["attack"], "eps": eps})
    except ConfigError as e:
      if e.field == "attack.eps":
        raise ConfigError(f"eps[{i}]", e.reason) from e
      raise


ATTACK = Section(
    _attack_fields({"num_examples": Field("int", None, nullable=True, low=1)}),
    check=_make_attack, doc="{name: fgsm|pgd|spsa, **its arguments}")
SWEEP = Section({
    "attack": Section(_attack_fields({}, exclude=("eps",))),
    "eps": Seq(Field("float", low=0.0), REQUIRED, min_length=1),
}, default=None, nullable=True, check=_check_sweep)


def _corruption_names() -> Any:
  from vmoe_ext.data.corruptions import CORRUPTION_FUNCTIONS
  return CORRUPTION_FUNCTIONS


CORRUPTIONS = Section({
    "names": Seq(Field("str", choices=_corruption_names), None,
                 nullable=True, doc="None: all 15"),
    "severities": Seq(Field("int", low=1, high=5), (1, 2, 3, 4, 5)),
    "num_examples": Field("int", None, nullable=True, low=1),
}, default=None, nullable=True)

def _check_robustness(value: dict[str, Any]) -> None:
  require(value.get("checkpoint_dir") != "", "checkpoint_dir",
          "is empty; give the workdir of the training run to evaluate, or "
          "leave it None to train")
  require(not (value.get("from_init") and value.get("checkpoint_dir")),
          "from_init", "evaluates the params the init section loads; unset "
          "robustness.checkpoint_dir (it names another source)")


ROBUSTNESS = Section({
    "num_examples": Field("int", None, nullable=True, low=1),
    "attacks": Seq(ATTACK, ()),
    "sweep": SWEEP,
    "corruptions": CORRUPTIONS,
    "datasets": Field("mapping", None, nullable=True,
                      doc="checked by vmoe_ext.evaluate.datasets"),
    "seed": Field("int", 0, low=0),
    "checkpoint_dir": Field("str", None, nullable=True,
                            doc="set: only evaluate that run's checkpoint"),
    "from_init": Field("bool", False,
                       doc="only evaluate the params `init` loads"),
}, default=None, nullable=True, check=_check_robustness)

# ------------------------------------------------------------------------ init


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

# ----------------------------------------------------------------------- carve


def _carve_fields(value: Mapping[str, Any]) -> dict[str, Spec]:
  del value
  from vmoe_ext.carving.spec import CarveSpec
  return dataclass_fields(CarveSpec)


def _check_carve(value: dict[str, Any]) -> None:
  """Ranges that need no other section (the rest: `CarveSpec.check`)."""
  from vmoe_ext.carving.spec import CarveSpec
  CarveSpec.from_config(value)


CARVE = Section(_carve_fields, default=None, nullable=True, check=_check_carve,
                doc="carve mode: a dense ViT checkpoint into a V-MoE (CMoE)")

# -------------------------------------------------------------------- sharding


def _check_sharding(value: dict[str, Any]) -> None:
  from vmoe_ext.sharding.mesh import check_layout, sharding_config
  check_layout(sharding_config(value))


SHARDING = Section({
    "axes": Seq(Field("str"), ("data", "expert"), min_length=1,
                doc="mesh axis names"),
    "shape": Seq(Field("int", low=-1), (-1, 1), min_length=1,
                 doc="one size per axis; one -1: the devices left over"),
    "expert_axis": Field("str", "expert", nullable=True,
                         doc="experts split over it; None: replicated"),
    "rules": Seq(Seq(Field("any"), length=2), None, nullable=True,
                 doc="(regex, PartitionSpec tuple) pairs; None: experts "
                 "over expert_axis, the rest replicated"),
}, default=None, nullable=True, check=_check_sharding,
                   doc="device mesh and partition rules (vmoe_ext.sharding)")

# ------------------------------------------------------------------------ root

CONFIG = Section({
    "seed": SEED,
    "data": DATA,
    "model": MODEL,
    "optimizer": OPTIMIZER,
    "train": TRAIN,
    "robustness": ROBUSTNESS,
    "init": INIT,
    "carve": CARVE,
    "sharding": SHARDING,
})
SECTIONS = tuple(CONFIG.fields_of({}))

__all__ = ["ATTACK", "CARVE", "CONFIG", "DATA", "INIT", "MODEL", "OPTIMIZER",
           "ROBUSTNESS", "SECTIONS", "SEED", "TRAIN", "registered"]
