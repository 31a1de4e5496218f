"""Evaluation metrics against hand-computed cases and independent references."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import sklearn.metrics

from vmoe_ext.data.corruptions import CORRUPTIONS
from vmoe_ext.errors import ConfigError
from vmoe_ext.evaluate import (ALEXNET_ERRORS, IMAGENET_A_CLASSES,
                               IMAGENET_R_CLASSES, average_precision,
                               corruption_errors, expert_set_iou,
                               expert_sets_to_mask, layer_mean_std,
                               load_balance, mask_logits, max_softmax, mce,
                               normalized_corruption_errors, ood_aupr,
                               prediction_change_rate, router_instability,
                               routing_change_rate, subset_labels,
                               topk_accuracy)

LOGITS = np.array([[0.1, 2.0, 0.3, 0.0],   # ranking 1, 2, 0, 3
                   [1.0, 0.0, 3.0, 2.0],   # ranking 2, 3, 0, 1
                   [0.0, 0.0, 0.0, 5.0]])  # ranking 3, then 0, 1, 2 (tied)
LABELS = np.array([1, 0, 1])


def _field(excinfo) -> str:
  return excinfo.value.field


# ----------------------------------------------------------------- accuracy


def test_topk_accuracy_hand_case():
  assert topk_accuracy(LOGITS, LABELS, 1) == pytest.approx(1 / 3)
  assert topk_accuracy(LOGITS, LABELS, 2) == pytest.approx(1 / 3)
  # Example 1's label 0 is third; example 2's label 1 is third (tie with 0
  # broken towards the lower index, so 0 comes first) and class 2 fourth.
  assert topk_accuracy(LOGITS, LABELS, 3) == 1.0
  assert topk_accuracy(LOGITS, np.array([1, 0, 2]), 3) == pytest.approx(2 / 3)
  assert topk_accuracy(LOGITS, np.array([1, 0, 2]), 4) == 1.0


def test_topk_accuracy_top1_matches_argmax_with_ties(rng):
  logits = rng.integers(0, 3, size=(200, 5)).astype(np.float32)  # many ties
  labels = rng.integers(0, 5, size=200)
  expected = np.mean(np.argmax(logits, axis=1) == labels)
  assert topk_accuracy(logits, labels, 1) == pytest.approx(expected)


def test_topk_accuracy_mask_and_empty():
  assert topk_accuracy(LOGITS, LABELS, 1, mask=[1, 0, 0]) == 1.0
  assert topk_accuracy(LOGITS, LABELS, 1, mask=[0, 1, 1]) == 0.0
  assert np.isnan(topk_accuracy(LOGITS, LABELS, 1, mask=[0, 0, 0]))


@pytest.mark.parametrize("k", [0, 5, 1.5])
def test_topk_accuracy_bad_k(k):
  with pytest.raises(ValueError) as e:
    topk_accuracy(LOGITS, LABELS, k)
  assert _field(e) == "k"


def test_topk_accuracy_bad_labels():
  with pytest.raises(ValueError) as e:
    topk_accuracy(LOGITS, np.array([0, 1, 4]), 1)
  assert _field(e) == "labels"


def test_prediction_change_rate_hand_case():
  adv = LOGITS.copy()
  adv[0] = [3.0, 2.0, 0.3, 0.0]  # argmax 1 -> 0
  adv[2] = [0.0, 0.0, 0.0, 4.0]  # still 3
  assert prediction_change_rate(LOGITS, adv) == pytest.approx(1 / 3)
  assert prediction_change_rate(LOGITS, adv, mask=[0, 1, 1]) == 0.0
  assert prediction_change_rate(LOGITS, LOGITS) == 0.0
  with pytest.raises(ValueError) as e:
    prediction_change_rate(LOGITS, LOGITS[:2])
  assert _field(e) == "logits_adv"


# ----------------------------------------------------------- routing change


def test_expert_sets_to_mask_ignores_invalid_and_duplicates():
  idx = np.array([[[0, 2], [1, -1], [-1, -1], [3, 3]]])  # [N=1, T=4, K=2]
  mask = expert_sets_to_mask(idx, 4)
  np.testing.assert_array_equal(mask[0], [[1, 0, 1, 0], [0, 1, 0, 0],
                                          [0, 0, 0, 0], [0, 0, 0, 1]])
  assert mask.dtype == bool
  with pytest.raises(ValueError) as e:
    expert_sets_to_mask(idx, 3)
  assert _field(e) == "indices"
  with pytest.raises(ValueError) as e:
    expert_sets_to_mask(idx, 0)
  assert _field(e) == "num_experts"


def test_routing_change_rate_hand_case():
  clean = np.array([[[0, 1], [0, -1], [-1, -1], [2, -1]]])
  adv = np.array([[[1, 2], [0, -1], [-1, -1], [-1, -1]]])
  # IoUs: {0,1} vs {1,2} = 1/3; {0} vs {0} = 1; {} vs {} = 1 (defined);
  # {2} vs {} = 0. Changes 2/3, 0, 0, 1.
  m_clean, m_adv = expert_sets_to_mask(clean, 3), expert_sets_to_mask(adv, 3)
  np.testing.assert_allclose(expert_set_iou(m_clean, m_adv),
                             [[1 / 3, 1, 1, 0]])
  assert routing_change_rate(m_clean, m_adv) == pytest.approx(
      (2 / 3 + 1) / 4)
  token_mask = np.array([[1, 1, 1, 0]])
  assert routing_change_rate(m_clean, m_adv, token_mask) == pytest.approx(
      (2 / 3) / 3)


def test_routing_change_rate_matches_python_sets(rng):
  n, t, e, k = 3, 7, 6, 2
  clean = rng.integers(-1, e, size=(n, t, k))
  adv = rng.integers(-1, e, size=(n, t, k))
  expected = []
  for i, j in itertools.product(range(n), range(t)):
    a = {int(v) for v in clean[i, j] if v >= 0}
    b = {int(v) for v in adv[i, j] if v >= 0}
    expected.append(1.0 - (len(a & b) / len(a | b) if a | b else 1.0))
  got = routing_change_rate(expert_sets_to_mask(clean, e),
                            expert_sets_to_mask(adv, e))
  assert got == pytest.approx(np.mean(expected))


def test_routing_change_rate_accepts_01_masks_rejects_indices():
  a = np.array([[[1, 0, 1]]], np.float32)
  b = np.array([[[1, 1, 0]]], np.int32)
  assert routing_change_rate(a, b) == pytest.approx(1 - 1 / 3)
  with pytest.raises(ValueError) as e:
    routing_change_rate(np.array([[[0, 2]]]), np.array([[[0, 2]]]))
  assert _field(e) == "mask_clean"


# ------------------------------------------------------------- load balance


def test_load_balance_top1_hand_case():
  top1 = np.array([[0, 0, 1, 2]])  # [N=1, T=4]
  out = load_balance(expert_sets_to_mask(top1[..., None], 4))
  np.testing.assert_allclose(out["percent"], [50, 25, 25, 0])
  np.testing.assert_array_equal(out["assignments"], [2, 1, 1, 0])
  # mean 25, deviations 25, 0, 0, -25 -> population var 312.5.
  assert out["std"] == pytest.approx(np.sqrt(312.5))


def test_load_balance_top2_and_token_mask():
  idx = np.array([[[0, 1], [0, 2], [1, 3], [3, 2]]])
  out = load_balance(expert_sets_to_mask(idx, 4))
  np.testing.assert_allclose(out["percent"], [25, 25, 25, 25])
  assert out["std"] == 0.0
  out = load_balance(expert_sets_to_mask(idx, 4), token_mask=[[1, 1, 0, 0]])
  np.testing.assert_allclose(out["percent"], [50, 25, 25, 0])
  empty = load_balance(np.zeros((1, 2, 3), bool))
  assert np.isnan(empty["std"])


def test_layer_mean_std():
  out = layer_mean_std([1.0, 3.0])
  assert out == {"mean": 2.0, "std": 1.0}
  with pytest.raises(ValueError):
    layer_mean_std([])


# ------------------------------------------------------- router instability


def _naive_instability(prev, cur):
  s_prev = prev[:, None] == prev[None, :]
  s_cur = cur[:, None] == cur[None, :]
  return np.mean(np.abs(s_prev.astype(int) - s_cur.astype(int)))


def test_router_instability_hand_case():
  # S_prev joins tokens (0, 1); S_cur joins (1, 2): 4 of 9 entries differ.
  assert router_instability([0, 0, 1], [0, 1, 1]) == pytest.approx(4 / 9)
  assert router_instability([0, 0, 1], [5, 5, 7]) == 0.0  # relabelled
  assert router_instability([0, 1, 2], [0, 0, 0]) == pytest.approx(6 / 9)


@pytest.mark.parametrize("n,e", [(1, 2), (7, 2), (50, 4), (200, 16)])
def test_router_instability_matches_naive(rng, n, e):
  for _ in range(3):
    prev = rng.integers(0, e, size=n)
    cur = rng.integers(0, e, size=n)
    assert router_instability(prev, cur) == pytest.approx(
        _naive_instability(prev, cur), abs=1e-12)


def test_router_instability_mask_and_shapes(rng):
  prev = rng.integers(0, 4, size=(3, 10))
  cur = rng.integers(0, 4, size=(3, 10))
  valid = rng.uniform(size=(3, 10)) < 0.6
  expected = _naive_instability(prev[valid], cur[valid])
  assert router_instability(prev, cur, token_mask=valid) == pytest.approx(
      expected)
  assert router_instability(prev, cur) == pytest.approx(
      _naive_instability(prev.ravel(), cur.ravel()))
  # Large n: O(n) memory (a dense S would need 10^12 entries).
  big = rng.integers(0, 8, size=1_000_000)
  value = router_instability(big, np.roll(big, 1))
  assert 0.0 < value < 1.0


# ------------------------------------------------------------- corruption


def test_alexnet_errors_are_the_design_constants_in_order():
  assert tuple(ALEXNET_ERRORS) == CORRUPTIONS
  assert ALEXNET_ERRORS["gaussian_noise"] == 0.886428
  assert ALEXNET_ERRORS["brightness"] == 0.564592
  assert ALEXNET_ERRORS["jpeg_compression"] == 0.606500


def test_corruption_errors_hand_case():
  table = {"fog": {1: 0.9, 2: 0.8, 3: 0.7, 4: 0.6, 5: 0.5},
           "snow": {1: 1.0, 2: 1.0}}
  out = corruption_errors(table)
  assert out["errors"]["fog"] == pytest.approx(0.3)
  assert out["errors"]["snow"] == pytest.approx(0.0)
  assert out["mean_corruption_error"] == pytest.approx(0.15)
  with pytest.raises(ValueError) as e:
    corruption_errors({"fog": {1: 1.2}})
  assert _field(e) == "acc_table.fog"
  with pytest.raises(ValueError) as e:
    corruption_errors({})
  assert _field(e) == "acc_table"


def test_mce_alexnet_protocol():
  assert mce(dict(ALEXNET_ERRORS)) == pytest.approx(1.0)
  half = {k: v / 2 for k, v in ALEXNET_ERRORS.items()}
  assert mce(half) == pytest.approx(0.5)
  # One corruption at AlexNet's error, the others at zero: mCE = 1/15.
  one = {k: 0.0 for k in ALEXNET_ERRORS}
  one["fog"] = ALEXNET_ERRORS["fog"]
  assert mce(one) == pytest.approx(1 / 15)
  ratios = normalized_corruption_errors(one)
  assert ratios["fog"] == pytest.approx(1.0) and ratios["snow"] == 0.0
  # Unnormalised mean for datasets without baselines.
  assert mce({"a": 0.2, "b": 0.4}, baseline=None) == pytest.approx(0.3)
  assert mce({"a": 0.2, "b": 0.4}, baseline={"a": 0.4, "b": 0.8}) == (
      pytest.approx(0.5))


def test_mce_missing_corruption():
  errors = dict(ALEXNET_ERRORS)
  del errors["frost"]
  with pytest.raises(ValueError) as e:
    mce(errors)
  assert _field(e) == "errors_model" and "frost" in str(e.value)


# -------------------------------------------------------------------- OOD


def test_average_precision_matches_sklearn_with_ties(rng):
  for trial in range(5):
    n = 30 + 20 * trial
    scores = rng.normal(size=n)
    if trial >= 3:  # Discrete scores: many ties.
      scores = rng.integers(0, 4, size=n).astype(np.float64)
    labels = rng.uniform(size=n) < 0.4
    labels[0] = True
    expected = sklearn.metrics.average_precision_score(labels, scores)
    assert average_precision(scores, labels) == pytest.approx(expected,
                                                              abs=1e-12)


def test_ood_aupr_matches_sklearn(rng):
  for _ in range(3):
    logits_in = rng.normal(size=(60, 5)) * 2 + np.eye(5)[rng.integers(
        0, 5, 60)] * 3
    logits_out = rng.normal(size=(40, 5))
    probs = np.exp(np.r_[logits_in, logits_out])
    msp = (probs / probs.sum(axis=1, keepdims=True)).max(axis=1)
    np.testing.assert_allclose(max_softmax(np.r_[logits_in, logits_out]), msp,
                               rtol=1e-12)
    labels = np.r_[np.zeros(60), np.ones(40)]  # OOD is the positive class.
    expected = sklearn.metrics.average_precision_score(labels, -msp)
    assert ood_aupr(logits_in, logits_out) == pytest.approx(expected,
                                                            abs=1e-12)


def test_ood_aupr_extremes():
  confident = np.array([[10.0, 0.0], [0.0, 9.0]])
  unsure = np.array([[0.1, 0.0], [0.0, 0.2]])
  assert ood_aupr(confident, unsure) == pytest.approx(1.0)
  # Reversed: OOD is the most confident; AP = mean of precisions 1/3, 2/4.
  assert ood_aupr(unsure, confident) == pytest.approx((1 / 3 + 2 / 4) / 2)
  with pytest.raises(ValueError) as e:
    ood_aupr(confident, np.zeros((2, 3)))
  assert _field(e) == "logits_out"


# ---------------------------------------------------------- class subsets


def test_mask_logits_restricts_then_argmax():
  logits = np.array([[5.0, 1.0, 2.0, 0.0], [0.0, 3.0, 1.0, 4.0]])
  subset = [1, 2]
  restricted = mask_logits(logits, subset)
  np.testing.assert_array_equal(restricted, [[1.0, 2.0], [3.0, 1.0]])
  np.testing.assert_array_equal(np.argmax(restricted, axis=1), [1, 0])
  full = mask_logits(logits, subset, keep_shape=True)
  np.testing.assert_array_equal(np.argmax(full, axis=1), [2, 1])
  assert np.isneginf(full[:, [0, 3]]).all()
  np.testing.assert_array_equal(subset_labels([2, 1], subset, 4), [1, 0])
  assert topk_accuracy(restricted, subset_labels([2, 2], subset, 4)) == 0.5


@pytest.mark.parametrize("subset", [[], [0, 0], [4], [-1]])
def test_mask_logits_bad_subset(subset):
  with pytest.raises(ValueError) as e:
    mask_logits(np.zeros((1, 4)), np.array(subset, dtype=np.int64))
  assert _field(e) == "class_subset"


def test_subset_labels_outside_subset():
  with pytest.raises(ValueError) as e:
    subset_labels([0, 3], [1, 3], 4)
  assert _field(e) == "labels"


@pytest.mark.parametrize("subset", [IMAGENET_A_CLASSES, IMAGENET_R_CLASSES])
def test_imagenet_subsets_well_formed(subset):
  assert len(subset) == 200 and len(set(subset)) == 200
  assert list(subset) == sorted(subset)
  assert 0 <= min(subset) and max(subset) < 1000
  assert mask_logits(np.zeros((2, 1000)), subset).shape == (2, 200)


def test_imagenet_subsets_known_entries():
  # ImageNet-A starts with 6 (stingray) and ends with 988; ImageNet-R starts
  # with 1 (goldfish) and ends with 988, 200 classes each.
  assert IMAGENET_A_CLASSES[:3] == (6, 11, 13)
  assert IMAGENET_A_CLASSES[-1] == 988
  assert IMAGENET_R_CLASSES[:3] == (1, 2, 4)
  assert IMAGENET_R_CLASSES[-2:] == (983, 988)
