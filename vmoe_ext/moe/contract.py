"""The router contract (v2) and the context threaded through the encoder.

This module is the router API that `vmoe_ext.moe` (the layer) and
`vmoe_ext.routers` (the implementations) both import; it imports neither, so
the layering runs one way: `routers -> moe.contract <- moe.layer`.

A router is a Flax linen module called as

    out = router(x, ctx, capacity=C, deterministic=..., update_state=...)

* `x`: the group-major MoE input tokens `[G, S, D]` (after the block's
  pre-LayerNorm);
* `ctx`: the `RoutingContext` of the block (previous MoE layers' assignments
  and forwarded data, the data-parallel axis name);
* `capacity`: the per-group expert capacity C computed by the layer (used by
  expert choice; token-choice routers leave capacity to the dispatcher);
* `deterministic`: no router noise (evaluation, attacks);
* `update_state`: update persistent router state (training steps only, and
  only when the caller also made the state collection mutable).

It returns a `RouterOutput`:

* (routing) `routing` — one of the forms in `vmoe_ext.moe.routing`, and
  `metrics`, a dict of scalars that always contains `auxiliary_loss` (already
  weighted); every entry is logged per layer (`layer_i/NAME` in
  `metrics.jsonl` and TensorBoard, train and test lines);
* (a) `expert_inputs` — optional transformed tokens `[G, S, D]` that the
  dispatcher sends to the experts instead of `x` (ACMoE's Swin/SoftMoE
  variants scale the expert inputs, not only the scores);
* (b) `forward` — an optional pytree handed to every later MoE layer through
  `ctx.records[i].forward` (`ctx.previous_forward` for the last one);
* `gates` — optional `[G, S, E]`: the full gate distribution a token-choice
  router selected from (`softmax` of its noisy logits), so that a router
  wrapping it can re-weight the gates and select again (Symphony).

(c) Persistent non-parameter state (Symphony's co-selection graph, CMoE's
balancing bias) lives in the collection `ROUTER_STATE` ("router_state"),
like BatchNorm's "batch_stats": a router updates it only when
`update_state=True`, and reduces the statistic it updates with
`ctx.reduce_mean(value)` or `ctx.reduce_sum(value)`, which average or sum
over `ctx.axis_name` (the model's `state_axis_name`, the data-parallel
mesh/vmap/pmap axis) when one is given, so a data-parallel run equals the
single-device run. It is saved with the
train state. A router never touches expert weights.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any, ClassVar, Optional

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp

from vmoe_ext.errors import ConfigError
from vmoe_ext.moe.routing import Routing

Array = jax.Array
Metrics = dict[str, Array]

TOKEN_CHOICE = "token_choice"
EXPERT_CHOICE = "expert_choice"
SOFT = "soft"
ROUTER_STATE = "router_state"


@flax.struct.dataclass
class Assignment:
  """A layer's expert assignment, token-major: independent of the grouping.

  Every routing form produces one (`Routing.assignment`): the experts a token
  went to, best first — token choice: its K choices; expert choice: the
  experts that picked it (up to E, by weight); soft: the experts of its
  top-K slots by combine weight (expert of slot j = j // P).

  Attributes:
    expert_indices: `[B, T, K]` int32; -1 where not valid.
    gates: `[B, T, K]` float, the weight of each entry (0 where not valid).
    valid: `[B, T, K]` bool.
  """
  expert_indices: Array
  gates: Array
  valid: Array

  @property
  def num_selected(self) -> int:
    return self.expert_indices.shape[-1]

  def top1(self) -> Array:
    """`[B, T]` int32: each token's first expert (-1 if it has none)."""
    return self.expert_indices[..., 0]


@flax.struct.dataclass
class LayerRecord:
  """What one MoE layer leaves for the layers after it.

  Attributes:
    assignment: the layer's `Assignment` (`[B, T, K]`).
    forward: the router's `RouterOutput.forward` pytree (or None).
    block: the encoder block index of the layer (static).
    num_experts: E of the layer (static; -1 if unknown).
    width: D of the layer's tokens (static; -1 if unknown).
  """
  assignment: Assignment
  forward: Any = None
  block: int = flax.struct.field(pytree_node=False, default=-1)
  num_experts: int = flax.struct.field(pytree_node=False, default=-1)
  width: int = flax.struct.field(pytree_node=False, default=-1)


@flax.struct.dataclass
class RoutingContext:
  """State carried from block to block through the encoder.

  Attributes:
    block: index of the encoder block being applied (static; 0-based over
      all blocks, dense ones included; `layer_index` is its deprecated
      alias).
    records: one `LayerRecord` per MoE layer applied so far, oldest first
      (`moe_index = len(records)`).
    stream_state: the residual stream's state, a pytree of fixed structure
      initialised before block 0 by `ResidualStream.init_state`.
    axis_name: the data-parallel axis that persistent router state is
      reduced over (static; None: no reduction).
    moe_blocks: the encoder block indices of all the model's MoE layers
      (static; routers whose behaviour depends on the placement, e.g. ACMoE's
      `layers` presets, read it).
    primary: False while a residual stream evaluates the layer a second time
      (e.g. at a shifted point; static). Such a call must not sow or update
      state: the layer then passes `update_state=False` and skips its own
      sows, and a router that sows intermediates of its own does so only
      when `ctx.primary`.
  """
  block: int = flax.struct.field(pytree_node=False, default=0)
  records: tuple[LayerRecord, ...] = ()
  stream_state: Any = ()
  axis_name: Optional[str] = flax.struct.field(pytree_node=False,
                                               default=None)
  moe_blocks: tuple[int, ...] = flax.struct.field(pytree_node=False,
                                                  default=())
  primary: bool = flax.struct.field(pytree_node=False, default=True)

  @property
  def moe_index(self) -> int:
    """How many MoE layers came before; 0 for the first MoE layer."""
    return len(self.records)

  @property
  def previous(self) -> Optional[Assignment]:
    """The previous MoE layer's `Assignment` `[B, T, K]`, or None."""
    return self.records[-1].assignment if self.records else None

  @property
  def previous_forward(self) -> Any:
    """What the previous MoE layer's router forwarded, or None."""
    return self.records[-1].forward if self.records else None

  def at_block(self, block: int) -> "RoutingContext":
    """Context for applying encoder block `block`."""
    return self.replace(block=block)

  @property
  def layer_index(self) -> int:
    """Deprecated alias of `block`, kept for one release."""
    return self.block

  def at_layer(self, layer_index: int) -> "RoutingContext":
    """Deprecated alias of `at_block`, kept for one release."""
    return self.at_block(layer_index)

  def after_moe(self, record: LayerRecord) -> "RoutingContext":
    """Context for the blocks after an MoE layer that left `record`."""
    return self.replace(records=self.records + (record,))

  def reduce_mean(self, value: Any) -> Any:
    """Mean of `value` over the data-parallel axis (identity without one)."""
    if self.axis_name is None:
      return value
    return jax.lax.pmean(value, self.axis_name)

  def reduce_sum(self, value: Any) -> Any:
    """Sum of `value` over the data-parallel axis (identity without one)."""
    if self.axis_name is None:
      return value
    return jax.lax.psum(value, self.axis_name)


def _accept_layer_index(init):
  """`RoutingContext(layer_index=i)`: the deprecated keyword of `block`,
  kept for one release."""

  @functools.wraps(init)
  def __init__(self, *args, layer_index: Optional[int] = None, **kwargs):
    if layer_index is not None:
      warnings.warn("RoutingContext(layer_index=...) is deprecated, kept for "
                    "one release; use block=...", DeprecationWarning,
                    stacklevel=2)
      kwargs["block"] = layer_index
    init(self, *args, **kwargs)

  return __init__


RoutingContext.__init__ = _accept_layer_index(RoutingContext.__init__)


@flax.struct.dataclass
class RouterOutput:
  """What a router returns (see the module docstring).

  Attributes:
    routing: the routing form.
    metrics: scalars, always with `auxiliary_loss`.
    expert_inputs: `[G, S, D]` tokens to dispatch instead of the router's
      input, or None.
    forward: a pytree for later MoE layers, or None.
    gates: `[G, S, E]` the gates a token-choice selection was made from, or
      None.
  """
  routing: Routing
  metrics: Metrics
  expert_inputs: Optional[Array] = None
  forward: Any = None
  gates: Optional[Array] = None


class Router(nn.Module):
  """Base class of every router.

  Subclasses set `kind` (one of "token_choice", "expert_choice", "soft") and
  implement `__call__` (see the module docstring). Token-choice routers report
  `slots_per_token` (K), which the MoE layer uses to size expert buffers.

  Attributes:
    num_experts: E.
  """
  num_experts: int

  kind: ClassVar[str] = TOKEN_CHOICE
  # Soft routing mixes tokens of a group, so a group must be one image.
  needs_image_groups: ClassVar[bool] = False
  # Routers that read `ctx.previous` cannot be the first MoE layer.
  needs_previous: ClassVar[bool] = False
  # Token choice: the selection is the top K of a gate vector, K fixed
  # (False for top-p, whose K varies per token). Routers that re-select from
  # a base router's gates (Symphony) need it.
  fixed_top_k: ClassVar[bool] = True
  # Whether the router may run inside a scan over blocks (`model.scan`):
  # False when it reads `ctx.block`, `ctx.records` or `ctx.moe_index` (its
  # routing depends on the block's position or on earlier MoE layers).
  scan_safe: ClassVar[bool] = True

  def __init_subclass__(cls, **kwargs: Any) -> None:
    """Reports a `ValueError` of a subclass's `__post_init__` (a router's
    own config check) as a `ConfigError` on its section ("router"), which
    its builder scopes (`model.moe.router`)."""
    super().__init_subclass__(**kwargs)
    own = cls.__dict__.get("__post_init__")
    if own is None or getattr(own, "reports_config_errors", False):
      return

    @functools.wraps(own)
    def post_init(self) -> None:
      try:
        own(self)
      except ConfigError:
        raise
      except ValueError as e:
        raise ConfigError("router", f"{type(self).__name__}: {e}") from e

    post_init.reports_config_errors = True  # type: ignore[attr-defined]
    cls.__post_init__ = post_init  # type: ignore[method-assign]

  def __post_init__(self) -> None:
    """Once a built router (no parent) is set up: a token-choice router's K
    (`slots_per_token`) fits its experts, so that an error names the field
    (`router.num_selected`) before the layer sizes the expert buffers."""
    super().__post_init__()
    if self.parent is not None or self.kind != TOKEN_CHOICE:
      return
    try:
      k, e = self.slots_per_token, self.num_experts
    except Exception:  # pylint: disable=broad-except
      return  # A wrapper whose base is checked where it is built.
    if not isinstance(e, int) or isinstance(e, bool) or e < 1:
      return
    field = ("router.num_selected" if "num_selected" in
             self.__dataclass_fields__ else "router")
    if not isinstance(k, int) or isinstance(k, bool) or not 0 < k <= e:
      raise ConfigError(field, f"K={k!r} experts a token (slots_per_token "
                        f"of {type(self).__name__}) must be an integer in "
                        f"1..num_experts E={e}")

  @property
  def slots_per_token(self) -> int:
    """K in `C = ceil(S*K*cf/E)`; 1 unless the router selects K experts."""
    return 1

  @property
  def assignment_width(self) -> int:
    """K of the `[B, T, K]` assignment this router's layer leaves behind."""
    return self.slots_per_token

  def check_placement(self, moe_blocks: tuple[int, ...]) -> None:
    """Raises ConfigError if this router cannot route MoE blocks `moe_blocks`.

    Called by the model before anything is traced, with every MoE layer's
    block index (they all use this router's config). The default accepts any
    placement; `needs_previous` routers are checked by the model itself.
    """
    del moe_blocks

  def check_stages(self, stages: tuple[tuple[int, ...], ...]) -> None:
    """Raises ConfigError if this router cannot route a model whose MoE
    blocks form `stages`: runs of MoE blocks over one token sequence, each
    with its own routing context (`ctx.moe_blocks` is the stage's, and
    `ctx.records` restart with it). A ViT has one stage; a Swin has one per
    resolution. The default checks each stage with `check_placement`;
    override it when the rule spans stages (ACMoE: at least one AC layer
    in the model, not in every stage).
    """
    for blocks in stages:
      self.check_placement(tuple(blocks))

  def __call__(self, x: Array, ctx: RoutingContext, *, capacity: int,
               deterministic: bool, update_state: bool = False
               ) -> RouterOutput:
    raise NotImplementedError


class RouterContractError(TypeError):
  """A router returned something the contract above does not allow (a bug
  in the router, raised while the model is traced)."""


def check_router_output(router: Router, out: Any) -> None:
  """Raises `RouterContractError` unless `out` keeps the router contract.

  Checked at trace time by the MoE layer: `out` is a `RouterOutput`, its
  `metrics` hold `auxiliary_loss`, and a token-choice routing selects as
  many experts a token (K of `[G, S, K]`) as the router's
  `slots_per_token`, from which the layer sized the expert capacity.
  """
  name = type(router).__name__
  if not isinstance(out, RouterOutput):
    raise RouterContractError(
        f"router {name} returned a {type(out).__name__}, not a RouterOutput "
        "(vmoe_ext.moe.contract)")
  if "auxiliary_loss" not in out.metrics:
    raise RouterContractError(
        f"router {name}'s metrics {sorted(out.metrics)} have no "
        "'auxiliary_loss': the router contract needs it, a scalar already "
        "weighted (a zero scalar if the router has no loss); the training "
        "loss adds it")
  k = getattr(out.routing, "num_selected", None)
  if router.kind == TOKEN_CHOICE and k is not None and (
      k != router.slots_per_token):
    raise RouterContractError(
        f"router {name} returned a token-choice routing of K = {k} experts "
        f"a token, but its slots_per_token is {router.slots_per_token}: the "
        "MoE layer sizes the expert capacity C = ceil(S * K * "
        "capacity_factor / E) from slots_per_token, so it would drop the "
        "wrong share of tokens. Make slots_per_token return the routing's "
        "K")


def at_least_float32(x: Array) -> Array:
  """`x` in float32 when it is in a narrower float (bfloat16), else as is
  (float64 stays float64). Routers and streams read their parameters through
  it: their scores and state stay float32 whatever `model.param_dtype`."""
  return x.astype(jnp.promote_types(x.dtype, jnp.float32))


class LinearLogits(nn.Module):
  """Router logits `l = x W (+ b)`, `W: [D, E]`, `b: [E]` (zeros at init)
  only with `use_bias`; computed in `dtype`."""
  num_experts: int
  dtype: Any = jnp.float32
  kernel_init: Any = nn.initializers.lecun_normal()
  use_bias: bool = False

  @nn.compact
  def __call__(self, x: Array) -> Array:
    """x: `[G, S, D]` -> logits `[G, S, E]`."""
    return nn.Dense(self.num_experts, use_bias=self.use_bias,
                    dtype=self.dtype, param_dtype=jnp.float32,
                    kernel_init=self.kernel_init,
                    name="dense")(x.astype(self.dtype))
