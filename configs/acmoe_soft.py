"""ACMoE on SoftMoE (the authors' SoftMoE code; ACMoE appendix C.7) on MNIST-5k.

The SoftMoE ViT of `configs/soft_moe.py` (E=4 experts of P=4 slots) with the
`softmoe` preset on block 3: statistics on the L2-normalised MoE input
(eps 0.35, clamp 5x mean, divided by the post-clamp mean), each token's
scaling mixed over the experts of its previous top-8 slots (weights: softmax
of those 8 slot logits), and the normalised, scaled tokens are what the slots
mix. Block 1 is plain SoftMoE (it dispatches raw tokens, as vmoe).
"""

from vmoe_ext.train.config_files import load_config


def get_config(arg=None):
  del arg
  config = load_config("soft_moe")
  config.model.moe.router = dict(
      name="acmoe", normalization="softmoe", layers="full",
      base=dict(name="soft", num_slots=4))
  return config
