"""ACMoE + top-p dynamic routing (ACMoE Table 20's setting) on MNIST-5k.

    python -m vmoe_ext.main --config=configs/acmoe_top_p.py[:learnable]

The top-p router of `configs/top_p.py` (p = 0.2 = 0.8 / E, at most 3 experts)
as the base of the AC router (`paper` preset, "full" placement: block 3);
the AC transform is computed from each token's top-1 of the previous layer.
"""

from vmoe_ext.train.config_files import load_config


def get_config(arg=None):
  config = load_config("top_p", arg)
  config.model.moe.router = dict(
      name="acmoe", normalization="paper", layers="full",
      base=dict(config.model.moe.router))
  return config
