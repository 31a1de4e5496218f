"""CLAIMS.md's numbers and verdicts are what the committed per-seed values
give: every generated block equals a fresh `claims_index.render` of the
reports in experiments/results/; the parser and the rule on hand-computed
cases; no claim counted twice or listed in both directions."""

from __future__ import annotations

import math
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir,
                                "experiments"))
import claims_index as ci  # noqa: E402
import claims_paired  # noqa: E402
from claims_rows import BLOCKS, Row  # noqa: E402

with open(ci.CLAIMS, encoding="utf-8") as _f:
  TEXT = _f.read()
ROWS = [row for rows in BLOCKS.values() for row in rows]


@pytest.mark.parametrize("name", sorted(BLOCKS))
def test_a_block_is_what_the_committed_values_give(name):
  lines = ci.read_block(TEXT, name)
  assert lines is not None, f"CLAIMS.md has no block {name!r}"
  fresh = ci.render(BLOCKS[name])
  for got, want in zip(lines, fresh):
    assert got == want, f"block {name}: stale row\n{got}\nshould be\n{want}"
  assert len(lines) == len(fresh), (
      f"block {name}: {len(lines)} lines, the render has {len(fresh)}; run "
      "python experiments/claims_index.py --write")


@pytest.mark.parametrize("name", claims_paired.PAIRED_BLOCKS)
def test_a_per_image_block_is_what_its_committed_results_give(name):
  # The rerun experiments' blocks, rendered from experiments/results/NAME.json
  # (tests/test_paired_claims.py re-derives that JSON from the outcomes).
  assert ci.read_block(TEXT, name) == claims_paired.render(name)


def test_rewrite_is_idempotent():
  assert ci.rewrite(TEXT, BLOCKS, claims_paired.PAIRED_BLOCKS) == TEXT


@pytest.mark.parametrize("row", ROWS, ids=lambda r: f"{r.report}:"
                         f"{r.baseline}->{r.candidate}:{r.metric}")
def test_a_row_reads_its_report(row):
  judged = ci.judged(row)
  assert set(judged) == set(ci.REGIMES)
  for j in judged.values():
    assert len(j.base) == len(j.cand) == 3
  assert row.better in (+1, -1)
  if row.numbers is not None:  # The paper's numbers go the claimed way.
    expected = judged["default"].expected
    assert expected is not None and expected * row.better > 0, row


SMALL_REPORT = """# A report

## Regime `default`: the config's budget

- base, seed 1: clean 97.000, load 3.000
- base, seed 0: clean 96.000, load 3.000
- base, seed 2: clean 98.000, load 3.000
- B, with a comma, seed 0: clean 97.500, load 2.000, pgd@0.01 90.000
- B, with a comma, seed 1: clean 97.500, load 1.000, pgd@0.01 91.000
- B, with a comma, seed 2: clean 98.500, load 0.000

## Regime `low_data`: 500 images

- base, seed 0: clean 80.000, load 4.000

## Accuracy vs eps

- base, seed 0: clean 1.000
"""


def test_parse_per_seed_on_a_hand_written_report(tmp_path):
  path = tmp_path / "small.md"
  path.write_text(SMALL_REPORT, encoding="utf-8")
  values = ci.parse_per_seed(str(path))
  assert values == {
      "default": {
          "base": {"clean": [96.0, 97.0, 98.0], "load": [3.0, 3.0, 3.0]},
          # A metric some seed lacks is left out; commas in labels stay.
          "B, with a comma": {"clean": [97.5, 97.5, 98.5],
                              "load": [2.0, 1.0, 0.0]}},
      "low_data": {"base": {"clean": [80.0], "load": [4.0]}}}


def test_a_seed_listed_twice_is_an_error():
  with pytest.raises(ValueError):
    ci.parse_per_seed_text("## Regime `default`\n- a, seed 0: clean 1.0\n"
                           "- a, seed 0: clean 2.0\n")


def _row(metric: str, better: int, numbers=None) -> Row:
  return Row("T", "setting", "small", "base", "B, with a comma", metric,
             better, numbers=numbers)


def test_a_verdict_by_hand(monkeypatch):
  default = ci.parse_per_seed_text(SMALL_REPORT)["default"]
  monkeypatch.setitem(ci._REPORTS, "small", {"default": default})
  # load (no sampling floor): d = [-1, -2, -3], mean -2, std 1, se 1/sqrt 3;
  # t = -3.46 is short of t_{0.975, 2} = 4.303.
  j = ci.judged(_row("load", -1))["default"]
  se = 1 / math.sqrt(3)
  assert j.diff.mean == pytest.approx(-2.0)
  assert j.diff.seed_std == pytest.approx(1.0)
  assert j.diff.se == pytest.approx(se)
  assert j.diff.critical == pytest.approx(4.303, abs=5e-4)
  assert j.diff.mdd == pytest.approx((4.303 + 1.061) * se, abs=1e-3)
  assert j.diff.mdd == pytest.approx(3.097, abs=1e-3)
  assert j.verdict == "not at this scale"  # 2 se would have called it.
  # The paper's 2.134 -> 2.127 on our error of 3: -0.33% of 3 = -0.0098,
  # below the MDD: the design could not have seen it.
  j = ci.judged(_row("load", -1, (2.134, 2.127, "error")))["default"]
  assert j.expected == pytest.approx(3.0 * (2.127 - 2.134) / 2.134)
  assert j.verdict == "undecidable here"
  # clean: d = [1.5, 0.5, 0.5], mean 0.833, std 0.577, se 0.333; the floor
  # at the pooled 97.417% on 1,000 images and 3 seeds is
  # 100 sqrt(.97417 * .02583 / 1000) sqrt(2 / 3) = 0.410 > 0.333.
  j = ci.judged(_row("clean", +1))["default"]
  floor = 100 * math.sqrt(0.974167 * 0.025833 / 1000) * math.sqrt(2 / 3)
  assert j.diff.se == pytest.approx(floor, rel=1e-4)
  assert j.diff.se == pytest.approx(0.410, abs=1e-3)
  assert j.verdict == "not at this scale"


def test_a_decisive_difference_by_hand():
  row = _row("load", -1)
  j = ci.judge_row(row, [3.0, 3.0, 3.0], [1.0, 0.0, -1.0])
  assert j.diff.mean / j.diff.se == pytest.approx(-3 * math.sqrt(3))
  assert j.verdict == "reproduced"  # t = -5.20 beyond -4.303.
  assert ci.judge_row(_row("load", +1), [3.0, 3.0, 3.0],
                      [1.0, 0.0, -1.0]).verdict == "contradicted"


def _keys(row: Row, regime: str) -> tuple[tuple, tuple]:
  j = ci.judged(row)[regime]
  return ((row.metric, j.base, j.cand), (row.metric, j.cand, j.base))


@pytest.mark.parametrize("regime", ci.REGIMES)
def test_no_claim_is_counted_twice_or_both_ways(regime):
  labels, values = {}, {}
  for row in ROWS:
    key = (row.report, row.baseline, row.candidate, row.metric)
    assert key not in labels, f"listed twice: {row} and {labels[key]}"
    reverse = (row.report, row.candidate, row.baseline, row.metric)
    assert reverse not in labels, f"both directions: {row}"
    labels[key] = row
    forward, backward = _keys(row, regime)
    assert forward not in values, (
        f"same per-seed numbers as {values[forward]}: {row}")
    assert backward not in values, (
        f"the same numbers reversed as {values[backward]}: {row}")
    values[forward] = row


def test_rows_without_committed_values_carry_no_verdict():
  start = TEXT.index("### Not re-judged")
  section = TEXT[start:TEXT.index("### ", start + 4)]
  table = [line for line in section.splitlines() if line.startswith("| ")]
  assert len(table) >= 2  # The header and at least one row.
  for line in table:
    for verdict in ("reproduced", "contradicted", "not at this scale",
                    "undecidable here"):
      assert verdict not in line, line
