"""`compute_capacity(rounding="vmoe")` against hand-computed values of
google-research/vmoe's `vmoe.moe.compute_capacity` (num_tokens = S * K,
`ceil(num_tokens * cf / E)` of the raw float, then up to a multiple of 4)."""

from __future__ import annotations

import numpy as np
import pytest

from vmoe_ext.errors import ConfigError
from vmoe_ext.moe.capacity import compute_capacity


@pytest.mark.parametrize("s,k,cf,e,exact,vmoe,vmoe_multiple_1", [
    # 1600 * 1.1 = 1760.0000000000002, / 8 = 220.00000000000003.
    (800, 2, 1.1, 8, 220, 224, 221),
    # 100 * 1.1 = 110.00000000000001, / 10 = 11.000000000000002.
    (100, 1, 1.1, 10, 11, 12, 12),
    # 8 * 1.25 = 10.0 exactly: no noise, the modes differ only by the multiple.
    (8, 1, 1.25, 1, 10, 12, 10),
    (2048, 2, 1.25, 8, 640, 640, 640),
    (10, 1, 1.0, 3, 4, 4, 4),        # ceil(3.33...)
    (788, 2, 1.5, 8, 296, 296, 296),  # ceil(295.5)
    (4, 1, 0.01, 8, 1, 4, 1),        # ceil(0.005) = 1 in both modes
])
def test_vmoe_rounding_hand_cases(s, k, cf, e, exact, vmoe, vmoe_multiple_1):
  assert compute_capacity(s, k, cf, e) == exact
  assert compute_capacity(s, k, cf, e, rounding="exact") == exact
  assert compute_capacity(s, k, cf, e, rounding="vmoe") == vmoe
  assert compute_capacity(s, k, cf, e, 1, rounding="vmoe") == vmoe_multiple_1


def test_explicit_multiple_applies_in_both_modes():
  assert compute_capacity(800, 2, 1.1, 8, 4) == 220  # 220 is a multiple of 4.
  assert compute_capacity(800, 2, 1.1, 8, 8) == 224
  assert compute_capacity(800, 2, 1.1, 8, 8, rounding="vmoe") == 224
  assert compute_capacity(800, 2, 1.1, 8, 3, rounding="vmoe") == 222
  assert compute_capacity(100, 1, 1.1, 10, 5, rounding="vmoe") == 15


@pytest.mark.parametrize("kwargs,field", [
    (dict(rounding="round"), "capacity_rounding"),
    (dict(rounding="vmoe", multiple_of=0), "capacity_multiple"),
    (dict(rounding="vmoe", capacity_factor=0.0), "capacity_factor"),
])
def test_errors_name_the_field(kwargs, field):
  args = dict(group_size=8, num_selected=1, capacity_factor=1.0,
              num_experts=2)
  with pytest.raises(ConfigError, match=field):
    compute_capacity(**{**args, **kwargs})


def _vmoe(**moe):
  import jax  # pylint: disable=g-import-not-at-top
  from vmoe_ext.models import build_model  # pylint: disable=g-import-not-at-top
  return build_model({
      "name": "vit_moe", "num_classes": 5, "patch_size": (4, 4),
      "hidden_size": 16, "num_layers": 2, "num_heads": 2, "mlp_dim": 32,
      "moe": {"layers": (1,), "num_experts": 4, "group_size": 17 * 2,
              "router": {"name": "noisy_topk", "num_selected": 2}, **moe}}
  ), jax


def test_eval_capacity_factor_applies_to_deterministic_calls_only():
  low, jax = _vmoe(capacity_factor=0.25, eval_capacity_factor=4.0)
  high, _ = _vmoe(capacity_factor=4.0)
  plain, _ = _vmoe(capacity_factor=0.25)
  images = jax.random.normal(jax.random.key(0), (2, 16, 16, 1))
  variables = jax.jit(low.init)(jax.random.key(1), images)
  rngs = {"gating": jax.random.key(2), "dropout": jax.random.key(3)}
  # Each pair of applies jitted: one compilation, not op-by-op eager ones.
  evaluate = jax.jit(lambda v, x: [m.apply(v, x, deterministic=True)
                                   for m in (low, high)])
  train = jax.jit(lambda v, x, r: [
      m.apply(v, x, deterministic=False, rngs=r) for m in (low, plain)])
  # Evaluation: exactly the model built with cf 4 (nothing dropped).
  (got, metrics), (want, _) = evaluate(variables, images)
  assert float(metrics["layer_1"]["drop_rate"]) == 0.0
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  # Training: the training cf (C = ceil(34 * 2 * 0.25 / 4) = 5 of 17
  # tokens' selections per expert: most are dropped).
  (got, metrics), (want, want_metrics) = train(variables, images, rngs)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  assert float(metrics["layer_1"]["drop_rate"]) == float(
      want_metrics["layer_1"]["drop_rate"]) > 0.5


def test_eval_capacity_factor_must_be_positive():
  with pytest.raises(ConfigError) as e:
    _vmoe(eval_capacity_factor=0.0)[0].init(
        __import__("jax").random.key(0), np.zeros((1, 16, 16, 1)))
  assert e.value.field.endswith("eval_capacity_factor"), e.value
