"""Independent NumPy (float64) reference of vmoe's / vit_jax's eval forward.

Written from the upstream sources only (google-research/vmoe and
google-research/vision_transformer), never from `vmoe_ext`'s model code, so
that checkpoints in vmoe's layout imported into our model by mapping rules can
be checked to give the same logits. Evaluation mode: no dropout, and the
routers are deterministic (no noise on the gating logits).

Which upstream function each part follows:

- `patch_embed`: `nn.Conv(features=hidden_size, kernel_size=patch_size,
  strides=patch_size, padding='VALID', name='embedding')` in
  `VisionTransformerMoe.__call__` (vmoe/nn/vit_moe.py) and
  `VisionTransformer.__call__` (vit_jax/models_vit.py); kernel `[ph, pw, C, D]`,
  images NHWC, the grid flattened row-major into tokens.
- classifier token: `cls` `[1, 1, D]` tiled and prepended when
  `classifier == 'token'` (both models).
- `add_position_emb`: `EncoderMoe.add_position_emb` (vit_moe.py): 'learned'
  is vit_jax's `AddPositionEmbs` (`Encoder/posembed_input/pos_embedding`),
  'sincos2d' is the MoCo-v3 embedding (omega = arange(c//4) / (c//4 - 1),
  1 / temperature**omega, concat [sin x, cos x, sin y, cos y], added to the
  grid tokens only, the classifier token gets none), 'none' adds nothing.
- `layer_norm`: `flax.linen.LayerNorm` (eps 1e-6, biased variance over the
  last axis, `scale` and `bias`).
- `multi_head_attention`: `flax.linen.MultiHeadDotProductAttention` with
  `dot_product_attention`: DenseGeneral `query`/`key`/`value` kernels
  `[D, heads, head_dim]` (+ bias `[heads, head_dim]`), optional
  `normalize_qk` (LayerNorm `query_ln`/`key_ln` without bias over head_dim),
  queries scaled by 1/sqrt(head_dim), softmax over keys, `out` kernel
  `[heads, head_dim, D]` + bias `[D]`.
- `mlp_block`: vit_jax `MlpBlock` (Dense_0 -> `nn.gelu`, i.e. the tanh
  approximation -> Dense_1); vmoe's `MlpBlock` subclasses it.
- `encoder_block`: vmoe `EncoderBlock` / vit_jax `Encoder1DBlock`:
  x = x + Attn(LN_0(x)); x = x + Mlp(LN_1(x)) (pre-LN, two residuals).
- MoE blocks: `MlpMoeBlock.__call__` (vit_moe.py) reshapes all tokens
  `[B, N, D]` -> `[-1, group_size, D]` (row-major over [B, N]); the router is
  `NoisyTopExpertsPerItemRouter` (vmoe/nn/routing.py) with
  `deterministic=True`: gates = softmax(x @ Router/dense/kernel) (no bias);
  the dispatcher is `get_top_experts_per_item_dispatcher` +
  `_get_top_experts_per_item_common` (vmoe/moe.py), capacity from
  `compute_capacity`; experts are vmoe `MlpBlock`s under `sparse_moe_spmd`
  (params stacked on axis 0: `Moe/Mlp/Dense_0/kernel [E, D, H]`, ...), and
  the combine is the gate-weighted sum of the kept choices
  (`EinsumDispatcher.combine` / `ExpertIndicesDispatcher.combine`).
- `map_head`: vmoe `MapHead`: attention of a learned `probe` over the tokens,
  then out = a + Mlp(LayerNorm(a)) (no residual from the probe itself).
- pre_logits / head: Dense + tanh when `representation_size` is set (else
  identity), then the `head` Dense (both models).

The vit_jax dense layout (`Transformer/encoderblock_{i}/{LayerNorm_0,
MultiHeadDotProductAttention_1, LayerNorm_2, MlpBlock_3}`) is handled by
`vit_jax_forward`, reusing the same pieces.
"""

from __future__ import annotations

import math
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple

import numpy as np

Params = Mapping[str, Any]

LAYER_NORM_EPS = 1e-6  # flax.linen.LayerNorm default.
DEFAULT_SINCOS2D_TEMPERATURE = 10_000.  # EncoderMoe.DEFAULT_SINCOS2D_TEMPERATURE
DEFAULT_CAPACITY_MULTIPLE_OF = 4  # get_top_experts_per_item_dispatcher default.


def _f64(x) -> np.ndarray:
  return np.asarray(x, dtype=np.float64)


# ----------------------------------------------------------------------------
# Shared building blocks.
# ----------------------------------------------------------------------------


def layer_norm(x: np.ndarray, scale: Optional[np.ndarray],
               bias: Optional[np.ndarray],
               eps: float = LAYER_NORM_EPS) -> np.ndarray:
  """flax LayerNorm over the last axis: (x - mean) / sqrt(var + eps) * s + b."""
  x = _f64(x)
  mean = x.mean(axis=-1, keepdims=True)
  var = ((x - mean) ** 2).mean(axis=-1, keepdims=True)
  y = (x - mean) / np.sqrt(var + eps)
  if scale is not None:
    y = y * _f64(scale)
  if bias is not None:
    y = y + _f64(bias)
  return y


def layer_norm_params(p: Params, x: np.ndarray) -> np.ndarray:
  return layer_norm(x, p.get("scale"), p.get("bias"))


def gelu_tanh(x: np.ndarray) -> np.ndarray:
  """jax.nn.gelu(approximate=True), the default of flax's `nn.gelu`."""
  x = _f64(x)
  return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) *
                                  (x + 0.044715 * x ** 3)))


def dense(p: Params, x: np.ndarray) -> np.ndarray:
  y = _f64(x) @ _f64(p["kernel"])
  if "bias" in p:
    y = y + _f64(p["bias"])
  return y


def mlp_block(p: Params, x: np.ndarray) -> np.ndarray:
  """vit_jax MlpBlock: Dense_0 -> gelu (tanh form) -> Dense_1."""
  return dense(p["Dense_1"], gelu_tanh(dense(p["Dense_0"], x)))


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
  x = _f64(x)
  z = np.exp(x - x.max(axis=axis, keepdims=True))
  return z / z.sum(axis=axis, keepdims=True)


def multi_head_attention(p: Params, inputs_q: np.ndarray,
                         inputs_kv: np.ndarray,
                         qk_norm: bool = False) -> np.ndarray:
  """flax MultiHeadDotProductAttention (deterministic, no mask).

  The number of heads is read from the kernels (`query/kernel` is
  `[D, heads, head_dim]`).
  """
  inputs_q, inputs_kv = _f64(inputs_q), _f64(inputs_kv)

  def proj(name, x):
    q = np.einsum("bnd,dhk->bnhk", x, _f64(p[name]["kernel"]))
    if "bias" in p[name]:
      q = q + _f64(p[name]["bias"])
    return q

  q = proj("query", inputs_q)
  k = proj("key", inputs_kv)
  v = proj("value", inputs_kv)
  if qk_norm:
    # LayerNorm(use_bias=False) over the last axis (head_dim).
    q = layer_norm(q, p["query_ln"]["scale"], None)
    k = layer_norm(k, p["key_ln"]["scale"], None)
  head_dim = q.shape[-1]
  q = q / math.sqrt(head_dim)
  logits = np.einsum("bqhd,bkhd->bhqk", q, k)
  weights = softmax(logits, axis=-1)
  attended = np.einsum("bhqk,bkhd->bqhd", weights, v)
  out = np.einsum("bqhd,hdo->bqo", attended, _f64(p["out"]["kernel"]))
  if "bias" in p["out"]:
    out = out + _f64(p["out"]["bias"])
  return out


def patch_embed(p: Params, images: np.ndarray,
                patch_size: Sequence[int]) -> np.ndarray:
  """nn.Conv(kernel=strides=patch_size, padding='VALID'): `[B, h, w, D]`."""
  images = _f64(images)
  ph, pw = patch_size
  b, hh, ww, c = images.shape
  h, w = hh // ph, ww // pw  # VALID padding drops the remainder.
  x = images[:, :h * ph, :w * pw, :].reshape(b, h, ph, w, pw, c)
  y = np.einsum("bhiwjc,ijcd->bhwd", x, _f64(p["kernel"]))
  if "bias" in p:
    y = y + _f64(p["bias"])
  return y


def sincos2d_posemb(h: int, w: int, c: int,
                    temperature: float = DEFAULT_SINCOS2D_TEMPERATURE
                    ) -> np.ndarray:
  """`[h * w, c]` MoCo-v3 embedding exactly as in EncoderMoe.add_position_emb."""
  if c % 4 != 0 or c < 8:
    raise ValueError(f"The hidden_size={c} must be multiple of 4 and >= 8.")
  y, x = np.mgrid[:h, :w].astype(np.float64)
  y, x = y.flatten(), x.flatten()
  omega = np.arange(c // 4, dtype=np.float64) / (c // 4 - 1)
  omega = 1. / (temperature ** omega)
  x = np.einsum("n,d->nd", x, omega)
  y = np.einsum("n,d->nd", y, omega)
  return np.concatenate([np.sin(x), np.cos(x), np.sin(y), np.cos(y)], axis=-1)


def add_position_emb(encoder_params: Params, position_emb: Optional[Mapping],
                     x: np.ndarray, grid_hw: Tuple[int, int]) -> np.ndarray:
  """EncoderMoe.add_position_emb ('learned' by default)."""
  position_emb = dict(position_emb or {})
  name = position_emb.get("name", "learned")
  if name == "none":
    return x
  if name == "learned":
    return x + _f64(encoder_params["posembed_input"]["pos_embedding"])
  if name == "sincos2d":
    _, n, c = x.shape
    h, w = grid_hw
    temperature = position_emb.get("temperature", DEFAULT_SINCOS2D_TEMPERATURE)
    posemb = sincos2d_posemb(h, w, c, temperature)[None]
    if n == h * w:
      return x + posemb
    if n == h * w + 1:  # The classifier token gets no position embedding.
      return np.concatenate([x[:, :1], x[:, 1:] + posemb], axis=1)
    raise ValueError(f"Unsupported sequence length {n=} for {h=} and {w=}.")
  raise ValueError(f"Unsupported position embedding: {position_emb}")


# ----------------------------------------------------------------------------
# Routing (vmoe/moe.py, vmoe/nn/routing.py).
# ----------------------------------------------------------------------------


def compute_capacity(num_tokens: int, num_experts: int, capacity_factor: float,
                     ceil_or_round: str = "ceil",
                     multiple_of: Optional[int] = DEFAULT_CAPACITY_MULTIPLE_OF
                     ) -> int:
  """vmoe.moe.compute_capacity (num_tokens = group_size * K for top-K)."""
  if ceil_or_round == "ceil":
    capacity = int(math.ceil(num_tokens * capacity_factor / num_experts))
  elif ceil_or_round == "round":
    # Python's round: half to even, as in vmoe.
    capacity = int(round(num_tokens * capacity_factor / num_experts))
  else:
    raise ValueError(f"Unsupported {ceil_or_round=}")
  if capacity < 1:
    raise ValueError(f"capacity = {capacity} must be >= 1 ({num_tokens=}, "
                     f"{num_experts=}, {capacity_factor=}).")
  if multiple_of and multiple_of > 0:
    capacity += (-capacity) % multiple_of
  return capacity


def top_k_desc(row: np.ndarray, k: int) -> list:
  """jax.lax.top_k on a vector: largest first, ties to the lower index."""
  order = sorted(range(len(row)), key=lambda e: (-row[e], e))
  return order[:k]


def top_experts_per_item_routing(gates: np.ndarray, num_selected_experts: int,
                                 capacity: int, batch_priority: bool
                                 ) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Routing of ONE group, following `_get_top_experts_per_item_common`.

  Args:
    gates: `[S, E]` softmax gates of the group.
    num_selected_experts: K.
    capacity: buffer size C of each expert.
    batch_priority: Batch Priority Routing (tokens sorted by their top gate,
      stable, descending) instead of token order.

  Returns:
    expert_index `[S, K]` (int), buffer_index `[S, K]` (int, position in the
    expert's buffer, >= capacity means dropped) and combine_weights `[S, K]`
    (the gate value of each kept choice, 0 for dropped ones; NOT renormalised).
  """
  gates = _f64(gates)
  s_size, _ = gates.shape
  k_size = num_selected_experts
  expert_index = np.array([top_k_desc(gates[s], k_size) for s in range(s_size)],
                          dtype=np.int64).reshape(s_size, k_size)
  top_gates = np.take_along_axis(gates, expert_index, axis=1)
  if batch_priority:
    # jnp.argsort(-combine_weights[:, 0]) is a stable sort.
    token_order = list(np.argsort(-top_gates[:, 0], kind="stable"))
  else:
    token_order = list(range(s_size))
  # The (K * S,) flattening with K leading + cumsum means: every token's 1st
  # choice takes a buffer slot (in token_order) before any 2nd choice, etc.
  fill = {}
  buffer_index = np.full((s_size, k_size), -1, dtype=np.int64)
  for k in range(k_size):
    for s in token_order:
      e = int(expert_index[s, k])
      buffer_index[s, k] = fill.get(e, 0)
      fill[e] = fill.get(e, 0) + 1
  kept = buffer_index < capacity
  combine_weights = np.where(kept, top_gates, 0.0)
  return expert_index, buffer_index, combine_weights


def moe_combine_from_gates(gates: np.ndarray, x: np.ndarray,
                           expert_params: Params, num_selected_experts: int,
                           capacity: int, batch_priority: bool) -> np.ndarray:
  """MoE-of-MLPs output of ONE group `[S, D]` given its gates `[S, E]`."""
  x = _f64(x)
  expert_index, _, combine_weights = top_experts_per_item_routing(
      gates, num_selected_experts, capacity, batch_priority)
  out_dim = np.shape(expert_params["Dense_1"]["kernel"])[-1]
  y = np.zeros((x.shape[0], out_dim))
  for s in range(x.shape[0]):
    for k in range(num_selected_experts):
      w = combine_weights[s, k]
      if w == 0.0:  # Dropped (over capacity): contributes nothing.
        continue
      e = int(expert_index[s, k])
      y[s] += w * mlp_block(expert_slice(expert_params, e), x[s][None])[0]
  return y


def expert_slice(expert_params: Params, e: int) -> Dict[str, Any]:
  """Params of expert `e` from the stacked (axis 0) `Moe/Mlp` tree."""
  return {name: {k: np.asarray(v)[e] for k, v in layer.items()}
          for name, layer in expert_params.items()}


def _dispatcher_settings(moe: Mapping, group_size: int, num_experts: int
                         ) -> Tuple[int, int, bool]:
  """(K, capacity, batch_priority) from the `moe.router` config."""
  router = dict(moe.get("router") or {})
  router_name = router.pop("name", "NoisyTopExpertsPerItemRouter")
  if router_name != "NoisyTopExpertsPerItemRouter":
    raise NotImplementedError(f"Unsupported router {router_name!r}")
  if router.get("deterministic") is False and router.get("noise_std",
                                                         1.0) != 0.0:
    raise ValueError("The reference only covers deterministic routing.")
  k = int(router.get("num_selected_experts", 1))
  if not num_experts >= k >= 1:
    raise ValueError(f"Need num_experts >= K >= 1, got {num_experts=} {k=}")
  disp = dict(router.get("dispatcher") or {})
  if disp.get("name", "einsum") not in ("einsum", "indices"):
    raise ValueError(f"Unknown dispatcher type: {disp['name']!r}")
  capacity = disp.get("capacity")
  capacity_factor = disp.get("capacity_factor")
  if (capacity is None) == (capacity_factor is None):
    raise ValueError("Specify either 'capacity' or 'capacity_factor'.")
  # vmoe's keyword is `capacity_multiple_of`; `multiple_of` is accepted too.
  mult_keys = [key for key in ("capacity_multiple_of", "multiple_of")
               if key in disp]
  if len(mult_keys) == 2 and disp[mult_keys[0]] != disp[mult_keys[1]]:
    raise ValueError("Conflicting capacity_multiple_of / multiple_of.")
  multiple_of = (disp[mult_keys[0]] if mult_keys
                 else DEFAULT_CAPACITY_MULTIPLE_OF)
  if not capacity:
    capacity = compute_capacity(
        num_tokens=group_size * k, num_experts=num_experts,
        capacity_factor=capacity_factor,
        ceil_or_round=disp.get("capacity_ceil_or_round", "ceil"),
        multiple_of=multiple_of)
  return k, int(capacity), bool(disp.get("batch_priority", False))


def mlp_moe_block(p: Params, moe: Mapping, x: np.ndarray) -> np.ndarray:
  """vmoe MlpMoeBlock (eval): `p` is the `Moe` subtree, x `[B, N, D]`."""
  x = _f64(x)
  b, n, d = x.shape
  group_size = int(moe["group_size"])
  if (b * n) % group_size:
    raise ValueError(f"{b * n} tokens are not a multiple of {group_size=}")
  router_kernel = _f64(p["Router"]["dense"]["kernel"])  # [D, E]
  num_experts = router_kernel.shape[1]
  if "num_experts" in moe and moe["num_experts"] != num_experts:
    raise ValueError("num_experts does not match Router/dense/kernel")
  k, capacity, batch_priority = _dispatcher_settings(moe, group_size,
                                                     num_experts)
  groups = x.reshape(-1, group_size, d)  # Row-major over [B, N].
  out = []
  for g in range(groups.shape[0]):
    gates = softmax(groups[g] @ router_kernel, axis=-1)  # [S, E]
    out.append(moe_combine_from_gates(gates, groups[g], p["Mlp"], k, capacity,
                                      batch_priority))
  out = np.stack(out)
  return out.reshape(b, n, out.shape[-1])


# ----------------------------------------------------------------------------
# Encoder blocks and heads.
# ----------------------------------------------------------------------------


def encoder_block(x: np.ndarray, ln_attn: Params, attn: Params, ln_mlp: Params,
                  mlp_fn, qk_norm: bool = False) -> np.ndarray:
  """Pre-LN block: x + Attn(LN(x)), then + Mlp(LN(.))."""
  y = layer_norm_params(ln_attn, x)
  x = x + multi_head_attention(attn, y, y, qk_norm=qk_norm)
  return x + mlp_fn(layer_norm_params(ln_mlp, x))


def map_head(p: Params, x: np.ndarray, qk_norm: bool = False) -> np.ndarray:
  """vmoe MapHead: a = MHA(probe, x); return (a + Mlp(LayerNorm(a)))[:, 0]."""
  probe = np.tile(_f64(p["probe"]), [x.shape[0], 1, 1])
  a = multi_head_attention(p["MultiHeadDotProductAttention"], probe, x,
                           qk_norm=qk_norm)
  y = mlp_block(p["Mlp"], layer_norm_params(p["LayerNorm"], a))
  return (a + y)[:, 0, :]


def _pre_logits_and_head(params: Params, x: np.ndarray,
                         representation_size, num_classes) -> np.ndarray:
  if representation_size is not None:
    x = np.tanh(dense(params["pre_logits"], x))
  if num_classes:
    x = dense(params["head"], x)
  return x


def _embed_tokens(params: Params, images: np.ndarray, patch_size,
                  classifier: str) -> Tuple[np.ndarray, Tuple[int, int]]:
  x = patch_embed(params["embedding"], images, patch_size)
  b, h, w, d = x.shape
  x = x.reshape(b, h * w, d)
  if classifier == "token":
    cls = np.tile(_f64(params["cls"]), [b, 1, 1])
    x = np.concatenate([cls, x], axis=1)
  return x, (h, w)


def _as_pair(v) -> Tuple[int, int]:
  if isinstance(v, Mapping):
    v = v["size"]
  if np.ndim(v) == 0:
    return int(v), int(v)
  return tuple(int(i) for i in v)


# ----------------------------------------------------------------------------
# vmoe VisionTransformerMoe.
# ----------------------------------------------------------------------------


def _moe_layers(encoder: Mapping) -> Tuple[int, ...]:
  moe = encoder.get("moe") or {}
  return tuple(int(i) for i in (moe.get("layers") or ()))


def vmoe_forward(params: Params, config: Mapping,
                 images: np.ndarray) -> np.ndarray:
  """Logits `[B, num_classes]` (float64) of vmoe's VisionTransformerMoe.

  Args:
    params: nested dict in vmoe's layout (see the module docstring).
    config: vmoe's model config dict (num_classes, patch_size, hidden_size,
      classifier, representation_size, encoder{num_layers, num_heads, mlp_dim,
      attention_qk_norm, position_emb, moe{layers, num_experts, group_size,
      router{num_selected_experts, dispatcher{...}}}}).
    images: `[B, H, W, C]`.
  """
  classifier = config.get("classifier", "token")
  if classifier not in ("token", "gap", "map", "0"):
    raise ValueError(f"Unknown classifier: {classifier!r}")
  encoder = config["encoder"]
  qk_norm = bool(encoder.get("attention_qk_norm", False))
  x, grid_hw = _embed_tokens(params, images, _as_pair(config["patch_size"]),
                             classifier)
  enc_p = params["Encoder"]
  x = add_position_emb(enc_p, encoder.get("position_emb"), x, grid_hw)
  moe_layers = _moe_layers(encoder)
  for i in range(int(encoder["num_layers"])):
    bp = enc_p[f"encoderblock_{i}"]
    if i in moe_layers:
      mlp_fn = lambda y, bp=bp: mlp_moe_block(bp["Moe"], encoder["moe"], y)  # noqa: E731
    else:
      mlp_fn = lambda y, bp=bp: mlp_block(bp["Mlp"], y)  # noqa: E731
    x = encoder_block(x, bp["LayerNorm_0"], bp["SelfAttention"],
                      bp["LayerNorm_1"], mlp_fn, qk_norm=qk_norm)
  x = layer_norm_params(enc_p["encoder_norm"], x)
  if classifier in ("token", "0"):
    x = x[:, 0]
  elif classifier == "gap":
    x = x.mean(axis=1)
  else:  # map
    x = map_head(params["MapHead"], x, qk_norm=qk_norm)
  return _pre_logits_and_head(params, x, config.get("representation_size"),
                              config.get("num_classes"))


# ----------------------------------------------------------------------------
# vit_jax VisionTransformer (dense).
# ----------------------------------------------------------------------------


def _vit_jax_config(config: Mapping) -> Dict[str, Any]:
  """Accepts vit_jax's config (patches.size, transformer{...}) or vmoe-style
  keys (patch_size, encoder{...})."""
  if config.get("resnet") is not None:
    raise NotImplementedError("Hybrid (ResNet) ViTs are not covered.")
  transformer = config.get("transformer") or config.get("encoder")
  patch = config.get("patches", config.get("patch_size"))
  return dict(
      num_classes=config.get("num_classes"),
      patch_size=_as_pair(patch),
      hidden_size=int(config["hidden_size"]),
      classifier=config.get("classifier", "token"),
      representation_size=config.get("representation_size"),
      num_layers=int(transformer["num_layers"]),
      num_heads=int(transformer["num_heads"]),
      mlp_dim=int(transformer["mlp_dim"]),
      add_position_embedding=transformer.get("add_position_embedding", True))


def vit_jax_forward(params: Params, config: Mapping,
                    images: np.ndarray) -> np.ndarray:
  """Logits of vit_jax's dense VisionTransformer ('token' or 'gap')."""
  c = _vit_jax_config(config)
  if c["classifier"] not in ("token", "gap"):
    raise ValueError(f"Invalid classifier={c['classifier']}")
  x, _ = _embed_tokens(params, images, c["patch_size"], c["classifier"])
  tp = params["Transformer"]
  if c["add_position_embedding"]:
    x = x + _f64(tp["posembed_input"]["pos_embedding"])
  for i in range(c["num_layers"]):
    bp = tp[f"encoderblock_{i}"]
    x = encoder_block(x, bp["LayerNorm_0"], bp["MultiHeadDotProductAttention_1"],
                      bp["LayerNorm_2"],
                      lambda y, bp=bp: mlp_block(bp["MlpBlock_3"], y))
  x = layer_norm_params(tp["encoder_norm"], x)
  x = x[:, 0] if c["classifier"] == "token" else x.mean(axis=1)
  return _pre_logits_and_head(params, x, c["representation_size"],
                              c["num_classes"])


# ----------------------------------------------------------------------------
# Random parameter trees (float32, nontrivial everywhere).
# ----------------------------------------------------------------------------


def _normal(rng: np.random.Generator, shape, std: float, mean: float = 0.0):
  return (mean + std * rng.standard_normal(shape)).astype(np.float32)


def _rand_dense(rng, shape_in: Sequence[int], shape_out: Sequence[int],
                bias: bool = True, fan_in: Optional[int] = None):
  fan_in = fan_in or int(np.prod(shape_in))
  p = {"kernel": _normal(rng, (*shape_in, *shape_out), 1.0 / math.sqrt(fan_in))}
  if bias:
    p["bias"] = _normal(rng, tuple(shape_out), 0.1)
  return p


def _rand_ln(rng, d: int, bias: bool = True):
  p = {"scale": _normal(rng, (d,), 0.1, mean=1.0)}
  if bias:
    p["bias"] = _normal(rng, (d,), 0.1)
  return p


def _rand_mlp(rng, d: int, mlp_dim: int):
  return {"Dense_0": _rand_dense(rng, (d,), (mlp_dim,)),
          "Dense_1": _rand_dense(rng, (mlp_dim,), (d,))}


def _rand_attention(rng, d: int, num_heads: int, qk_norm: bool = False):
  if d % num_heads:
    raise ValueError(f"hidden {d} not divisible by {num_heads} heads")
  hd = d // num_heads
  p = {name: _rand_dense(rng, (d,), (num_heads, hd))
       for name in ("query", "key", "value")}
  p["out"] = _rand_dense(rng, (num_heads, hd), (d,))
  if qk_norm:
    p["query_ln"] = _rand_ln(rng, hd, bias=False)
    p["key_ln"] = _rand_ln(rng, hd, bias=False)
  return p


def _grid_tokens(image_shape, patch_size) -> Tuple[int, int]:
  hh, ww = tuple(image_shape)[-3:-1]
  ph, pw = patch_size
  return hh // ph, ww // pw


def _rand_stem_and_head(rng, p, d, patch_size, channels, classifier,
                        representation_size, num_classes):
  ph, pw = patch_size
  p["embedding"] = _rand_dense(rng, (ph, pw, channels), (d,))
  if classifier == "token":
    p["cls"] = _normal(rng, (1, 1, d), 0.5)
  feat = d
  if representation_size is not None:
    p["pre_logits"] = _rand_dense(rng, (d,), (int(representation_size),))
    feat = int(representation_size)
  if num_classes:
    p["head"] = _rand_dense(rng, (feat,), (int(num_classes),))


def random_vmoe_params(rng: np.random.Generator, config: Mapping,
                       image_shape) -> Dict[str, Any]:
  """A random tree in vmoe's VisionTransformerMoe layout (float32).

  `image_shape` is `(H, W, C)` or `(B, H, W, C)`.
  """
  d = int(config["hidden_size"])
  patch_size = _as_pair(config["patch_size"])
  classifier = config.get("classifier", "token")
  encoder = config["encoder"]
  qk_norm = bool(encoder.get("attention_qk_norm", False))
  num_heads, mlp_dim = int(encoder["num_heads"]), int(encoder["mlp_dim"])
  h, w = _grid_tokens(image_shape, patch_size)
  n = h * w + (1 if classifier == "token" else 0)
  p: Dict[str, Any] = {}
  _rand_stem_and_head(rng, p, d, patch_size, tuple(image_shape)[-1],
                      classifier, config.get("representation_size"),
                      config.get("num_classes"))
  enc: Dict[str, Any] = {}
  pos_name = (encoder.get("position_emb") or {}).get("name", "learned")
  if pos_name == "learned":
    enc["posembed_input"] = {"pos_embedding": _normal(rng, (1, n, d), 0.1)}
  moe = encoder.get("moe") or {}
  moe_layers = _moe_layers(encoder)
  for i in range(int(encoder["num_layers"])):
    blk = {"LayerNorm_0": _rand_ln(rng, d),
           "SelfAttention": _rand_attention(rng, d, num_heads, qk_norm),
           "LayerNorm_1": _rand_ln(rng, d)}
    if i in moe_layers:
      e = int(moe["num_experts"])
      hid = int(moe.get("mlp_dim", mlp_dim))  # moe kwargs override mlp_dim.
      blk["Moe"] = {
          "Router": {"dense": {"kernel": _normal(rng, (d, e),
                                                 1.0 / math.sqrt(d))}},
          "Mlp": {
              "Dense_0": {"kernel": _normal(rng, (e, d, hid),
                                            1.0 / math.sqrt(d)),
                          "bias": _normal(rng, (e, hid), 0.1)},
              "Dense_1": {"kernel": _normal(rng, (e, hid, d),
                                            1.0 / math.sqrt(hid)),
                          "bias": _normal(rng, (e, d), 0.1)}}}
    else:
      blk["Mlp"] = _rand_mlp(rng, d, mlp_dim)
    enc[f"encoderblock_{i}"] = blk
  enc["encoder_norm"] = _rand_ln(rng, d)
  p["Encoder"] = enc
  if classifier == "map":
    p["MapHead"] = {
        "probe": _normal(rng, (1, 1, d), 0.5),
        "MultiHeadDotProductAttention": _rand_attention(rng, d, num_heads,
                                                        qk_norm),
        "LayerNorm": _rand_ln(rng, d),
        "Mlp": _rand_mlp(rng, d, mlp_dim)}
  return p


def random_vit_jax_params(rng: np.random.Generator, config: Mapping,
                          image_shape) -> Dict[str, Any]:
  """A random tree in vit_jax's VisionTransformer layout (float32)."""
  c = _vit_jax_config(config)
  d = c["hidden_size"]
  h, w = _grid_tokens(image_shape, c["patch_size"])
  n = h * w + (1 if c["classifier"] == "token" else 0)
  p: Dict[str, Any] = {}
  _rand_stem_and_head(rng, p, d, c["patch_size"], tuple(image_shape)[-1],
                      c["classifier"], c["representation_size"],
                      c["num_classes"])
  tp: Dict[str, Any] = {}
  if c["add_position_embedding"]:
    tp["posembed_input"] = {"pos_embedding": _normal(rng, (1, n, d), 0.1)}
  for i in range(c["num_layers"]):
    tp[f"encoderblock_{i}"] = {
        "LayerNorm_0": _rand_ln(rng, d),
        "MultiHeadDotProductAttention_1": _rand_attention(rng, d,
                                                          c["num_heads"]),
        "LayerNorm_2": _rand_ln(rng, d),
        "MlpBlock_3": _rand_mlp(rng, d, c["mlp_dim"])}
  tp["encoder_norm"] = _rand_ln(rng, d)
  p["Transformer"] = tp
  return p
