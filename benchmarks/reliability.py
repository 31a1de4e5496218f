"""Invalid inputs to the training binary: exit 2, one clear line, no traceback.

Runs each case as `python -m vmoe_ext.main --config=configs/tiny.py [ARGS]
--workdir=W` (cwd: the repository root, env CI=1 JAX_PLATFORMS=cpu, a fresh
temporary workdir per case) and checks that it

  (a) exits with status 2,
  (b) prints `config error: FIELD: message` on stderr, FIELD being the full
      dotted path of the expected field (`model.moe.router.num_selected`,
      `robustness.attacks[0].eps`) or the flag (`--config`, `--workdir`),
  (c) prints no Python traceback.

A case that trains instead of failing fails (it exits 0, or hits the timeout).
The "valid" group checks that overrides of fields absent from
configs/tiny.py (or whose default is None) parse: each is followed by an
invalid `--config.model.num_heads=0`, so a correct parse ends in that error.

    .venv/bin/python benchmarks/reliability.py             # all, 2 at a time
    .venv/bin/python benchmarks/reliability.py --only moe --json /tmp/r.json

Exit status 0 only if every selected case passed.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any, Callable, Optional, Union

ROOT = Path(__file__).resolve().parents[1]
TRACEBACK = "Traceback (most recent call last)"
Setup = Callable[[Path], list[str]]  # scratch dir -> argv of the case


@dataclasses.dataclass(frozen=True)
class Case:
  """One input. `field` may be a tuple of acceptable fields."""
  name: str
  args: tuple[str, ...]
  field: Union[str, tuple[str, ...]]
  setup: Optional[Setup] = None
  group: str = "invalid"
  devices: int = 1  # fake XLA host devices (sharding cases)


def flag(override: str, field: Optional[str] = None) -> Case:
  """`--config.OVERRIDE`; the expected field defaults to its dotted path."""
  path = override.split("=", 1)[0]
  return Case(override, (f"--config.{override}",), field or path)


# A streaming TFDS data section (validated before any data is read).
_STREAM = ('c.data = dict(name="tfds", tfds_name="imagenet2012", '
           'data_dir="/nonexistent", batch_size=8, eval_batch_size=8, '
           'image_size=32, streaming=True, pp_train="decode_jpeg_and_'
           'inception_crop(32)|flip_lr|value_range(-1, 1)")\n')


def config_file(name: str, body: str, field: str) -> Case:
  """A config file in the scratch dir: tiny's config, then `body` on `c`."""
  source = ("from vmoe_ext.train.config_files import load_config\n\n\n"
            "def get_config(arg=None):\n  del arg\n"
            '  c = load_config("tiny")\n' + textwrap.indent(body, "  ") +
            "\n  return c\n")
  return raw_file(name, source, field)


def raw_file(name: str, source: str, field: str = "--config") -> Case:
  """`--config=` a file with exactly `source` (the file name is `name`)."""

  def setup(scratch: Path) -> list[str]:
    path = scratch / f"{name.replace('-', '_').replace(' ', '_')}.py"
    path.write_text(source)
    return [f"--config={path}"]

  return Case(f"file:{name}", (), field, setup)


def workdir_file(name: str, sub: str) -> Case:
  """`--workdir=FILE` + `sub`, FILE being a regular file."""

  def setup(scratch: Path) -> list[str]:
    path = scratch / "a_file"
    path.write_text("not a directory\n")
    return [f"--workdir={path}{sub}"]

  return Case(name, (), "--workdir", setup)


def carve(override: str, *fields: str) -> Case:
  """`--config=configs/carve.py --config.OVERRIDE` (the carve mode)."""
  return Case(f"carve:{override}", ("--config=configs/carve.py",
                                     f"--config.{override}"),
              fields if len(fields) > 1 else fields[0])


def vmoe_import(override: str, field: str) -> Case:
  """`--config=configs/vmoe_import.py:tiny --config.OVERRIDE` (evaluating an
  imported vmoe checkpoint)."""
  return Case(f"vmoe_import:{override}", (
      "--config=configs/vmoe_import.py:tiny", f"--config.{override}"), field)


def on_devices(devices: int, *overrides: str, field: str) -> Case:
  """`--config.OVERRIDE`s on `devices` fake CPU devices (the mesh checks)."""
  return Case(f"{devices} devices:{' '.join(overrides)}",
              tuple(f"--config.{o}" for o in overrides), field,
              devices=devices)


def valid(override: str) -> Case:
  return Case(f"valid:{override}", (f"--config.{override}",
                                    "--config.model.num_heads=0"),
              "model.num_heads", group="valid")


CASES: list[Case] = [
    # model
    flag("model.patch_size=(0,0)"),
    flag("model.patch_size=(3,3)"),   # does not divide the 8x8 digits
    flag("model.patch_size=(4,)"),
    flag("model.patch_size=abc"),
    flag("model.num_heads=0"),
    flag("model.num_heads=3"),        # does not divide hidden_size 16
    flag("model.hidden_size=0"),
    flag("model.hidden_size=-16"),
    flag("model.mlp_dim=0"),
    flag("model.num_layers=0"),
    flag("model.num_classes=5"),      # digits has 10 classes
    flag("model.num_classes=0"),
    flag("model.classifier=bogus"),
    flag("model.name=bogus"),
    flag("model.dropout_rate=1.5"),
    flag("model.attention_dropout_rate=-0.1"),
    flag("model.num_heads="),
    # model.moe
    flag("model.moe.num_experts=0"),
    flag("model.moe.num_experts=two"),
    flag("model.moe.num_experts=1.5"),
    flag("model.moe.router.num_selected=3"),  # > 2 experts
    flag("model.moe.router.num_selected=0"),
    flag("model.moe.router.name=bogus"),
    flag("model.moe.capacity_factor=0"),
    flag("model.moe.capacity_factor=-1.0"),
    flag("model.moe.capacity_factor=1e39"),  # overflows float32
    flag("model.moe.capacity_factor=nan"),
    Case("model.moe.group_size=7", ("--config.model.moe.group_size=7",),
         ("model.moe.group_size", "data.batch_size")),  # 160 tokens
    flag("model.moe.group_size=0"),
    flag("model.moe.every=0"),
    flag("model.moe.every=5"),        # > 2 blocks
    config_file("moe-dispatcher", 'c.model.moe.dispatcher = "bogus"',
                "model.moe.dispatcher"),
    config_file("moe-capacity-rounding",
                'c.model.moe.capacity_rounding = "bogus"',
                "model.moe.capacity_rounding"),
    config_file("router-noise-std", "c.model.moe.router.noise_std = -1.0",
                "model.moe.router.noise_std"),
    config_file("router-logits-bias", "c.model.moe.router.logits_bias = 1",
                "model.moe.router.logits_bias"),
    config_file("moe-layers", 'moe = c.model.moe.to_dict()\n'
                'del moe["every"]\nmoe["layers"] = (5,)\nc.model.moe = moe',
                "model.moe.layers"),
    config_file("stream-name", 'c.model.stream = dict(name="bogus")',
                "model.stream.name"),
    # unknown fields
    flag("foo=1"),
    flag("model.foo=1"),
    flag("model.moe.foo=1"),
    flag("model.moe.router.foo=1"),
    flag("data.batchsize=16"),
    flag("robustness.foo=1"),
    config_file("data-batchsize", "c.data.batchsize = 16", "data.batchsize"),
    config_file("model-moe-foo", "c.model.moe.foo = 1", "model.moe.foo"),
    config_file("attack-foo", 'c.robustness.attacks = '
                '(dict(name="fgsm", eps=0.1, foo=1),)',
                "robustness.attacks[0].foo"),
    # config files
    Case("config=/nonexistent.py", ("--config=/nonexistent.py",), "--config"),
    Case("config=", ("--config=",), "--config"),
    Case("config=a directory", ("--config=configs",), "--config"),
    Case("config=vit_dense.py:bogus", ("--config=configs/vit_dense.py:bogus",),
         "--config"),
    raw_file("syntax-error", "def get_config(arg=None):\n  return (\n"),
    raw_file("no-get-config", "import ml_collections\nCONFIG = 1\n"),
    raw_file("get-config-raises", "def get_config(arg=None):\n"
             "  raise RuntimeError('boom')\n"),
    raw_file("get-config-returns-dict", "def get_config(arg=None):\n"
             "  return {'seed': 0}\n"),
    raw_file("import-error", "import no_such_module_xyz\n\n\n"
             "def get_config(arg=None):\n  return None\n"),
    # workdir (read-only ones made by chmod are writable for root: /proc is
    # read-only for everyone; tests/test_reliability.py mounts one)
    Case("workdir=", ("--workdir=",), "--workdir"),
    Case("workdir under read-only /proc", ("--workdir=/proc/1/vmoe_run",),
         "--workdir"),
    workdir_file("workdir is a file", ""),
    workdir_file("workdir under a file", "/sub"),
    # float32 overflow, NaN, inf
    flag("optimizer.learning_rate=1e39"),
    flag("optimizer.learning_rate=nan"),
    flag("optimizer.learning_rate=inf"),
    flag("optimizer.learning_rate=-inf"),
    flag("train.label_smoothing=1e39"),
    flag("train.label_smoothing=nan"),
    config_file("attack-eps-overflow",
                'c.robustness.attacks = (dict(name="fgsm", eps=1e39),)',
                "robustness.attacks[0].eps"),
    config_file("attack-eps-nan", 'c.robustness.attacks = c.robustness.'
                'attacks[:1] + (dict(name="pgd", eps=float("nan"), '
                'steps=3),)', "robustness.attacks[1].eps"),
    config_file("sweep-eps-nan",
                'c.robustness.sweep.eps = (0.0, float("nan"))',
                "robustness.sweep.eps[1]"),
    # types
    flag("seed=abc"),
    flag("train.total_steps=1.5"),
    flag("train.total_steps=True"),
    flag("data.batch_size=abc"),
    flag("data.augment=maybe"),
    flag("data.image_size=abc"),
    flag("optimizer.learning_rate=abc"),
    flag("model.moe.router.num_selected=1.5"),
    config_file("batch-size-bool", "c.data.batch_size = True",
                "data.batch_size"),
    config_file("seed-none", "c.seed = None", "seed"),
    config_file("capacity-multiple-float",
                "c.model.moe.capacity_multiple = 1.5",
                "model.moe.capacity_multiple"),
    # ranges and names
    flag("seed=-1"),
    flag("data.batch_size=0"),
    flag("data.batch_size=-32"),
    flag("data.eval_batch_size=0"),
    flag("data.image_size=0"),
    flag("data.name=bogus"),
    flag("train.total_steps=0"),
    flag("train.total_steps=-5"),
    flag("train.log_every=0"),
    flag("train.eval_every=-1"),
    flag("train.checkpoint_every=-1"),
    flag("train.keep_checkpoints=0"),
    flag("train.label_smoothing=1.0"),
    flag("optimizer.name=bogus"),
    flag("optimizer.decay=bogus"),
    flag("optimizer.learning_rate=-1.0"),
    flag("optimizer.warmup_steps=100"),  # > train.total_steps 20
    flag("optimizer.warmup_steps=-1"),
    flag("optimizer.weight_decay=-0.1"),
    flag("optimizer.weight_decay_mask=bogus"),
    flag("optimizer.clip_global_norm=-1.0"),
    flag("optimizer.name=adam", "optimizer.weight_decay"),  # wd 1e-4: adamw
    flag("robustness.num_examples=0"),
    flag("robustness.seed=-1"),
    flag("robustness.checkpoint_dir="),
    flag("robustness.corruptions.names=('bogus',)",
         "robustness.corruptions.names[0]"),
    flag("robustness.corruptions.severities=(0,5)",
         "robustness.corruptions.severities[0]"),
    flag("robustness.sweep.eps=(0.0,-0.1)", "robustness.sweep.eps[1]"),
    flag("robustness.sweep.attack.name=bogus"),
    flag("robustness.sweep.attack.steps=-1"),
    config_file("corruption-name", 'c.robustness.corruptions.names = '
                '("gaussian_noise", "bogus")',
                "robustness.corruptions.names[1]"),
    config_file("attack-name", 'c.robustness.attacks = '
                '(dict(name="bogus", eps=0.1),)', "robustness.attacks[0].name"),
    config_file("attack-eps-negative", 'c.robustness.attacks = '
                '(dict(name="fgsm", eps=-0.1),)', "robustness.attacks[0].eps"),
    config_file("attack-eps-missing", 'c.robustness.attacks = '
                '(dict(name="fgsm"),)', "robustness.attacks[0].eps"),
    config_file("attack-steps-negative", 'c.robustness.attacks = c.'
                'robustness.attacks[:1] + (dict(name="pgd", eps=0.1, '
                'steps=-1),)', "robustness.attacks[1].steps"),
    config_file("spsa-samples-zero", 'c.robustness.attacks = '
                '(dict(name="spsa", eps=0.1, samples=0),)',
                "robustness.attacks[0].samples"),
    config_file("init-workdir-empty", 'c.init = dict(workdir="")',
                "init.workdir"),
    config_file("init-rules-regex", 'c.init = dict(workdir="/nonexistent", '
                'rules=[("(", None)])', "init.rules[0][0]"),
    config_file("init-rules-missing", 'c.init = dict(workdir="/nonexistent")',
                "init.rules"),
    config_file("init-workdir-missing", "from vmoe_ext.train.initialization "
                "import identity_rules\nc.init = dict(workdir='/nonexistent', "
                "rules=identity_rules())", "init.workdir"),
    # MoE additions and the carve mode (configs/carve.py: the dense ViT of
    # vit_dense.py:plain, mlp_dim 128); all fail before data or compilation
    flag("model.mlp_activation=tanh"),
    flag("model.moe.shared_experts=-1"),
    flag("model.moe.output_bias=twice"),
    carve("carve.num_experts=5", "carve.num_experts"),  # 128 % 5 != 0
    carve("carve.num_shared=8", "carve.num_shared"),
    carve("carve.num_activated=8", "carve.num_activated"),
    carve("carve.activation_markers=0", "carve.activation_markers"),
    carve("carve.activation_markers=129", "carve.activation_markers"),
    carve("carve.num_calibration=0", "carve.num_calibration"),
    carve("carve.checkpoint_dir=/nonexistent", "carve.checkpoint_dir"),
    carve("carve.distance=cosine", "carve.distance"),
    carve("carve.method=moefication", "carve.method"),
    carve("model.mlp_activation=tanh", "model.mlp_activation"),
    carve("model.name=vit_moe", "model.name", "model.moe"),
    # vmoe parity options and importing vmoe checkpoints
    flag("model.representation_size=0"),
    flag("model.position_emb=bogus"),
    flag("model.position_emb_temperature=0"),
    flag("model.attention_kernel_init=bogus"),
    flag("model.head_bias_init=abc"),
    config_file("sincos2d-hidden-size", 'c.model.hidden_size = 10\n'
                'c.model.position_emb = "sincos2d"', "model.hidden_size"),
    config_file("from-init-without-init", "c.robustness.from_init = True",
                "robustness.from_init"),
    config_file("init-workdir-and-checkpoint", 'c.init = dict(workdir="/a", '
                'checkpoint="/b", layout="vmoe")', "init.checkpoint"),
    config_file("init-upcycle-vmoe", 'c.init = dict(checkpoint="/b", '
                'layout="vmoe", upcycle=True)', "init.upcycle"),
    config_file("pp-eval-random", _STREAM + 'c.data.pp_eval = '
                '"decode|flip_lr|value_range(-1, 1)"', "data.pp_eval"),
    config_file("pp-eval-other-range", _STREAM + 'c.data.pp_eval = '
                '"decode|central_crop(32)|value_range(0, 1)"', "data.pp_eval"),
    config_file("pp-eval-unknown-op", _STREAM + 'c.data.pp_eval = '
                '"decode|crop_center(32)"', "data.pp_eval"),
    config_file("pp-eval-without-streaming", _STREAM + 'c.data.update('
                'streaming=False, pp_train=None, pp_eval="decode")',
                "data.pp_eval"),
    config_file("analysis-examples-zero", _STREAM +
                "c.data.analysis_examples = 0", "data.analysis_examples"),
    config_file("mixup-groups", "c.train.mixup = dict(concentration=0.2, "
                "groups=7)", "train.mixup.groups"),
    config_file("mixup-size", "c.train.mixup = dict(concentration=0.2, "
                "size=1000)", "train.mixup.size"),
    flag("train.mixup.concentration=-1"),
    vmoe_import("init.checkpoint=/nonexistent/vmoe", "init.checkpoint"),
    vmoe_import("init.layout=bogus", "init.layout"),
    vmoe_import("init.format=bogus", "init.format"),
    # sharding (the tiny config: E=2, batch 32 and 50 of 5 tokens, groups
    # of 10 tokens; 16 and 25 groups)
    flag("sharding.shape=(2,1)", "sharding.shape"),
    flag("sharding.shape=(1,)", "sharding.shape"),
    flag("sharding.shape=(0,-1)", "sharding.shape"),
    flag("sharding.axes=('data','data')", "sharding.axes"),
    flag("sharding.expert_axis=model", "sharding.expert_axis"),
    flag("sharding.rules=(('/Moe/Mlp/',('model',)),)", "sharding.rules[0][1]"),
    flag("sharding.rules=(('(',('expert',)),)", "sharding.rules[0][0]"),
    flag("sharding.rules=(('/Moe/Mlp/',),)", "sharding.rules[0]"),
    on_devices(8, "sharding.shape=(4,4)", field="sharding.shape"),
    on_devices(8, "sharding.shape=(3,-1)", field="sharding.shape"),
    on_devices(8, "sharding.shape=(2,4)", "data.eval_batch_size=80",
               field="model.moe.num_experts"),
    on_devices(8, "sharding.shape=(8,1)", "data.batch_size=36",
               field="data.batch_size"),
    on_devices(8, "sharding.shape=(8,1)", "data.eval_batch_size=40",
               field="data.eval_batch_size"),
    on_devices(8, "sharding.shape=(4,2)", "data.eval_batch_size=40",
               field="data.eval_batch_size"),
    on_devices(8, "sharding.shape=(8,1)", "data.eval_batch_size=80",
               "sharding.rules=(('/Moe/Mlp/',('data',)),)",
               field="sharding.rules[0][1]"),
    on_devices(8, "sharding.shape=(8,1)", "data.eval_batch_size=80",
               "sharding.rules=(('/Moe/Mlp/',(None,None,None,'data')),)",
               field="sharding.rules[0][1]"),
    # command-line trip-ups: list items in either spelling, values of the
    # wrong type, a switched router whose groups no longer fit, alternatives
    flag("robustness.attacks.0.eps=-0.1", "robustness.attacks[0].eps"),
    flag("robustness.attacks[0].eps=-0.1"),
    flag("robustness.attacks[9].eps=0.1", "robustness.attacks[9]"),
    flag("robustness.attacks[0].epz=0.1"),
    flag("robustness.attacks[0].eps=abc"),
    flag("train.total_steps=1e3"),
    flag("robustness=none"),
    flag("robustness.attacks={'name':'fgsm','eps':0.03}",
         "robustness.attacks"),
    flag("model.moe.layers=(5,)"),    # the file's every=2 gives way
    # Groups of 2 images; SoftMoE routes one. Raised while the model is
    # traced: passes once that trace is scoped to "model".
    flag("model.moe.router.name=soft", "model.moe.group_size"),
    Case("config=configs/defualt.py", ("--config=configs/defualt.py",),
         "--config"),
    config_file("attack-pgd-eps-before-steps", 'c.robustness.attacks = '
                '(dict(name="pgd", eps=-0.1),)', "robustness.attacks[0].eps"),
    config_file("attacks-one-dict", 'r = c.robustness.to_dict()\n'
                'r["attacks"] = dict(name="fgsm", eps=0.1)\nc.robustness = r',
                "robustness.attacks"),
    # overrides that must parse (documented fields absent from tiny.py or
    # whose default is None); each then fails on model.num_heads=0
    valid("robustness.num_examples=200"),
    valid("robustness.corruptions.names=('fog',)"),
    valid("robustness.corruptions.num_examples=20"),
    valid("data.image_size=16"),
    valid("data.flip=True"),
    valid("data.pad=1"),
    valid("model.moe.router.noise_std=0.5"),
    valid("model.moe.router.renormalize_gates=True"),
    valid("model.moe.router.z_loss_weight=0.001"),
    valid("model.moe.dispatcher=einsum"),
    valid("model.representation_size=8"),
    valid("model.classifier=map"),
    valid("model.attention_qk_norm=True"),
    valid("model.position_emb=sincos2d"),
    valid("model.attention_broadcast_dropout=True"),
    valid("model.moe.capacity_rounding=vmoe"),
    valid("model.moe.capacity_multiple=4"),
    valid("model.moe.hidden_size=32"),
    valid("model.moe.dropout_rate=0.1"),
    valid("model.moe.last=1"),
    valid("model.moe.batch_priority=True"),
    valid("model.moe.expert_init=shared"),
    valid("model.moe.dispatch_dtype=bfloat16"),
    valid("model.stream.name=plain"),
    valid("optimizer.end_learning_rate=1e-5"),
    valid("optimizer.b1=0.8"),
    valid("model.mlp_activation=swiglu"),
    valid("model.mlp_activation=gelu_exact"),
    valid("model.moe.router.logits_bias=True"),
    valid("model.moe.shared_experts=1"),
    valid("model.moe.output_bias=once"),
    valid("train.mixup.concentration=0.2"),
    valid("train.mixup.granularity=example"),
    valid("model.moe.router.name=cosine"),   # its own defaults (noise 0)
    valid("model.moe.router.name=top_p"),    # its own cap, no load loss
    valid("model.moe.layers=(1,)"),
    valid("robustness.attacks[1].steps=3"),
    valid("robustness.attacks.0.num_examples=10"),
]


def run_case(case: Case, timeout: float) -> dict[str, Any]:
  """Runs one case in fresh temporary dirs; returns its result record."""
  scratch = Path(tempfile.mkdtemp(prefix="vmoe_reliability_"))
  workdir = tempfile.mkdtemp(prefix="vmoe_reliability_workdir_")
  try:
    args = case.setup(scratch) if case.setup else list(case.args)
    argv = [sys.executable, "-m", "vmoe_ext.main"]
    if not any(a.startswith("--config=") for a in args):
      argv.append("--config=configs/tiny.py")
    argv += args
    if not any(a.startswith("--workdir=") for a in args):
      argv.append(f"--workdir={workdir}")
    env = {**os.environ, "CI": "1", "JAX_PLATFORMS": "cpu"}
    if case.devices > 1:
      env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_"
                          f"platform_device_count={case.devices}").strip()
    start = time.monotonic()
    try:
      proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=timeout)
      status: Optional[int] = proc.returncode
      stdout, stderr = proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as e:
      status, stdout, stderr = None, _text(e.stdout), _text(e.stderr)
    seconds = time.monotonic() - start
  finally:
    shutil.rmtree(scratch, ignore_errors=True)
    shutil.rmtree(workdir, ignore_errors=True)
  fields = (case.field,) if isinstance(case.field, str) else case.field
  lines = [l.strip() for l in stderr.splitlines() if l.strip()]
  named = any(l.startswith(f"config error: {f}: ") for l in lines
              for f in fields)
  traceback = TRACEBACK in stdout or TRACEBACK in stderr
  return {
      "name": case.name, "group": case.group, "argv": argv[1:],
      "expected_field": case.field, "exit": status,
      "timeout": status is None, "exit_2": status == 2,
      "field_named": named, "no_traceback": not traceback,
      "passed": status == 2 and named and not traceback,
      "seconds": round(seconds, 2), "detail": _detail(lines, traceback),
      "stderr_tail": "\n".join(stderr.splitlines()[-20:]),
  }


def _text(data: Union[bytes, str, None]) -> str:
  return data.decode(errors="replace") if isinstance(data, bytes) else (
      data or "")


def _detail(lines: list[str], traceback: bool) -> str:
  """The error line: a traceback's last line, else the first error line."""
  errors = [l for l in lines if l.startswith(("config error:", "error:"))]
  line = (lines[-1:] if traceback else errors[:1] or lines[:1] or [""])[0]
  return line[:300]


def describe(result: dict[str, Any]) -> str:
  if result["passed"]:
    return f"PASS  {result['name']}  ({result['seconds']:.1f} s)"
  status = "timeout" if result["timeout"] else f"exit {result['exit']}"
  problems = [status]
  if not result["field_named"]:
    problems.append(f"{result['expected_field']!s} not named")
  if not result["no_traceback"]:
    problems.append("traceback")
  return (f"FAIL  {result['name']}: {', '.join(problems)} | "
          f"{result['detail']}")


def main() -> int:
  parser = argparse.ArgumentParser(
      description=__doc__.split("\n\n")[0],
      formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--jobs", type=int, default=2,
                      help="cases run in parallel (default 2)")
  parser.add_argument("--only", default=None, metavar="SUBSTRING",
                      help="run only the cases whose name contains it")
  parser.add_argument("--json", default=None, metavar="PATH",
                      help="write the per-case results there")
  parser.add_argument("--timeout", type=float, default=180.0,
                      help="seconds per case (default 180)")
  args = parser.parse_args()
  cases = [c for c in CASES if args.only is None or args.only in c.name]
  if not cases:
    print(f"no case matches {args.only!r}", file=sys.stderr)
    return 2
  names = [c.name for c in CASES]
  assert len(names) == len(set(names)), "duplicate case names"
  results: list[dict[str, Any]] = []
  with concurrent.futures.ThreadPoolExecutor(max(1, args.jobs)) as pool:
    futures = [pool.submit(run_case, c, args.timeout) for c in cases]
    for future in concurrent.futures.as_completed(futures):
      result = future.result()
      results.append(result)
      print(describe(result), flush=True)
  results.sort(key=lambda r: names.index(r["name"]))
  failed = [r for r in results if not r["passed"]]
  for group in sorted({r["group"] for r in results}):
    rs = [r for r in results if r["group"] == group]
    print(f"{group}: {sum(r['passed'] for r in rs)} of {len(rs)} passed")
  if failed:
    print(f"\n{len(failed)} failing:")
    for r in failed:
      print("  " + describe(r))
  if args.json:
    Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
  passed = len(results) - len(failed)
  print(f"{passed} of {len(results)} cases (invalid inputs and overrides "
        "that must parse): exit 2, field named, no traceback")
  return 0 if not failed else 1


if __name__ == "__main__":
  sys.exit(main())
