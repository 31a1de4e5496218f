"""ACMoE (Adaptive Clustering router) on MNIST-5k, one `normalization` preset.

    python -m vmoe_ext.main --config=configs/acmoe.py:swin

The default V-MoE (MoE in blocks 1 and 3, E=4, top-2) with the AC router on
every MoE layer that has one before it ("full": block 3). The argument picks
the preset and its base router (docs/routers.md, "`acmoe`"):

* `paper` (default): the paper's Definitions 1-2 — MAD, `M_k = diag(1/s_k)`
  with mean 1, scaled tokens to the router only; base: V-MoE noisy top-2.
* `language`: the authors' language-model code — eps 1e-4, clamp 10x mean,
  each feature divided by its mean over clusters; base: `(x*W) .
  normalize(e_j)` ("cosine_lm", combine softmax(top-2 logits), no noise).
* `swin`: the authors' Swin code — clamp 1.5x mean, divided by the pre-clamp
  mean, scaled tokens to the router and the experts; base: linear top-2 with
  train noise randn/E (V-MoE noise_std 1.0).
"""

from vmoe_ext.train.config_files import load_config

BASES = {
    "paper": dict(name="noisy_topk", num_selected=2, noise_std=1.0),
    "language": dict(name="cosine_lm", num_selected=2),
    "swin": dict(name="noisy_topk", num_selected=2, noise_std=1.0),
}


def get_config(arg=None):
  preset = arg or "paper"
  if preset not in BASES:
    raise ValueError(f"unknown ACMoE preset {preset!r}; one of {sorted(BASES)}")
  config = load_config("default")
  config.model.moe.router = dict(
      name="acmoe", normalization=preset, dispersion="mad", layers="full",
      base=BASES[preset])
  return config
