"""Config schema, component registries and the binary's bad-input handling.

Every config error names the full dotted path as the user wrote it and is
raised before anything compiles; errors that are not about the config are
not `ConfigError`s.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import ml_collections
import numpy as np
import pytest

from vmoe_ext.app.schema import CONFIG
from vmoe_ext.config import REQUIRED, Field, Section, Seq, validate
from vmoe_ext.config.overrides import prepare_overrides
from vmoe_ext.models.config import registered
from vmoe_ext.errors import ConfigError
from vmoe_ext.registry import Registry
from vmoe_ext.train.config_files import CONFIG_DIR, load_config, load_config_flag
from vmoe_ext.app.schema import validate_config

ROOT = os.path.dirname(CONFIG_DIR)


def _tiny() -> ml_collections.ConfigDict:
  return load_config("tiny")


def _error(config) -> ConfigError:
  with pytest.raises(ConfigError) as info:
    validate_config(config)
  return info.value


# ------------------------------------------------------------ unknown fields


def _set(config, path, value):
  *parents, leaf = path.split(".")
  node = config
  for p in parents:
    node = node[p]
  with node.unlocked() if hasattr(node, "unlocked") else _null():
    node[leaf] = value
  return config


class _null:

  def __enter__(self):
    return self

  def __exit__(self, *args):
    return False


@pytest.mark.parametrize("path,value", [
    ("data.batchsize", 16),
    ("train.totl_steps", 5),
    ("model.moe.router.num_selectd", 2),
    ("model.moe.groupsize", 10),
    ("optimizer.learning_rte", 0.1),
    ("bogus_section", 1),
])
def test_unknown_fields_name_their_full_path(path, value):
  e = _error(_set(_tiny(), path, value))
  assert e.field == path
  assert "unknown field" in e.reason


def test_unknown_field_suggests_the_close_name():
  e = _error(_set(_tiny(), "data.batchsize", 16))
  assert "did you mean 'batch_size'" in str(e)


def test_unknown_field_set_in_a_config_file(tmp_path):
  path = tmp_path / "typo.py"
  path.write_text(
      "from vmoe_ext.train.config_files import load_config\n"
      "def get_config(arg=None):\n"
      "  c = load_config('tiny')\n"
      "  c.data.batchsize = 16\n"
      "  return c\n")
  e = _error(load_config(str(path)))
  assert e.field == "data.batchsize"


def test_unknown_override_on_the_command_line():
  with pytest.raises(ConfigError) as info:
    prepare_overrides(_tiny(), ["prog", "--config.model.moe.router.num_selectd=2",
                              "--workdir=/tmp/x"], CONFIG)
  assert info.value.field == "model.moe.router.num_selectd"
  assert "did you mean 'num_selected'" in str(info.value)
  prepare_overrides(_tiny(), ["prog", "--config.model.moe.router.num_selected=2"], CONFIG)


def test_dataset_specific_fields_follow_the_name():
  config = _tiny()
  e = _error(_set(config, "data.tfds_name", "cifar10"))  # name is "digits"
  assert e.field == "data.tfds_name"
  config.data.name = "tfds"
  validate_config(config)


# --------------------------------------------------------------- wrong types


@pytest.mark.parametrize("path,value,message", [
    ("data.batch_size", "16", "must be an integer"),
    ("data.batch_size", True, "must be an integer"),  # bool is not an int
    ("data.augment", 1, "must be True or False"),
    ("train.label_smoothing", "0.1", "must be a number"),
    ("seed", 1.5, "must be an integer"),
    ("model.num_layers", 2.0, "must be an integer"),
])
def test_wrong_types_name_the_field(path, value, message):
  config = _tiny()
  with config.ignore_type():
    e = _error(_set(config, path, value))
  assert e.field == path and message in e.reason


def test_wrong_types_inside_component_sections():
  config = _tiny()
  config.model.moe = dict(every=2, num_experts="2", group_size=10,
                          router=dict(name="noisy_topk"))
  assert _error(config).field == "model.moe.num_experts"
  config.model.moe = dict(every=2, num_experts=2, group_size=10,
                          router=dict(name="noisy_topk", noise_std="1"))
  assert _error(config).field == "model.moe.router.noise_std"
  config.model.moe = dict(every=2, num_experts=2, group_size=10,
                          router=dict(name="noisy_topk", num_selected=True))
  assert _error(config).field == "model.moe.router.num_selected"


# ------------------------------------------------------------------ NaN / inf


@pytest.mark.parametrize("path", [
    "optimizer.learning_rate", "model.moe.capacity_factor",
    "model.dropout_rate", "train.label_smoothing",
])
@pytest.mark.parametrize("value", [float("nan"), float("inf"),
                                   float("-inf")])
def test_non_finite_floats_are_errors(path, value):
  e = _error(_set(_tiny(), path, value))
  assert e.field == path and "finite" in e.reason


def test_non_finite_attack_argument_names_the_list_entry():
  config = _tiny()
  config.robustness.attacks = (dict(name="fgsm", eps=0.1),
                               dict(name="pgd", eps=float("nan"), steps=2))
  e = _error(config)
  assert e.field == "robustness.attacks[1].eps" and "finite" in e.reason


# ---------------------------------------------------- ranges and nested paths


@pytest.mark.parametrize("mutate,field", [
    (lambda c: c.model.moe.router.update(num_selected=5),
     "model.moe.router.num_selected"),
    (lambda c: c.model.moe.update(num_experts=0), "model.moe.num_experts"),
    (lambda c: c.model.moe.update(capacity_factor=0.0),
     "model.moe.capacity_factor"),
    (lambda c: c.model.moe.router.update(name="switch"),
     "model.moe.router.name"),
    (lambda c: c.model.update(num_heads=3), "model.num_heads"),
    (lambda c: c.model.update(name="resnet"), "model.name"),
    (lambda c: c.data.update(batch_size=0), "data.batch_size"),
    (lambda c: c.train.update(label_smoothing=1.0), "train.label_smoothing"),
    (lambda c: c.optimizer.update(name="lamb"), "optimizer.name"),
    (lambda c: c.optimizer.update(warmup_steps=100), "optimizer.warmup_steps"),
    (lambda c: setattr(c.robustness, "attacks", (
        dict(name="fgsm", eps=0.1), dict(name="pgd", eps=-1.0, steps=2))),
     "robustness.attacks[1].eps"),
    (lambda c: setattr(c.robustness, "attacks", (
        dict(name="pgd", eps=0.1, stepz=2),)), "robustness.attacks[0].stepz"),
    (lambda c: setattr(c.robustness, "attacks", (dict(name="cw", eps=0.1),)),
     "robustness.attacks[0].name"),
    (lambda c: setattr(c.robustness, "sweep", dict(
        attack=dict(name="pgd", steps=-1), eps=(0.0, 0.1))),
     "robustness.sweep.attack.steps"),
    (lambda c: setattr(c.robustness, "sweep", dict(
        attack=dict(name="pgd", steps=1), eps=(0.0, -0.1))),
     "robustness.sweep.eps[1]"),
    (lambda c: setattr(c.robustness, "corruptions", dict(
        names=("fog", "rain"))), "robustness.corruptions.names[1]"),
    (lambda c: setattr(c.robustness, "corruptions", dict(severities=(0,))),
     "robustness.corruptions.severities[0]"),
])
def test_errors_name_the_full_dotted_path(mutate, field):
  config = _tiny()
  mutate(config)
  e = _error(config)
  assert e.field == field, str(e)
  assert str(e).startswith(field + ": ")


def test_soft_moe_router_defaults_to_soft_and_checks_its_fields():
  config = load_config("soft_moe")
  validate_config(config)
  config.model.moe = dict(every=2, num_experts=4, group_size=None,
                          router=dict(num_slots=0))
  assert _error(config).field == "model.moe.router.num_slots"
  config.model.moe = dict(every=2, num_experts=4, group_size=None,
                          router=dict(num_slots=4, num_selected=2))
  assert _error(config).field == "model.moe.router.num_selected"


def test_stream_section_is_checked():
  config = _tiny()
  config.model.stream = dict(name="nesterov")
  assert _error(config).field == "model.stream.name"


# ------------------------------------------------------------------- init


def test_init_section():
  config = _tiny()
  config.init = ml_collections.ConfigDict(dict(
      workdir="runs/pretrained", step=None,
      rules=((r"encoderblock_(\d+)/Moe/.*", r"\g<0>"),)))
  validate_config(config)
  for value, field in [
      (dict(step=3), "init.workdir"),
      (dict(workdir="", step=None), "init.workdir"),
      (dict(workdir="w", step=-1), "init.step"),
      (dict(workdir="w", step=1.5), "init.step"),
      (dict(workdir="w", rules=(("a(", "b"),)), "init.rules[0][0]"),
      (dict(workdir="w", rules=(("a", "b", "c"),)), "init.rules[0]"),
      (dict(workdir="w", rules=(("a", 3),)), "init.rules[0][1]"),
      (dict(workdir="w", rule=()), "init.rule"),
  ]:
    config.init = ml_collections.ConfigDict(value)
    assert _error(config).field == field, value


# ----------------------------------------------------- derived from classes


def test_moe_fields_are_read_from_moe_defaults_at_call_time(monkeypatch):
  from vmoe_ext.models import vit
  monkeypatch.setitem(vit.MOE_DEFAULTS, "new_knob", 3)
  config = _tiny()
  config.model.moe.new_knob = 4
  validate(CONFIG.fields["model"].fields_of(config.model.to_dict())["moe"],
           config.model.moe, "model.moe")
  with config.ignore_type():
    config.model.moe.new_knob = "x"
  with pytest.raises(ConfigError) as info:
    validate(CONFIG, config)
  assert info.value.field == "model.moe.new_knob"


@dataclasses.dataclass
class _ToyRouter:
  num_experts: int
  temperature: float = 1.0
  hard: bool = False

  def __post_init__(self):
    if self.temperature <= 0:
      raise ConfigError("temperature", "must be > 0")


def test_registered_sections_take_fields_from_the_class():
  spec = Section({"router": registered(
      Registry("router", {"toy": _ToyRouter}), fixed=("num_experts",))},
                 check=lambda v: _ToyRouter(num_experts=2, **{
                     k: x for k, x in v["router"].items() if k != "name"}))
  validate(spec, {"router": {"name": "toy", "temperature": 2}}, "m")
  for router, field in [({"name": "toy", "temperature": "hot"},
                         "m.router.temperature"),
                        ({"name": "toy", "hard": 1}, "m.router.hard"),
                        ({"name": "toy", "num_experts": 3},
                         "m.router.num_experts"),
                        ({"name": "toy", "temperature": -1.0},
                         "m.temperature"),
                        ({"name": "nope"}, "m.router.name"),
                        ({"temperature": 1.0}, "m.router.name")]:
    with pytest.raises(ConfigError) as info:
      validate(spec, {"router": router}, "m")
    assert info.value.field == field, router


def test_schema_primitives():
  spec = Section({"a": Field("int", REQUIRED, low=1),
                  "b": Seq(Field("float"), length=2),
                  "c": Field("str", None, nullable=True, choices=("x", "y"))})
  validate(spec, {"a": 1, "b": (0.5, 1)}, "s")
  for value, field in [({"a": 0, "b": (0, 0)}, "s.a"),
                       ({"b": (0, 0)}, "s.a"),
                       ({"a": 1, "b": (0,)}, "s.b"),
                       ({"a": 1, "b": (0, np.nan)}, "s.b[1]"),
                       ({"a": 1, "b": (0, 0), "c": "z"}, "s.c"),
                       ({"a": 1, "b": [0, 0], "d": 1}, "s.d")]:
    with pytest.raises(ConfigError) as info:
      validate(spec, value, "s")
    assert info.value.field == field, value
  validate(spec, {"a": np.int64(2), "b": [np.float32(1), 2], "c": None}, "s")


# ---------------------------------------------------------------- registries


def test_registry_holds_classes_and_lazy_functions():
  reg = Registry("thing", {"cls": _ToyRouter,
                           "fn": "vmoe_ext.data.corruptions:corrupt"})
  from vmoe_ext.data.corruptions import corrupt
  assert reg.get("fn") is corrupt and reg["cls"] is _ToyRouter
  assert list(reg) == ["cls", "fn"] and "fn" in reg and 3 not in reg
  reg.register("other", "vmoe_ext.errors:require")
  with pytest.raises(ValueError, match="already registered"):
    reg.register("fn", corrupt)
  with pytest.raises(ConfigError) as info:
    reg.get("nope")
  assert info.value.field == "thing.name"
  assert "registered: ['cls', 'fn', 'other']" in str(info.value)


@pytest.mark.parametrize("module,name,field", [
    ("vmoe_ext.routers.registry", "ROUTERS", "router.name"),
    ("vmoe_ext.streams", "STREAMS", "stream.name"),
    ("vmoe_ext.attacks", "ATTACKS", "attack.name"),
    ("vmoe_ext.data.corruptions", "CORRUPTION_FUNCTIONS", "corruption.name"),
    ("vmoe_ext.models", "MODELS", "model.name"),
    ("vmoe_ext.train.optimizer", "OPTIMIZERS", "optimizer.name"),
])
def test_component_registries_list_what_is_registered(module, name, field):
  import importlib
  registry = getattr(importlib.import_module(module), name)
  assert isinstance(registry, Registry) and len(registry) > 0
  with pytest.raises(ConfigError) as info:
    registry.get("no_such_thing")
  assert info.value.field == field
  assert f"registered: {registry.names()}" in str(info.value)
  for n in registry:
    assert registry.get(n) is not None


# ------------------------------------------------------ non-config errors


def test_metric_input_errors_are_not_config_errors():
  from vmoe_ext.evaluate.metrics import MetricInputError, topk_accuracy
  with pytest.raises(ValueError) as info:
    topk_accuracy(np.zeros((3, 4)), np.array([0, 1]), 1)
  assert isinstance(info.value, MetricInputError)
  assert not isinstance(info.value, ConfigError)
  assert info.value.field == "labels"


# ----------------------------------------------------- config files, binary


def test_load_config_flag_errors(tmp_path):
  (tmp_path / "syntax.py").write_text("def get_config(:\n")
  (tmp_path / "noget.py").write_text("X = 1\n")
  cases = [(str(tmp_path / "missing.py"), "not found"),
           (str(tmp_path / "syntax.py"), "syntax error"),
           (str(tmp_path / "noget.py"), "no get_config"),
           (os.path.join(CONFIG_DIR, "vit_dense.py") + ":bogus",
            "unknown arg 'bogus'")]
  for value, message in cases:
    with pytest.raises(ConfigError) as info:
      load_config_flag(value)
    assert info.value.field == "--config" and message in str(info.value)
  assert load_config_flag(os.path.join(CONFIG_DIR, "vit_dense.py") +
                          ":plain").model.name == "vit"


def _binary(*args, cwd=ROOT):
  return subprocess.run([sys.executable, "-m", "vmoe_ext.main", *args],
                        cwd=cwd, capture_output=True, text=True, timeout=600)


def test_binary_bad_input_exits_2_without_traceback(tmp_path):
  """One binary launch per path a bad input takes (each launch imports jax:
  ~5 s): an unknown field and a file that does not exist (the flag parser's
  ConfigError), a value of the wrong type (absl's flag error), a field the
  run checks against the data, and a workdir that is a file."""
  a_file = tmp_path / "file"
  a_file.write_text("")
  cases = [
      (["--config.data.batchsize=16"], "config error: data.batchsize: "),
      (["--config.data.batch_size=abc"], "config error: data.batch_size: "),
      (["--config.model.num_classes=3"], "config error: model.num_classes: "),
      (["--config=configs/nope.py"], "config error: --config: "),
      ([f"--workdir={a_file}"], "config error: --workdir: "),
  ]
  for args, message in cases:
    if not any(a.startswith("--config=") for a in args):
      args = ["--config=configs/tiny.py", *args]
    if not any(a.startswith("--workdir") for a in args):
      args = [*args, f"--workdir={tmp_path / 'run'}"]
    proc = _binary(*args)
    assert proc.returncode == 2, (args, proc.stderr[-2000:])
    assert message in proc.stderr, (args, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr
  assert not os.path.exists(tmp_path / "run")


@pytest.mark.parametrize("flag,field", [
    ("--config.model.moe.router.num_selected=5",
     "model.moe.router.num_selected"),
    ("--config.model.patch_size=(0,0)", "model.patch_size"),
])
def test_bad_values_through_the_binarys_flag_path(flag, field):
  """The binary's own path from a command line to a checked config
  (`parse_config_flags`, then the schema) names the field: what the binary
  prints as `config error: FIELD: ...` with exit 2 (the launches above)."""
  from absl import flags as absl_flags
  from vmoe_ext.app.context import resolved
  from vmoe_ext.app.main import parse_config_flags
  values = absl_flags.FlagValues()
  with pytest.raises(ConfigError) as info:
    parse_config_flags(["prog", "--config=configs/tiny.py", flag], values, [])
    validate_config(resolved(values.config))
  assert info.value.field == field
