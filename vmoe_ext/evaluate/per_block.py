"""Each evaluation block's NLL of a language model, for paired statistics.

After training, a language-model run writes `per_block.npz` into its
workdir: for every split of its final evaluation (`valid`, `test`, and with
the word swap on `valid_attacked`, `test_attacked`) the `[num_blocks]` mean
token NLL (nats) of each block that the full-stream evaluation scored, in
stream order (`vmoe_ext.data.text_eval.StreamEval.block_losses`). Their mean
is the split's `loss` in `metrics.jsonl` (the authors' `full_eval`: the mean
over blocks of the block's mean NLL), `exp` of it the PPL.

Two runs evaluated on the same text (corpus, `data.block_size`,
`data.eval_batch_size`, word-swap rate and seed) score the same blocks, so
they can be compared block by block, as image runs are compared image by
image (`vmoe_ext.evaluate.per_example`).

Keys of the file: the split names, each a float64 `[num_blocks]` array.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

import numpy as np

FILENAME = "per_block.npz"


def write(workdir: str, blocks: Mapping[str, Sequence[float]]) -> str:
  """Writes WORKDIR/per_block.npz: `{split: [num_blocks] block losses}`;
  returns its path."""
  arrays = {}
  for split, losses in blocks.items():
    values = np.asarray(losses, np.float64)
    if values.ndim != 1 or not values.size:
      raise ValueError(f"per-block losses of {split!r} must be a non-empty "
                       f"[num_blocks] array; got shape {values.shape}")
    arrays[split] = values
  path = os.path.join(workdir, FILENAME)
  np.savez_compressed(path, **arrays)
  return path


def load(workdir: str) -> dict[str, np.ndarray]:
  """`{split: [num_blocks] block losses}` from WORKDIR/per_block.npz."""
  path = os.path.join(workdir, FILENAME)
  if not os.path.exists(path):
    raise FileNotFoundError(f"{path}: no per-block losses (written by a "
                            "language-model run after training)")
  with np.load(path) as data:
    return {name: data[name] for name in data.files}


__all__ = ["FILENAME", "load", "write"]
