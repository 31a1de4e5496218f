"""XMoE cosine router on MNIST-5k: the default V-MoE with cosine routing.

Scores `cos(x P, e_j) / tau` with a projection to R = 16 dimensions, expert
embeddings initialised orthogonal (gain 0.32, torchscale's X-MoE gate) and a
learnable temperature initialised at 0.07; top-2, no router noise, the V-MoE
importance loss (the load loss needs noise and is 0). See docs/routers.md.
"""

from vmoe_ext.train.config_files import load_config


def get_config(arg=None):
  del arg
  config = load_config("default")
  config.model.moe.router = dict(
      name="cosine", num_selected=2, projection_dim=16, temperature=0.07,
      learnable_temperature=True, noise_std=0.0,
      importance_loss_weight=0.005, load_loss_weight=0.005)
  return config
