"""What a router returns: which token goes to which expert with which weight.

Three forms cover every router in the project:

* `TokenChoiceRouting` — each token picks up to K experts (V-MoE top-k, XMoE,
  ACMoE, Symphony, top-p). Capacity and dropping are decided by the dispatcher.
* `ExpertChoiceRouting` — each expert picks its C tokens (Zhou et al. 2022).
* `SoftRouting` — dense dispatch/combine weights over P slots per expert
  (SoftMoE, Puigcerver et al. 2023).

All are pytrees, so they can cross `jit`/`vmap` boundaries and be sown, and
all answer the same questions with the same signatures, so the MoE layer never
branches on the form:

* `expert_mask(num_experts) -> [G, S, E]` bool, which experts a token went to
  (soft: the expert holding the most combine weight);
* `assignment(num_experts) -> (indices, gates, valid)`, each `[G, S, K]`: the
  token's experts best first, their weights, and which entries exist. The
  layer turns it into the grouping-independent `[B, T, K]` `Assignment` that
  later MoE layers read (`vmoe_ext.moe.contract`).
"""

from __future__ import annotations

from typing import Optional, Union

import flax.struct
import jax
import jax.numpy as jnp

from vmoe_ext.moe.select import partitionable_top_k

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
    priority: `[G, S]` float, the score batch-priority routing orders the
      tokens by (highest first), or None: the token's largest valid combine
      weight. A router whose combine weights are not its selection scores
      (tutel's normalised gates, `vmoe_ext.routers.swin_moe`) sets it.
  """
  expert_indices: Array
  gates: Array
  valid: Array
  priority: Optional[Array] = None

  @classmethod
  def create(cls, expert_indices: Array, gates: Array,
             valid: Optional[Array] = None,
             priority: Optional[Array] = None) -> "TokenChoiceRouting":
    if valid is None:
      valid = jnp.ones(expert_indices.shape, dtype=bool)
    return cls(expert_indices=expert_indices.astype(jnp.int32), gates=gates,
               valid=valid, priority=priority)

  @property
  def num_selected(self) -> int:
    return self.expert_indices.shape[-1]

  def expert_mask(self, num_experts: int) -> Array:
    """`[G, S, E]` bool: expert e was selected by token s (before capacity)."""
    one_hot = jax.nn.one_hot(self.expert_indices, num_experts, dtype=jnp.bool_)
    return jnp.any(one_hot & self.valid[..., None], axis=-2)

  def assignment(self, num_experts: int) -> tuple[Array, Array, Array]:
    """The K choices themselves (-1 / weight 0 where not valid)."""
    del num_experts
    return (jnp.where(self.valid, self.expert_indices, -1),
            jnp.where(self.valid, self.gates, 0), self.valid)


@flax.struct.dataclass
class ExpertChoiceRouting:
  """Expert-choice routing.

  Attributes:
    token_indices: `[G, E, C]` int32, the tokens (within the group) picked by
      each expert, best first.
    weights: `[G, E, C]` float, the combine weight of each pick.
    group_size: S (static).
  """
  token_indices: Array
  weights: Array
  group_size: int = flax.struct.field(pytree_node=False)

  def _token_weights(self) -> tuple[Array, Array]:
    """`[G, S, E]` weight of expert e's pick of token s, and whether picked."""
    picked = jax.nn.one_hot(self.token_indices, self.group_size,
                            dtype=self.weights.dtype)  # [G, E, C, S]
    weights = jnp.einsum("gecs,gec->gse", picked, self.weights)
    return weights, jnp.any(picked > 0, axis=-2).transpose(0, 2, 1)

  def expert_mask(self, num_experts: int) -> Array:
    """`[G, S, E]` bool: token s was picked by expert e."""
    del num_experts  # Implied by the shape of token_indices.
    picked = jax.nn.one_hot(self.token_indices, self.group_size,
                            dtype=jnp.bool_)
    return jnp.any(picked, axis=-2).transpose(0, 2, 1)

  def assignment(self, num_experts: int) -> tuple[Array, Array, Array]:
    """The experts that picked each token, by decreasing weight (K = E)."""
    weights, picked = self._token_weights()
    order = jnp.argsort(jnp.where(picked, -weights, jnp.inf), axis=-1,
                        stable=True)[..., :num_experts]
    valid = jnp.take_along_axis(picked, order, axis=-1)
    gates = jnp.take_along_axis(weights, order, axis=-1)
    return (jnp.where(valid, order, -1).astype(jnp.int32),
            jnp.where(valid, gates, 0), valid)


@flax.struct.dataclass
class SoftRouting:
  """SoftMoE routing with P slots per expert.

  Attributes:
    dispatch_weights: `[G, S, E, P]`, normalised over S (each slot's input is a
      convex combination of the group's tokens).
    combine_weights: `[G, S, E, P]`, normalised over (E, P) jointly (each
      token's output is a convex combination of all slot outputs).
    assigned_slots: K of `assignment` (static): a token's assignment is the
      experts of its K slots of largest combine weight (capped at E*P).
  """
  dispatch_weights: Array
  combine_weights: Array
  assigned_slots: int = flax.struct.field(pytree_node=False, default=8)

  def expert_mask(self, num_experts: int) -> Array:
    """`[G, S, E]` bool: the expert holding the most combine weight of token s.

    Soft routing sends every token everywhere; for analysis (routing change,
    load) we call a token's "selected" expert the one whose slots contribute
    most to its output.
    """
    per_expert = jnp.sum(self.combine_weights, axis=-1)  # [G, S, E]
    return jax.nn.one_hot(jnp.argmax(per_expert, axis=-1), num_experts,
                          dtype=jnp.bool_)

  def assignment(self, num_experts: int) -> tuple[Array, Array, Array]:
    """The top-K slots by combine weight: expert `slot // P`, that weight."""
    g, s, e, p = self.combine_weights.shape
    del num_experts
    k = min(self.assigned_slots, e * p)
    gates, slots = partitionable_top_k(
        self.combine_weights.reshape(g, s, e * p), k)
    return ((slots // p).astype(jnp.int32), gates,
            jnp.ones(slots.shape, jnp.bool_))


Routing = Union[TokenChoiceRouting, ExpertChoiceRouting, SoftRouting]
