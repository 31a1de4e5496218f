"""Jitted train and eval steps for classification with MoE auxiliary losses."""

from __future__ import annotations

import re
from typing import Any, Callable, Mapping

import flax.linen as nn
import flax.traverse_util
import jax
import jax.numpy as jnp
import numpy as np
import optax

from vmoe_ext.classification import (cross_entropy, soft_targets,
                                     topk_correct)
from vmoe_ext.config.defaults import fill_defaults
from vmoe_ext.data.mixup import mixup_jax
from vmoe_ext.moe.contract import ROUTER_STATE
from vmoe_ext.naming import (METRIC_PREFIX, PARAM_PATTERN,
                                    metric_key_of)
from vmoe_ext.reporting.writers import MAX_ARRAY_SIZE
from vmoe_ext.train.config import LOSSES, MIXUP
from vmoe_ext.train.forward import forward_pass
from vmoe_ext.train.state import TrainState

Array = jax.Array
Batch = dict[str, Array]



# Folded into the step key (`jax.random.fold_in`) for the mixup weights:
# "mix" in ASCII. The gating and dropout keys stay the split of the step key,
# so a run without mixup is bit-identical to one built without the argument.
MIXUP_KEY_DATA = 0x6d6978


def mixup_options(mixup: Mapping[str, Any] | None) -> dict | None:
  """The `mixup_jax` keyword arguments of a checked `train.mixup` section,
  or None when mixup is off (no section, concentration 0 or None).

  Absent fields take the section's defaults (`train.config.MIXUP`: vmoe's
  size 2, granularity "device"); `groups=None` resolves to
  `jax.device_count()` (vmoe: one group per device), a static value fixed
  when the step is built.
  """
  mixup = fill_defaults(MIXUP, mixup)
  if mixup is None or not mixup["concentration"]:
    return None
  groups = mixup["groups"]
  return dict(concentration=mixup["concentration"], size=mixup["size"],
              granularity=mixup["granularity"],
              groups=jax.device_count() if groups is None else groups)


def routing_summary(metrics: dict[str, Any],
                    exclude: tuple[str, ...] = ()) -> dict[str, Any]:
  """`{"layer_i/name": value}` for every per-block metric but `exclude`
  (`layer_i`: block i, `vmoe_ext.naming`): all that the router returned
  (its losses and diagnostics: top-p's `experts_per_token` and `threshold`,
  Symphony's `symphony_fallback`, ...) and the layer's `drop_rate`,
  `expert_load` and `expert_usage` (`[E]`). A router's metrics are its
  declaration of what is logged: nothing else lists them."""
  out = {}
  for layer, values in metrics.items():
    if layer.startswith(METRIC_PREFIX):
      for name, value in values.items():
        if name not in exclude:
          out[f"{layer}/{name}"] = value
  return out


_ROUTER_PATH = re.compile(rf"^({PARAM_PATTERN})/Moe/router/(.+)$")


def router_state_metrics(collections: Mapping[str, Any]) -> dict[str, Any]:
  """Snapshot of the persistent router state for a train log line.

  Every numeric leaf of `collections["router_state"]` at
  `encoderblock_{i}/Moe/router/<path>` (block i) becomes the metric
  `layer_{i}/router_state/<path>` (any other leaf `router_state/<its
  path>`) as a host array, e.g. Symphony's `[E, E]` expert graph as
  `layer_1/router_state/adjacency`. Leaves of more than `MAX_ARRAY_SIZE`
  elements (too large for `metrics.jsonl`) are left out. Reads the device:
  call it only where the loop syncs anyway (log steps).
  """
  state = collections.get(ROUTER_STATE) or {}
  flat = flax.traverse_util.flatten_dict(state, sep="/") if state else {}
  out = {}
  for path, value in sorted(jax.device_get(flat).items()):
    value = np.asarray(value)
    if value.dtype.kind not in "biuf" or value.size > MAX_ARRAY_SIZE:
      continue
    match = _ROUTER_PATH.match(path)
    name = (f"{metric_key_of(match.group(1))}/{ROUTER_STATE}/{match.group(2)}"
            if match else f"{ROUTER_STATE}/{path}")
    out[name] = value
  return out


def all_finite(tree: Any) -> Array:
  """bool scalar: no NaN/Inf in any inexact leaf of `tree` (traceable)."""
  checks = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)
            if jnp.issubdtype(jnp.asarray(x).dtype, jnp.inexact)]
  return jnp.all(jnp.stack(checks)) if checks else jnp.asarray(True)


def guarded_update(state: TrainState, loss: jax.Array, grads: Any,
                   collections: Mapping[str, Any], guard_weights: bool
                   ) -> tuple[TrainState, jax.Array, jax.Array]:
  """One optimizer update of `state` with `grads` and the new mutable
  `collections`, committed only where the loss and the gradient norm are
  finite, and with `guard_weights` the new weights, moments and collections
  too (a finite gradient times an overflowing learning rate gives inf
  parameters or moments, which must not be committed either). Returns
  `(new_state, grad_norm, finite)`."""
  updates, opt_state = state.tx.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  grad_norm = optax.global_norm(grads)
  finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
  if guard_weights:
    finite &= all_finite((params, opt_state, collections))
  new_state = state.commit(
      state.replace(params=params, opt_state=opt_state,
                    collections=dict(collections)), finite)
  return new_state, grad_norm, finite


def make_train_step(model: nn.Module, *, label_smoothing: float = 0.0,
                    learning_rate_fn: Callable[[Array], Array] | None = None,
                    guard_weights: bool = True,
                    mixup: Mapping[str, Any] | None = None,
                    loss_type: str = LOSSES[0],
                    input_map: Callable[[Array], Array] | None = None
                    ) -> Callable[[TrainState, Batch], tuple[TrainState,
                                                             dict]]:
  """Returns `train_step(state, batch) -> (state, metrics)` (not jitted).

  The loss is the mean of `cross_entropy(..., loss_type)` (`train.loss`:
  softmax or vmoe's sigmoid cross-entropy) plus the model's summed
  auxiliary loss.
  Non-parameter collections (e.g. router state) are updated with the model's
  mutations (the model is applied with `update_state=True`). NaN guard on the
  device: if the loss, the gradient norm, or any updated parameter, optimizer
  moment or collection is not finite, the update is skipped and counted in the state (`TrainState.commit`); the caller reads
  `state.nonfinite_count` when it likes (no host sync per step). Safe to jit
  with `donate_argnums=0`. `guard_weights=False` checks only the loss and
  gradient norm (for benchmarks: `benchmarks/train_step.py` measures the
  cost of checking the weights).

  `mixup` (a `train.mixup` section, see `mixup_options`): when on, the
  integer labels become one-hot targets, label-smoothed *before* mixing, and
  images and targets are mixed by `vmoe_ext.data.mixup.mixup_jax` with the
  key `fold_in(step_key, MIXUP_KEY_DATA)`; the loss is the mean soft-target
  cross-entropy. The train `accuracy` stays against `batch["label"]`, the
  label of the example that keeps the largest mixing weight (>= 1 / size);
  with vmoe's `size=2` that label is always a largest component of its mixed
  target (with more, neighbours sharing a label can outweigh it).

  `input_map` (e.g. `vmoe_ext.data.device_normalize.DeviceNormalize`, with
  `data.device_normalize`): the step's first op, `batch["image"]` (uint8)
  -> the float32 images, before mixup and the model.
  """
  mix = mixup_options(mixup)
  smoothing = 0.0 if mix else label_smoothing  # With mixup: before mixing.

  def train_step(state: TrainState, batch: Batch):
    key = state.step_key()
    gating, dropout = jax.random.split(key)
    mutable = list(state.collections)
    images, targets = batch["image"], batch["label"]
    if input_map is not None:
      images = input_map(images)
    if mix:
      targets = soft_targets(targets, model.num_classes, label_smoothing)
      images, targets = mixup_jax(jax.random.fold_in(key, MIXUP_KEY_DATA),
                                  images, targets, **mix)

    def loss_fn(params):
      variables = {"params": params, **state.collections}
      out = model.apply(variables, images, deterministic=False,
                        rngs={"gating": gating, "dropout": dropout},
                        mutable=mutable or False, update_state=True)
      (logits, metrics), new_collections = out if mutable else (out, {})
      ce = jnp.mean(cross_entropy(logits, targets, smoothing, loss_type))
      loss = ce + metrics["auxiliary_loss"]
      return loss, (ce, logits, metrics, new_collections)

    (loss, (ce, logits, metrics, collections)), grads = jax.value_and_grad(
        loss_fn, has_aux=True)(state.params)
    new_state, grad_norm, finite = guarded_update(
        state, loss, grads, collections, guard_weights)
    out = {
        "loss": loss,
        "cross_entropy": ce,
        "auxiliary_loss": metrics["auxiliary_loss"],
        "accuracy": jnp.mean(topk_correct(logits, batch["label"], 1)),
        "grad_norm": grad_norm,
        **routing_summary(metrics),
    }
    if learning_rate_fn is not None:
      out["learning_rate"] = learning_rate_fn(state.step)
    return new_state, out

  return train_step


def make_eval_step(model: nn.Module, loss_type: str = LOSSES[0],
                   input_map: Callable[[Array], Array] | None = None
                   ) -> Callable[[TrainState, Batch], dict]:
  """Returns `eval_step(state, batch) -> sums` (not jitted); the summed
  `loss` is the run's `train.loss` (`cross_entropy`).

  `batch["mask"]` marks real examples (padding is False). The returned sums
  (`count`, `correct_top1`, `correct_top5`, `loss`) are over real examples;
  routing metrics are per batch (weighted by `count` when aggregated).
  `input_map` (as in `make_train_step`, for uint8 batches): the first op,
  padding rows set to 0 after it, as the float32 batches pad them.
  """

  def eval_step(state: TrainState, batch: Batch) -> dict:
    images = batch["image"]
    if input_map is not None:
      real = batch["mask"].reshape((-1,) + (1,) * (images.ndim - 1))
      images = jnp.where(real, input_map(images), 0.0)
    logits, metrics, _ = forward_pass(model, state.variables(), images)
    mask = batch["mask"].astype(jnp.float32)
    labels = batch["label"]
    return {
        "count": jnp.sum(mask),
        "correct_top1": jnp.sum(mask * topk_correct(logits, labels, 1)),
        "correct_top5": jnp.sum(mask * topk_correct(logits, labels, 5)),
        "loss": jnp.sum(mask * cross_entropy(logits, labels,
                                             loss=loss_type)),
        # The load loss is only defined with router noise (training).
        "routing": routing_summary(metrics, exclude=("load_loss",)),
    }

  return eval_step


def evaluate(eval_step: Callable, state: TrainState, batches) -> dict:
  """Runs `eval_step` over all batches; returns accuracy, top-5, loss, routing.

  Per-layer routing metrics are averaged over batches weighted by their number
  of real examples.
  """
  totals = {"count": 0.0, "correct_top1": 0.0, "correct_top5": 0.0,
            "loss": 0.0}
  routing: dict[str, Any] = {}
  for batch in batches:
    out = jax.device_get(eval_step(state, batch))
    n = float(out["count"])
    for key in totals:
      totals[key] += float(out[key])
    for key, value in out["routing"].items():
      routing[key] = routing.get(key, 0.0) + n * jnp.asarray(value)
  count = max(totals["count"], 1.0)
  result = {
      "accuracy": totals["correct_top1"] / count,
      "top5_accuracy": totals["correct_top5"] / count,
      "loss": totals["loss"] / count,
      "num_examples": int(totals["count"]),
  }
  for key, value in routing.items():
    result[key] = jax.device_get(value / count)
  return result
