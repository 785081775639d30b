"""Advantage estimators chosen by name (GRPO, Dr. GRPO, RLOO; GAE in `ppo.py`) and DAPO's dynamic-sampling
filter, in numpy.

Rewards are laid out as consecutive groups: samples ``[g * group_size, (g + 1) * group_size)`` are the
``group_size`` completions of prompt ``g`` (the order the generator produces them in).
"""
from __future__ import annotations

import numbers

import numpy as np

from mindrlhf.utils.registry import Registry

ADVANTAGE_ESTIMATORS: Registry = Registry("advantage estimator")


def _check_group_size(group_size: int) -> int:
    if isinstance(group_size, bool) or not isinstance(group_size, numbers.Integral) or group_size < 1:
        raise ValueError(f"group_size must be an integer >= 1, got {group_size!r}")
    return int(group_size)


def _grouped_rewards(rewards, group_size: int) -> np.ndarray:
    """Validates `rewards` (1-D, finite, batch divisible by group_size) and returns it as [groups, group_size]."""
    group_size = _check_group_size(group_size)
    values = np.asarray(rewards, dtype=np.float64)
    if values.ndim != 1:
        raise ValueError(f"rewards must be 1-D [batch], got shape {values.shape}")
    not_finite = np.flatnonzero(~np.isfinite(values))
    if not_finite.size:
        index = int(not_finite[0])
        raise ValueError(f"rewards must be finite, got {values[index]} at index {index}")
    if values.size % group_size:
        raise ValueError(
            f"rewards batch size {values.size} is not divisible by group_size {group_size}"
        )
    return values.reshape(-1, group_size)


def group_advantages(rewards, group_size: int, eps: float = 1e-4, scale_by_std: bool = True) -> np.ndarray:
    """GRPO outcome advantages: (r - group mean) / (group std + eps), one value per sample.

    From DeepSeekMath (Shao et al. 2024, sec. 4.1.2); the std uses ddof=1 as `torch.std` does in TRL's
    `GRPOTrainer` and verl's `compute_grpo_outcome_advantage`. With `scale_by_std=False` only the mean is
    removed (Dr. GRPO, Liu et al. 2025). With group_size == 1 the ddof=1 std is undefined; a group of one
    has no spread to compare against, so its advantage is defined as 0.

    Computed in float64, returned as float32 [batch].
    """
    grouped = _grouped_rewards(rewards, group_size)
    if eps < 0 or not np.isfinite(eps):
        raise ValueError(f"eps must be a finite number >= 0, got {eps!r}")
    if grouped.shape[1] == 1:
        return np.zeros(grouped.size, dtype=np.float32)
    centered = grouped - grouped.mean(axis=1, keepdims=True)
    if scale_by_std:
        scale = grouped.std(axis=1, ddof=1, keepdims=True) + eps
        # A group of equal rewards has centered == 0; keep it 0 (not 0/0) when eps == 0.
        centered = np.divide(centered, scale, out=np.zeros_like(centered), where=scale > 0)
    return centered.reshape(-1).astype(np.float32)


def broadcast_over_tokens(per_response, response_mask) -> np.ndarray:
    """One value per response [N] repeated over its valid tokens [N, R] (0 on padding), float32."""
    mask = np.asarray(response_mask, dtype=np.float32)
    values = np.asarray(per_response, dtype=np.float32)
    if mask.ndim != 2 or values.shape != (mask.shape[0],):
        raise ValueError(f"expected per-response values [N] and a response mask [N, R], got {values.shape} and "
                         f"{mask.shape}")
    return values[:, None] * mask


def rloo_advantages(rewards, group_size: int) -> np.ndarray:
    """RLOO (Ahmadian et al. 2024): r_i minus the mean of the other samples of its group, float32 [batch]."""
    grouped = _grouped_rewards(rewards, group_size)
    if grouped.shape[1] == 1:
        return np.zeros(grouped.size, dtype=np.float32)
    k = grouped.shape[1]
    leave_one_out = (grouped.sum(axis=1, keepdims=True) - grouped) / (k - 1)
    return (grouped - leave_one_out).reshape(-1).astype(np.float32)


# Estimators take the experience (a table with at least `rewards` [N] and `response_mask` [N, R]; GAE also
# reads `token_rewards` and `values`), the group size and the `algorithm` settings, and return token-level
# (advantages, returns), both float32 [N, R] and 0 on padding (verl's `compute_advantage` contract). Outcome
# estimators broadcast one value per response; their returns are the advantages, as in verl.
@ADVANTAGE_ESTIMATORS.register("grpo")
def grpo_estimator(batch, group_size: int, settings) -> tuple[np.ndarray, np.ndarray]:
    """GRPO: group mean removed, divided by the group std + advantage_eps (see `group_advantages`)."""
    per_response = group_advantages(batch["rewards"], group_size, eps=settings.advantage_eps)
    advantages = broadcast_over_tokens(per_response, batch["response_mask"])
    return advantages, advantages


@ADVANTAGE_ESTIMATORS.register("dr_grpo")
def dr_grpo_estimator(batch, group_size: int, settings) -> tuple[np.ndarray, np.ndarray]:
    """Dr. GRPO: group mean removed, no std scaling."""
    del settings
    per_response = group_advantages(batch["rewards"], group_size, scale_by_std=False)
    advantages = broadcast_over_tokens(per_response, batch["response_mask"])
    return advantages, advantages


@ADVANTAGE_ESTIMATORS.register("rloo")
def rloo_estimator(batch, group_size: int, settings) -> tuple[np.ndarray, np.ndarray]:
    """RLOO: leave-one-out baseline within each group (`rloo_advantages`)."""
    del settings
    advantages = broadcast_over_tokens(rloo_advantages(batch["rewards"], group_size), batch["response_mask"])
    return advantages, advantages


# estimators whose advantage of a response reads only its own prompt group's rewards: a rank holding whole groups
# computes its rows' advantages alone
GROUP_ESTIMATORS = ("grpo", "dr_grpo", "rloo")


def get_advantage_estimator(name: str):
    """The estimator registered as `name` (`grpo`, `dr_grpo`, `rloo`, `gae`)."""
    return ADVANTAGE_ESTIMATORS.get(name)


def dynamic_sampling_mask(rewards, group_size: int) -> np.ndarray:
    """DAPO dynamic sampling (Yu et al. 2025, eq. 11): True for groups whose rewards are not all equal.

    A group whose samples all got the same reward has zero advantage everywhere and gives no policy
    gradient; DAPO drops such groups. Returns bool [num_groups]; see `expand_group_mask` for per-sample.
    """
    grouped = _grouped_rewards(rewards, group_size)
    return grouped.max(axis=1) != grouped.min(axis=1)


def expand_group_mask(group_mask, group_size: int) -> np.ndarray:
    """Repeats a per-group bool mask [num_groups] to per-sample [num_groups * group_size]."""
    group_size = _check_group_size(group_size)
    group_mask = np.asarray(group_mask, dtype=bool)
    if group_mask.ndim != 1:
        raise ValueError(f"group_mask must be 1-D [num_groups], got shape {group_mask.shape}")
    return np.repeat(group_mask, group_size)
