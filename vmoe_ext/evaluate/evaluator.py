"""`Evaluator`: one trained model as jitted functions of raw [0, 1] images.

The model sees its inputs normalised with the training data's statistics
inside `logits_fn`, so attacks and corruptions work in raw pixel units. It
always runs deterministically (no router noise, no dropout).

With a `partitioning` (the run's mesh; needed in a multi-process job, where
every process holds the same host images) the inputs of `forward` and of
the attacks become global arrays split over the batch
(`Partitioning.global_from_full`) and their outputs come back replicated,
readable on every process. Without it the functions are plain `jax.jit`s.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Mapping, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from vmoe_ext.attacks import make_attack
from vmoe_ext.data import ArrayDataset
from vmoe_ext.data.readers import (ArrayReader, ExampleReader,
                                   reader_batches)
from vmoe_ext.reporting.writers import progress_bar
from vmoe_ext.sharding.partitioning import Partitioning

Array = jax.Array


class Evaluator:
  """Jitted clean/attacked evaluation of one model on raw [0, 1] images."""

  def __init__(self, model: nn.Module, variables: Mapping[str, Any],
               mean: Any, std: Any,
               partitioning: Optional[Partitioning] = None):
    self.model = model
    self.variables = variables
    self.mean = jnp.asarray(mean, jnp.float32)
    self.std = jnp.asarray(std, jnp.float32)
    self.partitioning = partitioning
    self._forward = self._jit(self._forward_with_routing)
    self._attacks: dict[str, Callable] = {}

  def _jit(self, fn: Callable) -> Callable:
    """`jax.jit(fn)` of `fn(variables, *arrays)`; with a partitioning the
    arrays are made global (typed PRNG keys replicated), the variables (the
    run's global arrays) passed as they are, and the outputs replicated."""
    if self.partitioning is None:
      return jax.jit(fn)
    part = self.partitioning
    jitted = jax.jit(fn, out_shardings=part.replicated)

    def to_global(x):
      if isinstance(x, jax.core.Tracer):
        return x
      if isinstance(x, jax.Array) and not x.is_fully_addressable:
        # Already global (an attack's replicated output): split like the
        # host inputs, so the forward compiles once.
        return jax.device_put(x, part.sharding_of(x.shape))
      return part.global_from_full(x)

    return lambda variables, *args: jitted(variables, *map(to_global, args))

  def logits_fn(self, x: Array) -> Array:
    """Deterministic logits of raw images `[B, H, W, C]` in [0, 1]."""
    return self._logits(self.variables, x)

  def logits_and_aux_fn(self, x: Array) -> tuple[Array, Array]:
    """`(logits, metrics["auxiliary_loss"])` of one deterministic call: the
    `logits_fn` of attacks with `include_auxiliary_loss=True`."""
    return self._logits_and_aux(self.variables, x)

  # The jitted functions take the variables as an argument: a multi-process
  # job's arrays (expert weights split over processes) cannot be closed over.
  def _logits(self, variables: Mapping[str, Any], x: Array) -> Array:
    return self.model.apply(variables, (x - self.mean) / self.std,
                            deterministic=True)[0]

  def _logits_and_aux(self, variables: Mapping[str, Any],
                      x: Array) -> tuple[Array, Array]:
    logits, metrics = self.model.apply(
        variables, (x - self.mean) / self.std, deterministic=True)
    return logits, metrics["auxiliary_loss"]

  def _forward_with_routing(self, variables: Mapping[str, Any], x: Array):
    (logits, _), state = self.model.apply(
        variables, (x - self.mean) / self.std, deterministic=True,
        mutable=["intermediates"])
    masks = {name: block["Moe"]["expert_mask"][0]
             for name, block in state.get("intermediates", {}).items()
             if "Moe" in block}
    return logits, masks

  def forward(self, x: Array):
    """`(logits [B, classes], {block name: expert_mask [B, T, E]})`."""
    return self._forward(self.variables, x)

  def attack(self, attack_config: Mapping[str, Any]) -> Callable:
    """Jitted `(x, labels, key) -> x_adv` for an attack config (with
    `include_auxiliary_loss=True` the attack sees the auxiliary loss too)."""
    key = repr(sorted(attack_config.items()))
    if key not in self._attacks:
      attack = make_attack(dict(attack_config))
      fn = (self._logits_and_aux
            if attack_config.get("include_auxiliary_loss") else self._logits)
      jitted = self._jit(lambda variables, x, y, k: attack(
          functools.partial(fn, variables), x, y, k))
      self._attacks[key] = lambda x, y, k: jitted(self.variables, x, y, k)
    return self._attacks[key]

  def predict(self, reader: ExampleReader, batch_size: int, *,
              indices: Optional[np.ndarray] = None,
              image_size: Optional[int] = None,
              desc: Optional[str] = None) -> tuple[np.ndarray, np.ndarray]:
    """Logits `[n, classes]` (float32) and labels `[n]` of `reader`'s examples
    `indices` (default: all), read and evaluated in padded batches of
    `batch_size`, images resized to `image_size` when read."""
    if indices is None:
      indices = np.arange(len(reader))
    logits, labels = [], []
    num_batches = -(-len(indices) // batch_size)
    with progress_bar(total=num_batches, desc=desc or reader.name,
                      disable=True if desc is None else None) as bar:
      for batch in reader_batches(reader, indices, batch_size, image_size):
        out, _ = self.forward(jnp.asarray(batch["image"]))
        out = np.asarray(out, np.float32)
        logits.append(out[batch["mask"]])
        labels.append(batch["label"][batch["mask"]])
        bar.update(1)
    if not logits:
      return np.zeros((0, 0), np.float32), np.zeros(0, np.int32)
    return np.concatenate(logits), np.concatenate(labels)


def clean_accuracy(evaluator: Evaluator, dataset: ArrayDataset,
                   batch_size: int) -> float:
  """Top-1 accuracy of `evaluator` on every example of `dataset`."""
  logits, labels = evaluator.predict(ArrayReader(dataset), batch_size)
  return float(np.mean(logits.argmax(-1) == labels)) if len(labels) else 0.0
