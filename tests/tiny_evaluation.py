"""The tiny model the evaluation tests share: the `tiny` config's ViT
(digits 8 x 8, patch 4) with a random, non-trivial head, and test images."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from vmoe_ext.data import ArrayDataset, load_dataset
from vmoe_ext.models import build_model
from vmoe_ext.train.config_files import load_config


def tiny_digits(n: int = 20) -> tuple[Any, dict, ArrayDataset]:
  """`(model, variables, data)`: the model, its variables (init at key 0,
  the head's kernel redrawn at key 1 so that predictions differ by image)
  and the first `n` test images."""
  config = load_config("tiny")
  test = load_dataset(config.data)["test"]
  data = ArrayDataset(test.images[:n], test.labels[:n], 10, "digits")
  model = build_model(config.model)
  variables = jax.jit(model.init)(jax.random.key(0),
                                  jnp.zeros((10, 8, 8, 1)))
  params = dict(variables["params"])
  params["head"] = {**params["head"], "kernel": jax.random.normal(
      jax.random.key(1), params["head"]["kernel"].shape)}
  return model, {"params": params}, data
