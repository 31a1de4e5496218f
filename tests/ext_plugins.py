"""A user's own components, outside `vmoe_ext`, for tests/test_extending.py.

Each is used as a config would name it, `"ext_plugins:GreedyRouter"`, or
registered with `vmoe_ext.register_*`. It is importable as `ext_plugins`:
tests/conftest.py puts tests/ on the Python path.
"""

from __future__ import annotations

from typing import Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from vmoe_ext.attacks import AttackSpec
from vmoe_ext.attacks.base import check_eps
from vmoe_ext.moe.routing import TokenChoiceRouting
from vmoe_ext.routers.base import LinearLogits, Router, RouterOutput
from vmoe_ext.streams.base import ResidualStream

Array = jax.Array


class GreedyRouter(Router):
  """Top-K of the softmax of a linear map of the tokens `x [G, S, D]`; no
  auxiliary loss."""
  num_selected: int = 1

  @property
  def slots_per_token(self) -> int:
    return self.num_selected

  @nn.compact
  def __call__(self, x: Array, ctx, *, capacity: int, deterministic: bool,
               update_state: bool = False) -> RouterOutput:
    del ctx, capacity, deterministic, update_state
    logits = LinearLogits(self.num_experts, name="logits")(x)  # [G, S, E]
    gates, idx = jax.lax.top_k(jax.nn.softmax(logits), self.num_selected)
    return RouterOutput(TokenChoiceRouting.create(idx, gates),
                        {"auxiliary_loss": jnp.zeros(())})


class DampedResidual(ResidualStream):
  """`x + u + decay * u_prev`, `u = F(LN(x))` of this block, `u_prev` the
  previous block's (zeros before block 0); decay 0 is the plain residual."""
  decay: float = 0.5

  def init_state(self, x: Array) -> dict[str, Array]:
    return {"u": jnp.zeros_like(x)}

  def __call__(self, x, ffn, state, *, ctx, is_moe):
    del ctx, is_moe
    u, _ = ffn(x)
    return x + u + self.decay * state["u"], {"u": u}


def sign_flip(logits_fn, x: Array, labels: Array, *,
              key: Optional[Array] = None, eps: float = 0.1) -> Array:
  """Moves every pixel by eps in a random direction (`key`), clipped to
  [0, 1]; ignores the model."""
  del logits_fn, labels
  signs = jax.random.rademacher(key, x.shape, x.dtype)
  return jnp.clip(x + eps * signs, 0.0, 1.0)


def check_sign_flip(*, eps: float) -> None:
  """`sign_flip`'s config check (found by name: `check_<attack>`)."""
  check_eps(eps)


# The same attack as an explicit spec.
SIGN_FLIP = AttackSpec(sign_flip, check_sign_flip)


def unchecked_attack(logits_fn, x: Array, labels: Array, *,
                     eps: float = 0.1) -> Array:
  """An attack without a `check_unchecked_attack`: not usable by path."""
  del logits_fn, labels
  return x + eps


class NotARouter:
  """Neither a router nor a stream."""
