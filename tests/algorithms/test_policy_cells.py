"""Trainer cells: response log-probs slice the right positions; the loss net equals the numpy loss."""
import inspect

import mindspore as ms
import numpy as np
import pytest
from mindspore import nn
from support.configs import tiny_qwen2_config
from support.tolerances import assert_weights_close_after_adam

from mindrlhf.algorithms import GRPOLossCell, aggregate, aggregation_weights, grpo_policy_loss
from mindrlhf.algorithms.policy_cells import (
    GRPOLossNet,
    PackedLogProbs,
    PackedSFTLossNet,
    ResponseHidden,
    ResponseLogProbs,
    ResponseScores,
    ResponseValues,
    SFTLossNet,
    ValueLossNet,
)
from mindrlhf.algorithms.value_loss_cell import ValueLossCell
from mindrlhf.models.qwen2 import Qwen2ForCausalLM, Qwen2ForValue
from mindrlhf.optim import AdamW
from mindrlhf.parallel.layers import init_random_weights
from mindrlhf.parallel.spmd import MicroBatchedTrainStep, SPMDTrainStep

ONE_LAYER = dict(vocab_size=64, num_layers=1, n_kv_heads=2, seq_length=64)  # the tiny Qwen2's overrides


@pytest.fixture(scope="module")
def model():
    previous = ms.get_context("mode")
    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    net = Qwen2ForCausalLM(tiny_qwen2_config(**ONE_LAYER))
    init_random_weights(net, seed=0)
    yield net
    ms.set_context(mode=previous)


def batch(seed=0):
    rng = np.random.RandomState(seed)
    prompt = rng.randint(1, 64, (3, 6)).astype(np.int32)
    prompt_mask = np.ones_like(prompt)
    prompt_mask[1, :2] = 0
    prompt[1, :2] = 0
    response = rng.randint(1, 64, (3, 5)).astype(np.int32)
    response_mask = np.array([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 1, 1, 1, 0]], np.int32)
    return prompt, prompt_mask, response, response_mask


def numpy_response_logp(model, prompt, prompt_mask, response, response_mask, temperature=1.0, with_entropy=False):
    ids = np.concatenate([prompt, response], 1)
    mask = np.concatenate([prompt_mask, response_mask], 1)
    logits = model(ms.Tensor(ids), ms.Tensor(mask)).asnumpy().astype(np.float64) / temperature
    shifted = logits - logits.max(-1, keepdims=True)
    log_softmax = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    p = prompt.shape[1]
    # the logits at position p-1+t predict response token t
    window = log_softmax[:, p - 1:p - 1 + response.shape[1]]
    if with_entropy:
        return (np.take_along_axis(window, response[..., None], -1)[..., 0],
                -(np.exp(window) * window).sum(-1))
    return np.take_along_axis(window, response[..., None], -1)[..., 0]


@pytest.mark.parametrize("cell", [ResponseLogProbs, ResponseHidden, ResponseValues, ResponseScores, SFTLossNet,
                                  PackedLogProbs, PackedSFTLossNet, GRPOLossNet, ValueLossNet])
def test_cells_name_their_inputs_in_construct_order(cell):
    arguments = [name for name in inspect.signature(cell.construct).parameters if name not in ("self", "hidden_in")]
    assert [{"old_values": "values"}.get(name, name) for name in arguments] == list(cell.INPUTS)


def test_loss_outputs_carry_no_role_prefix():
    assert GRPOLossNet.OUTPUTS == ("loss", "pg_loss", "kl_loss", "pg_clipfrac", "ratio_mean", "ppo_kl", "entropy")
    assert GRPOLossNet.OUTPUTS[:-1] == GRPOLossCell.OUTPUTS
    assert ValueLossNet.OUTPUTS == ValueLossCell.OUTPUTS == ("vf_loss", "vf_clipfrac")


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_response_log_probs_pick_the_tokens_that_follow_the_prompt(model, temperature):
    data = batch()
    got = ResponseLogProbs(model, temperature)(*map(ms.Tensor, data)).asnumpy()
    want = numpy_response_logp(model, *data, temperature=temperature)
    mask = data[3].astype(bool)
    np.testing.assert_allclose(got[mask], want[mask], atol=1e-5)


def test_grpo_loss_net_equals_the_numpy_loss(model):
    prompt, prompt_mask, response, response_mask = data = batch(1)
    rng = np.random.RandomState(2)
    logp = numpy_response_logp(model, *data)
    old = (logp + rng.normal(0, 0.3, logp.shape)).astype(np.float32)
    ref = (logp + rng.normal(0, 0.3, logp.shape)).astype(np.float32)
    adv = np.array([1.0, -0.5, 0.7], np.float32)
    _, entropy = numpy_response_logp(model, *data, temperature=0.8, with_entropy=True)
    for aggregation in ("seq-mean-token-mean", "token-mean"):
        weights = aggregation_weights(response_mask, aggregation).astype(np.float32)
        net = GRPOLossNet(model, GRPOLossCell(beta=0.04, epsilon_low=0.2, epsilon_high=0.28), temperature=0.8)
        out = dict(zip(GRPOLossNet.OUTPUTS, net(*map(ms.Tensor, (prompt, prompt_mask, response, response_mask, old,
                                                                ref, adv, weights)))))
        logp_t = numpy_response_logp(model, *data, temperature=0.8)
        loss, stats = grpo_policy_loss(logp_t, old, ref, adv, response_mask, beta=0.04, epsilon_low=0.2,
                                       epsilon_high=0.28, aggregation=aggregation)
        assert abs(float(out["loss"].asnumpy()) - loss) < 1e-5, aggregation
        assert abs(float(out["kl_loss"].asnumpy()) - stats["kl_loss"]) < 1e-5
        assert abs(float(out["ppo_kl"].asnumpy()) - stats["ppo_kl"]) < 1e-5
        expected_entropy = aggregate(entropy, response_mask, aggregation)
        assert float(out["entropy"].asnumpy()) == pytest.approx(expected_entropy, rel=1e-5)
        assert 0.1 < expected_entropy < np.log(model.config.vocab_size)


@pytest.mark.slow
def test_train_step_lowers_the_loss_on_a_fixed_batch(model):
    prompt, prompt_mask, response, response_mask = batch(3)
    logp = numpy_response_logp(model, prompt, prompt_mask, response, response_mask).astype(np.float32)
    adv = np.array([1.0, 1.0, 1.0], np.float32)  # every response is good: raise its likelihood
    net = GRPOLossNet(model, GRPOLossCell(beta=0.0, epsilon_low=0.2, epsilon_high=1.0))
    step = SPMDTrainStep(net, nn.Adam(model.trainable_params(), learning_rate=1e-2))
    weights = aggregation_weights(response_mask).astype(np.float32)
    inputs = [ms.Tensor(a) for a in (prompt, prompt_mask, response, response_mask, logp, logp, adv, weights)]
    before = ResponseLogProbs(model)(*inputs[:4]).asnumpy()
    for _ in range(3):
        step(*inputs)
    after = ResponseLogProbs(model)(*inputs[:4]).asnumpy()
    mask = response_mask.astype(bool)
    assert after[mask].mean() > before[mask].mean() + 0.1


@pytest.mark.slow
def test_micro_batches_give_the_update_of_the_whole_batch(graph_mode):
    """Gradient accumulation: one row at a time == all rows in one graph (outputs, clipped grad norm, weights)."""
    prompt, prompt_mask, response, response_mask = batch(5)
    rng = np.random.RandomState(5)
    old = (rng.randn(*response.shape) * 0.1 - 3).astype(np.float32)
    ref = (rng.randn(*response.shape) * 0.1 - 3).astype(np.float32)
    adv = np.array([1.2, -0.4, -0.8], np.float32)
    weights = aggregation_weights(response_mask, "token-mean").astype(np.float32)
    arrays = (prompt, prompt_mask, response, response_mask, old, ref, adv, weights)
    results = []
    for micro in (3, 1):
        net = Qwen2ForCausalLM(tiny_qwen2_config(**ONE_LAYER))
        init_random_weights(net, seed=0)
        loss_net = GRPOLossNet(net, GRPOLossCell(beta=0.04, epsilon_low=0.2, epsilon_high=0.28))
        step = MicroBatchedTrainStep(loss_net, AdamW(net.trainable_params(), learning_rate=1e-2), grad_reduction="sum",
                                     max_grad_norm=0.05)
        micro_batches = [[ms.Tensor(a[i:i + micro]) for a in arrays] for i in range(0, 3, micro)]
        history = [step(micro_batches) for _ in range(2)]
        results.append((history, {p.name: p.asnumpy().copy() for p in net.trainable_params()}))
    (whole, whole_weights), (micro, micro_weights) = results
    for (outputs_a, norm_a), (outputs_b, norm_b) in zip(whole, micro):
        np.testing.assert_allclose(outputs_b, outputs_a, rtol=1e-5, atol=1e-6)
        assert norm_b == pytest.approx(norm_a, rel=1e-5) and norm_a > 0.05  # clipping was active
    assert whole[0][1] != whole[1][1]  # the first update changed the weights the second saw
    # Adam moves each weight by ~lr = 1e-2 per step whatever its gradient's size, so near-zero gradients (k biases:
    # softmax is almost invariant to them) turn float rounding into weight differences: compared in lr units
    assert_weights_close_after_adam(micro_weights, whole_weights, lr=1e-2, updates=2, what="one row at a time vs whole")


def grouped_batch(groups=2, count=3, prompt_width=7, response_width=6, seed=0):
    """`groups` left-padded prompts (the second shorter) and `count` right-padded responses of each, one of them
    ended at its first token."""
    rng = np.random.RandomState(seed)
    prompt = rng.randint(1, 64, (groups, prompt_width)).astype(np.int32)
    prompt_mask = np.ones_like(prompt)
    prompt_mask[1, :3], prompt[1, :3] = 0, 0
    lengths = rng.randint(1, response_width + 1, groups * count)
    lengths[1] = 1
    response_mask = (np.arange(response_width)[None] < lengths[:, None]).astype(np.int32)
    response = np.where(response_mask > 0, rng.randint(1, 64, response_mask.shape), 0).astype(np.int32)
    return prompt, prompt_mask, response, response_mask


@pytest.mark.slow
def test_a_prompt_read_once_for_its_responses_gives_their_log_probs_entropy_and_gradients(model):
    """Prefix sharing: prompts [2, P] with 3 responses each give the log-probs, entropies and loss gradients of the 6
    [prompt | response] rows (grouped-query attention with 2 query heads a kv head, a left-padded prompt, a response
    of one token)."""
    prompt, prompt_mask, response, response_mask = grouped_batch()
    count = len(response) // len(prompt)
    each = [np.repeat(prompt, count, 0), np.repeat(prompt_mask, count, 0), response, response_mask]
    shared = [prompt, prompt_mask, response, response_mask]
    cell = ResponseLogProbs(model, 0.8, with_entropy=True)
    mask = response_mask.astype(bool)
    (logp_each, entropy_each), (logp_shared, entropy_shared) = [
        [out.asnumpy() for out in cell(*map(ms.Tensor, inputs))] for inputs in (each, shared)]
    assert logp_shared.shape == logp_each.shape == response.shape
    np.testing.assert_allclose(logp_shared[mask], logp_each[mask], atol=2e-6)
    np.testing.assert_allclose(entropy_shared[mask], entropy_each[mask], atol=2e-6)
    np.testing.assert_allclose(logp_each[mask], numpy_response_logp(model, *each, temperature=0.8)[mask], atol=1e-5)

    rng = np.random.RandomState(1)
    old = (logp_each + rng.normal(0, 0.2, logp_each.shape)).astype(np.float32)
    ref = (logp_each + rng.normal(0, 0.2, logp_each.shape)).astype(np.float32)
    adv = rng.normal(0, 1, len(response)).astype(np.float32)
    weights = aggregation_weights(response_mask).astype(np.float32)
    loss_net = GRPOLossNet(model, GRPOLossCell(beta=0.04, epsilon_low=0.2, epsilon_high=0.28), temperature=0.8)
    grad = ms.ops.value_and_grad(loss_net, None, model.trainable_params(), has_aux=True)
    results = [grad(*map(ms.Tensor, inputs + [old, ref, adv, weights])) for inputs in (each, shared)]
    (outputs_each, grads_each), (outputs_shared, grads_shared) = results
    for a, b in zip(outputs_each, outputs_shared):
        assert float(b.asnumpy()) == pytest.approx(float(a.asnumpy()), rel=1e-5, abs=1e-7)
    scale = max(float(np.abs(g.asnumpy()).max()) for g in grads_each)
    assert scale > 1e-3
    for param, a, b in zip(model.trainable_params(), grads_each, grads_shared):
        np.testing.assert_allclose(b.asnumpy(), a.asnumpy(), atol=1e-5 * scale, err_msg=param.name)


@pytest.mark.slow
def test_value_heads_read_a_shared_prompt_like_each_response(graph_mode):
    """The critic's values (before each response token) and a reward model's score (at the last response token) of
    responses sharing their prompt equal those of each [prompt | response] row."""
    net = Qwen2ForValue(tiny_qwen2_config(**ONE_LAYER))
    init_random_weights(net, seed=4)
    net.score.weight.set_data(ms.Tensor(np.random.RandomState(4).normal(0, 1, (1, 32)).astype(np.float32)))
    prompt, prompt_mask, response, response_mask = grouped_batch(count=2, seed=3)
    each = [np.repeat(prompt, 2, 0), np.repeat(prompt_mask, 2, 0), response, response_mask]
    mask = response_mask.astype(bool)
    for cell in (ResponseValues(net), ResponseScores(net)):
        values_each = cell(*map(ms.Tensor, each)).asnumpy()
        values_shared = cell(*map(ms.Tensor, (prompt, prompt_mask, response, response_mask))).asnumpy()
        assert values_shared.shape == values_each.shape
        assert np.abs(values_each).max() > 0.1
        if values_each.ndim == 2:
            values_each, values_shared = values_each[mask], values_shared[mask]
        np.testing.assert_allclose(values_shared, values_each, atol=1e-5)
