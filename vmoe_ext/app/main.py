"""Training binary.

    python -m vmoe_ext.main [--config=configs/FILE.py[:ARG]] [--workdir=DIR]
                            [--config.FIELD=VALUE ...]

With no flags it runs the embedded default (`configs/default.py`: a small V-MoE
on MNIST-5k, then the routing analysis and a short FGSM/PGD/SPSA and
corruption evaluation) into `./runs/default` and prints the report. The
config chooses the mode:

  train          (the default) train, then run the `robustness` section's
                 evaluation, if set.
  evaluate-only  `robustness.checkpoint_dir` set (`configs/robustness.py`):
                 evaluate that training workdir's newest checkpoint (or
                 `robustness.from_init`: the params `init` loads).
  carve          `carve` section set (`configs/carve.py`): carve a dense ViT
                 checkpoint into a V-MoE checkpoint (`vmoe_ext.app.carve`).

Every run ends with the routing analysis of the test split
(docs/robustness.md). The config is resolved once
(`vmoe_ext.app.schema.resolve_config`: checked, defaults filled) and each
mode assembles its run from it (`vmoe_ext.app.context.RunContext`).
Outputs in WORKDIR: `metrics.jsonl`, `report.md`, PNG plots, `checkpoints/`,
`tensorboard/`. A workdir holding a checkpoint of the same config resumes it.
`--help` prints this text and the flags.

Exit status, one per kind, each with one paragraph on stderr and no
traceback (unless `--debug`):

  0    the run finished (or was already finished).
  1    a failure at run time: `error: ...` (training diverged, no readable
       checkpoint, a full disk or unwritable file, data of a wrong shape, or an
       unexpected error, whose traceback is saved to WORKDIR/error.txt).
  2    invalid input: `config error: FIELD: message`, FIELD being the full
       dotted path of a config field (`model.moe.router.num_selected`,
       `robustness.attacks[1].eps`) or the flag (`--config` for a missing or
       broken config file, `--workdir`), before anything is compiled.
  130  stopped by Ctrl-C (SIGINT). The first Ctrl-C in training saves a
       checkpoint at the step boundary (as SIGTERM does); a second one, or
       one outside training, stops at once.
  143  stopped by SIGTERM (preemption): a checkpoint was saved at the step
       boundary; re-running the same command resumes bit-identically.
"""

from __future__ import annotations

import os
import re
import signal
import sys
import textwrap
import traceback
import warnings
from typing import NoReturn, Sequence

import jax
from absl import app, flags, logging
from ml_collections import config_flags

from vmoe_ext.app.carve import carve_checkpoint
from vmoe_ext.app.context import resolved
from vmoe_ext.app.evaluate import evaluate_checkpoint, output_dir
from vmoe_ext.app.memory import check_attack_memory
from vmoe_ext.app.schema import ALTERNATIVES, CONFIG
from vmoe_ext.app.train import train_and_evaluate
from vmoe_ext.config.overrides import (flag_error, prepare_overrides,
                                      take_none_overrides)
from vmoe_ext.errors import ConfigError, InputError
from vmoe_ext.evaluate.datasets import check_prepared
from vmoe_ext.evaluate.final import after_training_hook
from vmoe_ext.sharding.multihost import initialize, is_main_process
from vmoe_ext.train.checkpoints import CheckpointError
from vmoe_ext.train.config_files import CONFIG_DIR, load_config_flag
from vmoe_ext.train.loop import NonFiniteError, Preempted
from vmoe_ext.train.workdir import check_workdir

FLAGS = flags.FLAGS
DEFAULT_CONFIG = os.path.join(CONFIG_DIR, "default.py")
PREEMPTED = 143  # 128 + SIGTERM, as if the signal had ended the process.
INTERRUPTED = 130  # 128 + SIGINT.
flags.DEFINE_string("workdir", os.path.join(".", "runs", "default"),
                    "Directory for checkpoints, metrics, plots and report.")
flags.DEFINE_bool("debug", False, "Show the traceback of any error.")
# Multi-process jobs (`vmoe_ext.sharding.multihost`, docs/sharding.md).
flags.DEFINE_string("coordinator_address", None,
                    "host:port of process 0, for jax.distributed.initialize.")
flags.DEFINE_integer("num_processes", None, "Processes in the job.")
flags.DEFINE_integer("process_id", None, "This process's index.")
flags.DEFINE_bool("distributed", False,
                  "Call jax.distributed.initialize() with no arguments (TPU "
                  "pod slices, SLURM, Open MPI: jax finds the values).")


def _fail(message: str, status: int = 2) -> NoReturn:
  print(message, file=sys.stderr)
  sys.exit(status)


def _split_config_flag(argv: Sequence[str]) -> tuple[str, list[str]]:
  """The last `--config=FILE[:ARG]` (or `--config FILE`) of `argv`, and
  `argv` without those flags."""
  value, rest = DEFAULT_CONFIG, []
  skip = False
  for i, a in enumerate(argv):
    if skip:
      skip = False
    elif a.startswith("--config="):
      value = a[len("--config="):]
    elif a == "--config" and i + 1 < len(argv):
      value, skip = argv[i + 1], True
    else:
      rest.append(a)
  return value, rest


_HELP_FLAGS = ("--help", "-help", "-h", "-?", "--help=true", "--help=True")
_FLAG_NAMES = {"workdir": "=DIR", "debug": "", "coordinator_address":
               "=HOST:PORT", "num_processes": "=N", "process_id": "=I",
               "distributed": ""}
_OVERRIDES_HELP = """\
  --config.FIELD=VALUE
    Sets one field of the config (repeat for more), FIELD being its dotted
    path and VALUE a Python literal (a string needs no quotes):
      --config.train.total_steps=100
      --config.model.moe.router.name=cosine    (the router's own defaults)
      --config.robustness.attacks[0].eps=0.1   (list items by index)
      --config.robustness=None                 (a section or field: off)
    Every documented field can be set, also one the config file leaves out
    (docs/training.md); a mistake is one `config error:` line, exit 2.
  --helpfull
    Every flag, also those of absl and jax."""


def usage() -> str:
  """The `--help` text: the module docstring, then the binary's flags."""
  lines = [__doc__.strip(), "", "Flags:", "  --config=FILE[:ARG]",
           "    Config file (configs/FILE.py, ARG passed to its get_config); "
           "default",
           f"    {os.path.relpath(DEFAULT_CONFIG)}."]
  for name, value in _FLAG_NAMES.items():
    flag = FLAGS[name]
    lines += [f"  --{name}{value}", *textwrap.wrap(
        f"{flag.help} (default: {flag.default!r})", 76,
        initial_indent="    ", subsequent_indent="    ")]
  return "\n".join(lines) + "\n" + _OVERRIDES_HELP


def parse_config_flags(argv: Sequence[str], values: flags.FlagValues,
                       notes: list[str]) -> list[str]:
  """Loads the config `argv` names and parses its flags into `values`.

  The binary's one path from a command line to its config, also for tools
  and tests that resolve a command without running it: the config file
  (`--config=FILE[:ARG]`, else the default), every `--config.FIELD` checked
  against the schema and made settable (`prepare_overrides`), `=None` taken
  (`take_none_overrides`), then `values.config` defined and `argv` parsed.
  One `note:` line per field a component switch removed is printed on
  stderr and appended to `notes`.

  Returns:
    the arguments the flag parser left (argv[0] first).

  Raises:
    ConfigError, flags.Error, or what ml_collections raises on a flag value
    (`parse_flags` turns each into one line).
  """
  value, rest = _split_config_flag(argv)
  config = prepare_overrides(load_config_flag(value), rest, CONFIG, notes,
                             alternatives=ALTERNATIVES)
  for note in notes:
    print(f"note: {note}", file=sys.stderr)
  rest = take_none_overrides(config, rest, CONFIG)
  config_flags.DEFINE_config_dict(
      "config", config,
      "Config file (configs/FILE.py[:ARG]); fields can be overridden with "
      "--config.FIELD=VALUE.", flag_values=values, lock_config=True,
      sys_argv=rest)
  return values(rest)


def parse_flags(argv: list[str]) -> list[str]:
  """`app.run`'s flag parser: config problems exit 2 without a traceback.

  The config file is loaded here and every `--config.FIELD` override checked
  against the schema (`vmoe_ext.config.overrides`), so a missing file, an
  unknown field or a value of the wrong type is one clear line and every
  documented field can be set, also one the file leaves out or sets to
  None. `--help` prints `usage()` and exits 0.
  """
  if any(a in _HELP_FLAGS for a in argv[1:]):
    print(usage())
    sys.exit(0)
  rest: list[str] = []
  notes: list[str] = []
  try:
    rest = _split_config_flag(argv)[1]
    return parse_config_flags(argv, FLAGS, notes)
  except ConfigError as e:
    _fail(f"config error: {e}")
  except flags.Error as e:
    if re.match(r"flag --config\.", str(e)):  # A value of the wrong type.
      _fail(f"config error: {flag_error(e, rest)}")
    _fail(f"error: {e}\nPass --help to see the flags.")
  except (ValueError, TypeError, KeyError, IndexError, AttributeError) as e:
    # ml_collections on a --config.FIELD flag the checks above let through.
    if "--debug" in argv:
      raise
    _fail(f"config error: {flag_error(e, rest)}")


def stop_status(stop: Preempted | KeyboardInterrupt) -> int:
  """The exit status of a run stopped by a signal: 130 for Ctrl-C (a
  checkpoint saved, or a second Ctrl-C), 143 for SIGTERM."""
  if isinstance(stop, Preempted) and stop.signum != signal.SIGINT:
    return PREEMPTED
  return INTERRUPTED


def out_of_memory(error: BaseException) -> bool:
  """Whether `error` is XLA running out of device or host memory."""
  text = str(error)
  return "RESOURCE_EXHAUSTED" in text or "Out of memory" in text


def _out_of_memory(error: BaseException) -> NoReturn:
  first = str(error).strip().splitlines()[0][:300]
  _fail(f"error: out of memory ({first}). The batches do not fit this "
        "machine: lower data.batch_size (training) or data.eval_batch_size "
        "(evaluation, the routing analysis and the attacks run in batches of "
        "it), or use a smaller model; a mesh with more devices "
        "(sharding.shape) splits them. Nothing after the last checkpoint was "
        "lost: re-run the same command to resume.", status=1)


def _unexpected(error: BaseException, workdir: str) -> NoReturn:
  """A bug: one paragraph on stderr, the traceback in a file."""
  text = "".join(traceback.format_exception(error))
  name = ("error.txt" if jax.process_count() == 1
          else f"error.process{jax.process_index()}.txt")
  where = os.path.join(workdir, name)
  try:
    with open(where, "w", encoding="utf-8") as f:
      f.write(text)
  except OSError:
    where = None
  saved = (f"the traceback is in {where}" if where else "the traceback could "
           "not be saved")
  _fail(f"error: unexpected {type(error).__name__}: {error}. This is a bug "
        f"in vmoe_ext; {saved}, or re-run with --debug to see it.", status=1)


def _check_multiprocess_mode(config) -> None:
  """Multi-process jobs train (and evaluate after training); the carve and
  evaluate-only modes run in one process."""
  if jax.process_count() == 1:
    return
  robustness = config.robustness or {}
  for field, on in (("carve", config.carve is not None),
                    ("robustness.checkpoint_dir",
                     robustness.get("checkpoint_dir") is not None),
                    ("robustness.from_init", bool(robustness.get("from_init")))):
    if on:
      raise ConfigError(field, f"this mode runs in one process; this job "
                        f"has {jax.process_count()} (drop the "
                        "--coordinator_address/--distributed flags)")


def run(config, workdir: str) -> str:
  """Resolves the config (everything checked before any data or
  compilation), then trains, evaluates or carves into `workdir`; returns
  the report's path."""
  config = resolved(config)
  _check_multiprocess_mode(config)
  if config.robustness is not None and config.robustness.datasets:
    # Evaluation sets are read after training: their absence is reported
    # now, not after it.
    check_prepared(config.robustness.datasets, config.data)
  if config.carve is not None:
    check_workdir(workdir)
    carve_checkpoint(config, workdir)
    return os.path.join(workdir, "report.md")
  robustness = config.robustness
  if robustness is not None and (robustness.checkpoint_dir is not None
                                 or robustness.from_init):
    out = output_dir(workdir) if workdir else workdir
    check_workdir(out)
    evaluate_checkpoint(config, workdir)  # Evaluation only.
    return os.path.join(out, "report.md")
  check_workdir(workdir)
  # Every run: the routing analysis, then the robustness evaluation if set.
  train_and_evaluate(config, workdir,
                     after_training=after_training_hook(config, workdir),
                     preflight=check_attack_memory, handle_sigterm=True)
  return os.path.join(workdir, "report.md")


def main(argv) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  logging.set_verbosity(logging.WARNING)
  # One line per warning (a recovered corrupt checkpoint), not two.
  warnings.formatwarning = lambda message, *_, **__: f"warning: {message}\n"
  config, workdir = FLAGS.config, FLAGS.workdir
  try:
    initialize(FLAGS.coordinator_address, FLAGS.num_processes,
               FLAGS.process_id, auto=FLAGS.distributed)
    report = run(config, workdir)
  except ConfigError as e:
    if FLAGS.debug:
      raise
    _fail(f"config error: {e}")
  except Preempted as e:
    _fail(f"stopped: {e}", status=stop_status(e))
  except KeyboardInterrupt as e:
    if FLAGS.debug:
      raise
    _fail("stopped: interrupted (Ctrl-C) at once; nothing after the last "
          "checkpoint was saved. Re-run the same command to resume from it.",
          status=stop_status(e))
  except (InputError, NonFiniteError, CheckpointError) as e:
    if FLAGS.debug:
      raise
    _fail(f"error: {e}", status=1)
  except OSError as e:
    if FLAGS.debug:
      raise
    name = f" ({e.filename})" if getattr(e, "filename", None) else ""
    _fail(f"error: {e.strerror or e}{name}. Nothing was lost before the last "
          "checkpoint: fix the cause (e.g. free disk space) and re-run the "
          "same command to resume.", status=1)
  except Exception as e:  # pylint: disable=broad-except
    if FLAGS.debug:
      raise
    if out_of_memory(e):
      _out_of_memory(e)
    _unexpected(e, workdir)
  if is_main_process() and os.path.exists(report):
    with open(report, encoding="utf-8") as f:
      print(f.read())


if __name__ == "__main__":
  app.run(main, flags_parser=parse_flags)
