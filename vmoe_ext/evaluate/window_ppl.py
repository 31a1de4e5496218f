"""Perplexity over consecutive windows of a token stream, as the CMoE paper
reports it for LLaMA (WikiText-2 / C4 test text, windows of 2,048 tokens;
the GPTQ evaluation loop of the authors' code).

Shape letters: W windows, S tokens per window, V vocabulary.

The stream `[N]` is cut into `W = N // S` consecutive, non-overlapping
windows (the last partial one dropped; `max_windows` keeps only the first
ones). Each window is scored on its own from position 0 (no context carried
over): the logits at positions 0..S-2 predict the tokens at 1..S-1, so a
window scores S - 1 tokens. The loss is the mean over windows of each
window's mean token NLL (natural log), equal to the mean over all scored
tokens since every window scores the same number; `PPL = exp(loss)`. The
result is a `vmoe_ext.data.text_eval.StreamEval`, as our language model's
evaluation.

    logits_fn(tokens [b, S] int32) -> logits [b, S, V]

may be any function (a jitted `model.apply`); the windows go through it in
batches of `batch_size` (the last batch smaller).
"""

from __future__ import annotations

from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from vmoe_ext.data.text_eval import StreamEval
from vmoe_ext.errors import require

LogitsFn = Callable[[np.ndarray], jax.Array]


def stream_windows(ids: np.ndarray, length: int,
                   max_windows: Optional[int] = None, *,
                   field: str = "sequence_length") -> np.ndarray:
  """`[W, S]`: the consecutive whole windows of `ids` `[N]`."""
  ids = np.asarray(ids)
  require(ids.ndim == 1, "ids", f"must be a stream [N], got {ids.shape}")
  require(isinstance(length, int) and 2 <= length <= len(ids), field,
          f"must be an integer in 2..{len(ids)} (the stream's tokens), got "
          f"{length!r}")
  count = len(ids) // length
  if max_windows is not None:
    require(isinstance(max_windows, int) and max_windows >= 1,
            "max_windows", f"must be an integer >= 1 or None, got "
            f"{max_windows!r}")
    count = min(count, max_windows)
  return ids[:count * length].reshape(count, length).astype(np.int32)


@jax.jit
def window_nll(logits: jax.Array, tokens: jax.Array) -> jax.Array:
  """`[b]` each window's mean NLL of tokens 1..S-1 given logits `[b, S,
  V]` at 0..S-2."""
  log_probs = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), -1)
  picked = jnp.take_along_axis(log_probs, tokens[:, 1:, None], axis=-1)
  return -jnp.mean(picked[..., 0], axis=-1)


def window_perplexity(logits_fn: LogitsFn, ids: np.ndarray, *,
                      sequence_length: int, batch_size: int = 1,
                      max_windows: Optional[int] = None,
                      progress: Optional[Callable[[int, int], None]] = None
                      ) -> StreamEval:
  """The loss and PPL of the stream `ids` (module doc).

  Args:
    logits_fn: `tokens [b, S] -> logits [b, S, V]`.
    ids: the evaluation stream `[N]`.
    sequence_length: S.
    batch_size: windows per call of `logits_fn`.
    max_windows: score only the first windows (None: all).
    progress: called with (windows done, windows in all) after each batch.
  """
  require(isinstance(batch_size, int) and batch_size >= 1, "batch_size",
          f"must be an integer >= 1, got {batch_size!r}")
  windows = stream_windows(ids, sequence_length, max_windows)
  require(len(windows) > 0, "sequence_length",
          f"{sequence_length} is longer than the stream ({len(ids)} tokens)")
  losses = []
  for i in range(0, len(windows), batch_size):
    batch = windows[i:i + batch_size]
    losses.append(window_nll(logits_fn(batch), batch))
    if progress is not None:
      progress(min(i + batch_size, len(windows)), len(windows))
  per_window = np.concatenate([np.asarray(x, np.float64) for x in losses])
  return StreamEval(loss=float(per_window.mean()), num_blocks=len(windows),
                    num_tokens=len(windows) * (sequence_length - 1))


__all__ = ["stream_windows", "window_nll", "window_perplexity"]
