"""LoRA adapters on the Qwen2 net's linear layers (#68): a layer's output is W x + b + (alpha / r) B A x, a whole
net with adapters computes the logits of the merged weights, PEFT's start (B = 0) leaves the base net's logits, only
the adapters are trainable and a step changes nothing else; the config refuses bad values in one line."""
import numpy as np
import pytest

ms = pytest.importorskip("mindspore")

from mindspore import Tensor  # noqa: E402

from mindrlhf.configs.base import ConfigError  # noqa: E402
from mindrlhf.configs.lora import TARGET_MODULES, LoraConfig, is_adapter  # noqa: E402, is_adapter
from mindrlhf.models.qwen2 import Qwen2Config, Qwen2ForCausalLM  # noqa: E402
from mindrlhf.optim import AdamW  # noqa: E402
from mindrlhf.parallel.layers import (  # noqa: E402
    ColumnParallelLinear,
    RowParallelLinear,
    load_full_state,
    lora_full_state,
    param_split_axes,
    param_split_shards,
    random_full_state,
)
from mindrlhf.parallel.layout import Layout  # noqa: E402

MODEL = dict(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, n_kv_heads=2, intermediate_size=48,
             seq_length=16, max_position_embedding=16)
# HF module -> this net's layer name
LAYER = {"q_proj": "attention.wq", "k_proj": "attention.wk", "v_proj": "attention.wv", "o_proj": "attention.wo",
         "gate_proj": "feed_forward.w1", "up_proj": "feed_forward.w3", "down_proj": "feed_forward.w2"}

pytestmark = pytest.mark.usefixtures("graph_mode")


def config(**lora) -> Qwen2Config:
    return Qwen2Config(**MODEL, lora=LoraConfig(**lora) if lora else LoraConfig())


@pytest.mark.parametrize("kind", ["column", "row"])
def test_a_layers_output_is_the_weight_plus_the_scaled_low_rank_product(kind):
    rng = np.random.default_rng(0)
    cls = ColumnParallelLinear if kind == "column" else RowParallelLinear
    layer = cls(12, 10, has_bias=True, name="probe")
    layer.add_lora(3, alpha=6.0)
    values = {"weight": rng.normal(size=(10, 12)), "bias": rng.normal(size=10), "lora_a": rng.normal(size=(3, 12)),
              "lora_b": rng.normal(size=(10, 3))}
    for name, value in values.items():
        getattr(layer, name).set_data(Tensor(value.astype(np.float32)))
    x = rng.normal(size=(2, 5, 12)).astype(np.float32)
    got = layer(Tensor(x)).asnumpy()
    w, b, a, lb = (values[k] for k in ("weight", "bias", "lora_a", "lora_b"))
    expected = x @ w.T + b + (6.0 / 3) * (x @ a.T) @ lb.T
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def merged_state(state: dict, lora: LoraConfig) -> dict:
    """The base net's weights with each adapter's delta (alpha / r) B A added in."""
    merged = {k: v.copy() for k, v in state.items() if not is_adapter(k)}
    for name in state:
        if name.endswith(".lora_a"):
            layer = name[:-len(".lora_a")]
            merged[layer + ".weight"] += lora.scaling * state[layer + ".lora_b"] @ state[name]
    return merged


def test_a_net_with_adapters_computes_the_merged_weights_logits_and_starts_as_the_base_net():
    lora = LoraConfig(lora_rank=4, lora_alpha=8.0, lora_target_modules=["q_proj", "v_proj", "down_proj"])
    adapted, base = Qwen2ForCausalLM(config(**vars(lora))), Qwen2ForCausalLM(config())
    adapters = sorted(p.name for p in adapted.get_parameters() if is_adapter(p.name))
    assert adapters == sorted(f"model.layers.{i}.{LAYER[m]}.lora_{ab}" for i in range(2)
                              for m in ("q_proj", "v_proj", "down_proj") for ab in "ab")
    state = random_full_state(adapted, seed=3)  # B random too: the adapters change the logits
    load_full_state(adapted, state)
    load_full_state(base, merged_state(state, lora))
    ids = Tensor(np.random.default_rng(1).integers(0, 64, (2, 9)).astype(np.int32))
    logits = adapted(ids).asnumpy()
    np.testing.assert_allclose(logits, base(ids).asnumpy(), rtol=1e-4, atol=1e-4)
    load_full_state(base, {k: v for k, v in state.items() if not is_adapter(k)})
    assert np.abs(logits - base(ids).asnumpy()).max() > 1e-2
    # PEFT's start: A random, B zero -> the base net's logits
    start = lora_full_state(adapted, seed=7)
    assert all(not v.any() for k, v in start.items() if k.endswith(".lora_b"))
    a = start["model.layers.0.attention.wq.lora_a"]
    assert a.shape == (4, 32) and 0.9 / np.sqrt(32) < np.abs(a).max() <= 1 / np.sqrt(32)
    load_full_state(adapted, start, strict=False)
    np.testing.assert_allclose(adapted(ids).asnumpy(), base(ids).asnumpy(), rtol=1e-5, atol=1e-5)


def test_a_merged_twin_holds_the_weights_with_the_adapters_merged_in_and_shares_the_rest():
    """`MergedAdapters`: the net without adapters gets W + (alpha / r) B A in each adapted layer (numpy's), computes
    the adapted net's logits, holds every other parameter as the source's own object, and a call after the adapters
    moved writes the new merge (the base weights untouched)."""
    from mindrlhf.models.qwen2.modeling import MergedAdapters

    lora = LoraConfig(lora_rank=4, lora_alpha=8.0, lora_target_modules=["q_proj", "v_proj", "down_proj"])
    source = Qwen2ForCausalLM(config(**vars(lora)))
    source.update_parameters_name("infer.")
    state = random_full_state(source, seed=3)
    load_full_state(source, state)
    twin = Qwen2ForCausalLM(config())
    twin.update_parameters_name("merged.")
    merge = MergedAdapters(twin, source)
    merge()
    source_params = {id(p) for p in source.get_parameters()}
    own = sorted(p.name for p in twin.get_parameters() if id(p) not in source_params)
    assert own == sorted(f"merged.model.layers.{i}.{LAYER[m]}.weight" for i in range(2)
                         for m in ("q_proj", "v_proj", "down_proj"))
    plain = {k[len("infer."):]: v for k, v in state.items()}
    expected = merged_state(plain, lora)
    for p in twin.get_parameters():
        np.testing.assert_allclose(p.asnumpy(), expected[p.name.split(".", 1)[1]], rtol=1e-6, atol=1e-6,
                                   err_msg=p.name)
    ids = Tensor(np.random.default_rng(1).integers(0, 64, (2, 9)).astype(np.int32))
    np.testing.assert_allclose(twin(ids).asnumpy(), source(ids).asnumpy(), rtol=1e-4, atol=1e-4)
    moved = {**state, **{k: v + 0.5 for k, v in state.items() if k.endswith(".lora_b")}}
    load_full_state(source, moved)
    merge()
    expected = merged_state({k[len("infer."):]: v for k, v in moved.items()}, lora)
    for p in twin.get_parameters():
        np.testing.assert_allclose(p.asnumpy(), expected[p.name.split(".", 1)[1]], rtol=1e-6, atol=1e-6,
                                   err_msg=p.name)
    for p in source.get_parameters():
        np.testing.assert_array_equal(p.asnumpy(), moved[p.name], err_msg=p.name)
    with pytest.raises(ValueError, match="no adapters"):
        MergedAdapters(Qwen2ForCausalLM(config()), Qwen2ForCausalLM(config()))


def test_a_reference_copies_the_base_weights_of_a_net_with_adapters_and_keeps_its_own_memory():
    """`copy_weights` (the reference's sync from the policy's inference net): every weight of the net without adapters
    equals the source's at its place, a later change of the source leaves the copy alone, and a source of another
    shape is refused naming the parameter."""
    from mindrlhf.models.qwen2.modeling import copy_weights

    source = Qwen2ForCausalLM(config(lora_rank=2))
    source.update_parameters_name("infer.")
    state = random_full_state(source, seed=5)
    load_full_state(source, state)
    reference = Qwen2ForCausalLM(config())
    reference.update_parameters_name("ref.")
    copy_weights(reference, source)
    copied = {p.name[len("ref."):]: p.asnumpy().copy() for p in reference.get_parameters()}
    assert {f"infer.{k}" for k in copied} == {k for k in state if not is_adapter(k)}
    for name, value in copied.items():
        np.testing.assert_array_equal(value, state[f"infer.{name}"], err_msg=name)
    load_full_state(source, random_full_state(source, seed=6))
    for p in reference.get_parameters():
        np.testing.assert_array_equal(p.asnumpy(), copied[p.name[len("ref."):]], err_msg=p.name)
    wider = Qwen2ForCausalLM(Qwen2Config(**{**MODEL, "intermediate_size": 64}))
    with pytest.raises(ValueError, match=r"copy_weights: model\.layers\.0\.feed_forward\.w1\.weight is "):
        copy_weights(wider, reference)


def test_only_the_adapters_train_and_a_step_changes_nothing_else():
    net = Qwen2ForCausalLM(config(lora_rank=2))
    load_full_state(net, random_full_state(net, seed=4))  # B != 0: A gets a gradient too
    trainable = [p.name for p in net.trainable_params()]
    assert trainable and all(is_adapter(n) for n in trainable)
    assert len(trainable) == 2 * 7 * MODEL["num_layers"]
    before = {p.name: p.asnumpy().copy() for p in net.get_parameters()}
    optimizer = AdamW(net.trainable_params(), learning_rate=1e-2, weight_decay=0.0)
    ids = Tensor(np.random.default_rng(2).integers(0, 64, (2, 8)).astype(np.int32))

    def loss_fn(ids):
        return -net.log_probs(ids[:, :-1], ids[:, 1:]).mean()

    grad_fn = ms.value_and_grad(loss_fn, None, optimizer.parameters)
    _, grads = grad_fn(ids)
    optimizer(grads)
    for p in net.get_parameters():
        moved = not np.array_equal(p.asnumpy(), before[p.name])
        assert moved == is_adapter(p.name), p.name


def test_the_adapters_split_like_their_layers_weights():
    """Column-parallel: A whole, B split on its output (with tp over the kv heads, B of k/v shared like the
    weight); row-parallel: A split on its input, B whole."""
    axes, shards = {}, {}
    for tp in (2, 4):
        net = Qwen2ForCausalLM(config(lora_rank=2), Layout(dp=1, tp=tp, rank=0))
        axes, shards = param_split_axes(net), param_split_shards(net, tp)
        layer = "model.layers.0."
        for module in ("q_proj", "k_proj", "gate_proj"):
            assert (axes[layer + LAYER[module] + ".lora_a"], axes[layer + LAYER[module] + ".lora_b"]) == (None, 0)
        for module in ("o_proj", "down_proj"):
            assert (axes[layer + LAYER[module] + ".lora_a"], axes[layer + LAYER[module] + ".lora_b"]) == (1, None)
        kv_shards = min(tp, MODEL["n_kv_heads"])
        assert shards[layer + "attention.wk.lora_b"] == shards[layer + "attention.wk.weight"] == kv_shards
        assert shards[layer + "attention.wq.lora_b"] == tp


@pytest.mark.parametrize("bad, message", [
    (dict(lora_rank=-1), "lora.lora_rank must be an integer >= 0"),
    (dict(lora_rank=2, lora_alpha=0), "lora.lora_alpha must be a number > 0"),
    (dict(lora_rank=2, lora_dropout=1.0), "lora.lora_dropout must be in [0, 1)"),
    (dict(lora_rank=2, lora_target_modules=["q_proj", "qkv"]), "unknown module 'qkv'"),
])
def test_bad_lora_values_are_refused_naming_the_key(bad, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace(")", r"\)")):
        LoraConfig(**bad)


def test_a_rank_above_a_layers_width_is_refused_naming_the_module():
    assert LoraConfig(lora_rank=2, lora_target_modules="all-linear").modules() == TARGET_MODULES
    with pytest.raises(ConfigError, match=r"lora.lora_rank=20 is above the width 16 of k_proj \(32 -> 16"):
        config(lora_rank=20).validate()
    config(lora_rank=20, lora_target_modules=["q_proj"]).validate()  # q_proj is 32 wide


def test_dropout_acts_on_the_adapters_input_while_training_only():
    layer = ColumnParallelLinear(8, 6, name="probe")
    layer.add_lora(2, alpha=2.0, dropout=0.5)
    rng = np.random.default_rng(5)
    for name in ("weight", "lora_a", "lora_b"):
        param = getattr(layer, name)
        param.set_data(Tensor(rng.normal(size=param.shape).astype(np.float32)))
    x = Tensor(rng.normal(size=(4, 8)).astype(np.float32))
    layer.set_train(False)
    quiet = layer(x).asnumpy()
    np.testing.assert_allclose(quiet, layer(x).asnumpy())
    layer.set_train(True)
    assert np.abs(layer(x).asnumpy() - quiet).max() > 1e-3
