"""How a per-token matrix [B, T] under a 0/1 mask becomes one number, chosen by name (verl's `loss_agg_mode`
names), expressed as token weights: aggregate = sum(values * weights(mask)).

Weights make the normalisation global under data parallelism: each data-parallel rank weighs its own rows with
the whole mini-batch's counts (tokens, sequences), and the ranks' partial sums add up to the one-process value
whatever the response lengths on each rank. Sequences with an all-zero mask (rows padding a batch to
a static shape) get weight 0 and are not counted; every division is by max(count, 1), so an empty batch
gives 0, never NaN.
"""
from __future__ import annotations

import numpy as np

from mindrlhf.utils.registry import Registry

AGGREGATIONS: Registry = Registry("loss aggregation")


def mini_batch_counts(mask) -> tuple[float, float]:
    """(tokens, sequences with at least one token) under the 0/1 `mask` [B, T]: what an aggregation divides by."""
    tokens_per_sequence = np.asarray(mask, dtype=np.float64).sum(axis=1)
    return float(tokens_per_sequence.sum()), float((tokens_per_sequence > 0).sum())


@AGGREGATIONS.register("seq-mean-token-mean")
def seq_mean_token_mean(mask: np.ndarray, tokens: float, sequences: float) -> np.ndarray:
    """Mean over sequences of each sequence's token mean (DeepSeekMath GRPO, MindRLHF): each sequence weighs
    the same whatever its length."""
    del tokens
    return mask / np.maximum(mask.sum(axis=1), 1.0)[:, None] / max(sequences, 1.0)


@AGGREGATIONS.register("token-mean")
def token_mean(mask: np.ndarray, tokens: float, sequences: float) -> np.ndarray:
    """Sum over all tokens / number of tokens (DAPO, Dr. GRPO): each token weighs the same."""
    del sequences
    return mask / max(tokens, 1.0)


@AGGREGATIONS.register("seq-mean-token-sum")
def seq_mean_token_sum(mask: np.ndarray, tokens: float, sequences: float) -> np.ndarray:
    """Mean over sequences of each sequence's token sum (verl's `seq-mean-token-sum`)."""
    del tokens
    return mask / max(sequences, 1.0)


def aggregation_weights(mask, aggregation: str = "seq-mean-token-mean",
                        counts: tuple[float, float] | None = None) -> np.ndarray:
    """Token weights [B, T] (float64) of the aggregation registered as `aggregation`, for the 0/1 `mask`.
    `counts`: (tokens, sequences) of the whole mini-batch (`mini_batch_counts`) when `mask` holds one
    data-parallel rank's rows of it; default: `mask`'s own."""
    mask = np.asarray(mask, dtype=np.float64)
    if mask.ndim != 2:
        raise ValueError(f"mask must be 2-D [batch, tokens], got shape {mask.shape}")
    tokens, sequences = mini_batch_counts(mask) if counts is None else counts
    return AGGREGATIONS.get(aggregation)(mask, tokens, sequences)


def aggregate(values, mask, aggregation: str = "seq-mean-token-mean") -> float:
    """Reduces `values` [B, T] over the 0/1 `mask` [B, T] with the named aggregation (padding may hold anything)."""
    mask = np.asarray(mask, dtype=np.float64)
    values = np.where(mask > 0, np.asarray(values, dtype=np.float64), 0.0)
    return float((values * aggregation_weights(mask, aggregation)).sum())
