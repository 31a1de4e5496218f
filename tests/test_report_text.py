"""What the reports and the console say: progress lines with an estimate,
informational lines, one wall-time figure, dtypes by name, the attack
table's named MoE layers and settings, the sweep's attack settings and the
AutoAttack section when no image was left robust."""

from __future__ import annotations

import json
import types

import jax.numpy as jnp
import numpy as np
import pytest

from vmoe_ext.attacks import progress as attacks_progress
from vmoe_ext.data import ArrayDataset
from vmoe_ext.evaluate import autoattack_report
from vmoe_ext.evaluate.robustness import (attack_metrics, attack_settings,
                                          routing_by_layer,
                                          sweep_settings_text)
from vmoe_ext.reporting import progress
from vmoe_ext.reporting.report import write_report
from vmoe_ext.reporting.writers import MetricWriter


class FakeClock:
  """A clock the test moves by hand."""

  def __init__(self):
    self.now = 100.0

  def __call__(self) -> float:
    return self.now


class FakeBar:
  """A disabled progress bar that counts its updates."""
  disable = True

  def __init__(self):
    self.n = 0

  def update(self, n: int = 1) -> None:
    self.n += n


def test_batch_progress_lines_and_estimate(capsys):
  clock, bar = FakeClock(), FakeBar()
  p = progress.BatchProgress(bar, 5, "evaluate: autoattack", clock=clock,
                             min_interval=10.0)
  clock.now += 40.0  # The first batch (compiles): 40 s.
  p.update()
  clock.now += 30.0  # Then 30 s a batch: the estimate uses those.
  p.update()
  clock.now += 5.0  # Not 10 s since the last line: no line.
  p.update()
  clock.now += 25.0
  p.update()
  clock.now += 1.0  # The last batch always prints.
  p.update()
  lines = capsys.readouterr().err.splitlines()
  assert lines == [
      # 4 left at the first batch's pace (40 s each).
      "evaluate: autoattack 1/5 batches, 40s elapsed, ~2m40s left",
      # 3 left at 30 s each (timed from the first batch's end).
      "evaluate: autoattack 2/5 batches, 1m10s elapsed, ~1m30s left",
      # (100 - 40) / 3 = 20 s a batch since the first: 1 left.
      "evaluate: autoattack 4/5 batches, 1m40s elapsed, ~20s left",
      "evaluate: autoattack 5/5 batches, 1m41s elapsed"]
  assert bar.n == 5


def test_progress_lines_only_off_a_terminal(capsys):
  bar = FakeBar()
  bar.disable = False  # A bar on a terminal shows the progress itself.
  p = progress.BatchProgress(bar, 2, "x", clock=FakeClock())
  p.update()
  p.update()
  assert capsys.readouterr().err == "" and bar.n == 2


def test_a_note_inside_a_batch(capsys):
  """An attack's stage inside the batch under way: a line with the elapsed
  time off a terminal, the bar's postfix on one."""
  clock, bar = FakeClock(), FakeBar()
  p = progress.BatchProgress(bar, 2, "evaluate: autoattack", clock=clock)
  clock.now += 95.0
  p.note("apgd-ce done, 3 of the batch's 8 images still robust")
  assert capsys.readouterr().err == (
      "evaluate: autoattack batch 1/2: apgd-ce done, 3 of the batch's 8 "
      "images still robust, 1m35s elapsed\n")
  bar.disable = False
  bar.postfix = None
  bar.set_postfix_str = lambda text: setattr(bar, "postfix", text)
  p.update()
  p.note("square done, 0 of the batch's 8 images still robust")
  assert capsys.readouterr().err == ""
  assert bar.postfix == "square done, 0 of the batch's 8 images still robust"


class FakeEvaluator:
  """What `attack_metrics` calls: an identity attack and a forward whose
  logits predict class 0 (MoE masks of two layers, unchanged)."""

  def attack(self, config, details=False):
    del config, details
    return lambda x, y, k: (x, {})

  def forward(self, x):
    b = x.shape[0]
    logits = np.zeros((b, 3), np.float32)
    logits[:, 0] = 1.0
    mask = np.zeros((b, 4, 2), bool)
    mask[..., 0] = True
    return logits, {"encoderblock_10": mask, "encoderblock_2": mask}


def test_attack_metrics_prints_a_line_per_batch(capsys, monkeypatch):
  monkeypatch.setenv("CI", "1")  # Bars off: progress as lines.
  labels = np.array([0, 1, 0, 2, 0], np.int32)
  data = ArrayDataset(np.zeros((5, 2, 2, 1), np.float32), labels, 3, "t")
  m = attack_metrics(FakeEvaluator(), data, {"name": "fgsm", "eps": 0.1},
                     batch_size=2, seed=0, desc="fgsm")
  err = capsys.readouterr().err.splitlines()
  assert err[0] == "evaluate: fgsm on 5 images, 3 batches..."
  batches = [l for l in err if l.startswith("evaluate: fgsm ")
             and "/3 batches" in l]
  # The first and the last at least; each names its count.
  assert batches[0].startswith("evaluate: fgsm 1/3 batches, ")
  assert batches[-1].startswith("evaluate: fgsm 3/3 batches, ")
  assert "left" in batches[0] and "left" not in batches[-1]
  assert m["accuracy"] == pytest.approx(3 / 5)  # Labels 0: 3 of 5.
  assert routing_by_layer(m) == {"layer_2": 0.0, "layer_10": 0.0}


class StagedEvaluator(FakeEvaluator):
  """An ensemble's stand-in: one stage that leaves the examples of label 0
  robust, reported as the compiled chain reports its stages."""

  def attack(self, config, details=False):
    del config, details

    def run(x, y, k):
      del k
      attacks_progress._dispatch("apgd-ce", np.asarray(y) == 0)  # pylint: disable=protected-access
      return x, {}

    return run


def test_stage_lines_count_the_real_images_of_a_padded_batch(capsys,
                                                             monkeypatch):
  monkeypatch.setenv("CI", "1")
  labels = np.array([0, 1, 0, 2, 0], np.int32)
  data = ArrayDataset(np.zeros((5, 2, 2, 1), np.float32), labels, 3, "t")
  attack_metrics(StagedEvaluator(), data, {"name": "autoattack", "eps": 0.1},
                 batch_size=4, seed=0, desc="autoattack")
  stages = [l.rsplit(", ", 1)[0] for l in capsys.readouterr().err.splitlines()
            if " done, " in l]
  # The last batch holds one image and three of padding: only the image
  # counts.
  assert stages == [
      "evaluate: autoattack batch 1/2: apgd-ce done, 2 of the batch's 4 "
      "images still robust",
      "evaluate: autoattack batch 2/2: apgd-ce done, 1 of the batch's 1 "
      "images still robust"]


def test_info_line_and_wall_time(capsys):
  progress.info_line("resuming from the checkpoint of step 4 in /w")
  assert capsys.readouterr().err == (
      "info: resuming from the checkpoint of step 4 in /w\n")
  assert progress.wall_time(10.59) == "10.6 s"
  assert progress.wall_time(75.2) == "1m15s"
  assert progress.wall_time(3725) == "1h02m05s"


def test_report_config_names_dtypes(tmp_path):
  config = {"model": {"dtype": jnp.float32, "param_dtype": jnp.bfloat16,
                      "other": np.dtype("float16"), "name": "vit"}}
  text = write_report(str(tmp_path), final_metrics={"accuracy": 0.5},
                      records=[], config_summary=config, wall_seconds=1.0,
                      summary=["Evaluated checkpoint: step 7 of `/x`."])
  block = text.split("```json\n")[1].split("```")[0]
  assert json.loads(block)["model"] == {
      "dtype": "float32", "param_dtype": "bfloat16", "other": "float16",
      "name": "vit"}
  # The summary line sits under the title, before the first section.
  head = text.split("## ")[0]
  assert "Evaluated checkpoint: step 7 of `/x`." in head


def test_attack_settings_and_sweep_text():
  table_pgd = dict(name="pgd", eps=0.05, steps=10, step_size=0.0125,
                   random_start=True)
  sweep = dict(name="pgd", steps=5, random_start=False)
  assert attack_settings(table_pgd) == (
      "norm=linf, steps=10, step_size=0.0125, random_start=True, restarts=1")
  # Defaults come from the attack: PGD derives its step size, AutoAttack
  # its attacks from the version.
  assert attack_settings(sweep) == ("norm=linf, steps=5, "
                                    "step_size=2.5*eps/steps, "
                                    "random_start=False, restarts=1")
  assert attack_settings(dict(name="autoattack", eps=0.05)).startswith(
      "version=standard, attacks=apgd-ce+apgd-t+fab-t+square, norm=linf")
  assert "attacks=apgd-ce+apgd-dlr," in attack_settings(
      dict(name="autoattack", eps=0.05, version="rand"))
  text = sweep_settings_text(sweep, [dict(name="fgsm", eps=0.05), table_pgd])
  assert text.startswith("PGD with norm=linf, steps=5, "
                         "step_size=2.5*eps/steps, random_start=False, "
                         "restarts=1, at each eps")
  assert ("not the settings of the attack table's PGD (norm=linf, steps=10, "
          "step_size=0.0125, random_start=True, restarts=1)") in text
  # The same settings: nothing to explain.
  assert "not the settings" not in sweep_settings_text(table_pgd,
                                                       [table_pgd])


def _aa_metrics(clean, after):
  """AutoAttack metrics over 10 images: clean accuracy and the robust
  accuracy after apgd-ce, apgd-t, fab-t, square."""
  stages = ("apgd-ce", "apgd-t", "fab-t", "square")
  m = {"clean_accuracy": clean, "clean_correct": clean, "accuracy": after[-1],
       "square_only": 0.0, "apgd_loss/apgd-ce": [1.0, 2.0, 3.0],
       "apgd_loss/apgd-t": [0.0, 0.0, 0.0]}
  m.update({f"robust_after/{s}": a for s, a in zip(stages, after)})
  return m


def test_autoattack_section_when_nothing_is_left_robust(tmp_path):
  config = dict(name="autoattack", eps=0.3)
  m = _aa_metrics(0.8, [0.0, 0.0, 0.0, 0.0])
  (text,) = autoattack_report.autoattack_section([(config, m, 10)],
                                                 str(tmp_path))
  assert "no sign of gradient masking" not in text
  assert ("Gradient-masking check: no verdict: no image was left robust "
          "after apgd-ce, apgd-t, fab-t, so Square (black-box) had nothing "
          "to test.") in text
  assert ("No image was left robust before apgd-t, fab-t, square: those "
          "attacks had nothing to test.") in text
  assert "| after apgd-t (no robust image left to attack) | 0.0000 |" in text
  # APGD-T attacked nothing: only APGD-CE's curve is drawn.
  assert autoattack_report.robust_before(m, ["apgd-ce", "apgd-t"]) == {
      "apgd-ce": 0.8, "apgd-t": 0.0}
  drawn = []
  original = autoattack_report._plot  # pylint: disable=protected-access
  try:
    autoattack_report._plot = lambda curves, path: drawn.append(list(curves))
    autoattack_report.autoattack_section([(config, m, 10)], str(tmp_path))
  finally:
    autoattack_report._plot = original
  assert drawn == [["autoattack[0] eps=0.3 apgd-ce"]]


def test_autoattack_section_counts_what_square_tested(tmp_path):
  m = _aa_metrics(0.8, [0.5, 0.4, 0.4, 0.3])
  m["square_only"] = 0.1  # 1 of the 4 images the white-box attacks left.
  (text,) = autoattack_report.autoattack_section(
      [(dict(name="autoattack", eps=0.1), m, 10)], str(tmp_path))
  assert ("Square (black-box) broke 1 of the 4 images that every white-box "
          "attack failed on (25.0%)") in text
  assert "nothing to test" not in text


def test_attack_table_names_the_moe_layers(tmp_path, monkeypatch):
  """The robustness section's table: one `layer_i: rate` per MoE layer, in
  block order, and the attack's settings."""
  from vmoe_ext.evaluate import robustness as rob
  metrics = {"clean_accuracy": 1.0, "accuracy": 0.5,
             "prediction_change_rate": 0.5, "top5_accuracy": 1.0,
             "layer_10/routing_change_rate": 0.25,
             "layer_2/routing_change_rate": 0.125}
  monkeypatch.setattr(rob, "attack_metrics", lambda *a, **k: dict(metrics))
  monkeypatch.setattr(rob, "Evaluator", lambda *a, **k: None)
  data = ArrayDataset(np.zeros((4, 2, 2, 1), np.float32),
                      np.zeros(4, np.int32), 2, "t")
  data_config = types.SimpleNamespace(get=lambda k, d=None: d)
  monkeypatch.setattr(rob, "default_normalization", lambda c: (0.0, 1.0))
  with MetricWriter(str(tmp_path), tensorboard=False) as writer:
    (section,) = rob.evaluate_robustness(
        None, {}, data, data_config,
        {"attacks": (dict(name="pgd", eps=0.1, steps=3),), "sweep": None,
         "corruptions": None},
        batch_size=2, writer=writer, step=0, workdir=str(tmp_path))
  row = [l for l in section.splitlines() if l.startswith("| pgd |")][0]
  assert row.endswith("| layer_2: 0.125, layer_10: 0.250 |")
  assert "| steps=" not in row and "norm=linf, steps=3" in row
