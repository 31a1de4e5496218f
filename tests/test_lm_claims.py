"""The language-model claims (experiments/lm_claims.py): each evaluation
block's loss (`StreamEval.block_losses`, a run's `per_block.npz`) against a
naive loop over the blocks, the block-paired statistics and the paper's
effect as a log-PPL change by hand, the committed verdicts re-derived from
the committed per-block values, and the WikiText-103 commands CLAIMS.md
lists resolved against a stand-in corpus."""

from __future__ import annotations

import math
import os
import shlex
import sys

import jax
import numpy as np
import pytest

from test_documented_commands import resolve_command
from vmoe_ext.app.context import RunContext
from vmoe_ext.app.lm_run import LanguageRun
from vmoe_ext.app.schema import validate_config
from vmoe_ext.data.text_eval import evaluate_stream
from vmoe_ext.data.text_stream import batchify
from vmoe_ext.evaluate import per_block
from vmoe_ext.evaluate.lm_eval import SPLIT_PREFIX
from vmoe_ext.reporting.writers import MetricWriter, read_metrics
from vmoe_ext.train.config_files import load_config

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "experiments"))
import claims_paired  # noqa: E402
import lm_claims  # noqa: E402
import lm_commands  # noqa: E402
import paired_claims  # noqa: E402
import paired_stats  # noqa: E402
import study  # noqa: E402

ROWS, BLOCK = 4, 8


# --------------------------------------------------------------------------
# Per-block losses: the evaluation keeps them, a run writes them.
# --------------------------------------------------------------------------


def test_the_stream_evaluation_keeps_each_blocks_mean_nll():
  # A step whose NLL sum is the sum of the block's targets and whose count
  # is B * M: the block's mean NLL is the mean of its targets, by hand.
  ids = np.arange(50) % 7
  rows = ids[:48].reshape(4, 12)

  def step(carry, inputs, targets):
    return carry + 1, float(targets.sum()), float(targets.size)

  result = evaluate_stream(step, ids, 0, block_size=3, batch_size=4)
  want = [rows[:, p + 1:p + 4].mean() for p in range(0, 12 - 3, 3)]
  assert result.num_blocks == len(want) == 3
  np.testing.assert_allclose(result.block_losses, want, rtol=1e-15)
  assert result.loss == pytest.approx(np.mean(want), rel=1e-15)


def test_per_block_files_round_trip_and_refuse_bad_values(tmp_path):
  path = per_block.write(str(tmp_path), {"test": (1.0, 2.5), "valid": [3.0]})
  assert os.path.basename(path) == per_block.FILENAME
  back = per_block.load(str(tmp_path))
  assert back["test"].tolist() == [1.0, 2.5] and back["valid"].tolist() == [3.0]
  with pytest.raises(ValueError, match="test"):
    per_block.write(str(tmp_path), {"test": np.zeros((2, 2))})
  with pytest.raises(FileNotFoundError, match="per-block"):
    per_block.load(str(tmp_path / "nothing"))


def _corpus(directory):
  """Lines of 5 words (and one rare word, so `<unk>` exists for the word
  swap): 4 rows of 8 tokens leave 2 to 3 whole blocks per split."""
  rng = np.random.default_rng(0)
  words = "red blue cat dog runs sits fast slow".split()
  for split, count in (("train", 40), ("valid", 16), ("test", 16)):
    lines = [" ".join(rng.choice(words, 5)) for _ in range(count)]
    if split == "train":
      lines[-1] = "zebra"
    with open(os.path.join(directory, f"{split}.txt"), "w") as f:
      f.write("\n".join(lines) + "\n")


def test_a_language_model_run_writes_its_per_block_losses(tmp_path):
  # What the training loop does at the end, on the initial state (no train
  # step to compile): the final evaluation, then the after-training one.
  _corpus(tmp_path)
  config = load_config("lm", "tiny")
  config.data.update(dict(corpus="plain_text", path=str(tmp_path),
                          min_count=2, block_size=BLOCK, batch_size=ROWS))
  config.model.update(dict(attn_span=BLOCK, hidden_size=16,
                           inner_hidden_size=16, num_heads=2))
  workdir = str(tmp_path / "run")
  run = RunContext.assemble(config)
  assert isinstance(run, LanguageRun)
  run.open_training(workdir)
  run.checkpoints.close()
  final = run.evaluate(final=True)
  with MetricWriter(workdir, tensorboard=False) as writer:
    run.final_evaluations(writer=writer, workdir=workdir)
  blocks = per_block.load(workdir)
  assert set(blocks) == set(SPLIT_PREFIX)
  for split, prefix in SPLIT_PREFIX.items():
    assert blocks[split].mean() == pytest.approx(final[f"{prefix}loss"],
                                                 rel=1e-12)
  # The test blocks against a naive loop: the model applied block after
  # block from zero caches, each block's mean token NLL.
  rows = batchify(run.text.eval_splits["test"], ROWS)
  apply = jax.jit(lambda v, x, c: run.model.apply(v, x, c,
                                                  deterministic=True))
  variables, cache, naive = run.state.variables(), run.model.zero_cache(
      ROWS), []
  for p in range(0, rows.shape[1] - BLOCK, BLOCK):
    x, y = rows[:, p:p + BLOCK], rows[:, p + 1:p + BLOCK + 1]
    log_probs, cache, _ = apply(variables, x, cache)
    log_probs = np.asarray(log_probs, np.float64)
    naive.append(np.mean([-log_probs[b, t, y[b, t]] for b in range(ROWS)
                          for t in range(BLOCK)]))
  assert len(naive) >= 2
  np.testing.assert_allclose(blocks["test"], naive, rtol=2e-6)
  assert [r["split"] for r in read_metrics(workdir)] == ["routing"]


# --------------------------------------------------------------------------
# The statistics of a claim on per-block NLLs.
# --------------------------------------------------------------------------


def test_the_papers_effect_is_its_log_ppl_change_by_hand():
  # MomentumSMoE Table 1: 35.55 -> 33.46 is 100 ln(35.55 / 33.46) = 6.06
  # centinats lower (better), whatever our level.
  for our in (100.0, 400.0):
    assert paired_stats.expected_effect(35.55, 33.46, "ppl_as_nll", our,
                                        -1) == pytest.approx(6.0589, abs=1e-4)
  # Table 7's small model: momentum is worse, the effect negative.
  assert paired_stats.expected_effect(84.81, 86.65, "ppl_as_nll", 400.0,
                                      -1) == pytest.approx(-2.1464, abs=1e-4)
  with pytest.raises(ValueError, match="lower"):
    paired_stats.expected_effect(35.55, 33.46, "ppl_as_nll", 90.0, +1)


def test_a_block_claim_is_the_paired_nll_difference_by_hand():
  rng = np.random.default_rng(0)
  a = 4.0 + 0.3 * rng.standard_normal((3, 22))
  b = a - 0.05 + 0.002 * rng.standard_normal((3, 22))  # 5 centinats lower.
  outcomes = {("smoe", "test_nll"): a, ("momentum", "test_nll"): b}
  claims = [c for c in lm_claims.CLAIMS if c.baseline == "smoe"
            and c.candidate == "momentum" and c.metric == "test_nll"]
  assert len(claims) == 1  # Table 1 only: one direction per pair.
  # The same pair read with a paper whose candidate got worse (Table 7's
  # small model), to check the verdict follows the paper's direction.
  claims.append(lm_claims._claim(  # pylint: disable=protected-access
      "Table 7", "momentum raises the test PPL", "smoe", "momentum",
      "test_nll", (84.81, 86.65)))
  _, records = paired_claims.claims_rows(outcomes, "tiny", claims,
                                         {"smoe": "A", "momentum": "B"})
  d = 100 * (b - a)
  se = math.sqrt(d.mean(1).var(ddof=1) / 3 + d.mean(0).var(ddof=1) / 22)
  for r in records:
    assert r["effect"] == pytest.approx(d.mean(), rel=1e-12)
    assert r["se"] == pytest.approx(se, rel=1e-12)
    assert r["baseline_value"] == pytest.approx(100 * a.mean(), rel=1e-12)
    assert r["discordant"] is None
  medium, small = records
  assert medium["expected"] == pytest.approx(100 * math.log(35.55 / 33.46))
  assert medium["verdict"] == "reproduced"
  assert small["verdict"] == "contradicted"  # The paper: small gets worse.


# --------------------------------------------------------------------------
# The experiment and its committed results.
# --------------------------------------------------------------------------


def test_each_claim_compares_two_candidates_that_differ_only_in_the_model():
  keys = [c.key for c in lm_claims.CANDIDATES]
  assert len(keys) == len(set(keys)) and set(lm_claims.QUICK) <= set(keys)
  by_key = {c.key: c for c in lm_claims.CANDIDATES}
  for claim in lm_claims.CLAIMS:
    assert claim.source.endswith("(LM, tiny corpus)")
    assert claim.paper[2] == "ppl_as_nll"
    paired_claims.metric_of(claim.metric)  # A known metric.
    a, b = (study.build_config(by_key[k], 0, lm_claims.REGIME,
                               quick=False).to_dict()
            for k in (claim.baseline, claim.candidate))
    assert a["model"] != b["model"], claim.statement
    assert {k: v for k, v in a.items() if k != "model"} == {
        k: v for k, v in b.items() if k != "model"}, claim.statement


def test_the_committed_lm_claims_rederive_from_their_block_values():
  committed = claims_paired.load(lm_claims.NAME)
  assert not committed["quick"] and committed["seeds"] == [0, 1, 2]
  again = claims_paired.rederive(lm_claims.NAME, list(lm_claims.CLAIMS))
  assert set(again) == set(committed["claims"]) == {"tiny"}
  records = committed["claims"]["tiny"]
  assert len(again["tiny"]) == len(records) == len(lm_claims.CLAIMS)
  for new, old in zip(again["tiny"], records):
    assert new["verdict"] == old["verdict"], old["statement"]
    for field in ("effect", "se", "df", "mdd", "baseline_value", "expected"):
      assert new[field] == pytest.approx(old[field], rel=1e-12), field
    assert new["seed_diffs"] == pytest.approx(old["seed_diffs"], rel=1e-12)


def test_the_committed_block_values_are_the_runs_perplexities():
  # exp(mean over blocks) of each run's committed per-block NLLs is the PPL
  # its metrics.jsonl reported (committed per seed in the JSON).
  committed = claims_paired.load(lm_claims.NAME)
  outcomes = claims_paired.regime_outcomes(lm_claims.NAME, "tiny")
  for c in lm_claims.CANDIDATES:
    seeds = committed["per_seed"][f"tiny/{c.key}"]
    for metric, ppl in (("test_nll", "test_ppl"),
                        ("attacked_nll", "attacked_ppl")):
      blocks = outcomes[c.key, metric]
      assert blocks.shape == (3, 22)
      np.testing.assert_allclose(np.exp(blocks.mean(1)), seeds[ppl],
                                 rtol=1e-12)


# --------------------------------------------------------------------------
# The WikiText-103 commands.
# --------------------------------------------------------------------------


def test_claims_md_lists_every_wikitext_table_with_its_commands():
  with open(os.path.join(ROOT, "CLAIMS.md"), encoding="utf-8") as f:
    text = f.read()
  for line in lm_commands.markdown():
    assert line in text, line[:100]
  tables = {(t.paper, t.table) for t in lm_commands.TABLES}
  for table in ("Tables 1, 2 (WikiText-103)", "Table 3", "Table 9",
                "Table 10", "Table 13", "Tables 15, 16", "Table 20"):
    assert ("ACMoE", table) in tables
  assert {("Symphony", "Table 1"), ("MomentumSMoE", "Tables 1, 7"),
          ("MomentumSMoE", "Table 9")} <= tables


def test_every_wikitext_command_resolves_on_a_corpus_directory(tmp_path):
  for split in ("train", "valid", "test"):
    (tmp_path / f"{split}.txt").write_text("a b <unk>\n")
  seen = set()
  for command in lm_commands.commands():
    assert command not in seen
    seen.add(command)
    words = shlex.split(command.replace(lm_commands.WIKITEXT, str(tmp_path))
                        .replace(lm_commands.ENWIK8, str(tmp_path)))[3:]
    config = resolve_command(["prog", *words])
    validate_config(config)
    assert config.model.name == "language_model", command


def test_ci_runs_the_experiment_in_quick_mode():
  with open(os.path.join(ROOT, ".ci", "run"), encoding="utf-8") as f:
    ci = f.read()
  assert "experiments/lm_claims.py --quick" in ci
  with open(os.path.join(ROOT, "experiments", "README.md"),
            encoding="utf-8") as f:
    assert "lm_claims.py" in f.read()
