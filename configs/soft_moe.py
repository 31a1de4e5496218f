"""SoftMoE ViT on MNIST-5k: the default model with soft routing.

Blocks 1 and 3 are SoftMoE layers with E=4 experts of P=4 slots each (16 slots
for the 17 tokens of an image); one image per group, no auxiliary loss.
"""

from vmoe_ext.train.config_files import load_config


def get_config(arg=None):
  del arg
  config = load_config("default")
  config.model.name = "soft_moe_vit"
  config.model.moe = dict(every=2, num_experts=4, group_size=None,
                          router=dict(name="soft", num_slots=4))
  return config
