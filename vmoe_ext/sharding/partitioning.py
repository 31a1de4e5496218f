"""`Partitioning`: a run's mesh, its shardings, and the steps jitted over it.

    part = Partitioning.from_config(config.get("sharding"))
    model = build_model(config.model, part.expert_parallel)
    state = part.shard(state)                       # rules -> NamedShardings
    train_step = part.jit_train_step(make_train_step(model, ...), state)
    state, metrics = train_step(state, part.global_batch(local_batch))

Steps are jitted with explicit in/out shardings: the state keeps its
shardings across steps (and is donated), batches are split over all mesh
axes, metrics and evaluation sums come back replicated (readable on every
process). Batches are assembled from each process's rows
(`jax.make_array_from_process_local_data`), so the same code runs on one CPU,
a multi-GPU host and a multi-host TPU pod slice.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Optional

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from vmoe_ext.errors import require
from vmoe_ext.moe.expert_parallel import ExpertParallel
from vmoe_ext.sharding.mesh import (batch_axes, expert_parallel, make_mesh,
                                    sharding_config)
from vmoe_ext.sharding.rules import Rules, named_shardings


@dataclasses.dataclass(frozen=True)
class Partitioning:
  """How a run is laid out on its devices.

  Attributes:
    mesh: the device mesh (`sharding.axes`, `sharding.shape`).
    rules: the partition rules of the state (None: `DEFAULT_RULES`).
    expert_parallel: the MoE layers' layout (None on one device or without
      an expert axis); give it to `build_model`.
  """
  mesh: Mesh
  rules: Optional[Rules] = None
  expert_parallel: Optional[ExpertParallel] = None

  @classmethod
  def from_config(cls, section: Optional[Mapping[str, Any]] = None,
                  devices: Optional[Any] = None) -> "Partitioning":
    """From a `sharding` config section; errors name its fields."""
    config = sharding_config(section)
    mesh = make_mesh(config, devices)  # Checks the rules too.
    rules = config["rules"]
    return cls(mesh, None if rules is None else tuple(map(tuple, rules)),
               expert_parallel(mesh, config))

  @property
  def num_shards(self) -> int:
    """Batch shards: every device holds different examples."""
    return self.mesh.size

  @property
  def batch(self) -> NamedSharding:
    """`[B, ...]` split over all mesh axes."""
    return NamedSharding(self.mesh, PartitionSpec(batch_axes(self.mesh)))

  @property
  def replicated(self) -> NamedSharding:
    return NamedSharding(self.mesh, PartitionSpec())

  def check_batch_size(self, batch_size: int, field: str) -> None:
    """Errors naming `field` unless the batch splits over the devices and
    the processes."""
    require(batch_size % self.num_shards == 0, field,
            f"{batch_size} does not split over the {self.num_shards} "
            f"devices of the mesh {dict(self.mesh.shape)} (sharding.shape)")
    require(batch_size % jax.process_count() == 0, field,
            f"{batch_size} does not split over the {jax.process_count()} "
            "processes")

  def shardings(self, tree: Any) -> Any:
    """NamedShardings of a state tree (arrays or ShapeDtypeStructs)."""
    return named_shardings(tree, self.mesh, self.rules)

  def shard(self, tree: Any) -> Any:
    """`tree` placed by the rules. Leaves already where the rules want
    them are not copied: the result may share buffers with `tree` (donating
    it to a step deletes them)."""
    return jax.device_put(tree, self.shardings(tree))

  def global_batch(self, local: Mapping[str, Any]) -> dict[str, jax.Array]:
    """A global batch from this process's rows of it (all of it when there
    is one process): `[B/P, ...]` host arrays -> `[B, ...]` split arrays."""
    return {k: jax.make_array_from_process_local_data(
        self.batch, np.asarray(v)) for k, v in local.items()}

  def global_from_full(self, full: Any, split: bool = True) -> jax.Array:
    """A global array from a host array every process holds in full
    (in-memory evaluation data, attack inputs, index vectors, PRNG keys):
    split over the batch when `split` and its rows divide over the devices,
    else replicated. A typed PRNG key comes back a (replicated) typed key."""
    dtype = getattr(full, "dtype", None)
    if dtype is not None and jax.dtypes.issubdtype(dtype,
                                                   jax.dtypes.prng_key):
      return jax.random.wrap_key_data(
          self.global_from_full(jax.random.key_data(full), split=False),
          impl=jax.random.key_impl(full))
    full = np.asarray(full)
    return jax.make_array_from_callback(
        full.shape, self.sharding_of(full.shape, split),
        lambda index: full[index])

  def sharding_of(self, shape: tuple[int, ...], split: bool = True
                  ) -> NamedSharding:
    """`batch` for an array of `shape` whose rows divide over the devices
    (when `split`), else `replicated`."""
    if split and len(shape) and shape[0] % self.num_shards == 0:
      return self.batch
    return self.replicated

  def jit_train_step(self, step: Callable, state: Any) -> Callable:
    """`step(state, batch) -> (state, metrics)` jitted: state in and out
    with its rule shardings (donated), batch split, metrics replicated."""
    shardings = self.shardings(state)
    return jax.jit(step, in_shardings=(shardings, self.batch),
                   out_shardings=(shardings, self.replicated),
                   donate_argnums=0)

  def jit_eval_step(self, step: Callable, state: Any) -> Callable:
    """`step(state, batch) -> sums` jitted: sums replicated."""
    return jax.jit(step, in_shardings=(self.shardings(state), self.batch),
                   out_shardings=self.replicated)
