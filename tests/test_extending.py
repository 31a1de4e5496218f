"""Components from a user's own module (docs/extending.md): a router, a
stream and an attack of `ext_plugins` (tests/ext_plugins.py), selected in a
config by `"module:Name"` path and by a `vmoe_ext.register_*` name, give
what the same class gives through a registry entry (the built-ins' way) or
what the attack function gives called directly; bad paths and fields are
one `ConfigError` on the full field; and every python block of
docs/extending.md runs, its training script included.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ext_plugins
import vmoe_ext
from vmoe_ext.app.context import resolved
from vmoe_ext.attacks import ATTACKS, make_attack
from vmoe_ext.errors import ConfigError
from vmoe_ext.models import build_model
from vmoe_ext.routers.registry import ROUTERS
from vmoe_ext.streams import STREAMS
from vmoe_ext.train.config_files import load_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
IMAGES = jax.random.uniform(jax.random.key(0), (4, 8, 8, 1))


@contextlib.contextmanager
def restored_registries():
  """Undoes every registration and path import made inside."""
  # pylint: disable=protected-access
  saved = [(r, dict(r.entries), set(r._imported))
           for r in (ROUTERS, STREAMS, ATTACKS)]
  try:
    yield
  finally:
    for registry, entries, imported in saved:
      registry.entries = entries
      registry._imported = imported  # pylint: disable=protected-access


@pytest.fixture(autouse=True)
def _clean_registries():
  with restored_registries():
    yield


def _config(router=None, stream=None, attacks=None):
  config = load_config("tiny")  # 8x8x1 digits, 2 layers, 2 experts.
  config.model.moe.every = 1  # Both blocks MoE: a stream's state matters.
  if router is not None:
    config.model.moe.router = router
  if stream is not None:
    config.model.stream = stream
  if attacks is not None:
    config.robustness.attacks = attacks
  return config


def _logits(variables, **components):
  """The tiny model's logits on IMAGES, built from the checked config."""
  model = build_model(resolved(_config(**components)).model)
  if variables is None:  # Random params: the head is zero-initialised.
    variables = model.init(jax.random.key(1), IMAGES)
    leaves, tree = jax.tree.flatten(variables)
    keys = jax.random.split(jax.random.key(2), len(leaves))
    variables = jax.tree.unflatten(tree, [
        0.5 * jax.random.normal(k, v.shape, v.dtype)
        for k, v in zip(keys, leaves)])
  return np.asarray(model.apply(variables, IMAGES)[0]), variables


# ------------------------------------------------------------------ routers


def test_a_router_by_path_or_registered_name_is_the_class_itself():
  # Reference: the class as a registry entry, as the built-ins are.
  ROUTERS.entries["reference_greedy"] = ext_plugins.GreedyRouter
  reference, variables = _logits(
      None, router={"name": "reference_greedy", "num_selected": 2})
  vmoe_ext.register_router("greedy", ext_plugins.GreedyRouter)
  by_path, _ = _logits(variables, router={
      "name": "ext_plugins:GreedyRouter", "num_selected": 2})
  by_name, _ = _logits(variables, router={"name": "greedy",
                                          "num_selected": 2})
  np.testing.assert_array_equal(by_path, reference)
  np.testing.assert_array_equal(by_name, reference)
  # The class's own field reaches it: K=1 routes (and predicts) otherwise.
  top1, _ = _logits(variables, router={"name": "ext_plugins:GreedyRouter",
                                       "num_selected": 1})
  assert np.abs(top1 - reference).max() > 1e-4
  assert ROUTERS.get("ext_plugins:GreedyRouter") is ext_plugins.GreedyRouter
  # Paths a config used are cached, not listed; registered names are.
  assert "greedy" in ROUTERS.names()
  assert "ext_plugins:GreedyRouter" not in ROUTERS.names()


# ------------------------------------------------------------------ streams


def test_a_stream_by_path_or_registered_name_is_the_class_itself():
  router = {"name": "noisy_topk", "num_selected": 1}
  # Independent reference: decay 0 is the built-in plain residual.
  plain, variables = _logits(None, router=router, stream={"name": "plain"})
  undamped, _ = _logits(variables, router=router, stream={
      "name": "ext_plugins:DampedResidual", "decay": 0.0})
  np.testing.assert_allclose(undamped, plain, rtol=1e-6, atol=1e-6)
  STREAMS.entries["reference_damped"] = ext_plugins.DampedResidual
  reference, _ = _logits(variables, router=router, stream={
      "name": "reference_damped", "decay": 0.5})
  vmoe_ext.register_stream("damped", ext_plugins.DampedResidual)
  for name in ("ext_plugins:DampedResidual", "damped"):
    got, _ = _logits(variables, router=router,
                     stream={"name": name, "decay": 0.5})
    np.testing.assert_array_equal(got, reference)
  assert np.abs(reference - plain).max() > 1e-4


# ------------------------------------------------------------------ attacks


def test_an_attack_by_path_or_registered_name_is_the_function_itself():
  x = jnp.full((4, 8, 8, 1), 0.5).at[0].set(0.98)
  labels = jnp.arange(4) % 3
  key = jax.random.key(7)
  logits_fn = lambda z: jnp.zeros((z.shape[0], 3))  # noqa: E731
  # Independent reference: the function called directly, and by hand.
  direct = ext_plugins.sign_flip(logits_fn, x, labels, key=key, eps=0.05)
  signs = jax.random.rademacher(key, x.shape, x.dtype)
  np.testing.assert_allclose(direct, np.clip(x + 0.05 * signs, 0, 1))
  vmoe_ext.register_attack("flip", ext_plugins.sign_flip,
                           ext_plugins.check_sign_flip)
  vmoe_ext.register_attack("flip_spec", ext_plugins.SIGN_FLIP)
  for name in ("ext_plugins:sign_flip", "ext_plugins:SIGN_FLIP", "flip",
               "flip_spec"):
    attack = make_attack({"name": name, "eps": 0.05})
    np.testing.assert_array_equal(attack(logits_fn, x, labels, key), direct)
  # A function named by path brings its `check_<name>` (the convention).
  spec = ATTACKS.spec("ext_plugins:sign_flip")
  assert spec.check is ext_plugins.check_sign_flip and spec.details is None
  # And the robustness section takes it, its fields from the signature.
  config = resolved(_config(attacks=(
      {"name": "ext_plugins:sign_flip", "eps": 0.05, "num_examples": 8},)))
  assert config.robustness.attacks[0]["name"] == "ext_plugins:sign_flip"


# --------------------------------------------------------- config errors


@pytest.mark.parametrize("components,field,reason", [
    ({"router": {"name": "no_such_module_xyz:GreedyRouter"}},
     "model.moe.router.name", "cannot import module 'no_such_module_xyz'"),
    ({"router": {"name": "ext_plugins:GreedRouter"}},
     "model.moe.router.name",
     "'ext_plugins' has no attribute 'GreedRouter'; did you mean "
     "'GreedyRouter'?"),
    ({"router": {"name": "ext_plugins:DampedResidual"}},
     "model.moe.router.name",
     "ext_plugins.DampedResidual is not a Router subclass"),
    ({"router": {"name": "ext_plugins:NotARouter"}},
     "model.moe.router.name", "ext_plugins.NotARouter is not a Router"),
    ({"router": {"name": "ext_plugins:"}},
     "model.moe.router.name", "not a 'package.module:Name' path"),
    ({"router": {"name": "ext_plugins:GreedyRouter", "num_selectd": 2}},
     "model.moe.router.num_selectd", "did you mean 'num_selected'?"),
    ({"stream": {"name": "ext_plugins:GreedyRouter"}},
     "model.stream.name", "is not a ResidualStream subclass"),
    ({"stream": {"name": "ext_plugins:DampedResidual", "decy": 0.1}},
     "model.stream.decy", "did you mean 'decay'?"),
    ({"attacks": ({"name": "ext_plugins:GreedyRouter", "eps": 0.1},)},
     "robustness.attacks[0].name", "AttackSpec(fn, check) or an attack "
     "function"),
    ({"attacks": ({"name": "ext_plugins:unchecked_attack", "eps": 0.1},)},
     "robustness.attacks[0].name",
     "attack function 'unchecked_attack' has no check"),
    ({"attacks": ({"name": "fgsm", "eps": 0.1},
                  {"name": "ext_plugins:sign_flip", "epsilon": 0.1})},
     "robustness.attacks[1].epsilon", "unknown field"),
    ({"attacks": ({"name": "ext_plugins:SIGN_FLIP", "eps": -0.5},)},
     "robustness.attacks[0].eps", "must be a finite number >= 0"),
])
def test_a_bad_path_or_field_is_one_config_error_on_the_full_field(
    components, field, reason):
  with pytest.raises(ConfigError) as info:
    resolved(_config(**components))
  assert info.value.field == field
  assert reason in info.value.reason, info.value.reason


def test_a_path_from_the_command_line_is_checked_like_a_name(monkeypatch):
  # The binary's own flag path, as the documented commands are checked.
  from test_documented_commands import resolve_command
  monkeypatch.chdir(ROOT)
  config = resolve_command([
      "prog", "--config=configs/tiny.py",
      "--config.model.moe.router.name=ext_plugins:GreedyRouter",
      "--config.model.moe.router.num_selected=2"])
  assert dict(config.model.moe.router) == {
      "name": "ext_plugins:GreedyRouter", "num_selected": 2}
  with pytest.raises(ConfigError) as info:
    resolve_command(["prog", "--config=configs/tiny.py",
                     "--config.model.stream.name=ext_plugins:NotARouter"])
  assert info.value.field == "model.stream.name"


# ------------------------------------------------------------ registering


def test_registering_checks_the_object_and_keeps_names_unique():
  vmoe_ext.register_router("greedy", ext_plugins.GreedyRouter)
  assert ROUTERS.get("greedy") is ext_plugins.GreedyRouter
  with pytest.raises(ValueError, match="'greedy' is already registered"):
    vmoe_ext.register_router("greedy", ext_plugins.GreedyRouter)
  with pytest.raises(ValueError, match="override=True"):
    vmoe_ext.register_router("noisy_topk", ext_plugins.GreedyRouter)

  class Greedier(ext_plugins.GreedyRouter):
    pass

  vmoe_ext.register_router("greedy", Greedier, override=True)
  assert ROUTERS.get("greedy") is Greedier
  with pytest.raises(ValueError, match="without ':'"):
    vmoe_ext.register_router("my:greedy", Greedier)
  with pytest.raises(TypeError, match="not a Router subclass"):
    vmoe_ext.register_router("damped", ext_plugins.DampedResidual)
  with pytest.raises(TypeError, match="not a ResidualStream subclass"):
    vmoe_ext.register_stream("greedy", ext_plugins.GreedyRouter)
  with pytest.raises(TypeError, match="has no check"):
    vmoe_ext.register_attack("unchecked", ext_plugins.unchecked_attack)
  with pytest.raises(TypeError, match="exactly the config fields"):
    vmoe_ext.register_attack("flip", ext_plugins.sign_flip,
                             lambda *, eps, steps: None)
  with pytest.raises(ValueError, match="already registered"):
    vmoe_ext.register_attack("fgsm", ext_plugins.SIGN_FLIP)
  vmoe_ext.register_attack("fgsm", ext_plugins.SIGN_FLIP, override=True)
  assert ATTACKS.get("fgsm") is ext_plugins.sign_flip
  # A lazy path registers now and is checked when first used.
  vmoe_ext.register_stream("lazy", "ext_plugins:GreedyRouter")
  with pytest.raises(TypeError, match="not a ResidualStream subclass"):
    STREAMS.get("lazy")


def test_import_vmoe_ext_stays_light_until_register_is_used():
  code = ("import sys, vmoe_ext; light = 'jax' not in sys.modules; "
          "f = vmoe_ext.register_router; "
          "from vmoe_ext.routers import register_router; "
          "print(light, f is register_router, 'register_attack' in "
          "dir(vmoe_ext))")
  out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True,
                       capture_output=True, text=True, timeout=300).stdout
  assert out.split() == ["True", "True", "True"]


# ---------------------------------------------------- docs/extending.md


def _python_blocks(text: str) -> list[str]:
  return re.findall(r"```python\n(.*?)```", text, re.S)


def test_the_extending_guide_runs(tmp_path, monkeypatch):
  """Every python block of docs/extending.md, in order, from an empty
  directory: a block whose first line is `# path.py` is written to that
  file, the others run in one namespace; then the training script it
  writes runs as its bash block says (2 steps) in a fresh process."""
  text = open(os.path.join(ROOT, "docs", "extending.md"),
              encoding="utf-8").read()
  blocks = _python_blocks(text)
  monkeypatch.chdir(tmp_path)
  monkeypatch.syspath_prepend(str(tmp_path))
  namespace: dict = {"__name__": "extending_md"}
  files, ran = [], 0
  try:
    for block in blocks:
      first = block.splitlines()[0]
      match = re.fullmatch(r"# ([\w/]+\.py)", first)
      if match:
        path = tmp_path / match.group(1)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(block)
        files.append(match.group(1))
      else:
        code = compile(block, "docs/extending.md", "exec")
        exec(code, namespace)  # pylint: disable=exec-used
        ran += 1
  finally:
    for name in list(sys.modules):
      if name == "my_pkg" or name.startswith("my_pkg."):
        del sys.modules[name]
  assert files == ["my_pkg/routers.py", "my_pkg/streams.py",
                   "my_pkg/attacks.py", "train_my_pkg.py"]
  assert ran == 4
  assert "python train_my_pkg.py runs/my_pkg 2" in text
  run = subprocess.run(
      [sys.executable, "train_my_pkg.py", "runs/my_pkg", "2"],
      cwd=tmp_path, capture_output=True, text=True, timeout=600,
      env={**os.environ, "PYTHONPATH": os.pathsep.join(
          [ROOT, os.environ.get("PYTHONPATH", "")])})
  assert run.returncode == 0, run.stderr[-3000:]
  workdir = tmp_path / "runs" / "my_pkg"
  assert run.stdout.strip() == os.path.join("runs", "my_pkg", "report.md")
  records = [json.loads(line) for line in
             open(workdir / "metrics.jsonl", encoding="utf-8")]
  steps = [r["step"] for r in records if r.get("split") == "train"]
  assert max(steps) == 2
  attacked = [r for r in records
              if "adversarial/random_sign" in json.dumps(r)]
  assert attacked, records[-3:]
  assert "random_sign" in (workdir / "report.md").read_text()
