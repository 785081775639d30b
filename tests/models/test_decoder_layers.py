"""The decoder layers of a model are compiled once and inlined (`lazy_inline`): layers that must compile alike share
one key, layers whose graphs differ (their recompute mode) do not, sequence-parallel layers are inlined too, and
recompute still changes no value."""
import mindspore as ms
import numpy as np
import pytest
from support.configs import tiny_qwen2_config

from mindrlhf.configs.recompute import RecomputeConfig
from mindrlhf.models.qwen2 import Qwen2ForCausalLM
from mindrlhf.models.qwen2.modeling import InlinedDecoderLayer, Qwen2DecoderLayer
from mindrlhf.parallel.layers import init_random_weights
from mindrlhf.parallel.layout import Layout


def _model(recompute=None, select=None, layers=4):
    config = tiny_qwen2_config(num_layers=layers)
    config.recompute = RecomputeConfig(recompute=recompute or False, select_recompute=select or False)
    model = Qwen2ForCausalLM(config)
    init_random_weights(model, Layout(), seed=0)
    return model


def test_layers_share_a_compiled_layer_unless_their_recompute_differs():
    layers = list(_model(recompute=[1], select=[2]).model.layers)  # full, attention, then none
    keys = [layer.cell_init_args for layer in layers]
    assert all(type(layer) is InlinedDecoderLayer and layer.no_inline is False for layer in layers)
    assert keys[2] == keys[3] and len({keys[0], keys[1], keys[2]}) == 3, keys
    full, attention, plain = layers[0], layers[1], layers[2]
    assert full._has_config_recompute and full.feed_forward._has_config_recompute  # the whole layer
    assert attention.attention._has_config_recompute and not attention.feed_forward._has_config_recompute
    assert not plain.attention._has_config_recompute and not plain.feed_forward._has_config_recompute
    with pytest.raises(ValueError, match="recompute must be one of"):
        Qwen2DecoderLayer(tiny_qwen2_config(), Layout(), "everything")
    # sequence-parallel layers too (built, not run: tp 2 needs msrun; tests/parallel's spmd and pipeline runs with
    # sequence parallel compare their values against one process)
    sequence = tiny_qwen2_config()
    sequence.parallel_config.use_seq_parallel = True
    layers = list(Qwen2ForCausalLM(sequence, Layout(tp=2)).model.layers)
    assert all(type(layer) is InlinedDecoderLayer and layer.sequence is not None for layer in layers)


@pytest.mark.usefixtures("graph_mode")
def test_recomputed_inlined_layers_give_the_same_loss_and_gradients():
    ids = ms.Tensor(np.random.default_rng(0).integers(0, 96, (2, 12)).astype(np.int32))

    def loss_and_grads(model):
        def total(x):
            return model(x).sum()

        loss, grads = ms.value_and_grad(total, None, model.trainable_params())(ids)
        return float(loss), [g.asnumpy() for g in grads]

    plain_loss, plain_grads = loss_and_grads(_model())
    mixed_loss, mixed_grads = loss_and_grads(_model(recompute=[1], select=[2]))
    assert plain_loss == mixed_loss and np.isfinite(plain_loss)
    assert all(np.array_equal(a, b) for a, b in zip(plain_grads, mixed_grads))
    assert any(np.abs(g).max() > 0 for g in plain_grads)
