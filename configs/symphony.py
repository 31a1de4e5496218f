"""Symphony router (expert co-selection graph) on MNIST-5k.

    python -m vmoe_ext.main --config=configs/symphony.py[:BASE[,ABLATION...]]

The default V-MoE (MoE in blocks 1 and 3, E=4, top-2) with the Symphony
router: top-2 of `A softmax(gamma(x))`, the graph `A` learned by counting
the base router's co-selections (Algorithm 1; beta 0.9, zero init, dense).
BASE picks gamma (docs/routers.md):

* `linear` (default): the V-MoE noisy top-2 router (SymphonySMoE);
* `cosine`: the XMoE cosine router of `configs/xmoe.py` (SymphonyXMoE);
* `acmoe`: ACMoE (paper preset, AC on block 3) over noisy top-2 — ACMoE and
  Symphony together.

ABLATION tokens, comma-separated, give the paper's ablations (appendix G):
`beta=0.3|0.5|0.7|0.9` (Table 14), `init=zeros|random|kaiming|xavier`
(Table 13; `random` is the paper's "standard uniform") or `init=uniform|
identity` (every entry 1/E, or the identity: not in the paper), `sparse`
(graph threshold t = 0.05, Table 15). Example: `:cosine,beta=0.5,sparse`.
"""

from vmoe_ext.train.config_files import load_config

LINEAR = dict(name="noisy_topk", num_selected=2, noise_std=1.0,
              importance_loss_weight=0.005, load_loss_weight=0.005)
BASES = {
    "linear": LINEAR,
    "cosine": dict(name="cosine", num_selected=2, projection_dim=16,
                   temperature=0.07, learnable_temperature=True,
                   noise_std=0.0),
    "acmoe": dict(name="acmoe", normalization="paper", dispersion="mad",
                  layers="full", base=LINEAR),
}
ABLATIONS = {"beta": float, "init": str}
FIELDS = {"beta": "beta", "init": "graph_init"}


def get_config(arg=None):
  tokens = [t.strip() for t in (arg or "linear").split(",") if t.strip()]
  base = "linear"
  router = dict(name="symphony", beta=0.9, graph_init="zeros", threshold=0.0)
  for token in tokens:
    key, _, value = token.partition("=")
    if not value and key in BASES:
      base = key
    elif not value and key == "sparse":
      router["threshold"] = 0.05
    elif value and key in ABLATIONS:
      router[FIELDS[key]] = ABLATIONS[key](value)
    else:
      raise ValueError(f"unknown symphony config argument {token!r}; use a "
                       f"base {sorted(BASES)}, 'beta=B', 'init=NAME' or "
                       "'sparse'")
  config = load_config("default")
  config.model.moe.router = dict(router, base=dict(BASES[base]))
  return config
