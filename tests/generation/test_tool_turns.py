"""Multi-turn rollouts with tools (#67) on a tiny random Qwen2 (GRAPH_MODE): the KV cache after an extend equals a
fresh prefill of the same tokens; the rollout pauses a row at a turn that calls a tool, appends the tool's turn and
resumes, on the fixed batch, the slots and the step-down paths alike."""
import numpy as np
import pytest

ms = pytest.importorskip("mindspore")

from support.tool_handlers import CountingTool  # noqa: E402

from mindrlhf.configs.generation import GenerationConfig  # noqa: E402
from mindrlhf.generation import Generator  # noqa: E402
from mindrlhf.models.qwen2 import KVCache, Qwen2Config, Qwen2ForCausalLM  # noqa: E402
from mindrlhf.parallel.layers import load_full_state, random_full_state  # noqa: E402

MODEL = dict(vocab_size=128, hidden_size=32, num_layers=2, num_heads=4, n_kv_heads=2, intermediate_size=64,
             seq_length=128)

pytestmark = pytest.mark.usefixtures("graph_mode")


@pytest.fixture(scope="module")
def model():
    net = Qwen2ForCausalLM(Qwen2Config(**MODEL))
    state = random_full_state(net, seed=1234)
    state["lm_head.weight"] *= 2.0
    load_full_state(net, state)
    return net


def cache_tokens(cache: KVCache, layer_caches, row: int, slots: np.ndarray) -> np.ndarray:
    """The cached keys or values [kv_heads, len(slots), head_dim] of one row at `slots`."""
    return layer_caches.asnumpy().reshape(cache.shape)[row][:, slots]


def test_the_cache_after_an_extend_equals_a_fresh_prefill_of_the_same_tokens(model):
    """Rows prefilled from prompts of different lengths (left-padded), decoded a step, then extended by different
    numbers of tokens: row 0 by 3 in a window at its next slot, row 1 by 5 in a window shifted left (its next slot is
    within W of the cache's end), row 2 not at all. The extended rows' logits and every cached key and value equal
    those of one prefill of [prompt | decoded | extension]; row 2's cache is untouched and its decode goes on."""
    rng = np.random.default_rng(0)
    batch, bucket, length, width = 3, 8, 24, 8
    lengths = np.array([5, 8, 3])
    prompts = np.zeros((batch, bucket), np.int32)
    mask = np.zeros((batch, bucket), np.int32)
    for b, n in enumerate(lengths):
        prompts[b, bucket - n:] = rng.integers(1, 128, n)
        mask[b, bucket - n:] = 1
    cache = KVCache(model, batch, length)
    logits = cache.prefill(ms.Tensor(prompts), ms.Tensor(mask), *cache.rows_of(0, batch)).asnumpy()
    valid = np.zeros((batch, length), np.float32)
    valid[:, :bucket] = mask
    # row 1 has decoded 9 tokens (slots 8..16), the others one (slot 8): decode them one at a time, as a rollout does
    decoded = [[int(logits[b].argmax())] for b in range(batch)]
    for step in range(9):
        valid[:, bucket] = 1.0
        valid[1, bucket + step] = 1.0
        rows = [1] if step else [0, 1, 2]
        tokens = np.array([decoded[b][-1] for b in range(batch)], np.int32)
        slots = np.array([bucket + len(decoded[b]) - 1 for b in range(batch)], np.int32)
        positions = np.array([lengths[b] + len(decoded[b]) - 1 for b in range(batch)], np.int32)
        out = cache.decode(ms.Tensor(tokens[:, None]), ms.Tensor(positions[:, None]), ms.Tensor(slots),
                           ms.Tensor(valid)).asnumpy()
        for b in rows:
            decoded[b].append(int(out[b].argmax()))
    # now row b's trajectory holds decoded[b]; the cache holds all of it but the last token (it is fed next)
    assert [len(d) for d in decoded] == [2, 10, 2]
    extension = {0: rng.integers(1, 128, 3).tolist(), 1: rng.integers(1, 128, 5).tolist()}
    fed = {b: [decoded[b][-1]] + extension[b] for b in extension}  # the last token, then the tool's turn
    next_slot = {b: bucket + len(decoded[b]) - 1 for b in range(batch)}
    window = {b: min(next_slot[b], length - width) for b in range(batch)}
    assert window[1] < next_slot[1] and window[0] == next_slot[0]  # row 1's window is shifted left
    tokens = np.zeros((batch, width), np.int32)
    positions = np.zeros((batch, width), np.int32)
    written = np.zeros((batch, width), np.float32)
    last = np.zeros(batch, np.int32)
    window_start = np.array([window[b] for b in range(batch)], np.int32)
    for b, ids in fed.items():
        first = next_slot[b] - window[b]
        tokens[b, first:first + len(ids)] = ids
        written[b, first:first + len(ids)] = 1.0
        positions[b] = np.clip(lengths[b] + window[b] - bucket + np.arange(width), 0, MODEL["seq_length"] - 1)
        valid[b, next_slot[b]:next_slot[b] + len(ids)] = 1.0
        last[b] = first + len(ids) - 1
    before = [cache_tokens(cache, cache.key_caches[0], 2, np.arange(length)).copy()]
    logits = cache.extend(ms.Tensor(tokens), ms.Tensor(positions), ms.Tensor(window_start), ms.Tensor(written),
                          ms.Tensor(valid), ms.Tensor(last)).asnumpy()
    np.testing.assert_array_equal(cache_tokens(cache, cache.key_caches[0], 2, np.arange(length)), before[0])
    for b in fed:
        sequence = list(prompts[b, bucket - lengths[b]:]) + decoded[b] + extension[b]
        fresh = KVCache(model, 1, length)
        width_fresh = bucket + len(decoded[b]) + len(extension[b])
        ids_fresh = np.zeros((1, width_fresh), np.int32)
        mask_fresh = np.zeros((1, width_fresh), np.int32)
        ids_fresh[0, bucket - lengths[b]:], mask_fresh[0, bucket - lengths[b]:] = sequence, 1
        fresh_logits = fresh.prefill(ms.Tensor(ids_fresh), ms.Tensor(mask_fresh), *fresh.rows_of(0, 1)).asnumpy()
        np.testing.assert_allclose(logits[b], fresh_logits[0], atol=1e-5, err_msg=f"row {b}'s logits")
        real = np.flatnonzero(valid[b])
        assert real.size == width_fresh - (bucket - lengths[b])
        for ours, theirs in ((cache.key_caches, fresh.key_caches), (cache.value_caches, fresh.value_caches)):
            for layer in range(MODEL["num_layers"]):
                np.testing.assert_allclose(cache_tokens(cache, ours[layer], b, real),
                                           cache_tokens(fresh, theirs[layer], 0, real), atol=1e-5,
                                           err_msg=f"row {b}, layer {layer}")
    assert np.abs(logits[:2]).max() > 0.1


PROMPTS = [[5, 9, 17], [3, 1, 4, 1, 5, 9, 2], [7, 7] + list(range(20, 30))]
EOS = list(range(1, 128, 7))  # 19 of 128 ids: turns end after a few tokens


def tool_config(**overrides) -> GenerationConfig:
    base = dict(max_new_tokens=12, num_generations=4, do_sample=True, temperature=1.5, eos_token_ids=EOS,
                pad_token_id=0, prompt_buckets=[8, 16], seed=5, max_tool_calling_iterations=2,
                max_tool_response_tokens=6)
    return GenerationConfig(**{**base, **overrides})


@pytest.fixture(scope="module")
def tool_generator(model):
    return Generator(model, tool_config(), tools=CountingTool())


def rollout(generator, **overrides):
    generator.config = tool_config(**overrides)
    generator.tools = CountingTool()
    return generator.generate(PROMPTS, return_log_probs=True), generator.tools


def test_a_rollout_with_tool_turns_reads_each_answer_and_trains_only_the_models_tokens(model, tool_generator):
    """Samples pause at a turn the handler answers, get its tokens (tool_mask 1, log-prob 0) and decode on: every
    model token's log-prob is the full forward's over [prompt | trajectory] at that position (the extend wrote the
    answers into the cache as a prefill would), the answers are the handler's for the turn before them, at most
    max_tool_calling_iterations tool turns and max_new_tokens model tokens a sample."""
    out, handler = rollout(tool_generator)
    width = 12 + 2 * 6
    assert out.response_ids.shape == out.tool_mask.shape == (12, width)
    turns = (np.diff(np.concatenate([np.zeros((12, 1), np.int32), out.tool_mask], 1), axis=1) == 1).sum(1)
    assert set(turns.tolist()) >= {0, 1, 2}  # the case needs samples with no, one and two tool turns
    model_tokens = out.response_mask * (1 - out.tool_mask)
    assert model_tokens.sum(1).max() <= 12 and (out.tool_mask <= out.response_mask).all()
    assert out.stats["tool_turns"] == turns.sum() == sum(len(c) for c in out.tool_calls)
    assert out.stats["response_tokens"] == model_tokens.sum()
    assert (out.log_probs[out.tool_mask == 1] == 0).all()
    ids, mask = out.sequences()
    bucket = out.prompt_ids.shape[1]
    logits = model(ms.Tensor(ids), ms.Tensor(mask)).asnumpy()[:, bucket - 1:-1] / 1.5
    logits = logits - logits.max(-1, keepdims=True)
    expected = np.take_along_axis(logits - np.log(np.exp(logits).sum(-1, keepdims=True)),
                                  out.response_ids[..., None].astype(np.int64), -1)[..., 0]
    trained = model_tokens == 1
    np.testing.assert_allclose(out.log_probs[trained], expected[trained], atol=2e-5)
    for s in np.flatnonzero(turns):
        row, tools = out.response_ids[s], out.tool_mask[s]
        starts = np.flatnonzero(np.diff(np.concatenate([[0], tools])) == 1)
        for start in starts:
            end = start + np.argmin(np.concatenate([tools[start:], [0]]))
            turn_start = 0 if start == starts[0] else np.flatnonzero(tools[:start])[-1] + 1
            answer = handler.respond([row[turn_start:start]])[0]
            assert row[start:end].tolist() == answer.tokens


@pytest.mark.parametrize("paths", [{"max_num_seqs": 5}, {"min_decode_rows": 2}, {"max_num_seqs": 5,
                                                                                  "min_decode_rows": 2}],
                         ids=["slots", "step-down", "slots-step-down"])
def test_tool_turns_on_slots_and_step_down_give_the_fixed_batchs_trajectories(tool_generator, paths):
    fixed, _ = rollout(tool_generator)
    other, _ = rollout(tool_generator, **paths)
    np.testing.assert_array_equal(other.response_ids, fixed.response_ids)
    np.testing.assert_array_equal(other.tool_mask, fixed.tool_mask)
    np.testing.assert_array_equal(other.response_mask, fixed.response_mask)
    np.testing.assert_allclose(other.log_probs, fixed.log_probs, atol=1e-5)
    assert other.tool_calls == fixed.tool_calls
    assert tool_generator.compile_counts()["extend"] >= 1
