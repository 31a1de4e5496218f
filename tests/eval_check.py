"""A run's final metrics against an independent evaluation of its state."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
import pytest

from vmoe_ext.app import train as loop


def assert_final_metrics_match(final: dict, config: Any, state: Any,
                               workdir: str) -> None:
  """`final` (a run's returned final metrics) equals the model applied to
  `state`'s variables on every test example (the run's own eval batches,
  opened in `workdir`), with NumPy's cross-entropy, argmax and count."""
  ctx = loop.setup(config, workdir)
  ctx.checkpoints.close()
  apply = jax.jit(lambda images: ctx.model.apply(state.variables(),
                                                 images)[0])
  losses, correct = [], []
  for batch in ctx.eval_batches():
    logits = np.asarray(apply(batch["image"]), np.float64)
    keep = np.asarray(batch["mask"], bool)
    labels = np.asarray(batch["label"])
    top = logits.max(-1)
    logz = top + np.log(np.exp(logits - top[:, None]).sum(-1))
    losses += list((logz - logits[np.arange(len(labels)), labels])[keep])
    correct += list((logits.argmax(-1) == labels)[keep])
  assert final["num_examples"] == len(losses)
  assert final["accuracy"] == pytest.approx(np.mean(correct), abs=1e-9)
  assert final["loss"] == pytest.approx(np.mean(losses), rel=1e-5)
