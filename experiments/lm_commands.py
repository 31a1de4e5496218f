"""The binary commands behind every WikiText-103 table of the ACMoE, Symphony
and MomentumSMoE papers (and ACMoE's EnWik-8 row), for a user with the data
and GPUs: not run here (CLAIMS.md lists them; `lm_claims.py` tests the
tables' claims on the tiny model instead).

`TABLES` holds one row per paper table: the models, the paper's numbers
and, per model, the `python -m vmoe_ext.main` command (`configs/lm.py`'s
setting and methods, the overrides an ablation needs, the corpus read from
`data.path`), or what is not available here. `markdown()` renders the table;
`commands()` lists every command (the tests resolve each against a stand-in
corpus directory). Every run writes the clean and the word-swapped
(attacked) valid / test PPL in its final `metrics.jsonl` line (`ppl`,
`attacked_ppl`, ...), so a table's attacked column needs no other run.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

WIKITEXT = "/data/wikitext-103"
ENWIK8 = "/data/enwik8"
# The `c` layers' router, spelled out so that one field can change (an
# unset `model.ac_router` is `vmoe_ext.models.lm_config.LM_AC_ROUTER`).
AC_ROUTER = ("--config.model.ac_router.name=acmoe "
             "--config.model.ac_router.normalization=language "
             "--config.model.ac_router.base.name=cosine_lm "
             "--config.model.ac_router.base.num_selected=2 "
             "--config.model.ac_router.base.importance_loss_weight=0 "
             "--config.model.ac_router.base.load_loss_weight=0")
# The `m` layers' stream, spelled out likewise (unset: LM_STREAMS["m"]).
STREAM = "--config.model.stream.layout=vmoe_reference"
# Top-p routing (p 0.05, no noise, no loss, no cap below E = 16) on the `g`
# layers, and as the base of the `c` layers' AC router.
_TOP_P = ("name=top_p", "noise_std=0", "num_selected=16",
          "importance_loss_weight=0")
TOP_P = " ".join(f"--config.model.moe.router.{f}" for f in _TOP_P)
AC_TOP_P = " ".join(
    ["--config.model.ac_router.name=acmoe",
     "--config.model.ac_router.normalization=language"]
    + [f"--config.model.ac_router.base.{f}" for f in _TOP_P])
LEARN_P = ("--config.model.moe.router.learnable_threshold=True",
           "--config.model.ac_router.base.learnable_threshold=True")


@dataclasses.dataclass(frozen=True)
class Run:
  """One model of a table: `label`, and `arg` (`configs/lm.py:ARG`) with
  `overrides` (binary flags), or `missing` (why it cannot run here)."""
  label: str
  arg: Optional[str] = None
  overrides: str = ""
  missing: Optional[str] = None
  data: str = WIKITEXT

  def command(self) -> str:
    workdir = "runs/wt103/" + self.label.lower().replace(" ", "_").replace(
        "(", "").replace(")", "").replace(",", "").replace("=", "")
    flags = f" {self.overrides}" if self.overrides else ""
    return (f"python -m vmoe_ext.main --config=configs/lm.py:{self.arg}"
            f"{flags} --config.data.path={self.data} --workdir={workdir}")

  def cell(self) -> str:
    if self.missing is not None:
      return f"{self.label}: not available here ({self.missing})"
    return f"{self.label}: `{self.command()}`"


@dataclasses.dataclass(frozen=True)
class Table:
  paper: str
  table: str
  numbers: str
  runs: tuple[Run, ...]


def _ac(field: str, value: str) -> str:
  return f"{AC_ROUTER} --config.model.ac_router.{field}={value}"


def _stream(name: str, *fields: str) -> str:
  return " ".join([f"--config.model.stream.name={name}", STREAM]
                  + [f"--config.model.stream.{f}" for f in fields])


SAME = "the run above"
TABLES = (
    Table("ACMoE", "Tables 1, 2 (WikiText-103)", "test PPL Switch-medium "
          "35.48 → ACMoE 34.42, GLaM-medium 38.27 → 36.26; attacked test "
          "PPL 48.12 → 47.61, 50.84 → 47.91", (
              Run("SMoE medium", "switch_medium"),
              Run("ACMoE medium", "switch_medium,acmoe"),
              Run("GLaM medium", "glam_medium"),
              Run("ACMoE GLaM medium", "glam_medium,acmoe"))),
    Table("ACMoE", "Table 1 (EnWik-8; SST-2/5, Banking-77 fine-tuning)",
          "test BPC 1.153 → 1.137; fine-tuning SST-2 76.27 → 77.32 (from "
          "WikiText-103)", (
              Run("Switch EnWik-8", "enwik8", data=ENWIK8),
              Run("ACMoE EnWik-8", "enwik8,acmoe", data=ENWIK8),
              Run("fine-tuning", missing="no classification fine-tuning of "
                  "the language model"))),
    Table("ACMoE", "Table 3", "test PPL Switch-small SMoE 87.94, XMoE "
          "87.21, ACMoE 85.07; Switch-medium XMoE 35.88, StableMoE 35.33; "
          "GLaM-small 58.27, 54.80, 54.55; GLaM-medium XMoE 38.10, "
          "StableMoE 38.04 (SMoE, ACMoE medium: Tables 1, 2)", (
              Run("SMoE small", "switch_small"),
              Run("XMoE small", "switch_small,xmoe"),
              Run("ACMoE small", "switch_small,acmoe"),
              Run("XMoE medium", "switch_medium,xmoe"),
              Run("GLaM small", "glam_small"),
              Run("XMoE GLaM small", "glam_small,xmoe"),
              Run("ACMoE GLaM small", "glam_small,acmoe"),
              Run("XMoE GLaM medium", "glam_medium,xmoe"),
              Run("StableMoE", missing="no StableMoE router"))),
    Table("ACMoE", "Table 9", "Switch-medium test PPL: variance 34.87, MAD "
          "34.42 (MAD: Tables 1, 2)", (
              Run("ACMoE variance", "switch_medium,acmoe",
                  _ac("dispersion", "variance")),)),
    Table("ACMoE", "Table 10", "Switch-medium test PPL by AC placement: back "
          "half 34.95, alternating 34.80, skip 1 34.42 (Tables 1, 2), full "
          "34.88", (
              Run("ACMoE back half", "switch_medium,acmoe",
                  "--config.model.architecture=sgsgsgscscsc"),
              Run("ACMoE alternating", "switch_medium,acmoe",
                  "--config.model.architecture=sgscsgscsgsc"),
              Run("ACMoE full", "switch_medium,acmoe",
                  "--config.model.architecture=sgscscscscsc"))),
    Table("ACMoE", "Table 13", "Switch-medium test PPL: random diagonal "
          "38.17, ACMoE 34.42", (
              Run("ACMoE random", "switch_medium,acmoe",
                  _ac("transform", "random")),)),
    Table("ACMoE", "Tables 15, 16", "test PPL, Mix 1 → Mix 2: Switch 34.42 "
          "→ 34.66, GLaM 36.26 → 35.29", (
              Run("ACMoE mix 2", "switch_medium,acmoe", _ac("mix_k", "2")),
              Run("ACMoE GLaM mix 2", "glam_medium,acmoe",
                  _ac("mix_k", "2")))),
    Table("ACMoE", "Table 20", "Switch-medium test PPL: fixed p 35.20, "
          "ACMoE fixed p 34.14, learnable p 34.29, ACMoE learnable p 33.49 "
          "(our `top_p` router, not checked against the authors' LM gate)", (
              Run("top-p fixed", "switch_medium", TOP_P),
              Run("ACMoE top-p fixed", "switch_medium,acmoe",
                  f"{TOP_P} {AC_TOP_P}"),
              Run("top-p learnable", "switch_medium",
                  f"{TOP_P} {LEARN_P[0]}"),
              Run("ACMoE top-p learnable", "switch_medium,acmoe",
                  f"{TOP_P} {AC_TOP_P} {' '.join(LEARN_P)}"))),
    Table("Symphony", "Table 1", "test PPL SMoE 35.55 → 34.29, GLaM 37.71 → "
          "37.60, XMoE 34.59 → 34.51; attacked 44.19 → 42.79, 47.61 → "
          "46.43, 45.68 → 42.68 (baselines: ACMoE Tables 1, 3)", (
              Run("Symphony medium", "switch_medium,symphony"),
              Run("Symphony GLaM medium", "glam_medium,symphony"),
              Run("Symphony XMoE medium", "switch_medium,xmoe,symphony"))),
    Table("Symphony", "Tables 4, 17", "32 experts top-4: test PPL 32.71 → "
          "32.01, attacked 45.72 → 40.07; a shared expert (A): 34.12 → "
          "33.39; similarity-informed SMoE 32.58", (
              Run("SMoE 32 top-4", "switch_medium",
                  "--config.model.moe.num_experts=32 "
                  "--config.model.moe.router.num_selected=4"),
              Run("Symphony 32 top-4", "switch_medium,symphony",
                  "--config.model.moe.num_experts=32 "
                  "--config.model.moe.router.base.num_selected=4"),
              Run("shared expert", missing="no shared expert in the "
                  "language model"),
              Run("similarity-informed", missing="not implemented"))),
    Table("Symphony", "Tables 13, 14, 15", "test PPL by graph init: "
          "uniform 35.40, Kaiming 34.34, Xavier 34.32, zeros 34.29 (Table "
          "1); beta 0.7 35.2, 0.5 34.41, 0.3 34.38; sparse graph (t 0.05) "
          "34.53", (
              *(Run(f"Symphony init {i}", "switch_medium,symphony",
                    f"--config.model.moe.router.graph_init={i}")
                for i in ("uniform", "kaiming", "xavier")),
              *(Run(f"Symphony beta {b}", "switch_medium,symphony",
                    f"--config.model.moe.router.beta={b}")
                for b in ("0.7", "0.5", "0.3")),
              Run("Symphony sparse", "switch_medium,symphony",
                  "--config.model.moe.router.threshold=0.05"))),
    Table("Symphony", "Table 16", "similarity-informed SMoE 35.06, with "
          "Symphony 34.50", (
              Run("similarity-informed", missing="not implemented"),)),
    Table("MomentumSMoE", "Tables 1, 7", "test PPL SMoE-medium 35.55 → "
          "Momentum 33.46, Adam 33.25; large 30.33 → 29.03; GLaM-medium "
          "37.71 → 35.29, 34.32; small 84.81 → 86.65; attacked 44.19 → "
          "42.33, 41.11 (SMoE, GLaM medium: ACMoE Tables 1, 2)", (
              Run("MomentumSMoE medium", "switch_medium,momentum"),
              Run("AdamSMoE medium", "switch_medium,adam"),
              Run("SMoE large", "smoe_large"),
              Run("MomentumSMoE large", "smoe_large,momentum"),
              Run("MomentumGLaM medium", "glam_medium,momentum"),
              Run("AdamGLaM medium", "glam_medium,adam"),
              Run("MomentumSMoE small", "switch_small,momentum"))),
    Table("MomentumSMoE", "Tables 5, 6", "test PPL: learnable mu, gamma "
          "33.87; learnable gamma 33.69; gamma a linear network 33.96; "
          "time-varying 35.08; ZOH 34.00", (
              Run("MomentumSMoE learn both", "switch_medium,momentum",
                  _stream("momentum", "mu=0.7", "gamma=1.0", "learn=both")),
              Run("MomentumSMoE learn gamma", "switch_medium,momentum",
                  _stream("momentum", "mu=0.7", "gamma=1.0", "learn=gamma")),
              Run("MomentumSMoE gamma linear", "switch_medium,momentum",
                  _stream("momentum", "mu=0.7", "learn=gamma_linear")),
              Run("MomentumSMoE TV", "switch_medium,momentum",
                  _stream("time_varying", "gamma=1.0")),
              Run("MomentumSMoE ZOH", missing="no zero-order-hold stream"))),
    Table("MomentumSMoE", "Table 9", "test PPL: NAG 35.46, SR 35.01, rms "
          "34.25, SAM 35.05, robust 34.45, negative 35.09, complex 33.34 "
          "(negative and complex: the paper gives no mu; ours -0.3, and "
          "0.7 at pi/8)", (
              Run("NAG-SMoE", "switch_medium,momentum", _stream("nag")),
              Run("SR-SMoE", "switch_medium,momentum",
                  _stream("time_varying", "restart_every=3")),
              Run("rms-SMoE", "switch_medium,adam", _stream("rmsprop")),
              Run("SAM-SMoE", "switch_medium,momentum", _stream("sam")),
              Run("Robust MomentumSMoE", "switch_medium,momentum",
                  _stream("robust_momentum", "p=0.2", "kappa=1.25")),
              Run("Negative-MomentumSMoE", "switch_medium,momentum",
                  _stream("momentum", "mu=-0.3", "gamma=1.0")),
              Run("Complex-MomentumSMoE", "switch_medium,momentum",
                  _stream("complex_momentum")))),
    Table("MomentumSMoE", "Table 12", "minutes to 38 valid PPL: SMoE 85.56, "
          "Momentum 81.77, Adam 84.23", (
              Run("same runs", missing="read from Tables 1, 7's runs: "
                  "`valid_ppl` every 1,000 steps and the train lines' "
                  "timing"),)),
)


def commands() -> list[str]:
  """Every command of `TABLES`."""
  return [r.command() for t in TABLES for r in t.runs if r.missing is None]


def markdown() -> list[str]:
  """The table: paper, table, the paper's numbers, one command per model
  (or why it is not available)."""
  lines = ["| paper | table | the paper's numbers | commands (not run here) "
           "|", "|---|---|---|---|"]
  for t in TABLES:
    lines.append(f"| {t.paper} | {t.table} | {t.numbers} | "
                 + "<br>".join(r.cell() for r in t.runs) + " |")
  return lines
