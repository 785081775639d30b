"""The GRPO policy loss in numpy: the reference the MindSpore `GRPOLossCell` is tested against.

Per token (DeepSeekMath eq. 3, with DAPO's asymmetric "clip-higher" range):

    ratio = exp(logp - old_logp)
    pg    = -min(ratio * A, clip(ratio, 1 - epsilon_low, 1 + epsilon_high) * A)
    loss  = pg + beta * KL_k3(policy || ref)

then reduced over the response mask with a named aggregation (see `aggregation.py`).
"""
from __future__ import annotations

import numbers

import numpy as np

from mindrlhf.algorithms.aggregation import AGGREGATIONS, aggregation_weights
from mindrlhf.algorithms.kl import KL_ESTIMATORS, kl_penalty


def _check_number(name: str, value, low: float, high: float = np.inf) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not low <= float(value) <= high:
        bounds = f">= {low}" if high == np.inf else f"in [{low}, {high}]"
        raise ValueError(f"{name} must be a number {bounds}, got {value!r}")
    return float(value)


def check_loss_hyperparameters(beta: float, epsilon_low: float, epsilon_high: float, aggregation: str,
                               kl_estimator: str = "k3") -> tuple[float, float, float]:
    """Validates the GRPO loss settings (shared by the numpy loss and `GRPOLossCell`); returns the floats."""
    beta = _check_number("beta", beta, 0.0)
    epsilon_low = _check_number("epsilon_low", epsilon_low, 0.0, 1.0)
    epsilon_high = _check_number("epsilon_high", epsilon_high, 0.0)
    AGGREGATIONS.get(aggregation)
    KL_ESTIMATORS.get(kl_estimator)
    return beta, epsilon_low, epsilon_high


def _validated_inputs(logp, old_logp, ref_logp, advantages, mask):
    logp = np.asarray(logp, dtype=np.float64)
    if logp.ndim != 2:
        raise ValueError(f"logp must be 2-D [batch, response_len], got shape {logp.shape}")
    arrays = {"logp": logp}
    for name, value in (("old_logp", old_logp), ("ref_logp", ref_logp), ("mask", mask)):
        array = np.asarray(value, dtype=np.float64)
        if array.shape != logp.shape:
            raise ValueError(f"{name} must have the shape of logp {logp.shape}, got {array.shape}")
        arrays[name] = array
    advantages = np.asarray(advantages, dtype=np.float64)
    if advantages.shape == (logp.shape[0],):
        if not np.isfinite(advantages).all():
            bad = np.flatnonzero(~np.isfinite(advantages)).tolist()
            raise ValueError(f"advantages must be finite, got non-finite values at indices {bad}")
        advantages = np.broadcast_to(advantages[:, None], logp.shape)
    elif advantages.shape != logp.shape:
        raise ValueError(f"advantages must have shape ({logp.shape[0]},) [batch] or {logp.shape} [batch, "
                         f"response_len], got {advantages.shape}")
    arrays["advantages"] = advantages
    mask = arrays["mask"]
    if not np.isin(mask, (0.0, 1.0)).all():
        raise ValueError("mask must hold only 0 and 1")
    valid = mask > 0
    for name in ("logp", "old_logp", "ref_logp", "advantages"):
        bad = valid & ~np.isfinite(arrays[name])
        if bad.any():
            where = np.argwhere(bad)[0].tolist()
            raise ValueError(f"{name} must be finite where mask is 1, got {arrays[name][tuple(where)]} at {where}")
        # Padding may hold anything (even inf); zero it so it cannot leak NaN into masked sums.
        arrays[name] = np.where(valid, arrays[name], 0.0)
    return arrays["logp"], arrays["old_logp"], arrays["ref_logp"], arrays["advantages"], mask


def grpo_policy_loss(logp, old_logp, ref_logp, advantages, mask, beta: float = 0.01, epsilon_low: float = 0.2,
                     epsilon_high: float = 0.2, aggregation: str = "seq-mean-token-mean",
                     kl_estimator: str = "k3") -> tuple[float, dict[str, float]]:
    """GRPO clipped surrogate + beta * KL(policy || ref) (DeepSeekMath eq. 3; clip-higher from DAPO).

    Shapes: logp, old_logp, ref_logp, mask [B, T] (mask 0/1), advantages [B, T] (token level) or [B] (one per
    response, broadcast over its tokens). Computed in float64.
    The clip is "active" on a token when the clipped term is the one `min` picks and it differs from the
    unclipped one (ratio > 1 + epsilon_high with A > 0, ratio < 1 - epsilon_low with A < 0); there the
    token's policy-gradient term is constant in logp.

    Returns (loss, stats). Every stat is aggregated over masked tokens with the same `aggregation` as
    the loss (rows whose mask is all 0 are ignored, see `aggregation.py`), so loss == pg_loss + beta * kl_loss:
      kl_loss      the KL(policy || ref) estimate (`kl_estimator`, k3 by default),
      pg_clipfrac  the share of tokens where the clip is active,
      pg_loss      the clipped policy-gradient term,
      ratio_mean   the importance ratio exp(logp - old_logp),
      ppo_kl       old_logp - logp: the k1 estimate of KL(old policy || policy) on the tokens the old policy
                   sampled, how far the updates have moved the policy from the one that sampled.
    (Under `seq-mean-token-sum` pg_clipfrac, ratio_mean and ppo_kl are per-sequence sums averaged over sequences.)
    The stats are the names the trainer logs as `actor/<stat>` (MindSpeed-RL's and verl's names).
    """
    beta, epsilon_low, epsilon_high = check_loss_hyperparameters(
        beta, epsilon_low, epsilon_high, aggregation, kl_estimator)
    logp, old_logp, ref_logp, advantages, mask = _validated_inputs(logp, old_logp, ref_logp, advantages, mask)
    ratio = np.exp(logp - old_logp)
    unclipped = ratio * advantages
    clipped = np.clip(ratio, 1.0 - epsilon_low, 1.0 + epsilon_high) * advantages
    clip_active = clipped < unclipped
    pg_token = -np.minimum(unclipped, clipped)
    kl_token = kl_penalty(logp, ref_logp, kl_estimator)
    weights = aggregation_weights(mask, aggregation)
    loss = float((weights * (pg_token + beta * kl_token)).sum())
    stats = {
        "kl_loss": float((weights * kl_token).sum()),
        "pg_clipfrac": float((weights * clip_active).sum()),
        "pg_loss": float((weights * pg_token).sum()),
        "ratio_mean": float((weights * ratio).sum()),
        "ppo_kl": float((weights * (old_logp - logp)).sum()),
    }
    return loss, stats
