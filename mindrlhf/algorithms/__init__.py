"""GRPO math as small pure numpy functions chosen by name, plus the MindSpore loss Cell built on them.

`GRPOLossCell` is imported lazily so that the numpy functions can be used without loading MindSpore.
"""
from mindrlhf.algorithms.advantages import (
    ADVANTAGE_ESTIMATORS,
    dr_grpo_advantages,
    dynamic_sampling_mask,
    expand_group_mask,
    get_advantage_estimator,
    group_advantages,
    grpo_advantages,
)
from mindrlhf.algorithms.aggregation import (
    AGGREGATIONS,
    aggregate,
    aggregation_weights,
    seq_mean_token_mean,
    seq_mean_token_sum,
    token_mean,
)
from mindrlhf.algorithms.kl import KL_ESTIMATORS, kl_k1, kl_k2, kl_k3, kl_penalty
from mindrlhf.algorithms.policy_loss import STAT_NAMES, check_loss_hyperparameters, grpo_policy_loss
from mindrlhf.algorithms.registry import Registry

__all__ = [
    "ADVANTAGE_ESTIMATORS", "AGGREGATIONS", "KL_ESTIMATORS", "STAT_NAMES", "GRPOLossCell", "LOSS_CELL_OUTPUT_NAMES",
    "Registry", "aggregate", "aggregation_weights", "check_loss_hyperparameters", "dr_grpo_advantages",
    "dynamic_sampling_mask",
    "expand_group_mask", "get_advantage_estimator", "group_advantages", "grpo_advantages", "grpo_policy_loss",
    "kl_k1", "kl_k2", "kl_k3", "kl_penalty", "seq_mean_token_mean", "seq_mean_token_sum", "token_mean",
]


def __getattr__(name: str):
    if name == "GRPOLossCell":
        from mindrlhf.algorithms.loss_cell import GRPOLossCell
        return GRPOLossCell
    if name == "LOSS_CELL_OUTPUT_NAMES":
        from mindrlhf.algorithms.loss_cell import OUTPUT_NAMES
        return OUTPUT_NAMES
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
