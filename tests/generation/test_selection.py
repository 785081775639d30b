"""Token selection in the graph (`TokenSelection`) against the numpy reference (`sampling.sample_tokens`,
`greedy_tokens`, `token_log_probs`) on the same uniforms: greedy, temperature, top-k, top-p, both; a vocabulary of
SmolLM2's size (where a flat float32 prefix sum would move draws); ties; zero-probability tokens; a prompt's logits
serving its samples' draws; and a Generator whose random stream is restored draws what the straight run drew."""
import numpy as np
import pytest

ms = pytest.importorskip("mindspore")

from mindrlhf.configs.generation import GenerationConfig  # noqa: E402
from mindrlhf.generation import Generator  # noqa: E402
from mindrlhf.generation.sampling import (  # noqa: E402
    greedy_tokens,
    min_p_mask,
    nucleus_mask,
    sample_tokens,
    softmax,
    token_log_probs,
    top_k_candidates,
)
from mindrlhf.generation.selection import TokenSelection, block_length, float32_uniforms  # noqa: E402
from mindrlhf.models.qwen2 import Qwen2Config, Qwen2ForCausalLM  # noqa: E402
from mindrlhf.parallel.layers import load_full_state, random_full_state  # noqa: E402

pytestmark = pytest.mark.usefixtures("graph_mode")

ROWS = 64
# a uniform this close to an edge of the reference's (float64) CDF may fall on the other side in float32: the graph's
# blocked prefix sums are ~1e-7 off (a flat float32 cumsum over 49k entries drifts by 5e-5)
BOUNDARY = 1e-6


def select(logits, uniforms, **settings):
    """The graph's tokens and log-probs for `logits` [R, V] and float64 `uniforms` [B]."""
    cell = TokenSelection(logits.shape[-1], **settings)
    tokens, log_probs = cell(ms.Tensor(logits), ms.Tensor(float32_uniforms(uniforms)))
    return tokens.asnumpy(), None if log_probs is None else log_probs.asnumpy()


def edge_distance(logits, uniforms, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    """Per row, how far the reference's choices are from flipping: the uniform from the nearest edge of the CDF it
    inverts, the nucleus' cumulative probabilities from top_p (fractions of the total), and the probabilities over
    the largest from min_p."""
    scaled = np.asarray(logits, np.float64) / temperature
    if not 0 < top_k < scaled.shape[-1] and top_p >= 1.0 and min_p <= 0:
        cdf = np.cumsum(softmax(scaled), -1)
        return np.abs(cdf - uniforms[:, None]).min(-1)
    candidates, _ = top_k_candidates(scaled, top_k or scaled.shape[-1])
    probs = softmax(candidates)
    before = np.cumsum(probs, -1) - probs
    nucleus_edge = np.abs(before[:, 1:] - top_p).min(-1) if top_p < 1.0 else np.inf
    min_p_edge = np.abs(probs / probs[:, :1] - min_p).min(-1) if min_p > 0 else np.inf
    kept = np.where(nucleus_mask(candidates, top_p) & min_p_mask(candidates, min_p), probs, 0.0)
    cdf = np.cumsum(kept, -1) / kept.sum(-1, keepdims=True)
    return np.minimum(np.minimum(np.abs(cdf - uniforms[:, None]).min(-1), nucleus_edge), min_p_edge)


SETTINGS = {
    "temperature": dict(temperature=0.7),
    "top_k": dict(top_k=20),
    "top_p": dict(top_p=0.8),
    "top_k_and_top_p": dict(temperature=1.3, top_k=50, top_p=0.7),
    "min_p": dict(min_p=0.05),
    "top_k_top_p_and_min_p": dict(temperature=1.3, top_k=50, top_p=0.9, min_p=0.02),
    "plain": dict(),
}


# (vocabulary, settings, rows whose uniform lies within BOUNDARY of an edge, with these seeds); at SmolLM2's vocabulary
# the CDF's steps are ~2e-5 apart, so 7 and 4 rows lie within 1e-5
CASES = [(1000, name, 0) for name in SETTINGS] + [(49152, "plain", 2), (49152, "top_p", 0), (49152, "min_p", 0)]


@pytest.mark.parametrize("vocab,name,near_edges", CASES)
def test_sampling_equals_the_numpy_reference(vocab, name, near_edges):
    settings = SETTINGS[name]
    logits = (np.random.default_rng(vocab).normal(size=(ROWS, vocab)) * 3).astype(np.float32)
    uniforms = np.random.default_rng(7).random(ROWS)
    expected, expected_log_probs = sample_tokens(logits, np.random.default_rng(7), return_log_probs=True, **settings)
    tokens, log_probs = select(logits, uniforms, **settings)
    far = edge_distance(logits, uniforms, **settings) >= BOUNDARY
    assert (~far).sum() == near_edges
    np.testing.assert_array_equal(tokens[far], expected[far])
    assert tokens.dtype == np.int32 and log_probs.dtype == np.float32
    np.testing.assert_allclose(log_probs, expected_log_probs, atol=1e-5, rtol=0)
    assert len(set(tokens.tolist())) > ROWS // 4, "too peaked: the comparison would prove little"


def test_greedy_equals_argmax_and_takes_the_first_of_ties():
    logits = (np.random.default_rng(3).normal(size=(ROWS, 1000)) * 3).astype(np.float32)
    logits[0, [5, 700]] = logits[1, [9, 10, 999]] = logits.max() + 1  # ties at the top
    logits[2] = 0.0
    tokens, log_probs = select(logits, np.zeros(ROWS), greedy=True)
    expected = greedy_tokens(logits)
    np.testing.assert_array_equal(tokens, expected)
    assert tokens[:3].tolist() == [5, 9, 0]
    np.testing.assert_allclose(log_probs, token_log_probs(logits, expected), atol=1e-5, rtol=0)
    tokens_only, none = select(logits, np.zeros(ROWS), greedy=True, with_log_probs=False)
    np.testing.assert_array_equal(tokens_only, expected)
    assert none is None


def test_top_k_1_is_greedy_at_the_sampling_temperature():
    """One candidate: the argmax whatever the draw (the first of ties, as greedy; the SmolLM2 test samples with
    top_k 1 to compare with transformers' greedy tokens), its log-prob over the temperature-scaled distribution."""
    logits = (np.random.default_rng(5).normal(size=(ROWS, 1000)) * 3).astype(np.float32)
    logits[0, [5, 700]] = logits[1, [9, 10, 999]] = logits.max() + 1
    tokens, log_probs = select(logits, np.random.default_rng(6).random(ROWS), temperature=0.7, top_k=1)
    np.testing.assert_array_equal(tokens, greedy_tokens(logits))
    assert tokens[:2].tolist() == [5, 9]
    np.testing.assert_allclose(log_probs, token_log_probs(logits, tokens, 0.7), atol=1e-5, rtol=0)


@pytest.mark.parametrize("settings", [dict(), dict(top_k=3), dict(top_p=0.9), dict(min_p=0.5)],
                         ids=["plain", "top_k", "top_p", "min_p"])
def test_a_zero_probability_token_is_never_drawn(settings):
    """Even at the ends of [0, 1): a uniform that rounds to 1.0 in float32 would pass the last entry."""
    row = np.full(12, -np.inf, np.float32)
    row[[2, 7]] = [0.5, 0.0]
    logits = np.tile(row, (6, 1))
    uniforms = np.array([0.0, 1e-12, 0.5, 1 - 1e-9, 1 - 1e-17, 0.9999999])
    tokens, _ = select(logits, uniforms, **settings)
    assert set(tokens.tolist()) <= {2, 7} and tokens[0] == 2 and tokens[3] == 7
    np.testing.assert_array_equal(float32_uniforms(uniforms) < 1, True)


@pytest.mark.parametrize("settings,kept", [
    (dict(top_k=2), [1, 3]), (dict(top_p=0.7), [1, 3, 4]), (dict(min_p=0.3), [1, 3, 4]),
    (dict(top_p=0.9, min_p=0.5), [1, 3, 4]), (dict(top_k=4, min_p=0.6), [1, 3]),
], ids=["top_k", "top_p", "min_p", "top_p_min_p", "top_k_min_p"])
def test_the_graphs_filters_never_draw_an_excluded_token_and_follow_the_filtered_distribution(settings, kept):
    """40000 draws from one 5-token distribution: the excluded tokens never come, the kept ones as often as their
    renormalised probabilities say."""
    probs = np.array([0.05, 0.4, 0.1, 0.25, 0.2])
    rows = 40000
    tokens, _ = select(np.tile(np.log(probs), (rows, 1)).astype(np.float32), np.random.default_rng(11).random(rows),
                       **settings)
    frequency = np.bincount(tokens, minlength=5) / rows
    expected = np.zeros(5)
    expected[kept] = probs[kept] / probs[kept].sum()
    assert set(np.flatnonzero(frequency)) == set(kept)
    np.testing.assert_allclose(frequency, expected, atol=0.01)


def test_block_length_is_the_largest_divisor_up_to_the_square_root():
    assert [block_length(n) for n in (1, 7, 20, 1000, 49152, 151936)] == [1, 1, 4, 25, 192, 128]


@pytest.fixture(scope="module")
def model():
    net = Qwen2ForCausalLM(Qwen2Config(vocab_size=128, hidden_size=32, num_layers=1, num_heads=4, n_kv_heads=2,
                                       intermediate_size=64, seq_length=64))
    load_full_state(net, random_full_state(net, seed=5))
    return net


PROMPTS = [[3, 4, 5], [9, 8, 7, 6]]


def sampling_config(**overrides) -> GenerationConfig:
    settings = dict(max_new_tokens=5, num_generations=3, temperature=1.0, top_p=0.95, eos_token_ids=[],
                    pad_token_id=0, prompt_buckets=[8], seed=21)
    return GenerationConfig(**{**settings, **overrides})


def test_each_sample_of_a_prompt_draws_its_own_first_token_as_the_reference_does(model):
    """Prefill reads a prompt once; its logits serve its samples' rows, each with the next uniform of the stream, in
    row order: the numpy reference on the prompt's logits repeated, with the same stream, picks the same tokens."""
    config = sampling_config()
    out = Generator(model, config).generate(PROMPTS, return_log_probs=True)
    ids, mask = out.prompt_ids[::3], out.prompt_mask[::3]
    logits = model(ms.Tensor(ids), ms.Tensor(mask)).asnumpy()[:, -1]
    expected, expected_log_probs = sample_tokens(np.repeat(logits, 3, 0), np.random.default_rng(config.seed),
                                                 top_p=config.top_p, return_log_probs=True)
    np.testing.assert_array_equal(out.response_ids[:, 0], expected)
    np.testing.assert_allclose(out.log_probs[:, 0], expected_log_probs, atol=1e-5, rtol=0)
    assert len(set(expected[:3].tolist())) > 1


def test_a_restored_stream_draws_what_the_straight_run_drew(model):
    """The trainer saves `rng_state()` with a checkpoint: a resumed run samples the straight run's
    tokens (the host draws the uniforms in the same order as the numpy reference did)."""
    config = sampling_config()
    straight = Generator(model, config)
    straight.generate(PROMPTS)
    state = straight.rng_state()
    second = straight.generate(PROMPTS, return_log_probs=True)
    resumed = Generator(model, config)
    resumed.load_rng_state(state)
    again = resumed.generate(PROMPTS, return_log_probs=True)
    np.testing.assert_array_equal(again.response_ids, second.response_ids)
    np.testing.assert_array_equal(again.log_probs, second.log_probs)
    assert len({tuple(r) for r in second.response_ids}) > 2
