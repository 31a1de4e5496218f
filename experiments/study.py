"""Paired multi-seed comparisons: what every reproduction experiment shares.

An experiment names `Candidate`s (a config file, its argument, overrides),
trains each for every seed in every `Regime`, evaluates each run with the
binary's after-training hook (the robustness section of
`common.config_for`), and judges `Claim`s: a paper's statement that
candidate B beats candidate A on a metric. Runs of one seed share the data
order and, where the shapes agree, the initial weights, so the comparison is
paired: per seed the difference d_s = metric(B) - metric(A), judged by
`verdicts` (reproduced / not at this scale / contradicted).

Each run lives in ROOT/REGIME/KEY_SEED (a finished run is reused, an
interrupted one resumed). `--quick` shrinks every budget (CI runs it so the
scripts never rot); its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import multiprocessing
import os
import statistics
from collections.abc import Callable, Sequence
from typing import Any, Optional

import jax

import evaluate_only
from common import (config_for, describe_evaluation, mean_std,
                    paired_evaluation, write_report)
from paired_stats import judge_claim, paired_seeds
from verdicts import sampling_se
from vmoe_ext.app.schema import validate_config
from vmoe_ext.app.train import train_and_evaluate
from vmoe_ext.errors import require
from vmoe_ext.evaluate.final import after_training_hook
from vmoe_ext.reporting import figures
from vmoe_ext.reporting.writers import read_metrics

EVALUATION = ("FGSM / PGD-10 at eps 0.05 and the corruption suite on 500 "
              "test images, clean accuracy on all 1,000.")
PAIRED_EVALUATION = (
    "Clean accuracy, FGSM at eps 0.05 and PGD-10 (random start, step "
    "eps / 4) at eps 0.01, 0.03 and 0.05 on all 1,000 test images, the "
    "corruption suite (15 corruptions x 5 severities) on 500 of them, each "
    "image's outcome recorded for the paired statistics.")


@dataclasses.dataclass(frozen=True)
class Metric:
  """One figure of a finished run: `extract(records) -> float`; `better`
  is +1 where higher is better, -1 where lower is. A percentage measured on
  a set of images names the metrics line whose `num_examples` counts them
  (`examples_split`), for the sampling floor of `sampling_se`."""
  label: str
  better: int
  extract: Callable[[list[dict]], float]
  examples_split: Optional[str] = None


def _last(records: list[dict], split: str, key: str, scale: float = 1.0,
          final: bool = False) -> float:
  rows = [r for r in records if r.get("split") == split and key in r
          and (r.get("final") or not final)]
  return scale * rows[-1][key] if rows else float("nan")


def _mean_over_layers(records: list[dict], split: str, suffix: str,
                      scale: float = 1.0) -> float:
  rows = [r for r in records if r.get("split") == split]
  if not rows:
    return float("nan")
  values = [v for k, v in rows[-1].items() if k.endswith(suffix)]
  return scale * statistics.mean(values) if values else float("nan")


def _final_train_loss(records: list[dict]) -> float:
  """Mean training loss over the last 5 logged steps."""
  losses = [r["loss"] for r in records if r.get("split") == "train"
            and "loss" in r]
  return statistics.mean(losses[-5:]) if losses else float("nan")


# The training loss that "faster convergence" is measured to (fixed before
# the runs; the default V-MoE reaches it in both regimes).
LOSS_TARGET = 0.3


def _steps_to_loss(records: list[dict], target: float = LOSS_TARGET
                   ) -> float:
  """The first logged step at which the mean training loss over the last
  5 logs is at most `target` (NaN if never): convergence as steps to a
  target, not as a final loss that has saturated."""
  rows = [r for r in records if r.get("split") == "train" and "loss" in r]
  for i in range(len(rows)):
    window = [r["loss"] for r in rows[max(0, i - 4):i + 1]]
    if statistics.mean(window) <= target:
      return float(rows[i]["step"])
  return float("nan")


METRICS: dict[str, Metric] = {
    "clean": Metric("clean accuracy %", +1,
                    lambda r: _last(r, "test", "accuracy", 100, final=True),
                    "test"),
    "fgsm": Metric("FGSM accuracy %", +1,
                   lambda r: _last(r, "adversarial/fgsm", "accuracy", 100),
                   "adversarial/fgsm"),
    "pgd": Metric("PGD accuracy %", +1,
                  lambda r: _last(r, "adversarial/pgd", "accuracy", 100),
                  "adversarial/pgd"),
    "mce": Metric("mean corruption error %", -1,
                  lambda r: _last(r, "corruption", "mean_corruption_error",
                                  100), "corruption"),
    "load": Metric("load imbalance (std of expert %)", -1,
                   lambda r: _last(r, "routing", "load_balance_mean")),
    "instability": Metric("router instability", -1,
                          lambda r: _last(r, "routing", "instability_mean")),
    "routing_change": Metric(
        "PGD routing change % (mean over layers)", -1,
        lambda r: _mean_over_layers(r, "adversarial/pgd",
                                    "routing_change_rate", 100)),
    "train_loss": Metric("final train loss", -1, _final_train_loss),
    "steps_to_loss": Metric(f"steps to train loss {LOSS_TARGET:g}", -1,
                            _steps_to_loss),
}


@dataclasses.dataclass(frozen=True)
class Candidate:
  """`configs/CONFIG.py[:ARG]` with `overrides` applied: `(dotted field,
  value)` pairs, e.g. `(("model.moe.router", {...}),)` (data, so that a
  worker process can rebuild the config)."""
  key: str
  label: str
  config: str
  arg: Optional[str] = None
  overrides: tuple[tuple[str, Any], ...] = ()
  # A candidate with the same training config, this one changing only the
  # evaluation: its finished runs are evaluated again instead of retrained
  # (`evaluate_only`).
  trained_as: Optional["Candidate"] = None
  # The regimes it runs in (None: every regime the experiment runs).
  regimes: Optional[tuple[str, ...]] = None
  # Keep this many checkpoints evenly spaced along training (None: the
  # config's checkpointing), e.g. to measure a quantity over training.
  checkpoints_along: Optional[int] = None

  def runs_in(self, regime: str) -> bool:
    return self.regimes is None or regime in self.regimes


@dataclasses.dataclass(frozen=True)
class Regime:
  """A training budget: `train_examples` training images (None: all) for
  `total_steps` steps (None: the config's)."""
  name: str
  description: str
  train_examples: Optional[int] = None
  total_steps: Optional[int] = None


REGIMES = {
    "default": Regime("default", "the config's budget (MNIST-5k: 4,000 "
                      "training images, 2,500 steps)"),
    "low_data": Regime("low_data", "500 training images (50 per class), "
                       "600 steps (~150 epochs), where the baseline is well "
                       "below its ceiling", train_examples=500,
                       total_steps=600),
}
QUICK_REGIMES = {
    "default": Regime("default", "quick: 30 steps", total_steps=30),
    "low_data": Regime("low_data", "quick: 100 images, 20 steps",
                       train_examples=100, total_steps=20),
}


@dataclasses.dataclass(frozen=True)
class Claim:
  """A paper's claim that `candidate` beats `baseline` on `metric` (in the
  metric's `better` direction); with `margin`, the claim that the two do
  not differ by more than `margin` (in the metric's units) instead, e.g.
  "robust to the choice of mu"."""
  source: str
  statement: str
  baseline: str
  candidate: str
  metric: str
  margin: Optional[float] = None
  # The paper's (baseline, candidate, kind) numbers, kind one of
  # `paired_stats.PAPER_KINDS`: the effect the row can or cannot detect.
  paper: Optional[tuple[float, float, str]] = None


def build_config(candidate: Candidate, seed: int, regime: Regime,
                 quick: bool, per_image: bool = False):
  """The candidate's config for one seed and regime, with the robustness
  section of `common.config_for` (`EVALUATION`), or with `per_image` of
  `common.paired_evaluation` (`PAIRED_EVALUATION`); quick: 2 PGD and SPSA
  steps, severities 1 and 5 (the severity trend and the severity-5
  metrics read both), 32 images; the routing analysis without its t-SNE
  figure."""
  config = config_for(candidate.config, seed, candidate.arg)
  if per_image:
    config = paired_evaluation(config)
  for field, value in candidate.overrides:
    *parents, leaf = field.split(".")
    node = config
    for name in parents:
      node = node[name]
    node[leaf] = value
  if regime.train_examples is not None:
    config.data.train_examples = regime.train_examples
  if regime.total_steps is not None:
    config.train.total_steps = regime.total_steps
    config.train.eval_every = regime.total_steps
    config.train.checkpoint_every = regime.total_steps
    config.train.log_every = max(1, min(config.train.log_every,
                                        regime.total_steps // 10))
  if candidate.checkpoints_along is not None:
    total = config.train.total_steps
    require(total % candidate.checkpoints_along == 0,
            "Candidate.checkpoints_along", f"{candidate.checkpoints_along} "
            f"does not divide the {total} training steps")
    config.train.checkpoint_every = total // candidate.checkpoints_along
    config.train.keep_checkpoints = candidate.checkpoints_along
  image = "robustness" in config  # Else a language model (configs/lm.py).
  if quick and image:
    config.robustness.num_examples = 32
    config.robustness.attacks = tuple(
        dict(a, steps=2) if a["name"] in ("pgd", "spsa") else dict(a)
        for a in config.robustness.attacks)
    if config.robustness.get("corruptions") is not None:
      config.robustness.corruptions["severities"] = (1, 5)
  if image:
    config.data.analysis_tsne_tokens = 0  # No t-SNE figure (3 s a layer).
  return config


def run_dir(root: str, regime: Regime, candidate: Candidate, seed: int) -> str:
  return os.path.join(root, regime.name, f"{candidate.key}_{seed}")


def finished(workdir: str) -> bool:
  return os.path.exists(os.path.join(workdir, "report.md"))


def train_run(candidate: Candidate, seed: int, regime: Regime, quick: bool,
              workdir: str, log: Optional[str] = None,
              per_image: bool = False) -> None:
  """Trains and evaluates one run into `workdir` (resuming an interrupted
  one); with `log`, this process's output goes to that file."""
  if log is not None:
    os.makedirs(os.path.dirname(log), exist_ok=True)
    handle = open(log, "a")
    os.dup2(handle.fileno(), 1)
    os.dup2(handle.fileno(), 2)
  config = build_config(candidate, seed, regime, quick, per_image)
  train_and_evaluate(config, workdir,
                     after_training=after_training_hook(config, workdir))


def seed_evaluate_only(grid: Sequence[tuple[Regime, Candidate, int]],
                       root: str, quick: bool, per_image: bool = False) -> None:
  """Seeds each not yet started run of a candidate with `trained_as` from
  that candidate's finished run (same regime and seed) where ROOT has one,
  after checking that the two training configs agree."""
  for regime, candidate, seed in grid:
    source = candidate.trained_as
    if source is None:
      continue
    evaluate_only.check_same_training(
        candidate.key, build_config(candidate, seed, regime, quick, per_image),
        source.key, build_config(source, seed, regime, quick, per_image))
    evaluate_only.seed_from(run_dir(root, regime, source, seed),
                            run_dir(root, regime, candidate, seed))


def reuse_lines(root: str, regimes: Sequence[Regime],
                candidates: Sequence[Candidate], seeds: Sequence[int]
                ) -> list[str]:
  """The report's sentence per candidate whose runs were seeded from
  another's training (read from the runs' markers)."""
  lines = []
  for c in candidates:
    seeded = [f"{r.name} seed {s}" for r in regimes for s in seeds
              if evaluate_only.seeded_from(run_dir(root, r, c, s))]
    if seeded:
      lines.append(f"`{c.key}` has `{c.trained_as.key}`'s training config "
                   f"and only another evaluation: {len(seeded)} of its runs "
                   f"({', '.join(seeded)}) resumed `{c.trained_as.key}`'s "
                   "finished last checkpoint and ran only the evaluation.")
  return lines + [""] if lines else []


def run_grid(candidates: Sequence[Candidate], regimes: Sequence[Regime],
             seeds: Sequence[int], root: str, quick: bool, jobs: int = 1,
             per_image: bool = False) -> dict:
  """`{(regime, key, seed): metrics records}`, training what has not
  finished, `jobs` runs at a time (separate processes, each logging to
  its WORKDIR.log; on 2 cores two at a time give ~1.35x the throughput
  of one); `per_image`: with the paired evaluation (`build_config`)."""
  grid = [(regime, candidate, seed) for regime in regimes
          for candidate in candidates if candidate.runs_in(regime.name)
          for seed in seeds]
  seed_evaluate_only(grid, root, quick, per_image)
  todo = [(c, s, r, quick, run_dir(root, r, c, s)) for r, c, s in grid
          if not finished(run_dir(root, r, c, s))]
  if todo:
    # Identical programs across seeds and regimes compile once.
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                          os.path.join(root, ".jax_cache"))
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    jax.config.update("jax_compilation_cache_dir",
                      os.environ["JAX_COMPILATION_CACHE_DIR"])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
  if jobs > 1 and len(todo) > 1:
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=context
                                                ) as pool:
      futures = {pool.submit(train_run, *task, log=task[-1] + ".log",
                             per_image=per_image): task for task in todo}
      for future in concurrent.futures.as_completed(futures):
        future.result()  # A failed run fails the experiment.
        print("finished", futures[future][-1], flush=True)
  else:
    for task in todo:
      train_run(*task, per_image=per_image)
  return {(r.name, c.key, s): read_metrics(run_dir(root, r, c, s))
          for r, c, s in grid}


def values(runs: dict, regime: str, key: str, metric: str,
           seeds: Sequence[int]) -> list[float]:
  return [METRICS[metric].extract(runs[regime, key, s]) for s in seeds]


def results_table(runs: dict, regime: str, candidates: Sequence[Candidate],
                  metrics: Sequence[str], seeds: Sequence[int]) -> list[str]:
  """Markdown: mean ± std over seeds per candidate and metric."""
  lines = ["| model | " + " | ".join(METRICS[m].label for m in metrics)
           + " |", "|---|" + "---|" * len(metrics)]
  for c in candidates:
    cells = ["{} ± {}".format(*map(_num, mean_std(
        values(runs, regime, c.key, m, seeds)))) for m in metrics]
    lines.append(f"| {c.label} | " + " | ".join(cells) + " |")
  return lines


def _num(x: float, sign: str = "") -> str:
  """Two decimals, or two significant digits below 0.1 (small metrics);
  float rounding (|x| < 1e-9) prints as 0. The choice is made on the value
  rounded to two significant digits, so 0.0999... prints as 0.10, not 0.1."""
  x = 0.0 if abs(x) < 1e-9 else x
  small = abs(float(f"{x:.2g}")) < 0.1
  return f"{x:{sign}.2g}" if small and x != 0 else f"{x:{sign}.2f}"


def claims_table(runs: dict, regime: str, claims: Sequence[Claim],
                 labels: dict[str, str], seeds: Sequence[int]
                 ) -> tuple[list[str], list[dict]]:
  """Markdown: one row per claim with the paired difference and verdict;
  and the rows as dicts (for CLAIMS.md and tests)."""
  lines = ["| source | claim | baseline → candidate | metric | paired "
           "difference (mean ± std, se) | verdict |",
           "|---|---|---|---|---|---|"]
  rows = []
  for claim in claims:
    metric = METRICS[claim.metric]
    base = values(runs, regime, claim.baseline, claim.metric, seeds)
    cand = values(runs, regime, claim.candidate, claim.metric, seeds)
    floor = 0.0
    if metric.examples_split is not None:
      counts = [_last(runs[regime, k, s], metric.examples_split,
                      "num_examples") for k in (claim.baseline,
                                                claim.candidate)
                for s in seeds]
      floor = sampling_se(statistics.mean(base + cand), min(counts),
                          len(seeds))
    diff = paired_seeds(base, cand, floor)
    _, v = judge_claim(diff, metric.better, claim.paper,
                       statistics.mean(base), claim.margin)
    rows.append(dict(claim=claim, diff=diff, verdict=v, floor=floor))
    if claim.margin is not None:  # "\\|" keeps the table's columns.
      statement = (f"{claim.statement} (\\|difference\\| <= "
                   f"{claim.margin:g})")
    else:
      statement = claim.statement
    lines.append(
        f"| {claim.source} | {statement} | {labels[claim.baseline]} → "
        f"{labels[claim.candidate]} | {metric.label} | "
        f"{_num(diff.mean, '+')} ± {_num(diff.seed_std)} (se "
        f"{_num(diff.se)}, MDD {_num(diff.mdd)}) | "
        f"{v} |")
  return lines, rows


def per_seed_lines(runs: dict, regime: str, candidates: Sequence[Candidate],
                   metrics: Sequence[str], seeds: Sequence[int]) -> list[str]:
  lines = []
  for c in candidates:
    for s in seeds:
      lines.append(f"- {c.label}, seed {s}: " + ", ".join(
          f"{m} {METRICS[m].extract(runs[regime, c.key, s]):.3f}"
          for m in metrics))
  return lines


def train_curve(records: list[dict]) -> tuple[list[int], list[float]]:
  rows = [r for r in records if r.get("split") == "train" and "loss" in r]
  return [r["step"] for r in rows], [r["loss"] for r in rows]


def plot(runs: dict, regime: str, candidates: Sequence[Candidate],
         metrics: Sequence[str], seeds: Sequence[int], path: str) -> str:
  """One PNG: per metric, every seed's value (grey) and mean ± std over
  seeds (blue) per candidate; and the training-loss curves (mean over
  seeds) of every candidate."""
  panels = len(metrics) + 1
  cols = min(3, panels)
  rows = -(-panels // cols)
  fig, axes = figures.subplots(rows, cols, figsize=(5 * cols, 3.6 * rows),
                               squeeze=False)
  axes = axes.ravel()
  keys = [c.key for c in candidates]
  for ax, m in zip(axes, metrics):
    for i, k in enumerate(keys):  # Each seed, then mean ± std.
      seed_values = values(runs, regime, k, m, seeds)
      ax.plot([i] * len(seed_values), seed_values, "o", color="0.6", ms=3)
      mean, std = mean_std(seed_values)
      ax.errorbar([i], [mean], yerr=[std], fmt="s", color="tab:blue",
                  capsize=4, ms=6)
    ax.set_xlim(-0.5, len(keys) - 0.5)
    ax.set_xticks(range(len(keys)), keys, rotation=40, ha="right",
                  fontsize=7)
    ax.set_title(METRICS[m].label, fontsize=9)
    ax.grid(axis="y", alpha=0.3)
  ax = axes[len(metrics)]
  for c in candidates:
    curves = [train_curve(runs[regime, c.key, s]) for s in seeds]
    steps = curves[0][0]
    losses = [statistics.mean(l[i] for _, l in curves)
              for i in range(min(len(l) for _, l in curves))]
    ax.plot(steps[:len(losses)], losses, label=c.key, lw=1)
  ax.set_yscale("log")
  ax.set_xlabel("step")
  ax.set_title("training loss (mean over seeds)", fontsize=9)
  ax.legend(fontsize=6)
  for ax in axes[panels:]:
    ax.axis("off")
  return save_figure(fig, regime, seeds, path)


def save_figure(fig, regime: str, seeds: Sequence[int], path: str) -> str:
  """Titles `fig` (a `vmoe_ext.reporting.figures` figure) with the regime
  and seeds, writes it to `path` (PNG) and returns `path`."""
  fig.suptitle(f"regime: {regime}; seeds {list(seeds)}", fontsize=10)
  fig.tight_layout()
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  fig.savefig(path, dpi=110)
  return path


def parse_args(description: str, argv: Optional[Sequence[str]] = None,
               default_root: str = os.path.join("runs", "repro"),
               default_regimes: Sequence[str] = tuple(REGIMES)
               ) -> argparse.Namespace:
  """`--seeds` (default 0 1 2; quick: 0 1), `--root`, `--regimes`
  (default `default_regimes`), `--quick`, `--jobs`."""
  parser = argparse.ArgumentParser(description=description)
  parser.add_argument("--seeds", type=int, nargs="+", default=None)
  parser.add_argument("--root", default=default_root)
  parser.add_argument("--regimes", nargs="+", choices=sorted(REGIMES),
                      default=list(default_regimes))
  parser.add_argument("--quick", action="store_true",
                      help="tiny budgets (CI): the numbers mean nothing")
  parser.add_argument("--jobs", type=int, default=2,
                      help="runs trained at a time (processes)")
  args = parser.parse_args(argv)
  if args.seeds is None:
    args.seeds = [0, 1] if args.quick else [0, 1, 2]
  return args


def run_experiment(title: str, intro: Sequence[str],
                   candidates: Sequence[Candidate], claims: Sequence[Claim],
                   metrics: Sequence[str], args: argparse.Namespace,
                   name: str, quick_keys: Sequence[str] = (),
                   evaluation: str = EVALUATION,
                   sections: Optional[Callable[[dict, Sequence[Regime],
                                                Sequence[Candidate]],
                                               list[str]]] = None
                   ) -> tuple[str, dict]:
  """Trains the grid, writes ROOT/NAME.md (a section per regime: results,
  claims with verdicts, per-seed values; then `sections(runs, regimes,
  trained candidates)`'s markdown lines, if given) and ROOT/NAME_REGIME.png;
  returns the report and `{regime: claim rows}`. `evaluation` states how
  each run is evaluated (default: `EVALUATION`); in quick mode the header
  says what the quick runs evaluate instead (`describe_evaluation`: their
  fewer images and steps). `--quick` checks every candidate's config
  (`validate_config`: nothing compiles) and trains only `quick_keys`;
  claims between candidates not trained are left out."""
  regimes = [(QUICK_REGIMES if args.quick else REGIMES)[r]
             for r in args.regimes]
  if args.quick:
    for c in candidates:
      validate_config(build_config(c, 0, regimes[0], quick=True))
    candidates = [c for c in candidates if c.key in quick_keys]
    if candidates:
      evaluation = "Quick-mode evaluation: " + describe_evaluation(
          build_config(candidates[0], args.seeds[0], regimes[0], quick=True))
  keys = {c.key for c in candidates}
  claims = [c for c in claims if {c.baseline, c.candidate} <= keys]
  runs = run_grid(candidates, regimes, args.seeds, args.root, args.quick,
                  args.jobs)
  labels = {c.key: c.label for c in candidates}
  lines = [f"# {title}", ""] + list(intro) + reuse_lines(
      args.root, regimes, candidates, args.seeds) + [evaluation] + [
      "", f"Seeds {list(args.seeds)}; mean ± std (sample std) over seeds; "
      "verdicts from the paired difference over seeds (reproduced / "
      "contradicted: |mean| >= t_0.975 at S - 1 degrees of freedom times "
      "its standard error, floored by the test sample's binomial error, in "
      "/ against the claimed direction; MDD: the smallest effect the "
      "design detects with 80% power; `paired_stats.judge`)."
      + (" QUICK MODE: tiny budgets, the numbers mean nothing."
         if args.quick else ""), ""]
  verdicts = {}
  for regime in regimes:
    png = plot(runs, regime.name, candidates, metrics, args.seeds,
               os.path.join(args.root, f"{name}_{regime.name}.png"))
    claim_lines, rows = claims_table(runs, regime.name, claims, labels,
                                     args.seeds)
    verdicts[regime.name] = rows
    lines += [f"## Regime `{regime.name}`: {regime.description}", "",
              *results_table(runs, regime.name, candidates, metrics,
                             args.seeds), "", "Claims:", "", *claim_lines,
              "", f"![{regime.name}]({os.path.basename(png)})", "",
              "Per seed:", "",
              *per_seed_lines(runs, regime.name, candidates, metrics,
                              args.seeds), ""]
  if sections is not None:
    lines += sections(runs, regimes, candidates)
  return write_report(args.root, f"{name}.md", lines), verdicts
