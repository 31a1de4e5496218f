"""Claims judged image by image: what `study.run_experiment` does for a
paired experiment (runs evaluated with `study.PAIRED_EVALUATION`, each
image's outcome in the run's `per_example.npz`).

Per claim and regime: the per-seed mean differences (kept as mean ± std),
the per-image effect with its standard error and degrees of freedom
(`paired_stats.paired_images`), the minimum detectable difference, the
paper's effect on our scale, McNemar's discordant counts, and the verdict
(`paired_stats.judge`). Every number the report prints is written to
NAME.json and the per-image outcomes the claims use to NAME_images.npz, so
that a test can re-derive each verdict from committed files.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence
from typing import Optional

import numpy as np

from paired_stats import (ImagePaired, judge_claim, paired_images,
                          paired_seeds)
from vmoe_ext.evaluate import per_example


@dataclasses.dataclass(frozen=True)
class ImageMetric:
  """One per-image outcome: `label`; `better` +1 (accuracy) / -1 (error);
  `eval_names(regime)`: the per_example.npz evaluations it reads (one:
  its correctness; several: the image's error averaged over them)."""
  label: str
  better: int
  field: str = "correct"


# The PGD radius at which the default V-MoE's PGD accuracy is 30-70% per
# regime (common.PAIRED_PGD_EPS).
MID_EPS = {"default": 0.03, "low_data": 0.01}

IMAGE_METRICS = {
    "clean": ImageMetric("clean accuracy %", +1),
    "top5": ImageMetric("clean top-5 accuracy %", +1, "top5"),
    "fgsm": ImageMetric("FGSM accuracy % (eps 0.05)", +1),
    "pgd": ImageMetric("PGD-10 accuracy % (eps 0.05)", +1),
    "pgd_small": ImageMetric("PGD-10 accuracy % (eps 0.01)", +1),
    "pgd_mid": ImageMetric("PGD-10 accuracy % (baseline 30-70%: eps 0.03 "
                           "default, 0.01 low data)", +1),
    "mce": ImageMetric("corruption error % (per image, mean over 75 "
                       "conditions)", -1),
    "swap": ImageMetric("word-swap analogue accuracy % (2.5% of patches "
                        "replaced by a grey patch)", +1),
    "noise_trend": ImageMetric(
        "growth of the error with severity, points (severity 5 - 1, "
        "Gaussian and impulse noise)", -1),
}
# Language models (`lm_claims.py`): each evaluation block's mean token NLL
# x 100 (`vmoe_ext.evaluate.per_block`); the mean over blocks is 100 ln PPL,
# so a difference of 1 is about a 1% change of the PPL.
BLOCK_METRICS = {
    "test_nll": ImageMetric("100 × test NLL per block (mean: 100 ln PPL)",
                            -1),
    "attacked_nll": ImageMetric("100 × word-swapped test NLL per block "
                                "(mean: 100 ln attacked PPL)", -1),
}
# The noise corruptions of MomentumSMoE's Fig. 14.
TREND_CORRUPTIONS = ("gaussian_noise", "impulse_noise")


def image_metric(name: str) -> ImageMetric:
  """A fixed per-image metric; `corr:NAME`: the image's error on one
  corruption, averaged over its severities; `corr5:NAME`: its accuracy on
  that corruption at severity 5; `spsa:EPS`: its accuracy under SPSA at
  that radius (an evaluation only some candidates run)."""
  if name.startswith("corr:"):
    return ImageMetric(f"{name[5:]} error %", -1)
  if name.startswith("corr5:"):
    return ImageMetric(f"{name[6:]} accuracy % (severity 5)", +1)
  if name.startswith("spsa:"):
    return ImageMetric(f"SPSA accuracy % (eps {name[5:]})", +1)
  if name in BLOCK_METRICS:
    return BLOCK_METRICS[name]
  return IMAGE_METRICS[name]


def is_image_metric(name: str) -> bool:
  """Whether `name` is a per-image metric, or a language model's per-block
  one (`BLOCK_METRICS`; else a run-level one)."""
  return name in IMAGE_METRICS or name in BLOCK_METRICS or name.split(
      ":")[0] in ("corr", "corr5", "spsa")


def eval_names(metric: str, regime: str, available: Sequence[str]
               ) -> list[str]:
  """The per_example.npz evaluations behind `metric` in `regime`."""
  if metric in ("clean", "top5"):
    return ["clean"]
  if metric == "fgsm":
    return [per_example.eval_name("adversarial", "fgsm", 0.05)]
  if metric == "pgd":
    return [per_example.eval_name("adversarial", "pgd", 0.05)]
  if metric == "pgd_small":
    return [per_example.eval_name("adversarial", "pgd", 0.01)]
  if metric.startswith("spsa:"):
    return [per_example.eval_name("adversarial", "spsa", float(metric[5:]))]
  if metric.startswith("corr5:"):
    return [f"corruption/{metric[6:]}/s5"]
  if metric == "pgd_mid":
    return [per_example.eval_name("adversarial", "pgd", MID_EPS[regime])]
  if metric == "swap":
    return [per_example.eval_name("adversarial", "patch_swap")]
  if metric == "mce":
    return sorted(n for n in available if n.startswith("corruption/"))
  if metric.startswith("corr:"):
    return sorted(n for n in available
                  if n.startswith(f"corruption/{metric[5:]}/"))
  raise KeyError(f"no per-image metric {metric!r}")


def image_outcomes(workdir: str, metric: str, regime: str
                   ) -> tuple[np.ndarray, np.ndarray]:
  """`(index [I], value [I])` of one run: correctness (0/1) for an
  accuracy, the image's mean error over the conditions for `mce`."""
  data = per_example.load(workdir)
  if metric == "noise_trend":  # Error at severity 5 minus severity 1.
    names = [f"corruption/{c}/s{s}" for c in TREND_CORRUPTIONS
             for s in (1, 5)]
    if any(n not in data for n in names):
      raise KeyError(f"{workdir}: no outcomes for {names}")
    wrong = {n: 1.0 - data[n]["correct"].astype(np.float64) for n in names}
    trend = np.mean([wrong[f"corruption/{c}/s5"] - wrong[f"corruption/{c}/s1"]
                     for c in TREND_CORRUPTIONS], axis=0)
    return data[names[0]]["index"], trend
  names = eval_names(metric, regime, list(data))
  if not names or any(n not in data for n in names):
    raise KeyError(f"{workdir}: no per-image outcomes for {metric} "
                   f"({names}); was it evaluated with per_example?")
  spec = image_metric(metric)
  index = data[names[0]]["index"]
  values = np.stack([data[n][spec.field] for n in names]).astype(np.float64)
  if spec.better < 0:
    return index, 1.0 - values.mean(0)
  return index, values[0]


def outcomes_matrix(paths: Sequence[str], metric: str, regime: str
                    ) -> np.ndarray:
  """`[S, I]` outcomes of one candidate's seeds, checked to cover the same
  images."""
  rows, first = [], None
  for path in paths:
    index, values = image_outcomes(path, metric, regime)
    if first is None:
      first = index
    elif not np.array_equal(first, index):
      raise ValueError(f"{path}: evaluated on other images than {paths[0]}")
    rows.append(values)
  return np.stack(rows)


@dataclasses.dataclass(frozen=True)
class Contrast:
  """A claim that the candidate's gain over its baseline is larger in one
  setting (`high`: (baseline, candidate) keys) than in another (`low`):
  per seed and image the difference of the two differences, judged as a
  claim, e.g. "momentum helps more in a deeper model". The images and
  seeds are shared by the four arms. With `low_metric`, the low setting is
  another metric of the same arms, e.g. "the PGD gain grows with eps":
  `low` = `high` and `low_metric` the smaller radius."""
  source: str
  statement: str
  low: tuple[str, str]
  high: tuple[str, str]
  metric: str
  margin: Optional[float] = None
  paper: Optional[tuple[float, float, str]] = None
  low_metric: Optional[str] = None

  @property
  def baseline(self) -> str:
    at = f" ({self.low_metric})" if self.low_metric else ""
    return f"{self.low[1]} - {self.low[0]}{at}"

  @property
  def candidate(self) -> str:
    at = f" ({self.metric})" if self.low_metric else ""
    return f"{self.high[1]} - {self.high[0]}{at}"

  @property
  def keys(self) -> set[str]:
    return set(self.low) | set(self.high)


def claim_keys(claim) -> set[str]:
  """The candidate keys a claim or contrast compares."""
  return claim.keys if isinstance(claim, Contrast) else {claim.baseline,
                                                         claim.candidate}


def claim_needs(claim) -> set[tuple[str, str]]:
  """The `(key, metric)` outcomes a claim or contrast reads."""
  if isinstance(claim, Contrast):
    return ({(k, claim.metric) for k in claim.high}
            | {(k, claim.low_metric or claim.metric) for k in claim.low})
  return {(k, claim.metric) for k in (claim.baseline, claim.candidate)}


def claim_metrics(claims: Sequence) -> set[str]:
  """Every metric the claims read (a contrast's `low_metric` too)."""
  return {c.metric for c in claims} | {
      c.low_metric for c in claims
      if isinstance(c, Contrast) and c.low_metric is not None}


def claim_arms(outcomes: dict, claim) -> tuple[np.ndarray, np.ndarray]:
  """The two `[S, I]` (or `[S]`) arms a claim compares: the baseline's and
  the candidate's outcomes, or a contrast's two gains."""
  if isinstance(claim, Contrast):
    low_metric = claim.low_metric or claim.metric
    gain = [outcomes[b, m] - outcomes[c, m]
            for (c, b), m in ((claim.low, low_metric),
                              (claim.high, claim.metric))]
    return gain[0], gain[1]
  return outcomes[claim.baseline, claim.metric], outcomes[
      claim.candidate, claim.metric]


def claim_stats(a: np.ndarray, b: np.ndarray, claim, our_base: float,
                better: int) -> tuple[ImagePaired, Optional[float], str]:
  """The claim's paired statistics (per image for `[S, I]` outcomes, per
  seed for `[S]` values of a run-level metric), the paper's effect on our
  scale (None where the claim names no paper numbers) and the verdict. The
  claimed direction is the metric's `better`, or the paper's where its
  numbers show the candidate worse (e.g. SAM's clean accuracy)."""
  diff = paired_images(a, b) if a.ndim == 2 else paired_seeds(a, b)
  expected, verdict = judge_claim(diff, better, claim.paper, our_base,
                                  claim.margin)
  return diff, expected, verdict


# Run-level metrics computed from a run's checkpoint by an analysis
# script (`momentum_norms.py`: `vmoe_ext.evaluate.expert_norms`), not from
# its training log: (label, better).
ANALYSIS_METRICS = {
    "output_norm": ("MoE output norm ‖f(x)‖ (mean over test tokens)", -1),
    "rank_share": ("share % of the selections going to the expert of that "
                   "output-norm rank (mean over MoE layers)", +1),
    "rank_imbalance": ("norm-rank selection imbalance (std of the rank "
                       "shares %, mean over MoE layers)", -1),
}


def metric_of(name: str) -> tuple[str, int]:
  """(label, better) of a per-image metric, an analysis one
  (`ANALYSIS_METRICS`) or a run-level one (`study.METRICS`: load, train
  loss, steps to a target loss)."""
  if is_image_metric(name):
    return image_metric(name).label, image_metric(name).better
  if name in ANALYSIS_METRICS:
    return ANALYSIS_METRICS[name]
  import study  # Run-level metrics.
  return study.METRICS[name].label, study.METRICS[name].better


def _num(x: Optional[float], sign: str = "") -> str:
  if x is None:
    return "-"
  return f"{x:{sign}.2f}"


HEADER = ["| source | claim | baseline → candidate | metric | per-seed "
          "difference (mean ± std) | per-image effect (se, df) | p | "
          "detects ≥ (MDD) | paper's effect here | discordant (B / A "
          "right) | verdict |", "|---|---|---|---|---|---|---|---|---|---|"
          "---|"]


def claims_rows(outcomes: dict, regime: str, claims: Sequence, labels: dict
                ) -> tuple[list[str], list[dict]]:
  """Markdown rows and JSON records of every claim in `regime`;
  `outcomes[key, metric]` is the `[S, I]` matrix of a per-image metric,
  the `[S]` values of a run-level one."""
  lines, records = list(HEADER), []
  for claim in claims:
    a, b = claim_arms(outcomes, claim)
    label, better = metric_of(claim.metric)
    if isinstance(claim, Contrast):  # The baseline setting's own level.
      base = outcomes[claim.low[0], claim.low_metric or claim.metric]
      our_base = float(base.mean()) * (100 if base.ndim == 2 else 1)
    else:
      our_base = float(a.mean()) * (100 if a.ndim == 2 else 1)
    diff, expected, verdict = claim_stats(a, b, claim, our_base, better)
    mean_s = float(np.mean(diff.seed_diffs))
    statement = claim.statement + (
        f" (\\|difference\\| <= {claim.margin:g})" if claim.margin else "")
    disc = ("-" if diff.discordant is None
            else f"{diff.discordant[0]} / {diff.discordant[1]}")
    if isinstance(claim, Contrast):
      at = ((f" ({claim.low_metric})", f" ({claim.metric})")
            if claim.low_metric else ("", ""))
      arms = tuple(f"gain of {labels[new]} over {labels[old]}{suffix}"
                   for (old, new), suffix in zip((claim.low, claim.high), at))
    else:
      arms = (labels[claim.baseline], labels[claim.candidate])
    lines.append(
        f"| {claim.source} | {statement} | {arms[0]} → {arms[1]} | {label} | "
        f"{mean_s:+.2f} ± {diff.seed_std:.2f} | {diff.mean:+.2f} (se "
        f"{diff.se:.2f}, df {diff.df:.1f}) | {diff.p:.3f} | "
        f"{diff.mdd:.2f} | {_num(expected, '+')} | {disc} | {verdict} |")
    records.append(dict(
        source=claim.source, statement=claim.statement,
        baseline=claim.baseline, candidate=claim.candidate,
        metric=claim.metric, regime=regime, paper=claim.paper,
        margin=claim.margin, baseline_value=our_base,
        seed_diffs=list(diff.seed_diffs), effect=diff.mean, se=diff.se,
        df=diff.df, p=diff.p, mdd=diff.mdd, expected=expected,
        discordant=diff.discordant, verdict=verdict))
  return lines, records


def candidate_outcomes(paths: dict[str, Sequence[str]],
                       metrics: Sequence[str], claims: Sequence,
                       regime: str) -> dict[tuple[str, str], np.ndarray]:
  """`{(key, metric): [S, I]}` for every candidate and per-image metric its
  runs evaluated; one a claim reads must be there (a candidate that only
  re-evaluates with another attack, e.g. SPSA, lacks the others)."""
  needed = set().union(*(claim_needs(c) for c in claims))
  out = {}
  for key, runs in paths.items():
    for metric in metrics:
      try:
        out[key, metric] = outcomes_matrix(runs, metric, regime)
      except KeyError:
        if (key, metric) in needed:
          raise
  return out


def write_images(path: str, outcomes: dict[str, dict]) -> None:
  """NAME_images.npz: `REGIME/KEY/METRIC` -> `[S, I]` outcomes, correctness
  as uint8, per-image errors as float64."""
  arrays = {}
  for regime, table in outcomes.items():
    for (key, metric), matrix in table.items():
      if not is_image_metric(metric):
        continue  # Run-level values: in NAME.json.
      dtype = (np.uint8 if image_metric(metric).better > 0
               else np.float64)  # Exact: the test re-derives from these.
      arrays[f"{regime}/{key}/{metric}"] = matrix.astype(dtype)
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  np.savez_compressed(path, **arrays)


def read_images(path: str) -> dict[str, dict]:
  """The inverse of `write_images`: `{regime: {(key, metric): [S, I]}}`."""
  out: dict[str, dict] = {}
  with np.load(path) as data:
    for name in data.files:
      regime, key, metric = name.split("/")
      out.setdefault(regime, {})[key, metric] = data[name].astype(
          np.float64)
  return out


def write_json(path: str, records: dict) -> None:
  with open(path, "w") as f:
    json.dump(records, f, indent=1, sort_keys=True)


def run_paired_experiment(title: str, intro: Sequence[str],
                          candidates: Sequence, claims: Sequence,
                          metrics: Sequence[str], args, name: str,
                          quick_keys: Sequence[str] = (),
                          record_metrics: Sequence[str] = (
                              "load", "train_loss", "steps_to_loss")
                          ) -> tuple[str, dict]:
  """`study.run_experiment` for claims judged per image: trains the grid
  with the paired evaluation, then writes ROOT/NAME.md (per regime: the
  per-image metrics' mean ± std over seeds, `record_metrics` from the runs'
  logs, the claims with their paired statistics, the per-seed values),
  ROOT/NAME.json (every claim's numbers and every run's per-seed values)
  and ROOT/NAME_images.npz (the per-image outcomes the claims use);
  returns the report and `{regime: claim records}`."""
  import study  # The study machinery (training, configs, plots).
  from common import describe_evaluation, mean_std, write_report
  from vmoe_ext.app.schema import validate_config
  regimes = [(study.QUICK_REGIMES if args.quick else study.REGIMES)[r]
             for r in args.regimes]
  evaluation = study.PAIRED_EVALUATION
  if args.quick:
    for c in candidates:
      validate_config(study.build_config(c, 0, regimes[0], True, True))
    candidates = [c for c in candidates if c.key in quick_keys]
    evaluation = "Quick-mode evaluation: " + describe_evaluation(
        study.build_config(candidates[0], args.seeds[0], regimes[0], True,
                           True))
  keys = {c.key for c in candidates}
  claims = [c for c in claims if claim_keys(c) <= keys]
  for regime in regimes:  # A per-seed study's run in ROOT has no images.
    for c in candidates:
      for s in args.seeds if c.runs_in(regime.name) else ():
        path = study.run_dir(args.root, regime, c, s)
        if study.finished(path) and not os.path.exists(
            os.path.join(path, per_example.FILENAME)):
          raise SystemExit(
              f"{path} is a finished run without per-image outcomes (a "
              "per-seed study's run?); give this experiment a root of its "
              "own (--root)")
  runs = study.run_grid(candidates, regimes, args.seeds, args.root,
                        args.quick, args.jobs, per_image=True)
  labels = {c.key: c.label for c in candidates}
  lines = [f"# {title}", "", *intro, "", evaluation, "",
           f"Seeds {list(args.seeds)}. Claims judged per image "
           "(`paired_stats`): the per-image effect over seeds and images, "
           "its standard error from both the seeds and the test sample, "
           "decided at two-sided alpha 0.05 with Satterthwaite degrees of "
           "freedom; MDD: the smallest effect the design detects with 80% "
           "power; a null result whose paper effect (converted to our "
           "baseline's error) is below the MDD is *undecidable here*."
           + (" QUICK MODE: tiny budgets, the numbers mean nothing."
              if args.quick else ""), ""]
  all_outcomes, records, per_seed = {}, {}, {}
  for regime in regimes:
    # The candidates this regime runs, and the claims on them.
    here = [c for c in candidates if c.runs_in(regime.name)]
    judged = [c for c in claims if claim_keys(c) <= {h.key for h in here}]
    paths = {c.key: [study.run_dir(args.root, regime, c, s)
                     for s in args.seeds] for c in here}
    # The table's metrics and every other one a claim reads.
    image = list(metrics) + sorted(claim_metrics(judged) - set(metrics)
                                   - set(record_metrics))
    outcomes = candidate_outcomes(paths, image, judged, regime.name)
    outcomes.update({(c.key, m): np.asarray(study.values(
        runs, regime.name, c.key, m, args.seeds)) for c in here
                     for m in record_metrics})
    all_outcomes[regime.name] = outcomes
    table = ["| model | " + " | ".join(
        [image_metric(m).label for m in metrics]
        + [study.METRICS[m].label for m in record_metrics]) + " |",
             "|---|" + "---|" * (len(metrics) + len(record_metrics))]
    for c in here:
      cells = ["{:.2f} ± {:.2f}".format(*mean_std(
          list(100 * outcomes[c.key, m].mean(1))))
               if (c.key, m) in outcomes else "–" for m in metrics]
      cells += ["{:.3g} ± {:.2g}".format(*mean_std(study.values(
          runs, regime.name, c.key, m, args.seeds)))
                for m in record_metrics]
      table.append(f"| {c.label} | " + " | ".join(cells) + " |")
      per_seed[f"{regime.name}/{c.key}"] = {
          **{m: list(100 * outcomes[c.key, m].mean(1)) for m in metrics
             if (c.key, m) in outcomes},
          **{m: study.values(runs, regime.name, c.key, m, args.seeds)
             for m in record_metrics}}
    claim_lines, rows = claims_rows(outcomes, regime.name, judged, labels)
    records[regime.name] = rows
    png = study.plot(runs, regime.name, here, list(record_metrics),
                     args.seeds, os.path.join(args.root,
                                              f"{name}_{regime.name}.png"))
    lines += [f"## Regime `{regime.name}`: {regime.description}", "",
              *table, "", "Claims:", "", *claim_lines, "",
              f"![{regime.name}]({os.path.basename(png)})", "",
              "Per seed (points):", ""]
    for c in here:
      for i, s in enumerate(args.seeds):
        lines.append(f"- {c.label}, seed {s}: " + ", ".join(
            f"{m} {per_seed[f'{regime.name}/{c.key}'][m][i]:.3f}"
            for m in list(metrics) + list(record_metrics)
            if m in per_seed[f"{regime.name}/{c.key}"]))
    lines.append("")
  write_images(os.path.join(args.root, f"{name}_images.npz"), all_outcomes)
  write_json(os.path.join(args.root, f"{name}.json"),
             dict(seeds=list(args.seeds), claims=records,
                  per_seed=per_seed, quick=bool(args.quick)))
  return write_report(args.root, f"{name}.md", lines), records
