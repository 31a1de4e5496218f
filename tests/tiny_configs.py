"""Tiny versions of the repository's configs, shared by tests."""

from __future__ import annotations


def tiny_cifar10(config, data_dir):
  """Shrinks a `configs/cifar10_tfds.py`-based config in place: a 2-block,
  width-8 V-MoE with 2 experts, batches of 4, 2 training steps."""
  config.data.data_dir = data_dir
  config.data.batch_size = config.data.eval_batch_size = 4
  config.model.update(dict(hidden_size=8, num_layers=2, num_heads=2,
                           mlp_dim=8, dropout_rate=0.0))
  config.model.moe = dict(every=2, num_experts=2, group_size=65 * 2,
                          router=dict(name="noisy_topk", num_selected=1))
  config.train.update(dict(total_steps=2, log_every=1, eval_every=0,
                           checkpoint_every=2))
  config.optimizer.warmup_steps = 1
  return config
