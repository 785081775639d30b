"""Rows per graph call from an activation-memory budget: what a micro-batch size of 0 ("auto") resolves to.

Pure arithmetic on the model's shape. A graph call reads `prompts` prompts of width P and `rows` responses of width
R; each prompt is read once for its rows / prompts responses (prefix sharing: `prompts == rows` without it). The
per-token constants are measured, not derived: MindSpore's CPU backend keeps the activations a backward pass needs
plus several working buffers per op (SmolLM2-135M's shape, 30 layers, 223 tokens, 1 vs 2 rows: +0.6 GB a row,
~90 KB per token per layer in the train graph; the [tokens, vocab] float32 logits and their log-softmax, exp and
gradient ~4 copies). They overestimate a little on purpose: a run that fits is worth more than a few percent of
speed. What a graph holds besides activations (gradients, optimizer state, weights) is not in the budget.
"""
from __future__ import annotations

from collections.abc import Callable

FLOAT_BYTES = 4
# Recompute (activation checkpointing), measured on the CPU backend (benchmarks/memory_plan.py recompute: one GRPO
# train call at SmolLM2-135M's shape, rows of 64 + 192 tokens, peak RSS of the step): every layer fully recomputed
# saves 1.21 GiB with 4 rows and 0.30 GiB with 2 (the same loss and gradient norm), so it frees 0.72 of the bytes
# `train_bytes` counts for a layer a row and its bigger graph costs ~20 MiB a layer once (`memory_plan` counts that);
# every attention recomputed saves 0.13 GiB with 4 rows (vocab 49152 or 1024 alike). Most of a layer's train memory
# here is the backward's working buffers, which recompute does not remove.
FULL_RECOMPUTE_FREES = 0.72
SELECTIVE_RECOMPUTE_FREES = 0.05


def _tokens_and_attention(prompts: int, rows: int, prompt_width: int, read_width: int) -> tuple[int, int]:
    """(positions the layers read, attention scores per head) of a call whose responses read `read_width` positions
    each after their prompt: a prompt attends to itself, a response to its prompt and to itself."""
    tokens = prompts * prompt_width + rows * read_width
    scores = prompts * prompt_width ** 2 + rows * read_width * (prompt_width + read_width)
    return tokens, scores


def train_bytes(prompts: int, rows: int, prompt_width: int, response_width: int, hidden: int, intermediate: int,
                heads: int, layers: int, vocab: int, tp: int = 1, recomputed_layers: int = 0,
                selective_layers: int = 0) -> int:
    """Activation bytes of one train graph call (forward kept for backward + backward): `rows` responses of
    `response_width` tokens, each scored, read after `prompts` prompts of `prompt_width` tokens (the response's last
    token is scored but not read). `heads`, `intermediate` and `vocab` are split over `tp`.

    `recomputed_layers` of the `layers` recompute fully in the backward (`Cell.recompute()` on the decoder layer),
    `selective_layers` their attention only: each frees the measured share of its bytes (`FULL_RECOMPUTE_FREES`,
    `SELECTIVE_RECOMPUTE_FREES`). Together at most `layers`."""
    if not 0 <= recomputed_layers + selective_layers <= layers or min(recomputed_layers, selective_layers) < 0:
        raise ValueError(f"recomputed_layers={recomputed_layers} + selective_layers={selective_layers} must be "
                         f"between 0 and layers={layers}")
    tokens, scores = _tokens_and_attention(prompts, rows, prompt_width, response_width - 1)
    per_layer = tokens * (24 * hidden + 3 * intermediate // tp) + 2 * (heads // tp) * scores
    kept = layers - FULL_RECOMPUTE_FREES * recomputed_layers - SELECTIVE_RECOMPUTE_FREES * selective_layers
    return FLOAT_BYTES * (int(kept * per_layer) + rows * response_width * 4 * vocab // tp)


def log_prob_bytes(prompts: int, rows: int, prompt_width: int, response_width: int, hidden: int, intermediate: int,
                   heads: int, vocab: int, tp: int = 1) -> int:
    """Activation bytes of one forward-only log-prob graph call (buffers are reused from layer to layer, so one
    layer's working set counts, plus the scored positions' logits); arguments as :func:`train_bytes`."""
    tokens, scores = _tokens_and_attention(prompts, rows, prompt_width, response_width - 1)
    per_layer = tokens * (24 * hidden + 4 * intermediate // tp) + 3 * (heads // tp) * scores
    return FLOAT_BYTES * (per_layer + rows * response_width * 3 * vocab // tp)


def rows_per_call(rows: int, call_bytes: Callable[[int], int], budget_bytes: int, unit: int = 1) -> int:
    """The largest divisor d of `rows`, a multiple of `unit` (rows that must stay in one call: a preference pair),
    whose call of d rows fits `budget_bytes` (`call_bytes(d)`; at least `unit`: one unit always runs)."""
    if rows < 1 or rows % unit:
        raise ValueError(f"rows must be a positive multiple of {unit}, got {rows}")
    fitting = [d for d in range(unit, rows + 1, unit) if rows % d == 0 and call_bytes(d) <= budget_bytes]
    return max(fitting, default=unit)
