"""Sharding: the mesh, partition rules, the jitted steps over them, multi-host.

* `mesh` — the mesh of the config's `sharding` section (`AxisType.Auto`).
* `rules` — regex -> `PartitionSpec` for params, optimizer and router state.
* `partitioning` — `Partitioning`: shardings, global batches, jitted steps.
* `multihost` — `jax.distributed` start-up and per-process batch rows.

The expert-parallel MoE layer itself (`shard_map` + two all-to-alls) is
`vmoe_ext.moe.expert_parallel`. Import the submodules directly; this package
imports nothing itself.
"""
