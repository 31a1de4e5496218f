"""Training binary.

    python -m vmoe_ext.main [--config=configs/FILE.py[:ARG]] [--workdir=DIR]
                            [--config.FIELD=VALUE ...]

With no flags it runs the embedded default (`configs/default.py`: a small V-MoE
on MNIST-5k, then a short FGSM/PGD/SPSA and corruption evaluation) into
`./runs/default` and prints the report. A config whose
`robustness.checkpoint_dir` is set (`configs/robustness.py`) only evaluates
that training workdir's newest checkpoint. Outputs in WORKDIR:
`metrics.jsonl`, `report.md`, PNG plots, `checkpoints/`, `tensorboard/`. A
workdir holding a checkpoint of the same config resumes it.

Bad input exits with status 2 and one line on stderr, no traceback:
`config error: FIELD: message`, FIELD being the full dotted path of a config
field (`model.moe.router.num_selected`, `robustness.attacks[1].eps`) or the
flag (`--config` for a missing or broken config file, `--workdir`). Data
handed to a metric in a wrong shape prints `error: ...` and exits with 1.
Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import os
import re
import sys
from typing import NoReturn, Sequence

from absl import app, flags, logging
from ml_collections import config_flags

from vmoe_ext.errors import ConfigError, InputError
from vmoe_ext.train.config_files import (CONFIG_DIR, check_overrides,
                                         load_config_flag)

FLAGS = flags.FLAGS
DEFAULT_CONFIG = os.path.join(CONFIG_DIR, "default.py")
flags.DEFINE_string("workdir", os.path.join(".", "runs", "default"),
                    "Directory for checkpoints, metrics, plots and report.")


def _fail(message: str, status: int = 2) -> NoReturn:
  print(message, file=sys.stderr)
  sys.exit(status)


def _config_value(argv: Sequence[str]) -> str:
  """The last `--config=FILE[:ARG]` (or `--config FILE`) of `argv`."""
  value = DEFAULT_CONFIG
  for i, a in enumerate(argv):
    if a.startswith("--config="):
      value = a[len("--config="):]
    elif a == "--config" and i + 1 < len(argv):
      value = argv[i + 1]
  return value


def parse_flags(argv: list[str]) -> list[str]:
  """`app.run`'s flag parser: config problems exit 2 without a traceback.

  The config file is loaded and the `--config.FIELD` overrides are checked
  here first, so that a missing file or an unknown field is one clear line
  (ml_collections would raise while defining the flag).
  """
  try:
    check_overrides(load_config_flag(_config_value(argv)), argv)
    config_flags.DEFINE_config_file(
        "config", DEFAULT_CONFIG,
        "Config file (configs/FILE.py[:ARG]); fields can be overridden with "
        "--config.FIELD=VALUE.", lock_config=True, sys_argv=list(argv))
    return FLAGS(argv)
  except ConfigError as e:
    _fail(f"config error: {e}")
  except flags.Error as e:
    match = re.match(r"flag --config\.([^=\s]+)=", str(e))
    if match:  # A value that does not parse as the field's type.
      reason = str(e).split(": ", 1)[-1]
      _fail(f"config error: {match.group(1)}: cannot set it from the "
            f"command line: {reason}")
    _fail(f"error: {e}\nPass --helpfull to see the flags.")


def check_workdir(workdir: str) -> None:
  """ConfigError("--workdir") unless `workdir` can be (or is) a directory."""
  if not workdir:
    raise ConfigError("--workdir", "is empty; give a directory for the run")
  if os.path.exists(workdir) and not os.path.isdir(workdir):
    raise ConfigError("--workdir", f"{workdir!r} exists and is not a "
                      "directory")


def main(argv) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  # Heavy imports here, after flag parsing.
  from vmoe_ext.evaluate.from_checkpoint import evaluate_checkpoint
  from vmoe_ext.evaluate.robustness import (after_training_hook,
                                            robustness_config)
  from vmoe_ext.train.loop import train_and_evaluate
  from vmoe_ext.train.validate import validate_config

  logging.set_verbosity(logging.WARNING)
  config, workdir = FLAGS.config, FLAGS.workdir
  robustness = config.get("robustness")
  try:
    check_workdir(workdir)
    validate_config(config)  # Everything, before any data or compilation.
    if robustness is not None:
      robustness_config(robustness)  # Also its evaluation datasets.
    if robustness is not None and robustness.get("checkpoint_dir"):
      evaluate_checkpoint(config, workdir)  # Evaluation only.
    else:
      hook = None if robustness is None else after_training_hook(config,
                                                                 workdir)
      train_and_evaluate(config, workdir, after_training=hook)
  except ConfigError as e:
    _fail(f"config error: {e}")
  except InputError as e:
    _fail(f"error: {e}", status=1)
  with open(os.path.join(FLAGS.workdir, "report.md")) as f:
    print(f.read())


if __name__ == "__main__":
  app.run(main, flags_parser=parse_flags)
