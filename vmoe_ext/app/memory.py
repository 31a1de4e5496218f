"""Before training: does the robustness evaluation's attack step fit?

The attacks run after training, in batches of `data.eval_batch_size` raw
images, and their gradient step (forward and backward through the model
for a whole batch) is the evaluation's largest program. A batch that does
not fit in memory would only fail once training is over: 1,024 images at
224 px through a ViT-S/32 V-MoE ask for ~44 GB. `check_attack_memory(run)`
compiles that step for the run's model, mesh and evaluation batch without
running it, reads XLA's memory estimate for one device (temporaries, outputs
and the batch; the model's variables are already in memory) and raises a
`ConfigError` naming `data.eval_batch_size` when it exceeds what the device
has free: on an accelerator, its memory limit less what is in use; on the
CPU, the host's available memory shared by its local devices.
"""

from __future__ import annotations

import math
import os
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from vmoe_ext.attacks.base import cross_entropy
from vmoe_ext.data import default_normalization
from vmoe_ext.errors import ConfigError
from vmoe_ext.train.forward import Forward

GIB = 2.0 ** 30


def host_available_bytes(meminfo: str = "/proc/meminfo") -> Optional[int]:
  """The host's available memory (Linux `MemAvailable`; elsewhere the free
  physical pages), None where unknown."""
  try:
    with open(meminfo, encoding="utf-8") as f:
      for line in f:
        if line.startswith("MemAvailable:"):
          return int(line.split()[1]) * 1024
  except (OSError, ValueError, IndexError):
    pass
  try:
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
  except (ValueError, OSError, AttributeError):
    return None


def device_free_bytes(device: Any) -> Optional[int]:
  """Bytes free on `device`: its memory limit less what is in use (GPU,
  TPU); on the CPU, the host's available memory over its local devices.
  None where neither is known."""
  stats = device.memory_stats() if hasattr(device, "memory_stats") else None
  if stats and stats.get("bytes_limit"):
    return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
  host = host_available_bytes()
  if host is None:
    return None
  return host // max(1, jax.local_device_count())


def attack_step_bytes(run: Any) -> int:
  """XLA's estimate of the memory one device needs beyond the variables
  for the gradient of the cross-entropy wrt a batch of
  `data.eval_batch_size` raw images (compiled, not run)."""
  config, part = run.config, run.partitioning
  shape = (config.data.eval_batch_size,) + tuple(run.eval_image_shape()[1:])
  mean, std = default_normalization(config.data)
  fwd = Forward(run.model, mean=mean, std=std, partitioning=part)
  variables = {"params": run.state.params, **run.state.collections}

  def step(variables, images, labels):
    return jax.grad(lambda x: jnp.sum(cross_entropy(
        fwd.logits(variables, x), labels)))(images)

  images = jax.ShapeDtypeStruct(shape, jnp.float32,
                                sharding=part.sharding_of(shape))
  labels = jax.ShapeDtypeStruct(shape[:1], jnp.int32,
                                sharding=part.sharding_of(shape[:1]))
  stats = jax.jit(step).lower(variables, images, labels).compile(
      ).memory_analysis()
  if stats is None:  # A backend without the analysis.
    return 0
  return (int(stats.temp_size_in_bytes) + int(stats.output_size_in_bytes)
          - int(stats.alias_size_in_bytes) + _device_bytes((images, labels)))


def _device_bytes(tree: Any) -> int:
  """Bytes of `tree`'s (abstract) arrays that one device holds."""
  return sum(math.prod(leaf.sharding.shard_shape(leaf.shape))
             * np.dtype(leaf.dtype).itemsize
             for leaf in jax.tree.leaves(tree))


def check_attack_memory(run: Any) -> None:
  """A `ConfigError` naming `data.eval_batch_size` unless the attack step
  fits the free memory of the run's first local device (module docstring);
  nothing when the run has no attacks or the free memory is unknown."""
  robustness = run.config.get("robustness")
  if robustness is None or not robustness.get("attacks"):
    return
  device = jax.local_devices()[0]
  free = device_free_bytes(device)
  if free is None:
    return
  need = attack_step_bytes(run)
  if need <= free:
    return
  batch = run.config.data.eval_batch_size
  fits = max(1, int(batch * free / need))
  raise ConfigError(
      "data.eval_batch_size",
      f"the attacks' gradient step on a batch of {batch} images needs about "
      f"{need / GIB:.1f} GiB on each device (XLA's estimate), more than the "
      f"{free / GIB:.1f} GiB free on {device.platform.upper()}; lower it to "
      f"about {fits} images (whole routing groups that split over the "
      "mesh), or run more devices (sharding.shape). Checked before "
      "training, so that the run does not fail after it")


__all__ = ["attack_step_bytes", "check_attack_memory", "device_free_bytes",
           "host_available_bytes"]
