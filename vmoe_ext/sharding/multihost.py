"""Multi-process jobs: `jax.distributed` start-up and per-process batch rows.

One process runs per host (TPU pod worker, GPU node) or, for tests, several
on one machine. `initialize` must run before anything touches the devices:
the binary calls it first when `--coordinator_address` / `--num_processes`
/ `--process_id` are given, or with no arguments when `--distributed` is set
(TPU pods and SLURM/Open MPI clusters: jax finds the values itself).
On CPU the cross-process collectives are gloo's (this jax's default).

Who does what in a multi-process job (`vmoe_ext.train.loop`):

  * every process runs every jitted computation (they are collectives over
    the global mesh) and takes part in every checkpoint save and restore
    (orbax writes each process's shards and its own files once, from
    process 0, with barriers between);
  * only process 0 (`is_main_process`) holds the workdir lock, writes
    `metrics.jsonl`, TensorBoard events, plots and `report.md`, and prints
    progress; `agree` hands its decisions (the lock taken or not) to the
    others, so a refused workdir stops every process with the same error.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import jax
import numpy as np

from vmoe_ext.errors import require


def initialize(coordinator_address: Optional[str] = None,
               num_processes: Optional[int] = None,
               process_id: Optional[int] = None,
               auto: bool = False) -> bool:
  """Starts `jax.distributed` when asked; returns whether it did.

  `auto` (flag `--distributed`): let jax detect the cluster (TPU pod slices,
  SLURM, Open MPI). Otherwise all three values are needed, or none (a
  single-process job).
  """
  given = [v is not None for v in (coordinator_address, num_processes,
                                   process_id)]
  if not auto and not any(given):
    return False
  require(auto or all(given), "--coordinator_address",
          "give --coordinator_address, --num_processes and --process_id "
          "together (or --distributed on a TPU pod / SLURM cluster)")
  if num_processes is not None:
    require(num_processes >= 1, "--num_processes",
            f"must be >= 1, got {num_processes}")
    require(process_id is not None and 0 <= process_id < num_processes,
            "--process_id", f"must be in [0, {num_processes}), got "
            f"{process_id}")
  kwargs = {}
  if coordinator_address is not None:
    kwargs = dict(coordinator_address=coordinator_address,
                  num_processes=num_processes, process_id=process_id)
  jax.distributed.initialize(**kwargs)
  return True


def is_main_process() -> bool:
  """True on process 0 (the only process of a single-process job)."""
  return jax.process_index() == 0


def agree(value: Optional[str]) -> Optional[str]:
  """Process 0's `value` (a short message, or None) on every process.

  For decisions only process 0 can take (is the workdir locked?): the
  others learn the outcome and fail the same way instead of waiting for
  process 0 in a collective. A no-op in a single-process job.
  """
  if jax.process_count() == 1:
    return value
  from jax.experimental import multihost_utils
  data = np.zeros(1024, np.uint8)
  if value is not None and is_main_process():
    raw = value.encode("utf-8")[:len(data) - 1]
    data[0], data[1:len(raw) + 1] = 1, np.frombuffer(raw, np.uint8)
  data = np.asarray(multihost_utils.broadcast_one_to_all(data))
  if not data[0]:
    return None
  return bytes(data[1:]).rstrip(b"\0").decode("utf-8", "replace")


def sync(name: str) -> None:
  """A barrier of every process (a no-op in a single-process job)."""
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils
    multihost_utils.sync_global_devices(name)


def process_rows(batch: Mapping[str, Any], index: Optional[int] = None,
                 count: Optional[int] = None) -> dict[str, np.ndarray]:
  """This process's contiguous share `[B/P, ...]` of a batch every process
  computed in full (the in-memory loaders draw the same batch everywhere)."""
  index = jax.process_index() if index is None else index
  count = jax.process_count() if count is None else count
  if count == 1:
    return dict(batch)
  out = {}
  for key, value in batch.items():
    value = np.asarray(value)
    rows = value.shape[0] // count
    require(value.shape[0] % count == 0, "data.batch_size",
            f"{value.shape[0]} rows do not split over {count} processes")
    out[key] = value[index * rows:(index + 1) * rows]
  return out
