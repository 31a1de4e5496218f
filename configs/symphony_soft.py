"""SymphonySoftMoE (Symphony paper appendix E.4) on MNIST-5k.

    python -m vmoe_ext.main --config=configs/symphony_soft.py[:acmoe]

The SoftMoE ViT of `configs/soft_moe.py` (E=4 experts of P=4 slots, MoE in
blocks 1 and 3) with the Symphony graph on SoftMoE's combine weights: each
token's per-expert combine mass `q` is smoothed to `A q` and spread over the
expert's slots in SoftMoE's proportions; the graph counts each token's two
experts of largest mass (beta 0.9, zero init). `:acmoe` puts ACMoE's
`softmoe` preset (block 3) under it. See docs/routers.md.
"""

from vmoe_ext.train.config_files import load_config


def get_config(arg=None):
  soft = dict(name="soft", num_slots=4)
  bases = {"soft": soft,
           "acmoe": dict(name="acmoe", normalization="softmoe",
                         layers="full", base=soft)}
  name = arg or "soft"
  if name not in bases:
    raise ValueError(f"unknown symphony_soft base {name!r}; one of "
                     f"{sorted(bases)}")
  config = load_config("soft_moe")
  config.model.moe.router = dict(name="symphony_soft", beta=0.9,
                                 graph_init="zeros", num_selected=2,
                                 base=bases[name])
  return config
