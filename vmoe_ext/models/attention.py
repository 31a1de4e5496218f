"""`model.attention`: which function computes the softmax attention.

Shape letters: B batch (or windows), T queries, S keys, N heads, H the head
width.

  * "plain" (the default): the models' own attention code, unchanged
    (flax's `dot_product_attention` in the ViT encoder blocks and the MAP
    head, the explicit einsum-softmax-einsum of Swin's `WindowAttention`).
  * "fused": `jax.nn.dot_product_attention` with `implementation=None`, the
    backend JAX picks (XLA on every platform in JAX 0.10: one fused softmax
    with the bias folded in; later JAX versions may select cuDNN on GPUs).
  * "cudnn": `jax.nn.dot_product_attention(implementation="cudnn")`, cuDNN's
    flash attention. It needs a GPU backend, `model.dtype` bfloat16 or
    float16, a head width that is a multiple of 8 and at most 256, and (with
    a bias, as in Swin) an even number of tokens per window; each is checked
    when the model is built.

All three compute `softmax(q k^T / sqrt(H) + bias) v` with float32 logits and
softmax, and share every parameter: the option only changes the computation,
so a checkpoint trained with one evaluates with another. Neither fused form
has attention-weight dropout: a nonzero `attention_dropout_rate` with
"fused" or "cudnn" is a `ConfigError` (rather than a silent fallback to the
plain path, which would hide a slower step).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from vmoe_ext.errors import require

Array = jax.Array
ATTENTIONS = ("plain", "fused", "cudnn")
# `implementation` of `jax.nn.dot_product_attention` per fused option.
_IMPLEMENTATIONS = {"fused": None, "cudnn": "cudnn"}
# cuDNN's flash attention: half-precision inputs, head width bound.
CUDNN_DTYPES = (jnp.bfloat16, jnp.float16)
CUDNN_MAX_HEAD_DIM = 256


def check_attention(attention: str, *, dtype: Any = jnp.float32,
                    head_dims: tuple[int, ...] = (),
                    attention_dropout_rate: float = 0.0,
                    bias_lengths: tuple[int, ...] = ()) -> None:
  """Raises `ConfigError` on `attention` unless the model can run it.

  Args:
    attention: the `model.attention` value.
    dtype: the model's compute dtype.
    head_dims: H of every attention layer.
    attention_dropout_rate: the model's attention dropout.
    bias_lengths: the sequence lengths of the attention layers that add a
      bias (Swin's windows, `M * M`); cuDNN trains those only when even.
  """
  require(attention in ATTENTIONS, "attention",
          f"must be one of {ATTENTIONS}, got {attention!r}")
  if attention == "plain":
    return
  require(attention_dropout_rate == 0.0, "attention",
          f"{attention!r} (jax.nn.dot_product_attention) has no attention "
          f"dropout, but attention_dropout_rate is {attention_dropout_rate}: "
          "set it to 0 or use attention='plain'")
  if attention != "cudnn":
    return
  backend = jax.default_backend()
  require(backend == "gpu", "attention",
          f"'cudnn' needs a GPU backend, this process runs on {backend!r} "
          "(use 'fused': same parameters, same values)")
  require(jnp.dtype(dtype) in [jnp.dtype(d) for d in CUDNN_DTYPES],
          "attention", f"'cudnn' needs model.dtype bfloat16 or float16, got "
          f"{jnp.dtype(dtype).name} (use 'fused' in float32)")
  for h in head_dims:
    require(h % 8 == 0 and h <= CUDNN_MAX_HEAD_DIM, "attention",
            f"'cudnn' needs a head width that is a multiple of 8 and at most "
            f"{CUDNN_MAX_HEAD_DIM}, got {h} (width / num_heads)")
  for n in bias_lengths:
    require(n % 2 == 0, "attention",
            f"'cudnn' with a position bias needs an even number of tokens "
            f"per window to train, got {n} (window_size squared)")


def dot_product_attention(query: Array, key: Array, value: Array,
                          bias: Optional[Array] = None, *,
                          attention: str = "fused") -> Array:
  """`softmax(q k^T / sqrt(H) + bias) v` by `jax.nn.dot_product_attention`.

  Args:
    query: `[B, T, N, H]`.
    key, value: `[B, S, N, H]`.
    bias: None, or additive logits broadcastable to `[B, N, T, S]` (4-D).
    attention: "fused" or "cudnn".

  Returns:
    `[B, T, N, H]`, in the query's dtype.
  """
  require(attention in _IMPLEMENTATIONS, "attention",
          f"must be 'fused' or 'cudnn' here, got {attention!r}")
  if bias is not None and attention == "cudnn":
    bias = bias.astype(query.dtype)  # cuDNN takes the bias in the QKV dtype.
  return jax.nn.dot_product_attention(
      query, key, value, bias=bias,
      implementation=_IMPLEMENTATIONS[attention])


def flax_attention_fn(attention: str) -> Callable[..., Array]:
  """An `attention_fn` for flax's `MultiHeadDotProductAttention`.

  "plain" gives flax's own `dot_product_attention` (today's path); "fused"
  and "cudnn" a function of `(query [B, T, N, H], key, value, mask)` with a
  boolean mask broadcastable to `[B, N, T, S]` (True: attend). It refuses
  attention dropout at trace time too (the model checks it at build time).
  """
  if attention == "plain":
    return nn.dot_product_attention
  require(attention in _IMPLEMENTATIONS, "attention",
          f"must be one of {ATTENTIONS}, got {attention!r}")
  return _FLAX_FNS[attention]


def _flax_fn(attention: str) -> Callable[..., Array]:
  def fn(query: Array, key: Array, value: Array,
         mask: Optional[Array] = None, dropout_rate: float = 0.0,
         deterministic: bool = True) -> Array:
    require(dropout_rate == 0.0 or deterministic, "attention",
            f"{attention!r} has no attention dropout (rate {dropout_rate})")
    return jax.nn.dot_product_attention(
        query, key, value, mask=mask,
        implementation=_IMPLEMENTATIONS[attention])
  fn.__name__ = f"{attention}_attention"
  return fn


_FLAX_FNS = {name: _flax_fn(name) for name in _IMPLEMENTATIONS}

__all__ = ["ATTENTIONS", "CUDNN_DTYPES", "CUDNN_MAX_HEAD_DIM",
           "check_attention", "dot_product_attention", "flax_attention_fn"]
