"""The train state: everything a run needs to continue exactly where it stopped."""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax

Array = jax.Array


@flax.struct.dataclass
class TrainState:
  """Params, optimizer state, non-parameter collections, RNG and step.

  Attributes:
    step: int32 scalar, number of optimizer updates applied.
    params: the model parameters.
    opt_state: the optax optimizer state.
    collections: non-parameter variable collections that training mutates
      (e.g. "router_state"); `{}` for models without any.
    rng: `uint32[2]` raw key data (`jax.random.key_data`), so the state can be
      checkpointed; per-step keys are `fold_in(wrap_key_data(rng), step)`.
    tx: the optax transformation (static, not part of the pytree).
  """
  step: Array
  params: Any
  opt_state: Any
  collections: Any
  rng: Array
  tx: optax.GradientTransformation = flax.struct.field(pytree_node=False)

  @classmethod
  def create(cls, variables: dict, tx: optax.GradientTransformation,
             rng: Array) -> "TrainState":
    """State at step 0 from `model.init` variables and a typed PRNG key."""
    variables = dict(variables)
    params = variables.pop("params")
    variables.pop("intermediates", None)
    return cls(step=jnp.zeros((), jnp.int32), params=params,
               opt_state=tx.init(params), collections=variables,
               rng=jax.random.key_data(rng), tx=tx)

  def step_key(self) -> Array:
    """The typed PRNG key of the current step."""
    return jax.random.fold_in(jax.random.wrap_key_data(self.rng), self.step)

  def variables(self) -> dict:
    return {"params": self.params, **self.collections}
