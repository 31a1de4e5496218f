"""The deterministic forward pass of evaluation: one definition, one jit,
one global-array path.

Every evaluation of a trained model calls it through `Forward`:

* the eval step (`steps.make_eval_step`: `forward_pass`; its caller jits
  it with the state's shardings, `Partitioning.jit_eval_step`);
* the routing analysis (`vmoe_ext.evaluate.routing_analysis`);
* `vmoe_ext.evaluate.Evaluator`, and through it the clean accuracy, the
  attacks, the corruptions and the evaluation datasets.

    fwd = Forward(model, mean=0.5, std=0.25, partitioning=part)
    out = fwd.apply(variables, images, intermediates=True)   # traceable
    fn = fwd.jit(lambda variables, x, idx: ..., replicated=(1,))
    result = fn(variables, host_images, host_index)

The model runs deterministically (no router noise, no dropout) and never
updates its router state; the one exception is `sample_logits` (the
stochastic passes AutoAttack's "rand" version averages over), which draws
router noise and dropout from a key and still updates no state. With `mean`/`std` it takes raw images and
normalises them first (`(x - mean) / std`, inside the jitted function), so
attacks and corruptions work in pixel units; without, images as the data
pipeline normalised them.

`jit`: with `partitioning=None` (one device, or a single process that
lets jax place the arrays) a plain `jax.jit`. With the run's
`Partitioning` (needed in a multi-process job, where every process holds
the same host arrays) each array argument becomes a global array split over
the batch (`Partitioning.global_from_full`; replicated when its rows do not
divide over the devices, when its position is in `replicated`, and for
typed PRNG keys), an array already global (another jitted function's
replicated output) is re-split the same way so the function compiles once,
the variables (the run's global arrays) are passed as they are, and the
outputs come back replicated, readable on every process.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, NamedTuple, Optional, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from vmoe_ext.data.preprocessing import resize_weights
from vmoe_ext.models.stack import unscan_tree
from vmoe_ext.sharding.partitioning import Partitioning

Array = jax.Array
# What each MoE layer sows (`vmoe_ext.moe.layer`), per block.
INTERMEDIATES = "intermediates"


class ForwardOutput(NamedTuple):
  """One deterministic forward pass.

  Attributes:
    logits: `[B, classes]`.
    metrics: the model's metrics (`auxiliary_loss`, `layer_i/...`).
    moe: `{block name: {name: value}}` of what every MoE layer sowed
      (`expert_mask [B, T, E]`, `selected_experts [B, T, K]`,
      `moe_input [B, T, D]`, `moe_output [B, T, D]`); empty unless
      `intermediates=True`.
  """
  logits: Array
  metrics: Mapping[str, Any]
  moe: Mapping[str, Mapping[str, Array]]


def moe_intermediates(sown: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
  """`{block: {name: value}}` of the MoE layers' sown intermediates
  (`intermediates[block]["Moe"][name][0]`); blocks without an expert mask
  (dense blocks) are left out. A scanned stack's (`model.scan`) stacked
  intermediates are split into their blocks first."""
  out = {}
  for block, values in unscan_tree(sown).items():
    moe = values.get("Moe", {}) if isinstance(values, Mapping) else {}
    if "expert_mask" in moe:
      out[block] = {name: value[0] for name, value in moe.items()
                    if isinstance(value, tuple)}
  return out


def forward_pass(model: nn.Module, variables: Mapping[str, Any],
                 images: Array, *, intermediates: bool = False
                 ) -> ForwardOutput:
  """`model.apply(variables, images, deterministic=True)` as a
  `ForwardOutput` (traceable); `intermediates`: also what the MoE layers
  sow (`ForwardOutput.moe`)."""
  if not intermediates:
    logits, metrics = model.apply(variables, images, deterministic=True)
    return ForwardOutput(logits, metrics, {})
  (logits, metrics), state = model.apply(
      variables, images, deterministic=True, mutable=[INTERMEDIATES])
  return ForwardOutput(logits, metrics,
                       moe_intermediates(state.get(INTERMEDIATES, {})))


class Forward:
  """A model's evaluation forward pass, and the jit of functions of it.

  Args:
    model: the (Flax) model; called as `model.apply(variables, images,
      deterministic=True)`, returning `(logits, metrics)`.
    mean, std: when given, `apply` takes raw images and normalises them
      (`(x - mean) / std`, float32); None: images already normalised.
    partitioning: the run's mesh for `jit` (see the module docstring);
      None: one device.
    image_size: when given, raw images of another size are first resized to
      `image_size x image_size` by the linear interpolation the in-memory
      pipeline resizes with (`vmoe_ext.data.preprocessing.resize`, the
      `data.image_size` of a run), inside the traced function: an attack
      perturbs the stored images and differentiates through the resize.
  """

  def __init__(self, model: nn.Module, *, mean: Any = None, std: Any = None,
               partitioning: Optional[Partitioning] = None,
               image_size: Optional[int] = None):
    if (mean is None) != (std is None):
      raise ValueError("give both mean and std, or neither")
    self.model = model
    self.mean = None if mean is None else jnp.asarray(mean, jnp.float32)
    self.std = None if std is None else jnp.asarray(std, jnp.float32)
    self.partitioning = partitioning
    self.image_size = image_size

  def resize(self, images: Array) -> Array:
    """`[B, H, W, C]` -> `[B, S, S, C]` with S = `image_size` (unchanged
    without one, or at that size already)."""
    s = self.image_size
    _, h, w, _ = images.shape
    if s is None or (h, w) == (s, s):
      return images
    wh = jnp.asarray(resize_weights(h, s), jnp.float32)
    ww = jnp.asarray(resize_weights(w, s), jnp.float32)
    out = jnp.einsum("oh,nhwc->nowc", wh, images.astype(jnp.float32))
    return jnp.einsum("pw,nowc->nopc", ww, out)

  def normalize(self, images: Array) -> Array:
    """What the model sees of `images` (resized, normalised)."""
    images = self.resize(images)
    if self.mean is None:
      return images
    return (images - self.mean) / self.std

  def apply(self, variables: Mapping[str, Any], images: Array, *,
            intermediates: bool = False) -> ForwardOutput:
    """The deterministic forward pass of (raw, with `mean`/`std`) images
    (traceable; see `forward_pass`)."""
    return forward_pass(self.model, variables, self.normalize(images),
                        intermediates=intermediates)

  def logits(self, variables: Mapping[str, Any], images: Array,
             key: Optional[Array] = None) -> Array:
    """`apply(...).logits`: an attack's `logits_fn` once `variables` are
    bound. With `key`: the logits of one stochastic pass instead
    (`sample_logits`; AutoAttack's "rand" version averages over them)."""
    if key is not None:
      return self.sample_logits(variables, images, key)
    return self.apply(variables, images).logits

  def sample_logits(self, variables: Mapping[str, Any], images: Array,
                    key: Array) -> Array:
    """Logits of one training-mode pass (`deterministic=False`: router noise
    and dropout drawn from `key`); no router or stream state is updated."""
    gating, dropout = jax.random.split(key)
    logits, _ = self.model.apply(variables, self.normalize(images),
                                 deterministic=False,
                                 rngs={"gating": gating, "dropout": dropout})
    return logits

  def logits_and_aux(self, variables: Mapping[str, Any],
                     images: Array) -> tuple[Array, Array]:
    """`(logits, metrics["auxiliary_loss"])` of one pass: the `logits_fn` of
    attacks with `include_auxiliary_loss=True`."""
    out = self.apply(variables, images)
    return out.logits, out.metrics["auxiliary_loss"]

  def jit(self, fn: Callable[..., Any], *, replicated: Sequence[int] = ()
          ) -> Callable[..., Any]:
    """`fn(variables, *arrays)` jitted, called the same way (see the module
    docstring for the global-array path). `replicated`: positions in
    `arrays` (0 = the first array after the variables) that are never split
    (e.g. an index vector into the flattened batch); an argument may be a
    pytree of arrays (e.g. one index per layer)."""
    if self.partitioning is None:
      return jax.jit(fn)
    part = self.partitioning
    jitted = jax.jit(fn, out_shardings=part.replicated)
    keep = frozenset(replicated)

    def to_global(x: Any, split: bool) -> Any:
      if isinstance(x, jax.core.Tracer):
        return x  # Inside a trace (`jax.eval_shape`, an enclosing jit).
      if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return jax.device_put(x, part.sharding_of(x.shape, split))
      return part.global_from_full(x, split)

    def global_fn(variables, *arrays):
      return jitted(variables, *(
          jax.tree_util.tree_map(lambda a, s=i not in keep: to_global(a, s),
                                 x) for i, x in enumerate(arrays)))

    return global_fn


__all__ = ["Forward", "ForwardOutput", "INTERMEDIATES", "forward_pass",
           "moe_intermediates"]
