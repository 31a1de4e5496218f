"""Every `python -m vmoe_ext.main ...` command that README.md and docs/ print
in a code block parses and resolves: its config file and argument exist, its
flags are the binary's and every `--config.FIELD=VALUE` names a field with a
valid value. Checked through the binary's own flag path (`parse_flags`'
steps), config resolution and the model's checks (`validate_config`), in
one process, without training (running each would take minutes). A command
whose only problem is data that is not on this machine (a `data_dir`, a
checkpoint) must fail on exactly that field.
CI runs the commands themselves, shortened to a few steps:
`tests/run_documented_commands.py`.
"""

from __future__ import annotations

import glob
import os
import re
import shlex

import pytest
from absl import flags as absl_flags

from vmoe_ext.app.context import resolved
from vmoe_ext.app.main import (DEFAULT_CONFIG, _split_config_flag,
                               parse_config_flags)
from vmoe_ext.app.schema import validate_config
from vmoe_ext.errors import ConfigError
from vmoe_ext.train.config_files import CONFIG_DIR

ROOT = os.path.dirname(CONFIG_DIR)
DOCS = ["README.md", *sorted(
    os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs",
                                                              "*.md")))]
# The binary's own flags besides --config.
BINARY_FLAGS = ("--workdir", "--debug", "--distributed",
                "--coordinator_address", "--num_processes", "--process_id")
# Fields that name data or checkpoints on the user's disk.
DATA_FIELDS = ("data.data_dir", "data.path", "init.checkpoint",
               "init.workdir", "robustness.checkpoint_dir",
               "carve.checkpoint_dir")


def _code_blocks(text: str) -> list[str]:
  """Fenced blocks and 4-space indented blocks."""
  blocks = re.findall(r"```[a-z]*\n(.*?)```", text, re.S)
  blocks += ["\n".join(line[4:] for line in m.group(0).splitlines())
             for m in re.finditer(r"(?:^    \S.*\n?)+", text, re.M)]
  return blocks


def documented_commands() -> list[tuple[str, str]]:
  """`(file, command)` for every binary command of the docs, once each (at
  its first page), in the order the pages print them."""
  out = []
  for name in DOCS:
    text = open(os.path.join(ROOT, name), encoding="utf-8").read()
    for block in _code_blocks(text):
      for line in block.replace("\\\n", " ").splitlines():
        line = line.split(" #")[0].strip()
        if "python -m vmoe_ext.main" in line and "..." not in line:
          command = line[line.index("python -m vmoe_ext.main"):]
          if command.count('"') % 2:  # Inside a quoted remote command.
            command = command.rstrip('"')
          if command not in [c for _, c in out]:
            out.append((name, command))
  return out


COMMANDS = documented_commands()


def resolve_command(argv: list[str]):
  """The resolved config of a binary command line (argv[0] ignored), by the
  binary's own path (`parse_config_flags`) on fresh flag values."""
  value, rest = _split_config_flag(argv)
  values = absl_flags.FlagValues()
  parse_config_flags(["prog", f"--config={value}",
                      *(a for a in rest[1:] if a.startswith("--config."))],
                     values, [])
  return resolved(values.config)


def resolve_but_for_data(words: list[str], where: str):
  """The resolved config of the binary's arguments `words`, checked as a
  run checks it before reading data (`validate_config`: the model's own
  checks too), or None when the only problem is data this machine lacks
  (the command is right otherwise); any other ConfigError fails the test,
  naming `where`."""
  try:
    config = resolve_command(["prog", *words])
    validate_config(config)
    return config
  except ConfigError as e:
    assert e.field.startswith(DATA_FIELDS) or ".source" in e.field, (
        f"{where}: {e}")
    return None


def test_the_docs_print_binary_commands():
  files = {name for name, _ in COMMANDS}
  assert {"README.md", "docs/carving.md", "docs/imagenet.md",
          "docs/robustness.md", "docs/sharding.md"} <= files, files
  assert len(COMMANDS) >= 15


@pytest.mark.parametrize("where,command", COMMANDS,
                         ids=[f"{w}:{c[24:70]}" for w, c in COMMANDS])
def test_a_documented_command_resolves(where, command, monkeypatch):
  monkeypatch.chdir(ROOT)  # Commands are run from the repository root.
  words = [w for w in shlex.split(command)[3:] if not w.startswith("[")]
  for word in words:
    flag = word.split("=")[0]
    assert flag.startswith("--config") or flag in BINARY_FLAGS, (
        f"{where}: {command}: unknown flag {flag}")
  config = resolve_but_for_data(words, f"{where}: {command}")
  if config is None:
    return
  assert config.train.total_steps > 0
  if _split_config_flag(["prog", *words])[0] == DEFAULT_CONFIG:
    assert config.data.name == "mnist5k"
