"""The environment of a subprocess with `n` fake CPU devices.

`XLA_FLAGS=--xla_force_host_platform_device_count=n` must be set before jax
is imported, so multi-device checks run in a subprocess. It inherits the
suite's other XLA flags (the fast-compile flags of `tests/conftest.py`) and
its persistent compilation cache; a device count already in `XLA_FLAGS` is
replaced.
"""

from __future__ import annotations

import os
import re

DEVICE_FLAG = "--xla_force_host_platform_device_count"


def without_device_count(flags: str) -> str:
  return " ".join(re.sub(rf"{DEVICE_FLAG}=\S+", "", flags).split())


def fake_devices_env(n: int, **extra: str) -> dict[str, str]:
  """`os.environ` on the CPU with `n` devices, and `extra`."""
  flags = without_device_count(os.environ.get("XLA_FLAGS", ""))
  return {**os.environ, "JAX_PLATFORMS": "cpu", **extra,
          "XLA_FLAGS": f"{flags} {DEVICE_FLAG}={n}".strip()}
