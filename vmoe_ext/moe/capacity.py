"""Expert capacity: how many token slots each expert buffer has per group."""

from __future__ import annotations

import math
from typing import Optional

from vmoe_ext.errors import require

ROUNDINGS = ("exact", "vmoe", "tutel")
# multiple_of=None: C's round-up multiple per mode (vmoe's dispatchers default
# to capacity_multiple_of=4; tutel's `alignment` is 1 on one device).
DEFAULT_MULTIPLE = {"exact": 1, "vmoe": 4, "tutel": 1}


def compute_capacity(group_size: int,
                     num_selected: int,
                     capacity_factor: float,
                     num_experts: int,
                     multiple_of: Optional[int] = None,
                     rounding: str = "exact") -> int:
  """Returns `C = ceil(S * K * cf / E)`, rounded up to a multiple of `multiple_of`.

  Three ways to compute it (`rounding`):

  * "exact" (default): the ceiling of the real product. The float product is
    first rounded to 9 decimals, so float noise does not add a slot
    (S=100, K=1, cf=1.1, E=10: `110.00000000000001 / 10` gives C = 11), and C
    is at least 1. `multiple_of` defaults to 1 (C untouched).
  * "vmoe": google-research/vmoe's `vmoe.moe.compute_capacity`, called by its
    dispatchers with `num_tokens = S * K`: `ceil((S * K) * cf / E)` of the raw
    float product (float noise does add a slot: the case above gives 12), then
    rounded up to a multiple of `multiple_of`, which defaults to vmoe's
    `capacity_multiple_of=4`. S=800, K=2, cf=1.1, E=8: `1760.0000000000002 / 8`
    gives 221, then C = 224 (exact: 220).
  * "tutel": microsoft/tutel's `extract_critical` (the Swin-MoE router,
    `vmoe_ext.routers.swin_moe`), with num_tokens = S:
    `C = K * int(cf * ceil(S / E))` — the ceiling is of the tokens per
    expert, the product with cf is truncated (of the raw float), and K
    multiplies afterwards — then rounded up to a multiple of `multiple_of`
    (tutel's `alignment`, default 1). S=10, K=2, cf=1, E=4: `2 * int(3.0)`
    gives 6 (exact: 5); S=10, K=1, cf=1.25, E=4: `int(3.75)` gives 3
    (exact: 4).

  Args:
    group_size: S, tokens per group.
    num_selected: K, expert slots each token asks for (1 for expert choice).
    capacity_factor: cf > 0; cf = 1 gives exactly enough slots for perfectly
      balanced routing.
    num_experts: E.
    multiple_of: round C up to a multiple of this; None: the `rounding`
      mode's default (1 for "exact" and "tutel", 4 for "vmoe"). Rounding up
      to the multiple (and "exact"'s minimum of 1) are the only changes made
      to the mode's formula.
    rounding: "exact", "vmoe" or "tutel" (above).

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
  require(rounding in ROUNDINGS, "capacity_rounding",
          f"must be one of {ROUNDINGS}, got {rounding!r}")
  if multiple_of is None:
    multiple_of = DEFAULT_MULTIPLE[rounding]
  require(isinstance(multiple_of, int) and multiple_of > 0,
          "capacity_multiple", f"must be a positive integer, got {multiple_of!r}")
  if rounding == "tutel":
    capacity = num_selected * int(
        capacity_factor * ((group_size + num_experts - 1) // num_experts))
    # tutel would run with C = 0 (every token dropped); a config error here.
    require(capacity >= 1, "capacity_factor",
            f"{capacity_factor!r} gives tutel capacity {capacity} < 1 "
            f"(K * int(cf * ceil(S / E)) with S={group_size}, "
            f"E={num_experts})")
  elif rounding == "vmoe":
    capacity = math.ceil(group_size * num_selected * capacity_factor
                         / num_experts)
    # vmoe raises rather than clamps (only reachable by float underflow).
    require(capacity >= 1, "capacity_factor",
            f"{capacity_factor!r} gives capacity {capacity} < 1")
  else:
    # Round away float noise (e.g. 100 * 1.1 = 110.00000000000001) before ceil.
    raw = round(group_size * num_selected * capacity_factor / num_experts, 9)
    capacity = max(1, math.ceil(raw))
  return -(-capacity // multiple_of) * multiple_of
