"""PPO math in numpy: token rewards with a KL penalty, GAE, masked whitening, the clipped value loss, explained
variance and the KL-in-reward coefficient controllers (verl `core_algos.py` / OpenRLHF semantics).

Arrays are [N, T] over response tokens with a 0/1 `response_mask`; padded positions are returned as 0.
"""
from __future__ import annotations

import numpy as np

from mindrlhf.algorithms.advantages import ADVANTAGE_ESTIMATORS
from mindrlhf.data.experience import trained_tokens
from mindrlhf.utils.registry import Registry


def _token_arrays(mask, **arrays) -> tuple[np.ndarray, ...]:
    """float64 copies of `arrays`, each checked to have the mask's 2-D shape, and the mask as bool."""
    mask = np.asarray(mask)
    if mask.ndim != 2:
        raise ValueError(f"response_mask must be 2-D [batch, response_len], got shape {mask.shape}")
    if not np.isin(mask, (0, 1)).all():
        raise ValueError("response_mask must hold only 0 and 1")
    out = []
    for name, value in arrays.items():
        value = np.asarray(value, dtype=np.float64)
        if value.shape != mask.shape:
            raise ValueError(f"{name} must have the response mask's shape {mask.shape}, got {value.shape}")
        out.append(np.where(mask > 0, value, 0.0))  # padding may hold anything
    return (*out, mask > 0)


def masked_whiten(values, mask, shift_mean: bool = True, eps: float = 1e-8) -> np.ndarray:
    """(x - mean) / sqrt(var + eps) with mean and unbiased variance over the valid entries only (verl's
    `masked_whiten`); `shift_mean=False` adds the mean back. Needs at least 2 valid entries. float32."""
    values, valid = _token_arrays(mask, values=values)
    count = int(valid.sum())
    if count < 2:
        raise ValueError(f"masked_whiten needs at least 2 valid entries for a variance, got {count}")
    mean = values.sum() / count
    var = (np.where(valid, values - mean, 0.0) ** 2).sum() / (count - 1)
    whitened = (values - mean) / np.sqrt(var + eps)
    if not shift_mean:
        whitened += mean
    return np.where(valid, whitened, 0.0).astype(np.float32)


def token_level_rewards(sequence_rewards, response_mask, kl=None, kl_coef: float = 0.0) -> np.ndarray:
    """Per-token rewards: each response's reward on its last valid token, minus `kl_coef * kl` on every valid
    token (the KL-in-reward penalty of InstructGPT/verl/OpenRLHF: subtracted, never added). float32 [N, T]."""
    mask = np.asarray(response_mask)
    kl = np.zeros(mask.shape) if kl is None else kl
    kl, valid = _token_arrays(mask, kl=kl)
    rewards = np.asarray(sequence_rewards, dtype=np.float64)
    if rewards.shape != (mask.shape[0],):
        raise ValueError(f"sequence_rewards must have shape ({mask.shape[0]},), got {rewards.shape}")
    lengths = valid.sum(axis=1)
    empty = np.flatnonzero(lengths == 0)
    if empty.size:
        raise ValueError(f"response {int(empty[0])} has no valid token to carry its reward")
    if kl_coef < 0:
        raise ValueError(f"kl_coef must be >= 0, got {kl_coef}")
    out = -kl_coef * kl
    last = valid.shape[1] - 1 - np.argmax(valid[:, ::-1], axis=1)
    out[np.arange(len(rewards)), last] += rewards
    return np.where(valid, out, 0.0).astype(np.float32)


def gae_advantages_returns(token_rewards, values, response_mask, gamma: float = 1.0,
                           lam: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """Generalised advantage estimation (Schulman et al. 2016) over the valid tokens, as verl's
    `compute_gae_advantage_return`: delta_t = r_t + gamma * V_next - V_t, A_t = delta_t + gamma * lam * A_next,
    where "next" is the next *valid* token (a padded position in the middle is transparent: it neither adds a
    reward nor breaks the recursion) and V after the last token is 0. Returns (advantages, returns = A + V),
    float32 [N, T], not whitened (whiten over the global batch with `masked_whiten`)."""
    rewards, values, valid = _token_arrays(response_mask, token_rewards=token_rewards, values=values)
    for name, value in (("gamma", gamma), ("lam", lam)):
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"{name} must be in [0, 1], got {value}")
    next_value = np.zeros(rewards.shape[0])
    next_advantage = np.zeros(rewards.shape[0])
    advantages = np.zeros_like(rewards)
    for t in reversed(range(rewards.shape[1])):
        here = valid[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        advantage = delta + gamma * lam * next_advantage
        next_value = np.where(here, values[:, t], next_value)
        next_advantage = np.where(here, advantage, next_advantage)
        advantages[:, t] = np.where(here, advantage, 0.0)
    returns = np.where(valid, advantages + values, 0.0)
    return advantages.astype(np.float32), returns.astype(np.float32)


@ADVANTAGE_ESTIMATORS.register("gae")
def gae_estimator(batch, group_size: int, settings) -> tuple[np.ndarray, np.ndarray]:
    """PPO: GAE over `token_rewards` and the critic's `values` (`algorithm.gamma`, `algorithm.lam`) at the policy's
    tokens (`trained_tokens`: a tool turn's are passed over, as padding); the advantages are whitened over those
    tokens of the batch (the global batch: every rank holds it)."""
    del group_size
    mask = batch[trained_tokens(batch)]
    advantages, returns = gae_advantages_returns(batch["token_rewards"], batch["values"], mask, settings.gamma,
                                                 settings.lam)
    return masked_whiten(advantages, mask), returns


def value_loss(values, old_values, returns, response_mask, cliprange_value: float = 0.5,
               token_weights=None) -> tuple[float, float]:
    """Clipped value loss (PPO2, verl `compute_value_loss`): with v_clip = old + clip(v - old, -c, c),
    per token 0.5 * max((v - R)^2, (v_clip - R)^2), reduced as `sum(token_weights * per_token)` (token weights of
    an aggregation, `aggregation_weights`; default: token mean over the mask). Returns (loss, clipfrac), where
    clipfrac is the weighted share of tokens whose clipped error is the larger one."""
    values, old_values, returns, valid = _token_arrays(response_mask, values=values, old_values=old_values,
                                                       returns=returns)
    if cliprange_value < 0:
        raise ValueError(f"cliprange_value must be >= 0, got {cliprange_value}")
    if token_weights is None:
        token_weights = valid / max(int(valid.sum()), 1)
    (weights,) = _token_arrays(response_mask, token_weights=token_weights)[:1]
    moved = values - old_values
    # within the range the clipped value is the value itself: old + (v - old) rounds, and a tie of the two errors
    # decided by rounding would count the token as clipped
    clipped = np.where(np.abs(moved) > cliprange_value,
                       old_values + np.clip(moved, -cliprange_value, cliprange_value), values)
    unclipped_error = (values - returns) ** 2
    clipped_error = (clipped - returns) ** 2
    per_token = 0.5 * np.maximum(unclipped_error, clipped_error)
    return float((weights * per_token).sum()), float((weights * (clipped_error > unclipped_error)).sum())


def explained_variance(returns, values, response_mask) -> float:
    """1 - Var(returns - values) / Var(returns) over the valid tokens (1: the critic explains the returns; 0: no
    better than their mean); NaN when the returns do not vary."""
    returns, values, valid = _token_arrays(response_mask, returns=returns, values=values)
    if not valid.any():
        return float("nan")
    target = returns[valid]
    var = target.var()
    return float("nan") if var == 0 else float(1.0 - (target - values[valid]).var() / var)


# ---------------------------------------------------------------- KL-in-reward coefficient controllers
KL_CONTROLLERS: Registry = Registry("KL controller")


@KL_CONTROLLERS.register("fixed")
class FixedKLController:
    """A constant KL coefficient."""

    def __init__(self, kl_coef: float, target_kl: float = 0.0, horizon: int = 1):
        del target_kl, horizon
        if kl_coef < 0:
            raise ValueError(f"kl_coef must be >= 0, got {kl_coef}")
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        del current_kl, n_steps

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])


@KL_CONTROLLERS.register("adaptive")
class AdaptiveKLController(FixedKLController):
    """Ziegler et al. 2019 (verl's `AdaptiveKLController`): after each batch of `n_steps` samples, coef *=
    1 + clip(kl / target - 1, -0.2, 0.2) * n_steps / horizon, so the KL drifts towards `target_kl`."""

    def __init__(self, kl_coef: float, target_kl: float, horizon: int):
        super().__init__(kl_coef)
        if target_kl <= 0 or horizon <= 0:
            raise ValueError(f"the adaptive KL controller needs target_kl > 0 and horizon > 0, got {target_kl} "
                             f"and {horizon}")
        self.target, self.horizon = float(target_kl), int(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        error = float(np.clip(current_kl / self.target - 1.0, -0.2, 0.2))
        self.value *= 1.0 + error * n_steps / self.horizon


def build_kl_controller(kind: str, kl_coef: float, target_kl: float = 0.1, horizon: int = 10000):
    """The controller registered as `kind` ('fixed' or 'adaptive')."""
    return KL_CONTROLLERS.get(kind)(kl_coef, target_kl, horizon)
