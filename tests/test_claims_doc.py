"""CLAIMS.md cites what exists: every script, config and folder its tables
name is in the repository, and every config it tells a reader to run (a
`configs/FILE.py:ARG` cell, with the `--config.FIELD=VALUE` overrides of the
same cell; a `:ARG` alone means the row's last config file with that
argument; a whole `python -m vmoe_ext.main ...` command) resolves as the
binary resolves it, failing only on data this machine lacks (the check of
tests/test_documented_commands.py, for table cells instead of code blocks).
"""

from __future__ import annotations

import os
import re
import shlex

import pytest

from test_documented_commands import ROOT, resolve_but_for_data

CLAIMS = os.path.join(ROOT, "CLAIMS.md")
CODE = re.compile(r"`([^`]+)`")
PATH = re.compile(r"^(?:python )?((?:experiments|configs|benchmarks|docs)"
                  r"/[\w./]*)")


def _rows() -> list[str]:
  with open(CLAIMS, encoding="utf-8") as f:
    return [line for line in f if line.startswith("|")]


def cited_paths() -> list[str]:
  """Every repository path an inline code span of CLAIMS.md starts with."""
  with open(CLAIMS, encoding="utf-8") as f:
    spans = CODE.findall(f.read())
  return sorted({m.group(1).split(":")[0] for s in spans
                 if (m := PATH.match(s))})


def cited_runs() -> list[tuple[str, list[str]]]:
  """`(row, binary arguments)` for every config a table cell tells a
  reader to run."""
  out = []
  for row in _rows():
    for cell in row.split("|"):
      spans, last = CODE.findall(cell), None
      overrides = [s for s in spans if s.startswith("--config.")]
      for span in spans:
        if span.startswith("python -m vmoe_ext.main"):
          words = shlex.split(span)[3:]
          out.append((row, words))
          last = next((w.split("=", 1)[1].split(":")[0] for w in words
                       if w.startswith("--config=")), last)
        elif span.startswith("configs/"):
          last = span.split(":")[0]
          out.append((row, [f"--config={span}", *overrides]))
        elif span.startswith(":") and last is not None:
          out.append((row, [f"--config={last}{span}"]))
  return out


def test_claims_cites_scripts_and_configs():
  paths = cited_paths()
  assert "experiments/acmoe_vmoe.py" in paths
  assert any(p.startswith("configs/") for p in paths)
  missing = [p for p in paths if not os.path.exists(os.path.join(ROOT, p))]
  assert not missing, f"CLAIMS.md cites files that do not exist: {missing}"


RUNS = cited_runs()


def test_claims_tells_readers_what_to_run():
  configs = {words[0] for _, words in RUNS}
  assert "--config=configs/swin_moe_imagenet.py:top2" in configs
  assert len(RUNS) >= 10


@pytest.mark.parametrize("row,words", RUNS,
                         ids=[" ".join(w)[9:60] for _, w in RUNS])
def test_a_cited_config_resolves(row, words, monkeypatch):
  monkeypatch.chdir(ROOT)  # The paths are relative to the repository root.
  config = resolve_but_for_data(words, f"CLAIMS.md row {row[:80]}")
  if config is not None:
    assert config.train.total_steps > 0
