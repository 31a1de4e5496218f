"""What a training run logs: every router's metrics, progress, plots.

The train step's output (what `metrics.jsonl` and TensorBoard get at each
log step) is checked by shape only (`jax.eval_shape`: traced, never
compiled) against the metrics each MoE layer returns, for every registered
router.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from vmoe_ext.app.context import resolved
from vmoe_ext.models import build_model
from vmoe_ext.naming import METRIC_PREFIX
from vmoe_ext.routers import ROUTERS
from vmoe_ext.train.config_files import load_config
from vmoe_ext.train.state import TrainState
from vmoe_ext.train.steps import make_eval_step, make_train_step

# The tiny model with MoE in both blocks; the routers' diagnostics beside
# their losses.
ROUTER_FIELDS = {
    "acmoe": {"base": {"name": "noisy_topk", "num_selected": 1},
              "layers": "full"},
    "cmoe": {"num_selected": 1},
    "cosine": {"num_selected": 1},
    "cosine_lm": {"num_selected": 1},
    "expert_choice": {},
    "noisy_topk": {"num_selected": 1},
    "soft": {"num_slots": 1},
    "symphony": {"base": {"name": "noisy_topk", "num_selected": 1}},
    "symphony_soft": {"num_selected": 1,
                      "base": {"name": "soft", "num_slots": 1}},
    "swin_moe": {"num_selected": 1},
    "top_p": {"num_selected": 2},
}
DIAGNOSTICS = {"top_p": {"experts_per_token", "threshold"},
               "symphony": {"symphony_fallback"},
               "swin_moe": {"balance_loss", "importance_loss", "load_loss",
                            "gshard_loss"}}


def _config(router):
  config = load_config("tiny")
  config.model.moe.every = 1
  config.model.moe.router = {"name": router, **ROUTER_FIELDS[router]}
  if router in ("soft", "symphony_soft"):
    config.model.name = "soft_moe_vit"
    config.model.moe = dict(every=1, num_experts=2, group_size=None,
                            router=config.model.moe.router)
  return resolved(config)


def test_every_registered_router_is_covered():
  assert set(ROUTER_FIELDS) == set(ROUTERS.names())


@pytest.mark.parametrize("router", sorted(ROUTER_FIELDS))
def test_every_router_metric_reaches_the_train_and_test_lines(router):
  config = _config(router)
  model = build_model(config.model)
  images = jnp.zeros((4, 8, 8, 1))
  batch = {"image": images, "label": jnp.zeros((4,), jnp.int32),
           "mask": jnp.ones((4,), bool)}
  variables = jax.eval_shape(model.init, jax.random.key(0), images)
  _, metrics = jax.eval_shape(lambda v: model.apply(
      v, images, deterministic=False,
      rngs={"gating": jax.random.key(1), "dropout": jax.random.key(2)}),
      variables)
  layers = {k: v for k, v in metrics.items() if k.startswith(METRIC_PREFIX)}
  assert sorted(layers) == ["layer_0", "layer_1"]
  expected = {f"{layer}/{name}" for layer, values in layers.items()
              for name in values}
  for layer in layers:
    assert DIAGNOSTICS.get(router, set()) <= set(layers[layer]), layer
    assert {"drop_rate", "expert_load", "expert_usage",
            "auxiliary_loss"} <= set(layers[layer])
  state = jax.eval_shape(lambda v: TrainState.create(
      v, optax.sgd(0.1), jax.random.key(3)), variables)
  _, logged = jax.eval_shape(make_train_step(model), state, batch)
  assert expected <= set(logged), expected - set(logged)
  tested = jax.eval_shape(make_eval_step(model), state, batch)["routing"]
  assert set(tested) == {k for k in expected
                         if not k.endswith("/load_loss")}
