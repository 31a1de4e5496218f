"""Progress of a long attack, reported from inside its compiled program.

An ensemble such as AutoAttack runs several attacks on one batch in a single
compiled call (minutes on a CPU). After each of its stages it calls
`stage_done(name, robust)` inside its trace; that is a `jax.debug.callback`
to the listener active *when the compiled code runs* (`listening`), so one
compiled attack serves calls with and without a listener. No listener, no
effect; the attack's values never depend on it.

    with listening(lambda stage, robust: print(stage, robust.sum())):
      x_adv = autoattack(logits_fn, x, labels, eps=0.03, key=key)

The listener gets the stage's name and which examples are still robust after
it (`robust [B]`, a NumPy bool array: the caller knows which examples are
padding), on the host, in stage order.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator, Optional

import jax
import numpy as np

Listener = Callable[[str, np.ndarray], None]
_listener: Optional[Listener] = None


def _dispatch(name: str, robust: Any) -> None:
  if _listener is not None:
    _listener(name, np.asarray(robust, bool))


def stage_done(name: str, robust: jax.Array) -> None:
  """Inside an attack's trace: the stage `name` has finished; `robust [B]`
  (bool) marks the examples no stage has broken yet."""
  jax.debug.callback(functools.partial(_dispatch, name), robust)


@contextlib.contextmanager
def listening(listener: Listener) -> Iterator[None]:
  """Calls `listener(stage, robust)` after each stage of the attacks
  run inside (one listener at a time; the previous one is restored)."""
  global _listener
  previous, _listener = _listener, listener
  try:
    yield
  finally:
    _listener = previous


__all__ = ["listening", "stage_done"]
