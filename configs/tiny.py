"""A tiny V-MoE on scikit-learn digits (8x8): about a minute on 2 CPU cores
(20 steps, then the routing analysis and a short robustness evaluation);
for tests and smoke runs."""

from vmoe_ext.train.config_files import load_config


def get_config(arg=None):
  del arg
  config = load_config("default")
  config.data.name = "digits"
  config.data.batch_size = 32
  # 64 images = 32 routing groups: they split over 1, 2, 4 or 8 processes
  # or devices (docs/sharding.md runs it on 2 processes).
  config.data.eval_batch_size = 64
  config.data.augment = False
  # The routing analysis's t-SNE of 200 tokens a layer: 0.3 s, not 3 s.
  config.data.analysis_tsne_tokens = 200
  config.model.patch_size = (4, 4)           # 4 patches + class token
  config.model.hidden_size = 16
  config.model.num_layers = 2
  config.model.num_heads = 2
  config.model.mlp_dim = 16
  config.model.moe = dict(every=2, num_experts=2, capacity_factor=1.5,
                          group_size=5 * 2,
                          router=dict(name="noisy_topk", num_selected=1))
  config.train.total_steps = 20
  config.train.log_every = 5
  config.train.eval_every = 10
  config.train.checkpoint_every = 10
  config.optimizer.warmup_steps = 5
  config.robustness.num_examples = 50
  config.robustness.attacks = (
      dict(name="fgsm", eps=0.1),
      dict(name="pgd", eps=0.1, steps=3, step_size=0.05),
      dict(name="spsa", eps=0.1, steps=2, samples=4, num_examples=10),
  )
  config.robustness.sweep = dict(attack=dict(name="pgd", steps=2),
                                 eps=(0.0, 0.1))
  config.robustness.corruptions = dict(names=("gaussian_noise", "contrast"),
                                       severities=(1, 5))
  return config
