"""Carving's inputs: the dense ViT checkpoint, the calibration images and
the carved model's config (the carve mode, `vmoe_ext.app.carve`, drives
them).

* `carved_config(config)`: the run config with `model` the carved V-MoE and
  no `carve` section: what the carved checkpoint is fingerprinted with;
* `check_dense_checkpoint(spec, num_layers)`: the newest step of
  `carve.checkpoint_dir`, checked from metadata to hold a dense ViT;
* `calibration_images(train, spec, data)`: `carve.num_calibration` seeded
  training images, preprocessed as for evaluation.
"""

from __future__ import annotations

import os

import ml_collections
import numpy as np

from vmoe_ext.carving.spec import CarveSpec, carved_model_config
from vmoe_ext.data import default_normalization, eval_batches
from vmoe_ext.data.dataset import ArrayDataset
from vmoe_ext.data.stream_eval import StreamingEvalSplit
from vmoe_ext.errors import require
from vmoe_ext.interop import checkpoint_params as ckpt_params
from vmoe_ext.naming import param_name


def carved_config(config: ml_collections.ConfigDict
                  ) -> ml_collections.ConfigDict:
  """`config` with `model` the carved V-MoE and no `carve` section: what
  the carved checkpoint is fingerprinted with."""
  spec = CarveSpec.from_config(config.carve)
  out = ml_collections.ConfigDict(config.to_dict())
  del out["carve"]
  out.model = carved_model_config(config.model.to_dict(), spec)
  return out


def check_dense_checkpoint(spec: CarveSpec, num_layers: int) -> int:
  """The newest step of `spec.checkpoint_dir`, checked to hold a dense ViT
  with an MLP in every carved block (from metadata; no data is read)."""
  source = spec.checkpoint_dir
  steps = ckpt_params.checkpoint_steps(os.path.join(source, "checkpoints"))
  require(steps, "carve.checkpoint_dir",
          f"no checkpoint in {os.path.join(source, 'checkpoints')!r}; train "
          f"the dense ViT there first (python -m vmoe_ext.main "
          f"--config=configs/vit_dense.py:plain --workdir={source})")
  shapes = ckpt_params.param_shapes(
      ckpt_params.state_directory(os.path.join(source, "checkpoints"),
                                  steps[-1]))
  moe = sorted(p for p in shapes if "/Moe/" in p)
  require(not moe, "carve.checkpoint_dir",
          f"{source!r} holds a V-MoE checkpoint ({moe[0] if moe else ''}), "
          "not a dense ViT; carving reads a dense ViT trained with "
          "configs/vit_dense.py:plain")
  for block in spec.blocks(num_layers):
    path = f"{param_name(block)}/Mlp/Dense_0/kernel"
    require(path in shapes, "carve.checkpoint_dir",
            f"{source!r} is not a dense ViT with an MLP in block {block} "
            f"(no {path})")
  return steps[-1]


def calibration_images(train: ArrayDataset | StreamingEvalSplit,
                       spec: CarveSpec, data: ml_collections.ConfigDict
                       ) -> np.ndarray:
  """`spec.num_calibration` training images (a seeded sample, in sample
  order), preprocessed as for evaluation (a streamed train split: read
  record by record through `data.pp_eval`)."""
  require(len(train) > 0, "carve.num_calibration",
          f"the training split {train.name!r} is empty: no calibration data")
  require(spec.num_calibration <= len(train), "carve.num_calibration",
          f"asks for {spec.num_calibration} calibration images; the "
          f"training split {train.name!r} has {len(train)}")
  pick = np.random.default_rng(spec.seed).permutation(
      len(train))[:spec.num_calibration]
  if isinstance(train, StreamingEvalSplit):
    subset, image_size = train.analysis_dataset(None, indices=pick), None
  else:
    subset = ArrayDataset(train.images[pick], train.labels[pick],
                          train.num_classes, f"{train.name}[calibration]")
    image_size = data.get("image_size")
  mean, std = default_normalization(data)
  batches = eval_batches(subset, len(subset), image_size=image_size,
                         mean=mean, std=std)
  return next(batches)["image"]


__all__ = ["calibration_images", "carved_config", "check_dense_checkpoint"]
