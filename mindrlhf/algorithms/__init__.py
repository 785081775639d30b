"""RL math (GRPO, PPO) as small pure numpy functions chosen by name, plus the MindSpore loss cells built on them.

`GRPOLossCell` and `ValueLossCell` are imported lazily so that the numpy functions can be used without loading
MindSpore.
"""
from mindrlhf.algorithms.advantages import (
    ADVANTAGE_ESTIMATORS,
    broadcast_over_tokens,
    dynamic_sampling_mask,
    expand_group_mask,
    get_advantage_estimator,
    group_advantages,
    rloo_advantages,
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
from mindrlhf.algorithms.policy_loss import check_loss_hyperparameters, grpo_policy_loss
from mindrlhf.algorithms.ppo import (
    KL_CONTROLLERS,
    build_kl_controller,
    explained_variance,
    gae_advantages_returns,
    masked_whiten,
    token_level_rewards,
    value_loss,
)

__all__ = [
    "ADVANTAGE_ESTIMATORS", "AGGREGATIONS", "KL_CONTROLLERS", "KL_ESTIMATORS", "GRPOLossCell",
    "ValueLossCell", "build_kl_controller", "explained_variance", "gae_advantages_returns",
    "masked_whiten", "token_level_rewards", "value_loss",
    "aggregate", "aggregation_weights", "broadcast_over_tokens", "check_loss_hyperparameters",
    "dynamic_sampling_mask", "expand_group_mask", "get_advantage_estimator", "group_advantages", "grpo_policy_loss",
    "rloo_advantages",
    "kl_k1", "kl_k2", "kl_k3", "kl_penalty", "seq_mean_token_mean", "seq_mean_token_sum", "token_mean",
]


def __getattr__(name: str):
    if name == "GRPOLossCell":
        from mindrlhf.algorithms.loss_cell import GRPOLossCell
        return GRPOLossCell
    if name == "ValueLossCell":
        from mindrlhf.algorithms.value_loss_cell import ValueLossCell
        return ValueLossCell
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
