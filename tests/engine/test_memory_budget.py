"""Auto micro-batch sizes from the activation budget (mindrlhf.engine.memory_budget)."""
import pytest

from mindrlhf.engine.memory_budget import log_prob_bytes, rows_per_call, train_bytes

SMOLLM2 = dict(hidden=576, intermediate=1536, heads=9, vocab=49152)  # SmolLM2-135M, 30 layers
ARITH = dict(hidden=256, intermediate=672, heads=4, vocab=640)  # the bundled policy, 4 layers
GIB = 2**30


def test_rows_per_call_is_the_largest_divisor_that_fits():
    per_row = lambda rows: 100 * rows
    assert rows_per_call(16, per_row, budget_bytes=1600) == 16
    assert rows_per_call(16, per_row, budget_bytes=750) == 4  # 7 fit; 4 is the largest divisor <= 7
    assert rows_per_call(12, per_row, budget_bytes=1100) == 6
    assert rows_per_call(7, per_row, budget_bytes=600) == 1  # a prime: one row at a time
    assert rows_per_call(8, lambda rows: 10**12, budget_bytes=GIB) == 1  # one row always runs
    # a cost that is not linear in the rows (a shared prompt paid once a call)
    assert rows_per_call(8, lambda rows: 500 + 100 * rows, budget_bytes=1000) == 4
    with pytest.raises(ValueError, match="rows must be a positive multiple of 1"):
        rows_per_call(0, per_row, 1)
    # preference pairs stay whole: multiples of 2 only, at least one pair
    assert rows_per_call(12, per_row, budget_bytes=1100, unit=2) == 6
    assert rows_per_call(12, per_row, budget_bytes=500, unit=2) == 4
    assert rows_per_call(6, per_row, budget_bytes=100, unit=2) == 2
    with pytest.raises(ValueError, match="rows must be a positive multiple of 2, got 7"):
        rows_per_call(7, per_row, 1000, unit=2)


def test_train_estimate_matches_the_measured_cost_per_token_and_layer():
    # measured on the CPU backend, SmolLM2's shape, 30 layers, 223 tokens: a second row adds ~0.6 GB
    per_layer = train_bytes(1, 1, 160, 64, layers=2, **SMOLLM2) - train_bytes(1, 1, 160, 64, layers=1, **SMOLLM2)
    assert 80e3 < per_layer / 223 < 100e3
    assert 0.55e9 < train_bytes(1, 1, 160, 64, layers=30, **SMOLLM2) < 0.7e9
    # the logits and their softmax/gradient copies: 4 float32 [scored, vocab] buffers a response, whatever the layers
    no_head = dict(SMOLLM2, vocab=0)
    assert train_bytes(2, 2, 160, 64, layers=1, **SMOLLM2) - train_bytes(2, 2, 160, 64, layers=1, **no_head) == \
        2 * 64 * 4 * 4 * 49152


def test_a_shared_prompt_is_paid_once_a_call():
    alone = train_bytes(4, 4, 160, 48, layers=4, **ARITH)  # each response with its own copy of the prompt
    shared = train_bytes(1, 4, 160, 48, layers=4, **ARITH)
    one = train_bytes(1, 1, 160, 48, layers=4, **ARITH)
    assert alone == 4 * one
    # the prompt's 160 positions once instead of 4 times: the 4 responses cost less than 2 alone
    assert one < shared < 2 * one
    assert log_prob_bytes(1, 8, 160, 48, **ARITH) < log_prob_bytes(8, 8, 160, 48, **ARITH) / 2


def test_tensor_parallel_splits_what_is_split():
    whole = train_bytes(1, 1, 152, 48, layers=4, **ARITH)
    split = train_bytes(1, 1, 152, 48, layers=4, tp=2, **ARITH)
    hidden_part = 4 * 199 * 4 * 24 * 256  # replicated: the same on every tp rank
    assert hidden_part < split < whole
    assert log_prob_bytes(1, 1, 152, 48, tp=2, **ARITH) < log_prob_bytes(1, 1, 152, 48, **ARITH)


def test_defaults_keep_small_models_in_one_call_and_split_a_135m_model():
    budget = 1 * GIB  # schedule.activation_memory_gib's default
    arith = lambda fn, share, **kw: (lambda rows: fn(max(1, rows // share), rows, 160, 48, **kw, **ARITH))
    # bundled run: 160-token prompts + 48 new tokens, 8 responses per train rank (dp=2) or 16 (tp=2), 32 a rank in
    # the reference pass; with and without prefix sharing
    for share in (1, 8):
        assert rows_per_call(16, arith(train_bytes, share, layers=4, tp=2), budget) == 16
        assert rows_per_call(8, arith(train_bytes, share, layers=4), budget) == 8
        assert rows_per_call(32, arith(log_prob_bytes, share), budget) == 32
    # SmolLM2 on 2 ranks (dp=2), 2 prompts x 4: 4 responses a rank of 160 + 64 tokens
    smol = lambda fn, share, **kw: (lambda rows: fn(max(1, rows // share), rows, 160, 64, **kw, **SMOLLM2))
    assert rows_per_call(4, smol(train_bytes, 1, layers=30), budget) == 1
    assert rows_per_call(4, smol(log_prob_bytes, 1), budget) == 4
    assert rows_per_call(4, smol(log_prob_bytes, 4), budget) == 4
