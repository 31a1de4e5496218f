"""Shared fixtures and helpers for the test suite."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile

# XLA compilation is most of the suite's time, and many tests (and the
# binary's subprocesses, which inherit the environment) compile the same
# programs: a persistent compilation cache shared by the xdist workers of one
# run (fresh for every run, removed at its end) compiles each once.
_RUN = os.environ.get("PYTEST_XDIST_TESTRUNUID") or f"serial{os.getpid()}"
CACHE_DIR = os.path.join(tempfile.gettempdir(), f"vmoe_ext_jax_cache_{_RUN}")
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", CACHE_DIR)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")
# The tests' programs are tiny: compiling them is most of their time and
# running them is not. LLVM's optimisation level 0 compiles them faster; XLA's
# HLO passes (fusion, what is computed) run as always, and the results move
# only at the rounding level (a default-model gradient: 0.5% of the entries by
# at most 4e-7 of 1.5), which every test allows for: each compares within one
# run or against an independent reference at a stated tolerance. The CPU
# backend's older elemental emitters instead of its MLIR fusion emitters
# halve the compile time again (the tiny train step: 2.4 s -> 1.1 s; each
# eager op ~45% less), with the same HLO. The binary (CI's default job) keeps
# XLA's defaults. Subprocesses inherit the flags.
_FAST_COMPILE = ("--xla_backend_optimization_level=0",
                 "--xla_llvm_disable_expensive_passes=true",
                 "--xla_cpu_use_fusion_emitters=false")
os.environ["XLA_FLAGS"] = " ".join(
    [os.environ.get("XLA_FLAGS", "")]
    + [f for f in _FAST_COMPILE if f not in os.environ.get("XLA_FLAGS", "")]
).strip()

import jax  # noqa: E402  (after the cache settings above)
import numpy as np  # noqa: E402
import pytest  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
jax.config.update("jax_default_matmul_precision", "highest")


# The longest files (measured: 40-100 s each) start first: xdist hands whole
# files to the two workers in collection order (pyproject's
# --no-loadscope-reorder; by default xdist reorders the files by their
# number of tests, so that a long file of few tests, test_sharding's, started
# last), and a long file started last would leave one worker running alone
# at the end. The rest keep their order. Measured on 2 cores: this list
# 12:08; xdist's reordering 12:36; the 26 longest files in this way 13:59
# (xdist queues two files ahead per worker, so long files pile up on one).
LONGEST_FIRST = ("test_sharding.py", "test_momentum_config.py",
                 "test_multiprocess.py", "test_reliability.py",
                 "test_carving.py", "test_train_loop.py", "test_symphony.py",
                 "test_streaming_eval.py", "test_vmoe_import.py",
                 "test_forward.py", "test_models.py", "test_precision.py",
                 "test_lm_training.py", "test_stack.py")


def pytest_collection_modifyitems(session, config, items):
  del session, config
  rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
  items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


def pytest_sessionfinish(session, exitstatus):
  del exitstatus
  if not hasattr(session.config, "workerinput"):  # The controller, last.
    shutil.rmtree(CACHE_DIR, ignore_errors=True)


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
