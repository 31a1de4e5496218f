"""The architecture string of the language-model backbone: which sub-layers
each layer has (docs/language_model.md, "Architecture string").

One letter per sub-layer, in order:

* `s` — attention over the cache plus the block (`seq_attention`);
* `g` — an MoE sub-layer with the model's router (`moe.router`);
* `m` — an MoE sub-layer through the model's residual stream
  (`stream`, heavy-ball momentum by default: MomentumSMoE);
* `a` — an MoE sub-layer through an adaptive first-layer stream (AdamSMoE by
  default): the Adam step in the first MoE layer, heavy-ball after it;
* `c` — an MoE sub-layer with the Adaptive Clustering router (`ac_router`),
  which reads the previous MoE layer's assignment, so an MoE letter must come
  before it;
* `f` — a dense feed-forward sub-layer.

A *layer* is one attention sub-layer and the sub-layer after it (the unit
that owns one cache entry). `base_arch="transformer"` (Switch) has
`num_layers` pairs `s?` with `?` an MoE letter; `base_arch="glam"` has
`num_layers` quadruples `s? s f` (an MoE layer, then a dense one), i.e.
`2 * num_layers` layers. Layers are numbered 0, 1, ... over the whole model;
that index is the layer's block index (`encoderblock_i`, `layer_i`).
Anything else is a `ConfigError` naming `architecture` (or `base_arch`).
"""

from __future__ import annotations

import dataclasses

from vmoe_ext.errors import require

BASE_ARCHS = ("transformer", "glam")
ATTENTION = "s"
DENSE = "f"
MOE_LETTERS = ("g", "m", "a", "c")
STREAM_LETTERS = ("m", "a")
LETTERS = (ATTENTION,) + MOE_LETTERS + (DENSE,)
# The letters of one unit of each base arch, as a pattern: "?" is an MoE
# letter, other characters must appear as they are.
UNITS = {"transformer": "s?", "glam": "s?sf"}


@dataclasses.dataclass(frozen=True)
class LayerSpec:
  """One layer: attention, then the sub-layer of letter `ffn`.

  Attributes:
    block: the layer's index over the model (0-based).
    ffn: the sub-layer letter after the attention: an MoE letter
      (`MOE_LETTERS`) or `f`.
  """
  block: int
  ffn: str

  @property
  def is_moe(self) -> bool:
    return self.ffn in MOE_LETTERS


def default_architecture(base_arch: str, num_layers: int) -> str:
  """The plain SMoE string: `"sg" * n` (transformer) or `"sgsf" * n`
  (glam)."""
  check_base_arch(base_arch)
  return UNITS[base_arch].replace("?", "g") * num_layers


def check_base_arch(base_arch: str) -> None:
  require(base_arch in BASE_ARCHS, "base_arch",
          f"must be one of {BASE_ARCHS}, got {base_arch!r}")


def parse_architecture(architecture: str, base_arch: str,
                       num_layers: int) -> tuple[LayerSpec, ...]:
  """The layers of `architecture` (see the module docstring).

  Raises:
    ConfigError naming `architecture` (or `base_arch`, `num_layers`) for an
    unknown base arch, a string of the wrong length, an unknown letter, a
    letter in the wrong place, a `c` before any MoE layer, or `m` and `a`
    in one model (they are two different residual streams).
  """
  check_base_arch(base_arch)
  require(isinstance(num_layers, int) and not isinstance(num_layers, bool)
          and num_layers > 0, "num_layers",
          f"must be a positive integer, got {num_layers!r}")
  require(isinstance(architecture, str), "architecture",
          f"must be a string of sub-layer letters {LETTERS}, got "
          f"{architecture!r}")
  unit = UNITS[base_arch]
  expected = len(unit) * num_layers
  require(len(architecture) == expected, "architecture",
          f"{architecture!r} has {len(architecture)} letters; "
          f"base_arch={base_arch!r} with num_layers={num_layers} needs "
          f"{expected} ({num_layers} x {unit!r}, '?' an MoE letter "
          f"{MOE_LETTERS})")
  for i, letter in enumerate(architecture):
    require(letter in LETTERS, "architecture",
            f"unknown letter {letter!r} at position {i} of {architecture!r}; "
            f"letters: {LETTERS} (s attention, g MoE, m momentum MoE, "
            "a Adam MoE, c AC MoE, f dense)")
    want = unit[i % len(unit)]
    if want == "?":
      require(letter in MOE_LETTERS, "architecture",
              f"position {i} of {architecture!r} must be an MoE letter "
              f"{MOE_LETTERS} (base_arch={base_arch!r} layers are "
              f"{unit!r}), got {letter!r}")
    else:
      require(letter == want, "architecture",
              f"position {i} of {architecture!r} must be {want!r} "
              f"(base_arch={base_arch!r} layers are {unit!r}), got "
              f"{letter!r}")
  specs = tuple(LayerSpec(block=j, ffn=architecture[2 * j + 1])
                for j in range(len(architecture) // 2))
  first_moe = next(s for s in specs if s.is_moe)
  require(first_moe.ffn != "c", "architecture",
          f"{architecture!r}: the first MoE layer (block {first_moe.block}) "
          "is 'c', but an AC layer clusters tokens by the previous MoE "
          "layer's experts; put an MoE letter (g, m, a) before it")
  used = {s.ffn for s in specs}
  require(not {"m", "a"} <= used, "architecture",
          f"{architecture!r} mixes 'm' and 'a': both go through the model's "
          "one residual stream ('a' for an adaptive first-layer stream such "
          "as AdamSMoE, 'm' for the others); use one of them")
  return specs


def moe_blocks(specs: tuple[LayerSpec, ...]) -> tuple[int, ...]:
  """The block indices of the MoE layers."""
  return tuple(s.block for s in specs if s.is_moe)


def blocks_of(specs: tuple[LayerSpec, ...], letters: str) -> tuple[int, ...]:
  """The block indices of the layers whose sub-layer letter is in
  `letters`."""
  return tuple(s.block for s in specs if s.ffn in letters)


__all__ = ["ATTENTION", "BASE_ARCHS", "DENSE", "LETTERS", "LayerSpec",
           "MOE_LETTERS", "STREAM_LETTERS", "blocks_of", "check_base_arch",
           "default_architecture", "moe_blocks", "parse_architecture"]
