"""Runs every `python -m vmoe_ext.main ...` command of README.md and docs/
end to end, shortened to a few steps; CI's `.ci/run` calls it.

    python tests/run_documented_commands.py [--list] [SUBSTRING ...]

`tests/test_documented_commands.py` (in the test suite) checks that each
command resolves; this runs them, from a scratch directory that holds the
repository's `configs/` (so relative workdirs such as `runs/vit_dense` land
there), with

  * `--config.train.total_steps=2` (one warm-up step, a log line every
    step, no periodic evaluation) appended, the robustness evaluation cut
    to 32 examples where the command's config has one, and every
    `--workdir` moved into the scratch directory (a command without one
    trains into the binary's default `./runs/default` there);
  * `data_dir` values (`DIR`, `/data/tfds`, ...) pointed at a fake
    `imagenet2012` made with `python -m vmoe_ext.data.fake_tfds`;
  * 8 fake CPU devices for a command with a `sharding.shape`;
  * one persistent compilation cache for all of them (the programs they
    share compile once). XLA keeps its default flags: the test suite's
    fast-compile ones make the 224-px ImageNet command's steps many times
    slower.

Two commands run at a time (each is mostly one core); those that read
another's workdir run after it (`chain`). A
command that needs what this machine cannot have is listed as skipped with
the reason (a released checkpoint, CIFAR-10, ImageNet-O, a cloud bucket, or
a paper-size batch of 224-px images); the test suite still checks that it
resolves. Exit status 1 if any command run fails.
"""

from __future__ import annotations

import concurrent.futures
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from vmoe_ext.errors import ConfigError  # noqa: E402
from vmoe_ext.models import LANGUAGE_MODEL  # noqa: E402
from fake_devices import fake_devices_env  # noqa: E402
from test_documented_commands import (  # noqa: E402
    ROOT, documented_commands, resolve_command)

STEPS = ("--config.train.total_steps=2", "--config.train.log_every=1",
         "--config.train.eval_every=0", "--config.train.checkpoint_every=2",
         "--config.optimizer.warmup_steps=1")
ROBUSTNESS = ("--config.robustness.num_examples=32",)
FAKE_DATA = ("DIR", "/data/tfds", "/data/tensorflow_datasets",
             "/tmp/fake_tfds")
# (pattern in the command, why it cannot run here).
SKIP = (
    ("gs://", "writes to a cloud bucket"),
    ("/ckpts/", "needs a released checkpoint"),
    ("cifar10", "needs CIFAR-10 prepared with TFDS"),
    ("imagenet_o=", "needs ImageNet-O"),
    ("/data/wikitext-103", "needs WikiText-103"),
)
DEFAULT_RUN = "python -m vmoe_ext.main"  # Trains into ./runs/default.


def chain(where: str, command: str) -> str:
  """Commands that build on another's workdir share a chain and run in
  order: the carving walk-through's four steps, and docs/robustness.md's
  checkpoint evaluation after the default run whose `./runs/default` it
  reads. Every other command is a chain of its own."""
  if where == "docs/carving.md":
    return where
  if command == DEFAULT_RUN or where == "docs/robustness.md":
    return "runs/default"
  if "runs/lm_tiny" in command:  # The LM's evaluate-only after its run.
    return "runs/lm_tiny"
  return command
# ImageNet configs run at the paper's batch (4,096 images at 224 px) on this
# machine only with the config's smoke option.
SMALL_IMAGENET = ",smoke"


def skip_reason(command: str) -> str | None:
  for pattern, why in SKIP:
    if pattern in command:
      return why
  if (re.search(r"configs/(imagenet|swin_moe_imagenet)\.py", command)
      and SMALL_IMAGENET not in command):
    return ("a paper-size batch of 224-px images (the smoke command of "
            "docs/imagenet.md runs this config small)")
  return None


def shortened(command: str, scratch: str, fake_data: str) -> list[str]:
  """The command's arguments for this machine (module docstring)."""
  words = [w for w in shlex.split(command)[3:] if not w.startswith("[")]
  out = []
  for word in words:
    flag, _, value = word.partition("=")
    if flag == "--workdir":
      value = os.path.join(scratch, value.lstrip("/"))
    elif flag.endswith(".data_dir") and value in FAKE_DATA:
      value = fake_data
    out.append(f"{flag}={value}" if _ else word)
  out += STEPS
  config = resolve_command(["prog", *out])
  if (config.get("robustness") is not None
      and config["model"]["name"] != LANGUAGE_MODEL):  # Image attacks only.
    out += ROBUSTNESS
  return out


def main(argv: list[str]) -> int:
  wanted = [a for a in argv[1:] if not a.startswith("--")]
  commands = [(w, c) for w, c in documented_commands()
              if not wanted or any(a in c for a in wanted)]
  if "--list" in argv:
    for where, command in commands:
      print(f"{where}: {command}  [{skip_reason(command) or 'runs'}]")
    return 0
  scratch = tempfile.mkdtemp(prefix="documented_commands_")
  try:
    return _run_all(commands, scratch)
  finally:
    shutil.rmtree(scratch, ignore_errors=True)


def _run_one(where: str, command: str, scratch: str, fake_data: str
             ) -> tuple[bool, str]:
  """Runs one command; `(passed, what to print)`."""
  try:
    args = shortened(command, scratch, fake_data)
  except ConfigError as e:
    return False, (f"FAIL  {where}: {command}\n      shortened, it does not "
                   f"resolve: {e}")
  env = dict(os.environ)
  if re.search(r"sharding\.shape", command):
    env = fake_devices_env(8)
  start = time.time()
  proc = subprocess.run([sys.executable, "-m", "vmoe_ext.main", *args],
                        cwd=scratch, env=env, capture_output=True, text=True,
                        check=False)
  ok = proc.returncode == 0
  text = (f"{'ok  ' if ok else 'FAIL'}  {where}: {command} "
          f"({time.time() - start:.0f} s)")
  if not ok:
    text += "\n      " + "\n      ".join(
        (proc.stderr.strip() or proc.stdout.strip()).splitlines()[-15:])
  return ok, text


def _run_all(commands: list[tuple[str, str]], scratch: str) -> int:
  """Runs the commands two at a time (each is mostly one core), those
  that build on each other (`chain`) in order."""
  os.environ["JAX_COMPILATION_CACHE_DIR"] = os.path.join(scratch, "jax_cache")
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")
  os.symlink(os.path.join(ROOT, "configs"), os.path.join(scratch, "configs"))
  fake_data = os.path.join(scratch, "fake_tfds")
  subprocess.run([sys.executable, "-m", "vmoe_ext.data.fake_tfds",
                  f"--data_dir={fake_data}", "--num_train=64",
                  "--num_validation=32"], check=True, cwd=scratch,
                 capture_output=True)
  chains: dict[str, list[tuple[str, str]]] = {}
  skipped = 0
  for where, command in commands:
    why = skip_reason(command)
    if why is not None:
      skipped += 1
      print(f"skip  {where}: {command}\n      ({why})", flush=True)
      continue
    chains.setdefault(chain(where, command), []).append((where, command))
  lock = threading.Lock()
  results = []

  def run_chain(chain: list[tuple[str, str]]) -> None:
    for where, command in chain:
      ok, text = _run_one(where, command, scratch, fake_data)
      with lock:
        results.append(ok)
        print(text, flush=True)

  with concurrent.futures.ThreadPoolExecutor(2) as pool:
    list(pool.map(run_chain, chains.values()))
  failed = results.count(False)
  print(f"documented commands: {len(results)} run, {failed} failed, "
        f"{skipped} skipped (each still resolves: "
        "tests/test_documented_commands.py)")
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main(sys.argv))
