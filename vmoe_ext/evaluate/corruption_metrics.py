"""Corruption robustness: per-corruption error, ImageNet-C mCE
(docs/robustness.md, "Metrics").

Protocol of Hendrycks & Dietterich (2019): the error `E_c` of corruption c is
the top-1 error averaged over its severities (1..5); the corruption error is
normalised by AlexNet's, `CE_c = E_c / E_c^AlexNet`, and the mean corruption
error is `mCE = mean_c CE_c` over the 15 ImageNet-C corruptions. Datasets
without AlexNet baselines (our local suite on MNIST, CIFAR-10-C, ...) report
the unnormalised mean `mean_c E_c` instead.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from vmoe_ext.errors import check

# AlexNet top-1 error on ImageNet-C averaged over severities (Hendrycks &
# Dietterich 2019; docs/robustness.md, "Metrics"), in the order of
# `vmoe_ext.data.corruptions.CORRUPTIONS`.
ALEXNET_ERRORS: dict[str, float] = {
    "gaussian_noise": 0.886428,
    "shot_noise": 0.894468,
    "impulse_noise": 0.922640,
    "defocus_blur": 0.819880,
    "glass_blur": 0.826268,
    "motion_blur": 0.785948,
    "zoom_blur": 0.798360,
    "snow": 0.866816,
    "frost": 0.826572,
    "fog": 0.819324,
    "brightness": 0.564592,
    "contrast": 0.853204,
    "elastic_transform": 0.646056,
    "pixelate": 0.717840,
    "jpeg_compression": 0.606500,
}


def corruption_errors(acc_table: Mapping[str, Mapping[int, float]]
                      ) -> dict[str, object]:
  """Per-corruption error averaged over severities and their mean.

  Args:
    acc_table: `{corruption: {severity: top-1 accuracy in [0, 1]}}`; each
      corruption needs at least one severity (normally 1..5).

  Returns:
    `{"errors": {corruption: mean_s (1 - acc)}, "mean_corruption_error":
    mean over corruptions of those errors (unnormalised)}`.
  """
  check(isinstance(acc_table, Mapping) and len(acc_table) > 0, "acc_table",
          "must be a non-empty {corruption: {severity: accuracy}} mapping")
  errors = {}
  for name, per_severity in acc_table.items():
    check(isinstance(per_severity, Mapping) and len(per_severity) > 0,
            f"acc_table.{name}", "must be a non-empty {severity: accuracy} "
            "mapping")
    acc = np.asarray(list(per_severity.values()), np.float64)
    check(np.all((acc >= 0) & (acc <= 1)), f"acc_table.{name}",
            f"accuracies must lie in [0, 1], got {acc.tolist()}")
    errors[name] = float(np.mean(1.0 - acc))
  return {"errors": errors,
          "mean_corruption_error": float(np.mean(list(errors.values())))}


def normalized_corruption_errors(
    errors_model: Mapping[str, float],
    baseline: Mapping[str, float] = ALEXNET_ERRORS) -> dict[str, float]:
  """`CE_c = E_c / E_c^baseline` for every corruption of the baseline.

  Corruptions of `errors_model` outside the baseline are ignored (ImageNet-C
  mCE is defined over the baseline's 15); every baseline corruption must be
  present.
  """
  check(isinstance(baseline, Mapping) and len(baseline) > 0, "baseline",
          "must be a non-empty {corruption: error} mapping")
  missing = [name for name in baseline if name not in errors_model]
  check(not missing, "errors_model", f"missing corruptions {missing}")
  out = {}
  for name, base in baseline.items():
    check(base > 0, f"baseline.{name}", f"must be > 0, got {base}")
    err = float(errors_model[name])
    check(0.0 <= err <= 1.0, f"errors_model.{name}",
            f"must be an error in [0, 1], got {err}")
    out[name] = err / float(base)
  return out


def mce(errors_model: Mapping[str, float],
        baseline: Mapping[str, float] | None = ALEXNET_ERRORS) -> float:
  """Mean corruption error.

  Args:
    errors_model: `{corruption: error averaged over severities}`, e.g.
      `corruption_errors(acc_table)["errors"]`.
    baseline: per-corruption baseline errors (default: AlexNet, ImageNet-C
      protocol, `mCE = mean_c E_c / E_c^AlexNet` over its 15 corruptions);
      None gives the unnormalised mean `mean_c E_c` over `errors_model`, for
      datasets without baselines.
  """
  if baseline is None:
    check(isinstance(errors_model, Mapping) and len(errors_model) > 0,
            "errors_model", "must be a non-empty {corruption: error} mapping")
    return float(np.mean([float(v) for v in errors_model.values()]))
  ratios = normalized_corruption_errors(errors_model, baseline)
  return float(np.mean(list(ratios.values())))
