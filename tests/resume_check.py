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
  params and collections (router state). Returns `(final metrics, state)`.
  """
  straight = str(tmp_path / "straight")
  final = loop.train_and_evaluate(config(), straight)
  resumed = str(tmp_path / "resumed")
  assert loop.train_and_evaluate(config(), resumed,
                                 stop_at_step=stop_at_step) is None
  assert loop.train_and_evaluate(config(), resumed) == final
  states = []
  total = config().train.total_steps
  for workdir in (straight, resumed):
    run = loop.setup(config(), workdir)
    assert run.restore() == total
    run.checkpoints.close()
    states.append(run.state)
  chex.assert_trees_all_equal(states[0].params, states[1].params)
  chex.assert_trees_all_equal(states[0].collections, states[1].collections)
  return final, states[0]
