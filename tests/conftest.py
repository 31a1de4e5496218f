"""Shared fixtures and helpers for the test suite."""

from __future__ import annotations

import os
import sys

import jax
import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
jax.config.update("jax_default_matmul_precision", "highest")


@pytest.fixture
def rng():
  return np.random.default_rng(0)


def random_token_routing(rng, g, s, e, k, with_invalid=False):
  """Random distinct top-k expert indices and positive gates `[G, S, K]`."""
  idx = np.stack([np.stack([rng.permutation(e)[:k] for _ in range(s)])
                  for _ in range(g)]).astype(np.int32)
  gates = rng.uniform(0.05, 1.0, size=(g, s, k)).astype(np.float32)
  valid = np.ones((g, s, k), bool)
  if with_invalid:
    valid = rng.uniform(size=(g, s, k)) < 0.7
    valid[..., 0] = True
  return idx, gates, valid
