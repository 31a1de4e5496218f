"""Carving the MLPs of a decoder language model, layer by layer (CMoE on a
LLaMA or on our language model; docs/carving.md, "Decoder language
models").

The machinery every decoder shares:

* `calibration_windows`: the calibration text, as the CMoE paper takes it
  (the GPTQ data loader of the authors' code): `N` windows of `L`
  consecutive tokens of the training stream at seeded random offsets in
  `[0, len - L - 1]` (the paper: 8 windows of 2,048 WikiText-2 tokens);
* `capture_output`: one module's output inside a model's forward pass
  (the inputs of a layer's MLP are its pre-MLP norm's output);
* `carve_in_sequence`: layers carved in increasing order, layer i profiled
  on the MLP inputs that the model with layers < i already carved computes
  (as the ViT's blocks, `vmoe_ext.carving.model`), each MLP cut by
  `carve_mlp` / `random_split` and `moe_params` into an `MoeLayer`'s
  params, so a carved decoder layer is exactly what a carved ViT block is;
* `fill_fresh`: the carved model's variables: the carved params where
  carving made them, the dense model's elsewhere, and for the rest (the
  CMoE balancing bias, 0; a random split's fresh router) the carved model's
  own initialisation, computed without materialising the other parameters.

The backbone adapters are `vmoe_ext.carving.llama` and
`vmoe_ext.carving.language`.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Mapping, Optional, Sequence

import flax
import flax.linen as nn
import jax
import numpy as np
from flax import traverse_util

from vmoe_ext.carving.layer import (CarvedLayer, carve_mlp, moe_params,
                                    random_split)
from vmoe_ext.carving.spec import CarveSpec
from vmoe_ext.errors import require
from vmoe_ext.naming import param_name

Params = dict[str, Any]
# capture(block, carved) -> the MLP inputs `[N, D]` of `block` in the model
# whose layers `carved` (block -> `Moe` params) are already carved.
Capture = Callable[[int, Mapping[int, Params]], np.ndarray]


def calibration_windows(ids: np.ndarray, count: int, length: int, seed: int,
                        *, field: str = "carve.sequence_length"
                        ) -> np.ndarray:
  """`[count, length]` windows of the stream `ids` `[N]` at offsets drawn
  uniformly from `[0, N - length - 1]` by `numpy.random.default_rng(seed)`
  (windows may overlap, as the authors' sampler)."""
  ids = np.asarray(ids)
  require(ids.ndim == 1, "ids", f"must be a stream [N], got {ids.shape}")
  require(isinstance(length, int) and 1 <= length < len(ids), field,
          f"must be an integer in 1..{len(ids) - 1} (the calibration "
          f"stream has {len(ids)} tokens), got {length!r}")
  require(isinstance(count, int) and count >= 1, "carve.num_calibration",
          f"must be an integer >= 1 (calibration windows), got {count!r}")
  offsets = np.random.default_rng(seed).integers(0, len(ids) - length,
                                                 size=count)
  return np.stack([ids[o:o + length] for o in offsets]).astype(np.int32)


def capture_filter(path: Sequence[str]) -> Callable[[nn.Module, str], bool]:
  """`capture_intermediates` filter keeping the `__call__` output of the
  module at scope `path`."""
  path = tuple(path)
  return lambda mdl, method: (method == "__call__" and mdl.scope is not None
                              and tuple(mdl.scope.path) == path)


def captured(state: Mapping[str, Any], path: Sequence[str]) -> Any:
  """The output `capture_filter(path)` kept in `state["intermediates"]`."""
  node = state["intermediates"]
  for key in path:
    node = node[key]
  return node["__call__"][0]


def host(tree: Any) -> Any:
  return jax.tree.map(np.asarray, flax.core.unfreeze(tree))


def carve_in_sequence(blocks: Sequence[int], mlps: Mapping[int, Params],
                      capture: Capture, spec: CarveSpec, activation: str, *,
                      progress: Optional[Callable[[int, CarvedLayer, float],
                                                  None]] = None
                      ) -> tuple[dict[int, Params], dict[int, CarvedLayer],
                                 dict[int, float]]:
  """Carves the dense MLPs `mlps[block]` (`Dense_0`, `Dense_up`,
  `Dense_1` params) of `blocks` in increasing order (module doc).

  Returns, per block: the `Moe` params, the grouping, the seconds taken
  (calibration forward included). `progress(block, layer, seconds)` after
  each.
  """
  moe: dict[int, Params] = {}
  layers: dict[int, CarvedLayer] = {}
  seconds: dict[int, float] = {}
  for block in sorted(blocks):
    t0 = time.perf_counter()
    mlp = mlps[block]
    hidden = np.shape(mlp["Dense_0"]["kernel"])[-1]
    if spec.method == "random":
      layer = random_split(hidden, num_experts=spec.num_experts,
                           num_shared=spec.num_shared, seed=spec.seed + block)
    else:
      layer = carve_mlp(mlp, capture(block, dict(moe)),
                        num_experts=spec.num_experts,
                        num_shared=spec.num_shared, activation=activation,
                        activation_markers_k=spec.activation_markers,
                        distance=spec.distance, iterations=spec.iterations,
                        normalize=spec.normalize)
    moe[block] = moe_params(mlp, layer, activation)
    layers[block] = layer
    seconds[block] = time.perf_counter() - t0
    if progress is not None:
      progress(block, layer, seconds[block])
  return moe, layers, seconds


def with_carved(params: Params, moe: Mapping[int, Params]) -> Params:
  """`params` with the `Mlp` of every block in `moe` replaced by its `Moe`
  params (the other entries of the block kept)."""
  out = dict(params)
  for block, value in moe.items():
    name = param_name(block)
    out[name] = {**{k: v for k, v in params[name].items() if k != "Mlp"},
                 "Moe": value}
  return out


def fill_fresh(model: nn.Module, init_args: Sequence[Any],
               variables: Mapping[str, Any], seed: int
               ) -> tuple[Params, dict[str, Any]]:
  """The params and other collections of `model` (`model.init(key,
  *init_args)`, intermediates dropped): `variables` (`{"params": ...,
  "router_state": ...}`) wherever it has a leaf (shapes must agree; dtypes
  become the model's), the model's initialisation for the others. Only
  those are computed: the jitted init returns nothing else, so the compiler
  drops the rest."""
  key = jax.random.key(seed)
  shapes = jax.eval_shape(lambda k: model.init(k, *init_args), key)
  shapes = {k: v for k, v in flax.core.unfreeze(shapes).items()
            if k != "intermediates"}
  flat = traverse_util.flatten_dict(shapes)
  given = traverse_util.flatten_dict(flax.core.unfreeze(dict(variables)))
  extra = sorted("/".join(p) for p in given if p not in flat)
  if extra:
    raise ValueError(f"carved variables {extra[0]} are not in the carved "
                     "model")
  missing = [p for p in flat if p not in given]

  def pick(k):
    values = traverse_util.flatten_dict(
        flax.core.unfreeze(model.init(k, *init_args)))
    return [values[p] for p in missing]

  fresh = dict(zip(missing, host(jax.jit(pick)(key)))) if missing else {}
  out = {}
  for path, shape in flat.items():
    if path in fresh:
      out[path] = fresh[path]
      continue
    value = np.asarray(given[path])
    if value.shape != tuple(shape.shape):
      raise ValueError(f"carved {'/'.join(path)} has shape {value.shape}, "
                       f"the carved model expects {tuple(shape.shape)}")
    out[path] = value.astype(shape.dtype)
  out = traverse_util.unflatten_dict(out)
  return out.pop("params"), out


__all__ = ["Capture", "calibration_windows", "capture_filter", "captured",
           "carve_in_sequence", "fill_fresh", "host", "with_carved"]
