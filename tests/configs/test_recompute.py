"""Activation recompute: which layers recompute (`RecomputeConfig`, read from the YAML keys of MindFormers and
MindSpeed-RL), and that recomputing changes no loss or gradient of the actor's and the critic's loss nets. (With
pipeline stages and tensor parallel: `tests/parallel/test_pipeline.py`, its recompute variants.)"""
import dataclasses

import mindspore as ms
import numpy as np
import pytest
from support.batches import grpo_batch
from support.configs import TINY_QWEN2, tiny_qwen2_config

from mindrlhf.algorithms import GRPOLossCell, aggregation_weights
from mindrlhf.algorithms.policy_cells import GRPOLossNet, ValueLossNet
from mindrlhf.algorithms.value_loss_cell import ValueLossCell
from mindrlhf.configs.base import ConfigError
from mindrlhf.configs.recompute import RecomputeConfig
from mindrlhf.models.qwen2 import Qwen2Config, Qwen2ForCausalLM, Qwen2ForValue
from mindrlhf.parallel.layers import init_random_weights
from mindrlhf.parallel.layout import Layout
from mindrlhf.parallel.spmd import SPMDGradients

COLUMNS = ("prompt_ids", "prompt_mask", "response_ids", "response_mask")


@pytest.mark.parametrize("config,stage,stages,layers,expected", [
    (RecomputeConfig(), 0, 1, 4, (0, 0)),
    (RecomputeConfig(recompute=True), 1, 2, 3, (3, 0)),
    (RecomputeConfig(recompute=[2, 1]), 0, 2, 3, (2, 0)),
    (RecomputeConfig(recompute=[2, 1]), 1, 2, 3, (1, 0)),
    (RecomputeConfig(recompute=[1, 9]), 1, 2, 3, (3, 0)),
    (RecomputeConfig(select_recompute=True), 0, 1, 4, (0, 4)),
    (RecomputeConfig(recompute=[1, 0], select_recompute=[3, 2]), 0, 2, 4, (1, 2)),  # full layers come first
    (RecomputeConfig(recompute=True, select_recompute=True), 0, 1, 4, (4, 0)),
    (RecomputeConfig(recompute_granularity="full"), 0, 2, 5, (5, 0)),
    (RecomputeConfig(recompute_granularity="full", recompute_num_layers=2), 1, 2, 5, (2, 0)),
    (RecomputeConfig(recompute_granularity="full", recompute_num_layers=2, recompute_method="uniform"), 0, 1, 5,
     (5, 0)),
    (RecomputeConfig(recompute_granularity="selective", recompute_num_layers=3), 0, 1, 5, (0, 3)),
])
def test_layers_of_stage(config, stage, stages, layers, expected):
    config.validate()
    assert config.layers_of_stage(stage, stages, layers) == expected


def test_a_per_stage_list_needs_one_entry_per_stage():
    with pytest.raises(ConfigError, match=r"recompute_config.recompute=\[1, 2, 3\] has 3 entries; expected one per "
                                          r"pipeline stage \(2\)"):
        RecomputeConfig(recompute=[1, 2, 3]).layers_of_stage(0, 2, 4)


@pytest.mark.parametrize("field,value,message", [
    ("recompute_slice_activation", True, "recompute_config.recompute_slice_activation=true is not implemented; set "
                                         "it to false"),
    ("select_comm_recompute", True, "recompute_config.select_comm_recompute=true is not implemented"),
    ("mp_comm_recompute", False, "mp_comm_recompute=false is not possible here"),
    ("recompute_granularity", "layers", "recompute_granularity='layers'; expected full or selective"),
    ("recompute_method", "every", "recompute_method='every'; expected block or uniform"),
    ("recompute_num_layers", -1, "recompute_num_layers must be >= 0"),
    ("recompute", [1, -1], r"recompute_config.recompute=\[1, -1\]: layer counts must be >= 0"),
])
def test_what_recompute_cannot_do_is_refused_by_name(field, value, message):
    with pytest.raises(ConfigError, match=message):
        RecomputeConfig(**{field: value}).validate()


def _yaml(**top) -> dict:
    model_config = {key: value for key, value in TINY_QWEN2.items()}
    return {"model": {"model_config": model_config}, **top}


def test_recompute_and_optimizer_shard_are_read_from_mindformers_and_mindspeed_keys():
    cfg = Qwen2Config.from_dict(_yaml(recompute_config={"recompute": [1, 2], "select_recompute": False,
                                                        "parallel_optimizer_comm_recompute": True,
                                                        "mp_comm_recompute": True,
                                                        "recompute_slice_activation": False},
                                      parallel_config={"pipeline_stage": 2}, parallel={
                                          "enable_parallel_optimizer": True, "parallel_mode": 1}), "r.yaml")
    assert cfg.recompute.layers_of_stage(1, 2, 1) == (1, 0) and cfg.parallel_config.optimizer_shard
    legacy = Qwen2Config.from_dict(_yaml(parallel_config={"recompute": True, "optimizer_shard": True}), "l.yaml")
    assert legacy.recompute.recompute is True and legacy.parallel_config.optimizer_shard
    mindspeed = Qwen2Config.from_dict(_yaml(recompute_config={"recompute_granularity": "selective",
                                                              "recompute_num_layers": 1}), "m.yaml")
    assert mindspeed.recompute.layers_of_stage(0, 1, 2) == (0, 1)
    assert Qwen2Config.from_dict(cfg.to_dict(), "again").recompute == cfg.recompute  # written back as read
    with pytest.raises(ConfigError, match=r"one.yaml: recompute_config.recompute=\[1, 2\] has 2 entries; expected "
                                          r"one per pipeline stage \(1\)"):
        Qwen2Config.from_dict(_yaml(recompute_config={"recompute": [1, 2]}), "one.yaml")
    with pytest.raises(ConfigError, match=r"bad.yaml: recompute_config: unknown field\(s\) 'recompute_layers'"):
        Qwen2Config.from_dict(_yaml(recompute_config={"recompute_layers": 2}), "bad.yaml")


def test_the_configured_layers_are_the_ones_that_recompute():
    cfg = tiny_qwen2_config(num_layers=4, recompute=RecomputeConfig(recompute=[1, 0], select_recompute=[2, 1]))
    cfg.parallel_config.pipeline_stage = 2

    def marks(stage):
        model = Qwen2ForCausalLM(cfg, Layout(pp=2, rank=stage)).model
        return [(getattr(model.layers[i], "_has_config_recompute", False),
                 getattr(model.layers[i].attention, "_has_config_recompute", False)) for i in model.owned_layers]
    assert marks(0) == [(True, True), (False, True)]  # layer 0 whole (its attention with it), layer 1 attention
    assert marks(1) == [(False, True), (False, False)]


def _grads(net, loss_net, arrays):
    outputs, grads, norm = SPMDGradients(loss_net, net.trainable_params(), Layout(), grad_reduction="sum")(
        *[ms.Tensor(a) for a in arrays])
    return [o.asnumpy() for o in outputs], [g.asnumpy() for g in grads], float(norm.asnumpy())


def _assert_same(reference, other, what):
    for got, want in zip(other[0] + other[1], reference[0] + reference[1]):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7, err_msg=what)
    assert reference[2] > 0 and other[2] == pytest.approx(reference[2], rel=1e-6)


@pytest.mark.parametrize("role", ["actor", "critic"])
def test_recompute_changes_no_loss_or_gradient(role):
    """The GRPO loss (actor) and the clipped value loss (critic) over responses of unequal lengths, read after
    their shared prompt (prefix sharing): the outputs and every gradient with full and with selective recompute
    equal those without (1e-6)."""
    data = grpo_batch(TINY_QWEN2["vocab_size"])
    prompts = {k: data[k][::2].repeat(2, axis=0) for k in ("prompt_ids", "prompt_mask")}  # 2 responses a prompt
    arrays = [prompts["prompt_ids"], prompts["prompt_mask"], data["response_ids"], data["response_mask"]]
    weights = aggregation_weights(data["response_mask"], "token-mean").astype(np.float32)
    noise = data["noise"]
    results = {}
    for mode in ("off", "full", "selective"):
        cfg = tiny_qwen2_config(recompute=RecomputeConfig(recompute=mode == "full",
                                                          select_recompute=mode == "selective"))
        if role == "actor":
            net = Qwen2ForCausalLM(cfg)
            loss_net = GRPOLossNet(net, GRPOLossCell(beta=0.05, epsilon_low=0.05, epsilon_high=0.08,
                                                     kl_estimator="k3"))
            logp = -2.0 + 0.1 * noise[0]
            extra = [logp.astype(np.float32), (logp + 0.3 * noise[1]).astype(np.float32), data["advantages"]]
        else:
            net = Qwen2ForValue(dataclasses.replace(cfg, arch="Qwen2ForValue"))
            loss_net = ValueLossNet(net, ValueLossCell(cliprange_value=0.2))
            extra = [noise[0], noise[0] + noise[1]]
        init_random_weights(net, Layout(), seed=0)
        if role == "critic":
            net.score.weight.set_data(ms.Tensor(np.random.RandomState(1).randn(1, TINY_QWEN2["hidden_size"]),
                                                ms.float32))
        results[mode] = _grads(net, loss_net, arrays + [e.astype(np.float32) for e in extra] + [weights])
    for mode in ("full", "selective"):
        _assert_same(results["off"], results[mode], f"{role} with {mode} recompute")


def test_the_log_names_the_memory_features_a_net_runs():
    cfg = tiny_qwen2_config(num_layers=4, recompute=RecomputeConfig(recompute=[1, 2], select_recompute=True))
    assert tiny_qwen2_config().memory_features() == ""
    cfg.parallel_config.pipeline_stage = 2
    cfg.parallel_config.model_parallel = 2
    cfg.parallel_config.use_seq_parallel = True
    assert cfg.memory_features() == ("sequence parallel, full recompute of 1 of 2 layers of the first stage, "
                                     "attention recompute of 1 of 2 layers of the first stage")
    cfg.parallel_config.data_parallel, cfg.parallel_config.optimizer_shard = 2, True
    assert cfg.memory_features().endswith("AdamW moments sharded over data parallel 2")
