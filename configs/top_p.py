"""Top-p dynamic routing (Guo et al. 2024; ACMoE appendix C.10) on MNIST-5k.

    python -m vmoe_ext.main --config=configs/top_p.py             # fixed p
    python -m vmoe_ext.main --config=configs/top_p.py:learnable   # learnable p

Each token goes to every expert whose gate exceeds p, at most 3 of the E=4
(and always its top-1). The paper uses p = 0.05 with E = 16 experts, i.e.
0.8 / E; with our E = 4 the same ratio to the uniform gate gives p = 0.2 (at
p = 0.05 nearly every token would take all experts). Learnable p starts
there. The importance loss balances the experts (no load loss for top-p).
"""

from vmoe_ext.train.config_files import load_config


def top_p_router(arg=None) -> dict:
  if arg not in (None, "fixed", "learnable"):
    raise ValueError(f"unknown argument {arg!r}; 'fixed' or 'learnable'")
  return dict(name="top_p", num_selected=3, threshold=0.2,
              learnable_threshold=arg == "learnable", noise_std=1.0,
              importance_loss_weight=0.005, load_loss_weight=0.0)


def get_config(arg=None):
  config = load_config("default")
  config.model.moe.router = top_p_router(arg)
  config.model.moe.capacity_factor = 1.25
  return config
