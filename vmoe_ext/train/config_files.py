"""Loading ml-collections config files (`configs/*.py` with `get_config(arg)`).

`load_config` loads a file by path or name. For the binary, `load_config_flag`
loads the `--config=FILE[:ARG]` value, raising `ConfigError("--config")` with a
clear message (missing file, syntax error, no `get_config`, an argument the
file rejects) instead of a traceback. The `--config.FIELD=VALUE` flags are
checked by `vmoe_ext.config.overrides`.
"""

from __future__ import annotations

import difflib
import importlib.util
import os
import traceback
from typing import Optional

import ml_collections

from vmoe_ext.errors import ConfigError

# The repository's configs/ folder (the package is installed editable).
CONFIG_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "configs")


def load_config(path: str, arg: Optional[str] = None
                ) -> ml_collections.ConfigDict:
  """Returns `get_config(arg)` of the config file at `path`.

  A bare name such as "default" refers to `configs/default.py`.
  """
  if not path.endswith(".py"):
    path = os.path.join(CONFIG_DIR, f"{path}.py")
  name = "vmoe_ext_config_" + os.path.splitext(os.path.basename(path))[0]
  spec = importlib.util.spec_from_file_location(name, path)
  if spec is None or not os.path.exists(path):
    raise FileNotFoundError(f"config file not found: {path}")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(arg) if arg is not None else module.get_config()


def load_config_flag(value: str) -> ml_collections.ConfigDict:
  """Loads `--config=FILE[:ARG]`; ConfigError("--config") if it fails."""
  path, _, arg = value.partition(":")
  field = "--config"
  if not path:
    raise ConfigError(field, "is empty; give a config file, e.g. "
                      "--config=configs/default.py")
  if not os.path.isfile(path):
    raise ConfigError(field, f"config file not found: {path!r}" +
                      _did_you_mean(path))
  try:
    config = load_config(path, arg or None)
  except SyntaxError as e:
    raise ConfigError(field, f"syntax error in {e.filename}, line {e.lineno}: "
                      f"{e.msg}") from e
  except AttributeError as e:
    if "get_config" not in str(e):
      raise ConfigError(field, _failure(path, arg, e)) from e
    raise ConfigError(field, f"{path} defines no get_config(arg=None) "
                      "function") from e
  except ConfigError:
    raise
  except Exception as e:  # pylint: disable=broad-except
    raise ConfigError(field, _failure(path, arg, e)) from e
  if not isinstance(config, ml_collections.ConfigDict):
    raise ConfigError(field, f"get_config of {path} returned a "
                      f"{type(config).__name__}, not a ConfigDict")
  return config


def _did_you_mean(path: str) -> str:
  """"; did you mean 'configs/default.py'?" for the closest config file in
  `path`'s folder (`configs/` for a bare name), else ""."""
  folder = os.path.dirname(path) or os.path.relpath(CONFIG_DIR)
  try:
    names = sorted(n for n in os.listdir(folder) if n.endswith(".py"))
  except OSError:
    return ""
  close = difflib.get_close_matches(os.path.basename(path), names, n=1)
  return (f"; did you mean {os.path.join(folder, close[0])!r}?" if close
          else "")


def _failure(path: str, arg: str, e: BaseException) -> str:
  where = traceback.extract_tb(e.__traceback__)[-1]
  call = f"get_config({arg!r})" if arg else "get_config()"
  return (f"{path}: {call} failed: {type(e).__name__}: {e} "
          f"({os.path.basename(where.filename)}, line {where.lineno})")
