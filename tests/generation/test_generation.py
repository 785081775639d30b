"""Generation with the static KV cache (GRAPH_MODE, tiny random Qwen2): greedy against a python loop of full
forwards, cache vs no cache, EOS handling, log-probs against the full forward, seeded sampling, the
top-k/top-p filters on small arrays, the n-samples-per-prompt layout, compile counts, config errors."""
import dataclasses

import numpy as np
import pytest

ms = pytest.importorskip("mindspore")

from mindrlhf.configs.base import ConfigError, from_mapping  # noqa: E402
from mindrlhf.configs.generation import GenerationConfig  # noqa: E402
from mindrlhf.generation import (  # noqa: E402
    Generator,
    nucleus_mask,
    sample_tokens,
    token_log_probs,
    top_k_candidates,
    top_k_filter,
    top_p_filter,
)
from mindrlhf.generation.sampling import categorical, log_softmax, min_p_filter  # noqa: E402
from mindrlhf.models.qwen2 import Qwen2Config, Qwen2ForCausalLM  # noqa: E402
from mindrlhf.parallel.layers import load_full_state, random_full_state  # noqa: E402

MODEL = dict(vocab_size=128, hidden_size=32, num_layers=2, num_heads=4, n_kv_heads=2, intermediate_size=64,
             seq_length=128)
PAD = 0
NEW = 6
PROMPTS = [[5, 9, 17], [3, 1, 4, 1, 5, 9, 2], [7, 7] + list(range(20, 30))]  # lengths 3, 7, 12 -> bucket 16


pytestmark = pytest.mark.usefixtures("graph_mode")


@pytest.fixture(scope="module")
def model():
    net = Qwen2ForCausalLM(Qwen2Config(**MODEL))
    state = random_full_state(net, seed=1234)
    state["lm_head.weight"] *= 2.0  # logits with a spread of a few nats: peaked, but not one-hot
    load_full_state(net, state)
    return net


def gen_config(**overrides) -> GenerationConfig:
    base = dict(max_new_tokens=NEW, num_generations=1, do_sample=False, eos_token_ids=[], pad_token_id=PAD,
                prompt_buckets=[8, 16], seed=0)
    return GenerationConfig(**{**base, **overrides})


@pytest.fixture(scope="module")
def generator(model):
    """One Generator shared by the tests (its config is replaced per test) so graphs compile once."""
    return Generator(model, gen_config())


def run(generator, prompts=PROMPTS, return_log_probs=False, **overrides):
    generator.config = gen_config(**overrides)
    return generator.generate(prompts, return_log_probs=return_log_probs)


def full_logits(model, ids, mask) -> np.ndarray:
    return model(ms.Tensor(ids.astype(np.int32)), ms.Tensor(mask.astype(np.int32))).asnumpy()


def reference_greedy(model, prompts, steps) -> np.ndarray:
    """argmax decoding by a python loop of full forwards, prompts left-padded to the longest (not to a bucket)."""
    longest = max(len(p) for p in prompts)
    ids = np.full((len(prompts), longest + steps), PAD, np.int32)
    mask = np.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, longest - len(p):longest] = p
        mask[i, longest - len(p):longest] = 1
    for t in range(steps):
        token = full_logits(model, ids, mask)[:, longest + t - 1].argmax(-1)
        ids[:, longest + t] = token
        mask[:, longest + t] = 1
    return ids[:, longest:]


# ------------------------------------------------------------------ greedy, cache, EOS


@pytest.mark.slow
def test_greedy_matches_full_forward_loop(model, generator):
    out = run(generator)
    np.testing.assert_array_equal(out.response_ids, reference_greedy(model, PROMPTS, NEW))
    assert out.prompt_ids.shape == (3, 16) and out.response_ids.shape == (3, NEW)
    np.testing.assert_array_equal(out.prompt_mask.sum(1), [3, 7, 12])
    np.testing.assert_array_equal(out.prompt_ids[0, -3:], PROMPTS[0])
    assert (out.prompt_ids[0, :-3] == PAD).all() and (out.prompt_mask[0, :-3] == 0).all()
    assert (out.response_mask == 1).all()
    np.testing.assert_array_equal(out.response_lengths, [NEW] * 3)
    assert len(set(out.response_ids.ravel().tolist())) > 3, "logits too flat: the test would prove little"


@pytest.mark.slow
def test_min_prompt_width_picks_a_wider_common_bucket(model, generator):
    # data-parallel ranks share the global batch's width: short local prompts still use the wider bucket
    generator.config = gen_config()
    narrow = generator.generate(PROMPTS[:1])
    wide = generator.generate(PROMPTS[:1], min_prompt_width=12)
    assert narrow.prompt_ids.shape == (1, 8) and wide.prompt_ids.shape == (1, 16)
    np.testing.assert_array_equal(wide.response_ids, narrow.response_ids)


@pytest.mark.parametrize("sampling", [False, True], ids=["greedy", "sampled"])
def test_without_kv_cache_identical(generator, sampling):
    kw = dict(do_sample=sampling, temperature=1.0, seed=7)
    cached = run(generator, return_log_probs=True, **kw)
    uncached = run(generator, return_log_probs=True, use_kv_cache=False, **kw)
    np.testing.assert_array_equal(cached.response_ids, uncached.response_ids)
    np.testing.assert_allclose(cached.log_probs, uncached.log_probs, atol=1e-5)


def test_prompt_array_with_mask_equals_lists(generator):
    expected = run(generator).response_ids
    width = 14
    left = np.full((3, width), 99, np.int64)  # pad value is irrelevant where the mask is 0
    right = np.full((3, width), 99, np.int64)
    mask_left, mask_right = np.zeros_like(left), np.zeros_like(right)
    for i, p in enumerate(PROMPTS):
        left[i, width - len(p):], mask_left[i, width - len(p):] = p, 1
        right[i, :len(p)], mask_right[i, :len(p)] = p, 1
    for ids, mask in ((left, mask_left), (right, mask_right)):
        np.testing.assert_array_equal(generator.generate(ids, mask).response_ids, expected)


def test_eos_ends_response_and_pads_after(generator):
    free = run(generator).response_ids
    row = 1
    step = next(t for t in range(1, NEW - 1) if free[row, t] not in free[row, :t])  # a first occurrence
    eos = int(free[row, step])
    out = run(generator, eos_token_ids=[eos])
    for r in range(3):
        hits = np.flatnonzero(free[r] == eos)
        end = hits[0] + 1 if hits.size else NEW
        np.testing.assert_array_equal(out.response_ids[r, :end], free[r, :end])
        assert (out.response_ids[r, end:] == PAD).all()
        np.testing.assert_array_equal(out.response_mask[r], (np.arange(NEW) < end).astype(np.int32))
        assert out.response_lengths[r] == end
    assert out.response_lengths[row] == step + 1 < NEW and out.response_ids[row, step] == eos


def test_stops_when_every_row_has_ended(generator):
    first = run(generator).response_ids[:, 0]
    out = run(generator, eos_token_ids=sorted(set(first.tolist())))
    assert out.stats["steps"] == 1
    np.testing.assert_array_equal(out.response_lengths, [1, 1, 1])
    assert (out.response_ids[:, 1:] == PAD).all()


@pytest.mark.parametrize("do_sample", [False, True], ids=["greedy", "sampled"])
def test_slots_refilled_mid_rollout_give_the_fixed_batchs_samples(generator, do_sample):
    """3 prompts x 4 samples through 5 slots (`max_num_seqs`): samples end at an EOS at different steps and their
    slots take the waiting ones (a prompt prefilled into the free slots), each slot at its own position. Every
    response and mask equals the fixed batch's token for token, and the log-probs within float rounding: each
    sample draws the same uniforms whatever slot it runs in."""
    kw = dict(num_generations=4, max_new_tokens=12, do_sample=do_sample, temperature=1.5, seed=4)
    free = run(generator, **kw).response_ids
    tokens, counts = np.unique(free[:, 1:6], return_counts=True)
    eos = int(tokens[np.argmax(counts)])  # frequent early: responses end at different steps
    fixed = run(generator, return_log_probs=True, eos_token_ids=[eos], **kw)
    fixed_stats = fixed.stats
    slots = run(generator, return_log_probs=True, eos_token_ids=[eos], max_num_seqs=5, **kw)
    lengths = fixed.response_lengths
    assert lengths.min() < 12 and len(set(lengths.tolist())) > 2  # the case needs ends at several steps
    np.testing.assert_array_equal(slots.response_ids, fixed.response_ids)
    np.testing.assert_array_equal(slots.response_mask, fixed.response_mask)
    np.testing.assert_allclose(slots.log_probs, fixed.log_probs, atol=1e-5)
    assert slots.stats["rows"] == 5 and fixed_stats["rows"] == 12
    # decode work: every fixed-batch call computes 12 rows until the longest response ends; a slots call at most 5
    decoded = lengths.sum() - 12  # each sample's first token comes from a prefill call
    assert fixed_stats["idle_row_share"] == pytest.approx(1 - decoded / (12 * (lengths.max() - 1)))
    assert slots.stats["steps"] >= decoded / 5
    assert slots.stats["idle_row_share"] == pytest.approx(1 - decoded / (5 * slots.stats["steps"]))
    assert generator.cache(5).batch_size == 5  # the slots' cache: 5 rows, not 12
    prefills = {sig[-4] for sig in generator.first_call_seconds if sig[0] == "prefill" and sig[1] == 5}
    assert prefills == {(1, 16)}  # one prompt a prefill call, into the slots its samples take


@pytest.mark.parametrize("max_num_seqs", [0, 5], ids=["fixed-batch", "slots"])
def test_stepping_down_for_the_tail_gives_the_same_samples_in_fewer_rows(generator, max_num_seqs):
    """3 prompts x 4 samples with `min_decode_rows` 2: once the running responses fit in fewer rows (12 -> 6 -> 3 -> 2,
    or 5 slots -> 3 -> 2 once no sample waits), their KV rows move into a smaller cache and decoding goes on there.
    Responses, masks and log-probs equal the fixed batch's (each sample keeps its uniforms); the decode calls
    compute fewer rows, and each row count compiles one decode graph and one move."""
    kw = dict(num_generations=4, max_new_tokens=12, do_sample=True, temperature=1.5, seed=8,
              max_num_seqs=max_num_seqs)
    free = run(generator, **{**kw, "max_num_seqs": 0}).response_ids
    tokens, counts = np.unique(free[:, 1:6], return_counts=True)
    eos = tokens[np.argsort(-counts)[:3]].tolist()  # frequent early: responses end at many steps
    whole = run(generator, return_log_probs=True, eos_token_ids=eos, **kw)
    whole_stats = whole.stats
    moves = generator.compile_counts()["move"]
    down = run(generator, return_log_probs=True, eos_token_ids=eos, min_decode_rows=2, **kw)
    lengths = np.sort(whole.response_lengths)
    assert lengths[5] < 8 and lengths[9] < 11 and lengths[-1] == 12  # 6, then 2 still running near the end
    np.testing.assert_array_equal(down.response_ids, whole.response_ids)
    np.testing.assert_array_equal(down.response_mask, whole.response_mask)
    np.testing.assert_allclose(down.log_probs, whole.log_probs, atol=1e-5)
    decoded = lengths.sum() - 12
    stats = down.stats
    assert stats["computed_rows"] < whole_stats["computed_rows"]
    assert stats["idle_row_share"] == pytest.approx(1 - decoded / stats["computed_rows"])
    assert stats["idle_rows"] == stats["computed_rows"] - decoded  # what the trainer sums over a step's rollouts
    assert stats["idle_row_share"] < whole_stats["idle_row_share"]
    counts = [12, 6, 3, 2] if max_num_seqs == 0 else [5, 3, 2]
    assert GenerationConfig(min_decode_rows=2).decode_row_counts(counts[0]) == counts
    # a row count the tail reached has its cache and decode graph; the ladder's steps each compiled a move
    reached = {sig[1] for sig in generator.first_call_seconds if sig[0] == "decode"}
    assert counts[-1] in reached and generator.compile_counts()["move"] > moves


@pytest.mark.parametrize("rows,minimum,ratio,counts", [
    (32, 4, 0.5, [32, 16, 8, 4]), (12, 2, 0.5, [12, 6, 3, 2]), (16, 1, 0.67, [16, 11, 8, 6, 5, 4, 3, 2, 1]),
    (10, 1, 0.6, [10, 6, 4, 3, 2, 1]),  # 0.6 x 10 is 6.000000000000001 in floats: 6, not 7
    (8, 1, 0.9, [8, 7, 6, 5, 4, 3, 2, 1]),  # at least one row fewer a step
    (8, 3, 0.25, [8, 3]), (8, 0, 0.67, [8]), (4, 4, 0.5, [4]),
])
def test_the_step_down_ladder_is_each_count_times_the_ratio_rounded_up(rows, minimum, ratio, counts):
    assert GenerationConfig(min_decode_rows=minimum, step_down_ratio=ratio).decode_row_counts(rows) == counts


def letters(ids) -> str:
    """A toy detokenizer of the tiny vocabulary: token i is one or two copies of a letter."""
    return "".join("abcdefgh"[i % 8] * (1 + i // 8 % 2) for i in map(int, ids))


def first_completion(tokens, stop: str) -> int | None:
    """The length of the shortest prefix of `tokens` whose text holds `stop` (None: none does)."""
    return next((k for k in range(1, len(tokens) + 1) if stop in letters(tokens[:k])), None)


@pytest.mark.parametrize("paths", [{}, {"max_num_seqs": 5}, {"min_decode_rows": 2}, {"use_kv_cache": False}],
                         ids=["fixed-batch", "slots", "step-down", "no-cache"])
def test_a_stop_string_ends_a_response_at_the_token_that_completes_it(model, generator, paths):
    """Each response is the one sampled without the stop string, cut after the first token whose text completes it
    (kept, as an EOS is; padded after), with the same log-probs, on every decode path: a stopped sample frees its
    slot for a waiting one, and the tail steps down past it."""
    kw = dict(num_generations=4, max_new_tokens=12, do_sample=True, temperature=1.5, seed=8)
    free = run(generator, return_log_probs=True, **kw)
    texts = [letters(row) for row in free.response_ids]
    pairs = {text[i:i + 2] for text in texts for i in range(len(text) - 1)}
    stop = max(sorted(pairs), key=lambda p: sum(p in text[4:] and p not in text[:6] for text in texts))
    stopper = Generator(model, gen_config(), graphs=generator.graphs, detokenize=letters)
    stopper.config = gen_config(stop_strings=[stop], **kw, **paths)
    out = stopper.generate(PROMPTS, return_log_probs=True)
    ends = [first_completion(row, stop) or 12 for row in free.response_ids]
    assert len({e for e in ends if e < 12}) >= 3 and max(ends) == 12  # several ends, and one that never stops
    for r, end in enumerate(ends):
        np.testing.assert_array_equal(out.response_ids[r, :end], free.response_ids[r, :end])
        assert (out.response_ids[r, end:] == PAD).all() and out.response_lengths[r] == end
        np.testing.assert_allclose(out.log_probs[r, :end], free.log_probs[r, :end], atol=1e-5)
        assert (out.log_probs[r, end:] == 0).all()


def test_stop_strings_need_the_text_of_the_responses(model):
    with pytest.raises(ConfigError, match="generation.stop_strings.*detokenize"):
        Generator(model, gen_config(stop_strings=["ab"]))


def test_a_prefill_budget_prefills_fewer_prompts_a_call_with_the_same_samples(generator):
    """3 prompts of bucket 16 with `max_num_batched_tokens` 40: two would take 32 positions but do not divide 3, so one
    a call; the samples are the whole batch's."""
    kw = dict(num_generations=2, do_sample=True, temperature=1.5, seed=3)
    whole = run(generator, return_log_probs=True, **kw)
    chunked = run(generator, return_log_probs=True, max_num_batched_tokens=40, **kw)
    np.testing.assert_array_equal(chunked.response_ids, whole.response_ids)
    np.testing.assert_allclose(chunked.log_probs, whole.log_probs, atol=1e-5)
    prefills = {sig[-4] for sig in generator.first_call_seconds if sig[0] == "prefill" and sig[1] == 6}
    assert prefills == {(3, 16), (1, 16)}


@pytest.mark.parametrize("prompts,bucket,budget,per_call", [
    (8, 72, 0, 8), (8, 72, 300, 4), (6, 72, 300, 3), (5, 72, 300, 1), (8, 72, 72, 1), (8, 72, 10_000, 8)])
def test_prefill_prompts_is_the_largest_divisor_within_the_budget(prompts, bucket, budget, per_call):
    config = gen_config(max_num_batched_tokens=budget, prompt_buckets=[bucket])
    assert config.prefill_prompts(prompts, bucket) == per_call


def test_as_many_slots_as_rows_is_the_fixed_batch(generator):
    fixed = run(generator, num_generations=2, do_sample=True, seed=9)
    same = run(generator, num_generations=2, do_sample=True, seed=9, max_num_seqs=6)
    np.testing.assert_array_equal(same.response_ids, fixed.response_ids)
    assert same.stats["rows"] == 6


# ----------------------------------------------------------------------- log-probs


@pytest.mark.parametrize("temperature,do_sample", [(1.0, True), (0.7, True), (0.7, False)],
                         ids=["T1", "T0.7", "greedy"])
def test_log_probs_match_full_forward(model, generator, temperature, do_sample):
    """log_probs = log_softmax(logits / T) of the full forward at the chosen tokens (T = 1 when greedy)."""
    out = run(generator, return_log_probs=True, do_sample=do_sample, temperature=temperature, seed=3)
    ids, mask = out.sequences()
    prompt_len = out.prompt_ids.shape[1]
    logits = full_logits(model, ids, mask)[:, prompt_len - 1:-1]  # position P-1+t predicts response token t
    used_temperature = temperature if do_sample else 1.0
    expected = np.take_along_axis(log_softmax(logits / used_temperature), out.response_ids[..., None].astype(np.int64),
                                  axis=-1)[..., 0]
    assert out.log_probs.dtype == np.float32
    np.testing.assert_allclose(out.log_probs, expected, atol=1e-5)


# ----------------------------------------------------------------------- sampling


def test_seeded_sampling_reproducible(generator):
    kw = dict(do_sample=True, temperature=1.0)
    a = run(generator, seed=11, **kw).response_ids
    a_next = generator.generate(PROMPTS).response_ids  # the stream advances across calls
    b = run(generator, seed=11, **kw).response_ids
    c = run(generator, seed=12, **kw).response_ids
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, a_next)
    assert not np.array_equal(a, c)
    generator.reseed(11)
    np.testing.assert_array_equal(generator.generate(PROMPTS).response_ids, a)


@pytest.mark.parametrize("filters", [dict(top_k=1), dict(top_p=1e-6), dict(top_k=3, top_p=1e-6)],
                         ids=["top_k=1", "top_p=1e-6", "both"])
def test_degenerate_filters_equal_greedy(generator, filters):
    greedy = run(generator).response_ids
    sampled = run(generator, do_sample=True, temperature=1.5, seed=5, **filters).response_ids
    np.testing.assert_array_equal(sampled, greedy)


@pytest.mark.slow
def test_samples_per_prompt_layout(generator):
    prompts = PROMPTS[:2]
    out = run(generator, prompts, num_generations=3, do_sample=True, temperature=1.5, seed=2)
    assert out.response_ids.shape == (6, NEW)
    for j, prompt in enumerate(prompts):
        for i in range(3):
            row = j * 3 + i
            np.testing.assert_array_equal(out.prompt_ids[row][out.prompt_mask[row] == 1], prompt)
        assert len({tuple(r) for r in out.response_ids[j * 3:(j + 1) * 3]}) > 1, "samples of a group all equal"
    greedy = run(generator, prompts, num_generations=3)
    for j in range(2):
        group = greedy.response_ids[j * 3:(j + 1) * 3]
        assert (group == group[0]).all()


# ------------------------------------------------------- pure filters and sampling (numpy)


def test_top_k_filter_and_candidates():
    logits = np.array([[0.1, 3.0, -1.0, 2.0, 0.5], [5.0, 4.0, 3.0, 2.0, 1.0]], np.float32)
    out = top_k_filter(logits, 2)
    np.testing.assert_array_equal(np.isfinite(out), [[0, 1, 0, 1, 0], [1, 1, 0, 0, 0]])
    np.testing.assert_array_equal(out[np.isfinite(out)], [3.0, 2.0, 5.0, 4.0])
    np.testing.assert_array_equal(top_k_filter(logits, 0), logits)
    np.testing.assert_array_equal(top_k_filter(logits, 5), logits)
    values, indices = top_k_candidates(logits, 3)
    np.testing.assert_array_equal(indices, [[1, 3, 4], [0, 1, 2]])
    np.testing.assert_array_equal(values, [[3.0, 2.0, 0.5], [5.0, 4.0, 3.0]])


@pytest.mark.parametrize("top_p,kept", [(1e-6, 1), (0.45, 1), (0.75, 2), (0.85, 3), (0.97, 4), (1.0, 4)])
def test_top_p_filter_keeps_smallest_nucleus(top_p, kept):
    probs = np.array([0.15, 0.5, 0.05, 0.3])  # sorted: 0.5, 0.3, 0.15, 0.05 (cumulative 0.5, 0.8, 0.95, 1.0)
    logits = np.log(probs)[None, :]
    out = top_p_filter(logits, top_p)
    order = np.argsort(-probs)
    np.testing.assert_array_equal(np.isfinite(out[0, order]), np.arange(4) < kept)
    np.testing.assert_array_equal(out[np.isfinite(out)], logits[np.isfinite(out)])


def test_nucleus_mask_always_keeps_top_token():
    sorted_logits = np.array([[10.0, 0.0, -1.0], [0.0, 0.0, 0.0]])
    np.testing.assert_array_equal(nucleus_mask(sorted_logits, 1e-9), [[1, 0, 0], [1, 0, 0]])
    np.testing.assert_array_equal(nucleus_mask(sorted_logits, 0.5), [[1, 0, 0], [1, 1, 0]])


def test_sample_tokens_follows_filtered_distribution():
    probs = np.array([0.05, 0.4, 0.1, 0.25, 0.2])
    rows = 40000
    logits = np.tile(np.log(probs), (rows, 1))
    rng = np.random.default_rng(0)

    def freq(**kw):
        return np.bincount(sample_tokens(logits, rng, **kw), minlength=5) / rows

    np.testing.assert_allclose(freq(), probs, atol=0.01)
    np.testing.assert_allclose(freq(top_k=2), [0, 0.4 / 0.65, 0, 0.25 / 0.65, 0], atol=0.01)
    np.testing.assert_allclose(freq(top_p=0.7), [0, 0.4 / 0.85, 0, 0.25 / 0.85, 0.2 / 0.85], atol=0.01)
    # top-p on the distribution renormalised after top-k: {0.4, 0.25, 0.2}/0.85 -> 0.47, 0.29: keeps two
    np.testing.assert_allclose(freq(top_k=3, top_p=0.6), [0, 0.4 / 0.65, 0, 0.25 / 0.65, 0], atol=0.01)
    tempered = probs ** 2 / (probs ** 2).sum()
    np.testing.assert_allclose(freq(temperature=0.5), tempered, atol=0.01)
    # min-p: the tokens of at least min_p x the largest probability (0.3 x 0.4 = 0.12)
    np.testing.assert_allclose(freq(min_p=0.3), [0, 0.4 / 0.85, 0, 0.25 / 0.85, 0.2 / 0.85], atol=0.01)
    # after top-p (0.4, 0.25, 0.2, 0.1 kept) min-p 0.49 cuts at 0.196 all the same: the cut ignores the normalisation
    # (0.5 would cut exactly at 0.2, where the float rounding of exp decides, machine by machine)
    np.testing.assert_allclose(freq(top_p=0.9, min_p=0.49), [0, 0.4 / 0.85, 0, 0.25 / 0.85, 0.2 / 0.85], atol=0.01)
    np.testing.assert_allclose(freq(top_k=2, min_p=0.7), [0, 1, 0, 0, 0], atol=0)  # 0.25 < 0.7 x 0.4


@pytest.mark.parametrize("min_p,kept", [(0.0, 4), (0.1, 4), (0.2, 3), (0.5, 2), (0.6, 2), (0.61, 1), (1.0, 1)])
def test_min_p_filter_keeps_the_tokens_within_a_factor_of_the_top(min_p, kept):
    probs = np.array([0.15, 0.5, 0.05, 0.3])  # / 0.5: 0.3, 1, 0.1, 0.6
    logits = np.log(probs)[None, :]
    out = min_p_filter(logits, min_p)
    order = np.argsort(-probs)
    np.testing.assert_array_equal(np.isfinite(out[0, order]), np.arange(4) < kept)
    np.testing.assert_array_equal(out[np.isfinite(out)], logits[np.isfinite(out)])


def test_sampling_is_seeded_and_never_draws_zero_probability():
    logits = np.random.default_rng(1).normal(size=(64, 50))
    a = sample_tokens(logits, np.random.default_rng(9), top_k=5)
    b = sample_tokens(logits, np.random.default_rng(9), top_k=5)
    np.testing.assert_array_equal(a, b)
    allowed = np.isfinite(top_k_filter(logits, 5))
    assert allowed[np.arange(64), a].all()
    probs = np.array([[0.0, 0.0, 1.0, 0.0], [0.0, 0.5, 0.0, 0.5]])
    draws = np.stack([categorical(probs, np.random.default_rng(s)) for s in range(200)])
    assert (draws[:, 0] == 2).all() and set(draws[:, 1].tolist()) == {1, 3}


def test_sampling_with_log_probs_gives_the_same_tokens_and_log_probs_as_apart():
    logits = np.random.default_rng(2).normal(size=(32, 300)).astype(np.float32) * 3
    for kw in (dict(), dict(temperature=0.7), dict(top_k=20), dict(top_p=0.8, temperature=1.3)):
        tokens = sample_tokens(logits, np.random.default_rng(5), **kw)
        both, log_probs = sample_tokens(logits, np.random.default_rng(5), return_log_probs=True, **kw)
        np.testing.assert_array_equal(both, tokens)
        expected = token_log_probs(logits, tokens, kw.get("temperature", 1.0))
        np.testing.assert_array_equal(log_probs, expected)
        assert log_probs.dtype == np.float32 and (log_probs < 0).all()


def test_token_log_probs_with_temperature():
    logits = np.array([[1.0, 2.0, 3.0]])
    expected = np.log(np.exp(2.0 / 0.5) / np.exp(np.array([1.0, 2.0, 3.0]) / 0.5).sum())
    np.testing.assert_allclose(token_log_probs(logits, np.array([1]), 0.5), [expected], rtol=1e-6)


# ------------------------------------------------------------------- compile counts


@pytest.mark.slow
@pytest.mark.slow
def test_compiles_once_per_bucket_and_once_for_decode(model):
    """Prompt lengths 5, 9, 30, 33 with buckets [16, 32, 64] -> prefill compiled for 16, 32, 64; decode once."""
    gen = Generator(model, gen_config(max_new_tokens=3, prompt_buckets=[16, 32, 64]))
    rng = np.random.default_rng(0)
    for length in (5, 9, 30, 33, 9):
        prompts = rng.integers(1, MODEL["vocab_size"], size=(2, length)).tolist()
        gen.generate(prompts)
    expected = {"prefill": 3, "decode": 1, "extend": 0, "forward": 0, "move": 0}
    assert gen.compile_counts() == expected
    assert gen.graph_compile_counts() == expected  # MindSpore's own record (Cell.compile_cache)
    assert sorted(sig[3][1] for sig in gen.first_call_seconds if sig[0] == "prefill") == [16, 32, 64]


@pytest.mark.slow
@pytest.mark.slow
def test_a_generator_sharing_graphs_runs_the_other_ones(model):
    """The held-out evaluation's greedy generator shares the rollout's KV caches and graphs: at the rollout's batch
    size and bucket, prefilling as many prompts a call as the rollout (whose prompts each fill their samples' rows),
    it compiles nothing, and its answers equal those of a generator with graphs of its own that prefills every prompt
    in one call."""
    rng = np.random.default_rng(3)
    prompts = [rng.integers(1, MODEL["vocab_size"], size=n).tolist() for n in (5, 9, 12, 7)]
    rollout = Generator(model, gen_config(do_sample=True, num_generations=2))
    rollout.generate(prompts[:2])  # 2 prompts x 2 samples: 4 rows, bucket 16, one prefill of 2 prompts
    greedy = gen_config(num_generations=1, max_new_tokens=NEW)
    shared = Generator(model, greedy, graphs=rollout.graphs, prefill_prompts=2)
    alone = Generator(model, greedy)
    out_shared, out_alone = shared.generate(prompts), alone.generate(prompts)  # 4 rows, bucket 16
    np.testing.assert_array_equal(out_shared.response_ids, out_alone.response_ids)
    np.testing.assert_array_equal(out_shared.response_mask, out_alone.response_mask)
    assert shared.cache(4) is rollout.cache(4) and alone.cache(4) is not rollout.cache(4)
    graphs = {"prefill": 1, "decode": 1, "extend": 0, "forward": 0, "move": 0}
    assert rollout.graph_compile_counts() == alone.graph_compile_counts() == graphs  # nothing compiled twice
    assert shared.compile_counts() == rollout.compile_counts() == graphs
    prefills = [sig for sig in rollout.first_call_seconds if sig[0] == "prefill"]
    assert [sig[3] for sig in prefills] == [(2, 16)]  # the rollout and the evaluation: 2 prompts a call
    assert rollout.generate(prompts[2:]).response_ids.shape == (4, NEW)  # the rollout still runs after it
    assert rollout.graph_compile_counts() == graphs
    with pytest.raises(ValueError, match="another model"):
        Generator(Qwen2ForCausalLM(Qwen2Config(**MODEL)), greedy, graphs=rollout.graphs)


# -------------------------------------------------------------------- config errors


@pytest.mark.parametrize("field,value", [
    ("top_p", 0.0), ("top_p", 1.5), ("temperature", -0.1), ("top_k", -1), ("max_new_tokens", 0),
    ("num_generations", 0), ("prompt_buckets", []), ("prompt_buckets", [32, 16]), ("seed", -1),
    ("eos_token_ids", [-2]), ("pad_token_id", -1), ("max_num_seqs", -1), ("stop_strings", [""]), ("min_p", -0.1),
    ("min_p", 1.5), ("max_num_batched_tokens", 15), ("max_num_batched_tokens", -1), ("max_model_len", 21),
    ("stop_strings", "ab"), ("step_down_ratio", 0.0), ("step_down_ratio", 1.0), ("step_down_ratio", "half"),
])
def test_bad_config_names_field(field, value):
    with pytest.raises(ConfigError, match=f"generation.{field}"):
        dataclasses.replace(gen_config(), **{field: value})  # a config is validated as it is made


def test_config_from_mapping_names_source_and_field():
    with pytest.raises(ConfigError, match=r"run.yaml.*generation.top_p"):
        from_mapping(GenerationConfig, {"top_p": 2.0}, "run.yaml")
    with pytest.raises(ConfigError, match="did you mean 'top_k'"):
        from_mapping(GenerationConfig, {"topk": 2}, "run.yaml")
    assert from_mapping(GenerationConfig, {"top_k": 20, "prompt_buckets": [128, 256]}, "run.yaml").top_k == 20


def test_prompt_longer_than_largest_bucket(generator):
    generator.config = gen_config()
    with pytest.raises(ConfigError, match=r"prompt_buckets.*17 tokens.*largest bucket 16"):
        generator.generate([[1] * 17])


def test_cache_longer_than_seq_length_and_ids_outside_vocab(model):
    with pytest.raises(ConfigError, match=r"max_new_tokens=16.*prompt_buckets=120.*seq_length=128"):
        Generator(model, gen_config(prompt_buckets=[64, 120], max_new_tokens=16))
    with pytest.raises(ConfigError, match="eos_token_ids"):
        Generator(model, gen_config(eos_token_ids=[151645]))
    with pytest.raises(ConfigError, match="pad_token_id"):
        Generator(model, gen_config(pad_token_id=128))


def test_the_generator_keeps_its_frozen_config_and_checks_only_that_it_fits_the_model(generator):
    cfg = gen_config(seed=3)
    generator.config = cfg
    assert generator.config is cfg  # frozen and validated as it was made: no copy, no second validation
    with pytest.raises(ConfigError, match=r"max_new_tokens=120.*= 136 exceeds model_config.seq_length=128"):
        generator.config = dataclasses.replace(cfg, max_new_tokens=120)
    assert generator.config is cfg


def test_defaults_are_qwen_and_valid():
    cfg = GenerationConfig()  # validated as it is made
    assert cfg.eos_token_ids == [151645, 151643] and cfg.pad_token_id == 151643
    assert cfg.cache_length == 1024 + cfg.max_new_tokens
