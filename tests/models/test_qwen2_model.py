"""Qwen2/Llama network parity with Hugging Face transformers (GRAPH_MODE, fp32, CPU)."""
import mindspore as ms
import numpy as np
import pytest
import torch
from support.hf_fixtures import hf_logits, make_hf_model_dir

from mindrlhf.algorithms.policy_cells import ResponseLogProbs
from mindrlhf.models.qwen2 import KVCache, Qwen2ForCausalLM
from mindrlhf.models.qwen2.convert import convert_hf_to_ms

LOGIT_TOL = 1e-4
VARIANTS = {
    "qwen2-untied": dict(arch="qwen2", tie=False, rope_theta=1e6),
    "qwen2-tied": dict(arch="qwen2", tie=True),
    "llama-nobias": dict(arch="llama", tie=False),
    "llama-tied-bias-free": dict(arch="llama", tie=True, qkv_bias=False, rope_theta=5e5),
}


# every test compiles the converted nets of 4 variants (and runs transformers): the full suite, not the quick tier
pytestmark = [pytest.mark.usefixtures("graph_mode"), pytest.mark.slow]


@pytest.fixture(scope="module", params=list(VARIANTS))
def converted(request, tmp_path_factory):
    """(HF model, our network loaded from the converted checkpoint, config) for one variant."""
    folder = tmp_path_factory.mktemp(request.param)
    hf_dir, hf_model = make_hf_model_dir(folder / "hf", seed=3, **VARIANTS[request.param])
    ckpt = str(folder / "model.ckpt")
    config = convert_hf_to_ms(hf_dir, ckpt)
    config.seq_length = 128
    net = Qwen2ForCausalLM(config)
    not_loaded, ckpt_unused = ms.load_param_into_net(net, ms.load_checkpoint(ckpt), strict_load=True)
    assert not_loaded == [] and ckpt_unused == []
    return hf_model, net, config


def random_ids(config, batch, seq, seed=0):
    return np.random.RandomState(seed).randint(0, config.vocab_size, (batch, seq)).astype(np.int32)


def test_every_parameter_comes_from_the_checkpoint(converted):
    _, net, config = converted
    names = {p.name for p in net.get_parameters()}
    assert ("lm_head.weight" in names) == (not config.tie_word_embeddings)
    assert sum(int(np.prod(p.shape)) for p in net.get_parameters()) == config.num_parameters()


def test_logits_match_transformers(converted):
    hf_model, net, config = converted
    ids = random_ids(config, 3, 40)
    ours = net(ms.Tensor(ids)).asnumpy()
    ref = hf_logits(hf_model, ids).numpy()
    assert ours.shape == (3, 40, config.vocab_size)
    diff = np.abs(ours - ref).max()
    assert diff <= LOGIT_TOL, f"max |logit diff| {diff}"
    assert np.abs(ref).max() > 0.1  # the comparison is not between two near-zero tensors


def greedy_with_cache(net, prompt, new_tokens, cache_length=64):
    """Greedy decoding through the static KV cache (prefill once, then one token per step)."""
    batch, seq = prompt.shape
    cache = KVCache(net, batch, cache_length)
    mask = np.ones_like(prompt)
    logits = cache.prefill(ms.Tensor(prompt), ms.Tensor(mask), *cache.rows_of(0, batch)).asnumpy()
    valid = np.zeros((batch, cache_length), np.float32)
    valid[:, :seq] = 1
    out = []
    for step in range(new_tokens):
        token = logits.argmax(-1).astype(np.int32)
        out.append(token)
        valid[:, seq + step] = 1
        positions = np.full((batch, 1), seq + step, np.int32)
        logits = cache.decode(ms.Tensor(token[:, None]), ms.Tensor(positions),
                              ms.Tensor(np.full(batch, seq + step, np.int32)), ms.Tensor(valid)).asnumpy()
    return np.stack(out, 1)


def test_greedy_generation_matches_transformers_generate(converted):
    hf_model, net, config = converted
    prompt = random_ids(config, 2, 12, seed=1)
    ours = greedy_with_cache(net, prompt, 16)
    with torch.no_grad():
        ref = hf_model.generate(torch.tensor(prompt, dtype=torch.long), max_new_tokens=16, min_new_tokens=16,
                                do_sample=False, pad_token_id=0)[:, 12:].numpy()
    np.testing.assert_array_equal(ours, ref)


# the tests below call the net on [batch 2, width 16] batches with a mask, so they share one compiled full-forward graph
FULL_WIDTH = 16


def test_kv_cache_decode_equals_full_forward_with_left_padding(converted):
    """Prefill and every decode step give the logits the full forward gives at the same position of the final
    sequence (a causal net: position p sees tokens <= p only), with a left-padded row."""
    _, net, config = converted
    batch, seq, length = 2, 10, 32
    steps = FULL_WIDTH - seq
    ids = random_ids(config, batch, seq, seed=2)
    mask = np.ones((batch, seq), np.int32)
    mask[1, :4] = 0  # row 1 is a 6-token prompt, left-padded
    ids[1, :4] = 0
    cache = KVCache(net, batch, length)
    logits = cache.prefill(ms.Tensor(ids), ms.Tensor(mask), *cache.rows_of(0, batch)).asnumpy()
    valid = np.zeros((batch, length), np.float32)
    valid[:, :seq] = mask
    positions = mask.sum(1) - 1
    decoded = [logits]
    for step in range(steps):
        token = logits.argmax(-1).astype(np.int32)
        ids = np.concatenate([ids, token[:, None]], 1)
        mask = np.concatenate([mask, np.ones((batch, 1), np.int32)], 1)
        positions = positions + 1
        valid[:, seq + step] = 1
        logits = cache.decode(ms.Tensor(token[:, None]), ms.Tensor(positions[:, None].astype(np.int32)),
                              ms.Tensor(np.full(batch, seq + step, np.int32)), ms.Tensor(valid)).asnumpy()
        decoded.append(logits)
    # the cache holds rows of head_dim values (one a sample, kv head and position): prefill and the decode steps wrote
    # positions 0 .. seq + steps - 1 of every row and nothing after them
    batch_rows, kv_heads, _, head_dim = cache.shape
    for layer_cache in (cache.key_caches[-1], cache.value_caches[0]):
        assert layer_cache.shape == (batch_rows * kv_heads * length, head_dim)
        values = layer_cache.asnumpy().reshape(cache.shape)
        assert values[:, :, :seq + steps].any(-1).all() and not values[:, :, seq + steps:].any()
    full = net(ms.Tensor(ids), ms.Tensor(mask)).asnumpy()
    assert full.shape[1] == FULL_WIDTH
    np.testing.assert_allclose(decoded[0], full[:, seq - 1], atol=1e-5, err_msg="prefill")
    for step in range(steps - 1):  # the last decode step predicts past the final sequence
        np.testing.assert_allclose(decoded[step + 1], full[:, seq + step], atol=1e-5, err_msg=f"decode step {step}")


def test_left_padding_does_not_change_the_real_tokens_logits(converted):
    """Row 1 is row 0's first 13 tokens after 3 pad positions: its real tokens get row 0's logits."""
    _, net, config = converted
    real = random_ids(config, 1, FULL_WIDTH, seed=4)[0]
    ids = np.stack([real, np.concatenate([np.zeros(3, np.int32), real[:FULL_WIDTH - 3]])])
    mask = np.ones_like(ids)
    mask[1, :3] = 0
    logits = net(ms.Tensor(ids), ms.Tensor(mask)).asnumpy()
    np.testing.assert_allclose(logits[1, 3:], logits[0, :FULL_WIDTH - 3], atol=1e-5)
    assert np.abs(logits[0]).max() > 0.1


def test_log_probs_equal_log_softmax_of_logits(converted):
    _, net, config = converted
    ids = random_ids(config, 2, FULL_WIDTH, seed=5)
    mask = np.ones_like(ids)
    prompt, response = ids[:, :6], ids[:, 6:]
    logp = ResponseLogProbs(net)(*map(ms.Tensor, (prompt, mask[:, :6], response, mask[:, 6:]))).asnumpy()
    logits = net(ms.Tensor(ids), ms.Tensor(mask)).asnumpy().astype(np.float64)[:, 5:-1]  # position s predicts s + 1
    log_softmax = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - logits.max(-1, keepdims=True)
    expected = np.take_along_axis(log_softmax, response[..., None], -1)[..., 0]
    assert logp.shape == (2, 10) and logp.dtype == np.float32
    np.testing.assert_allclose(logp, expected, atol=1e-5)


def test_fp16_compute_stays_close_to_fp32(tmp_path):
    hf_dir, hf_model = make_hf_model_dir(tmp_path / "hf", arch="qwen2", seed=7)
    ckpt = str(tmp_path / "m.ckpt")
    config = convert_hf_to_ms(hf_dir, ckpt)
    config.compute_dtype = "float16"
    config.seq_length = 64
    net = Qwen2ForCausalLM(config)
    ms.load_param_into_net(net, ms.load_checkpoint(ckpt), strict_load=True)
    ids = random_ids(config, 2, 20, seed=8)
    ours = net(ms.Tensor(ids)).asnumpy()
    assert ours.dtype == np.float32  # logits always come back in float32
    ref = hf_logits(hf_model, ids).numpy()
    assert np.abs(ours - ref).max() < 2e-2
    assert (ours.argmax(-1) == ref.argmax(-1)).mean() > 0.95
