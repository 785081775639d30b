"""`TokenSelection`: a generation step's choice of tokens as a graph cell, so that the host receives one token and its
log-prob a row instead of the [B, V] logits.

The rule is the numpy reference's (:mod:`mindrlhf.generation.sampling`: `sample_tokens`, `greedy_tokens`,
`token_log_probs`) in float32: logits / temperature, top-k, top-p on the distribution renormalised after top-k, min-p
(a token's scaled logit at least the row's largest + log(min_p)), then the inverse CDF at one uniform a row drawn on
the host; greedy is argmax (the first index on ties). The settings are
constants of the compiled graph, so without top-k and top-p it is a softmax, block sums and two short prefix sums, no
sort (top-p alone sorts the vocabulary with a TopK of all of it: faster than Sort on CPU). Ties among equal logits
may be ordered otherwise than numpy's stable sort (the same distribution, another token id).

A float32 prefix sum over a whole vocabulary drifts (5e-5 of the total over 49k entries, which moves one draw in
six by a token or more against float64): the sums run inside blocks of about sqrt(N) entries and then over the
blocks' totals, and the search follows them: the block where the threshold falls, then the entry inside it.
"""
from __future__ import annotations

import math

import mindspore as ms
import numpy as np
from mindspore import nn, ops

from mindrlhf.parallel.layers import scaled_by_temperature

# float64 uniforms in [1 - 2**-25, 1) round up to 1.0 in float32, whose threshold would pass every entry
_LARGEST_BELOW_ONE = np.nextafter(np.float32(1.0), np.float32(0.0))


def float32_uniforms(uniforms: np.ndarray) -> np.ndarray:
    """Uniforms in [0, 1) as float32, still below 1 (the selection's `uniforms` input)."""
    return np.minimum(np.asarray(uniforms, np.float32), _LARGEST_BELOW_ONE)


def block_length(n: int) -> int:
    """The largest divisor of `n` up to sqrt(n): the block of the two-level prefix sums over n entries (1 for a
    prime n: then one prefix sum runs over all n)."""
    return max(d for d in range(1, math.isqrt(n) + 1) if n % d == 0)


def count_below(values, limit, strict):
    """How many entries of `values` [.., n] are <= `limit` [.., 1] (< when `strict`), int32 [..]."""
    below = values < limit if strict else values <= limit
    return below.astype(ms.float32).sum(-1).astype(ms.int32)  # a float32 sum counts exactly up to 2**24


def block_ends(weights, block):
    """The prefix sums of `weights` [B, N] at the ends of its blocks of `block` entries, [B, N / block] (the last:
    the row's total, summed in two levels)."""
    rows, n = weights.shape
    sums = weights.reshape(rows * (n // block), block).sum(-1)  # on 2-D: a reduction of 3-D's last axis is 5x slower
    return ops.cumsum(sums.reshape(rows, n // block), -1)


def inverse_cdf(weights, ends, fraction, block, strict=False):
    """How many leading prefix sums of `weights` [B, N] (>= 0, N a multiple of `block`; `ends` = `block_ends`) are
    <= `fraction` of the row's total (< when `strict`), int32 [B]; `fraction` is [B, 1] or a number.

    Not strict, with a fraction below 1, the count is the index of the drawn entry, and its weight is never 0: it
    stops inside the first block whose prefix sum passes the threshold, at an entry that adds to the sum.
    """
    rows, n = weights.shape
    limit = fraction * ends[:, -1:]
    starts = ops.concat((ops.zeros((rows, 1), ms.float32), ends[:, :-1]), -1)
    first = ops.minimum(count_below(ends, limit, strict), n // block - 1)
    offset = ops.gather_elements(starts, 1, first.reshape(rows, 1))
    inside = ops.cumsum(ops.gather(weights.reshape(rows, n // block, block), first, 1, 1), -1)  # row b: block first[b]
    within = count_below(offset + inside, limit, strict)
    if not strict:
        # the block's own sum may round below its end in `ends`: stay on its last entry with weight
        within = ops.minimum(within, count_below(inside, inside[:, -1:], True))
    return first * block + within


class TokenSelection(nn.Cell):
    """logits [B, V] (float32, or cast to it) and uniforms [B] float32 in [0, 1) (`float32_uniforms`) -> tokens
    int32 [B] and their log-probs float32 [B] (None unless `with_log_probs`).

    log-prob = log_softmax(logits / T) at the token, T = `temperature` (1 when `greedy`), before top-k/top-p
    (`Generator.generate`'s convention). `top_k` 0 (or >= V), `top_p` 1 and `min_p` 0 are off. Greedy ignores the
    uniforms.
    """

    def __init__(self, vocab_size: int, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                 greedy: bool = False, with_log_probs: bool = True, min_p: float = 0.0):
        super().__init__()
        if not greedy and temperature <= 0:
            raise ValueError(f"temperature={temperature} must be > 0 for sampling; greedy=True for argmax")
        self.greedy = greedy
        self.temperature = 1.0 if greedy else float(temperature)
        self.top_k = top_k if 0 < top_k < vocab_size else 0
        self.top_p = float(top_p)
        self.log_min_p = math.log(min_p) if min_p > 0 else None
        self.with_log_probs = with_log_probs
        self.candidates = self.top_k or vocab_size  # top-p alone sorts the whole vocabulary
        self.vocab_block = block_length(vocab_size)
        self.block = block_length(self.candidates)
        self.positions = ms.Tensor(np.arange(self.candidates, dtype=np.int32)) if self.top_p < 1.0 else None

    def construct(self, logits, uniforms):
        rows = uniforms.shape[0]
        logits = logits.astype(ms.float32)
        if self.greedy:
            tokens = ops.argmax(logits, -1).astype(ms.int32)
            return tokens, self._full_log_prob(logits, tokens)
        scaled = scaled_by_temperature(logits, self.temperature)
        if self.top_k == 1:  # one candidate: the argmax (the first on ties, as greedy), whatever the draw
            tokens = ops.argmax(scaled, -1).astype(ms.int32)
            return tokens, self._full_log_prob(scaled, tokens)
        fraction = uniforms.reshape(rows, 1)
        if not self.top_k and self.top_p >= 1.0:
            probs = ops.softmax(scaled, -1)
            ends = block_ends(probs, self.block)
            if self.log_min_p is None:
                tokens = inverse_cdf(probs, ends, fraction, self.block)
            else:
                weights = self._min_p(probs, scaled, scaled.max(-1, keepdims=True))
                tokens = inverse_cdf(weights, block_ends(weights, self.block), fraction, self.block)
            return tokens, self._log_prob(probs, ends[:, -1:], tokens)
        values, indices = ops.topk(scaled, self.candidates)
        probs = ops.softmax(values, -1)
        ends = block_ends(probs, self.block)
        weights = probs
        if self.top_p < 1.0:
            kept = 1 + inverse_cdf(probs, ends, self.top_p, self.block, strict=True)
            weights = probs * (self.positions < kept.reshape(rows, 1)).astype(ms.float32)
        weights = self._min_p(weights, values, values[:, :1])
        choice = inverse_cdf(weights, block_ends(weights, self.block), fraction, self.block)
        tokens = ops.gather_elements(indices, 1, choice.reshape(rows, 1)).reshape(rows)
        if self.top_k:
            return tokens, self._full_log_prob(scaled, tokens)
        return tokens, self._log_prob(probs, ends[:, -1:], choice)  # all V candidates: their softmax is the full one

    def _min_p(self, weights, scaled, largest):
        """`weights` without the tokens min-p drops: those whose scaled logit is below the row's `largest` + log(min_p)
        (probability below min_p times the largest); `weights` itself when min-p is off."""
        if self.log_min_p is None:
            return weights
        return weights * (scaled >= largest + self.log_min_p).astype(ms.float32)

    def _full_log_prob(self, scaled, tokens):
        """log_softmax(scaled) at `tokens` (None unless `with_log_probs`)."""
        if not self.with_log_probs:
            return None
        probs = ops.softmax(scaled, -1)
        return self._log_prob(probs, block_ends(probs, self.vocab_block)[:, -1:], tokens)

    def _log_prob(self, probs, total, index):
        """log(probs / total) at `index` [B] (None unless `with_log_probs`). `total`, the rows' sum of `probs` by
        blocks, corrects the softmax's own normaliser (a float32 sum over the row, 1e-5 off over 49k entries); the
        log of a probability is exact to float32 above 1e-38, far below any token a draw or argmax picks."""
        if not self.with_log_probs:
            return None
        return ops.log(ops.gather_elements(probs, 1, index.reshape(-1, 1)) / total).reshape(-1)
