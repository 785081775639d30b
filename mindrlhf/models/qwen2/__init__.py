"""Qwen2 / Qwen2.5 (and Llama) for MindSpore."""
from mindrlhf.models.qwen2.config import Qwen2Config
from mindrlhf.models.qwen2.modeling import KVCache, Qwen2ForCausalLM, Qwen2ForValue

__all__ = ["KVCache", "Qwen2Config", "Qwen2ForCausalLM", "Qwen2ForValue", "Qwen2Tokenizer"]


def __getattr__(name):
    # The tokenizer pulls in `tokenizers`; import it only when asked for.
    if name == "Qwen2Tokenizer":
        from mindrlhf.models.qwen2.tokenizer import Qwen2Tokenizer
        return Qwen2Tokenizer
    raise AttributeError(name)
