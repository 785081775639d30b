"""Reductions of a per-token matrix [B, T] under a 0/1 mask to a scalar, chosen by name (verl's
`loss_agg_mode` names).

Sequences with an all-zero mask (e.g. rows padding a batch to a static shape) are ignored: they add 0 to
every sum and are not counted in any mean, so padding rows change neither the loss nor its gradient (as
verl does). Every division is by max(count, 1), so an empty batch gives 0, never NaN.
"""
from __future__ import annotations

import numpy as np

from mindrlhf.algorithms.registry import Registry

AGGREGATIONS: Registry = Registry("loss aggregation")


@AGGREGATIONS.register("seq-mean-token-mean")
def seq_mean_token_mean(values: np.ndarray, mask: np.ndarray) -> float:
    """Mean over sequences of each sequence's masked token mean (DeepSeekMath GRPO, MindRLHF, TRL 0.14).

    Each sequence weighs the same whatever its length.
    """
    tokens_per_sequence = mask.sum(axis=1)
    per_sequence = (values * mask).sum(axis=1) / np.maximum(tokens_per_sequence, 1.0)
    return float(per_sequence.sum() / max(float((tokens_per_sequence > 0).sum()), 1.0))


@AGGREGATIONS.register("token-mean")
def token_mean(values: np.ndarray, mask: np.ndarray) -> float:
    """Sum over all masked tokens / number of masked tokens (DAPO, Dr. GRPO): each token weighs the same."""
    return float((values * mask).sum() / max(float(mask.sum()), 1.0))


@AGGREGATIONS.register("seq-mean-token-sum")
def seq_mean_token_sum(values: np.ndarray, mask: np.ndarray) -> float:
    """Mean over sequences of each sequence's masked token sum (verl's `seq-mean-token-sum`)."""
    nonempty_sequences = float((mask.sum(axis=1) > 0).sum())
    return float((values * mask).sum() / max(nonempty_sequences, 1.0))


def aggregate(values, mask, aggregation: str = "seq-mean-token-mean") -> float:
    """Reduces `values` [B, T] over the 0/1 `mask` [B, T] with the aggregation registered as `aggregation`."""
    fn = AGGREGATIONS.get(aggregation)
    return fn(np.asarray(values, dtype=np.float64), np.asarray(mask, dtype=np.float64))
