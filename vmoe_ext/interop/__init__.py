"""Interoperability with other code bases' checkpoints (google's vmoe, vit_jax).

`formats` reads their files (vmoe's partitioned `.index`/`.data-*`, `.npz`,
flax msgpack); `layouts` maps their parameter names onto ours as `init`
rules. Importing happens through the `init` section
(`vmoe_ext.train.initialization`); see `docs/importing.md`.
"""
