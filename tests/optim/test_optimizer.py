"""AdamW equals torch.optim.AdamW (bias correction, decoupled decay); the schedule; global-norm clipping."""
import math

import mindspore as ms
import numpy as np
import pytest
from mindspore import Parameter, Tensor, nn
from support.cells import ApplyGrads as ScaledApplyGrads  # (grads, scale)

from mindrlhf.optim import AdamW, learning_rate_at, update_groups

pytestmark = pytest.mark.usefixtures("graph_mode")

SHAPES = {"w1": (6, 5), "w2": (3, 4, 2), "bias": (5,), "norm": (7,)}
HYPER = dict(learning_rate=3e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)


def initial_and_grads(steps=3, seed=0):
    rng = np.random.default_rng(seed)
    weights = {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}
    # gradients of very different scales per tensor and step, as in a real run
    grads = [{k: (rng.standard_normal(s) * 10.0 ** rng.integers(-3, 2)).astype(np.float32) for k, s in SHAPES.items()}
             for _ in range(steps)]
    return weights, grads


class ApplyGrads(nn.Cell):
    def __init__(self, optimizer):
        super().__init__(auto_prefix=False)
        self.optimizer = optimizer

    def construct(self, grads):
        return self.optimizer(grads)


def run_mindspore(optimizer_cls, weights, grads, **kwargs):
    params = [Parameter(Tensor(v.copy()), name=k) for k, v in weights.items()]
    optimizer = optimizer_cls(params, **kwargs)
    step = ApplyGrads(optimizer)
    for g in grads:
        step(tuple(Tensor(g[k]) for k in weights))
    return {p.name: p.asnumpy() for p in params}, optimizer


def run_torch(weights, grads, max_norm=None):
    import torch
    params = {k: torch.nn.Parameter(torch.tensor(v.copy())) for k, v in weights.items()}
    decay = [p for k, p in params.items() if p.ndim > 1]
    no_decay = [p for k, p in params.items() if p.ndim == 1]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": HYPER["weight_decay"]},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=HYPER["learning_rate"],
                                  betas=(HYPER["beta1"], HYPER["beta2"]), eps=HYPER["eps"])
    norms = []
    for g in grads:
        for k, p in params.items():
            p.grad = torch.tensor(g[k])
        if max_norm is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(list(params.values()), max_norm)))
        optimizer.step()
    return {k: p.detach().numpy() for k, p in params.items()}, norms


def test_three_steps_equal_torch_adamw():
    weights, grads = initial_and_grads()
    ours, optimizer = run_mindspore(AdamW, weights, grads, **HYPER)
    theirs, _ = run_torch(weights, grads)
    for name in weights:
        # tight on purpose: both get the very same gradients (no noise for Adam to amplify), a bit-level algorithm check
        np.testing.assert_allclose(ours[name], theirs[name], rtol=1e-6, atol=1e-7, err_msg=name)
        assert not np.allclose(ours[name], weights[name])
    assert float(optimizer.adam_step.asnumpy()) == 3.0
    state = {p.name for p in optimizer.get_parameters()}
    assert {"adam_m.w1", "adam_v.w1", "adam_step", "learning_rate"} <= state


def test_mindspore_adamweightdecay_has_no_bias_correction():
    # why the project has its own AdamW: without bias correction the first update is (1 - beta1) / sqrt(1 - beta2)
    # times torch's (0.45x with beta2 0.95, 3.2x with beta2 0.999), so learning rates from papers do not transfer
    weights, grads = initial_and_grads(steps=1)
    theirs, _ = run_torch(weights, grads)
    builtin, _ = run_mindspore(nn.AdamWeightDecay, weights, grads, **HYPER)
    step_torch = np.abs(theirs["w1"] - weights["w1"]).mean()
    step_builtin = np.abs(builtin["w1"] - weights["w1"]).mean()
    expected = (1 - HYPER["beta1"]) / math.sqrt(1 - HYPER["beta2"])
    assert step_builtin / step_torch == pytest.approx(expected, rel=0.05)


def test_learning_rate_is_set_from_the_host():
    weights, grads = initial_and_grads(steps=1)
    params = [Parameter(Tensor(v.copy()), name=k) for k, v in weights.items()]
    optimizer = AdamW(params, **HYPER)
    optimizer.set_learning_rate(0.0)
    ApplyGrads(optimizer)(tuple(Tensor(grads[0][k]) for k in weights))
    for p in params:  # lr 0: neither decay nor update moves the weights
        np.testing.assert_array_equal(p.asnumpy(), weights[p.name])


def test_schedule_values():
    assert learning_rate_at(0, 1.0, warmup_steps=4, total_steps=10) == 0.25
    assert learning_rate_at(3, 1.0, warmup_steps=4, total_steps=10) == 1.0
    assert learning_rate_at(9, 1.0, warmup_steps=4, total_steps=10) == 1.0
    # cosine: peak right after warmup, half-way at the middle of the decay, min at the last update
    assert learning_rate_at(4, 2.0, 4, 10, "cosine") == pytest.approx(2.0)
    assert learning_rate_at(4 + 5 / 2, 2.0, 4, 10, "cosine", 0.1) == pytest.approx(2.0 * (0.1 + 0.9 * 0.5))
    assert learning_rate_at(9, 2.0, 4, 10, "cosine", 0.1) == pytest.approx(0.2)
    assert learning_rate_at(50, 2.0, 4, 10, "cosine", 0.1) == pytest.approx(0.2)
    assert learning_rate_at(2, 1.0, 0, 5, "cosine") == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.5)))
    for bad in (dict(schedule="linear"), dict(min_lr_ratio=2.0), dict(total_steps=0), dict(step=-1)):
        kwargs = {"step": 0, "base_lr": 1.0, "total_steps": 5, **bad}
        with pytest.raises(ValueError):
            learning_rate_at(**kwargs)


def test_clipping_equals_torch_clip_grad_norm():
    from mindspore import ops

    from mindrlhf.parallel.spmd import SPMDTrainStep

    weights, grads = initial_and_grads(steps=3, seed=3)

    class GivenGradLoss(nn.Cell):
        """loss = sum(w * g) for fixed g: its gradient is g (fed as inputs)."""

        def __init__(self):
            super().__init__()
            self.params = nn.CellList()
            self.weights = [Parameter(Tensor(v.copy()), name=k) for k, v in weights.items()]
            for i, p in enumerate(self.weights):
                setattr(self, f"p{i}", p)

        def construct(self, *gs):
            loss = ops.zeros((), ms.float32)
            for p, g in zip(self.weights, gs):
                loss = loss + (p * g).sum()
            return loss, ops.stop_gradient(loss)

    loss_net = GivenGradLoss()
    optimizer = AdamW(loss_net.weights, **HYPER)
    step = SPMDTrainStep(loss_net, optimizer, max_grad_norm=1.0)
    norms = []
    for g in grads:
        _, norm = step(*(Tensor(g[k]) for k in weights))
        norms.append(float(norm.asnumpy()))
    theirs, torch_norms = run_torch(weights, grads, max_norm=1.0)
    np.testing.assert_allclose(norms, torch_norms, rtol=1e-5)
    assert max(torch_norms) > 1.0  # the clip was active
    for p in loss_net.weights:
        # tight on purpose: the same gradients; clip factors that agree to ~1e-7 scale every element alike (Adam
        # cancels a common scale), so no near-zero gradient differs by noise; 1e-6 is ~3e-4 of an update at lr 3e-3
        np.testing.assert_allclose(p.asnumpy(), theirs[p.name], rtol=1e-5, atol=1e-6, err_msg=p.name)


def test_sum_of_squares_by_rows_equals_the_full_sum(graph_mode):
    from mindrlhf.parallel.spmd import sum_of_squares

    class SumsOfSquares(nn.Cell):
        def construct(self, *xs):
            return tuple(sum_of_squares(x) for x in xs)

    rng = np.random.default_rng(4)
    arrays = [rng.standard_normal(shape).astype(np.float32) for shape in ((), (7,), (5, 3), (2, 3, 4))]
    got = SumsOfSquares()(*(Tensor(a) for a in arrays))
    for a, value in zip(arrays, got):
        assert value.shape == ()
        assert float(value.asnumpy()) == pytest.approx(float((a.astype(np.float64) ** 2).sum()), rel=1e-6)


def test_update_groups_fill_a_byte_budget_with_consecutive_parameters():
    # float32 bytes 40, 80, 20, 400, 4: a group closes before the parameter that would pass 100 bytes; a parameter
    # larger than the budget is a group of its own
    assert update_groups([10, 20, 5, 100, 1], group_bytes=100) == ((0, 1), (1, 3), (3, 4), (4, 5))
    assert update_groups([10, 20, 5, 100, 1], group_bytes=10**6) == ((0, 5),)
    assert update_groups([7], group_bytes=4) == ((0, 1),)
    assert update_groups([]) == ()


@pytest.mark.parametrize("scaled", [False, True])
def test_parameters_updated_in_several_groups_equal_one_group_bit_for_bit(scaled):
    """The groups only order the updates: a parameter per group gives the weights and moments of one group."""
    weights, grads = initial_and_grads()
    results = []
    for groups in (((0, 4),), ((0, 1), (1, 2), (2, 3), (3, 4))):
        params = [Parameter(Tensor(v.copy()), name=k) for k, v in weights.items()]
        optimizer = AdamW(params, **HYPER)
        optimizer.groups = groups
        step = ScaledApplyGrads(optimizer) if scaled else ApplyGrads(optimizer)
        for g in grads:
            inputs = tuple(Tensor(g[k]) for k in weights)
            step(inputs, Tensor(0.37, ms.float32)) if scaled else step(inputs)
        results.append({p.name: p.asnumpy() for p in (*params, *optimizer.moments1, *optimizer.moments2)})
    one, several = results
    assert one.keys() == several.keys() and len(one) == 12
    for name in one:
        np.testing.assert_array_equal(several[name], one[name], err_msg=name)
    assert not np.array_equal(one["w1"], weights["w1"])  # the updates ran
