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
    nonfinite_count: int32 scalar, number of steps whose loss or gradient was
      not finite (their updates were skipped, see `commit`).
    first_nonfinite_step: int32 scalar, the step number (1-based: the value
      `step` took after it) of the first such step; 0 while there is none.
    tx: the optax transformation (static, not part of the pytree).
  """
  step: Array
  params: Any
  opt_state: Any
  collections: Any
  rng: Array
  nonfinite_count: Array
  first_nonfinite_step: Array
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
               rng=jax.random.key_data(rng),
               nonfinite_count=jnp.zeros((), jnp.int32),
               first_nonfinite_step=jnp.zeros((), jnp.int32), tx=tx)

  @classmethod
  def for_evaluation(cls, params: Any, collections: Any,
                     step: int = 0) -> "TrainState":
    """Params and collections only, for `make_eval_step` and `variables()`:
    no optimizer (`opt_state` None, `tx` the identity), zero counters."""
    zero = jnp.zeros((), jnp.int32)
    return cls(step=jnp.asarray(step, jnp.int32), params=params,
               opt_state=None, collections=dict(collections),
               rng=jnp.zeros((2,), jnp.uint32), nonfinite_count=zero,
               first_nonfinite_step=zero, tx=optax.identity())

  def step_key(self) -> Array:
    """The typed PRNG key of the current step."""
    return jax.random.fold_in(jax.random.wrap_key_data(self.rng), self.step)

  def variables(self) -> dict:
    return {"params": self.params, **self.collections}

  def commit(self, updated: "TrainState", finite: Array) -> "TrainState":
    """The state after one step: `updated` if `finite`, else this one.

    Traceable (no host sync): `finite` is a bool scalar array. The step always
    advances; on a non-finite step params, optimizer state and collections
    stay as they were (one `lax.cond` picks the whole tree, so a finite step
    returns exactly `updated`'s values) and the step is counted in
    `nonfinite_count` / `first_nonfinite_step`.
    """
    step = self.step + 1
    bad = jnp.logical_not(finite)
    # One conditional, not a select per leaf: XLA would fuse the reduction
    # behind `finite` into every leaf's select (hundreds of copies, a 6x
    # larger program that compiles 5x slower).
    params, opt_state, collections = jax.lax.cond(
        finite, lambda new, old: new, lambda new, old: old,
        (updated.params, updated.opt_state, updated.collections),
        (self.params, self.opt_state, self.collections))
    return self.replace(
        step=step, params=params, opt_state=opt_state,
        collections=collections,
        nonfinite_count=self.nonfinite_count + bad.astype(jnp.int32),
        first_nonfinite_step=jnp.where(
            bad & (self.nonfinite_count == 0), step,
            self.first_nonfinite_step).astype(jnp.int32))
