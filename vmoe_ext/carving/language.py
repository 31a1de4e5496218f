"""Carving the dense ReLU `f` sub-layers of our language model into CMoE
layers (docs/carving.md, "Decoder language models").

    result = carve_language_model(model, variables, windows, spec,
                                  block_size=M)
    carved = carved_language_model(model, spec)     # CarvedLanguageModel
    log_probs, cache, _ = carved.apply({"params": result.params,
                                        **result.collections}, tokens, cache)

Shape letters: N calibration windows, L window length, M tokens per block.

The carved layers are the GLaM backbone's dense `f` layers: `carve.layers`
lists block indices (each must be an `f` layer), `carve.every` /
`carve.last` count among the `f` layers (default: all of them). The MoE
layers the model already has are left as they are.

Calibration (the paper's practice on the model's own data): N windows of L
tokens of the training stream (`calibration_windows`), each run as one row
from zero caches through its L / M consecutive blocks of M tokens with the
caches carried, as the evaluation runs a stream; the calibration tokens of
layer i are the inputs of its MLP (the output of its `LayerNorm_attention`)
at every position, computed by the model whose layers before i are already
carved. The carved `moe` dict is `carved_moe_config`'s (ReLU, `cmoe` router
with the ReLU score `|relu(x W_R)|`, dropless capacity by default) with
dropout after the expert activation only, as the dense `f` MLP.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Mapping, Optional

import jax
import numpy as np

from vmoe_ext.carving.decoder import (capture_filter, captured,
                                      carve_in_sequence, fill_fresh, host,
                                      with_carved)
from vmoe_ext.carving.layer import CarvedLayer
from vmoe_ext.carving.model import CarveResult
from vmoe_ext.carving.spec import CarveSpec, carved_moe_config
from vmoe_ext.errors import require
from vmoe_ext.models.language import LanguageModel
from vmoe_ext.models.lm_arch import DENSE
from vmoe_ext.models.lm_carved import CarvedLanguageModel
from vmoe_ext.naming import param_name

Params = dict[str, Any]
ACTIVATION = "relu"
HIDDEN_FIELD = "model.inner_hidden_size"


def dense_blocks(model: LanguageModel) -> tuple[int, ...]:
  """The block indices of the model's dense `f` layers."""
  return tuple(s.block for s in model.layers if s.ffn == DENSE)


def lm_blocks(model: LanguageModel, spec: CarveSpec) -> tuple[int, ...]:
  """Checks `spec` against the model (errors name `carve.*` or the model
  field) and returns the carved blocks (module doc)."""
  dense = dense_blocks(model)
  require(dense, "model.base_arch",
          f"the architecture {model.architecture!r} has no dense 'f' layer "
          "to carve (GLaM layouts, base_arch='glam', have them)")
  spec.check_options(model.inner_hidden_size, HIDDEN_FIELD)
  if spec.layers is not None:
    bad = [b for b in spec.layers if b not in dense]
    require(not bad and len(spec.layers) > 0, "carve.layers",
            f"must list dense 'f' layers of {model.architecture!r} (blocks "
            f"{dense}), got {tuple(spec.layers)}")
    return tuple(sorted(set(spec.layers)))
  return tuple(dense[i] for i in spec.blocks(len(dense)))


def carved_language_model(model: LanguageModel, spec: CarveSpec,
                          blocks: Optional[tuple[int, ...]] = None
                          ) -> CarvedLanguageModel:
  """The dense `model` with `blocks` (default: `spec`'s) carved."""
  if blocks is None:
    blocks = lm_blocks(model, spec)
  moe = carved_moe_config(spec, blocks, model.inner_hidden_size, ACTIVATION)
  moe.update(dropout_output=False)
  fields = {f.name: getattr(model, f.name)
            for f in dataclasses.fields(LanguageModel)
            if f.name not in ("parent", "name")}
  return CarvedLanguageModel(**fields, carved_layers=tuple(blocks),
                             carved_moe=moe)


def carve_language_model(model: LanguageModel,
                         variables: Mapping[str, Any], windows: np.ndarray,
                         spec: CarveSpec, *, block_size: int,
                         progress: Optional[Callable[[int, CarvedLayer,
                                                      float], None]] = None
                         ) -> CarveResult:
  """Carves the dense `f` layers of `model` (module doc).

  Args:
    model: the dense `LanguageModel`.
    variables: its `params` and other collections (a router's state).
    windows: `[N, L]` calibration windows, L a multiple of `block_size`
      (unused by the random split).
    spec: the carve options (`checkpoint_dir` unused here).
    block_size: M, tokens per block.
    progress: called after each layer with `(block, grouping, seconds)`.

  Returns:
    The carved params and collections (the dense model's router state,
    the carved routers' bias 0); `model` is `{"carved_layers",
    "carved_moe"}` of `carved_language_model`.
  """
  start = time.perf_counter()
  blocks = lm_blocks(model, spec)
  windows = np.asarray(windows, np.int32)
  require(isinstance(block_size, int) and block_size >= 1
          and windows.shape[1] % block_size == 0, "carve.sequence_length",
          f"the calibration windows' length {windows.shape[1]} must be a "
          f"multiple of the block size data.block_size={block_size}")
  variables = host(variables)
  params = variables["params"]
  collections = {k: v for k, v in variables.items()
                 if k not in ("params", "intermediates")}

  def capture(block: int, carved: Mapping[int, Params]) -> np.ndarray:
    partial = carved_language_model(model, spec, tuple(carved))
    path = (param_name(block), "LayerNorm_attention")

    @jax.jit
    def run(v, tokens, cache):
      (_, cache, _), state = partial.apply(
          v, tokens, cache, capture_intermediates=capture_filter(path),
          mutable=["intermediates", "router_state"])  # Bias: its init, 0.
      out = captured(state, path)
      return cache, out.reshape(-1, out.shape[-1])

    v = {"params": with_carved(params, carved), **collections}
    chunks = []
    for i in range(0, len(windows), spec.batch_size):
      rows = windows[i:i + spec.batch_size]
      cache = partial.zero_cache(len(rows))
      for p in range(0, rows.shape[1], block_size):
        cache, x = run(v, rows[:, p:p + block_size], cache)
        chunks.append(np.asarray(x))
    return np.concatenate(chunks).astype(np.float64)

  mlps = {b: params[param_name(b)]["Mlp"] for b in blocks}
  moe, layers, seconds = carve_in_sequence(blocks, mlps, capture, spec,
                                           ACTIVATION, progress=progress)
  carved_model = carved_language_model(model, spec, blocks)
  sample = np.zeros((1, block_size), np.int32)
  carved, collections = fill_fresh(
      carved_model, (sample, carved_model.zero_cache(1)),
      {"params": with_carved(params, moe), **collections}, spec.seed)
  return CarveResult({"carved_layers": blocks,
                      "carved_moe": dict(carved_model.carved_moe)},
                     carved, collections, layers, seconds,
                     time.perf_counter() - start)


__all__ = ["ACTIVATION", "carve_language_model", "carved_language_model",
           "dense_blocks", "lm_blocks"]
