"""A LLaMA-architecture decoder with Hugging Face `LlamaForCausalLM`
semantics, loaded from a Hugging Face checkpoint directory (safetensors).

Shape letters: B sequences, T tokens per sequence, D `hidden_size`, F
`intermediate_size`, V vocabulary, Q query heads, K key/value heads, d
`head_dim`.

    h = embed_tokens[tokens]                                     [B, T, D]
    for each layer i (`encoderblock_i`):
      h = h + o_proj(Attention(RoPE(q_proj(n)), RoPE(k_proj(n)), v_proj(n)))
            with n = RMSNorm_in(h), causal, K | Q (grouped-query: query
            head j reads key/value head j // (Q / K)), scale d^-1/2
      h = h + Mlp(RMSNorm_post(h))     Mlp: down(silu(gate(x)) * up(x))
    logits = RMSNorm_final(h) lm_head                            [B, T, V]

RMSNorm: `w * x / sqrt(mean(x^2) + eps)` (`rms_norm_eps`). Rotary embedding
(the "rotate half" layout of Hugging Face's LLaMA): for position p and
`inv_freq_j = rope_theta^(-2j/d)`, `x * cos + rotate_half(x) * sin` with
`cos = cos(p * [inv_freq, inv_freq])`, `rotate_half([x1, x2]) = [-x2, x1]`;
positions count from 0 in every sequence (no cache). `lm_head` is the
embedding when `tie_word_embeddings`. Everything is computed in float32
(the checkpoint's F16 / BF16 weights are converted).

The MLP of layer i is `Mlp` (a `DenseMlp` with the "swiglu" activation:
`Dense_0` = `gate_proj`, `Dense_up` = `up_proj`, `Dense_1` = `down_proj`,
LLaMA's missing biases loaded as zeros for the first two) or, for the
layers in `moe_layers`, an `MoeLayer` `Moe` built from the `moe` dict (a
carved model, `vmoe_ext.carving.llama`). Carved layers route each sequence
as one group with their own routing context; their metrics are the
model's `metrics["layer_i"]`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from vmoe_ext.errors import require
from vmoe_ext.interop.safetensors import (CONFIG_FILE, load_checkpoint,
                                          read_config)
from vmoe_ext.models.sublayer import build_moe_layer, moe_config
from vmoe_ext.moe.contract import RoutingContext
from vmoe_ext.moe.experts import DenseMlp
from vmoe_ext.naming import metric_key, param_name

Array = jax.Array
Params = dict[str, Any]
# config.json keys without a Hugging Face default that we accept.
REQUIRED = ("vocab_size", "hidden_size", "intermediate_size",
            "num_hidden_layers", "num_attention_heads")
# Names in some converted checkpoints that carry no weights of the model.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _config_field(key: str) -> str:
  return f"{CONFIG_FILE}:{key}"


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
  """The fields of a Hugging Face `LlamaConfig` that the model computes
  with (the defaults are Hugging Face's)."""
  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_hidden_layers: int
  num_attention_heads: int
  num_key_value_heads: int
  head_dim: int
  rms_norm_eps: float = 1e-6
  rope_theta: float = 10000.0
  tie_word_embeddings: bool = False
  attention_bias: bool = False
  mlp_bias: bool = False

  @classmethod
  def from_hf(cls, config: Mapping[str, Any]) -> "LlamaConfig":
    """Checks a `config.json` dict; errors name `config.json:KEY`."""
    model_type = config.get("model_type")
    require(model_type == "llama", _config_field("model_type"),
            f"must be 'llama' (a LlamaForCausalLM checkpoint), got "
            f"{model_type!r}")
    for key in REQUIRED:
      value = config.get(key)
      require(isinstance(value, int) and not isinstance(value, bool)
              and value > 0, _config_field(key),
              f"must be a positive integer, got {value!r}")
    act = config.get("hidden_act", "silu")
    require(act == "silu", _config_field("hidden_act"),
            f"LLaMA's MLP is SwiGLU ('silu'), got {act!r}")
    scaling = config.get("rope_scaling")
    kind = None if scaling is None else (
        scaling.get("rope_type", scaling.get("type"))
        if isinstance(scaling, Mapping) else scaling)
    require(kind in (None, "default"), _config_field("rope_scaling"),
            f"only the plain rotary embedding is implemented, got "
            f"{scaling!r}")
    heads = config["num_attention_heads"]
    kv = config.get("num_key_value_heads") or heads
    require(isinstance(kv, int) and kv > 0 and heads % kv == 0,
            _config_field("num_key_value_heads"),
            f"must divide num_attention_heads={heads}, got {kv!r}")
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    require(isinstance(head_dim, int) and head_dim > 0 and head_dim % 2 == 0,
            _config_field("head_dim"), f"must be a positive even integer "
            f"(hidden_size / num_attention_heads by default), got "
            f"{head_dim!r}")
    eps = config.get("rms_norm_eps", 1e-6)
    require(isinstance(eps, (int, float)) and eps > 0,
            _config_field("rms_norm_eps"), f"must be > 0, got {eps!r}")
    return cls(
        vocab_size=config["vocab_size"], hidden_size=config["hidden_size"],
        intermediate_size=config["intermediate_size"],
        num_hidden_layers=config["num_hidden_layers"],
        num_attention_heads=heads, num_key_value_heads=kv,
        head_dim=head_dim, rms_norm_eps=float(eps),
        rope_theta=float(config.get("rope_theta", 10000.0)),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        attention_bias=bool(config.get("attention_bias", False)),
        mlp_bias=bool(config.get("mlp_bias", False)))


class RMSNorm(nn.Module):
  """`scale * x / sqrt(mean(x^2) + eps)` over the last axis, in float32."""
  eps: float

  @nn.compact
  def __call__(self, x: Array) -> Array:
    scale = self.param("scale", nn.initializers.ones, (x.shape[-1],))
    x = x.astype(jnp.float32)
    x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.eps)
    return scale * x


def rotary(x: Array, theta: float) -> Array:
  """RoPE of `x` `[B, T, heads, d]` at positions 0..T-1 (module doc)."""
  t, d = x.shape[1], x.shape[-1]
  inv_freq = 1.0 / theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d)
  angles = jnp.arange(t, dtype=jnp.float32)[:, None] * inv_freq[None]
  angles = jnp.concatenate([angles, angles], axis=-1)[None, :, None]
  half = d // 2
  rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
  return x * jnp.cos(angles) + rotated * jnp.sin(angles)


class LlamaAttention(nn.Module):
  """Causal grouped-query attention with RoPE: `[B, T, D] -> [B, T, D]`."""
  config: LlamaConfig

  @nn.compact
  def __call__(self, x: Array) -> Array:
    c = self.config
    b, t, _ = x.shape
    dense = lambda n, name, bias: nn.Dense(n, use_bias=bias, name=name)
    q = dense(c.num_attention_heads * c.head_dim, "q_proj",
              c.attention_bias)(x)
    k = dense(c.num_key_value_heads * c.head_dim, "k_proj",
              c.attention_bias)(x)
    v = dense(c.num_key_value_heads * c.head_dim, "v_proj",
              c.attention_bias)(x)
    groups = c.num_attention_heads // c.num_key_value_heads
    q = rotary(q.reshape(b, t, c.num_attention_heads, c.head_dim),
               c.rope_theta)
    k = rotary(k.reshape(b, t, c.num_key_value_heads, c.head_dim),
               c.rope_theta)
    v = v.reshape(b, t, c.num_key_value_heads, c.head_dim)
    q = q.reshape(b, t, c.num_key_value_heads, groups, c.head_dim)
    scores = jnp.einsum("btkgd,bskd->bkgts", q, k) * c.head_dim ** -0.5
    causal = jnp.tril(jnp.ones((t, t), bool))
    scores = jnp.where(causal, scores, jnp.finfo(jnp.float32).min)
    weights = jax.nn.softmax(scores.astype(jnp.float32), axis=-1)
    out = jnp.einsum("bkgts,bskd->btkgd", weights, v)
    out = out.reshape(b, t, c.num_attention_heads * c.head_dim)
    return dense(c.hidden_size, "o_proj", c.attention_bias)(out)


class LlamaDecoder(nn.Module):
  """`LlamaForCausalLM` (module doc) on `[B, T]` token ids.

  Attributes:
    config: the checkpoint's `LlamaConfig`.
    moe_layers: layer indices whose MLP is an `MoeLayer` (a carved model).
    moe: the filled `moe` dict of those layers (`MOE_DEFAULTS` fields).
  """
  config: LlamaConfig
  moe_layers: tuple[int, ...] = ()
  moe: Optional[Mapping[str, Any]] = None

  def __post_init__(self):
    layers = tuple(self.moe_layers)
    n = self.config.num_hidden_layers
    require(all(isinstance(i, int) and 0 <= i < n for i in layers),
            "moe_layers", f"must be layer indices in 0..{n - 1}, got "
            f"{layers}")
    require(not layers or self.moe is not None, "moe",
            "MoE layers need an moe config")
    object.__setattr__(self, "moe_layers", layers)
    object.__setattr__(self, "moe", moe_config(self.moe))
    super().__post_init__()

  @nn.compact
  def __call__(self, tokens: Array, *, deterministic: bool = True,
               update_state: bool = False) -> tuple[Array, dict[str, Any]]:
    """Logits `[B, T, V]` (float32) and the metrics (`auxiliary_loss`, and
    `layer_i` of each MoE layer)."""
    c = self.config
    embed = nn.Embed(c.vocab_size, c.hidden_size, name="embed_tokens")
    h = embed(tokens).astype(jnp.float32)
    metrics: dict[str, Any] = {}
    for i in range(c.num_hidden_layers):
      h, layer_metrics = LlamaLayer(
          c, self.moe if i in self.moe_layers else None, i,
          name=param_name(i))(h, deterministic=deterministic,
                              update_state=update_state)
      if layer_metrics is not None:
        metrics[metric_key(i)] = layer_metrics
    h = RMSNorm(c.rms_norm_eps, name="norm")(h)
    if c.tie_word_embeddings:
      logits = embed.attend(h)
    else:
      logits = nn.Dense(c.vocab_size, use_bias=False, name="lm_head")(h)
    metrics["auxiliary_loss"] = sum(
        (v["auxiliary_loss"] for v in metrics.values()),
        jnp.zeros((), jnp.float32))
    return logits.astype(jnp.float32), metrics


class LlamaLayer(nn.Module):
  """One decoder layer (pre-norm attention, then pre-norm MLP or MoE)."""
  config: LlamaConfig
  moe: Optional[Mapping[str, Any]]
  block: int

  @nn.compact
  def __call__(self, h: Array, *, deterministic: bool, update_state: bool
               ) -> tuple[Array, Optional[dict]]:
    c = self.config
    h = h + LlamaAttention(c, name="self_attn")(
        RMSNorm(c.rms_norm_eps, name="input_layernorm")(h))
    x = RMSNorm(c.rms_norm_eps, name="post_attention_layernorm")(h)
    if self.moe is None:
      return h + DenseMlp(c.intermediate_size, activation="swiglu",
                          output_bias=c.mlp_bias, name="Mlp")(x), None
    layer = build_moe_layer(self.moe, c.intermediate_size, 0.0, jnp.float32,
                            "swiglu", name="Moe")
    ctx = RoutingContext(block=self.block, moe_blocks=(self.block,))
    y, metrics, _ = layer(x, ctx, deterministic=deterministic,
                          update_state=update_state)
    return h + y, metrics


# ------------------------------------------------------------------ loading


def _tensor(tensors: Mapping[str, np.ndarray], name: str,
            shape: tuple[int, ...], field: str) -> np.ndarray:
  require(name in tensors, field, f"the checkpoint has no tensor {name!r}")
  value = tensors[name]
  require(tuple(value.shape) == shape, field,
          f"tensor {name!r} has shape {tuple(value.shape)}, {CONFIG_FILE} "
          f"implies {shape}")
  return np.asarray(value, np.float32)


def params_from_hf(tensors: Mapping[str, np.ndarray], config: LlamaConfig,
                   field: str = "checkpoint_dir") -> Params:
  """The `LlamaDecoder` params (float32) of a checkpoint's tensors.

  torch `Linear` weights `[out, in]` become kernels `[in, out]`. A missing
  tensor, a shape other than `config`'s, or a tensor the model does not
  use is an error naming `field`."""
  c = config
  used = set()

  def get(name: str, *shape: int) -> np.ndarray:
    used.add(name)
    return _tensor(tensors, name, shape, field)

  def linear(name: str, n_in: int, n_out: int, bias: bool) -> Params:
    out = {"kernel": get(f"{name}.weight", n_out, n_in).T}
    if bias:
      out["bias"] = get(f"{name}.bias", n_out)
    return out

  d, f = c.hidden_size, c.intermediate_size
  q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
  params: Params = {
      "embed_tokens": {"embedding": get("model.embed_tokens.weight",
                                        c.vocab_size, d)},
      "norm": {"scale": get("model.norm.weight", d)}}
  for i in range(c.num_hidden_layers):
    p = f"model.layers.{i}."
    a = c.attention_bias
    mlp = {"Dense_0": linear(p + "mlp.gate_proj", d, f, c.mlp_bias),
           "Dense_up": linear(p + "mlp.up_proj", d, f, c.mlp_bias),
           "Dense_1": linear(p + "mlp.down_proj", f, d, c.mlp_bias)}
    for name in ("Dense_0", "Dense_up"):  # DenseMlp's first layers: a bias.
      mlp[name].setdefault("bias", np.zeros(f, np.float32))
    params[param_name(i)] = {
        "input_layernorm": {"scale": get(p + "input_layernorm.weight", d)},
        "post_attention_layernorm": {
            "scale": get(p + "post_attention_layernorm.weight", d)},
        "self_attn": {"q_proj": linear(p + "self_attn.q_proj", d, q, a),
                      "k_proj": linear(p + "self_attn.k_proj", d, kv, a),
                      "v_proj": linear(p + "self_attn.v_proj", d, kv, a),
                      "o_proj": linear(p + "self_attn.o_proj", q, d, a)},
        "Mlp": mlp}
  if c.tie_word_embeddings:
    used.add("lm_head.weight")  # Hugging Face ties it to the embedding.
  else:
    params["lm_head"] = linear("lm_head", d, c.vocab_size, False)
  extra = sorted(n for n in tensors if n not in used
                 and not n.endswith(_IGNORED_SUFFIXES))
  require(not extra, field, f"the checkpoint has tensors a LLaMA model does "
          f"not use, e.g. {extra[:3]} ({len(extra)} in all)")
  return params


def load_llama(directory: str, field: str = "checkpoint_dir"
               ) -> tuple[LlamaConfig, Params]:
  """The config and params of a Hugging Face LLaMA directory
  (`config.json` and `model.safetensors` or its sharded index)."""
  config = LlamaConfig.from_hf(read_config(directory, field))
  return config, params_from_hf(load_checkpoint(directory, field), config,
                                field)


__all__ = ["LlamaAttention", "LlamaConfig", "LlamaDecoder", "LlamaLayer",
           "RMSNorm", "load_llama", "params_from_hf", "rotary"]
