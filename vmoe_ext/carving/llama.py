"""Carving the SwiGLU MLPs of a LLaMA decoder into CMoE layers
(docs/carving.md, "Decoder language models").

    config, params = load_llama("path/to/hf_llama")        # models.llama
    windows = calibration_windows(train_ids, 8, 2048, seed=0)
    result = carve_llama(config, params, windows, spec)    # spec: CarveSpec
    model = carved_llama(config, spec)                     # LlamaDecoder
    logits, _ = model.apply({"params": result.params,
                             **result.collections}, tokens)

Layer i's calibration tokens are the outputs of its
`post_attention_layernorm` (the MLP's inputs) on every token of the
calibration windows, computed by the model whose layers before i are
already carved. The carved layers are `MoeLayer`s with the `moe` dict of
`carved_moe_config` (shared experts, `output_bias="once"`, the `cmoe` router
with the SwiGLU score `|silu(x W_gate,R) * (x W_up,R)|`, dropless capacity
by default, one sequence per routing group); every other parameter is the
dense model's.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Mapping, Optional

import jax
import numpy as np

from vmoe_ext.carving.decoder import (capture_filter, captured,
                                      carve_in_sequence, fill_fresh,
                                      with_carved)
from vmoe_ext.carving.layer import CarvedLayer
from vmoe_ext.carving.model import CarveResult
from vmoe_ext.carving.spec import CarveSpec, carved_moe_config
from vmoe_ext.models.llama import LlamaConfig, LlamaDecoder
from vmoe_ext.naming import param_name

Params = dict[str, Any]
ACTIVATION = "swiglu"
HIDDEN_FIELD = "config.json:intermediate_size"


def llama_blocks(config: LlamaConfig, spec: CarveSpec) -> tuple[int, ...]:
  """Checks `spec` against the LLaMA's sizes (errors name `carve.*`) and
  returns the carved layers (`carve.layers/every/last` over its
  `num_hidden_layers`)."""
  spec.check_options(config.intermediate_size, HIDDEN_FIELD)
  return spec.blocks(config.num_hidden_layers)


def carved_llama(config: LlamaConfig, spec: CarveSpec,
                 blocks: Optional[tuple[int, ...]] = None) -> LlamaDecoder:
  """The `LlamaDecoder` with `blocks` (default: `spec`'s) carved."""
  if blocks is None:
    blocks = llama_blocks(config, spec)
  moe = carved_moe_config(spec, blocks, config.intermediate_size,
                          ACTIVATION)
  return LlamaDecoder(config, moe_layers=tuple(blocks), moe=moe)


def carve_llama(config: LlamaConfig, params: Params, windows: np.ndarray,
                spec: CarveSpec, *,
                progress: Optional[Callable[[int, CarvedLayer, float], None]]
                = None) -> CarveResult:
  """Carves the dense LLaMA `params` (module doc).

  Args:
    config: the checkpoint's config.
    params: its `LlamaDecoder` params (`load_llama`).
    windows: `[N, L]` calibration token windows (`calibration_windows`;
      unused by the random split).
    spec: the carve options (`checkpoint_dir` unused here).
    progress: called after each layer with `(layer, grouping, seconds)`.

  Returns:
    The carved params and router state; `model` is `{"moe_layers",
    "moe"}` of `carved_llama`.
  """
  start = time.perf_counter()
  blocks = llama_blocks(config, spec)
  params = jax.tree.map(np.asarray, params)
  windows = np.asarray(windows, np.int32)

  def capture(block: int, carved: Mapping[int, Params]) -> np.ndarray:
    model = carved_llama(config, spec, tuple(carved))
    path = (param_name(block), "post_attention_layernorm")

    @jax.jit
    def run(p, tokens):
      _, state = model.apply(
          {"params": p}, tokens, capture_intermediates=capture_filter(path),
          mutable=["intermediates", "router_state"])  # Bias: its init, 0.
      out = captured(state, path)
      return out.reshape(-1, out.shape[-1])

    p = with_carved(params, carved)
    return np.concatenate([
        np.asarray(run(p, windows[i:i + spec.batch_size]))
        for i in range(0, len(windows), spec.batch_size)]).astype(np.float64)

  mlps = {b: params[param_name(b)]["Mlp"] for b in blocks}
  moe, layers, seconds = carve_in_sequence(blocks, mlps, capture, spec,
                                           ACTIVATION, progress=progress)
  model = carved_llama(config, spec, blocks)
  carved, collections = fill_fresh(
      model, (np.zeros((1, 2), np.int32),),
      {"params": with_carved(params, moe)}, spec.seed)
  return CarveResult({"moe_layers": blocks, "moe": dict(model.moe)}, carved,
                     collections, layers, seconds,
                     time.perf_counter() - start)


__all__ = ["ACTIVATION", "carve_llama", "carved_llama", "llama_blocks"]
