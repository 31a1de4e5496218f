"""The classifier end of the ViT: pooling, pre-logits and the linear head.

`model.classifier` picks how the encoder's output `[B, T, D]` becomes one
vector per image (vmoe's names):
  * "token": the class token, which the model prepends (a `cls` parameter);
  * "0": the first token, with no class token prepended (vmoe's "0");
  * "gap": the mean of all tokens;
  * "map": multi-head attention pooling (`MapHead`): a learned probe attends
    over the tokens, then a residual LayerNorm + MLP, as in vmoe / big_vision.
`model.representation_size` adds a `pre_logits` Dense + tanh (ViT's
pre-logits layer); the `head` Dense then gives the logits, its kernel
initialised to zeros (vmoe's default, `head_kernel_zero_init`) or LeCun
normal, its bias to the constant `head_bias_init`.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from vmoe_ext.models.attention import flax_attention_fn
from vmoe_ext.moe.experts import DenseMlp

Array = jax.Array
CLASSIFIERS = ("token", "gap", "map", "0")
# `model.attention_kernel_init`: vmoe's and ViT's choice, or flax's default.
ATTENTION_KERNEL_INITS: dict[str, Callable[..., Any]] = {
    "xavier_uniform": nn.initializers.xavier_uniform(),
    "lecun_normal": nn.initializers.lecun_normal(),
}


def has_class_token(classifier: str) -> bool:
  """Whether the model prepends a class token (`cls`)."""
  return classifier == "token"


class MapHead(nn.Module):
  """Multi-head attention pooling: `[B, T, D]` -> `[B, D]`.

  A probe `[1, 1, D]` (Xavier uniform) queries the tokens with multi-head
  attention (`MultiHeadDotProductAttention`, no dropout; its attention
  function is `model.attention`'s, `vmoe_ext.models.attention`); its output `z`
  becomes `z + Mlp(LayerNorm(z))`. Parameter names follow vmoe's `MapHead`.
  """
  num_heads: int
  mlp_dim: int
  qk_norm: bool = False
  kernel_init: str = "xavier_uniform"
  activation: str = "gelu"
  dtype: Any = jnp.float32
  attention: str = "plain"

  @nn.compact
  def __call__(self, x: Array) -> Array:
    b, _, d = x.shape
    probe = self.param("probe", nn.initializers.xavier_uniform(), (1, 1, d))
    probe = jnp.broadcast_to(probe.astype(x.dtype), (b, 1, d))
    z = nn.MultiHeadDotProductAttention(
        num_heads=self.num_heads, normalize_qk=self.qk_norm,
        kernel_init=ATTENTION_KERNEL_INITS[self.kernel_init],
        attention_fn=flax_attention_fn(self.attention),
        deterministic=True, dtype=self.dtype,
        name="MultiHeadDotProductAttention")(probe, x)
    y = nn.LayerNorm(name="LayerNorm", dtype=self.dtype)(z)
    y = DenseMlp(self.mlp_dim, 0.0, self.dtype, self.activation,
                 name="Mlp")(y)
    return (z + y)[:, 0]


def classifier_head(x: Array, *, num_classes: int, classifier: str,
                    representation_size: Optional[int] = None,
                    head_kernel_zero_init: bool = True,
                    head_bias_init: float = 0.0, num_heads: int = 1,
                    mlp_dim: int = 1, attention_qk_norm: bool = False,
                    attention_kernel_init: str = "xavier_uniform",
                    activation: str = "gelu", dtype: Any = jnp.float32,
                    attention: str = "plain") -> Array:
  """Pooling, optional pre-logits and the head: `[B, T, D]` -> `[B, C]`.

  Call it inside a module's compact method: its submodules (`MapHead`,
  `pre_logits`, `head`) are created in that module's scope, at the top of
  the model's parameter tree as in vmoe.
  """
  if classifier in ("token", "0"):
    x = x[:, 0]
  elif classifier == "gap":
    x = jnp.mean(x, axis=1)
  else:  # "map"
    x = MapHead(num_heads, mlp_dim, attention_qk_norm, attention_kernel_init,
                activation, dtype, attention=attention, name="MapHead")(x)
  if representation_size is not None:
    x = jnp.tanh(nn.Dense(representation_size, dtype=dtype,
                          name="pre_logits")(x))
  kernel_init = (nn.initializers.zeros if head_kernel_zero_init
                 else nn.initializers.lecun_normal())
  return nn.Dense(num_classes, kernel_init=kernel_init,
                  bias_init=nn.initializers.constant(head_bias_init),
                  dtype=dtype, name="head")(x)


__all__ = ["ATTENTION_KERNEL_INITS", "CLASSIFIERS", "MapHead",
           "classifier_head", "has_class_token"]
