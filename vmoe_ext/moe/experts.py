"""Expert MLPs applied over a leading expert axis: `[E, N, D] -> [E, N, D]`.

The compute is the pure function `mlp_experts(params, x)` of the expert
weights, so a `shard_map` can take the weights as arguments (expert
parallelism); `MlpExperts` is the thin module that owns them. The parameters
mirror the dense ViT MLP (`Mlp/Dense_0/{kernel,bias}`, `Mlp/Dense_1/...`) with
a leading expert axis, as in google's vmoe:

    Dense_0/kernel [E, D, H]   Dense_0/bias [E, H]
    Dense_1/kernel [E, H, D]   Dense_1/bias [E, D]

so a dense MLP initialises every expert with one rule
(`(.*)/Moe/Mlp/(.*) -> \\1/Mlp/\\2`, see `vmoe_ext.train.initialization`).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional

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


def mlp_experts(params: Mapping[str, Mapping[str, Array]], x: Array, *,
                dropout_rate: float = 0.0,
                dropout_rng: Optional[Array] = None,
                dtype: Any = jnp.float32) -> Array:
  """E GELU MLPs `D -> H -> D`, one per expert.

  Args:
    params: `{"Dense_0": {"kernel": [E, D, H], "bias": [E, H]},
      "Dense_1": {"kernel": [E, H, D], "bias": [E, D]}}`.
    x: `[E, N, D]` expert inputs (N = G*C buffer slots per expert).
    dropout_rate: dropout after the activation and after the output layer,
      applied when `dropout_rng` is given.
    dropout_rng: PRNG key, or None for no dropout (deterministic).
    dtype: compute dtype.

  Returns:
    `[E, N, D]`.
  """
  w_in, b_in = params["Dense_0"]["kernel"], params["Dense_0"]["bias"]
  w_out, b_out = params["Dense_1"]["kernel"], params["Dense_1"]["bias"]
  use_dropout = dropout_rng is not None and dropout_rate > 0
  keys = jax.random.split(dropout_rng, 2) if use_dropout else (None, None)

  def dropout(v: Array, key: Optional[Array]) -> Array:
    if key is None:
      return v
    keep = jax.random.bernoulli(key, 1.0 - dropout_rate, v.shape)
    return jnp.where(keep, v / (1.0 - dropout_rate), 0).astype(v.dtype)

  x = x.astype(dtype)
  h = jnp.einsum("end,edh->enh", x, w_in.astype(dtype))
  h = nn.gelu(h + b_in[:, None].astype(dtype))
  h = dropout(h, keys[0])
  y = jnp.einsum("enh,ehd->end", h, w_out.astype(dtype))
  y = y + b_out[:, None].astype(dtype)
  return dropout(y, keys[1])


class ExpertDense(nn.Module):
  """The weights of E dense layers `[E, in, out]` (+ bias `[E, out]`)."""
  num_experts: int
  features: int
  init_mode: str = "independent"
  kernel_init: Callable = nn.initializers.xavier_uniform()
  bias_init: Callable = nn.initializers.normal(stddev=1e-6)

  @nn.compact
  def __call__(self, in_features: int) -> dict[str, Array]:
    init = lambda base: _expert_init(base, self.num_experts, self.init_mode)
    e = self.num_experts
    return {
        "kernel": self.param("kernel", init(self.kernel_init),
                             (e, in_features, self.features)),
        "bias": self.param("bias", init(self.bias_init), (e, self.features)),
    }


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
    require(self.init_mode in INIT_MODES, "init_mode",
            f"unknown init mode {self.init_mode!r}; expected {INIT_MODES}")
    require(self.hidden_size > 0, "hidden_size",
            f"must be positive, got {self.hidden_size}")
    require(0.0 <= self.dropout_rate < 1.0, "dropout_rate",
            f"must be in [0, 1), got {self.dropout_rate}")
    super().__post_init__()

  @nn.compact
  def __call__(self, x: Array, *, deterministic: bool = True) -> Array:
    """x: `[E, N, D]` -> `[E, N, D]`."""
    e, _, d = x.shape
    if e != self.num_experts:
      raise ValueError(f"expert inputs have {e} experts, the module has "
                       f"{self.num_experts}")
    dense = lambda features, name: ExpertDense(
        self.num_experts, features, self.init_mode, self.kernel_init,
        self.bias_init, name=name)
    params = {"Dense_0": dense(self.hidden_size, "Dense_0")(d),
              "Dense_1": dense(d, "Dense_1")(self.hidden_size)}
    rng = None
    if not deterministic and self.dropout_rate > 0:
      rng = self.make_rng("dropout")
    return mlp_experts(params, x, dropout_rate=self.dropout_rate,
                       dropout_rng=rng, dtype=self.dtype)
