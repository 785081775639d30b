"""Rule-based reward verifiers behind a registry; user functions by import path; weighted combination."""
from mindrlhf.data.answers import (
    answers_match,
    extract_completion_answer,
    extract_gold_answer,
    last_boxed_content,
    last_number,
    parse_number,
)
from mindrlhf.reward.registry import (
    REWARD_FUNCTIONS,
    RewardError,
    RewardFn,
    WeightedRewards,
    build_reward_fn,
    columns_per_completion,
    get_reward_function,
    register_reward,
)
from mindrlhf.reward.rules import (
    accuracy_reward,
    check_reward_inputs,
    format_reward,
    hash_format_reward,
    is_hash_answer_format,
    is_think_answer_format,
)

__all__ = [
    "REWARD_FUNCTIONS", "RewardError", "RewardFn", "WeightedRewards", "accuracy_reward", "answers_match",
    "build_reward_fn", "check_reward_inputs", "columns_per_completion", "extract_completion_answer",
    "extract_gold_answer", "format_reward", "get_reward_function", "hash_format_reward", "is_hash_answer_format",
    "is_think_answer_format", "last_boxed_content", "last_number", "parse_number", "register_reward",
]
