"""Mixed precision: the `model.dtype` and `model.param_dtype` fields.

Every backbone (`VisionTransformerMoe`, `SwinTransformerMoe`,
`LanguageModel`) has two fields:

    dtype         the compute dtype: the inputs and kernels of every
                  matmul, convolution and embedding are cast to it, and the
                  activations `[B, T, D]` between the blocks are in it.
    param_dtype   the dtype the parameters are stored (and, in training,
                  updated: the optimizer state follows the parameters) in.

Both are "float32" (the default: today's computation, bit for bit) or
"bfloat16". The usual mixed-precision run is `dtype="bfloat16"` with
`param_dtype="float32"`: bfloat16 matmuls, float32 weights and Adam moments.

What stays float32 whatever `dtype` says:

* router logits, their softmax / top-k scores and the auxiliary losses (every
  router computes in its own float32 `dtype`, `vmoe_ext.moe.contract`), the
  routers' persistent state (ACMoE's cluster statistics, Symphony's graph);
* LayerNorm statistics (flax's `LayerNorm` reduces in float32);
* the residual streams' state (momentum buffers, `stream_state`), which the
  backbone starts in float32 and each block keeps in float32;
* the logits the classifiers return (cast to at least float32 after the
  head, so the loss, the evaluation metrics and the attacks' gradient with
  respect to the float32 image see float32), and the language model's
  log-probabilities.

Parameters are created in float32 by every layer and cast once, at the end of
`init`, to `param_dtype` (`cast_params`): one place covers the backbone, the
experts, the routers and the streams alike. Applying a model to parameters of
another dtype is allowed (flax checks shapes, not dtypes): every layer casts
what it reads to its compute dtype, so a checkpoint trained in one precision
evaluates in the other.
"""

from __future__ import annotations

from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from vmoe_ext.errors import require
from vmoe_ext.moe.contract import at_least_float32

Array = jax.Array

# Config name -> dtype. float16 is left out: its 5-bit exponent needs loss
# scaling to train, which the train step does not do.
DTYPES: Mapping[str, Any] = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
PRECISION_FIELDS = ("dtype", "param_dtype")


def resolve_dtype(value: Any, field: str) -> Any:
  """The dtype `value` names: a `DTYPES` name, or a floating dtype object
  (tests compute in float64). Raises ConfigError naming `field` otherwise."""
  if isinstance(value, str):
    require(value in DTYPES, field,
            f"must be one of {tuple(DTYPES)}, got {value!r}")
    return DTYPES[value]
  try:
    floating = jnp.issubdtype(jnp.dtype(value), jnp.floating)
  except TypeError:
    floating = False
  require(floating, field,
          f"must be one of {tuple(DTYPES)}, got {value!r}")
  return value


def resolve_precision_fields(module: Any) -> None:
  """Sets a backbone's `dtype` and `param_dtype` (frozen dataclass fields,
  in its `__post_init__`) from their names ("bfloat16") to dtypes."""
  for field in PRECISION_FIELDS:
    object.__setattr__(module, field,
                       resolve_dtype(getattr(module, field), field))


def cast_params(variables: Mapping[str, Any], param_dtype: Any
                ) -> Mapping[str, Any]:
  """`variables` with the floating leaves of "params" in `param_dtype`.

  Other collections (router state, intermediates) are left as they are;
  float32 (the default) returns `variables` untouched.
  """
  if np.dtype(param_dtype) == np.float32 or "params" not in variables:
    return variables
  cast = lambda x: (x.astype(param_dtype)
                    if jnp.issubdtype(x.dtype, jnp.floating) else x)
  return {**variables, "params": jax.tree.map(cast, variables["params"])}


def float32_state(state: Any) -> Any:
  """A stream state with its narrower floating leaves in float32."""
  return jax.tree.map(at_least_float32, state)


def keep_dtypes(tree: Any, like: Any) -> Any:
  """`tree`'s leaves cast to the dtypes of `like`'s (same structure)."""
  return jax.tree.map(lambda x, y: x.astype(y.dtype), tree, like)


__all__ = ["DTYPES", "PRECISION_FIELDS", "at_least_float32", "cast_params",
           "float32_state", "keep_dtypes", "resolve_dtype",
           "resolve_precision_fields"]
