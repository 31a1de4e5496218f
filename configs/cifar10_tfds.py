"""V-MoE on CIFAR-10 read with TFDS from your own prepared data directory.

    python -m vmoe_ext.main --config=configs/cifar10_tfds.py \
        --config.data.data_dir=/path/to/tensorflow_datasets --workdir=runs/c10

Nothing downloads: prepare the dataset first on a machine with internet, e.g.
`tfds build cifar10 --data_dir=DIR --file_format=array_record` (array_record
is read without TensorFlow; the default tfrecord format also needs
`pip install tensorflow-cpu`). Install the extra: `pip install -e ".[tfds]"`.

Model: a ViT-S-like V-MoE at 32x32 (patch 4 -> 64 patches + class token),
6 blocks, MoE in blocks 1, 3, 5 with E=8 experts, noisy top-2, cf 1.25,
routing groups of 8 images; AdamW with cosine decay, random shifts and flips.
"""

import ml_collections


def get_config(arg=None):
  del arg
  config = ml_collections.ConfigDict()
  config.seed = 0
  total_steps = ml_collections.FieldReference(20_000)
  config.data = ml_collections.ConfigDict(dict(
      name="tfds",
      tfds_name="cifar10",
      # Required: --config.data.data_dir=DIR (typed so it can be overridden).
      data_dir=ml_collections.FieldReference(None, field_type=str),
      train_split="train",
      test_split="test",
      batch_size=128,
      eval_batch_size=200,     # 50 batches cover the 10,000 test images
      image_size=ml_collections.FieldReference(None, field_type=int),
      augment=True,
      flip=True,
      max_examples=ml_collections.FieldReference(None, field_type=int),
  ))
  config.model = ml_collections.ConfigDict(dict(
      name="vit_moe",
      num_classes=10,
      patch_size=(4, 4),
      hidden_size=192,
      num_layers=6,
      num_heads=3,
      mlp_dim=768,
      classifier="token",
      dropout_rate=0.1,
      attention_dropout_rate=0.0,
      moe=dict(every=2, num_experts=8, capacity_factor=1.25,
               group_size=65 * 8, dispatcher="indices",
               router=dict(name="noisy_topk", num_selected=2)),
  ))
  config.optimizer = ml_collections.ConfigDict(dict(
      name="adamw", learning_rate=1e-3, warmup_steps=1000, decay="cosine",
      total_steps=total_steps, weight_decay=0.05,
      weight_decay_mask="no_bias_norm", clip_global_norm=1.0))
  config.train = ml_collections.ConfigDict(dict(
      total_steps=total_steps, log_every=100, eval_every=2000,
      checkpoint_every=1000, keep_checkpoints=3, label_smoothing=0.1))
  return config
