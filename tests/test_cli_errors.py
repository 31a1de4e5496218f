"""The command line's promise: a selector switched from the command line
gives the new component its own defaults, and every invalid input is one
line naming the full field (`vmoe_ext.config.overrides`,
`vmoe_ext.app.main.parse_flags`)."""

from __future__ import annotations

import os
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from absl import flags as absl_flags

from vmoe_ext.app.context import resolved
from vmoe_ext.app.main import parse_config_flags
from vmoe_ext.app.schema import CONFIG, validate_config
from vmoe_ext.config.overrides import flag_error
from vmoe_ext.config.schema import validate
from vmoe_ext.errors import ConfigError, join_parts, split_path
from vmoe_ext.moe.routing import TokenChoiceRouting
from vmoe_ext.routers.base import LinearLogits, Router, RouterOutput
from vmoe_ext.routers.registry import ROUTERS
from vmoe_ext.train.config_files import load_config, load_config_flag

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WAS = "the config file's {} (for {}) is "


def _flags(name, *args):
  """The binary's path (`parse_config_flags`) on `configs/NAME.py` and
  `args`: the resolved config and the notes."""
  notes = []
  values = absl_flags.FlagValues()
  parse_config_flags(["prog", f"--config=configs/{name}.py", *args], values,
                     notes)
  return resolved(values.config), notes


def _error(name, *args):
  with pytest.raises(ConfigError) as info:
    _flags(name, *args)
  return str(info.value)


# ------------------------------------------------- selectors switched


def test_a_switched_router_takes_its_own_defaults():
  config, notes = _flags("default", "--config.model.moe.router.name=cosine")
  assert notes == [
      "model.moe.router.noise_std: " + WAS.format(1.0, "noisy_topk") +
      "not carried over to cosine; it takes cosine's default 0.0",
      "model.moe.router.num_selected: " + WAS.format(2, "noisy_topk") +
      "not carried over to cosine; it takes cosine's default 1"]
  router = config.model.moe.router
  assert (router.name, router.noise_std, router.num_selected) == (
      "cosine", 0.0, 1)
  validate_config(config)
  # Independent reference: the default config whose file names the cosine
  # router with no field set, resolved.
  file = load_config("default")
  file.model.moe.router = {"name": "cosine"}
  assert router == resolved(file).model.moe.router
  # A field set beside the name is kept: the default config plus K = 2 is
  # configs/xmoe.py's XMoE router.
  config, _ = _flags("default", "--config.model.moe.router.name=cosine",
                     "--config.model.moe.router.num_selected=2")
  xmoe, _ = _flags("xmoe")
  assert config.model.moe.router == xmoe.model.moe.router
  # top_p: its own cap and no load loss, so it is valid as it stands.
  config, _ = _flags("default", "--config.model.moe.router.name=top_p")
  assert (config.model.moe.router.num_selected,
          config.model.moe.router.load_loss_weight) == (4, 0.0)
  validate_config(config)


def test_another_selector_keeps_the_fields_both_choices_default_alike():
  """`optimizer.name` is no component: a switch keeps the schedule the file
  set (fields both optimizers have, with the same default)."""
  file = load_config("default")
  config, notes = _flags("default", "--config.optimizer.name=sgd")
  assert notes == [] or all("optimizer." in n for n in notes)
  assert (config.optimizer.warmup_steps, config.optimizer.decay,
          config.optimizer.learning_rate) == (
              file.optimizer.warmup_steps, file.optimizer.decay,
              file.optimizer.learning_rate)


def test_fields_set_on_the_command_line_are_kept():
  config, notes = _flags("default", "--config.model.moe.router.noise_std=0.5",
                         "--config.model.moe.router.name=cosine")
  assert notes == [
      "model.moe.router.num_selected: " + WAS.format(2, "noisy_topk") +
      "not carried over to cosine; it takes cosine's default 1"]
  assert config.model.moe.router.noise_std == 0.5


def test_a_wrapper_router_base_switch_takes_the_base_defaults():
  config, notes = _flags("symphony",
                         "--config.model.moe.router.base.name=cosine")
  assert notes == [
      "model.moe.router.base.noise_std: " + WAS.format(1.0, "noisy_topk") +
      "not carried over to cosine; it takes cosine's default 0.0",
      "model.moe.router.base.num_selected: " + WAS.format(2, "noisy_topk") +
      "not carried over to cosine; it takes cosine's default 1"]
  assert config.model.moe.router.base.noise_std == 0.0


def test_a_switched_attack_entry_drops_the_previous_attack_fields():
  config, notes = _flags("default", "--config.robustness.attacks.1.name=fgsm")
  assert notes == [
      f"robustness.attacks[1].{field}: " + WAS.format(value, "pgd") +
      "dropped: fgsm has no such field"
      for field, value in (("steps", 10), ("step_size", 0.0125),
                           ("random_start", True))]
  assert dict(config.robustness.attacks[1]) == {"name": "fgsm", "eps": 0.05}


def test_a_switched_stream_drops_the_previous_stream_fields():
  config, notes = _flags("momentum", "--config.model.stream.name=plain")
  assert notes == [
      f"model.stream.{field}: " + WAS.format(value, "momentum") +
      "dropped: plain has no such field"
      for field, value in (("gamma", 1.0), ("layout", "'vmoe_reference'"),
                           ("mu", 0.8))]
  assert dict(config.model.stream) == {"name": "plain", "blocks": "moe"}


def test_layers_on_the_command_line_replaces_the_file_every():
  config, notes = _flags("default", "--config.model.moe.layers=(3,)")
  assert notes == [
      "model.moe.every: the config file's 2 is dropped: "
      "--config.model.moe.layers replaces it (give one of model.moe.layers "
      "and model.moe.every)"]
  assert (config.model.moe.every, tuple(config.model.moe.layers)) == (
      None, (3,))


# -------------------------------------------------------- list items


def test_list_items_by_index_in_either_spelling():
  assert split_path("robustness.attacks.0.eps") == [
      "robustness", "attacks", 0, "eps"]
  assert split_path("sharding.rules[0][1]") == ["sharding", "rules", 0, 1]
  assert join_parts(["robustness", "attacks", 0, "eps"]) == (
      "robustness.attacks[0].eps")
  with pytest.raises(ConfigError) as info:
    split_path("model..moe")
  assert info.value.field == "model..moe"
  config, _ = _flags("default", "--config.robustness.attacks.2.steps=3",
                     "--config.robustness.attacks[0].num_examples=50")
  assert config.robustness.attacks[2]["steps"] == 3
  assert config.robustness.attacks[0]["num_examples"] == 50
  assert _error("default", "--config.robustness.attacks[5].eps=0.1") == (
      "robustness.attacks[5]: (--config.robustness.attacks[5].eps) no such "
      "item: the config has 3 (indices 0..2); set the whole list with "
      "--config.robustness.attacks=(...)")
  assert _error("default", "--config.robustness.attacks.0.epz=0.1").startswith(
      "robustness.attacks[0].epz: (--config.robustness.attacks[0].epz) "
      "unknown field; did you mean 'eps'?")


# -------------------------------------------- values of the wrong type


@pytest.mark.parametrize("flag, message", [
    ("train.total_steps=1e3",
     "train.total_steps: expects an integer (e.g. 1000), got '1e3'"),
    ("robustness.attacks[0].eps=abc", "robustness.attacks[0].eps: expects a "
     "number (e.g. 0.1 or 1e-3), got 'abc'"),
    ("data.augment=maybe", "data.augment: expects True or False, got 'maybe'"),
    ("robustness=none", "robustness: is a section: set it to None (capital "
     "N) to turn it off, or to a dict of its fields, e.g. "
     "--config.robustness=\"{...}\" (or set one field: "
     "--config.robustness.FIELD=VALUE); got 'none'"),
    ("robustness.attacks={'name':'fgsm','eps':0.03}", "robustness.attacks: "
     "expects a tuple/list, got one dict; wrap it: --config.robustness."
     "attacks=\"({'name':'fgsm','eps':0.03},)\", e.g. ({'name': 'fgsm', "
     "'eps': 0.03},)"),
])
def test_values_of_the_wrong_type_say_what_works(flag, message):
  assert _error("default", f"--config.{flag}") == message


def test_a_dict_where_a_list_of_entries_belongs_in_a_config_file():
  config = load_config("default").to_dict()
  config["robustness"]["attacks"] = {"name": "fgsm", "eps": 0.1}
  with pytest.raises(ConfigError) as info:
    validate(CONFIG, config)
  assert str(info.value) == (
      "robustness.attacks: must be a tuple/list of dicts (one per entry), "
      "got one dict; wrap it: ({'name': 'fgsm', 'eps': 0.1},)")


def test_flag_parser_exceptions_become_one_line_on_the_flag():
  error = ValueError("Could not parse 'robustness.attacks.x': SyntaxError\n"
                     "  more lines")
  assert str(flag_error(error, ["--config.robustness.attacks.x=1"])) == (
      "robustness.attacks.x: cannot set it from the command line: "
      "ValueError: Could not parse 'robustness.attacks.x': SyntaxError")


def test_an_entry_reports_its_fields_in_order():
  config = load_config("default").to_dict()
  config["robustness"]["attacks"] = ({"name": "pgd", "eps": -0.1},)
  with pytest.raises(ConfigError) as info:
    validate(CONFIG, config)
  assert str(info.value) == ("robustness.attacks[0].eps: must be a finite "
                             "number >= 0, got -0.1")
  config["robustness"]["attacks"] = ({"name": "pgd", "eps": 0.1},)
  with pytest.raises(ConfigError) as info:
    validate(CONFIG, config)
  assert str(info.value) == "robustness.attacks[0].steps: is required"


def test_a_misspelt_config_file_suggests_the_close_one():
  with pytest.raises(ConfigError) as info:
    load_config_flag(os.path.join("configs", "defualt.py"))
  assert str(info.value) == (
      "--config: config file not found: 'configs/defualt.py'; did you mean "
      "'configs/default.py'?")


# --------------------------------------------------- a custom router


class _GreedyRouter(Router):
  num_selected: int = 1

  @property
  def slots_per_token(self):
    return self.num_selected

  @nn.compact
  def __call__(self, x, ctx, *, capacity, deterministic, update_state=False):
    logits = LinearLogits(self.num_experts, name="logits")(x)
    gates, idx = jax.lax.top_k(jax.nn.softmax(logits), self.num_selected)
    return RouterOutput(TokenChoiceRouting.create(idx, gates),
                        {"auxiliary_loss": jnp.zeros(())})


class _PickyRouter(_GreedyRouter):

  def __post_init__(self):
    if self.num_selected == 3:
      raise ValueError("K=3 is not supported")
    super().__post_init__()


@pytest.fixture
def custom_routers():
  ROUTERS.register("test_greedy", _GreedyRouter)
  ROUTERS.register("test_picky", _PickyRouter)
  yield
  ROUTERS.unregister("test_greedy")
  ROUTERS.unregister("test_picky")


@pytest.mark.parametrize("name, k, message", [
    ("test_greedy", 9, "model.moe.router.num_selected: K=9 experts a token "
     "(slots_per_token of _GreedyRouter) must be an integer in "
     "1..num_experts E=4"),
    ("test_picky", 3, "model.moe.router: _PickyRouter: K=3 is not supported"),
])
def test_a_custom_router_error_names_the_full_path(custom_routers, name, k,
                                                   message):
  config = load_config("default")
  config.model.moe.router = {"name": name, "num_selected": k}
  with pytest.raises(ConfigError) as info:
    validate_config(config)
  assert str(info.value) == message


# ----------------------------------------------------------- the binary


def _binary(*args):
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "CI": "1"}
  return subprocess.run([sys.executable, "-m", "vmoe_ext.main", *args],
                        cwd=ROOT, env=env, capture_output=True, text=True,
                        timeout=300)


def test_help_lists_the_flags_and_exits_0():
  proc = _binary("--help")
  assert proc.returncode == 0
  for line in ("Flags:", "  --config=FILE[:ARG]", "  --workdir=DIR",
               "  --debug", "  --coordinator_address=HOST:PORT",
               "  --num_processes=N", "  --process_id=I", "  --distributed",
               "  --config.FIELD=VALUE", "  --helpfull"):
    assert line in proc.stdout.splitlines(), line


@pytest.mark.parametrize("flag, line", [
    ("--config.robustness.attacks.0.eps=-0.1",
     "config error: robustness.attacks[0].eps: must be a finite number >= 0, "
     "got -0.1"),
    ("--config.train.total_steps=1e3", "config error: train.total_steps: "
     "expects an integer (e.g. 1000), got '1e3'"),
])
def test_binary_bad_flags_are_one_line_and_exit_2(tmp_path, flag, line):
  proc = _binary("--config=configs/tiny.py", flag,
                 f"--workdir={tmp_path / 'run'}")
  assert (proc.returncode, proc.stderr.strip().splitlines()) == (2, [line])


def test_a_trace_time_check_names_the_full_field():
  """SoftMoE needs one image per group; the check needs the token count, so
  it runs when the model is first traced, and must still name the full
  field and the fix (it said `moe.group_size`)."""
  from vmoe_ext.app.context import abstract_variables  # pylint: disable=g-import-not-at-top
  from vmoe_ext.models import build_model  # pylint: disable=g-import-not-at-top
  model = build_model({
      "name": "vit_moe", "num_classes": 10, "patch_size": (7, 7),
      "hidden_size": 16, "num_layers": 2, "num_heads": 2, "mlp_dim": 32,
      "moe": {"every": 2, "num_experts": 4, "group_size": 17 * 2,
              "router": {"name": "soft"}}})
  sample = jax.ShapeDtypeStruct((2, 28, 28, 1), jnp.float32)
  with pytest.raises(ConfigError) as info:
    abstract_variables(model, jax.random.key(0), sample)
  assert info.value.field == "model.moe.group_size"
  assert info.value.reason.endswith("got 34: set it to 17 or None (one "
                                    "image per group)")
  ok = build_model({**model_config(model), "moe": {
      **model_config(model)["moe"], "group_size": None}})
  assert abstract_variables(ok, jax.random.key(0), sample)["params"]


def model_config(model):
  return {"name": "vit_moe", "num_classes": 10, "patch_size": (7, 7),
          "hidden_size": 16, "num_layers": 2, "num_heads": 2, "mlp_dim": 32,
          "moe": {"every": 2, "num_experts": 4, "router": {"name": "soft"}}}
