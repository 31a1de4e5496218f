"""The language model with some dense `f` sub-layers carved into MoE layers
(CMoE, `vmoe_ext.carving.language`; docs/carving.md, "Decoder language
models").

Shape letters as `vmoe_ext.models.language`: B rows, M tokens per block, L
attention span, D model width.

A carved `f` layer keeps its attention and both LayerNorms and replaces its
dense ReLU MLP by an `MoeLayer` `Moe` (the `carved_moe` dict), in the same
place of the post-norm layer:

    dense f:   h = LN_ffn(h + Mlp(h))        (h = LN_attention(h + attn))
    carved f:  h = LN_ffn(h + Moe(h))

Every other layer is the `LanguageLayer` it was, with the same routing
context and residual-stream state as in the dense model: a carved layer
routes with a context of its own and passes the model's context through
untouched, so the MoE layers after it (an AC `c` layer reading the previous
MoE layer's experts, a momentum stream) compute exactly what they did.
The carved layers' metrics are `metrics["layer_i"]` like the others'.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from vmoe_ext.errors import field_scope, require
from vmoe_ext.models.language import LanguageModel
from vmoe_ext.models.lm_arch import DENSE, LayerSpec
from vmoe_ext.models.seq_attention import SeqAttention
from vmoe_ext.models.sublayer import build_moe_layer, moe_config
from vmoe_ext.moe.contract import RoutingContext
from vmoe_ext.moe.expert_parallel import ExpertParallel
from vmoe_ext.naming import param_name

Array = jax.Array


class CarvedFfnLayer(nn.Module):
  """A carved `f` layer: cached attention, then `LN_ffn(h + Moe(h))`."""
  num_heads: int
  inner_hidden_size: int
  moe: Mapping[str, Any]
  dropout_rate: float = 0.0
  layer_norm_epsilon: float = 1e-5
  dtype: Any = jnp.float32
  expert_parallel: Optional[ExpertParallel] = None

  @nn.compact
  def __call__(self, h: Array, cache: Array, key_pe: Array,
               ctx: RoutingContext, *, deterministic: bool = True,
               update_state: bool = False) -> tuple[Array, dict]:
    """h: `[B, M, D]`, cache: `[B, L, D]` -> `[B, M, D]`, MoE metrics."""
    norm = lambda name: nn.LayerNorm(epsilon=self.layer_norm_epsilon,
                                     dtype=self.dtype, name=name)
    a = SeqAttention(self.num_heads, self.dropout_rate, self.dtype,
                     name="Attention")(h, cache, key_pe,
                                       deterministic=deterministic)
    h = norm("LayerNorm_attention")(h + a)
    layer = build_moe_layer(self.moe, self.inner_hidden_size,
                            self.dropout_rate, self.dtype, "relu",
                            name="Moe", expert_parallel=self.expert_parallel)
    f, metrics, _ = layer(h, ctx, deterministic=deterministic,
                          update_state=update_state)
    return norm("LayerNorm_ffn")(h + f), metrics


class CarvedLanguageModel(LanguageModel):
  """`LanguageModel` whose `f` layers `carved_layers` are MoE layers.

  Attributes:
    carved_layers: block indices of carved `f` layers.
    carved_moe: their `moe` dict (`MOE_DEFAULTS` fields; the placement
      fields are ignored, `carved_layers` places them).

  Everything else (fields, `zero_cache`, `moe_layers`: the dense model's
  MoE layers) is the `LanguageModel`'s; `__call__` returns what its does.
  `scan` must be False: carving reads and writes each layer's parameters
  by its unrolled name (`encoderblock_i`).
  """
  carved_layers: tuple[int, ...] = ()
  carved_moe: Optional[Mapping[str, Any]] = None

  def __post_init__(self):
    super().__post_init__()
    require(self.scan is False, "scan",
            "the carved language model runs its layers unrolled: carving "
            "reads and writes each layer's parameters by name "
            "(encoderblock_i), and a carved 'f' layer is a kind of its own; "
            "set model.scan=False (a checkpoint trained with scan=True is "
            "read into the unrolled layout, converted exactly)")
    carved = tuple(self.carved_layers)
    dense = tuple(s.block for s in self.layers if s.ffn == DENSE)
    bad = [b for b in carved if b not in dense]
    require(not bad, "carved_layers",
            f"block(s) {bad} are not dense 'f' layers of {self.architecture!r}"
            f" (its f layers: {dense})")
    require(not carved or self.carved_moe is not None, "carved_moe",
            "carved layers need an moe config")
    moe = moe_config(self.carved_moe)
    if moe is not None:
      with field_scope("carved_moe"):
        build_moe_layer(moe, self.inner_hidden_size, self.dropout_rate,
                        self.dtype, "relu", parent=None)
    object.__setattr__(self, "carved_layers", carved)
    object.__setattr__(self, "carved_moe", moe)

  @nn.nowrap
  def layer(self, spec: LayerSpec, h: Array, cache: Array, key_pe: Array,
            ctx: RoutingContext, *, deterministic: bool, update_state: bool,
            name: Optional[str] = None
            ) -> tuple[Array, RoutingContext, Optional[dict[str, Any]]]:
    """A carved `f` layer with its own routing context (so a later `c` layer
    or the stream sees what it saw in the dense model); the others as the
    `LanguageModel`'s."""
    if spec.block not in self.carved_layers:
      return super().layer(spec, h, cache, key_pe, ctx,
                           deterministic=deterministic,
                           update_state=update_state, name=name)
    own = RoutingContext(block=spec.block, axis_name=self.state_axis_name,
                         moe_blocks=self.carved_layers)
    h, layer_metrics = CarvedFfnLayer(
        self.num_heads, self.inner_hidden_size, self.carved_moe,
        self.dropout_rate, self.layer_norm_epsilon, self.dtype,
        self.expert_parallel,
        name=param_name(spec.block) if name is None else name)(
            h, cache, key_pe, own, deterministic=deterministic,
            update_state=update_state)
    return h, ctx, layer_metrics


__all__ = ["CarvedFfnLayer", "CarvedLanguageModel"]
