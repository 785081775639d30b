"""The tiny Qwen2 the unit tests and workers build (random weights, runs in seconds on CPU): `TINY_QWEN2` are its
numbers, `tiny_qwen2_config(**overrides)` a fresh `Qwen2Config` of them with `overrides` replacing or adding
fields (a test that needs other numbers passes them)."""
from types import MappingProxyType

# 2 layers of width 32, 4 query and 4 kv heads, rotary base 1e4 (read-only: pass overrides instead)
TINY_QWEN2 = MappingProxyType(dict(vocab_size=96, hidden_size=32, num_layers=2, num_heads=4, n_kv_heads=4,
                                   intermediate_size=64, seq_length=32, max_position_embedding=64, theta=10000.0,
                                   qkv_has_bias=True))
# SmolLM2-135M-Instruct's shape (random weights): the memory probes' real-model case
SMOLLM2_SHAPE = MappingProxyType(dict(vocab_size=49152, hidden_size=576, num_layers=30, num_heads=9, n_kv_heads=3,
                                      intermediate_size=1536, qkv_has_bias=False, tie_word_embeddings=True))


def tiny_qwen2_config(**overrides):
    """`Qwen2Config(**TINY_QWEN2)` with `overrides` applied, a new object on every call (tests change its fields)."""
    from mindrlhf.models.qwen2 import Qwen2Config

    return Qwen2Config(**{**TINY_QWEN2, **overrides})
