"""Evaluate-only candidates (experiments/evaluate_only.py, study's
`trained_as`) without training: the training-config check on the study's
own configs, the seeding of a run directory from hand-made finished runs,
and a whole `run_experiment` report over finished runs (nothing trains)."""

from __future__ import annotations

import argparse
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir,
                                "experiments"))
import evaluate_only  # noqa: E402  pylint: disable=g-import-not-at-top
import study  # noqa: E402  pylint: disable=g-import-not-at-top

BASE = study.Candidate("base", "Base", "default")
SWEEP = (("robustness.sweep", dict(attack=dict(name="pgd", steps=2),
                                   eps=(0.01,))),)
EVAL_ONLY = study.Candidate("swept", "Base + sweep", "default",
                            overrides=SWEEP, trained_as=BASE)
LOW = study.REGIMES["low_data"]


def _config(candidate, seed=0, regime=LOW):
  return study.build_config(candidate, seed, regime, quick=False)


def test_evaluation_fields_may_differ_training_fields_may_not():
  evaluate_only.check_same_training("swept", _config(EVAL_ONLY), "base",
                                    _config(BASE))
  k1 = study.Candidate("k1", "K=1", "default", overrides=(
      ("model.moe.router.num_selected", 1),) + SWEEP, trained_as=BASE)
  with pytest.raises(ValueError, match=r"'k1' names trained_as='base'.*"
                     r"model\.moe\.router\.num_selected: 1 vs 2"):
    evaluate_only.check_same_training("k1", _config(k1), "base",
                                      _config(BASE))
  # Another seed is another training (and a field only one side sets is
  # named too).
  with pytest.raises(ValueError, match=r"seed: 1 vs 0"):
    evaluate_only.check_same_training("swept", _config(EVAL_ONLY, seed=1),
                                      "base", _config(BASE))
  other = _config(BASE).to_dict()
  other["train"]["extra"] = 3
  with pytest.raises(ValueError, match=r"train\.extra: '<unset>' vs 3"):
    evaluate_only.check_same_training("swept", _config(BASE), "base", other)


def _finished_source(path, steps=("10", "20"), report=True):
  for step in steps:
    (path / "checkpoints" / step / "state").mkdir(parents=True)
    (path / "checkpoints" / step / "state" / "data").write_text(step)
  (path / "metrics.jsonl").write_text(json.dumps(
      {"step": 20, "split": "train", "loss": 0.5}) + "\n")
  if report:
    (path / "report.md").write_text("done")


def test_seed_from_copies_the_last_checkpoint_once(tmp_path):
  src, dst = tmp_path / "src", tmp_path / "dst"
  assert not evaluate_only.seed_from(str(src), str(dst))  # No source.
  _finished_source(src, report=False)
  assert not evaluate_only.seed_from(str(src), str(dst))  # Not finished.
  assert not dst.exists()
  (src / "report.md").write_text("done")
  assert evaluate_only.seed_from(str(src), str(dst))
  assert os.listdir(dst / "checkpoints") == ["20"]
  assert (dst / "checkpoints" / "20" / "state" / "data").read_text() == "20"
  assert (dst / "metrics.jsonl").read_text() == (src / "metrics.jsonl"
                                                 ).read_text()
  assert not study.finished(str(dst))  # The study evaluates it.
  assert evaluate_only.seeded_from(str(dst)) == {"source": str(src),
                                                 "step": 20}
  assert evaluate_only.seeded_from(str(src)) is None
  assert not evaluate_only.seed_from(str(src), str(dst))  # Started.
  assert sorted(os.listdir(tmp_path)) == ["dst", "src"]  # No leftovers.


def test_run_experiment_reports_seeded_runs_and_extra_sections(tmp_path):
  """Finished runs in ROOT (so nothing trains): the seeded candidate's
  runs are named in the report, the `sections` lines end it."""
  root, seeds = str(tmp_path), [0, 1, 2]
  for seed in seeds:
    _finished_source(tmp_path / "low_data" / f"base_{seed}")
  study.seed_evaluate_only([(LOW, EVAL_ONLY, s) for s in seeds[:2]], root,
                           quick=False)
  for key in ("base", "swept"):
    for seed in seeds:
      workdir = tmp_path / "low_data" / f"{key}_{seed}"
      workdir.mkdir(exist_ok=True)
      acc = 0.9 + 0.01 * seed + (0.02 if key == "swept" else 0.0)
      (workdir / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in (
          {"step": 20, "split": "train", "loss": 0.5},
          {"step": 20, "split": "test", "accuracy": acc, "final": True,
           "num_examples": 1000.0})) + "\n")
      (workdir / "report.md").write_text("done")
  seen = []

  def sections(runs, regimes, candidates):
    seen.append((sorted(runs), [r.name for r in regimes],
                 [c.key for c in candidates]))
    return ["## Extra", "", "extra line"]

  args = argparse.Namespace(root=root, seeds=seeds, regimes=["low_data"],
                            quick=False, jobs=1)
  claim = study.Claim("p", "swept is better", "base", "swept", "clean")
  report, verdicts = study.run_experiment(
      "T", ["intro"], [BASE, EVAL_ONLY], [claim], ["clean"], args, "t",
      sections=sections)
  assert seen == [(sorted(("low_data", k, s) for k in ("base", "swept")
                          for s in seeds), ["low_data"], ["base", "swept"])]
  assert report.rstrip().endswith("## Extra\n\nextra line")
  assert ("`swept` has `base`'s training config and only another "
          "evaluation: 2 of its runs (low_data seed 0, low_data seed 1) "
          "resumed `base`'s finished last checkpoint") in report
  assert verdicts["low_data"][0]["diff"].mean == pytest.approx(2.0)
  with open(os.path.join(root, "t.md")) as f:
    assert f.read() == report


def test_evaluating_a_checkpoint_names_it_and_shows_progress(
    tmp_path, capfd, monkeypatch):
  """The evaluate-only mode says (console and report.md) which checkpoint
  and step it evaluated, and prints a progress line with an estimate per
  attack batch off a terminal; the training run it evaluates says that it
  resumed as an `info:` line."""
  import ml_collections
  from vmoe_ext.app import train as train_mode
  from vmoe_ext.app.evaluate import evaluate_checkpoint
  from vmoe_ext.train.config_files import load_config

  config = load_config("tiny")
  config.train.update(dict(total_steps=3, log_every=1, eval_every=0,
                           checkpoint_every=2))
  config.optimizer.warmup_steps = 1
  config.robustness = None
  run = str(tmp_path / "run")
  # Stopped at step 2 (its checkpoint), then resumed: an `info:` line, no
  # absl warning.
  assert train_mode.train_and_evaluate(config, run, stop_at_step=2) is None
  capfd.readouterr()
  train_mode.train_and_evaluate(config, run)
  err = capfd.readouterr().err.splitlines()
  assert f"info: resuming from the checkpoint of step 2 in {run}" in err
  # Once: the `info:` line only (no logging warning beside it).
  assert sum("resuming from the checkpoint" in l.lower() for l in err) == 1
  config.robustness = ml_collections.ConfigDict(dict(
      checkpoint_dir=run, num_examples=70,  # 2 batches of 64.
      attacks=(dict(name="fgsm", eps=0.1),), sweep=None, corruptions=None))
  monkeypatch.setenv("CI", "1")  # Off a terminal: progress as lines.
  capfd.readouterr()
  out = str(tmp_path / "eval")
  evaluate_checkpoint(config, out)
  err = capfd.readouterr().err.splitlines()
  source = os.path.abspath(run)
  assert f"info: Evaluating checkpoint: step 3 of {source}." in err
  assert "evaluate: fgsm on 70 images, 2 batches..." in err
  progress = [l for l in err if l.startswith("evaluate: fgsm ")
              and " batches, " in l]
  assert [l.split(",")[0] for l in progress] == [
      "evaluate: fgsm 1/2 batches", "evaluate: fgsm 2/2 batches"]
  assert "elapsed, ~" in progress[0] and progress[0].endswith(" left")
  assert [l for l in err if l.startswith("evaluate: routing analysis ")]
  with open(os.path.join(out, "report.md")) as f:
    head = f.read().split("\n## ")[0]  # Under the title, before sections.
  assert f"Evaluated checkpoint: step 3 of `{source}`." in head
