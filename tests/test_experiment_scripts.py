"""The reproduction experiments as a set (experiments/*.py on study.py).

Runs are shared through ROOT by candidate key (`study.run_dir`: a finished
run is reused, not retrained), so a key must name the same config in every
script that declares it, or one script would silently report another's
model. Each script's claims and quick keys name its own candidates, its
metrics are the study's, and CI runs every script in --quick mode.
"""

from __future__ import annotations

import collections
import importlib
import os
import re
import sys

import pytest

EXPERIMENTS_DIR = os.path.join(os.path.dirname(__file__), os.pardir,
                               "experiments")
sys.path.insert(0, EXPERIMENTS_DIR)
import study  # noqa: E402  pylint: disable=g-import-not-at-top


def _calls(name: str, function: str) -> bool:
  with open(os.path.join(EXPERIMENTS_DIR, name), encoding="utf-8") as f:
    return f"{function}(" in f.read()


_SCRIPTS = [n for n in os.listdir(EXPERIMENTS_DIR)
            if n.endswith(".py") and n not in ("study.py", "paired_claims.py")]
# Claims judged per seed (study.run_experiment) or per image
# (paired_claims.run_paired_experiment).
PER_IMAGE = sorted(n[:-3] for n in _SCRIPTS
                   if _calls(n, "run_paired_experiment"))
NAMES = sorted(n[:-3] for n in _SCRIPTS
               if _calls(n, " run_experiment")) + PER_IMAGE
MODULES = {name: importlib.import_module(name) for name in NAMES}
import paired_claims  # noqa: E402


def test_the_study_scripts_are_found():
  assert {"acmoe_vmoe", "routers_vmoe", "momentum_extensions",
          "momentum_negative_complex", "symphony_experts",
          "momentum_layout"} <= set(NAMES)
  assert PER_IMAGE == ["acmoe_paired", "momentum_depth", "momentum_layout",
                       "momentum_variants", "symphony_paired"]


@pytest.mark.parametrize("name", NAMES)
def test_claims_and_quick_keys_name_the_scripts_candidates(name):
  module = MODULES[name]
  keys = [c.key for c in module.CANDIDATES]
  assert len(keys) == len(set(keys)), f"{name}: a key twice"
  assert set(module.QUICK) <= set(keys), name
  metrics = dict(study.METRICS)
  if name in PER_IMAGE:  # Per-image metrics, and run-level ones.
    metrics.update(paired_claims.IMAGE_METRICS)
  for claim in module.CLAIMS:
    assert paired_claims.claim_keys(claim) <= set(keys), (name, claim)
    if name in PER_IMAGE:
      paired_claims.metric_of(claim.metric)  # KeyError if unknown.
    else:
      assert claim.metric in metrics, (name, claim.metric)
  assert set(module.METRICS) <= set(metrics), name


def _config(candidate: study.Candidate, regime: study.Regime) -> dict:
  return study.build_config(candidate, 0, regime, quick=False).to_dict()


def test_a_candidate_key_names_one_config_in_every_script():
  declared = collections.defaultdict(list)
  for name, module in MODULES.items():
    for candidate in module.CANDIDATES:
      declared[candidate.key].append((name, candidate))
  shared = {k: v for k, v in declared.items() if len(v) > 1}
  assert "noisy_topk" in shared  # Most scripts' baseline.
  for key, where in shared.items():
    for regime in study.REGIMES.values():
      first_name, first = where[0]
      expected = _config(first, regime)
      for name, candidate in where[1:]:
        assert _config(candidate, regime) == expected, (
            f"key {key!r}: {name}'s config differs from {first_name}'s "
            f"({regime.name} regime)")
        assert candidate.trained_as == first.trained_as, (key, name)


def test_ci_runs_every_script_in_quick_mode():
  with open(os.path.join(EXPERIMENTS_DIR, os.pardir, ".ci", "run"),
            encoding="utf-8") as f:
    ci = f.read()
  missing = [n for n in NAMES if not re.search(rf"\b{n}\b", ci)]
  assert not missing, f".ci/run does not run {missing} --quick"
