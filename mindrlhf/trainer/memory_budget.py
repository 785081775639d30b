"""Rows per graph call from an activation-memory budget: what a micro-batch size of 0 ("auto") resolves to.

Pure arithmetic on the model's shape. The per-token constants are measured, not derived: MindSpore's CPU backend
keeps the activations a backward pass needs plus several working buffers per op (SmolLM2-135M's shape, 30 layers,
223 tokens, 1 vs 2 rows: +0.6 GB a row, ~90 KB per token per layer in the train graph; the [tokens, vocab] float32
logits and their log-softmax, exp and gradient ~4 copies). They overestimate a little on purpose: a run that fits
is worth more than a few percent of speed. What a graph holds besides activations (gradients, optimizer state,
weights) is not in the budget.
"""
from __future__ import annotations

FLOAT_BYTES = 4


def train_bytes_per_row(tokens: int, scored: int, hidden: int, intermediate: int, heads: int, layers: int,
                        vocab: int, tp: int = 1) -> int:
    """Activation bytes one response row costs in the train graph (forward kept for backward + backward).

    `tokens`: positions the model reads (prompt bucket + response width - 1); `scored`: positions that reach the
    head (the response width); `heads`, `intermediate` and `vocab` are split over `tp`."""
    per_token_layer = 24 * hidden + 3 * intermediate // tp + 2 * (heads // tp) * tokens
    return FLOAT_BYTES * (tokens * layers * per_token_layer + scored * 4 * vocab // tp)


def log_prob_bytes_per_row(tokens: int, scored: int, hidden: int, intermediate: int, heads: int, vocab: int,
                           tp: int = 1) -> int:
    """Activation bytes one row costs in a forward-only log-prob graph (buffers are reused from layer to layer,
    so one layer's working set counts, plus the scored positions' logits)."""
    per_token_layer = 24 * hidden + 4 * intermediate // tp + 3 * (heads // tp) * tokens
    return FLOAT_BYTES * (tokens * per_token_layer + scored * 3 * vocab // tp)


def rows_per_call(rows: int, bytes_per_row: int, budget_bytes: int) -> int:
    """The largest divisor of `rows` whose activations fit `budget_bytes` (at least 1: one row always runs)."""
    if rows < 1:
        raise ValueError(f"rows must be >= 1, got {rows}")
    fitting = max(1, budget_bytes // max(1, bytes_per_row))
    return max(d for d in range(1, rows + 1) if rows % d == 0 and d <= fitting)
