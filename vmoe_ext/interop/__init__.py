"""Interoperability with other code bases' checkpoints (google's vmoe, vit_jax).

`formats` reads their files (vmoe's partitioned `.index`/`.data-*`, `.npz`,
flax msgpack); `layouts` maps their parameter names onto ours as `init`
rules. Importing happens through the `init` section
(`vmoe_ext.train.initialization`); see `docs/importing.md`. `checkpoint_params`
reads the params of our own orbax checkpoints without the training package
(carving reads a dense run with it). `safetensors` reads Hugging Face
checkpoint directories (a LLaMA for `vmoe_ext.models.llama`).
"""
