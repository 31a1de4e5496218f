"""Expert MLPs over a leading expert axis `[E, N, D] -> [E, N, D]`, and the dense MLP.

The compute is the pure function `mlp_experts(params, x)` of the expert
weights, so a `shard_map` can take the weights as arguments (expert
parallelism); `MlpExperts` is the thin module that owns them. The parameters
mirror the dense ViT MLP (`DenseMlp`: `Mlp/Dense_0/{kernel,bias}`,
`Mlp/Dense_1/...`) with a leading expert axis, as in google's vmoe:

    Dense_0/kernel [E, D, H]   Dense_0/bias [E, H]      (activated branch)
    Dense_up/kernel [E, D, H]  Dense_up/bias [E, H]     (gated MLPs only)
    Dense_1/kernel [E, H, D]   Dense_1/bias [E, D]      (output; the bias is
                                                         absent when the MoE
                                                         layer adds it once
                                                         or has none)

so a dense MLP initialises every expert with one rule
(`(.*)/Moe/Mlp/(.*) -> \\1/Mlp/\\2`, see `vmoe_ext.train.initialization`).

Activations (`ACTIVATIONS`): "gelu" (the tanh approximation, ViT's and
vmoe's), "gelu_exact" (the erf form `x Phi(x)`, torch's default `nn.GELU()`)
and "relu" give `h = act(x W_0 + b_0)`; "swiglu" (Shazeer 2020, LLaMA's FFN) gives the gated
`h = silu(x W_0 + b_0) * (x W_up + b_up)`: `Dense_0` is LLaMA's `gate_proj`,
`Dense_up` its `up_proj`, `Dense_1` its `down_proj`.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from vmoe_ext.errors import require

Array = jax.Array
INIT_MODES = ("independent", "shared")
# Name -> the activation of the first layer; gated ones multiply it by the
# linear `Dense_up` branch.
_ACTIVATION_FNS: dict[str, Callable[[Array], Array]] = {
    "gelu": nn.gelu,
    "gelu_exact": lambda x: nn.gelu(x, approximate=False),
    "relu": nn.relu, "swiglu": nn.silu}
GATED = ("swiglu",)
ACTIVATIONS = tuple(_ACTIVATION_FNS)


def check_activation(activation: str, field: str = "mlp_activation") -> None:
  require(activation in _ACTIVATION_FNS, field,
          f"unknown MLP activation {activation!r}; expected one of "
          f"{ACTIVATIONS}")


def hidden_activation(activation: str, pre: Array,
                      up: Optional[Array] = None) -> Array:
  """The hidden units `[..., H]` from the pre-activations of `Dense_0` (and,
  for a gated activation, of `Dense_up`)."""
  act = _ACTIVATION_FNS[activation](pre)
  if activation in GATED:
    return act * up
  return act


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


def expert_dropout_keep(rng: Array, rate: float, num_experts: int,
                        slots: int, hidden: int, width: int
                        ) -> tuple[Array, Array]:
  """The experts' dropout keep masks: `[E, N, H]` (after the activation) and
  `[E, N, D]` (after the output layer), drawn from `rng` on these global
  shapes, so an expert-parallel layer can draw them once and shard them
  (`vmoe_ext.moe.expert_parallel`) and get the single-device masks. Both are
  drawn whatever the placement (`dropout_output`), so the mask after the
  activation does not depend on it."""
  keys = jax.random.split(rng, 2)
  return (jax.random.bernoulli(keys[0], 1.0 - rate,
                               (num_experts, slots, hidden)),
          jax.random.bernoulli(keys[1], 1.0 - rate,
                               (num_experts, slots, width)))


def _dropout(v: Array, rate: float, keep: Optional[Array]) -> Array:
  if keep is None:
    return v
  return jnp.where(keep, v / (1.0 - rate), 0).astype(v.dtype)


def mlp_experts(params: Mapping[str, Mapping[str, Array]], x: Array, *,
                activation: str = "gelu",
                dropout_rate: float = 0.0,
                dropout_output: bool = True,
                dropout_rng: Optional[Array] = None,
                dropout_keep: Optional[tuple[Array, Array]] = None,
                dtype: Any = jnp.float32) -> Array:
  """E MLPs `D -> H -> D`, one per expert.

  Args:
    params: `{"Dense_0": {"kernel": [E, D, H], "bias": [E, H]},
      "Dense_1": {"kernel": [E, H, D], "bias": [E, D]}}`, plus `"Dense_up"`
      (like `Dense_0`) for a gated activation; `Dense_1` may have no bias.
    x: `[E, N, D]` expert inputs (N = G*C buffer slots per expert).
    activation: one of `ACTIVATIONS`.
    dropout_rate: dropout after the activation and (with `dropout_output`)
      after the output layer, applied when `dropout_rng` (or `dropout_keep`)
      is given.
    dropout_output: also drop after the output layer (vmoe, the dense ViT
      MLP); False: after the activation only (tutel's experts, Swin-MoE).
    dropout_rng: PRNG key, or None for no dropout (deterministic); the
      masks are `expert_dropout_keep(dropout_rng, ...)` on x's shape.
    dropout_keep: the keep masks themselves (`[E, N, H]`, `[E, N, D]`),
      instead of `dropout_rng` (an expert-parallel shard's part of them).
    dtype: compute dtype.

  Returns:
    `[E, N, D]`.
  """
  keep = (None, None) if dropout_rate <= 0 else dropout_keep or (None, None)
  if dropout_rng is not None and dropout_rate > 0:
    e, n, d = x.shape
    keep = expert_dropout_keep(dropout_rng, dropout_rate, e, n,
                               params["Dense_0"]["kernel"].shape[-1], d)
  x = x.astype(dtype)

  def dense_in(name: str) -> Array:
    layer = params[name]
    h = jnp.einsum("end,edh->enh", x, layer["kernel"].astype(dtype))
    return h + layer["bias"][:, None].astype(dtype)

  up = dense_in("Dense_up") if activation in GATED else None
  h = hidden_activation(activation, dense_in("Dense_0"), up)
  h = _dropout(h, dropout_rate, keep[0])
  out = params["Dense_1"]
  y = jnp.einsum("enh,ehd->end", h, out["kernel"].astype(dtype))
  if "bias" in out:
    y = y + out["bias"][:, None].astype(dtype)
  if not dropout_output:
    return y
  return _dropout(y, dropout_rate, keep[1])


class ExpertDense(nn.Module):
  """The weights of E dense layers `[E, in, out]` (+ bias `[E, out]`)."""
  num_experts: int
  features: int
  init_mode: str = "independent"
  kernel_init: Callable = nn.initializers.xavier_uniform()
  bias_init: Callable = nn.initializers.normal(stddev=1e-6)
  use_bias: bool = True

  @nn.compact
  def __call__(self, in_features: int) -> dict[str, Array]:
    init = lambda base: _expert_init(base, self.num_experts, self.init_mode)
    e = self.num_experts
    out = {"kernel": self.param("kernel", init(self.kernel_init),
                                (e, in_features, self.features))}
    if self.use_bias:
      out["bias"] = self.param("bias", init(self.bias_init),
                               (e, self.features))
    return out


class MlpExperts(nn.Module):
  """E independent MLPs `D -> H -> D` (ViT MLP block), one per expert.

  Attributes:
    num_experts: E.
    hidden_size: H.
    activation: one of `ACTIVATIONS` ("gelu", as ViT; "swiglu" is gated).
    output_bias: give each expert's output layer a bias (False when the MoE
      layer adds one bias once or has none, `MoeLayer.output_bias="once"` or
      `"none"`).
    dropout_rate: dropout after the activation and (with `dropout_output`)
      after the output layer.
    dropout_output: see `mlp_experts`.
    init_mode: "independent" (default) or "shared" (all experts start equal).
    kernel_init: per-expert kernel initializer (applied to `[D, H]`/`[H, D]`).
  """
  num_experts: int
  hidden_size: int
  activation: str = "gelu"
  output_bias: bool = True
  dropout_rate: float = 0.0
  dropout_output: bool = True
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
    check_activation(self.activation, "activation")
    super().__post_init__()

  @nn.compact
  def __call__(self, x: Array, *, deterministic: bool = True,
               compute: Optional[Callable[..., Any]] = None) -> Any:
    """x: `[E, N, D]` -> `[E, N, D]`.

    `compute(params, x, dropout_rng)` replaces `mlp_experts` when given (x
    is then whatever it takes, with D last): the expert-parallel layer runs
    dispatch, experts and combine in one `shard_map` over these weights.
    """
    e, d = x.shape[0], x.shape[-1]
    if compute is None and e != self.num_experts:
      raise ValueError(f"expert inputs have {e} experts, the module has "
                       f"{self.num_experts}")
    dense = lambda features, name, use_bias=True: ExpertDense(
        self.num_experts, features, self.init_mode, self.kernel_init,
        self.bias_init, use_bias, name=name)
    params = {"Dense_0": dense(self.hidden_size, "Dense_0")(d)}
    if self.activation in GATED:
      params["Dense_up"] = dense(self.hidden_size, "Dense_up")(d)
    params["Dense_1"] = dense(d, "Dense_1", self.output_bias)(
        self.hidden_size)
    rng = None
    if not deterministic and self.dropout_rate > 0:
      rng = self.make_rng("dropout")
    if compute is not None:
      return compute(params, x, rng)
    return mlp_experts(params, x, activation=self.activation,
                       dropout_rate=self.dropout_rate,
                       dropout_output=self.dropout_output, dropout_rng=rng,
                       dtype=self.dtype)


class DenseMlp(nn.Module):
  """The dense ViT MLP `D -> H -> D` with dropout (a V-MoE's dense blocks,
  the dense ViT, and an MoE layer's shared experts).

  Parameters `Dense_0`, (`Dense_up`,) `Dense_1`, as the experts' without the
  expert axis; `output_bias=False` drops `Dense_1`'s bias (Swin's
  `mlp_fc2_bias`); `dropout_output=False` drops only after the activation
  (an MoE layer's shared experts under `MoeLayer.dropout_output=False`).
  """
  mlp_dim: int
  dropout_rate: float = 0.0
  dtype: Any = jnp.float32
  activation: str = "gelu"
  output_bias: bool = True
  dropout_output: bool = True

  @nn.compact
  def __call__(self, x: Array, *, deterministic: bool = True) -> Array:
    d = x.shape[-1]
    init = dict(kernel_init=nn.initializers.xavier_uniform(),
                bias_init=nn.initializers.normal(stddev=1e-6), dtype=self.dtype)
    pre = nn.Dense(self.mlp_dim, name="Dense_0", **init)(x)
    up = (nn.Dense(self.mlp_dim, name="Dense_up", **init)(x)
          if self.activation in GATED else None)
    x = hidden_activation(self.activation, pre, up)
    x = nn.Dropout(self.dropout_rate)(x, deterministic=deterministic)
    x = nn.Dense(d, name="Dense_1", use_bias=self.output_bias, **init)(x)
    if not self.dropout_output:
      return x
    return nn.Dropout(self.dropout_rate)(x, deterministic=deterministic)
