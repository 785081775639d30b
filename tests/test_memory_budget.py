"""Auto micro-batch sizes from the activation budget (mindrlhf.trainer.memory_budget)."""
import pytest

from mindrlhf.trainer.memory_budget import log_prob_bytes_per_row, rows_per_call, train_bytes_per_row

SMOLLM2 = dict(hidden=576, intermediate=1536, heads=9, vocab=49152)  # SmolLM2-135M, 30 layers
ARITH = dict(hidden=256, intermediate=672, heads=4, vocab=640)  # the bundled policy, 4 layers
GIB = 2**30


def test_rows_per_call_is_the_largest_divisor_that_fits():
    assert rows_per_call(16, bytes_per_row=100, budget_bytes=1600) == 16
    assert rows_per_call(16, bytes_per_row=100, budget_bytes=750) == 4  # 7 fit; 4 is the largest divisor <= 7
    assert rows_per_call(12, bytes_per_row=100, budget_bytes=1100) == 6
    assert rows_per_call(7, bytes_per_row=100, budget_bytes=600) == 1  # a prime: one row at a time
    assert rows_per_call(8, bytes_per_row=10**12, budget_bytes=GIB) == 1  # one row always runs
    with pytest.raises(ValueError, match="rows must be >= 1"):
        rows_per_call(0, 1, 1)


def test_train_estimate_matches_the_measured_cost_per_token_and_layer():
    # measured on the CPU backend, SmolLM2's shape, 30 layers, 223 tokens: a second row adds ~0.6 GB
    per_layer = train_bytes_per_row(223, 0, layers=2, **SMOLLM2) - train_bytes_per_row(223, 0, layers=1, **SMOLLM2)
    assert 80e3 < per_layer / 223 < 100e3
    assert 0.55e9 < train_bytes_per_row(223, 64, layers=30, **SMOLLM2) < 0.7e9
    # the logits and their softmax/gradient copies: 4 float32 [scored, vocab] buffers
    assert train_bytes_per_row(224, 64, layers=1, **SMOLLM2) - train_bytes_per_row(224, 0, layers=1, **SMOLLM2) == \
        4 * 64 * 4 * 49152


def test_tensor_parallel_splits_what_is_split():
    whole = train_bytes_per_row(200, 48, layers=4, **ARITH)
    split = train_bytes_per_row(200, 48, layers=4, tp=2, **ARITH)
    hidden_part = 4 * 200 * 4 * 24 * 256  # replicated: the same on every tp rank
    assert hidden_part < split < whole
    assert log_prob_bytes_per_row(200, 48, tp=2, **ARITH) < log_prob_bytes_per_row(200, 48, **ARITH)


def test_defaults_keep_small_models_in_one_call_and_split_a_135m_model():
    budget = 1 * GIB  # schedule.activation_memory_gib's default
    # bundled run: 160-token prompts + 48 new tokens, 16 responses per train rank (tp=2) or 8 (dp=2)
    assert rows_per_call(16, train_bytes_per_row(207, 48, layers=4, tp=2, **ARITH), budget) == 16
    assert rows_per_call(8, train_bytes_per_row(207, 48, layers=4, **ARITH), budget) == 8
    assert rows_per_call(32, log_prob_bytes_per_row(207, 48, **ARITH), budget) == 32
    # SmolLM2 on 2 ranks (dp=2), 2 prompts x 4: 4 responses a rank of 160 + 64 tokens
    assert rows_per_call(4, train_bytes_per_row(223, 64, layers=30, **SMOLLM2), budget) == 1
    assert rows_per_call(4, log_prob_bytes_per_row(223, 64, **SMOLLM2), budget) == 4
