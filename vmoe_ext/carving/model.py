"""Carving a dense ViT into a V-MoE, block by block (CMoE; docs/carving.md,
"The algorithm").

Blocks are carved in increasing order, each calibrated on the output of the
blocks already carved: block i's calibration tokens are the inputs of its
MLP (the output of its `LayerNorm_1`, every token of every calibration
image, class token included) computed by the partially carved model whose
blocks before i are already MoE layers. The random split needs no
calibration; its routers keep a fresh (seeded) initialisation.

The result is the params and router state of `carved_model_config(model,
spec)`; every parameter outside the carved MLPs is the dense model's.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Mapping, Optional

import flax
import jax
import numpy as np

from vmoe_ext.carving.layer import (CarvedLayer, carve_mlp, moe_params,
                                    random_split)
from vmoe_ext.carving.spec import CarveSpec, carved_model_config
from vmoe_ext.models import build_model
from vmoe_ext.naming import param_name

Params = dict[str, Any]


@dataclasses.dataclass
class CarveResult:
  """A carved model.

  Attributes:
    model: the carved `vit_moe` model config.
    params: its params (numpy leaves).
    collections: its non-parameter variables (the router state: the CMoE
      balancing bias, 0).
    layers: block index -> the `CarvedLayer` grouping.
    seconds: block index -> wall time of that block (profiling, grouping,
      slicing; calibration forward included).
    total_seconds: the whole carving's wall time.
  """
  model: dict[str, Any]
  params: Params
  collections: dict[str, Any]
  layers: dict[int, CarvedLayer]
  seconds: dict[int, float]
  total_seconds: float


def _host(tree: Any) -> Any:
  return jax.tree.map(np.asarray, flax.core.unfreeze(tree))


def ffn_inputs(model_config: Mapping[str, Any], params: Params,
               images: np.ndarray, block: int, batch_size: int,
               on_batch: Optional[Callable[[], None]] = None) -> np.ndarray:
  """`[N*T, D]` the inputs of block `block`'s MLP (its `LayerNorm_1`
  output) on `images` `[N, H, W, C]`, in batches of `batch_size`
  (`on_batch()` after each)."""
  model = build_model(model_config)
  path = (param_name(block), "LayerNorm_1")

  @jax.jit
  def capture(p, x):
    _, state = model.apply(
        {"params": p}, x, capture_intermediates=(
            lambda mdl, method: method == "__call__" and mdl.scope is not None
            and tuple(mdl.scope.path) == path),
        mutable=["intermediates", "router_state"])  # Bias: its init, 0.
    out = state["intermediates"][path[0]][path[1]]["__call__"][0]
    return out.reshape(-1, out.shape[-1])

  chunks = []
  for i in range(0, len(images), batch_size):
    chunks.append(np.asarray(capture(params, images[i:i + batch_size])))
    if on_batch is not None:
      on_batch()
  return np.concatenate(chunks).astype(np.float64)


def _with_blocks(model: Mapping[str, Any], spec: CarveSpec,
                 blocks: tuple[int, ...]) -> dict[str, Any]:
  """The model with only `blocks` carved so far (the dense model if none)."""
  if not blocks:
    return dict(model)
  partial = dataclasses.replace(spec, layers=blocks, every=None, last=None)
  return carved_model_config(model, partial)


def carve_vit(model: Mapping[str, Any], params: Params, images: np.ndarray,
              spec: CarveSpec, *,
              progress: Optional[Callable[[int, CarvedLayer, float], None]]
              = None,
              on_batch: Optional[Callable[[], None]] = None) -> CarveResult:
  """Carves the dense ViT `model` with `params` (module doc).

  Args:
    model: the dense model config (checked by `spec.check` beforehand).
    params: its params.
    images: `[N, H, W, C]` preprocessed calibration images (unused by the
      random split).
    spec: the carve section.
    progress: called after each block with `(block, layer, seconds)`.
    on_batch: called after each calibration forward pass (profiling).
  """
  start = time.perf_counter()
  params = _host(params)
  activation = model.get("mlp_activation", "gelu")
  blocks = spec.blocks(model["num_layers"])
  carved: dict[int, CarvedLayer] = {}
  seconds: dict[int, float] = {}
  for block in blocks:
    t0 = time.perf_counter()
    name = param_name(block)
    mlp = params[name]["Mlp"]
    hidden = np.shape(mlp["Dense_0"]["kernel"])[-1]
    if spec.method == "random":
      layer = random_split(hidden, num_experts=spec.num_experts,
                           num_shared=spec.num_shared, seed=spec.seed + block)
    else:
      x = ffn_inputs(_with_blocks(model, spec, tuple(carved)), params,
                     images, block, spec.batch_size, on_batch)
      layer = carve_mlp(mlp, x, num_experts=spec.num_experts,
                        num_shared=spec.num_shared, activation=activation,
                        activation_markers_k=spec.activation_markers,
                        distance=spec.distance, iterations=spec.iterations,
                        normalize=spec.normalize)
    block_params = {k: v for k, v in params[name].items() if k != "Mlp"}
    block_params["Moe"] = moe_params(mlp, layer, activation)
    params = {**params, name: block_params}
    carved[block] = layer
    seconds[block] = time.perf_counter() - t0
    if progress is not None:
      progress(block, layer, seconds[block])
  config = carved_model_config(model, spec)
  fresh = _fresh_variables(config, images[:1], spec.seed)
  params = _fill_fresh(params, fresh.pop("params"))
  return CarveResult(config, params, fresh, carved, seconds,
                     time.perf_counter() - start)


def _fresh_variables(config: Mapping[str, Any], sample: np.ndarray,
                     seed: int) -> dict[str, Any]:
  """The carved model's initial variables (shapes only, plus the values of
  what carving leaves fresh: a random split's routers, the router state)."""
  model = build_model(config)
  variables = jax.jit(model.init)(jax.random.key(seed), sample)
  variables = _host(variables)
  variables.pop("intermediates", None)
  return variables


def _fill_fresh(carved: Params, fresh: Params, path: str = "") -> Params:
  """`fresh` with every leaf that `carved` has replaced by carved's (shapes
  and dtypes must agree); leaves only `fresh` has stay fresh."""
  out = {}
  for key, value in fresh.items():
    here = f"{path}/{key}" if path else key
    if isinstance(value, Mapping):
      out[key] = _fill_fresh(carved.get(key, {}), value, here)
    elif key in carved:
      new = np.asarray(carved[key])
      if new.shape != np.shape(value):
        raise ValueError(f"carved {here} has shape {new.shape}, the carved "
                         f"model expects {np.shape(value)}")
      out[key] = new.astype(np.asarray(value).dtype)
    else:
      out[key] = value
  extra = sorted(set(carved) - set(fresh))
  if extra:
    raise ValueError(f"carved params {path}/{extra[0]} are not in the carved "
                     "model")
  return out
