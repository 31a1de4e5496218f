"""The root config schema, and resolving a config once per run.

The root schema is assembled here from the sections each package declares
beside the code it configures:

    seed, train, optimizer, init   vmoe_ext.train.config
    data                           vmoe_ext.data.config
    model                          vmoe_ext.models.config
    robustness                     vmoe_ext.evaluate.config
    carve                          vmoe_ext.carving.config
    sharding                       vmoe_ext.sharding.config

`resolve_config(config)` validates the whole config (unknown fields at any
depth, types, NaN/inf, ranges, each section's own checks, then what spans
sections) and returns it with every absent field set to its schema default:
the config every part of the run reads, so no part restates a default. The
model's own checks (placement, a router's `__post_init__`, the MoE layer's
ranges) run where the model is built, once per run, right after
(`vmoe_ext.app.context.RunContext.assemble`); `validate_config` runs both.
A `ConfigError` names the full dotted path as the user wrote it.
"""

from __future__ import annotations

from typing import Any, Mapping

import jax
import ml_collections

from vmoe_ext.carving.config import CARVE
from vmoe_ext.carving.spec import CarveSpec
from vmoe_ext.classification import LOSSES
from vmoe_ext.config.defaults import fill_defaults
from vmoe_ext.config.schema import Section, plain, validate
from vmoe_ext.data.config import DATA
from vmoe_ext.data.text_config import TEXT_DATASET_NAME
from vmoe_ext.errors import require
from vmoe_ext.evaluate.config import ROBUSTNESS
from vmoe_ext.models import LANGUAGE_MODEL, build_model
from vmoe_ext.models.config import MODEL
from vmoe_ext.sharding.config import SHARDING
from vmoe_ext.train.config import INIT, MIXUP, OPTIMIZER, SEED, TRAIN


def _check_mixup(config: Mapping[str, Any]) -> None:
  """With mixup on: the batch splits into the mixing groups, and `size`
  examples fit in one group (`groups=None`: one group per device)."""
  mixup = fill_defaults(MIXUP, config["train"].get("mixup"))
  if mixup is None or not mixup["concentration"]:
    return
  groups = mixup["groups"]
  resolved = (f"groups=None resolves to jax.device_count() = "
              f"{jax.device_count()}, vmoe's one group per device")
  if groups is None:
    groups = jax.device_count()
  size = mixup["size"]
  batch = config["data"]["batch_size"]
  require(batch % groups == 0, "train.mixup.groups",
          f"data.batch_size={batch} does not split into {groups} mixing "
          f"groups of equal size ({resolved})")
  require(size <= batch // groups, "train.mixup.size",
          f"{size} examples per mixed example exceed the {batch // groups} "
          f"examples of a mixing group (data.batch_size={batch} / {groups} "
          f"groups; {resolved})")


def _check_across_sections(config: dict[str, Any]) -> None:
  """What no single section can check."""
  train_steps = config["train"]["total_steps"]
  total = config["optimizer"].get("total_steps")
  require(total in (None, train_steps), "optimizer.total_steps",
          f"{total} differs from train.total_steps={train_steps}; the "
          "schedule would not end with the run")
  robustness = config.get("robustness")
  require(not (robustness is not None and robustness.get("from_init"))
          or config.get("init") is not None, "robustness.from_init",
          "evaluates the params the init section loads, but init is None")
  _check_mixup(config)
  _check_language_run(config)
  if config.get("carve") is not None:
    _check_carve(config)


def _check_language_run(config: Mapping[str, Any]) -> None:
  """A language model reads text data and text data feeds only it; the
  image-classification options do not apply to it."""
  is_lm = config["model"].get("name") == LANGUAGE_MODEL
  is_text = config["data"].get("name") == TEXT_DATASET_NAME
  if not is_lm:
    require(not is_text, "data.name",
            f"'{TEXT_DATASET_NAME}' (a language-model corpus) feeds model "
            f"'{LANGUAGE_MODEL}', not {config['model'].get('name')!r}")
    return
  require(is_text, "data.name",
          f"model '{LANGUAGE_MODEL}' reads a text corpus: data.name="
          f"'{TEXT_DATASET_NAME}', got {config['data'].get('name')!r}")
  train = config["train"]
  mixup = fill_defaults(MIXUP, train.get("mixup"))
  robustness = config.get("robustness")
  if robustness is not None:
    _check_lm_evaluation(robustness)
  not_for_lm = (
      ("carve", config.get("carve") is not None,
       "carving reads an image model; set carve=None"),
      ("train.mixup", mixup is not None and bool(mixup["concentration"]),
       "mixes images; set it None for a language model"),
      ("train.label_smoothing", bool(train.get("label_smoothing")),
       "a language model is trained on the token NLL; set 0"),
      ("train.loss", train.get("loss", LOSSES[0]) != LOSSES[0],
       f"a language model is trained on the token NLL (softmax "
       f"cross-entropy, {LOSSES[0]!r})"),
  )
  for field, bad, why in not_for_lm:
    require(not bad, field, why)


def _check_lm_evaluation(robustness: Mapping[str, Any]) -> None:
  """A language model's `robustness` section may only name the checkpoint
  to evaluate (the evaluate-only mode); the image evaluations (attacks,
  corruptions, datasets) do not apply to it, and its word-swap attack is
  `data.word_swap_rate`."""
  why = ("the image robustness evaluation does not apply to a language "
         "model (its word-swap attack is data.word_swap_rate); a language "
         "model's robustness section only sets checkpoint_dir (evaluate "
         "that run's checkpoint), else set robustness=None")
  defaults = fill_defaults(ROBUSTNESS, {})
  values = fill_defaults(ROBUSTNESS, robustness)
  for key, default in defaults.items():
    if key not in ("checkpoint_dir", "seed"):
      require(values[key] == default, f"robustness.{key}", why)
  require(values["checkpoint_dir"] is not None, "robustness.checkpoint_dir",
          "required in a language model's robustness section: the workdir "
          "of the training run to evaluate (or set robustness=None to "
          "train)")


def _check_carve(config: Mapping[str, Any]) -> None:
  """The carve section against the model it carves and the data it reads."""
  CarveSpec.from_config(config["carve"]).check(config["model"])
  data = config["data"]
  require(not (data.get("name") == "tfds" and data.get("streaming"))
          or data.get("pp_eval"), "data.pp_eval",
          "required by the carve mode with data.streaming=True: the "
          "calibration images of the train split are preprocessed as for "
          "evaluation, e.g. 'decode|resize_small(256)|central_crop(224)|"
          "value_range(-1, 1)'")


CONFIG = Section({
    "seed": SEED,
    "data": DATA,
    "model": MODEL,
    "train": TRAIN,  # Before the optimizer, whose schedule follows it.
    "optimizer": OPTIMIZER,
    "robustness": ROBUSTNESS,
    "init": INIT,
    "carve": CARVE,
    "sharding": SHARDING,
}, check=_check_across_sections)
SECTIONS = tuple(CONFIG.fields_of({}))
# Exclusive fields: one set on the command line drops the config file's
# other one (`vmoe_ext.config.overrides.drop_alternatives`).
ALTERNATIVES = (("model.moe.layers", "model.moe.every"),)


def resolve_config(config: Any) -> ml_collections.ConfigDict:
  """The validated `config` with every absent field set to its default.

  Args:
    config: a run config (ConfigDict or dict; not modified).

  Returns:
    A new ConfigDict holding every field of every section that is on
    (sections that are None stay None).

  Raises:
    ConfigError: the first invalid field, by its full dotted path.
  """
  validate(CONFIG, config)
  return ml_collections.ConfigDict(fill_defaults(CONFIG, plain(config)))


def validate_config(config: Any) -> None:
  """Raises `ConfigError` naming the first invalid field: everything a run
  checks before reading data, i.e. `resolve_config` and the model's own
  checks (placement, routers, MoE layers), which run when the model is
  built (`RunContext.assemble` builds it once per run). A language model
  whose `vocab_size` is None (the corpus's, known once the data is read) is
  checked with a stand-in vocabulary of one token."""
  model = resolve_config(config).model.to_dict()
  if model["name"] == LANGUAGE_MODEL and model.get("vocab_size") is None:
    model["vocab_size"] = 1
  build_model(model)


__all__ = ["ALTERNATIVES", "CONFIG", "SECTIONS", "resolve_config",
           "validate_config"]
