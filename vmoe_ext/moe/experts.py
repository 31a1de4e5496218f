"""Expert MLPs applied over a leading expert axis: `[E, N, D] -> [E, N, D]`."""

from __future__ import annotations

from typing import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from vmoe_ext.errors import require

Array = jax.Array
INIT_MODES = ("independent", "shared")


def _expert_init(base: Callable, num_experts: int, mode: str) -> Callable:
  """Initializer for a `[E, ...]` parameter from a per-expert initializer.

  "independent" draws every expert with its own key; "shared" draws one
  expert and copies it E times (vmoe's behaviour without split rngs), so the
  experts start identical and differ only through routing.
  """

  def init(key: Array, shape: tuple[int, ...], dtype=jnp.float32) -> Array:
    if mode == "shared":
      one = base(key, shape[1:], dtype)
      return jnp.broadcast_to(one, shape)
    keys = jax.random.split(key, num_experts)
    return jax.vmap(lambda k: base(k, shape[1:], dtype))(keys)

  return init


class MlpExperts(nn.Module):
  """E independent GELU MLPs `D -> H -> D` (ViT MLP block), one per expert.

  Attributes:
    num_experts: E.
    hidden_size: H.
    dropout_rate: dropout after the activation and after the output layer.
    init_mode: "independent" (default) or "shared" (all experts start equal).
    kernel_init: per-expert kernel initializer (applied to `[D, H]`/`[H, D]`).
  """
  num_experts: int
  hidden_size: int
  dropout_rate: float = 0.0
  init_mode: str = "independent"
  kernel_init: Callable = nn.initializers.xavier_uniform()
  bias_init: Callable = nn.initializers.normal(stddev=1e-6)
  dtype: jnp.dtype = jnp.float32

  def __post_init__(self):
    require(self.init_mode in INIT_MODES, "experts.init_mode",
            f"unknown init mode {self.init_mode!r}; expected {INIT_MODES}")
    require(self.hidden_size > 0, "experts.hidden_size",
            f"must be positive, got {self.hidden_size}")
    require(0.0 <= self.dropout_rate < 1.0, "experts.dropout_rate",
            f"must be in [0, 1), got {self.dropout_rate}")
    super().__post_init__()

  @nn.compact
  def __call__(self, x: Array, *, deterministic: bool = True) -> Array:
    """x: `[E, N, D]` -> `[E, N, D]`."""
    e, _, d = x.shape
    require(e == self.num_experts, "experts.num_experts",
            f"input has {e} experts, module has {self.num_experts}")
    init = lambda base: _expert_init(base, self.num_experts, self.init_mode)
    w_in = self.param("wi", init(self.kernel_init),
                      (e, d, self.hidden_size))
    b_in = self.param("bi", init(self.bias_init), (e, self.hidden_size))
    w_out = self.param("wo", init(self.kernel_init),
                       (e, self.hidden_size, d))
    b_out = self.param("bo", init(self.bias_init), (e, d))
    x = x.astype(self.dtype)
    h = jnp.einsum("end,edh->enh", x, w_in.astype(self.dtype))
    h = nn.gelu(h + b_in[:, None].astype(self.dtype))
    h = nn.Dropout(self.dropout_rate)(h, deterministic=deterministic)
    y = jnp.einsum("enh,ehd->end", h, w_out.astype(self.dtype))
    y = y + b_out[:, None].astype(self.dtype)
    return nn.Dropout(self.dropout_rate)(y, deterministic=deterministic)
