"""Which encoder blocks hold an MoE layer."""

from __future__ import annotations

from typing import Optional, Sequence

from vmoe_ext.errors import require


def resolve_moe_layers(num_layers: int,
                       layers: Optional[Sequence[int]] = None,
                       every: Optional[int] = None,
                       last: Optional[int] = None) -> tuple[int, ...]:
  """Returns the sorted 0-based indices of the MoE blocks.

  Args:
    num_layers: number of encoder blocks.
    layers: explicit block indices (0-based), e.g. `(1, 3, 5, 7)`.
    every: every N-th block, counting from 1: blocks `N-1, 2N-1, ...` (N=2 is
      V-MoE "Every-2": the odd blocks 1, 3, 5, ...). Exclusive with `layers`.
    last: keep only the last N of the candidates (all blocks, or those of
      `every`). `every=2, last=2` on 12 blocks gives V-MoE "Last-2": (9, 11);
      `last=2` alone gives (10, 11).

  Raises:
    ConfigError naming the field for out-of-range, duplicate or empty choices.
  """
  require(isinstance(num_layers, int) and num_layers > 0, "num_layers",
          f"must be a positive integer, got {num_layers!r}")
  if layers is not None:
    require(every is None, "moe.every",
            "give either an explicit moe.layers list or moe.every, not both")
    layers = tuple(layers)
    for i in layers:
      require(isinstance(i, int) and 0 <= i < num_layers, "moe.layers",
              f"MoE layer index {i!r} is out of range for {num_layers} "
              f"encoder blocks (valid: 0..{num_layers - 1})")
    require(len(set(layers)) == len(layers), "moe.layers",
            f"duplicate indices in {layers}")
    candidates = sorted(layers)
  elif every is not None:
    require(isinstance(every, int) and 0 < every <= num_layers, "moe.every",
            f"must be an integer in 1..{num_layers}, got {every!r}")
    candidates = [i for i in range(num_layers) if (i + 1) % every == 0]
  else:
    require(last is not None, "moe.layers",
            "MoE placement missing: set moe.layers, moe.every or moe.last")
    candidates = list(range(num_layers))
  if last is not None:
    require(isinstance(last, int) and 0 < last <= len(candidates), "moe.last",
            f"must be an integer in 1..{len(candidates)} (the candidate "
            f"blocks {tuple(candidates)}), got {last!r}")
    candidates = candidates[-last:]
  require(len(candidates) > 0, "moe.layers", "no MoE layer selected")
  return tuple(candidates)
