"""What a router returns: which token goes to which expert with which weight.

Three forms cover every router in the project:

* `TokenChoiceRouting` — each token picks up to K experts (V-MoE top-k, XMoE,
  ACMoE, Symphony, top-p). Capacity and dropping are decided by the dispatcher.
* `ExpertChoiceRouting` — each expert picks its C tokens (Zhou et al. 2022).
* `SoftRouting` — dense dispatch/combine weights over P slots per expert
  (SoftMoE, Puigcerver et al. 2023).

All are pytrees, so they can cross `jit`/`vmap` boundaries and be sown.
"""

from __future__ import annotations

from typing import Optional, Union

import flax.struct
import jax
import jax.numpy as jnp

Array = jax.Array


@flax.struct.dataclass
class TokenChoiceRouting:
  """Token-choice routing.

  Attributes:
    expert_indices: `[G, S, K]` int32, the experts chosen by each token, in
      order of preference (choice k=0 is the token's top-1).
    gates: `[G, S, K]` float, the combine weight of each choice.
    valid: `[G, S, K]` bool, False for choices that do not exist (routers that
      select a variable number of experts per token, e.g. top-p, pad to a
      static K with invalid choices). Invalid choices never take capacity.
  """
  expert_indices: Array
  gates: Array
  valid: Array

  @classmethod
  def create(cls, expert_indices: Array, gates: Array,
             valid: Optional[Array] = None) -> "TokenChoiceRouting":
    if valid is None:
      valid = jnp.ones(expert_indices.shape, dtype=bool)
    return cls(expert_indices=expert_indices.astype(jnp.int32), gates=gates,
               valid=valid)

  @property
  def num_selected(self) -> int:
    return self.expert_indices.shape[-1]

  def expert_mask(self, num_experts: int) -> Array:
    """`[G, S, E]` bool: expert e was selected by token s (before capacity)."""
    one_hot = jax.nn.one_hot(self.expert_indices, num_experts, dtype=jnp.bool_)
    return jnp.any(one_hot & self.valid[..., None], axis=-2)


@flax.struct.dataclass
class ExpertChoiceRouting:
  """Expert-choice routing.

  Attributes:
    token_indices: `[G, E, C]` int32, the tokens (within the group) picked by
      each expert, best first.
    weights: `[G, E, C]` float, the combine weight of each pick.
  """
  token_indices: Array
  weights: Array

  def expert_mask(self, num_experts: int, group_size: int) -> Array:
    """`[G, S, E]` bool: token s was picked by expert e."""
    del num_experts  # Implied by the shape of token_indices.
    picked = jax.nn.one_hot(self.token_indices, group_size, dtype=jnp.bool_)
    return jnp.any(picked, axis=-2).transpose(0, 2, 1)


@flax.struct.dataclass
class SoftRouting:
  """SoftMoE routing with P slots per expert.

  Attributes:
    dispatch_weights: `[G, S, E, P]`, normalised over S (each slot's input is a
      convex combination of the group's tokens).
    combine_weights: `[G, S, E, P]`, normalised over (E, P) jointly (each
      token's output is a convex combination of all slot outputs).
  """
  dispatch_weights: Array
  combine_weights: Array

  def expert_mask(self, num_experts: int) -> Array:
    """`[G, S, E]` bool: the expert holding the most combine weight of token s.

    Soft routing sends every token everywhere; for analysis (routing change,
    load) we call a token's "selected" expert the one whose slots contribute
    most to its output.
    """
    per_expert = jnp.sum(self.combine_weights, axis=-1)  # [G, S, E]
    return jax.nn.one_hot(jnp.argmax(per_expert, axis=-1), num_experts,
                          dtype=jnp.bool_)


Routing = Union[TokenChoiceRouting, ExpertChoiceRouting, SoftRouting]
