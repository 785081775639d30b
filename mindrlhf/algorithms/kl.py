"""Per-token estimators of KL(policy || ref) from sampled tokens' log-probs (J. Schulman, "Approximating
KL divergence", 2020), chosen by name as in verl's `kl_penalty`. Inputs are log-probs of the sampled
tokens under the policy (`logp`) and the reference model (`ref_logp`); samples come from the policy.
"""
from __future__ import annotations

import numpy as np

from mindrlhf.utils.registry import Registry

KL_ESTIMATORS: Registry = Registry("KL estimator")


@KL_ESTIMATORS.register("k1")
def kl_k1(logp, ref_logp) -> np.ndarray:
    """k1 = logp - ref_logp: unbiased, high variance, can be negative."""
    return np.asarray(logp, dtype=np.float64) - np.asarray(ref_logp, dtype=np.float64)


@KL_ESTIMATORS.register("k2")
def kl_k2(logp, ref_logp) -> np.ndarray:
    """k2 = (logp - ref_logp)^2 / 2: biased, low variance, >= 0."""
    return 0.5 * np.square(kl_k1(logp, ref_logp))


@KL_ESTIMATORS.register("k3")
def kl_k3(logp, ref_logp) -> np.ndarray:
    """k3 = exp(ref - logp) - (ref - logp) - 1: unbiased, low variance, >= 0 (the GRPO paper's KL term)."""
    log_ratio = np.asarray(ref_logp, dtype=np.float64) - np.asarray(logp, dtype=np.float64)
    return np.expm1(log_ratio) - log_ratio


def kl_penalty(logp, ref_logp, estimator: str = "k3") -> np.ndarray:
    """Per-token KL estimate with the estimator registered as `estimator` (`k1`, `k2`, `k3`), float64."""
    return KL_ESTIMATORS.get(estimator)(logp, ref_logp)
