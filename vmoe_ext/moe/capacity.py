"""Expert capacity: how many token slots each expert buffer has per group."""

from __future__ import annotations

import math

from vmoe_ext.errors import require


def compute_capacity(group_size: int,
                     num_selected: int,
                     capacity_factor: float,
                     num_experts: int,
                     multiple_of: int = 1) -> int:
  """Returns `C = ceil(S * K * cf / E)`, rounded up to a multiple of `multiple_of`.

  Args:
    group_size: S, tokens per group.
    num_selected: K, expert slots each token asks for (1 for expert choice).
    capacity_factor: cf > 0; cf = 1 gives exactly enough slots for perfectly
      balanced routing.
    num_experts: E.
    multiple_of: round C up to a multiple of this (vmoe uses 4; default 1
      leaves C untouched). Rounding is the only change ever made to C.

  Raises:
    ConfigError naming the field when an argument is out of range.
  """
  require(isinstance(group_size, int) and group_size > 0, "group_size",
          f"must be a positive integer, got {group_size!r}")
  require(isinstance(num_experts, int) and num_experts > 0, "num_experts",
          f"must be a positive integer, got {num_experts!r}")
  require(isinstance(num_selected, int) and num_selected > 0, "num_selected",
          f"must be a positive integer, got {num_selected!r}")
  require(num_selected <= num_experts, "num_selected",
          f"K={num_selected} must be <= num_experts E={num_experts}")
  require(capacity_factor is not None and capacity_factor > 0,
          "capacity_factor", f"must be > 0, got {capacity_factor!r}")
  require(isinstance(multiple_of, int) and multiple_of > 0,
          "capacity_multiple", f"must be a positive integer, got {multiple_of!r}")
  # Round away float noise (e.g. 1.25 * 8 = 10.000000000000002) before ceil.
  raw = round(group_size * num_selected * capacity_factor / num_experts, 9)
  capacity = max(1, math.ceil(raw))
  return -(-capacity // multiple_of) * multiple_of
