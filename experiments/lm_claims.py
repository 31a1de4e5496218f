"""The language-model claims of ACMoE, Symphony and MomentumSMoE, on the
tiny language model, judged block by block (clean and word-swapped PPL).

    python experiments/lm_claims.py [--seeds 0 1 2] [--root runs/lm]
        [--jobs 1] [--quick]

NOT WikiText-103: every candidate is `configs/lm.py:tiny` (2 layers of
width 64, 4 experts, top-2, on the Python Language Reference shipped with
Python: about 95,000 training words, 600 steps of 16 rows x 32 tokens),
with one method switched on, every other hyper-parameter shared:

* Switch layout (every layer an MoE layer): `smoe` (the SMoE gate),
  `acmoe` (`sgsc`: the AC router over the authors' cosine gate in layer 1),
  `xmoe` (the XMoE gate), `symphony` (Symphony over the SMoE gate),
  `xmoe_symphony` (over the XMoE gate), `momentum` (`smsm`: MomentumSMoE's
  heavy-ball stream), `adam` (`sasa`: AdamSMoE, Adam in the first MoE
  layer);
* GLaM layout (`model.base_arch="glam"`: an MoE and a dense layer
  alternate, `sgsfsgsf`, 2 MoE layers as in the Switch model): `glam`,
  `glam_acmoe` (`sgsfscsf`), `glam_symphony`, `glam_momentum`
  (`smsfsmsf`), `glam_adam` (`sasfsasf`).

Each run's final evaluation scores the test split and its word-swapped copy
(the papers' attack: 2.5% of the words swapped for "AAA", here `<unk>`:
"AAA" is not in this corpus's vocabulary) in the same 22 blocks of 16 x 32
tokens for every model; `per_block.npz` holds each block's mean token NLL
(`vmoe_ext.evaluate.per_block`). A claim pairs its two models block by block
and seed by seed on 100 x NLL, whose mean over blocks is 100 ln PPL: the
effect is (about) the relative PPL change in %, pooled over seeds and blocks
with `paired_stats.paired_images` (standard error from both the seeds and
the blocks, Satterthwaite degrees of freedom), the paper's effect converted
exactly (100 ln(PPL_B / PPL_A), kind "ppl_as_nll"), the minimum detectable
difference and the verdict as for the image claims
(`paired_claims.claims_rows`). The paper number a row uses is the setting
nearest ours (small where the paper has it; the attacked PPL only at
medium).

Writes ROOT/lm_claims.md (tables, claims, per-seed values, the WikiText-103
commands), ROOT/lm_claims.json (every claim's numbers, every run's per-seed
PPL) and ROOT/lm_claims_images.npz (the per-block NLLs the claims use:
`REGIME/KEY/METRIC` -> `[S, 22]`, nats). 36 runs, about 30 minutes on a
2-core CPU with `--jobs 1`; `--quick` (CI) trains `smoe` and `acmoe` for 30
steps and checks every candidate's config.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from typing import Optional

import numpy as np

import lm_commands
import paired_claims
from common import mean_std, write_report
from study import Candidate, Claim, Regime, build_config, run_dir, run_grid
from vmoe_ext.app.schema import validate_config
from vmoe_ext.evaluate import per_block

NAME = "lm_claims"
REGIME = Regime("tiny", "configs/lm.py:tiny's budget: 600 steps of 16 rows "
                "x 32 tokens (about 3.2 passes over the training text)")
QUICK_REGIME = Regime("tiny", "quick: 30 steps", total_steps=30)
_GLAM = (("model.base_arch", "glam"),)


def _glam(key: str, label: str, arg: str, architecture: Optional[str] = None
          ) -> Candidate:
  """A tiny GLaM candidate: `configs/lm.py:ARG` in the GLaM layout (2 MoE
  layers, each followed by a dense one); `architecture` replaces the
  method's Switch letters with their GLaM string."""
  over = _GLAM + ((("model.architecture", architecture),)
                  if architecture else ())
  return Candidate(key, label, "lm", arg, overrides=over)


CANDIDATES = (
    Candidate("smoe", "SMoE (Switch)", "lm", "tiny"),
    Candidate("acmoe", "ACMoE (Switch)", "lm", "tiny,acmoe"),
    Candidate("xmoe", "XMoE (Switch)", "lm", "tiny,xmoe"),
    Candidate("symphony", "SymphonySMoE (Switch)", "lm", "tiny,symphony"),
    Candidate("momentum", "MomentumSMoE (Switch)", "lm", "tiny,momentum"),
    Candidate("adam", "AdamSMoE (Switch)", "lm", "tiny,adam"),
    Candidate("xmoe_symphony", "SymphonyXMoE (Switch)", "lm",
              "tiny,xmoe,symphony"),
    _glam("glam", "GLaM", "tiny"),
    _glam("glam_acmoe", "GLaM-ACMoE", "tiny,acmoe", "sgsfscsf"),
    _glam("glam_symphony", "SymphonyGLaM", "tiny,symphony"),
    _glam("glam_momentum", "MomentumGLaM", "tiny,momentum", "smsfsmsf"),
    _glam("glam_adam", "AdamGLaM", "tiny,adam", "sasfsasf"),
)
QUICK = ("smoe", "acmoe")

# Split of the final evaluation behind each per-block metric.
SPLITS = {"test_nll": "test", "attacked_nll": "test_attacked"}
METRICS = tuple(SPLITS)


def _claim(source: str, statement: str, baseline: str, candidate: str,
           metric: str, paper: tuple[float, float]) -> Claim:
  return Claim(source + " (LM, tiny corpus)", statement, baseline, candidate,
               metric, paper=(*paper, "ppl_as_nll"))


CLAIMS = (
    # ACMoE: Table 3 (small; medium in Table 1) and Table 2 (medium).
    _claim("ACMoE Table 3 (Switch-small test PPL 87.94 → 85.07; medium "
           "35.48 → 34.42, Table 1)", "ACMoE lowers the test PPL (Switch)",
           "smoe", "acmoe", "test_nll", (87.94, 85.07)),
    _claim("ACMoE Table 2 (Switch-medium attacked test PPL 48.12 → 47.61)",
           "ACMoE lowers the attacked test PPL (Switch)", "smoe", "acmoe",
           "attacked_nll", (48.12, 47.61)),
    _claim("ACMoE Table 3 (GLaM-small test PPL 58.27 → 54.55; medium "
           "38.27 → 36.26, Table 1)", "ACMoE lowers the test PPL (GLaM)",
           "glam", "glam_acmoe", "test_nll", (58.27, 54.55)),
    _claim("ACMoE Table 2 (GLaM-medium attacked test PPL 50.84 → 47.91)",
           "ACMoE lowers the attacked test PPL (GLaM)", "glam", "glam_acmoe",
           "attacked_nll", (50.84, 47.91)),
    _claim("ACMoE Table 3 (Switch-small: XMoE 87.21 → ACMoE 85.07; medium "
           "35.88 → 34.42; the arms differ in both layers' gates)",
           "ACMoE beats the XMoE router (Switch)", "xmoe", "acmoe",
           "test_nll", (87.21, 85.07)),
    _claim("ACMoE Table 3 (baselines, Switch-small: SMoE 87.94 → XMoE "
           "87.21; medium the other way, 35.48 → 35.88)",
           "XMoE lowers the test PPL (Switch, small)", "smoe", "xmoe",
           "test_nll", (87.94, 87.21)),
    # Symphony: Table 1 (medium).
    _claim("Symphony Table 1 (SMoE-medium test PPL 35.55 → 34.29)",
           "Symphony lowers the test PPL", "smoe", "symphony", "test_nll",
           (35.55, 34.29)),
    _claim("Symphony Table 1 (SMoE-medium attacked test PPL 44.19 → "
           "42.79)", "Symphony lowers the attacked test PPL", "smoe",
           "symphony", "attacked_nll", (44.19, 42.79)),
    _claim("Symphony Table 1 (GLaM-medium test PPL 37.71 → 37.60)",
           "Symphony lowers the test PPL (GLaM)", "glam", "glam_symphony",
           "test_nll", (37.71, 37.60)),
    _claim("Symphony Table 1 (GLaM-medium attacked test PPL 47.61 → "
           "46.43)", "Symphony lowers the attacked test PPL (GLaM)", "glam",
           "glam_symphony", "attacked_nll", (47.61, 46.43)),
    _claim("Symphony Table 1 (XMoE-medium test PPL 34.59 → 34.51)",
           "Symphony lowers the test PPL (XMoE)", "xmoe", "xmoe_symphony",
           "test_nll", (34.59, 34.51)),
    _claim("Symphony Table 1 (XMoE-medium attacked test PPL 45.68 → "
           "42.68)", "Symphony lowers the attacked test PPL (XMoE)", "xmoe",
           "xmoe_symphony", "attacked_nll", (45.68, 42.68)),
    # MomentumSMoE: Table 1 (medium). Its Table 7 (the small model, where
    # momentum hurts: 84.81 -> 86.65) is a claim about depth, on the same
    # pair in the other direction: not listed (depth is not varied here).
    _claim("MomentumSMoE Table 1 (SMoE-medium test PPL 35.55 → 33.46)",
           "MomentumSMoE lowers the test PPL", "smoe", "momentum",
           "test_nll", (35.55, 33.46)),
    _claim("MomentumSMoE Table 1 (SMoE-medium attacked test PPL 44.19 → "
           "42.33)", "MomentumSMoE lowers the attacked test PPL", "smoe",
           "momentum", "attacked_nll", (44.19, 42.33)),
    _claim("MomentumSMoE Table 1 (AdamSMoE-medium test PPL 35.55 → 33.25)",
           "AdamSMoE lowers the test PPL", "smoe", "adam", "test_nll",
           (35.55, 33.25)),
    _claim("MomentumSMoE Table 1 (AdamSMoE-medium attacked test PPL 44.19 "
           "→ 41.11)", "AdamSMoE lowers the attacked test PPL", "smoe",
           "adam", "attacked_nll", (44.19, 41.11)),
    _claim("MomentumSMoE Table 1 (GLaM-medium test PPL 37.71 → 35.29)",
           "MomentumGLaM lowers the test PPL", "glam", "glam_momentum",
           "test_nll", (37.71, 35.29)),
    _claim("MomentumSMoE Table 1 (GLaM-medium attacked test PPL 47.61 → "
           "43.64)", "MomentumGLaM lowers the attacked test PPL", "glam",
           "glam_momentum", "attacked_nll", (47.61, 43.64)),
    _claim("MomentumSMoE Table 1 (AdamGLaM-medium test PPL 37.71 → 34.32)",
           "AdamGLaM lowers the test PPL", "glam", "glam_adam", "test_nll",
           (37.71, 34.32)),
    _claim("MomentumSMoE Table 1 (AdamGLaM-medium attacked test PPL 47.61 "
           "→ 42.81)", "AdamGLaM lowers the attacked test PPL", "glam",
           "glam_adam", "attacked_nll", (47.61, 42.81)),
)


def block_outcomes(workdirs: Sequence[str], metric: str) -> np.ndarray:
  """`[S, I]`: each block's mean token NLL (nats) of the metric's split,
  one row per run (seed); every run must have scored the same blocks. (The
  claims read the differences x 100, `paired_images`' scale.)"""
  rows = [per_block.load(w)[SPLITS[metric]] for w in workdirs]
  if len({r.shape for r in rows}) != 1:
    raise ValueError(f"{metric}: the runs scored different blocks: "
                     f"{[r.shape for r in rows]} ({list(workdirs)})")
  return np.stack(rows)


def _final(records: list[dict]) -> dict:
  finals = [r for r in records if r.get("final")]
  if not finals:
    raise ValueError("a run without its final evaluation line")
  return finals[-1]


def run_values(records: list[dict]) -> dict[str, float]:
  """The run's final valid / test / attacked test PPL and its test split's
  load imbalance (std of the experts' shares in %, mean over MoE layers)."""
  final = _final(records)
  routing = [r for r in records if r.get("split") == "routing"]
  return {"valid_ppl": final["valid_ppl"], "test_ppl": final["ppl"],
          "attacked_ppl": final["attacked_ppl"],
          "load": routing[-1]["load_balance_mean"] if routing
          else float("nan")}


RUN_LABELS = {"valid_ppl": "valid PPL", "test_ppl": "test PPL",
              "attacked_ppl": "attacked test PPL",
              "load": "load imbalance (std of expert %)"}


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--seeds", type=int, nargs="+", default=None,
                      help="default 0 1 2 (quick: 0)")
  parser.add_argument("--root", default=os.path.join("runs", "lm"))
  parser.add_argument("--quick", action="store_true",
                      help="30 steps (CI): the numbers mean nothing")
  parser.add_argument("--jobs", type=int, default=1,
                      help="runs trained at a time (processes; the CPU is "
                      "often shared: 1 by default)")
  args = parser.parse_args(argv)
  if args.seeds is None:
    args.seeds = [0] if args.quick else [0, 1, 2]
  return args


def main(argv: Optional[Sequence[str]] = None) -> tuple[str, list[dict]]:
  args = parse_args(argv)
  regime = QUICK_REGIME if args.quick else REGIME
  candidates = list(CANDIDATES)
  if args.quick:  # Every config is checked; two candidates train.
    for c in candidates:
      validate_config(build_config(c, 0, regime, quick=True))
    candidates = [c for c in candidates if c.key in QUICK]
  keys = {c.key for c in candidates}
  claims = [c for c in CLAIMS if paired_claims.claim_keys(c) <= keys]
  runs = run_grid(candidates, [regime], args.seeds, args.root, args.quick,
                  args.jobs)
  outcomes, per_seed = {}, {}
  for c in candidates:
    dirs = [run_dir(args.root, regime, c, s) for s in args.seeds]
    for metric in METRICS:
      outcomes[c.key, metric] = block_outcomes(dirs, metric)
    values = [run_values(runs[regime.name, c.key, s]) for s in args.seeds]
    per_seed[f"{regime.name}/{c.key}"] = {
        k: [v[k] for v in values] for k in RUN_LABELS}
  labels = {c.key: c.label for c in candidates}
  claim_lines, records = paired_claims.claims_rows(outcomes, regime.name,
                                                   claims, labels)
  # The rows' unit is a block; no outcome is right or wrong (no McNemar).
  claim_lines[0] = claim_lines[0].replace("per-image", "per-block")
  table = ["| model | " + " | ".join(RUN_LABELS.values()) + " |",
           "|---|" + "---|" * len(RUN_LABELS)]
  for c in candidates:
    cells = ["{:.2f} ± {:.2f}".format(*mean_std(
        per_seed[f"{regime.name}/{c.key}"][k])) for k in RUN_LABELS]
    table.append(f"| {c.label} (`{c.key}`) | " + " | ".join(cells) + " |")
  blocks = outcomes[candidates[0].key, "test_nll"].shape[1]
  lines = [
      "# Language-model claims on the tiny model (LM, tiny corpus; not "
      "WikiText-103)", "",
      "Every candidate is `configs/lm.py:tiny` (2 layers of width 64, 4 "
      "experts, top-2, the shipped `python_docs` text) with one method "
      "switched on; the GLaM ones alternate an MoE and a dense layer "
      "(`model.base_arch=glam`). Each claim pairs its two models on the "
      f"same {blocks} test blocks of 16 x 32 tokens, clean and word-swapped "
      "(2.5% of the words, here to `<unk>`), seed by seed: the outcome is "
      "100 x the block's mean token NLL (its mean over blocks is 100 ln "
      "PPL, so a difference of -1 is about 1% lower PPL); standard error "
      "from the seeds and the blocks, Satterthwaite degrees of freedom, "
      "decided at two-sided alpha 0.05; MDD the smallest effect the design "
      "finds with 80% power; the paper's effect is 100 ln(PPL_B / PPL_A) "
      "of its numbers; a null result whose paper effect is below the MDD "
      "is *undecidable here*.", "",
      f"Seeds {list(args.seeds)}; regime `{regime.name}`: "
      f"{regime.description}."
      + (" QUICK MODE: the numbers mean nothing." if args.quick else ""), "",
      "## Results (mean ± std over seeds)", "", *table, "",
      "## Claims", "", *claim_lines, "", "## Per seed", ""]
  for c in candidates:
    values = per_seed[f"{regime.name}/{c.key}"]
    for i, s in enumerate(args.seeds):
      lines.append(f"- {c.label}, seed {s}: " + ", ".join(
          f"{k} {values[k][i]:.3f}" for k in RUN_LABELS))
  lines += ["", "## WikiText-103 and EnWik-8: the papers' tables as "
            "commands (not run here)", "", *lm_commands.markdown(), ""]
  root = args.root
  paired_claims.write_images(os.path.join(root, f"{NAME}_images.npz"),
                             {regime.name: outcomes})
  paired_claims.write_json(os.path.join(root, f"{NAME}.json"), dict(
      seeds=list(args.seeds), claims={regime.name: records},
      per_seed=per_seed, quick=bool(args.quick)))
  return write_report(root, f"{NAME}.md", lines), records


if __name__ == "__main__":
  main()
