"""Parameter names of the MindSpore Qwen2 network (MindFormers convention) and their HF counterparts.

Shapes are of the full (unsplit) tensors, `[out, in]` for linear weights as in both MindSpore and torch.
`split_axis` is the dimension split over tensor parallel (None = replicated).

| MindSpore name                               | HF name                                   | shape        | split |
|----------------------------------------------|-------------------------------------------|--------------|-------|
| model.tok_embeddings.embedding_weight        | model.embed_tokens.weight                 | [V, D]       | 0     |
| model.layers.{i}.attention_norm.weight       | model.layers.{i}.input_layernorm.weight   | [D]          | None  |
| model.layers.{i}.attention.wq.weight / .bias | model.layers.{i}.self_attn.q_proj.*       | [H*hd, D]    | 0     |
| model.layers.{i}.attention.wk.weight / .bias | model.layers.{i}.self_attn.k_proj.*       | [KV*hd, D]   | 0     |
| model.layers.{i}.attention.wv.weight / .bias | model.layers.{i}.self_attn.v_proj.*       | [KV*hd, D]   | 0     |
| model.layers.{i}.attention.wo.weight         | model.layers.{i}.self_attn.o_proj.weight  | [D, H*hd]    | 1     |
| model.layers.{i}.ffn_norm.weight             | model.layers.{i}.post_attention_layernorm.weight | [D]   | None  |
| model.layers.{i}.feed_forward.w1.weight      | model.layers.{i}.mlp.gate_proj.weight     | [I, D]       | 0     |
| model.layers.{i}.feed_forward.w3.weight      | model.layers.{i}.mlp.up_proj.weight       | [I, D]       | 0     |
| model.layers.{i}.feed_forward.w2.weight      | model.layers.{i}.mlp.down_proj.weight     | [D, I]       | 1     |
| model.norm_out.weight                        | model.norm.weight                         | [D]          | None  |
| lm_head.weight (absent if tied)              | lm_head.weight                            | [V, D]       | 0     |
| score.weight (value models instead of lm_head) | score.weight                            | [1, D]       | None  |
| score.bias (token-classification value heads) | score.bias                               | [1]          | None  |

Value models (the PPO critic, reward models) are `*ForSequenceClassification` (head without bias) or
`*ForTokenClassification` (head with a bias, verl's critic format) with one label: the backbone and a `score` head
in place of `lm_head`.
"""
from __future__ import annotations

import re

# (HF pattern, MindSpore pattern); {i} is the layer index.
_NAME_PAIRS = [
    ("model.embed_tokens.weight", "model.tok_embeddings.embedding_weight"),
    ("model.layers.{i}.input_layernorm.weight", "model.layers.{i}.attention_norm.weight"),
    ("model.layers.{i}.self_attn.q_proj.weight", "model.layers.{i}.attention.wq.weight"),
    ("model.layers.{i}.self_attn.q_proj.bias", "model.layers.{i}.attention.wq.bias"),
    ("model.layers.{i}.self_attn.k_proj.weight", "model.layers.{i}.attention.wk.weight"),
    ("model.layers.{i}.self_attn.k_proj.bias", "model.layers.{i}.attention.wk.bias"),
    ("model.layers.{i}.self_attn.v_proj.weight", "model.layers.{i}.attention.wv.weight"),
    ("model.layers.{i}.self_attn.v_proj.bias", "model.layers.{i}.attention.wv.bias"),
    ("model.layers.{i}.self_attn.o_proj.weight", "model.layers.{i}.attention.wo.weight"),
    ("model.layers.{i}.post_attention_layernorm.weight", "model.layers.{i}.ffn_norm.weight"),
    ("model.layers.{i}.mlp.gate_proj.weight", "model.layers.{i}.feed_forward.w1.weight"),
    ("model.layers.{i}.mlp.up_proj.weight", "model.layers.{i}.feed_forward.w3.weight"),
    ("model.layers.{i}.mlp.down_proj.weight", "model.layers.{i}.feed_forward.w2.weight"),
    ("model.norm.weight", "model.norm_out.weight"),
    ("lm_head.weight", "lm_head.weight"),
    ("score.weight", "score.weight"),
    ("score.bias", "score.bias"),
]


def _compile(pattern: str) -> re.Pattern:
    return re.compile("^" + re.escape(pattern).replace(re.escape("{i}"), r"(?P<i>\d+)") + "$")


_HF_TO_MS = [(_compile(hf), ms) for hf, ms in _NAME_PAIRS]
_MS_TO_HF = [(_compile(ms), hf) for hf, ms in _NAME_PAIRS]


def _translate(name: str, table) -> str | None:
    for regex, target in table:
        m = regex.match(name)
        if m:
            return target.replace("{i}", m.group("i")) if "i" in regex.groupindex else target
    return None


def hf_to_ms_name(name: str) -> str | None:
    """MindSpore name of a Hugging Face parameter name; None if it is not a Qwen2/Llama weight."""
    return _translate(name, _HF_TO_MS)


def ms_to_hf_name(name: str) -> str | None:
    """Hugging Face name of a MindSpore parameter name; None if unknown."""
    return _translate(name, _MS_TO_HF)
