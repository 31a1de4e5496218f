"""One check shared by the router/stream tests: stop, resume, compare."""

from __future__ import annotations

from typing import Any, Callable

import chex

from vmoe_ext.app import train as loop


def short_schedule(config: Any, total_steps: int = 6) -> Any:
  """A few steps with a log line and a checkpoint every 2 (in place)."""
  config.train.update(dict(total_steps=total_steps, log_every=2,
                           eval_every=0, checkpoint_every=2,
                           keep_checkpoints=3))
  return config


def straight_vs_resumed(config: Callable[[], Any], tmp_path: Any,
                        stop_at_step: int) -> tuple[dict, Any]:
  """Trains `config()` straight and with a stop at `stop_at_step` + resume.

  Asserts that both runs end with the same final metrics and bit-identical
  params and collections (router state), taken from each run's context
  after its final evaluation (the resumed run's state is the one restored
  from the checkpoint and trained on). Returns `(final metrics, state)`.
  """
  states = {}

  def keep_state(name: str) -> Callable[..., list]:
    def hook(run: Any, writer: Any) -> list:
      del writer
      states[name] = run.state
      return []
    return hook

  final = loop.train_and_evaluate(config(), str(tmp_path / "straight"),
                                  after_training=keep_state("straight"))
  resumed = str(tmp_path / "resumed")
  assert loop.train_and_evaluate(config(), resumed,
                                 stop_at_step=stop_at_step) is None
  assert "resumed" not in states
  assert loop.train_and_evaluate(config(), resumed,
                                 after_training=keep_state("resumed")) == final
  total = config().train.total_steps
  for state in states.values():
    assert int(state.step) == total
  chex.assert_trees_all_equal(states["straight"].params,
                              states["resumed"].params)
  chex.assert_trees_all_equal(states["straight"].collections,
                              states["resumed"].collections)
  return final, states["straight"]
