"""Dense ViT baselines for the default V-MoE on MNIST-5k.

    --config=configs/vit_dense.py           # equal active width (default arg)
    --config=configs/vit_dense.py:plain     # plain dense ViT, mlp_dim 128
    --config=configs/vit_dense.py:plain,swiglu   # the same with SwiGLU MLPs
    --config=configs/vit_dense.py:plain,relu     # ... with ReLU MLPs

"active": the V-MoE's blocks 1 and 3 give each token K*H = 2*128 = 256 hidden
units; here those blocks are one always-selected expert of width 256 with gate
1 and no capacity limit, which computes exactly a dense MLP of width 256 (see
tests/test_models.py::test_single_expert_moe_equals_the_dense_vit); blocks 0
and 2 are the same dense MLPs of width 128 as in the V-MoE. No auxiliary loss.

"plain" is the dense ViT that CMoE carves (`configs/carve.py`); "swiglu" and
"relu" set `model.mlp_activation` (default GELU).
"""

from vmoe_ext.train.config_files import load_config

ACTIVATIONS = ("gelu", "relu", "swiglu")


def get_config(arg=None):
  parts = [p for p in (arg or "active").split(",") if p]
  kinds = [p for p in parts if p in ("active", "plain")] or ["active"]
  activations = [p for p in parts if p in ACTIVATIONS]
  unknown = [p for p in parts if p not in ("active", "plain") + ACTIVATIONS]
  if unknown or len(kinds) > 1 or len(activations) > 1:
    bad = unknown[0] if unknown else arg
    raise ValueError(f"configs/vit_dense.py: unknown arg {bad!r}; expected "
                     "'active' or 'plain', optionally with one of "
                     f"{ACTIVATIONS} (e.g. 'plain,swiglu')")
  config = load_config("default")
  model = config.model
  if activations:
    model.mlp_activation = activations[0]
  if kinds[0] == "plain":
    model.name = "vit"
    model.moe = None
    return config
  model.moe = dict(
      every=2, num_experts=1, hidden_size=2 * model.mlp_dim,
      capacity_factor=1.0, group_size=None,
      router=dict(name="noisy_topk", num_selected=1, renormalize_gates=True,
                  noise_std=0.0, importance_loss_weight=0.0,
                  load_loss_weight=0.0))
  return config
