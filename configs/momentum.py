"""MomentumSMoE-family residual streams on MNIST-5k (V-MoE or SoftMoE).

    python -m vmoe_ext.main --config=configs/momentum.py[:VARIANT[,TOKEN...]]

The default V-MoE (MoE in blocks 1 and 3, E=4, top-2) — or, with `soft`,
the SoftMoE ViT of `configs/soft_moe.py` — with one stream of the
MomentumSMoE paper (docs/streams.md). The layout is `vmoe_reference` (the
authors' V-MoE code: post-LayerNorm in every block, the MoE output
subtracted, robust extrapolation after the pre-LayerNorm in every block),
which produced the paper's vision numbers; `paper` switches to the
equations as written.

VARIANT (default `heavy_ball`):

* `heavy_ball`: mu 0.8, gamma 1.0 (the authors' V-MoE config);
* `learn_both` / `learn_gamma` / `gamma_linear`: learnable mu and gamma /
  gamma with mu 0.7 / gamma = sigmoid(linear(x)) with mu 0.7 (E.1);
* `negative`: heavy-ball with mu = -0.3 (Negative-MomentumSMoE, E.4);
* `adam` / `adam_code`: AdamSMoE in the first MoE layer, heavy-ball after,
  in the paper's form / the authors' code form (§4.1);
* `robust`: robust momentum, p 0.2, k 1.25, L 1 (the V-MoE reference);
* `nag`, `time_varying`, `restart` (time-varying, restarted every 2 MoE
  layers; implies `deep`), `rmsprop`, `sam` (rho 0.05), `complex`
  (|mu| 0.7, arg pi/8): the extensions of appendix E.4.

TOKENS: `soft` (SoftMoE backbone), `paper` (paper layout), `deep` (8 blocks,
MoE in every odd one: 4 MoE layers, the paper's V-MoE-S placement).
Example: `:robust,soft` or `:adam_code,paper`.
"""

from vmoe_ext.train.config_files import load_config

VARIANTS = {
    "heavy_ball": dict(name="momentum", mu=0.8, gamma=1.0),
    "learn_both": dict(name="momentum", mu=0.7, gamma=1.0, learn="both"),
    "learn_gamma": dict(name="momentum", mu=0.7, gamma=1.0, learn="gamma"),
    "gamma_linear": dict(name="momentum", mu=0.7, learn="gamma_linear"),
    "negative": dict(name="momentum", mu=-0.3, gamma=1.0),
    "adam": dict(name="adam", form="paper"),
    "adam_code": dict(name="adam", form="code"),
    "robust": dict(name="robust_momentum", p=0.2, L=1.0, kappa=1.25),
    "nag": dict(name="nag", mu=0.7, gamma=1.0),
    "time_varying": dict(name="time_varying", gamma=1.0),
    "restart": dict(name="time_varying", gamma=1.0, restart_every=2),
    "rmsprop": dict(name="rmsprop"),
    "sam": dict(name="sam", rho=0.05, gamma=1.0),
    "complex": dict(name="complex_momentum", mu_abs=0.7),
}
TOKENS = ("soft", "paper", "deep")


def get_config(arg=None):
  words = [t.strip() for t in (arg or "heavy_ball").split(",") if t.strip()]
  variants = [w for w in words if w in VARIANTS]
  unknown = [w for w in words if w not in VARIANTS and w not in TOKENS]
  if unknown or len(variants) > 1:
    raise ValueError(f"momentum config argument {arg!r}: give at most one "
                     f"variant of {sorted(VARIANTS)} and any of {TOKENS}")
  variant = variants[0] if variants else "heavy_ball"
  config = load_config("soft_moe" if "soft" in words else "default")
  stream = dict(VARIANTS[variant],
                layout="paper" if "paper" in words else "vmoe_reference")
  config.model.stream = stream
  if "deep" in words or variant == "restart":
    config.model.num_layers = 8
  return config
