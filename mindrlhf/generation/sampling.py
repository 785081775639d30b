"""Token selection on [B, V] logits as pure numpy functions (temperature, top-k, top-p, min-p, draw): the reference
of the graph cell the Generator runs on the device (:mod:`mindrlhf.generation.selection`), and the host-side tools.

Filtered-out tokens get logit -inf. Probabilities are computed in float64.
"""
from __future__ import annotations

import numpy as np


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """log softmax over the last axis, float64 (-inf entries give -inf)."""
    x = np.asarray(logits, np.float64)
    top = np.max(x, axis=-1, keepdims=True)
    top = np.where(np.isfinite(top), top, 0.0)
    shifted = x - top
    with np.errstate(divide="ignore"):
        return shifted - np.log(np.sum(np.exp(shifted), axis=-1, keepdims=True))


def softmax(logits: np.ndarray) -> np.ndarray:
    """softmax over the last axis, float64."""
    return np.exp(log_softmax(logits))


def top_k_candidates(logits: np.ndarray, top_k: int) -> tuple[np.ndarray, np.ndarray]:
    """The `top_k` largest logits of each row and their indices, both [B, k], sorted descending.

    O(V) per row (argpartition) plus a sort of k values; ties at the k-th value are broken arbitrarily,
    so exactly k tokens are kept.
    """
    logits = np.asarray(logits)
    vocab = logits.shape[-1]
    if not 1 <= top_k <= vocab:
        raise ValueError(f"top_k={top_k} must be in [1, vocab={vocab}]")
    if top_k == vocab:
        indices = np.broadcast_to(np.arange(vocab), logits.shape)
    else:
        indices = np.argpartition(-logits, top_k - 1, axis=-1)[..., :top_k]
    values = np.take_along_axis(logits, indices, axis=-1)
    order = np.argsort(-values, axis=-1, kind="stable")
    return np.take_along_axis(values, order, axis=-1), np.take_along_axis(indices, order, axis=-1)


def nucleus_mask(sorted_logits: np.ndarray, top_p: float) -> np.ndarray:
    """Keep-mask over logits sorted descending: the smallest prefix whose probability sums to >= top_p.

    A token is kept when the probability of the tokens before it is still < top_p, so the top token is
    always kept (top_p > 0).
    """
    probs = softmax(sorted_logits)
    before = np.cumsum(probs, axis=-1) - probs
    keep = before < top_p
    keep[..., 0] = True
    return keep


def min_p_mask(logits: np.ndarray, min_p: float) -> np.ndarray:
    """Keep-mask of the tokens whose probability is at least `min_p` times their row's largest (min-p sampling,
    Nguyen et al. 2024); the same tokens whatever the rows' normalisation, so whether top-k/top-p ran first."""
    probs = softmax(logits)
    return probs >= min_p * probs.max(axis=-1, keepdims=True)


def min_p_filter(logits: np.ndarray, min_p: float) -> np.ndarray:
    """Logits of the tokens `min_p_mask` drops set to -inf; min_p 0 = unchanged."""
    logits = np.asarray(logits)
    if min_p <= 0:
        return logits.copy()
    return np.where(min_p_mask(logits, min_p), logits, -np.inf).astype(logits.dtype, copy=False)


def top_k_filter(logits: np.ndarray, top_k: int) -> np.ndarray:
    """Logits with everything but each row's `top_k` largest set to -inf; top_k 0 (or >= V) = unchanged."""
    logits = np.asarray(logits)
    if top_k <= 0 or top_k >= logits.shape[-1]:
        return logits.copy()
    values, indices = top_k_candidates(logits, top_k)
    out = np.full_like(logits, -np.inf)
    np.put_along_axis(out, indices, values, axis=-1)
    return out


def top_p_filter(logits: np.ndarray, top_p: float) -> np.ndarray:
    """Logits outside each row's nucleus (see `nucleus_mask`) set to -inf; top_p 1.0 = unchanged."""
    logits = np.asarray(logits)
    if top_p >= 1.0:
        return logits.copy()
    order = np.argsort(-logits, axis=-1, kind="stable")
    keep_sorted = nucleus_mask(np.take_along_axis(logits, order, axis=-1), top_p)
    keep = np.empty_like(keep_sorted)
    np.put_along_axis(keep, order, keep_sorted, axis=-1)
    return np.where(keep, logits, -np.inf).astype(logits.dtype, copy=False)


def categorical(probs: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """One draw per row of `probs` [B, N] (rows need not be normalised) by inverse CDF: one uniform per row.

    Zero-probability entries are never drawn.
    """
    cdf = np.cumsum(probs, axis=-1)
    u = rng.random((cdf.shape[0], 1)) * cdf[:, -1:]
    choice = np.sum(cdf <= u, axis=-1)
    return np.minimum(choice, cdf.shape[-1] - 1)


def sample_tokens(logits: np.ndarray, rng: np.random.Generator, temperature: float = 1.0, top_k: int = 0,
                  top_p: float = 1.0, return_log_probs: bool = False, min_p: float = 0.0):
    """Token ids [B] drawn from logits [B, V]: / temperature, then top-k, then top-p, then min-p, then a categorical
    draw.

    Consumes exactly B uniforms from `rng` per call. Top-p acts on the distribution renormalised after
    top-k (as Hugging Face's warpers do; min-p keeps the same tokens in any order); with top-k set, only the k
    candidates are sorted. With
    `return_log_probs`, returns `(tokens, token_log_probs(logits, tokens, temperature))`, from the same
    log-softmax that the unfiltered draw uses (the same numbers as computing them apart).
    """
    if temperature <= 0:
        raise ValueError(f"temperature={temperature} must be > 0 for sampling; use greedy_tokens for argmax")
    scaled = np.asarray(logits, np.float64) / temperature
    vocab = scaled.shape[-1]
    indices = None
    if 0 < top_k < vocab:
        candidates, indices = top_k_candidates(scaled, top_k)
    elif top_p < 1.0:
        indices = np.argsort(-scaled, axis=-1, kind="stable")
        candidates = np.take_along_axis(scaled, indices, axis=-1)
    full_log_probs = log_softmax(scaled) if indices is None or return_log_probs else None
    if indices is None:
        tokens = categorical(np.exp(min_p_filter(full_log_probs, min_p)), rng)
    else:
        if top_p < 1.0:
            candidates = np.where(nucleus_mask(candidates, top_p), candidates, -np.inf)
        choice = categorical(softmax(min_p_filter(candidates, min_p)), rng)
        tokens = np.take_along_axis(indices, choice[:, None], axis=-1)[:, 0]
    tokens = tokens.astype(np.int64)
    if not return_log_probs:
        return tokens
    return tokens, _at_tokens(full_log_probs, tokens)


def greedy_tokens(logits: np.ndarray) -> np.ndarray:
    """argmax over the last axis (the first index on ties), int64 [B]."""
    return np.argmax(np.asarray(logits), axis=-1).astype(np.int64)


def token_log_probs(logits: np.ndarray, tokens: np.ndarray, temperature: float = 1.0) -> np.ndarray:
    """log softmax(logits / temperature) at `tokens`, float32 [B]. Top-k/top-p are not applied."""
    return _at_tokens(log_softmax(np.asarray(logits, np.float64) / temperature), tokens)


def _at_tokens(log_probs: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """float32 [B]: each row's entry of `log_probs` [B, V] at its token."""
    return np.take_along_axis(log_probs, np.asarray(tokens, np.int64)[:, None], axis=-1)[:, 0].astype(np.float32)
