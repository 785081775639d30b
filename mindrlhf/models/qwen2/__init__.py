"""Qwen2 / Qwen2.5 (and Llama) for MindSpore."""
from mindrlhf.models.qwen2.config import Qwen2Config
from mindrlhf.models.qwen2.tokenizer import Qwen2Tokenizer

__all__ = ["KVCache", "Qwen2Config", "Qwen2ForCausalLM", "Qwen2ForValue", "Qwen2Tokenizer"]

_NETWORKS = ("KVCache", "Qwen2ForCausalLM", "Qwen2ForValue")


def __getattr__(name):
    # the networks load MindSpore, which Qwen2Config's readers (the job's checks, `--plan`) do without
    if name in _NETWORKS:
        from mindrlhf.models.qwen2 import modeling
        return getattr(modeling, name)
    raise AttributeError(name)
