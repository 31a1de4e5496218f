"""The authors' initialisation of the language-model backbone's feed-forward
parameters (docs/language_model.md, "Initialisation").

The shared building blocks initialise as vmoe does (expert and dense-MLP
kernels Xavier-uniform and biases `N(0, 1e-6)`; the linear gate's kernel
LeCun-normal, its bias zero). The authors' torch code initialises them
differently; `authors_initialization` redraws them after `init`:

* `Moe/Mlp/Dense_{0,1}/kernel` `[E, in, out]`: fastmoe's `FMoELinear`
  draws `kaiming_uniform_(a=sqrt(5))` on a `[E, out, in]` tensor, whose
  torch fan-in is `out * in`: here `U(+-1/sqrt(in * out))`;
* `Moe/Mlp/Dense_{0,1}/bias`: zeros (fastmoe leaves them at zero);
* `Moe/router/.../logits/dense/{kernel,bias}` `[D, E]`, the linear gate
  (`nn.Linear(D, E)`): `U(+-1/sqrt(D))`, kernel and bias;
* `Mlp/Dense_{0,1}/{kernel,bias}` `[in, out]`, the dense FFN
  (`nn.Linear(in, out)`): `U(+-1/sqrt(in))`, kernel and bias.

Everything else keeps the initialiser its module gives it: the backbone's
own modules already follow torch (embedding and `key_pe` `N(0, 1)`,
projections and output layer `U(+-1/sqrt(in))`, LayerNorms ones/zeros);
the parameters of the other routers (XMoE's projection and embeddings, ...)
keep our routers' initialisers.
"""

from __future__ import annotations

import math
import re
from typing import Any, Callable, Optional

import flax
import jax
import jax.numpy as jnp

Array = jax.Array

_EXPERT = re.compile(r"(^|/)Moe/Mlp/Dense_[01]/(kernel|bias)$")
_GATE = re.compile(r"(^|/)Moe/router/(base/)*logits/dense/(kernel|bias)$")
_DENSE = re.compile(r"(^|/)Mlp/Dense_[01]/(kernel|bias)$")


def _uniform(bound: float) -> Callable[[Array, tuple[int, ...], Any], Array]:
  return lambda key, shape, dtype: jax.random.uniform(
      key, shape, dtype, -bound, bound)


def _rule(path: str, shapes: dict[str, tuple[int, ...]]
          ) -> Optional[Callable[[Array, tuple[int, ...], Any], Array]]:
  """The authors' initialiser of the parameter at `path` (None: keep)."""
  kernel = shapes.get(path.rsplit("/", 1)[0] + "/kernel")
  if _EXPERT.search(path):
    if path.endswith("bias"):
      return lambda key, shape, dtype: jnp.zeros(shape, dtype)
    return _uniform(1.0 / math.sqrt(kernel[-2] * kernel[-1]))
  if _GATE.search(path) or _DENSE.search(path):
    return _uniform(1.0 / math.sqrt(kernel[0]))
  return None


def authors_initialization(params: Any, key: Array) -> Any:
  """`params` with the parameters of the table above redrawn from `key`
  (one key per parameter, `fold_in` of its position in the sorted paths)."""
  flat = flax.traverse_util.flatten_dict(params, sep="/")
  shapes = {path: tuple(value.shape) for path, value in flat.items()}
  out = {}
  for i, path in enumerate(sorted(flat)):
    value = flat[path]
    rule = _rule(path, shapes)
    out[path] = value if rule is None else rule(
        jax.random.fold_in(key, i), value.shape, value.dtype)
  return flax.traverse_util.unflatten_dict(out, sep="/")


__all__ = ["authors_initialization"]
