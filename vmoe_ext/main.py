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
"""

from __future__ import annotations

import os
import sys

from absl import app, flags, logging
from ml_collections import config_flags

from vmoe_ext.errors import ConfigError
from vmoe_ext.train.config_files import CONFIG_DIR

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file(
    "config", os.path.join(CONFIG_DIR, "default.py"),
    "Config file (configs/FILE.py[:ARG]); fields can be overridden with "
    "--config.FIELD=VALUE.", lock_config=True)
flags.DEFINE_string("workdir", os.path.join(".", "runs", "default"),
                    "Directory for checkpoints, metrics, plots and report.")


def main(argv) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  # Heavy imports here, after flag parsing.
  from vmoe_ext.evaluate.from_checkpoint import evaluate_checkpoint
  from vmoe_ext.evaluate.robustness import after_training_hook
  from vmoe_ext.train.loop import train_and_evaluate

  logging.set_verbosity(logging.WARNING)
  config, workdir = FLAGS.config, FLAGS.workdir
  robustness = config.get("robustness")
  try:
    if robustness is not None and robustness.get("checkpoint_dir"):
      evaluate_checkpoint(config, workdir)  # Evaluation only.
    else:
      hook = None if robustness is None else after_training_hook(config,
                                                                 workdir)
      train_and_evaluate(config, workdir, after_training=hook)
  except ConfigError as e:
    print(f"config error: {e}", file=sys.stderr)
    sys.exit(2)
  with open(os.path.join(FLAGS.workdir, "report.md")) as f:
    print(f.read())


if __name__ == "__main__":
  app.run(main)
