"""How a per-token matrix [B, T] under a 0/1 mask becomes one number, chosen by name (verl's `loss_agg_mode`
names), expressed as token weights: aggregate = sum(values * weights(mask)).

Weights make the normalisation global under data parallelism: they are computed once on the whole (global)
mini-batch, each data-parallel rank takes its rows, and the ranks' partial sums add up to the one-process
value whatever the response lengths on each rank. Sequences with an all-zero mask (rows padding a batch to
a static shape) get weight 0 and are not counted; every division is by max(count, 1), so an empty batch
gives 0, never NaN.
"""
from __future__ import annotations

import numpy as np

from mindrlhf.utils.registry import Registry

AGGREGATIONS: Registry = Registry("loss aggregation")


def _tokens_and_sequences(mask: np.ndarray) -> tuple[np.ndarray, float]:
    tokens_per_sequence = mask.sum(axis=1)
    return tokens_per_sequence, max(float((tokens_per_sequence > 0).sum()), 1.0)


@AGGREGATIONS.register("seq-mean-token-mean")
def seq_mean_token_mean(mask: np.ndarray) -> np.ndarray:
    """Mean over sequences of each sequence's token mean (DeepSeekMath GRPO, MindRLHF): each sequence weighs
    the same whatever its length."""
    tokens_per_sequence, sequences = _tokens_and_sequences(mask)
    return mask / np.maximum(tokens_per_sequence, 1.0)[:, None] / sequences


@AGGREGATIONS.register("token-mean")
def token_mean(mask: np.ndarray) -> np.ndarray:
    """Sum over all tokens / number of tokens (DAPO, Dr. GRPO): each token weighs the same."""
    return mask / max(float(mask.sum()), 1.0)


@AGGREGATIONS.register("seq-mean-token-sum")
def seq_mean_token_sum(mask: np.ndarray) -> np.ndarray:
    """Mean over sequences of each sequence's token sum (verl's `seq-mean-token-sum`)."""
    return mask / _tokens_and_sequences(mask)[1]


def aggregation_weights(mask, aggregation: str = "seq-mean-token-mean") -> np.ndarray:
    """Token weights [B, T] (float64) of the aggregation registered as `aggregation`, for the 0/1 `mask`."""
    mask = np.asarray(mask, dtype=np.float64)
    if mask.ndim != 2:
        raise ValueError(f"mask must be 2-D [batch, tokens], got shape {mask.shape}")
    return AGGREGATIONS.get(aggregation)(mask)


def aggregate(values, mask, aggregation: str = "seq-mean-token-mean") -> float:
    """Reduces `values` [B, T] over the 0/1 `mask` [B, T] with the named aggregation (padding may hold anything)."""
    mask = np.asarray(mask, dtype=np.float64)
    values = np.where(mask > 0, np.asarray(values, dtype=np.float64), 0.0)
    return float((values * aggregation_weights(mask, aggregation)).sum())
