"""Evaluation: accuracy, routing change, load balance, router instability,
corruption error / mCE, OOD AUPR, 200-class subsets (docs/robustness.md,
"Metrics").

Host-side numpy metrics (`metrics`, `corruption_metrics`); `Evaluator` (a
model as jitted functions of raw images); what the binary runs after training
(`final`): the routing analysis (`routing_analysis`, `routing_plots`,
`routing_report`) and the robustness evaluation (`robustness`, `datasets`).
The local corruption suite itself lives in `vmoe_ext.data.corruptions`.
"""

from vmoe_ext.evaluate.corruption_metrics import (
    ALEXNET_ERRORS, corruption_errors, mce, normalized_corruption_errors)
from vmoe_ext.evaluate.evaluator import Evaluator
from vmoe_ext.evaluate.imagenet_subsets import (IMAGENET_A_CLASSES,
                                                IMAGENET_R_CLASSES)
from vmoe_ext.evaluate.metrics import (assignment_counts, average_precision,
                                       expert_set_iou, expert_sets_to_mask,
                                       layer_mean_std, load_balance,
                                       load_balance_from_counts, mask_logits,
                                       max_softmax, ood_aupr,
                                       prediction_change_rate,
                                       router_instability,
                                       router_instability_from_counts,
                                       routing_change_rate, subset_labels,
                                       topk_accuracy)

__all__ = [
    "ALEXNET_ERRORS",
    "Evaluator",
    "IMAGENET_A_CLASSES",
    "IMAGENET_R_CLASSES",
    "assignment_counts",
    "average_precision",
    "corruption_errors",
    "expert_set_iou",
    "expert_sets_to_mask",
    "layer_mean_std",
    "load_balance",
    "load_balance_from_counts",
    "mask_logits",
    "max_softmax",
    "mce",
    "normalized_corruption_errors",
    "ood_aupr",
    "prediction_change_rate",
    "router_instability",
    "router_instability_from_counts",
    "routing_change_rate",
    "subset_labels",
    "topk_accuracy",
]
