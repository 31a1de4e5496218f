"""CLAIMS.md's tested tables, computed from the committed per-seed values.

    python experiments/claims_index.py           # print the tables
    python experiments/claims_index.py --write   # rewrite CLAIMS.md's blocks
    python experiments/claims_index.py --check   # exit 1 if CLAIMS.md is stale

Every row of `claims_rows.BLOCKS` is re-judged from the per-seed lines of
its report (`experiments/results/REPORT.md`, one block per regime) with the
rule of `paired_stats`: the paired difference over seeds
(`paired_seeds`), its standard error floored by the test sample's
(`verdicts.sampling_se`: 1,000 images for clean accuracy, 500 for the
attacks and corruptions of the old evaluation; none for load, instability,
routing change or training loss), the t critical value at S - 1 degrees of
freedom, the minimum detectable difference at 80% power, the paper's
effect on our scale (`expected_effect`) and the verdict (`judge`).

CLAIMS.md holds each table between `<!-- claims:begin NAME -->` and
`<!-- claims:end NAME -->`; `--write` replaces what lies between.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import statistics
import sys
from collections.abc import Sequence
from typing import Optional

import claims_paired
from claims_rows import BLOCKS, Row
from paired_stats import ImagePaired, expected_effect, judge, paired_seeds
from verdicts import sampling_se

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results")
CLAIMS = os.path.join(ROOT, "CLAIMS.md")
REGIMES = ("default", "low_data")


@dataclasses.dataclass(frozen=True)
class MetricSpec:
  """How a per-seed metric reads: `better` +1 (higher is better) / -1;
  `images`: the test images a percentage was measured on (its sampling
  floor), 0 for a metric of the model itself."""
  label: str
  better: int
  images: int = 0


METRICS: dict[str, MetricSpec] = {
    "clean": MetricSpec("clean acc. %", +1, 1000),
    "fgsm": MetricSpec("FGSM acc. % (eps 0.05)", +1, 500),
    "pgd": MetricSpec("PGD-10 acc. % (eps 0.05)", +1, 500),
    "pgd_area": MetricSpec("PGD-10 acc. % averaged over eps 0–0.05", +1,
                           500),
    "mce": MetricSpec("mCE %", -1, 500),
    "load": MetricSpec("load imbalance (std of expert %)", -1),
    "instability": MetricSpec("router instability", -1),
    "routing_change": MetricSpec(
        "PGD routing change %: mean(1 − IoU) of the selected-expert sets",
        -1),
    "train_loss": MetricSpec("final train loss", -1),
}

# {regime: {label: {metric: [value per seed]}}}
PerSeed = dict[str, dict[str, dict[str, list[float]]]]

_REGIME = re.compile(r"^## Regime `(\w+)`")
_SEED = re.compile(r"^- (?P<label>.+), seed (?P<seed>\d+): (?P<values>.+)$")


def parse_per_seed(report_path: str) -> PerSeed:
  """`{regime: {label: {metric: [value per seed, seeds ascending]}}}` from
  a report's `- LABEL, seed S: METRIC VALUE, ...` lines (those under a
  `## Regime \\`NAME\\`` heading)."""
  with open(report_path, encoding="utf-8") as f:
    return parse_per_seed_text(f.read())


def parse_per_seed_text(text: str) -> PerSeed:
  """`parse_per_seed` on a report's text."""
  by_seed: dict[str, dict[str, dict[int, dict[str, float]]]] = {}
  regime = None
  for line in text.splitlines():
    if line.startswith("## "):
      m = _REGIME.match(line)
      regime = m.group(1) if m else None
      continue
    m = _SEED.match(line)
    if regime is None or m is None:
      continue
    values = {}
    for item in m.group("values").split(", "):
      key, value = item.rsplit(" ", 1)
      values[key] = float(value)
    seeds = by_seed.setdefault(regime, {}).setdefault(m.group("label"), {})
    seed = int(m.group("seed"))
    if seed in seeds:
      raise ValueError(f"{regime}: {m.group('label')} seed {seed} twice")
    seeds[seed] = values
  out: PerSeed = {}
  for regime, labels in by_seed.items():
    for label, seeds in labels.items():
      order = sorted(seeds)
      metrics = set().union(*(seeds[s] for s in order))
      out.setdefault(regime, {})[label] = {
          k: [seeds[s][k] for s in order] for k in sorted(metrics)
          if all(k in seeds[s] for s in order)}
  return out


@dataclasses.dataclass(frozen=True)
class Judged:
  """One row in one regime: the per-seed values, the paired difference,
  the paper's effect on our scale (a difference candidate - baseline in
  our metric's points; None without paper numbers) and the verdict (None
  where the row's `status` replaces it)."""
  base: tuple[float, ...]
  cand: tuple[float, ...]
  diff: ImagePaired
  expected: Optional[float]
  verdict: Optional[str]


def judge_row(row: Row, base: Sequence[float], cand: Sequence[float]
              ) -> Judged:
  """`paired_stats`' rule on one row's per-seed values (paired by seed)."""
  if len(base) != len(cand):
    raise ValueError(f"{row.report}: {row.baseline} has {len(base)} seeds, "
                     f"{row.candidate} {len(cand)}")
  spec = METRICS[row.metric]
  floor = (sampling_se(statistics.mean([*base, *cand]), spec.images,
                       len(base)) if spec.images else 0.0)
  diff = paired_seeds(base, cand, floor)
  expected = None
  if row.numbers is not None:
    b, c, kind = row.numbers
    expected = spec.better * expected_effect(b, c, kind,
                                             statistics.mean(base),
                                             spec.better)
  verdict = None if row.status else judge(diff, row.better, expected,
                                          row.margin)
  return Judged(tuple(base), tuple(cand), diff, expected, verdict)


_REPORTS: dict[str, PerSeed] = {}


def report_values(report: str) -> PerSeed:
  """`parse_per_seed` of experiments/results/REPORT.md (cached)."""
  if report not in _REPORTS:
    _REPORTS[report] = parse_per_seed(os.path.join(RESULTS, f"{report}.md"))
  return _REPORTS[report]


def judged(row: Row) -> dict[str, Judged]:
  """`{regime: Judged}` for every regime the report has."""
  values = report_values(row.report)
  out = {}
  for regime in REGIMES:
    if regime not in values:
      continue
    labels = values[regime]
    for label in (row.baseline, row.candidate):
      if row.metric not in labels.get(label, {}):
        raise KeyError(f"{row.report} ({regime}): no per-seed "
                       f"{row.metric!r} for {label!r}")
    out[regime] = judge_row(row, labels[row.baseline][row.metric],
                            labels[row.candidate][row.metric])
  return out


def num(x: float, sign: bool = False) -> str:
  """Two decimals, or two significant digits below 0.1; a minus sign."""
  x = 0.0 if abs(x) < 1e-9 else x
  small = abs(float(f"{x:.2g}")) < 0.1
  text = f"{x:{'+' if sign else ''}.2g}" if small and x else (
      f"{x:{'+' if sign else ''}.2f}")
  return text.replace("-", "−")


def level(x: float) -> str:
  """A metric's level: two decimals from 10 up, else three digits."""
  return (f"{x:.2f}" if abs(x) >= 10 else f"{x:#.3g}").replace("-", "−")


def _ours(j: Judged) -> str:
  return (f"{num(j.diff.mean, True)} ± {num(j.diff.seed_std)} "
          f"({level(statistics.mean(j.base))} → "
          f"{level(statistics.mean(j.cand))})")


def _pair(cells: Sequence[str]) -> str:
  return " / ".join(cells)


HEADER = ("| table / figure | paper's setting and numbers | our metric | "
          "ours: default (mean ± std over seeds; baseline → candidate) | "
          "ours: low data | detects ≥ (MDD): default / low data | paper's "
          "effect here: default / low data | verdict: default / low data | "
          "command |")


def render_row(row: Row) -> str:
  """One markdown table line."""
  js = judged(row)
  cells = [js[r] if r in js else None for r in REGIMES]
  ours = [_ours(j) if j else "–" for j in cells]
  mdd = _pair([num(j.diff.mdd) if j else "–" for j in cells])
  paper = ("–" if row.numbers is None else
           _pair([num(j.expected, True) if j else "–" for j in cells]))
  if row.status:
    verdict = row.status
  else:
    verdicts = [j.verdict if j else "–" for j in cells]
    verdict = verdicts[0] if len(set(verdicts)) == 1 else _pair(verdicts)
  metric = row.metric_label or METRICS[row.metric].label
  if row.margin is not None:
    metric += f" (\\|difference\\| ≤ {row.margin:g})"
  if row.note:
    metric += f"; {row.note}"
  return (f"| {row.where} | {row.setting} | {metric} | {ours[0]} | {ours[1]} | "
          f"{mdd} | {paper} | {verdict} | `{row.command}` |")


def render(rows: Sequence[Row]) -> list[str]:
  """The markdown table of `rows`, every number from the committed
  per-seed values."""
  return [HEADER, "|" + "---|" * 9, *(render_row(r) for r in rows)]


def block_pattern(name: str) -> re.Pattern:
  return re.compile(rf"(<!-- claims:begin {re.escape(name)} -->\n)(.*?)"
                    rf"(<!-- claims:end {re.escape(name)} -->)", re.DOTALL)


def read_block(text: str, name: str) -> Optional[list[str]]:
  """The lines between a block's markers in `text`; None if absent."""
  m = block_pattern(name).search(text)
  return None if m is None else m.group(2).splitlines()


def rewrite(text: str, blocks: dict[str, Sequence[Row]],
            paired: Sequence[str] = ()) -> str:
  """`text` with every named block's lines replaced by a fresh render;
  `paired`: blocks rendered from a per-image experiment's committed JSON
  (`claims_paired.render`) where it exists."""
  bodies = {name: render(rows) for name, rows in blocks.items()}
  for name in paired:
    if os.path.exists(os.path.join(RESULTS, f"{name}.json")):
      bodies[name] = claims_paired.render(name)
  for name, lines in bodies.items():
    pattern = block_pattern(name)
    if not pattern.search(text):
      raise KeyError(f"CLAIMS.md has no block {name!r}")
    body = "\n".join(lines) + "\n"
    text = pattern.sub(lambda m, b=body: m.group(1) + b + m.group(3), text)
  return text


def main(argv: Optional[Sequence[str]] = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  group = parser.add_mutually_exclusive_group()
  group.add_argument("--write", action="store_true",
                     help="rewrite CLAIMS.md's generated blocks in place")
  group.add_argument("--check", action="store_true",
                     help="exit 1 when CLAIMS.md's blocks are stale")
  args = parser.parse_args(argv)
  if not (args.write or args.check):
    for name, rows in BLOCKS.items():
      print(f"<!-- claims:begin {name} -->", *render(rows),
            f"<!-- claims:end {name} -->", sep="\n")
    return 0
  with open(CLAIMS, encoding="utf-8") as f:
    text = f.read()
  fresh = rewrite(text, BLOCKS, claims_paired.PAIRED_BLOCKS)
  if args.write:
    if fresh != text:
      with open(CLAIMS, "w", encoding="utf-8") as f:
        f.write(fresh)
    return 0
  if fresh != text:
    print("CLAIMS.md is stale: run python experiments/claims_index.py "
          "--write", file=sys.stderr)
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
