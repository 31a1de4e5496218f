"""Contiguous rows of an id stream and the blocks a cached LM reads from them.

`batchify` cuts a split's stream `[N]` into B contiguous rows `[B, N // B]`
(the last `N % B` tokens dropped): row b is tokens `b*L .. (b+1)*L - 1`, so
row b of one block continues row b of the block before it and a model that
caches the hidden states of the previous block sees them as its past (the
authors' `_batchify`). Sharding the B rows over devices or processes gives
each its own contiguous streams.

A block at position p is `inputs = rows[:, p : p+M]` and `targets =
rows[:, p+1 : p+M+1]` (M = block size).

Training (`BlockIterator`, the authors' `train_iteration`): blocks at
p = 0, M, 2M, ...; when the next position p' reaches `L - M` (no whole block
fits after it) the stream restarts at a random offset below M and the
caches are zeroed. The r-th restart's offset is `restart_offset(seed, r, M)`
(a SeedSequence of the seed and r), so the iterator's state `{"position",
"restarts", "reset"}` (JSON-able) fixes every later block: a resumed run
sees bit-identical blocks. The authors draw the offset with Python's unseeded
`random.randrange(M)`, per process; here every process draws the same.

Evaluation (`eval_positions`, the authors' `full_eval`): blocks at
p = 0, M, 2M, ... while a whole block fits, from zero caches, the cache
carried: `(L - 1) // M` blocks; the tokens after the last whole block are not
scored.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from vmoe_ext.errors import require

_RESTART_STREAM = 1
STATE_KEYS = ("position", "restarts", "reset")


def batchify(ids: np.ndarray, batch_size: int, *,
             field: str = "data.batch_size") -> np.ndarray:
  """`[N]` -> `[B, N // B]` contiguous rows (module docstring).

  Raises:
    ConfigError on `field` when B is not positive or exceeds N.
  """
  ids = np.asarray(ids)
  if ids.ndim != 1:
    raise ValueError(f"ids must be one stream [N], got shape {ids.shape}")
  require(isinstance(batch_size, (int, np.integer)) and batch_size >= 1,
          field, f"must be a positive integer, got {batch_size!r}")
  require(batch_size <= len(ids), field,
          f"{batch_size} rows asked of a stream of {len(ids)} tokens")
  length = len(ids) // batch_size
  return ids[:length * batch_size].reshape(batch_size, length)


def num_eval_blocks(length: int, block_size: int) -> int:
  """Whole blocks in rows of `length` tokens: `(length - 1) // M`."""
  return max(length - 1, 0) // block_size


def eval_positions(length: int, block_size: int, *,
                   field: str = "data.block_size") -> range:
  """Start positions of the evaluation blocks over rows of `length` tokens.

  Raises:
    ConfigError on `field` when not one whole block fits (L < M + 1).
  """
  count = num_eval_blocks(length, block_size)
  require(count >= 1, field,
          f"block of {block_size} tokens (and its next-token targets) does "
          f"not fit in rows of {length} tokens; lower it or the batch size")
  return range(0, count * block_size, block_size)


def restart_offset(seed: int, restart: int, block_size: int) -> int:
  """The offset in `[0, M)` at which the `restart`-th restart (1, 2, ...)
  of a `BlockIterator(seed=seed)` resumes."""
  rng = np.random.default_rng([int(seed) % 2**64, _RESTART_STREAM,
                               int(restart)])
  return int(rng.integers(block_size))


class BlockIterator:
  """Infinite training blocks over contiguous rows (module docstring).

  Yields `{"inputs": [B, M] int32, "targets": [B, M] int32, "reset": bool}`;
  `reset` says the caches must be zero before this block (the first block
  and the first after each restart).
  """

  def __init__(self, rows: np.ndarray, block_size: int, seed: int):
    """Builds the iterator at the start of the rows.

    Args:
      rows: `[B, L]` contiguous rows (`batchify`).
      block_size: M, tokens per row per block.
      seed: determines the restart offsets.

    Raises:
      ConfigError on "data.block_size" unless `L >= 2 M` (a restart offset
      may be M - 1, and a whole block must still fit after it).
    """
    rows = np.asarray(rows)
    if rows.ndim != 2:
      raise ValueError(f"rows must be [B, L], got shape {rows.shape}")
    require(isinstance(block_size, (int, np.integer)) and block_size >= 1,
            "data.block_size", f"must be a positive integer, got "
            f"{block_size!r}")
    require(rows.shape[1] >= 2 * block_size, "data.block_size",
            f"{block_size} is too long for training rows of {rows.shape[1]} "
            f"tokens ({rows.shape[0]} rows): a restart may start at "
            f"{block_size - 1}, so rows need >= 2 x block_size tokens; "
            "lower data.block_size or data.batch_size")
    self._rows = rows.astype(np.int32, copy=False)
    self._block_size = int(block_size)
    self._seed = int(seed)
    self._position, self._restarts, self._reset = 0, 0, True

  @property
  def rows(self) -> np.ndarray:
    return self._rows

  def __iter__(self) -> BlockIterator:
    return self

  def __next__(self) -> dict[str, Any]:
    p, m = self._position, self._block_size
    block = {"inputs": self._rows[:, p:p + m],
             "targets": self._rows[:, p + 1:p + m + 1],
             "reset": self._reset}
    self._position, self._reset = p + m, False
    if self._position >= self._rows.shape[1] - m:
      self._restarts += 1
      self._position = restart_offset(self._seed, self._restarts, m)
      self._reset = True
    return block

  def get_state(self) -> dict[str, Any]:
    """`{"position": p, "restarts": r, "reset": bool}` of the next block."""
    return {"position": self._position, "restarts": self._restarts,
            "reset": self._reset}

  def set_state(self, state: Mapping[str, Any]) -> None:
    """Resumes at a state returned by `get_state`."""
    if set(state) != set(STATE_KEYS):
      raise ValueError(f"state must have keys {list(STATE_KEYS)}, got "
                       f"{sorted(state)}")
    position, restarts = int(state["position"]), int(state["restarts"])
    last = self._rows.shape[1] - self._block_size - 1
    if not (0 <= position <= last and restarts >= 0):
      raise ValueError(f"state {dict(state)} out of range: need 0 <= "
                       f"position <= {last} and restarts >= 0")
    self._position, self._restarts = position, restarts
    self._reset = bool(state["reset"])


__all__ = ["BlockIterator", "STATE_KEYS", "batchify", "eval_positions",
           "num_eval_blocks", "restart_offset"]
