"""The language-model settings of the papers, as plain model-field dicts,
and their parameter counts (docs/language_model.md, "Settings").

Each `LMSetting.model` is the keyword arguments of `LanguageModel` (with
the plain SMoE architecture: every MoE letter `g`; swap letters for the
other methods, e.g. `"smsmsmsmsmsm"` for MomentumSMoE-medium or
`"sgsgscscscsc"` for ACMoE-medium). Sources, read from the authors' scripts
(rachtsy/MomentumSMoE and Fsoft-AIC/Tight-Clusters-Make-Specialized-Experts
`scripts/pretraining/...`, and the CompeteSMoE scripts they started from)
and ACMoE's Table 8:

| setting | layers | D = inner | span | block | dropout | vocabulary | paper |
|---|---|---|---|---|---|---|---|
| switch_small | 3 x sg | 128 | 256 | 256 | 0.7 | 267,735 words | 70M |
| switch_medium | 6 x sg | 352 | 1024 | 512 | 0.1 | 267,735 | 216M |
| glam_small | 3 x sgsf | 144 | 2048 | 512 | 0.1 | 267,735 | 79M |
| glam_medium | 6 x sgsf | 352 | 2048 | 512 | 0.1 | 267,735 | 220M |
| smoe_large | 12 x sg | 512 | 1024 | 512 | 0.1 | 267,735 | 388M |
| enwik8 | 8 x sg | 352 | 2048 | 512 | 0.1 | 205 bytes | 36M |

All: 8 heads, 16 experts, top-2. `smoe_large` (MomentumSMoE Table 7) has no
public script: 12 layers of width 512 is the width that gives 388M (352
gives 242M); its span and block size are the medium model's. The EnWik-8
vocabulary is the distinct byte values of the prepared text, the newline
byte becoming `<eos>`; 205 assumes enwik8's commonly cited 205 distinct byte
values (the file is not on this machine), and each token more or less moves
the total by `2 * 352 + 1` parameters (0.002%).
`glam_small` as scripted (3 quadruples) counts 80.05M, 1.3% above the
paper's 79M (2 quadruples would give 79.17M); docs/language_model.md.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

import jax
import jax.numpy as jnp

WIKITEXT103_VOCAB = 267_735
ENWIK8_VOCAB = 205


@dataclasses.dataclass(frozen=True)
class LMSetting:
  """A paper setting: the model's fields and how it is fed.

  Attributes:
    model: `LanguageModel` keyword arguments.
    block_size: M, tokens per row per step (`--block-sz`).
    batch_size: rows per step (`--batch-sz`, over all devices).
    paper_parameters: the parameter count the papers report.
  """
  model: Mapping[str, Any]
  block_size: int
  batch_size: int
  paper_parameters: float


def _model(vocab: int, width: int, layers: int, span: int, base_arch: str,
           dropout: float) -> dict[str, Any]:
  return dict(vocab_size=vocab, hidden_size=width, inner_hidden_size=width,
              num_heads=8, num_layers=layers, attn_span=span,
              base_arch=base_arch, dropout_rate=dropout,
              moe={"num_experts": 16})


SETTINGS: dict[str, LMSetting] = {
    "switch_small": LMSetting(
        _model(WIKITEXT103_VOCAB, 128, 3, 256, "transformer", 0.7),
        block_size=256, batch_size=96, paper_parameters=70e6),
    "switch_medium": LMSetting(
        _model(WIKITEXT103_VOCAB, 352, 6, 1024, "transformer", 0.1),
        block_size=512, batch_size=48, paper_parameters=216e6),
    "glam_small": LMSetting(
        _model(WIKITEXT103_VOCAB, 144, 3, 2048, "glam", 0.1),
        block_size=512, batch_size=48, paper_parameters=79e6),
    "glam_medium": LMSetting(
        _model(WIKITEXT103_VOCAB, 352, 6, 2048, "glam", 0.1),
        block_size=512, batch_size=48, paper_parameters=220e6),
    "smoe_large": LMSetting(
        _model(WIKITEXT103_VOCAB, 512, 12, 1024, "transformer", 0.1),
        block_size=512, batch_size=48, paper_parameters=388e6),
    "enwik8": LMSetting(
        _model(ENWIK8_VOCAB, 352, 8, 2048, "transformer", 0.1),
        block_size=512, batch_size=48, paper_parameters=36e6),
    # Not a paper setting: a small GLaM (MoE and dense layers) for smoke
    # runs; swap letters for the other sub-layers.
    "tiny": LMSetting(
        dict(vocab_size=32, hidden_size=16, inner_hidden_size=16,
             num_heads=2, num_layers=2, attn_span=8, base_arch="glam",
             dropout_rate=0.1, moe={"num_experts": 4}),
        block_size=8, batch_size=4, paper_parameters=math.nan),
}


def count_parameters(model: Any, batch_size: int = 1, block_size: int = 1
                     ) -> int:
  """The number of parameters of a `LanguageModel`, from the shapes of its
  initialisation (`jax.eval_shape`: nothing is allocated)."""
  tokens = jax.ShapeDtypeStruct((batch_size, block_size), jnp.int32)
  cache = jax.eval_shape(lambda: model.zero_cache(batch_size))
  shapes = jax.eval_shape(model.init, jax.random.PRNGKey(0), tokens, cache)
  return sum(math.prod(leaf.shape)
             for leaf in jax.tree_util.tree_leaves(shapes["params"]))


__all__ = ["ENWIK8_VOCAB", "LMSetting", "SETTINGS", "WIKITEXT103_VOCAB",
           "count_parameters"]
