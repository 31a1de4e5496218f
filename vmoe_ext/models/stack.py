"""The stack of encoder blocks: rematerialisation, scan over blocks, and the
checkpoint layout of a scanned stack.

Shared by every backbone (`vmoe_ext.models.vit`, `.swin`, `.language`);
shape letters: B batch, T tokens, D width, n steps of a scanned run.

* `model.remat` ("none" | "full" | a policy of `REMAT_POLICIES`): each block
  is wrapped in `nn.remat` (`jax.checkpoint`), so its activations are
  recomputed in the backward pass instead of kept, except what the policy
  saves. Values and gradients are those of the plain block; parameter names
  are unchanged (`block_builder`).
* `model.scan`: runs of identical blocks are applied by one `nn.scan`, so
  the compiled program holds one copy of the block per run instead of one
  per block (compile time stops growing with depth). Where the MoE placement
  alternates (V-MoE Every-2: dense, MoE, dense, MoE, ...) a scan step is one
  period of the pattern; blocks that fit no repeated period are applied one
  by one (`plan_segments`, `apply_stack`). A Swin plans each stage on its
  own (kinds: shifted or not, MoE or not); what differs per block inside a
  run (Swin's drop-path rate) enters as per-step scan inputs
  (`apply_stack(step_inputs=...)`). The language model plans its layers by
  their sub-layer letter; each layer's cache `[B, L, D]` is a per-step scan
  input and its next cache a per-step scan output (`run_stack`), and
  `key_pe`, shared by every layer, is closed over.

A scanned run of `n` periods of `p` blocks starting at block `s` is one
module named `scan_name(s, p, n)` (`"scan_{s}_{p}x{n}"`), whose sub-modules
`period_{j}` hold the variables of blocks `s + i*p + j` stacked on a leading
axis `[n, ...]`, in every collection (params, router state, intermediates).
`unscan_tree` and `scan_tree` convert a collection between that layout and
the unrolled one (`encoderblock_{i}`), both ways and exactly.

Scan needs blocks that do not depend on their position: the routers and
streams that read the block index or earlier MoE layers' records (Symphony,
ACMoE, the first-layer and time-varying momentum streams, routers that
`needs_previous`) set `scan_safe = False` and `check_scan` rejects them.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable, Mapping, Optional, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from vmoe_ext.errors import require
from vmoe_ext.moe.contract import RoutingContext
from vmoe_ext.naming import PARAM_PREFIX, metric_key, param_name

Array = jax.Array

# `model.remat` names -> `jax.checkpoint` policies ("full": save nothing).
REMAT_POLICIES: dict[str, Optional[Callable[..., bool]]] = {
    "full": None,
    "nothing_saveable": jax.checkpoint_policies.nothing_saveable,
    "dots_saveable": jax.checkpoint_policies.dots_saveable,
    "save_matmuls": jax.checkpoint_policies.dots_saveable,
    "dots_with_no_batch_dims_saveable":
        jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "everything_saveable": jax.checkpoint_policies.everything_saveable,
}
REMAT_CHOICES = ("none",) + tuple(REMAT_POLICIES)
FLAGS = ("deterministic", "update_state")
_SCAN_NAME = re.compile(r"scan_(\d+)_(\d+)x(\d+)")
_PERIOD_PREFIX = "period_"


def check_remat(value: Any, field: str = "remat") -> None:
  """Raises ConfigError on `field` unless `value` is a `REMAT_CHOICES`."""
  require(isinstance(value, str) and value in REMAT_CHOICES, field,
          f"must be one of {REMAT_CHOICES}, got {value!r}")


def _positional(cls: type, num_inputs: int) -> type:
  """`cls` called with its keyword flags (`FLAGS`) as trailing positional
  arguments, so that `nn.remat` can mark them static."""

  class Positional(cls):  # type: ignore[misc, valid-type]

    @nn.compact
    def __call__(self, *args: Any) -> Any:
      inputs, flags = args[:num_inputs], args[num_inputs:]
      return super().__call__(*inputs, **dict(zip(FLAGS, flags)))

  Positional.__name__ = Positional.__qualname__ = cls.__name__
  return Positional


def block_builder(cls: type, remat: str, num_inputs: int,
                  prevent_cse: bool = True) -> Callable[..., Callable]:
  """A constructor of block `cls` under `remat`.

  `block_builder(cls, remat, n)(**attrs)` builds the block (with the same
  name and parameters as `cls(**attrs)`) and returns
  `call(*inputs, deterministic=..., update_state=...)`, where `inputs` are
  the `n` positional arguments of `cls.__call__`. With `remat="none"` the
  block is `cls` itself, called as before.
  """
  check_remat(remat)
  if remat == "none":
    def build_plain(**attrs: Any) -> Callable:
      module = cls(**attrs)
      return lambda *inputs, **flags: module(*inputs, **flags)
    return build_plain
  rematted = nn.remat(
      _positional(cls, num_inputs), policy=REMAT_POLICIES[remat],
      prevent_cse=prevent_cse,
      static_argnums=tuple(range(num_inputs + 1, num_inputs + 1 + len(FLAGS))))

  def build(**attrs: Any) -> Callable:
    module = rematted(**attrs)

    def call(*inputs: Any, deterministic: bool = True,
             update_state: bool = False) -> Any:
      return module(*inputs, deterministic, update_state)
    return call
  return build


@dataclasses.dataclass(frozen=True)
class Segment:
  """Blocks `start .. start + period * count - 1`, applied as `count` scan
  steps of `period` blocks (`count == 1`: unrolled, `period == 1`)."""
  start: int
  period: int
  count: int

  @property
  def stop(self) -> int:
    return self.start + self.period * self.count

  @property
  def scanned(self) -> bool:
    return self.count > 1


def plan_segments(kinds: Sequence[Any], max_period: int = 4, start: int = 0
                  ) -> tuple[Segment, ...]:
  """Splits blocks `start, start + 1, ...` of the given kinds (e.g. `is_moe`
  per block, `kinds[0]` being block `start`'s) into scanned runs and
  unrolled blocks.

  From the first block not yet placed, the shortest period `p <= max_period`
  whose pattern repeats at least twice is scanned as long as it repeats;
  a block that starts no repetition is unrolled. V-MoE Every-2 on 12 blocks:
  one run of 6 periods `(dense, MoE)`; Last-2 (MoE at 9 and 11): blocks 0-8
  scanned (period 1), 9, 10, 11 unrolled. `start` numbers the blocks of a
  later stack (a Swin stage) globally, so their names are the unrolled
  model's.
  """
  kinds = list(kinds)
  n, i, out = len(kinds), 0, []
  while i < n:
    best = None
    for p in range(1, max_period + 1):
      count = 1
      while (i + (count + 1) * p <= n and kinds[i + count * p:
                                                 i + (count + 1) * p]
             == kinds[i:i + p]):
        count += 1
      if count >= 2:
        best = Segment(i, p, count)
        break
    out.append(best or Segment(i, 1, 1))
    i = out[-1].stop
  return tuple(Segment(seg.start + start, seg.period, seg.count)
               for seg in out)


def scan_name(start: int, period: int, count: int) -> str:
  """`"scan_{start}_{period}x{count}"`: the module of a scanned run."""
  return f"scan_{start}_{period}x{count}"


def check_scan(scan: Any, router: Optional[nn.Module], stream: nn.Module,
               field: str = "scan", expert_parallel: Any = None) -> None:
  """Raises ConfigError on `field` unless `scan` is a bool and, when True,
  the built `router` (None: dense model) and `stream` are scan-safe and
  there is no `expert_parallel` layout."""
  require(isinstance(scan, bool), field, f"must be True or False, got "
          f"{scan!r}")
  if not scan:
    return
  require(expert_parallel is None, field, "a scan over blocks does not run "
          "with expert parallelism (its stacked expert weights would need "
          "their own sharding); set scan=False")
  for what, module in (("router", router), ("stream", stream)):
    if module is None:
      continue
    unsafe = not getattr(module, "scan_safe", True) or getattr(
        module, "needs_previous", False)
    require(not unsafe, field, f"the {what} {type(module).__name__} reads "
            "the block index or earlier MoE layers (cross-layer state), "
            "which a scan over blocks cannot give it; set scan=False")


class ScanPeriod(nn.Module):
  """One scan step: `period` blocks, built by `build(j, block)` and applied
  to the carry `(x, stream_state)`; returns the new carry and, as the
  step's scan outputs, the blocks' `(metrics, outputs)`: tuples over the
  period of each block's metrics (None for dense blocks) and per-step
  output (None for blocks that return none; see `run_stack`).

  `xs`, the step's scan inputs: None, or a tuple over the period of each
  block's inputs (this step's slice of `step_inputs`), passed to block `j`
  as its third positional argument.

  The routing context of each block starts with no records (scan-safe
  routers and streams read none) and `block` set to the run's first step.
  """
  build: Callable[[int, int], Callable]
  start: int
  period: int
  context: RoutingContext  # static fields only
  deterministic: bool
  update_state: bool

  @nn.compact
  def __call__(self, carry: tuple[Array, Any], xs: Optional[tuple]
               ) -> tuple[tuple[Array, Any], tuple[tuple, tuple]]:
    x, state = carry
    ctx = self.context.replace(stream_state=state)
    metrics, outputs = [], []
    for j in range(self.period):
      block = self.start + j
      inputs = () if xs is None else (xs[j],)
      x, ctx, m, out = self.build(j, block)(
          x, ctx.at_block(block).replace(records=()), *inputs,
          deterministic=self.deterministic, update_state=self.update_state)
      metrics.append(m)
      outputs.append(out)
    return (x, ctx.stream_state), (tuple(metrics), tuple(outputs))


def _stack(values: Sequence[Any]) -> Any:
  """`values` stacked on a new leading axis: on the host (`np.stack`)
  unless one of them is a JAX array (or tracer)."""
  if any(isinstance(v, jax.Array) for v in values):
    return jnp.stack(values)
  return np.stack(values)


def stack_inputs(step_inputs: Callable[[int], Any], seg: Segment
                 ) -> tuple:
  """The scan inputs of a scanned run: per block of the period, its blocks'
  `step_inputs(block)` stacked on a leading axis `[n, ...]` (host values
  stay host arrays, each value exactly the unrolled block's; traced arrays,
  e.g. the language model's per-layer caches, are stacked by `jnp.stack`)."""
  return tuple(
      jax.tree.map(lambda *a: _stack(a),
                   *(step_inputs(seg.start + i * seg.period + j)
                     for i in range(seg.count)))
      for j in range(seg.period))


def _unstack(seg: Segment, stacked: Sequence[Any]) -> dict[int, Any]:
  """`{block: value}` of a scanned run's per-step outputs (a tuple over the
  period of `[n, ...]` pytrees; None entries: blocks with no output)."""
  out = {}
  for j, value in enumerate(stacked):
    if value is None:
      continue
    for i in range(seg.count):
      out[seg.start + i * seg.period + j] = jax.tree.map(
          lambda a, i=i: a[i], value)
  return out


def run_stack(parent_build: Callable[..., Callable], x: Array,
              ctx: RoutingContext, num_blocks: int,
              segments: Optional[tuple[Segment, ...]], *,
              deterministic: bool, update_state: bool, start: int = 0,
              step_inputs: Optional[Callable[[int], Any]] = None
              ) -> tuple[Array, RoutingContext, dict[str, Any],
                         dict[int, Any]]:
  """`apply_stack` for blocks with a per-block output: `parent_build(block,
  name)`'s call returns `(x, ctx, metrics, output)`, where `output` (None,
  or a pytree of arrays with the same structure and shapes for every
  block of a run, e.g. the language model's next cache) is a scanned
  run's per-step scan output.

  Returns `x`, the context, `{metric_key(block): metrics}` of MoE blocks
  and `{block: output}` of the blocks whose output is not None.
  """
  metrics: dict[str, Any] = {}
  outputs: dict[int, Any] = {}
  segments = segments or tuple(Segment(b, 1, 1)
                               for b in range(start, start + num_blocks))
  for seg in segments:
    if not seg.scanned:
      x, ctx, m, out = parent_build(seg.start, param_name(seg.start))(
          x, ctx.at_block(seg.start), deterministic=deterministic,
          update_state=update_state)
      if m is not None:
        metrics[metric_key(seg.start)] = m
      if out is not None:
        outputs[seg.start] = out
      continue
    static = RoutingContext(block=seg.start, axis_name=ctx.axis_name,
                            moe_blocks=ctx.moe_blocks, primary=ctx.primary)
    scanned = nn.scan(ScanPeriod, variable_axes={True: 0},
                      split_rngs={True: True}, length=seg.count)
    (x, state), (stacked, stacked_out) = scanned(
        build=lambda j, block: parent_build(block, f"{_PERIOD_PREFIX}{j}"),
        start=seg.start, period=seg.period, context=static,
        deterministic=deterministic, update_state=update_state,
        name=scan_name(seg.start, seg.period, seg.count))(
            (x, ctx.stream_state),
            None if step_inputs is None else stack_inputs(step_inputs, seg))
    ctx = ctx.replace(stream_state=state)
    metrics.update((metric_key(b), m)
                   for b, m in sorted(_unstack(seg, stacked).items()))
    outputs.update(_unstack(seg, stacked_out))
  return x, ctx, metrics, dict(sorted(outputs.items()))


def apply_stack(parent_build: Callable[..., Callable], x: Array,
                ctx: RoutingContext, num_blocks: int,
                segments: Optional[tuple[Segment, ...]], *,
                deterministic: bool, update_state: bool, start: int = 0,
                step_inputs: Optional[Callable[[int], Any]] = None
                ) -> tuple[Array, RoutingContext, dict[str, Any]]:
  """Applies blocks `start .. start + num_blocks - 1` to `x` `[B, T, D]` in
  a compact method; `parent_build(block, name)` returns block `block`'s
  call `(x, ctx, deterministic=, update_state=) -> (x, ctx, metrics)` named
  `name`. `segments=None`: every block unrolled (the plain loop).

  `step_inputs(block)`: None, or what differs per block inside a scanned
  run (a pytree of host scalars or arrays, e.g. Swin's drop-path keep
  probability; or of traced arrays): a scanned run takes its blocks' values
  as scan inputs and calls each block with its step's value as a third
  positional argument; an unrolled block is called without (its build fixes
  the value, as a Python constant or a closed-over array).

  Returns `x`, the context and `{metric_key(block): metrics}` of MoE blocks
  (in block order). Blocks with a per-block output: `run_stack`.
  """
  def build(block: int, name: str) -> Callable:
    call = parent_build(block, name)
    return lambda *args, **flags: (*call(*args, **flags), None)

  x, ctx, metrics, _ = run_stack(
      build, x, ctx, num_blocks, segments, deterministic=deterministic,
      update_state=update_state, start=start, step_inputs=step_inputs)
  return x, ctx, metrics


def unscan_tree(tree: Mapping[str, Any]) -> dict[str, Any]:
  """A collection (e.g. params) with every scanned run split into its
  blocks `encoderblock_{i}`; other entries unchanged."""
  out: dict[str, Any] = {}
  for key, value in tree.items():
    match = _SCAN_NAME.fullmatch(key)
    if match is None:
      out[key] = value
      continue
    start, period, count = map(int, match.groups())
    for j in range(period):
      if f"{_PERIOD_PREFIX}{j}" not in value:  # No variables in this one.
        continue
      sub = value[f"{_PERIOD_PREFIX}{j}"]
      for i in range(count):
        out[param_name(start + i * period + j)] = jax.tree.map(
            lambda a, i=i: a[i], sub)
  return out


def scan_tree(tree: Mapping[str, Any], like: Mapping[str, Any]
              ) -> dict[str, Any]:
  """`tree` (either layout) in the layout of `like` (the same collection of
  the target model, arrays or shapes): the blocks of each scanned run of
  `like` stacked into it, the others `encoderblock_{i}`."""
  flat = unscan_tree(tree)
  out = {k: v for k, v in flat.items()}
  for key in like:
    match = _SCAN_NAME.fullmatch(key)
    if match is None:
      continue
    start, period, count = map(int, match.groups())
    stacked = {}
    for j in range(period):
      blocks = [param_name(start + i * period + j) for i in range(count)]
      missing = [b for b in blocks if b not in out]
      if missing:
        if f"{_PERIOD_PREFIX}{j}" in like[key]:
          raise KeyError(f"{key}: blocks {missing} are not in the tree")
        continue
      stacked[f"{_PERIOD_PREFIX}{j}"] = jax.tree.map(
          lambda *a: jnp.stack(a), *(out.pop(b) for b in blocks))
    out[key] = stacked
  return out


def is_scanned(tree: Mapping[str, Any]) -> bool:
  """Whether a collection holds any scanned run."""
  return any(_SCAN_NAME.fullmatch(k) for k in tree)


def to_layout(variables: Mapping[str, Any], like: Mapping[str, Any]
              ) -> dict[str, Any]:
  """Every collection of `variables` in the layout (scanned or unrolled) of
  the same collection in `like`; collections absent from `like` unrolled.
  Converts checkpoints between `model.scan` True and False exactly."""
  out = {}
  for name, tree in variables.items():
    target = like.get(name) if isinstance(like, Mapping) else None
    if not isinstance(tree, Mapping) or not any(
        k.startswith(PARAM_PREFIX) or _SCAN_NAME.fullmatch(k) for k in tree):
      out[name] = tree
    elif isinstance(target, Mapping) and is_scanned(target):
      out[name] = scan_tree(tree, target)
    else:
      out[name] = unscan_tree(tree)
  return out


__all__ = ["REMAT_CHOICES", "REMAT_POLICIES", "Segment", "ScanPeriod",
           "apply_stack", "block_builder", "check_remat", "check_scan",
           "is_scanned", "plan_segments", "run_stack", "scan_name",
           "scan_tree", "stack_inputs", "to_layout", "unscan_tree"]
