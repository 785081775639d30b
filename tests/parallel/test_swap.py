"""Host swap bookkeeping on CPU (where `Parameter._offload/_load` are no-ops) and the Ascend call path."""
from __future__ import annotations

import logging

import mindspore as ms
import numpy as np
import pytest
from mindspore import Parameter, Tensor, nn, ops

from mindrlhf.parallel.swap import SwapError, SwapManager, format_bytes

# group names are the caller's; these are the trainer's (mindrlhf.trainer.roles)
TRAIN_WEIGHTS, OPTIMIZER_MOMENTS, INFER_WEIGHTS, REF_WEIGHTS = (
    "train_weights", "optimizer_moments", "infer_weights", "ref_weights")


def make_params(prefix: str, dtype=np.float32) -> list[Parameter]:
    rng = np.random.default_rng(len(prefix))
    return [Parameter(Tensor(rng.standard_normal((4, 3)).astype(dtype)), name=f"{prefix}.w"),
            Parameter(Tensor(rng.standard_normal(5).astype(dtype)), name=f"{prefix}.b")]


def snapshot(params) -> list[bytes]:
    return [p.asnumpy().tobytes() for p in params]


@pytest.fixture
def swap():
    manager = SwapManager()
    manager.register(TRAIN_WEIGHTS, make_params("train"))
    manager.register(OPTIMIZER_MOMENTS, make_params("adam_m", np.float16))
    manager.register(INFER_WEIGHTS, make_params("infer"))
    return manager


def test_resident_bytes_per_group(swap):
    assert swap.resident_bytes() == {TRAIN_WEIGHTS: 17 * 4, OPTIMIZER_MOMENTS: 17 * 2, INFER_WEIGHTS: 17 * 4}
    assert swap.offload(OPTIMIZER_MOMENTS, "generation") == 34
    assert swap.resident_bytes() == {TRAIN_WEIGHTS: 68, OPTIMIZER_MOMENTS: 0, INFER_WEIGHTS: 68}
    assert swap.group_bytes(OPTIMIZER_MOMENTS) == 34
    assert swap.groups == (TRAIN_WEIGHTS, OPTIMIZER_MOMENTS, INFER_WEIGHTS)


def test_cpu_round_trip_keeps_values_and_flips_bookkeeping(swap):
    assert ms.get_context("device_target") == "CPU" and not swap.offloads_for_real
    before = snapshot(swap.params(TRAIN_WEIGHTS))
    assert swap.offload(TRAIN_WEIGHTS, "generation") == 68
    assert not swap.is_resident(TRAIN_WEIGHTS)
    assert snapshot(swap.params(TRAIN_WEIGHTS)) == before  # CPU: nothing moves
    assert swap.load(TRAIN_WEIGHTS, "train") == 68
    assert swap.is_resident(TRAIN_WEIGHTS) and snapshot(swap.params(TRAIN_WEIGHTS)) == before
    assert [(e.phase, e.group, e.action, e.nbytes) for e in swap.events] == [
        ("generation", TRAIN_WEIGHTS, "offload", 68), ("train", TRAIN_WEIGHTS, "load", 68)]


def test_offload_and_load_are_idempotent(swap):
    assert swap.offload(INFER_WEIGHTS) == 68
    assert swap.offload(INFER_WEIGHTS) == 0
    assert swap.load(INFER_WEIGHTS) == 68
    assert swap.load(INFER_WEIGHTS) == 0
    assert len(swap.events) == 2


def test_unknown_group(swap):
    with pytest.raises(SwapError, match="unknown swap group 'ref_weights' "
                                        r"\(registered: train_weights, optimizer_moments, infer_weights\)"):
        swap.offload("ref_weights")
    with pytest.raises(SwapError, match="unknown swap group 'ref'"):
        swap.assert_plan(resident=["ref"], phase="generation")


def test_registration_errors(swap):
    shared = swap.params(TRAIN_WEIGHTS)[0]
    with pytest.raises(SwapError, match="parameter 'train.w' is already in swap group 'train_weights'; "
                                        "it cannot also be in group 'ref_weights'"):
        swap.register("ref_weights", [shared])
    with pytest.raises(SwapError, match="parameter 'infer.w' is already in swap group 'infer_weights'"):
        swap.register("ref_weights", make_params("infer"))  # other objects, same names
    with pytest.raises(SwapError, match="'ref_weights': parameter 'ref.w' given twice"):
        p = make_params("ref")[0]
        swap.register("ref_weights", [p, p])
    with pytest.raises(SwapError, match="'train_weights' is already registered"):
        swap.register(TRAIN_WEIGHTS, make_params("more"))
    with pytest.raises(SwapError, match="'empty': no parameters"):
        swap.register("empty", [])
    with pytest.raises(TypeError, match="'bad': item 0 is a Tensor"):
        swap.register("bad", [Tensor(np.ones(2))])
    assert "ref_weights" not in swap.groups
    assert swap.register("ref_weights", make_params("ref")) == 68


def test_a_growing_group_takes_buffers_made_while_it_is_resident(swap):
    assert swap.register("kv_caches", (), growing=True) == 0
    swap.apply_plan("generate", resident=["kv_caches", INFER_WEIGHTS], offloaded=[TRAIN_WEIGHTS, OPTIMIZER_MOMENTS])
    assert swap.extend("kv_caches", make_params("kv.8")) == 68
    assert swap.extend("kv_caches", make_params("kv.4")) == 136  # a smaller cache for the rollout's tail
    swap.apply_plan("train", resident=[TRAIN_WEIGHTS, OPTIMIZER_MOMENTS], offloaded=["kv_caches", INFER_WEIGHTS])
    assert [(e.group, e.action, e.nbytes) for e in swap.events if e.group == "kv_caches"] == [
        ("kv_caches", "offload", 136)]
    with pytest.raises(SwapError, match="'kv_caches' is offloaded: its buffers can only be made in a phase where"):
        swap.extend("kv_caches", make_params("kv.2"))
    with pytest.raises(SwapError, match="'train_weights' was registered whole"):
        swap.extend(TRAIN_WEIGHTS, make_params("more"))
    swap.load("kv_caches")
    with pytest.raises(SwapError, match="parameter 'kv.8.w' is already in swap group 'kv_caches'"):
        swap.extend("kv_caches", make_params("kv.8"))


def test_assert_plan(swap):
    swap.apply_plan("generation", resident=[INFER_WEIGHTS], offloaded=[TRAIN_WEIGHTS, OPTIMIZER_MOMENTS])
    swap.assert_plan(resident=[INFER_WEIGHTS], offloaded=[TRAIN_WEIGHTS, OPTIMIZER_MOMENTS], phase="generation")
    with pytest.raises(SwapError) as err:
        swap.assert_plan(resident=[TRAIN_WEIGHTS, OPTIMIZER_MOMENTS], offloaded=[INFER_WEIGHTS], phase="train")
    assert str(err.value) == ("swap plan violated in phase 'train': expected resident but offloaded: "
                              "train_weights, optimizer_moments; expected offloaded but resident: infer_weights")
    with pytest.raises(SwapError, match="phase 'x': group\\(s\\) infer_weights both resident and offloaded"):
        swap.assert_plan(resident=[INFER_WEIGHTS], offloaded=[INFER_WEIGHTS], phase="x")


def test_apply_plan_moves_and_records(swap):
    moved = swap.apply_plan("generation", resident=[INFER_WEIGHTS], offloaded=[TRAIN_WEIGHTS, OPTIMIZER_MOMENTS])
    assert moved == 68 + 34
    assert swap.apply_plan("generation", resident=[INFER_WEIGHTS], offloaded=[TRAIN_WEIGHTS]) == 0
    assert swap.apply_plan("train", resident=[TRAIN_WEIGHTS, OPTIMIZER_MOMENTS], offloaded=[INFER_WEIGHTS]) == 170
    assert [e.action for e in swap.events] == ["offload", "offload", "offload", "load", "load"]  # offload first
    assert swap.phase_plan[-1] == ("train", (TRAIN_WEIGHTS, OPTIMIZER_MOMENTS))
    text = swap.summary()
    assert "swap groups (CPU, bookkeeping only):" in text
    assert "train_weights" in text and "offloads=1 loads=1 moved=136 B" in text
    assert "phase generation: resident infer_weights (68 B)" in text
    assert "phase train: resident train_weights, optimizer_moments (102 B)" in text


def test_check_resident(swap):
    swap.check_resident([INFER_WEIGHTS, TRAIN_WEIGHTS], "generation.prefill")
    swap.offload(INFER_WEIGHTS, "train")
    with pytest.raises(SwapError, match="'generation.decode' uses offloaded swap group\\(s\\) infer_weights; load "
                                        "them first \\(resident now: train_weights, optimizer_moments\\)"):
        swap.check_resident(INFER_WEIGHTS, "generation.decode")
    with pytest.raises(SwapError, match="'ref.logprobs' uses offloaded swap group\\(s\\) infer_weights"):
        swap.check_resident(INFER_WEIGHTS, "ref.logprobs")


class _Linear(nn.Cell):
    def __init__(self, weight: Parameter):
        super().__init__()
        self.weight = weight

    def construct(self, x):
        return ops.matmul(x, self.weight)


def test_debug_mode_poisons_offloaded_floats_and_restores_exactly():
    swap = SwapManager(debug=True)
    weight = Parameter(Tensor(np.arange(6, dtype=np.float32).reshape(2, 3)), name="dbg.w")
    counter = Parameter(Tensor(np.array([7], np.int32)), name="dbg.step", requires_grad=False)
    swap.register(TRAIN_WEIGHTS, [weight, counter])
    before = snapshot([weight, counter])
    net, x = _Linear(weight), Tensor(np.ones((1, 2), np.float32))
    mode = ms.get_context("mode")
    ms.set_context(mode=ms.GRAPH_MODE)
    try:
        expected = net(x).asnumpy()
        swap.offload(TRAIN_WEIGHTS, "generation")
        assert np.isnan(weight.asnumpy()).all() and np.isnan(net(x).asnumpy()).all()  # an unchecked read shows
        assert counter.asnumpy().tolist() == [7]  # non-float parameters are left alone
        with pytest.raises(SwapError, match="'train.step' uses offloaded swap group\\(s\\) train_weights"):
            swap.check_resident(TRAIN_WEIGHTS, "train.step")
        swap.load(TRAIN_WEIGHTS, "train")
        assert snapshot([weight, counter]) == before
        assert np.array_equal(net(x).asnumpy(), expected)
    finally:
        ms.set_context(mode=mode)


def test_ascend_path_calls_parameter_offload_and_load(monkeypatch):
    calls = []
    monkeypatch.setattr(Parameter, "_offload", lambda self: calls.append(("offload", self.name)))
    monkeypatch.setattr(Parameter, "_load", lambda self: calls.append(("load", self.name)))
    swap = SwapManager(device_target="Ascend", debug=True)
    swap.register(REF_WEIGHTS, make_params("ref"))
    assert swap.offloads_for_real
    swap.offload(REF_WEIGHTS, "train")
    swap.offload(REF_WEIGHTS, "train")
    swap.load(REF_WEIGHTS, "ref")
    assert calls == [("offload", "ref.w"), ("offload", "ref.b"), ("load", "ref.w"), ("load", "ref.b")]
    assert "(Ascend, real offload, debug)" in swap.summary()


def test_transitions_are_logged(swap, caplog):
    with caplog.at_level(logging.DEBUG, logger="mindrlhf.parallel.swap"):
        swap.offload(TRAIN_WEIGHTS, "generation")
    assert any("swap offload train_weights: 2 parameters, 68 B" in r.getMessage() and "phase generation" in
               r.getMessage() for r in caplog.records)


def test_format_bytes():
    assert [format_bytes(n) for n in (0, 1023, 1024, 5 * 2**20, 3 * 2**30)] == [
        "0 B", "1023 B", "1.00 KiB", "5.00 MiB", "3.00 GiB"]
