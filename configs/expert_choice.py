"""Expert-choice V-MoE on MNIST-5k: each expert picks its top-C tokens.

capacity_factor 2.0 = on average two experts per token (like top-2), so
C = ceil(S * 2 / E) tokens per expert per group of 8 images.
"""

from vmoe_ext.train.config_files import load_config


def get_config(arg=None):
  del arg
  config = load_config("default")
  config.model.moe.router = dict(name="expert_choice")
  config.model.moe.capacity_factor = 2.0
  return config
