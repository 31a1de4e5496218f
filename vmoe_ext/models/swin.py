"""Swin Transformer (Liu et al. 2021) and Swin-MoE, on `[B, H, W, C]` images.

Patch partition + linear embedding (a conv of stride = kernel = patch, then
a LayerNorm with `patch_norm`), then stages of blocks over an `h x w` token
grid with window attention (window M; every second block of a stage shifts
the windows cyclically by M // 2 and masks attention across the shifted
regions), patch merging between stages (`[h, w, C] -> [h/2, w/2, 2C]`), a
final LayerNorm, global average pooling and the head. Any block's MLP can be
an MoE layer (`moe_blocks`, per stage), with every router, stream and
dispatcher of the library: blocks are numbered globally (`encoderblock_i`,
metrics `layer_i`) as in the ViT, so the parameter and metric names, the
sharding rules and the routing analysis are the same.

A stage is one token sequence: the routing context (the previous MoE
layers' assignments) and the residual stream's state restart at each stage,
since patch merging changes the tokens (the ACMoE authors' Swin code resets
the previous assignment per stage too).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from vmoe_ext.errors import require
from vmoe_ext.models.attention import check_attention
from vmoe_ext.models.heads import classifier_head
from vmoe_ext.models.precision import (at_least_float32, cast_params,
                                       float32_state,
                                       resolve_precision_fields)
from vmoe_ext.models.stack import (Segment, apply_stack, block_builder,
                                    check_remat, check_scan, plan_segments)
from vmoe_ext.models.sublayer import (DEFAULT_STREAM, build_moe_layer,
                                      check_moe_placement,
                                      check_stream_placement, mlp_sublayer,
                                      moe_config)
from vmoe_ext.models.swin_attention import (POSITION_BIASES, SWIN_INIT,
                                            DropPath, WindowAttention,
                                            keep_probability)
from vmoe_ext.models.swin_window import (check_window, cyclic_shift,
                                         shift_attention_mask, stage_window,
                                         window_partition, window_reverse)
from vmoe_ext.moe.contract import RoutingContext
from vmoe_ext.moe.expert_parallel import ExpertParallel
from vmoe_ext.moe.experts import check_activation
from vmoe_ext.streams import STREAMS

Array = jax.Array


class SwinBlock(nn.Module):
  """One Swin block on a stage's `[B, h*w, C]` tokens (row-major grid):
  `x + DropPath(WindowAttention(LN(x)))`, then the MLP or MoE sublayer
  through the stream, its output through DropPath too.

  Attributes:
    grid: `(h, w)` of the stage.
    window, shift: M and the cyclic shift (0: regular windows), as
      `stage_window` resolved them for this stage.
    drop_path_rate: this block's stochastic depth rate (unless the call
      gives `keep`).
    mlp_dim: the MLP's (and the experts') hidden width.
    moe: None (dense MLP) or a filled `moe` config.
    The other fields: `SwinTransformerMoe`'s.
  """
  num_heads: int
  grid: tuple[int, int]
  window: int
  shift: int
  mlp_dim: int
  drop_path_rate: float = 0.0
  dropout_rate: float = 0.0
  attention_dropout_rate: float = 0.0
  qkv_bias: bool = True
  relative_position_bias: str = "table"
  attention: str = "plain"
  mlp_activation: str = "gelu_exact"
  mlp_fc2_bias: bool = True
  layer_norm_epsilon: float = 1e-5
  moe: Optional[Mapping[str, Any]] = None
  stream: Optional[Mapping[str, Any]] = None
  dtype: Any = jnp.float32
  expert_parallel: Optional[ExpertParallel] = None

  @nn.compact
  def __call__(self, x: Array, ctx: RoutingContext,
               keep: Optional[Array] = None, *, deterministic: bool = True,
               update_state: bool = False
               ) -> tuple[Array, RoutingContext, Optional[dict]]:
    """x: `[B, h*w, C]` -> `[B, h*w, C]`, the context, MoE metrics.
    `keep`: None, or the drop-path keep probability as a traced scalar `[]`
    (a scanned block's scan input), replacing `1 - drop_path_rate`."""
    b, t, c = x.shape
    gh, gw = self.grid
    y = nn.LayerNorm(epsilon=self.layer_norm_epsilon, dtype=self.dtype,
                     name="LayerNorm_0")(x).reshape(b, gh, gw, c)
    y = cyclic_shift(y, self.shift)
    mask = (shift_attention_mask(gh, gw, self.window, self.shift)
            if self.shift else None)
    y = WindowAttention(
        self.num_heads, self.window, qkv_bias=self.qkv_bias,
        position_bias=self.relative_position_bias,
        attention_dropout_rate=self.attention_dropout_rate,
        dropout_rate=self.dropout_rate, dtype=self.dtype,
        attention=self.attention, name="Attention")(
            window_partition(y, self.window), mask,
            deterministic=deterministic)
    y = cyclic_shift(window_reverse(y, self.window, gh, gw), -self.shift)
    drop_path = DropPath(self.drop_path_rate, name="DropPath")
    x = x + drop_path(y.reshape(b, t, c), deterministic=deterministic,
                      keep=keep)
    norm = nn.LayerNorm(epsilon=self.layer_norm_epsilon, dtype=self.dtype,
                        name="LayerNorm_1")
    return mlp_sublayer(
        x, ctx, norm, moe=self.moe, stream=self.stream or DEFAULT_STREAM,
        mlp_dim=self.mlp_dim, dropout_rate=self.dropout_rate,
        activation=self.mlp_activation, dtype=self.dtype,
        expert_parallel=self.expert_parallel, deterministic=deterministic,
        update_state=update_state, mlp_output_bias=self.mlp_fc2_bias,
        branch=lambda f: drop_path(f, deterministic=deterministic,
                                   keep=keep))


class PatchMerging(nn.Module):
  """`[B, h*w, C]` -> `[B, h/2 * w/2, 2C]`: each 2 x 2 neighbourhood's
  tokens concatenated as `[x(0,0), x(1,0), x(0,1), x(1,1)]` (row, column
  offsets, the reference's order), a LayerNorm over the 4C (`norm`), a
  Dense to 2C without bias (`reduction`)."""
  grid: tuple[int, int]
  layer_norm_epsilon: float = 1e-5
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x: Array) -> Array:
    b, _, c = x.shape
    gh, gw = self.grid
    x = x.reshape(b, gh, gw, c)
    x = jnp.concatenate([x[:, 0::2, 0::2], x[:, 1::2, 0::2],
                         x[:, 0::2, 1::2], x[:, 1::2, 1::2]], axis=-1)
    x = x.reshape(b, (gh // 2) * (gw // 2), 4 * c)
    x = nn.LayerNorm(epsilon=self.layer_norm_epsilon, dtype=self.dtype,
                     name="norm")(x)
    return nn.Dense(2 * c, use_bias=False, kernel_init=SWIN_INIT,
                    dtype=self.dtype, name="reduction")(x)


class SwinTransformerMoe(nn.Module):
  """Swin / Swin-MoE classifier on `[B, H, W, C]` images.

  Attributes:
    num_classes: output classes.
    patch_size: `(ph, pw)`, must divide the image size.
    embed_dim: C of stage 0 (stage s has `C * 2**s`).
    depths: blocks per stage.
    num_heads: heads per stage (each divides its stage's width).
    window_size: M. A stage no larger than M uses one window of its whole
      grid and no shift (`swin_window.stage_window`); otherwise M must
      divide the stage's grid (a ConfigError on `model.window_size`).
    mlp_ratio: the MLP's (and experts') hidden width over the stage width.
    qkv_bias: biases of q, k, v.
    relative_position_bias: "table" (the paper's learned `[(2M-1)^2, h]`
      table) or "log_cpb" (the Swin-MoE release's MLP of log-spaced
      offsets, `swin_attention.WindowAttention`).
    attention: "plain" (the explicit softmax), "fused" or "cudnn"
      (`jax.nn.dot_product_attention` with the position bias and shift mask
      as its bias, `vmoe_ext.models.attention`); same parameters and values.
    patch_norm: a LayerNorm after the patch embedding.
    absolute_position_emb: a learned position embedding added to the patch
      tokens (the reference's `ape`; off by default).
    dropout_rate: dropout after the embedding, the attention projection and
      in the MLPs (the reference's `drop_rate`); the experts' dropout is
      `moe.dropout_rate` (None: this).
    attention_dropout_rate: dropout on the attention weights.
    drop_path_rate: stochastic depth; block i of n (over all stages) drops
      its branches with rate `drop_path_rate * i / (n - 1)`.
    mlp_activation: the MLP's (and experts') activation; "gelu_exact" is
      torch's `nn.GELU()`, the reference's.
    mlp_fc2_bias: the dense MLPs' output layers have a bias (the release's
      `MLP_FC2_BIAS`; the experts' is `moe.output_bias`).
    layer_norm_epsilon: of every LayerNorm (torch's 1e-5).
    head_kernel_zero_init, head_bias_init: the head's initialisation
      (`vmoe_ext.models.heads`).
    moe: None for a dense Swin, else a dict of `MOE_DEFAULTS` fields;
      `moe.layers`, `moe.every` and `moe.last` are the ViT's and must be
      unset: `moe_blocks` places the MoE layers.
    moe_blocks: one list per stage of the stage's MoE blocks (0-based
      within the stage; -1 or an empty list: none), the release's
      `MOE_BLOCKS`, e.g. `((-1,), (-1,), (1, 3, 5), (1,))`.
    stream: the residual stream (`vmoe_ext.streams`; default plain).
    state_axis_name, expert_parallel, dtype, param_dtype: as
      `VisionTransformerMoe`'s.
    remat: as `VisionTransformerMoe`'s, per Swin block.
    scan: as `VisionTransformerMoe`'s, within each stage (`scan_segments`:
      periods of the (shifted, MoE) pattern, named by global block
      numbers); the blocks' drop-path rates are per-step scan inputs.

  Calling it returns `(logits [B, num_classes], metrics)` as the ViT does
  (`auxiliary_loss`, `layer_i/...` per MoE block i), and the MoE layers sow
  the same intermediates, on each stage's `[B, h*w, ...]` tokens.
  """
  num_classes: int
  patch_size: tuple[int, int] = (4, 4)
  embed_dim: int = 96
  depths: tuple[int, ...] = (2, 2, 6, 2)
  num_heads: tuple[int, ...] = (3, 6, 12, 24)
  window_size: int = 7
  mlp_ratio: float = 4.0
  qkv_bias: bool = True
  relative_position_bias: str = "table"
  attention: str = "plain"
  patch_norm: bool = True
  absolute_position_emb: bool = False
  dropout_rate: float = 0.0
  attention_dropout_rate: float = 0.0
  drop_path_rate: float = 0.1
  mlp_activation: str = "gelu_exact"
  mlp_fc2_bias: bool = True
  layer_norm_epsilon: float = 1e-5
  head_kernel_zero_init: bool = True
  head_bias_init: float = 0.0
  moe: Optional[Mapping[str, Any]] = None
  moe_blocks: Optional[Sequence[Sequence[int]]] = None
  stream: Optional[Mapping[str, Any]] = None
  state_axis_name: Optional[str] = None
  expert_parallel: Optional[ExpertParallel] = None
  dtype: Any = jnp.float32
  param_dtype: Any = jnp.float32
  remat: str = "none"
  scan: bool = False

  def __post_init__(self):
    resolve_precision_fields(self)  # Names ("bfloat16") -> dtypes.
    check_remat(self.remat)
    require(isinstance(self.num_classes, int) and self.num_classes > 0,
            "num_classes", f"must be positive, got {self.num_classes!r}")
    patch = tuple(self.patch_size) if isinstance(
        self.patch_size, (tuple, list)) else None
    require(patch is not None and len(patch) == 2
            and all(isinstance(p, int) and p > 0 for p in patch),
            "patch_size", f"must be two positive integers (ph, pw), got "
            f"{self.patch_size!r}")
    for field in ("embed_dim", "window_size"):
      value = getattr(self, field)
      require(isinstance(value, int) and value > 0, field,
              f"must be a positive integer, got {value!r}")
    depths, heads = tuple(self.depths), tuple(self.num_heads)
    require(len(depths) > 0 and all(isinstance(d, int) and d > 0
                                    for d in depths), "depths",
            f"must be a non-empty list of positive integers, got "
            f"{self.depths!r}")
    require(len(heads) == len(depths), "num_heads",
            f"needs one entry per stage ({len(depths)}), got {self.num_heads!r}")
    for s, h in enumerate(heads):
      width = self.embed_dim * 2 ** s
      require(isinstance(h, int) and h > 0 and width % h == 0,
              f"num_heads[{s}]", f"{h!r} heads do not divide stage {s}'s "
              f"width {width}")
    require(self.mlp_ratio > 0 and int(self.embed_dim * self.mlp_ratio) > 0,
            "mlp_ratio", f"must give a positive MLP width, got "
            f"{self.mlp_ratio!r}")
    require(self.relative_position_bias in POSITION_BIASES,
            "relative_position_bias", f"must be one of {POSITION_BIASES}, "
            f"got {self.relative_position_bias!r}")
    for field in ("dropout_rate", "attention_dropout_rate",
                  "drop_path_rate"):
      rate = getattr(self, field)
      require(0.0 <= rate < 1.0, field, f"must be in [0, 1), got {rate}")
    require(self.layer_norm_epsilon > 0, "layer_norm_epsilon",
            f"must be positive, got {self.layer_norm_epsilon}")
    check_activation(self.mlp_activation)
    check_attention(self.attention, dtype=self.dtype,
                    head_dims=tuple(self.embed_dim * 2 ** s // h
                                    for s, h in enumerate(heads)),
                    attention_dropout_rate=self.attention_dropout_rate,
                    bias_lengths=(self.window_size ** 2,))
    stages = self._local_moe_blocks(depths)
    moe = moe_config(self.moe)
    stream = dict(self.stream or DEFAULT_STREAM)
    has_moe = any(stages)
    require(moe is not None or not has_moe, "moe",
            "model.moe_blocks places MoE layers: give the moe config")
    if moe is not None:
      for field in ("layers", "every", "last"):
        require(moe[field] is None, f"moe.{field}",
                "a Swin places its MoE layers per stage with "
                "model.moe_blocks (e.g. [[-1], [-1], [1, 3, 5], [1]]), "
                "not moe.layers / every / last")
      require(has_moe, "moe_blocks", "the moe config is given but no block "
              "is an MoE block (e.g. moe_blocks=[[-1], [-1], [1, 3], [1]])")
    object.__setattr__(self, "moe", moe)
    object.__setattr__(self, "stream", stream)
    object.__setattr__(self, "depths", depths)
    object.__setattr__(self, "num_heads", heads)
    object.__setattr__(self, "patch_size", patch)
    if moe is not None:
      check_moe_placement(moe, stream, self.moe_stages,
                          int(self.embed_dim * self.mlp_ratio),
                          self.dropout_rate, self.dtype, self.mlp_activation)
    else:
      check_stream_placement(stream, tuple(() for _ in depths))
    check_scan(self.scan, moe and build_moe_layer(
        moe, int(self.embed_dim * self.mlp_ratio), self.dropout_rate,
        self.dtype, self.mlp_activation, parent=None).router,
               STREAMS.build(stream, parent=None),
               expert_parallel=self.expert_parallel)
    super().__post_init__()

  def init(self, rngs: Any, *args: Any, **kwargs: Any) -> Any:
    """`nn.Module.init`, the parameters then cast to `param_dtype`."""
    return cast_params(super().init(rngs, *args, **kwargs), self.param_dtype)

  def _local_moe_blocks(self, depths: tuple[int, ...]
                        ) -> tuple[tuple[int, ...], ...]:
    """`moe_blocks` checked and without the -1 markers."""
    if self.moe_blocks is None:
      return tuple(() for _ in depths)
    per_stage = tuple(self.moe_blocks)
    require(len(per_stage) == len(depths), "moe_blocks",
            f"needs one list per stage ({len(depths)} stages), got "
            f"{self.moe_blocks!r}")
    out = []
    for s, (blocks, depth) in enumerate(zip(per_stage, depths)):
      require(isinstance(blocks, (list, tuple)), f"moe_blocks[{s}]",
              f"must be a list of block indices (-1: none), got {blocks!r}")
      chosen = tuple(b for b in blocks if b != -1)
      for b in chosen:
        require(isinstance(b, int) and 0 <= b < depth, f"moe_blocks[{s}]",
                f"block {b!r} is out of range for stage {s}'s {depth} "
                f"blocks (valid: 0..{depth - 1}, or -1 for none)")
      require(len(set(chosen)) == len(chosen), f"moe_blocks[{s}]",
              f"duplicate indices in {tuple(blocks)}")
      out.append(tuple(sorted(chosen)))
    return tuple(out)

  @property
  def num_layers(self) -> int:
    """All blocks, over the stages."""
    return sum(self.depths)

  def stage_start(self, stage: int) -> int:
    """The global index of stage `stage`'s first block."""
    return sum(self.depths[:stage])

  @property
  def moe_stages(self) -> tuple[tuple[int, ...], ...]:
    """Per stage, the global block indices of its MoE blocks."""
    return tuple(tuple(self.stage_start(s) + b for b in blocks)
                 for s, blocks in enumerate(
                     self._local_moe_blocks(self.depths)))

  @property
  def moe_layers(self) -> tuple[int, ...]:
    """The global block indices of all MoE blocks."""
    return tuple(b for blocks in self.moe_stages for b in blocks)

  @property
  def scan_segments(self) -> Optional[tuple[tuple[Segment, ...], ...]]:
    """Per stage, its scanned runs and unrolled blocks (None: `scan` off);
    a block's kind is (shifted: an odd position in the stage, MoE)."""
    if not self.scan:
      return None
    moe = self.moe_layers
    return tuple(plan_segments(
        [(i % 2 == 1, self.stage_start(s) + i in moe) for i in range(depth)],
        start=self.stage_start(s)) for s, depth in enumerate(self.depths))

  def stage_grids(self, image_size: tuple[int, int]
                  ) -> tuple[tuple[int, int], ...]:
    """The `(h, w)` token grid of each stage for `(H, W)` images.

    Raises:
      ConfigError naming `patch_size` or `window_size` when the patches,
      the merging (an odd grid before a merge) or the windows do not fit.
    """
    height, width = image_size
    ph, pw = self.patch_size
    require(height % ph == 0 and width % pw == 0, "patch_size",
            f"patch {self.patch_size} does not divide the image size "
            f"{(height, width)}")
    grid = (height // ph, width // pw)
    grids = []
    for s in range(len(self.depths)):
      if s:
        require(grid[0] % 2 == 0 and grid[1] % 2 == 0, "patch_size",
                f"stage {s - 1}'s {grid[0]}x{grid[1]} tokens cannot be "
                f"merged 2x2 into stage {s} (the image size over the "
                f"patch must be divisible by 2**{len(self.depths) - 1})")
        grid = (grid[0] // 2, grid[1] // 2)
      window, _ = stage_window(*grid, self.window_size, 0)
      check_window(*grid, window, "window_size")
      grids.append(grid)
    return tuple(grids)

  def check_image_size(self, image_size: tuple[int, int]) -> None:
    """Raises ConfigError (`patch_size`, `window_size`) unless images of
    `(H, W)` fit the patches, the merges and the windows; with
    `attention="cudnn"`, `attention` unless every stage's window (which
    shrinks on a small stage) holds an even number of tokens."""
    grids = self.stage_grids(image_size)
    if self.attention == "cudnn":
      windows = [stage_window(*g, self.window_size, 0)[0] for g in grids]
      check_attention(self.attention, dtype=self.dtype,
                      bias_lengths=tuple(m * m for m in windows))

  def token_grid(self, block: int, image_size: tuple[int, int]
                 ) -> tuple[int, int, int]:
    """`(h, w, 0)`: the row-major token grid block `block` sees (no tokens
    other than patches)."""
    grids = self.stage_grids(image_size)
    stage = next(s for s in range(len(self.depths))
                 if block < self.stage_start(s + 1))
    return grids[stage] + (0,)

  @nn.compact
  def __call__(self, images: Array, *, deterministic: bool = True,
               update_state: bool = False) -> tuple[Array, dict[str, Any]]:
    """Logits `[B, classes]` and metrics of images `[B, H, W, C]`
    (`deterministic`, `update_state`: as `VisionTransformerMoe`'s)."""
    b, h, w, _ = images.shape
    grids = self.stage_grids((h, w))
    ph, pw = self.patch_size
    c = self.embed_dim
    x = nn.Conv(c, (ph, pw), strides=(ph, pw), padding="VALID",
                dtype=self.dtype, name="embedding")(images)
    x = x.reshape(b, -1, c)
    if self.patch_norm:
      x = nn.LayerNorm(epsilon=self.layer_norm_epsilon, dtype=self.dtype,
                       name="embedding_norm")(x)
    if self.absolute_position_emb:
      x = x + self.param("pos_embedding", SWIN_INIT,
                         (1,) + x.shape[1:]).astype(x.dtype)
    x = nn.Dropout(self.dropout_rate)(x, deterministic=deterministic)
    rates = np.linspace(0.0, self.drop_path_rate, self.num_layers)
    segments = self.scan_segments
    metrics: dict[str, Any] = {}
    for s, grid in enumerate(grids):
      if s:
        x = PatchMerging(grids[s - 1], self.layer_norm_epsilon, self.dtype,
                         name=f"merging_{s}")(x)
      ctx = RoutingContext(
          stream_state=float32_state(
              STREAMS.build(self.stream, parent=None).init_state(x)),
          axis_name=self.state_axis_name, moe_blocks=self.moe_stages[s])
      x, _, stage_metrics = apply_stack(
          self._stage_builder(s, grid, rates), x, ctx, self.depths[s],
          segments and segments[s], start=self.stage_start(s),
          deterministic=deterministic, update_state=update_state,
          step_inputs=(lambda block: keep_probability(rates[block])
                       ) if self.drop_path_rate else None)
      metrics.update(stage_metrics)
    x = nn.LayerNorm(epsilon=self.layer_norm_epsilon, dtype=self.dtype,
                     name="encoder_norm")(x)
    logits = classifier_head(
        x, num_classes=self.num_classes, classifier="gap",
        head_kernel_zero_init=self.head_kernel_zero_init,
        head_bias_init=self.head_bias_init, dtype=self.dtype)
    metrics["auxiliary_loss"] = sum(
        (m["auxiliary_loss"] for m in metrics.values()),
        jnp.zeros((), jnp.float32))
    return at_least_float32(logits), metrics

  def _stage_builder(self, stage: int, grid: tuple[int, int],
                     rates: np.ndarray) -> Callable[[int, str], Callable]:
    """`build(block, name)` of stage `stage`'s blocks for `apply_stack`:
    the call `(x, ctx, keep=None, deterministic=, update_state=)`, where
    `keep` (a scanned block's scan input) replaces `1 - rates[block]`."""
    make_block = block_builder(SwinBlock, self.remat, 3,
                               prevent_cse=not self.scan)
    width = self.embed_dim * 2 ** stage
    window, shift = stage_window(*grid, self.window_size,
                                 self.window_size // 2)
    moe_blocks = self.moe_stages[stage]

    def build(block: int, name: str) -> Callable:
      call = make_block(
          num_heads=self.num_heads[stage], grid=grid, window=window,
          shift=shift if (block - self.stage_start(stage)) % 2 else 0,
          mlp_dim=int(width * self.mlp_ratio),
          drop_path_rate=float(rates[block]),
          dropout_rate=self.dropout_rate,
          attention_dropout_rate=self.attention_dropout_rate,
          qkv_bias=self.qkv_bias,
          relative_position_bias=self.relative_position_bias,
          attention=self.attention, mlp_activation=self.mlp_activation,
          mlp_fc2_bias=self.mlp_fc2_bias,
          layer_norm_epsilon=self.layer_norm_epsilon,
          moe=self.moe if block in moe_blocks else None,
          stream=self.stream, dtype=self.dtype,
          expert_parallel=self.expert_parallel, name=name)
      return lambda x, ctx, keep=None, **flags: call(x, ctx, keep, **flags)
    return build


__all__ = ["PatchMerging", "SwinBlock", "SwinTransformerMoe"]
