"""Tensor-parallel bookkeeping that needs no second process (split axes, shards, seeded init), and the layer
helpers' values and memory on the CPU backend."""
import sys

import numpy as np
import pytest

from mindrlhf.models.qwen2 import Qwen2Config, Qwen2ForCausalLM
from mindrlhf.models.qwen2.names import ms_to_hf_name
from mindrlhf.parallel.layers import (
    full_shape,
    init_random_weights,
    load_full_state,
    param_split_axes,
    random_full_state,
    shard_array,
)
from mindrlhf.parallel.layout import Layout

CONFIG = dict(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, n_kv_heads=2, intermediate_size=48,
              seq_length=32, max_position_embedding=32, qkv_has_bias=True)

# Megatron placement: columns (output features) of q/k/v/gate/up and the vocab rows split; o/down by input.
EXPECTED_AXES = {"embedding_weight": 0, "wq.weight": 0, "wq.bias": 0, "wk.weight": 0, "wv.bias": 0,
                 "wo.weight": 1, "w1.weight": 0, "w3.weight": 0, "w2.weight": 1, "attention_norm.weight": None,
                 "ffn_norm.weight": None, "norm_out.weight": None, "lm_head.weight": 0}


def net(tp=1, rank=0, **overrides):
    return Qwen2ForCausalLM(Qwen2Config(**{**CONFIG, **overrides}), Layout(dp=1, tp=tp, rank=rank))


def test_split_axes_follow_megatron():
    axes = param_split_axes(net(tp=2))
    assert all(ms_to_hf_name(name) for name in axes)
    for suffix, axis in EXPECTED_AXES.items():
        matching = [a for n, a in axes.items() if n.endswith(suffix)]
        assert matching and set(matching) == {axis}, suffix


def test_shards_have_the_expected_local_shapes_and_rebuild_the_full_tensor():
    single, shards = net(), [net(tp=2, rank=r) for r in range(2)]
    axes = param_split_axes(single)
    for p in single.get_parameters():
        local = dict((q.name, q) for q in shards[0].get_parameters())[p.name]
        assert full_shape(tuple(local.shape), axes[p.name], 2) == tuple(p.shape), p.name
    full = np.arange(48 * 32, dtype=np.float32).reshape(48, 32)
    rebuilt = np.concatenate([shard_array(full, 0, 2, r) for r in range(2)], axis=0)
    np.testing.assert_array_equal(rebuilt, full)


def test_seeded_init_is_the_same_whatever_the_layout():
    single = net()
    init_random_weights(single, seed=5)
    axes = param_split_axes(single)
    parts = []
    for rank in range(2):
        shard_net = net(tp=2, rank=rank)
        init_random_weights(shard_net, Layout(dp=1, tp=2, rank=rank), seed=5)
        parts.append({p.name: p.asnumpy() for p in shard_net.get_parameters()})
    for p in single.get_parameters():
        axis = axes[p.name]
        rebuilt = parts[0][p.name] if axis is None else np.concatenate([parts[0][p.name], parts[1][p.name]], axis)
        np.testing.assert_array_equal(rebuilt, p.asnumpy(), err_msg=p.name)
    other_seed = random_full_state(single, seed=6)
    for name in ("lm_head.weight", "model.norm_out.weight"):
        assert not np.allclose(other_seed[name], random_full_state(single, seed=5)[name]), name


def test_loading_a_wrong_shape_names_the_parameter():
    target = net()
    state = random_full_state(target)
    state["model.layers.1.feed_forward.w2.weight"] = np.zeros((32, 40), np.float32)
    with pytest.raises(ValueError, match=r"model.layers.1.feed_forward.w2.weight: shard shape \(32, 40\)"):
        load_full_state(target, state)
    del state["model.layers.1.feed_forward.w2.weight"]
    with pytest.raises(ValueError, match="missing from the state: model.layers.1.feed_forward.w2.weight"):
        load_full_state(target, state)


def test_logits_scaled_by_the_temperature_keep_no_per_element_tables_on_cpu():
    """The reference pass's graph at temperature 0.7 keeps what it keeps at 1.0 (`tests/workers/graph_memory.py`,
    one decoder layer, 16 x 96 responses at a vocabulary of 8192: a division by the temperature kept 192 MiB more,
    16 bytes an element of the logits); the scaled logits are within an ulp of the quotient."""
    import json

    import mindspore as ms
    from support.msrun import run_command
    from support.paths import WORKERS_DIR

    from mindrlhf.parallel.layers import scaled_by_temperature

    def kept_mib(temperature: float) -> float:
        cmd = [sys.executable, str(WORKERS_DIR / "graph_memory.py"), "--layers", "1", "--vocab", "8192", "--kind",
               "forward", "--temperature", str(temperature), "--calls", "[[2, 16, 72, 96]]"]
        proc = run_command(cmd, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])["calls"][0]["kept_mib"]

    plain = kept_mib(1.0)
    assert 150 < plain and kept_mib(0.7) < plain + 48
    x = np.random.default_rng(0).standard_normal((4, 1000)).astype(np.float32) * 30
    scaled = scaled_by_temperature(ms.Tensor(x), 0.7).asnumpy()
    np.testing.assert_array_max_ulp(scaled, x / np.float32(0.7), maxulp=1)
    assert scaled_by_temperature(x, 1.0) is x


def test_expand_as_broadcasts_large_operands_only_and_keeps_values():
    import mindspore as ms
    from mindspore import nn

    from mindrlhf.parallel.layers import EXPAND_MIN_ELEMENTS, expand_as

    class Scale(nn.Cell):
        def construct(self, x, w):
            full = expand_as(w, x)
            return full, x * full

    rng = np.random.default_rng(0)
    w = rng.standard_normal(64).astype(np.float32)
    for rows in (EXPAND_MIN_ELEMENTS // 64, 4):  # large: broadcast in the graph; small: left to the op
        x = rng.standard_normal((rows, 64)).astype(np.float32)
        full, product = Scale()(ms.Tensor(x), ms.Tensor(w))
        assert full.shape == ((rows, 64) if rows * 64 >= EXPAND_MIN_ELEMENTS else (64,))
        np.testing.assert_array_equal(product.asnumpy(), x * w)
