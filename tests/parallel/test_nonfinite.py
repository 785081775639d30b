"""A NaN/inf loss or gradient skips the optimizer update: weights, AdamW moments and step count stay as they were,
and the next finite update is the one a run without the bad batch would take."""
import mindspore as ms
import numpy as np
import pytest
from mindspore import ops
from support.configs import tiny_qwen2_config

from mindrlhf.algorithms import GRPOLossCell, aggregation_weights
from mindrlhf.algorithms.policy_cells import GRPOLossNet
from mindrlhf.models.qwen2 import Qwen2ForCausalLM
from mindrlhf.optim import AdamW
from mindrlhf.parallel.layers import init_random_weights
from mindrlhf.parallel.spmd import MicroBatchedTrainStep

ONE_LAYER = dict(vocab_size=64, num_layers=1, n_kv_heads=2, seq_length=64)  # the tiny Qwen2's overrides


def arrays(poison=None):
    rng = np.random.RandomState(3)
    prompt = rng.randint(1, 64, (4, 6)).astype(np.int32)
    response = rng.randint(1, 64, (4, 5)).astype(np.int32)
    mask = np.ones((4, 5), np.int32)
    mask[1, 3:] = 0
    old = (rng.randn(4, 5) * 0.1 - 3).astype(np.float32)
    ref = (rng.randn(4, 5) * 0.1 - 3).astype(np.float32)
    advantages = np.array([1.0, -0.5, 0.7, -1.2], np.float32)
    if poison is not None:
        advantages[2] = poison
    weights = aggregation_weights(mask, "token-mean").astype(np.float32)
    return [prompt, np.ones_like(prompt), response, mask, old, ref, advantages, weights]


def parameters(net, optimizer) -> dict:
    """Every Parameter of the step by name: the weights, the AdamW moments, its step count and learning rate."""
    return {p.name: p for p in list(net.trainable_params()) + list(optimizer.get_parameters())}


def state(params: dict) -> dict:
    return {name: p.asnumpy().copy() for name, p in params.items()}


def restore(params: dict, saved: dict) -> None:
    """Puts `saved` back in place (the compiled step reads these Parameters; `set_data` would give them new
    tensors)."""
    for name, p in params.items():
        ops.assign(p, ms.Tensor(saved[name]))


@pytest.mark.parametrize("micro", [4, 2])  # the fused one-call step and gradient accumulation
def test_a_non_finite_batch_changes_nothing_and_the_next_update_is_unaffected(micro, graph_mode):
    """One compiled step runs the clean sequence and, from the same start, each poisoned one (NaN, then inf)."""
    net = Qwen2ForCausalLM(tiny_qwen2_config(**ONE_LAYER))
    init_random_weights(net, seed=1)
    optimizer = AdamW(net.trainable_params(), learning_rate=1e-2)
    step = MicroBatchedTrainStep(GRPOLossNet(net, GRPOLossCell(beta=0.04)), optimizer, grad_reduction="sum",
                                 max_grad_norm=1.0)
    params = parameters(net, optimizer)
    start = state(params)

    def run(batch_list):
        restore(params, start)
        norms = []
        for batch in batch_list:
            before = state(params)
            norms.append(step([[ms.Tensor(a[i:i + micro]) for a in batch] for i in range(0, 4, micro)])[1])
            if not np.isfinite(norms[-1]):
                after = state(params)
                assert all(np.array_equal(after[k], before[k], equal_nan=True) for k in before), "skip changed state"
        return norms, state(params)

    clean_norms, clean = run([arrays(), arrays()])
    assert all(np.isfinite(clean_norms)) and clean["adam_step"] == 2.0
    assert any(not np.array_equal(clean[k], start[k]) for k in start if k.startswith("model."))  # it learned
    for poison in (np.nan, np.inf):
        skipped_norms, skipped = run([arrays(), arrays(poison), arrays()])
        assert not np.isfinite(skipped_norms[1]), poison
        assert skipped["adam_step"] == 2.0  # the bad batch did not count as an update
        assert skipped_norms[0] == clean_norms[0] and skipped_norms[2] == clean_norms[1], poison
        for name, value in clean.items():
            np.testing.assert_array_equal(skipped[name], value, err_msg=f"{poison}: {name}")
