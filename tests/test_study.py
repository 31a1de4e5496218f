"""The reproduction experiments' shared machinery (experiments/study.py,
experiments/verdicts.py, the per-seed rule of paired_stats.py): the paired
statistics and verdicts against hand-computed cases, the metric
extraction from hand-written metrics records, and the configs it builds."""

from __future__ import annotations

import math
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir,
                                "experiments"))
import study  # noqa: E402  pylint: disable=g-import-not-at-top
import paired_stats  # noqa: E402  pylint: disable=g-import-not-at-top
import verdicts  # noqa: E402  pylint: disable=g-import-not-at-top

from vmoe_ext.app.schema import validate_config  # noqa: E402
from vmoe_ext.errors import ConfigError  # noqa: E402


T2 = 4.302653  # t_0.975 at 2 degrees of freedom (3 seeds).


def test_paired_difference_hand_case():
  diff = paired_stats.paired_seeds([1.0, 2.0, 3.0], [2.0, 3.1, 4.2])
  # d = 1.0, 1.1, 1.2: mean 1.1, sample std 0.1, se 0.1 / sqrt(3).
  assert diff.seeds == 3
  assert diff.mean == pytest.approx(1.1)
  assert diff.seed_std == pytest.approx(0.1)
  assert diff.se == pytest.approx(0.1 / math.sqrt(3))
  assert diff.critical == pytest.approx(T2, rel=1e-6)
  with pytest.raises(ValueError):
    paired_stats.paired_seeds([1.0, 2.0], [1.0])


@pytest.mark.parametrize("diffs, better, expected", [
    ([1.0, 1.1, 1.2], +1, "reproduced"),     # |m| = 19 se
    ([1.0, 1.1, 1.2], -1, "contradicted"),
    ([1.0, -1.0, 0.5], +1, "not at this scale"),   # mean 0.17, se 0.60
    ([0.3, 0.3, 0.3], -1, "contradicted"),        # std 0: any mean counts
    ([0.0, 0.0, 0.0], +1, "not at this scale"),
    ([2.0, 2.1], +1, "undecidable here"),          # < 3 seeds: no verdict
    # mean 0.6, std 0.4, se 0.231: |m| = 2.6 se, decisive at the old 2 se
    # screen, not at t_2 = 4.30.
    ([0.2, 0.6, 1.0], +1, "not at this scale"),
    # mean 0.9, std 0.1, se 0.0577: |m| = 15.6 se.
    ([0.8, 0.9, 1.0], +1, "reproduced"),
])
def test_verdict_rule(diffs, better, expected):
  diff = paired_stats.paired_seeds([0.0] * len(diffs), diffs)
  assert paired_stats.judge(diff, better) == expected


def test_a_null_below_the_detectable_difference_is_undecidable():
  diff = paired_stats.paired_seeds([0.0] * 3, [1.0, -1.0, 0.5])
  # se 0.601, MDD (4.303 + 1.061) x 0.601 = 3.22 points.
  assert diff.mdd == pytest.approx((T2 + 1.060660) * diff.se, rel=1e-5)
  assert paired_stats.judge(diff, +1, expected=1.0) == "undecidable here"
  assert paired_stats.judge(diff, +1, expected=5.0) == "not at this scale"


@pytest.mark.parametrize("diffs, expected", [
    # mean 0.1, std 0.1, se 0.0577: |m| + 4.30 se = 0.348 <= 0.5.
    ([0.0, 0.1, 0.2], "reproduced"),
    # mean 0.4, std 0.1: 0.4 + 0.248 > 0.5 and 0.4 - 0.248 < 0.5.
    ([0.3, 0.4, 0.5], "undecidable here"),
    # mean -1.0, std 0.1: |m| - 4.30 se = 0.752 > 0.5, whichever the sign.
    ([-0.9, -1.0, -1.1], "contradicted"),
    # mean 0.0 but se 0.577: the interval ±2.48 is wider than the margin.
    ([-1.0, 0.0, 1.0], "undecidable here"),
    ([0.0, 0.0], "undecidable here"),             # < 3 seeds: no verdict
])
def test_verdict_equivalence_rule(diffs, expected):
  diff = paired_stats.paired_seeds([0.0] * len(diffs), diffs)
  for better in (+1, -1):  # The claimed direction plays no part.
    assert paired_stats.judge(diff, better, margin=0.5) == expected


def test_claims_table_marks_an_equivalence_claim():
  records = {s: [dict(split="routing", load_balance_mean=v)]
             for s, v in enumerate((1.0, 2.0, 3.0))}
  runs = {("r", "a", s): records[s] for s in range(3)}
  runs.update({("r", "b", s): records[s] for s in range(3)})
  claim = study.Claim("src", "a equals b", "a", "b", "load", margin=0.1)
  lines, rows = study.claims_table(runs, "r", [claim],
                                   dict(a="A", b="B"), [0, 1, 2])
  assert rows[0]["verdict"] == "reproduced"  # d = 0 on every seed.
  assert "(\\|difference\\| <= 0.1)" in lines[-1]
  assert lines[-1].count(" | ") == 5  # Six columns: the pipes escaped.


def test_claims_table_judges_in_the_papers_direction():
  runs = {}
  for seed, (a, b) in enumerate(((0.90, 0.80), (0.91, 0.80), (0.92, 0.81))):
    runs["r", "a", seed] = [{"step": 1, "split": "test", "accuracy": a,
                             "final": True, "num_examples": 1000.0}]
    runs["r", "b", seed] = [{"step": 1, "split": "test", "accuracy": b,
                             "final": True, "num_examples": 1000.0}]
  worse = study.Claim("p", "b costs accuracy", "a", "b", "clean",
                      paper=(73.16, 72.84, "accuracy"))
  _, rows = study.claims_table(runs, "r", [worse], dict(a="A", b="B"),
                               [0, 1, 2])
  assert rows[0]["verdict"] == "reproduced"  # -10.7 points, as claimed.


def test_sampling_floor_hand_case():
  # p = 1% on 500 images: binomial std 100 sqrt(0.01 * 0.99 / 500) = 0.445
  # points; a difference of two averaged over 3 seeds: x sqrt(2 / 3).
  floor = verdicts.sampling_se(1.0, 500, 3)
  assert floor == pytest.approx(0.44497 * math.sqrt(2 / 3), rel=1e-4)
  # One image of 500 on every seed: std 0, but below 2 floors.
  diff = paired_stats.paired_seeds([1.0] * 3, [1.2] * 3, floor)
  assert diff.se == pytest.approx(floor)
  assert paired_stats.judge(diff, +1) == "not at this scale"
  # A seed spread larger than the floor wins.
  assert paired_stats.paired_seeds([0.0, 0.0, 0.0], [1.0, 3.0, 5.0],
                                   floor).se == pytest.approx(
                                       2 / math.sqrt(3))
  assert verdicts.sampling_se(50.0, float("nan"), 3) == 0.0


def test_claims_table_applies_the_floor_from_num_examples():
  runs = {}
  for seed in range(3):
    for key, acc in (("base", 0.010), ("new", 0.012)):
      runs["default", key, seed] = [
          {"step": 1, "split": "adversarial/pgd", "accuracy": acc,
           "num_examples": 500.0}]
  claim = study.Claim("p", "s", "base", "new", "pgd")
  _, rows = study.claims_table(runs, "default", [claim],
                               {"base": "B", "new": "N"}, [0, 1, 2])
  assert rows[0]["diff"].seed_std == pytest.approx(0.0, abs=1e-9)
  assert rows[0]["floor"] == pytest.approx(verdicts.sampling_se(1.1, 500, 3))
  assert rows[0]["diff"].se == pytest.approx(rows[0]["floor"])
  assert rows[0]["verdict"] == "not at this scale"


RECORDS = [
    {"step": 10, "split": "train", "loss": 2.0},
    {"step": 20, "split": "train", "loss": 1.0},
    {"step": 30, "split": "train", "loss": 0.5},
    {"step": 30, "split": "test", "accuracy": 0.5},
    {"step": 30, "split": "test", "accuracy": 0.9, "final": True},
    {"step": 30, "split": "adversarial/pgd", "accuracy": 0.25,
     "layer_1/routing_change_rate": 0.1, "layer_3/routing_change_rate": 0.3,
     "prediction_change_rate": 0.7},
    {"step": 30, "split": "corruption", "mean_corruption_error": 0.2},
    {"step": 30, "split": "routing", "load_balance_mean": 3.5},
]


def test_metrics_read_from_hand_records():
  m = {k: v.extract(RECORDS) for k, v in study.METRICS.items()}
  assert m["clean"] == pytest.approx(90.0)       # The final line, in %.
  assert m["pgd"] == pytest.approx(25.0)
  assert m["routing_change"] == pytest.approx(20.0)  # Mean of 10 and 30.
  assert m["mce"] == pytest.approx(20.0)
  assert m["load"] == pytest.approx(3.5)
  assert m["train_loss"] == pytest.approx(3.5 / 3)  # Fewer than 5 logged.
  assert math.isnan(m["fgsm"]) and math.isnan(m["instability"])


def test_claims_table_pairs_by_seed():
  runs = {}
  for seed, (a, b) in enumerate([(0.90, 0.92), (0.95, 0.96), (0.80, 0.83)]):
    for key, acc in (("base", a), ("new", b)):
      runs["default", key, seed] = [
          {"step": 1, "split": "test", "accuracy": acc, "final": True}]
  claim = study.Claim("paper T1", "new is better", "base", "new", "clean")
  lines, rows = study.claims_table(runs, "default", [claim],
                                   {"base": "B", "new": "N"}, [0, 1, 2])
  # d = 2, 1, 3 points: mean 2, std 1, se 0.577 -> 3.5 se, below
  # t_2 = 4.30 (decisive at the old 2 se screen); MDD 5.36 se = 3.10.
  assert rows[0]["diff"].mean == pytest.approx(2.0)
  assert rows[0]["diff"].seed_std == pytest.approx(1.0)
  assert rows[0]["verdict"] == "not at this scale"
  assert lines[-1] == ("| paper T1 | new is better | B → N | clean accuracy "
                       "% | +2.00 ± 1.00 (se 0.58, MDD 3.10) | not at this "
                       "scale |")


@pytest.mark.parametrize("x,sign,expected", [
    (2.0, "+", "+2.00"),
    (0.1, "", "0.10"),
    (0.1 - 1e-12, "", "0.10"),      # A std of 0.1 after float rounding.
    (0.09949, "", "0.099"),
    (-0.0995, "+", "-0.10"),        # Rounds up to 0.10: two decimals.
    (0.05, "", "0.05"),
    (0.0019, "", "0.0019"),
    (1e-12, "+", "+0.00"),          # Float noise prints as zero.
])
def test_numbers_keep_two_decimals_or_two_significant_digits(x, sign,
                                                            expected):
  assert study._num(x, sign) == expected  # pylint: disable=protected-access


def test_build_config_applies_candidate_and_regime():
  candidate = study.Candidate(
      "lm", "cosine_lm", "default",
      overrides=(("model.moe.router", dict(name="cosine_lm",
                                           num_selected=2)),))
  config = study.build_config(candidate, 3, study.REGIMES["low_data"],
                              quick=False)
  assert config.seed == 3
  assert config.model.moe.router.to_dict() == dict(name="cosine_lm",
                                                  num_selected=2)
  assert config.data.train_examples == 500
  # The shared step reference moves the schedule with the run length.
  assert (config.train.total_steps, config.optimizer.total_steps,
          config.optimizer.warmup_steps) == (600, 600, 24)
  assert config.robustness.num_examples == 500
  assert [a["name"] for a in config.robustness.attacks] == ["fgsm", "pgd"]
  assert config.robustness.attacks[1]["steps"] == 10
  validate_config(config)
  default = study.build_config(study.Candidate("b", "b", "default"), 0,
                               study.REGIMES["default"], quick=False)
  assert default.train.total_steps == 2500
  assert default.data.get("train_examples") is None


def test_checkpoints_kept_evenly_along_training():
  along = study.Candidate("a", "a", "default", checkpoints_along=10)
  for regime, every in (("low_data", 60), ("default", 250)):
    config = study.build_config(along, 0, study.REGIMES[regime], quick=False)
    assert (config.train.checkpoint_every,
            config.train.keep_checkpoints) == (every, 10)
    validate_config(config)
  with pytest.raises(ConfigError) as info:
    study.build_config(study.Candidate("a", "a", "default",
                                       checkpoints_along=7), 0,
                       study.REGIMES["low_data"], quick=False)
  assert info.value.field == "Candidate.checkpoints_along"


def test_quick_config_shrinks_the_evaluation_it_has():
  quick = study.QUICK_REGIMES["low_data"]
  config = study.build_config(study.Candidate("b", "b", "default"), 0, quick,
                              quick=True)
  assert config.robustness.num_examples == 32
  assert [a.get("steps") for a in config.robustness.attacks] == [None, 2]
  assert tuple(config.robustness.corruptions["severities"]) == (1, 5)
  assert (config.data.train_examples, config.train.total_steps) == (100, 20)
  # A candidate without the corruption suite keeps it off.
  config = study.build_config(study.Candidate(
      "n", "n", "default", overrides=(("robustness.corruptions", None),)),
      0, quick, quick=True)
  assert config.robustness.corruptions is None
  validate_config(config)


def test_plot_writes_a_png(tmp_path):
  runs = {("default", k, s): RECORDS for k in ("a", "b") for s in (0, 1)}
  path = study.plot(runs, "default",
                    [study.Candidate("a", "A", "x"),
                     study.Candidate("b", "B", "x")],
                    ["clean", "fgsm"], [0, 1], str(tmp_path / "p.png"))
  with open(path, "rb") as f:
    assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_quick_report_header_states_the_quick_evaluation(tmp_path,
                                                         monkeypatch):
  """A quick report says what its runs evaluated (32 images, PGD-2,
  severities 1 and 5), not the full budgets of `EVALUATION`."""
  seen = []

  def fake_grid(candidates, regimes, seeds, root, quick, jobs=1):
    seen.append(quick)
    return {(r.name, c.key, s): RECORDS for r in regimes for c in candidates
            for s in seeds}

  monkeypatch.setattr(study, "run_grid", fake_grid)
  args = study.parse_args("t", ["--quick", "--regimes", "default", "--root",
                                str(tmp_path)])
  text, _ = study.run_experiment(
      "T", ["intro"], [study.Candidate("b", "B", "default")], [],
      ["clean"], args, "t", quick_keys=("b",))
  assert seen == [True]
  assert ("Quick-mode evaluation: FGSM / PGD-2 at eps 0.05 and the "
          "corruption suite (severities 1, 5) on 32 test images, clean "
          "accuracy on the whole test split.") in text
  assert study.EVALUATION not in text and "500" not in text


def test_describe_evaluation_of_the_full_budgets():
  config = study.build_config(study.Candidate("b", "b", "default"), 0,
                              study.REGIMES["default"], quick=False)
  assert study.describe_evaluation(config) == (
      "FGSM / PGD-10 at eps 0.05 and the corruption suite (severities 1, 2, "
      "3, 4, 5) on 500 test images, clean accuracy on the whole test split.")


def test_stability_region_out_is_a_directory(tmp_path, capsys):
  import stability_region  # pylint: disable=g-import-not-at-top
  out = tmp_path / "figs"
  path = stability_region.main(["--out", str(out), "--n-mu", "21",
                                "--n-gs", "21"])
  assert path == str(out / "stability_region.png")
  with open(path, "rb") as f:
    assert f.read(8) == b"\x89PNG\r\n\x1a\n"
  assert f"Wrote {path} " in capsys.readouterr().out
  # The default is a run directory, not the committed figure's.
  assert stability_region.DEFAULT_OUT == os.path.join("runs",
                                                      "stability_region")
  with pytest.raises(SystemExit):  # A file is no --out.
    stability_region.main(["--out", path])


def test_a_candidate_runs_only_in_its_regimes(tmp_path, monkeypatch):
  """`Candidate.regimes`: the grid trains (and returns) a candidate only in
  the regimes it names; the others run everywhere."""
  trained = []
  monkeypatch.setattr(study, "train_run", lambda c, s, r, q, w, **_: (
      trained.append((r.name, c.key, s)), os.makedirs(w, exist_ok=True),
      open(os.path.join(w, "metrics.jsonl"), "w").close()))
  both = study.Candidate("a", "A", "default")
  low = study.Candidate("b", "B", "default", regimes=("low_data",))
  runs = study.run_grid([both, low], list(study.QUICK_REGIMES.values()),
                        [0], str(tmp_path), quick=True)
  assert sorted(trained) == [("default", "a", 0), ("low_data", "a", 0),
                             ("low_data", "b", 0)]
  assert sorted(runs) == sorted(trained)
  assert low.runs_in("low_data") and not low.runs_in("default")
  assert both.runs_in("default")
