"""The language-model backbone of the ACMoE, Symphony and MomentumSMoE papers'
WikiText-103 / EnWik-8 experiments (docs/language_model.md): Switch ("sg...")
and GLaM ("sgsf...") layouts of a post-LayerNorm Transformer with cached
attention, built from the same routers, MoE layer and residual streams as the
vision backbones.

Shape letters: B batch rows (contiguous text streams), M tokens per block, L
attention span (= cache length), D model width, V vocabulary.

    h = Embed(tokens)                                    [B, M, D]
    for each layer l (architecture string, `vmoe_ext.models.lm_arch`):
      cache'[l] = last L rows of [cache[l], h]           (detached)
      h = LN_attention(h + Attention(h, [cache[l], h]))  (`seq_attention`)
      g, c:  y = LN_moe_output(h + Dropout(MoE(h)))
      m, a:  y = stream(h, MoE)          (momentum: LN_2(h - m))
      both:  h = LN_moe(h + y)           (h enters twice)
      f:     h = LN_ffn(h + Mlp(h))
    log_probs = log_softmax(h W_out + b_out)             [B, M, V]

No final LayerNorm; the output layer has a bias and is not tied to the
embedding. The stream state (the momentum) starts at zero in every call,
i.e. at every block of the text stream; the caches carry over blocks.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Optional, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from vmoe_ext.config.schema import renamed_scope
from vmoe_ext.errors import check, field_scope, require
from vmoe_ext.models.lm_arch import (STREAM_LETTERS, LayerSpec, blocks_of,
                                     default_architecture, moe_blocks,
                                     parse_architecture)
from vmoe_ext.models.lm_config import (LM_AC_ROUTER, LM_MOE_DEFAULTS,
                                       LM_ROUTER, LM_STREAMS, LM_XMOE_ROUTER,
                                       layer_moe, lm_moe_config,
                                       resolve_ac_router, resolve_stream)
from vmoe_ext.models.lm_init import authors_initialization
from vmoe_ext.models.precision import (cast_params, float32_state,
                                       resolve_precision_fields)
from vmoe_ext.models.seq_attention import (SeqAttention, next_cache,
                                           torch_bias_init, torch_linear_init)
from vmoe_ext.models.stack import (Segment, block_builder, check_remat,
                                   check_scan, is_scanned, plan_segments,
                                   run_stack, scan_tree, unscan_tree)
from vmoe_ext.models.sublayer import (DEFAULT_STREAM, MlpBlock,
                                      build_moe_layer, check_moe_placement,
                                      mlp_sublayer)
from vmoe_ext.moe.contract import RoutingContext
from vmoe_ext.moe.expert_parallel import ExpertParallel
from vmoe_ext.naming import param_name
from vmoe_ext.streams import STREAMS

Array = jax.Array
Cache = tuple[Array, ...]

INITIALIZATIONS = ("authors", "framework")


def _identity(x: Array) -> Array:
  return x


class LanguageLayer(nn.Module):
  """One layer: cached attention, then the sub-layer of letter `ffn`
  (post-LayerNorm; see the module docstring).

  Attributes:
    ffn: the sub-layer letter (`g`, `m`, `a`, `c` or `f`).
    moe: the filled `moe` dict of this layer (None for `f`).
    stream: the stream config of `m` / `a` layers (plain for the others).
  """
  ffn: str
  num_heads: int
  inner_hidden_size: int
  dropout_rate: float = 0.0
  moe: Optional[Mapping[str, Any]] = None
  stream: Mapping[str, Any] = dataclasses.field(
      default_factory=lambda: dict(DEFAULT_STREAM))
  layer_norm_epsilon: float = 1e-5
  dtype: Any = jnp.float32
  expert_parallel: Optional[ExpertParallel] = None

  @nn.compact
  def __call__(self, h: Array, cache: Array, key_pe: Array,
               ctx: RoutingContext, *, deterministic: bool = True,
               update_state: bool = False
               ) -> tuple[Array, RoutingContext, Optional[dict]]:
    """h: `[B, M, D]`, cache: `[B, L, D]` -> `[B, M, D]`, context, MoE
    metrics (None for a dense layer)."""
    norm = lambda name: nn.LayerNorm(epsilon=self.layer_norm_epsilon,
                                     dtype=self.dtype, name=name)
    a = SeqAttention(self.num_heads, self.dropout_rate, self.dtype,
                     name="Attention")(h, cache, key_pe,
                                       deterministic=deterministic)
    h = norm("LayerNorm_attention")(h + a)
    if self.moe is None:
      f = MlpBlock(self.inner_hidden_size, self.dropout_rate, self.dtype,
                   "relu", dropout_output=False, name="Mlp")(
                       h, deterministic=deterministic)
      return norm("LayerNorm_ffn")(h + f), ctx, None
    through_stream = self.ffn in STREAM_LETTERS
    drop = nn.Dropout(self.dropout_rate, name="MoeDropout")
    y, ctx, metrics = mlp_sublayer(
        h, ctx, _identity, moe=self.moe,
        stream=self.stream if through_stream else DEFAULT_STREAM,
        mlp_dim=self.inner_hidden_size, dropout_rate=self.dropout_rate,
        activation="relu", dtype=self.dtype,
        expert_parallel=self.expert_parallel, deterministic=deterministic,
        update_state=update_state,
        branch=lambda f: drop(f, deterministic=deterministic))
    if not through_stream:  # The MoE sub-layer's own post-norm.
      y = norm("LayerNorm_moe_output")(y)
    return norm("LayerNorm_moe")(h + y), ctx, metrics


class LanguageModel(nn.Module):
  """Word- or byte-level language model on `[B, M]` token blocks.

  Attributes:
    vocab_size: V.
    hidden_size: D.
    inner_hidden_size: the hidden width of the dense FFNs and (unless
      `moe.hidden_size`) of the experts.
    num_heads: attention heads (must divide D).
    num_layers: the authors' `nlayers`: pairs `s?` (transformer) or
      quadruples `s?sf` (glam) of the architecture string.
    attn_span: L, the positions each query attends to (the cache length).
    base_arch: "transformer" (Switch) or "glam".
    architecture: the sub-layer letters (`vmoe_ext.models.lm_arch`); None:
      every MoE layer `g` (`"sg" * n` or `"sgsf" * n`).
    dropout_rate: attention weights, expert and FFN hidden units, MoE output.
    moe: the `moe` dict (`MOE_DEFAULTS` fields, backbone defaults
      `LM_MOE_DEFAULTS`: 16 experts, the authors' top-2 gate `LM_ROUTER`,
      the "dropless" dispatcher as the authors' fastmoe layer, dropout after
      the expert activation only). With a capacity dispatcher ("indices",
      "einsum"), `capacity_factor` None (the default) still drops nothing:
      each layer's capacity factor is `E / K`, so an expert buffer holds a
      whole group; any number is used as given. `moe.router` routes the
      `g`, `m` and `a` layers.
    ac_router: the router of the `c` layers (None: `LM_AC_ROUTER`); an
      `acmoe` router is placed on exactly the `c` blocks.
    stream: the residual stream of the `m` / `a` layers (None:
      `LM_STREAMS`, heavy-ball for `m`, the authors' Adam form for `a`).
      `g` and `c` layers pass its state through untouched.
    layer_norm_epsilon: of the backbone's LayerNorms (torch's 1e-5).
    initialization: "authors" (`init` redraws the experts, the linear gate
      and the dense FFNs as the authors' torch code initialises them,
      `vmoe_ext.models.lm_init`) or "framework" (the shared modules' own
      initialisers, vmoe's).
    state_axis_name, expert_parallel, dtype, param_dtype: as
      `VisionTransformerMoe`'s.
    remat: as `VisionTransformerMoe`'s, per layer (`layer`).
    scan: one `nn.scan` per run of layers of one letter or of a repeated
      period of letters (GLaM's `(g, f)`; `scan_segments`, `.stack`):
      parameters stacked `[n, ...]` under `scan_{start}_{period}x{n}`, the
      layers' caches scan inputs and their next caches scan outputs; the
      unrolled model's values. Not with a router or stream that reads the
      layer's position (`c` layers' ACMoE, `a` layers' first-layer
      streams, time-varying momentum), nor with `expert_parallel`.
    attention: "plain" only. The cached attention's key position term
      `q . key_pe` depends on the query, so as a `jax.nn.dot_product_attention`
      bias it would be the whole `[B, N, M, L+M]` score matrix (plus the
      band mask): no fused form saves anything, and "fused" / "cudnn" are a
      ConfigError.

  `__call__(tokens, cache)` returns `(log_probs [B, M, V], new_cache,
  metrics)`: `cache` and `new_cache` are tuples with one `[B, L, D]` array
  per layer (`zero_cache` gives the one a stream starts from); `metrics` has
  `auxiliary_loss` (summed over MoE layers) and `metrics["layer_i"]` of each
  MoE layer, and the MoE layers sow their intermediates, as the ViT's.
  """
  vocab_size: int
  hidden_size: int = 128
  inner_hidden_size: int = 128
  num_heads: int = 8
  num_layers: int = 3
  attn_span: int = 256
  base_arch: str = "transformer"
  architecture: Optional[str] = None
  dropout_rate: float = 0.0
  moe: Optional[Mapping[str, Any]] = None
  ac_router: Optional[Mapping[str, Any]] = None
  stream: Optional[Mapping[str, Any]] = None
  layer_norm_epsilon: float = 1e-5
  initialization: str = "authors"
  state_axis_name: Optional[str] = None
  expert_parallel: Optional[ExpertParallel] = None
  dtype: Any = jnp.float32
  attention: str = "plain"
  param_dtype: Any = jnp.float32
  remat: str = "none"
  scan: bool = False

  def __post_init__(self):
    resolve_precision_fields(self)  # Names ("bfloat16") -> dtypes.
    check_remat(self.remat)
    require(self.attention == "plain", "attention",
            f"the language model's cached attention has only the 'plain' "
            f"form (its key position term depends on the query, so no fused "
            f"kernel's bias can hold it without the full score matrix), got "
            f"{self.attention!r}")
    for field in ("vocab_size", "hidden_size", "inner_hidden_size",
                  "num_heads", "num_layers", "attn_span"):
      value = getattr(self, field)
      require(isinstance(value, int) and not isinstance(value, bool)
              and value > 0, field,
              f"must be a positive integer, got {value!r}")
    require(self.hidden_size % self.num_heads == 0, "num_heads",
            f"{self.num_heads} heads do not divide hidden_size "
            f"{self.hidden_size}")
    require(0.0 <= self.dropout_rate < 1.0, "dropout_rate",
            f"must be in [0, 1), got {self.dropout_rate}")
    require(self.layer_norm_epsilon > 0, "layer_norm_epsilon",
            f"must be > 0, got {self.layer_norm_epsilon}")
    require(self.initialization in INITIALIZATIONS, "initialization",
            f"must be one of {INITIALIZATIONS}, got {self.initialization!r}")
    architecture = (default_architecture(self.base_arch, self.num_layers)
                    if self.architecture is None else self.architecture)
    specs = parse_architecture(architecture, self.base_arch, self.num_layers)
    moe = lm_moe_config(self.moe)
    stream = resolve_stream(self.stream, specs)
    ac_router = resolve_ac_router(self.ac_router, blocks_of(specs, "c"),
                                  moe["group_size"])
    stage = (moe_blocks(specs),)
    # Everything is validated now, before any tracing (the stream's
    # placement too, by `check_moe_placement`).
    check_moe_placement(layer_moe(moe, moe["router"]), stream, stage,
                        self.inner_hidden_size, self.dropout_rate,
                        self.dtype, "relu")
    routers = [build_moe_layer(layer_moe(moe, moe["router"]),
                               self.inner_hidden_size, self.dropout_rate,
                               self.dtype, "relu", parent=None).router]
    if ac_router is not None:
      with renamed_scope("moe.router", "ac_router"):
        layer = build_moe_layer(layer_moe(moe, ac_router),
                                self.inner_hidden_size, self.dropout_rate,
                                self.dtype, "relu", parent=None)
        with field_scope("moe"):
          layer.router.check_stages(stage)
      routers.append(layer.router)
    for router in routers:
      check_scan(self.scan, router, STREAMS.build(stream, parent=None),
                 expert_parallel=self.expert_parallel)
    for name, value in (("architecture", architecture), ("moe", moe),
                        ("stream", stream), ("ac_router", ac_router)):
      object.__setattr__(self, name, value)
    super().__post_init__()

  @property
  def layers(self) -> tuple[LayerSpec, ...]:
    return parse_architecture(self.architecture, self.base_arch,
                              self.num_layers)

  @property
  def moe_layers(self) -> tuple[int, ...]:
    """The block indices of the MoE layers."""
    return moe_blocks(self.layers)

  @property
  def scan_segments(self) -> Optional[tuple[Segment, ...]]:
    """The scanned runs and unrolled layers (None: `scan` off), planned
    over the layers' sub-layer letters (Switch `"sg" * n`: one run of n
    layers; GLaM `"sgsf" * n`: one run of n periods `(g, f)`)."""
    if not self.scan:
      return None
    return plan_segments([spec.ffn for spec in self.layers])

  def layer_moe(self, spec: LayerSpec) -> Optional[dict[str, Any]]:
    """The filled `moe` dict of layer `spec` (None for a dense layer)."""
    if not spec.is_moe:
      return None
    return layer_moe(self.moe, self.ac_router if spec.ffn == "c"
                     else self.moe["router"])

  def init(self, rngs: Any, *args: Any, **kwargs: Any) -> Any:
    """`nn.Module.init`, then (`initialization="authors"`, no `method`)
    the authors' initialisation of the feed-forward parameters, drawn from
    the "params" key (on the unrolled layout, so a scanned model redraws
    exactly the unrolled model's values); the parameters are then cast to
    `param_dtype`."""
    variables = super().init(rngs, *args, **kwargs)
    if self.initialization == "authors" and kwargs.get("method") is None:
      key = rngs["params"] if isinstance(rngs, Mapping) else rngs
      params = variables["params"]
      redrawn = authors_initialization(unscan_tree(params),
                                       jax.random.fold_in(key, 1))
      variables = {**variables, "params": scan_tree(redrawn, params)
                   if is_scanned(params) else redrawn}
    return cast_params(variables, self.param_dtype)

  @nn.nowrap  # Builds the layer under the calling module (a scan step).
  def layer(self, spec: LayerSpec, h: Array, cache: Array, key_pe: Array,
            ctx: RoutingContext, *, deterministic: bool, update_state: bool,
            name: Optional[str] = None
            ) -> tuple[Array, RoutingContext, Optional[dict[str, Any]]]:
    """Layer `spec` on `h` `[B, M, D]` (called inside `__call__`): the new
    `h`, the routing context for the next layer and the layer's metrics (None
    without an MoE sub-layer). `name`: the module's (None:
    `encoderblock_{block}`). Subclasses replace layers here."""
    return block_builder(LanguageLayer, self.remat, 4,
                         prevent_cse=not self.scan)(
        ffn=spec.ffn, num_heads=self.num_heads,
        inner_hidden_size=self.inner_hidden_size,
        dropout_rate=self.dropout_rate, moe=self.layer_moe(spec),
        stream=self.stream, layer_norm_epsilon=self.layer_norm_epsilon,
        dtype=self.dtype, expert_parallel=self.expert_parallel,
        name=param_name(spec.block) if name is None else name)(
            h, cache, key_pe, ctx.at_block(spec.block),
            deterministic=deterministic, update_state=update_state)

  def zero_cache(self, batch_size: int, dtype: Any = jnp.float32) -> Cache:
    """The cache a stream starts from: zeros `[B, L, D]` per layer."""
    return tuple(jnp.zeros((batch_size, self.attn_span, self.hidden_size),
                           dtype) for _ in self.layers)

  @nn.compact
  def __call__(self, tokens: Array, cache: Sequence[Array], *,
               deterministic: bool = True, update_state: bool = False
               ) -> tuple[Array, Cache, dict[str, Any]]:
    """Log-probabilities `[B, M, V]` of the next token at every position of
    `tokens` `[B, M]`, the next block's cache, and the metrics.

    `deterministic`: no router noise, no dropout. `update_state`: let
    routers update their persistent state ("router_state" mutable).
    """
    b, m = tokens.shape
    specs = self.layers
    want = (b, self.attn_span, self.hidden_size)
    check(len(cache) == len(specs), "cache",
          f"needs one [B, L, D] array per layer ({len(specs)}), got "
          f"{len(cache)}; start a stream from model.zero_cache(B)")
    for i, c in enumerate(cache):
      check(tuple(c.shape) == want, "cache",
            f"layer {i}'s cache has shape {tuple(c.shape)}, expected {want} "
            f"(B, attn_span, hidden_size)")
    h = nn.Embed(self.vocab_size, self.hidden_size,
                 embedding_init=nn.initializers.normal(stddev=1.0),
                 dtype=self.dtype, name="embedding")(tokens)
    key_pe = self.param("key_pe", nn.initializers.normal(stddev=1.0),
                        (self.hidden_size // self.num_heads, self.attn_span))
    ctx = RoutingContext(
        stream_state=float32_state(
            STREAMS.build(self.stream, parent=None).init_state(h)),
        axis_name=self.state_axis_name, moe_blocks=self.moe_layers)
    # Keyed by block: `layer_{block}` metrics, each layer's next cache.
    h, ctx, metrics, new_cache = run_stack(
        self._layer_builder(cache, key_pe), h, ctx, len(specs),
        self.scan_segments, deterministic=deterministic,
        update_state=update_state, step_inputs=lambda block: cache[block])
    logits = nn.Dense(self.vocab_size, kernel_init=torch_linear_init(),
                      bias_init=torch_bias_init(self.hidden_size),
                      dtype=self.dtype, name="output")(h)
    log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    metrics["auxiliary_loss"] = sum(
        (v["auxiliary_loss"] for v in metrics.values()),
        jnp.zeros((), jnp.float32))
    return log_probs, tuple(new_cache[s.block] for s in specs), metrics

  def _layer_builder(self, cache: Sequence[Array], key_pe: Array
                     ) -> Callable[[int, str], Callable]:
    """`build(block, name)` of the layers for `run_stack`: the call
    `(h, ctx, layer_cache=None, deterministic=, update_state=)` returning
    `(h, ctx, metrics, next_cache(layer_cache, h))`, the layer's next cache
    from its input `h`. `layer_cache` `[B, L, D]` (a scanned layer's scan
    input) replaces `cache[block]`; `key_pe` is shared by every layer."""
    specs = self.layers

    def build(block: int, name: str) -> Callable:
      def call(h: Array, ctx: RoutingContext,
               layer_cache: Optional[Array] = None, *, deterministic: bool,
               update_state: bool) -> tuple[Array, RoutingContext, Any, Array]:
        layer_cache = cache[block] if layer_cache is None else layer_cache
        new = next_cache(layer_cache, h)
        h, ctx, metrics = self.layer(
            specs[block], h, layer_cache, key_pe, ctx, name=name,
            deterministic=deterministic, update_state=update_state)
        return h, ctx, metrics, new
      return call
    return build


def language_model_fields(config: dict[str, Any]) -> dict[str, Any]:
  """The `complete` function of the model registry entry: the fields are
  the `LanguageModel`'s, checked by the class itself."""
  return config


# The config defaults live in `vmoe_ext.models.lm_config`; they stay
# importable from here.
__all__ = ["LM_AC_ROUTER", "LM_MOE_DEFAULTS", "LM_ROUTER", "LM_STREAMS",
           "LM_XMOE_ROUTER", "LanguageLayer", "LanguageModel",
           "language_model_fields", "layer_moe", "lm_moe_config",
           "resolve_ac_router", "resolve_stream"]
