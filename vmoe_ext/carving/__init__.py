"""CMoE: carving a Mixture-of-Experts out of a trained dense ViT or decoder
language model (docs/carving.md).

* `profiling` — hidden states, activation markers and rates of a dense MLP;
* `grouping` — the shared expert, balanced K-means of the routed experts by
  an exact linear assignment, representative neurons;
* `layer` — one MLP carved into an MoE layer's params (and the random-split
  baseline);
* `spec` — the `carve` config section and the carved model config;
* `model` — a whole ViT carved block by block, each calibrated on the
  already carved blocks' outputs;
* `dense_source` — the dense checkpoint, the calibration images and the
  carved model's config; the binary's carve mode is `vmoe_ext.app.carve`;
* `decoder` — decoder language models: calibration windows of text,
  layers carved in sequence, the carved model's fresh variables;
  `llama` (a LLaMA's SwiGLU MLPs) and `language` (our language model's
  dense `f` layers) on top of it; the command is
  `vmoe_ext.app.carve_decoder`.

The router of a carved layer is `vmoe_ext.routers.cmoe`.
"""
