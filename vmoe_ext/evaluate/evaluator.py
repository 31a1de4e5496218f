"""`Evaluator`: one trained model as jitted functions of raw [0, 1] images.

The model sees its inputs normalised with the training data's statistics
inside the jitted functions, so attacks and corruptions work in raw pixel
units. It runs deterministically (no router noise, no dropout), except the
stochastic passes an EOT attack asks for (`logits_fn(x, key=k)`).

Built on the one evaluation forward pass, `vmoe_ext.train.forward.Forward`:
one jit and one global-array path for the clean forward, the attacks and
everything that predicts through `predict` (corruptions, evaluation
datasets). With a `partitioning` (the run's mesh; needed in a multi-process
job, where every process holds the same host images) the inputs become
global arrays split over the batch and the outputs come back replicated,
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
from vmoe_ext.classification import topk_correct
from vmoe_ext.data import ArrayDataset
from vmoe_ext.data.readers import (ArrayReader, ExampleReader,
                                   reader_batches)
from vmoe_ext.reporting.writers import progress_bar
from vmoe_ext.sharding.partitioning import Partitioning
from vmoe_ext.train.forward import Forward

Array = jax.Array


class Evaluator:
  """Jitted clean/attacked evaluation of one model on raw [0, 1] images."""

  def __init__(self, model: nn.Module, variables: Mapping[str, Any],
               mean: Any, std: Any,
               partitioning: Optional[Partitioning] = None,
               image_size: Optional[int] = None):
    self.model = model
    self.variables = variables
    self.partitioning = partitioning
    # `image_size`: the run's `data.image_size`; the stored images are
    # resized inside the forward pass (`Forward.resize`), so attacks and
    # corruptions act on them and eps stays in their pixel units.
    self.fwd = Forward(model, mean=mean, std=std, partitioning=partitioning,
                       image_size=image_size)
    self.mean, self.std = self.fwd.mean, self.fwd.std
    # The jitted functions take the variables as an argument: a
    # multi-process job's arrays (expert weights split over processes)
    # cannot be closed over.
    self._forward = self.fwd.jit(self._forward_with_routing)
    self._attacks: dict[str, Callable] = {}

  def logits_fn(self, x: Array) -> Array:
    """Deterministic logits of raw images `[B, H, W, C]` in [0, 1] (not
    jitted: for use inside a caller's trace)."""
    return self.fwd.logits(self.variables, x)

  def logits_and_aux_fn(self, x: Array) -> tuple[Array, Array]:
    """`(logits, metrics["auxiliary_loss"])` of one deterministic call: the
    `logits_fn` of attacks with `include_auxiliary_loss=True` (not
    jitted)."""
    return self.fwd.logits_and_aux(self.variables, x)

  def _forward_with_routing(self, variables: Mapping[str, Any], x: Array):
    out = self.fwd.apply(variables, x, intermediates=True)
    return out.logits, {block: sown["expert_mask"]
                        for block, sown in out.moe.items()}

  def forward(self, x: Array):
    """`(logits [B, classes], {block name: expert_mask [B, T, E]})`."""
    return self._forward(self.variables, x)

  def attack(self, attack_config: Mapping[str, Any],
             details: bool = False) -> Callable:
    """Jitted `(x, labels, key) -> x_adv` for an attack config (with
    `include_auxiliary_loss=True` the attack sees the auxiliary loss too).
    `details`: `-> (x_adv, diagnostics)` (`make_attack`). The attack's
    `logits_fn` also takes `key=` for a stochastic pass (EOT attacks).

    `eps` is an argument of the compiled function, not a constant of it:
    configs that differ only in `eps` (an eps sweep; one attack at two eps)
    share one compilation."""
    config = dict(attack_config)
    make_attack(config, details=details)  # Every field checked, eps too.
    eps = config.pop("eps", None)
    key = repr((details, eps is None, sorted(config.items())))
    if key not in self._attacks:
      fn = (self.fwd.logits_and_aux
            if config.get("include_auxiliary_loss") else self.fwd.logits)

      def run(variables, x, y, k, e):
        # `e` is traced: the attacks' checks of eps skip traced values (it
        # was checked above, concretely).
        attack = make_attack(config if e is None else {**config, "eps": e},
                             details=details)
        return attack(functools.partial(fn, variables), x, y, k)

      jitted = self.fwd.jit(run, replicated=(3,))
      self._attacks[key] = jitted
    jitted = self._attacks[key]
    value = None if eps is None else np.float32(eps)
    return lambda x, y, k: jitted(self.variables, x, y, k, value)

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
  return (float(np.mean(topk_correct(logits, labels, 1))) if len(labels)
          else 0.0)
