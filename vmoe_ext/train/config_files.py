"""Loading ml-collections config files (`configs/*.py` with `get_config(arg)`)."""

from __future__ import annotations

import importlib.util
import os
from typing import Optional

import ml_collections

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
