"""Full-stream language-model evaluation, as the authors' `full_eval`.

`evaluate_stream(step_fn, ids, carry, block_size=M, batch_size=B)` cuts the
split into B contiguous rows (`text_stream.batchify`) and runs `step_fn` on
the consecutive blocks at positions 0, M, 2M, ... while a whole block fits
(`(L - 1) // M` blocks; the last partial block is not scored), threading the
model's carry (its caches) from block to block, starting from the `carry`
the caller gives (zero caches). The loss is the mean over blocks of each
block's mean token NLL (`nll_sum / count`); perplexity is `exp(loss)`, bits
per character `loss / ln 2`. Every block the authors score is whole, so this
equals the mean NLL over all scored tokens.

The model side supplies only

  step_fn(carry, inputs [B, M] int32, targets [B, M] int32)
      -> (carry, nll_sum, count)

with `nll_sum` the sum of the token NLLs (natural log) of the block and
`count` the number of tokens it scored (B * M for the authors' models). It
may be jitted; the per-block values are read back once at the end, so the
device is not synchronised block by block.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from vmoe_ext.data.text_stream import batchify, eval_positions
from vmoe_ext.errors import InputError

StepFn = Callable[[Any, np.ndarray, np.ndarray], tuple[Any, Any, Any]]


@dataclasses.dataclass(frozen=True)
class StreamEval:
  """One split's full evaluation.

  Attributes:
    loss: mean over blocks of the block's mean token NLL, in nats.
    num_blocks: blocks scored.
    num_tokens: tokens scored (the sum of the `count`s).
    block_losses: `[num_blocks]` each block's mean token NLL, in nats, in
      stream order (their mean is `loss`): the per-block outcomes that
      paired comparisons of two models on the same text read.
  """
  loss: float
  num_blocks: int
  num_tokens: int
  block_losses: tuple[float, ...] = ()

  @property
  def ppl(self) -> float:
    """Perplexity, `exp(loss)` (word-level corpora report it)."""
    return math.exp(self.loss)

  @property
  def bpc(self) -> float:
    """Bits per character, `loss / ln 2` (byte-level corpora report it)."""
    return self.loss / math.log(2)


def evaluate_stream(step_fn: StepFn, ids: np.ndarray, carry: Any, *,
                    block_size: int, batch_size: int | None = None,
                    progress: Callable[[int, int], None] | None = None
                    ) -> StreamEval:
  """Scores a whole split (module docstring).

  Args:
    step_fn: `(carry, inputs, targets) -> (carry, nll_sum, count)`.
    ids: the split's stream `[N]` (cut into `batch_size` rows), or rows
      `[B, L]` already cut (`batch_size` then None or B).
    carry: the model's state before the first block (zero caches).
    block_size: M, tokens per row per block.
    batch_size: B, rows, for a stream `[N]`.
    progress: called with (blocks done, blocks in all) after each block.

  Raises:
    ConfigError: "data.eval_batch_size" (more rows than tokens),
      "data.block_size" (no whole block fits).
    InputError: a block scored no tokens.
  """
  ids = np.asarray(ids)
  if ids.ndim == 1:
    if batch_size is None:
      raise InputError("batch_size", "is needed to cut a stream [N] into "
                       "rows")
    rows = batchify(ids, batch_size, field="data.eval_batch_size")
  elif ids.ndim == 2:
    if batch_size not in (None, ids.shape[0]):
      raise InputError("batch_size", f"is {batch_size}, but the rows given "
                       f"are {ids.shape[0]}")
    rows = ids
  else:
    raise InputError("ids", f"must be [N] or [B, L], got shape {ids.shape}")
  rows = rows.astype(np.int32, copy=False)
  positions = eval_positions(rows.shape[1], block_size)
  sums, counts = [], []
  for done, p in enumerate(positions, 1):
    carry, nll_sum, count = step_fn(carry, rows[:, p:p + block_size],
                                    rows[:, p + 1:p + block_size + 1])
    sums.append(nll_sum)
    counts.append(count)
    if progress is not None:
      progress(done, len(positions))
  sums_np = np.array([np.asarray(s, np.float64) for s in sums])
  counts_np = np.array([np.asarray(c, np.float64) for c in counts])
  if sums_np.shape != (len(positions),) or counts_np.shape != sums_np.shape:
    raise InputError("step_fn", "must return a scalar nll_sum and count per "
                     "block")
  if np.any(counts_np <= 0):
    raise InputError("step_fn", f"returned count {counts_np.min()} for a "
                     "block; every block must score tokens")
  losses = sums_np / counts_np
  return StreamEval(loss=float(np.mean(losses)),
                    num_blocks=len(positions),
                    num_tokens=int(counts_np.sum()),
                    block_losses=tuple(float(x) for x in losses))


def evaluate_splits(step_fn: StepFn, splits: Mapping[str, np.ndarray],
                    carry: Any, *, block_size: int, batch_size: int
                    ) -> dict[str, StreamEval]:
  """`evaluate_stream` on every split (clean and attacked ones alike), each
  from the same initial `carry`."""
  return {name: evaluate_stream(step_fn, ids, carry, block_size=block_size,
                                batch_size=batch_size)
          for name, ids in splits.items()}


__all__ = ["StepFn", "StreamEval", "evaluate_splits", "evaluate_stream"]
