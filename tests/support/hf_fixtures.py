"""Tiny random Hugging Face Qwen2 / Llama models saved to folders, the reference side of parity tests.

    from support.hf_fixtures import make_hf_model_dir
    path, model = make_hf_model_dir(tmp_path / "qwen", arch="qwen2", tie=True)

Every parameter (biases and norm weights included) is drawn from a seeded normal, because HF
initialises biases to zero and norms to one, which would hide mapping mistakes. Models are float32,
eval mode, eager attention. Saved folders hold `config.json` plus safetensors (optionally sharded,
optionally bf16) or `pytorch_model*.bin` written with `torch.save` (transformers 5 only saves safetensors).
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import NamedTuple

import torch
import transformers
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

transformers.utils.logging.disable_progress_bar()

ARCHS = {"qwen2": (Qwen2Config, Qwen2ForCausalLM), "llama": (LlamaConfig, LlamaForCausalLM)}
TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class HFModelDir(NamedTuple):
    """A saved HF folder and the in-memory model it was saved from (in the saved dtype)."""

    path: Path
    model: torch.nn.Module


def tiny_hf_config(arch: str = "qwen2", *, vocab_size: int = 320, tie: bool = False, qkv_bias: bool | None = None,
                   rope_theta: float = 10000.0, **overrides):
    """A HF config: hidden 64, 2 layers, 4 heads, 2 kv heads (GQA), intermediate 128.

    `qkv_bias`: Llama's `attention_bias` (default off; it also gives o_proj a bias). Qwen2 always has
    q/k/v biases, so qkv_bias=False with arch="qwen2" is an error.
    """
    config_cls, _ = ARCHS[arch]
    kwargs = dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6,
        rope_theta=rope_theta, tie_word_embeddings=tie, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        attn_implementation="eager",
    )
    if arch == "llama":
        kwargs["attention_bias"] = bool(qkv_bias)
    elif qkv_bias is False:
        raise ValueError("Qwen2 always has q/k/v biases; use arch='llama' for a model without them")
    kwargs.update(overrides)
    return config_cls(**kwargs)


@torch.no_grad()
def randomize_(model: torch.nn.Module, seed: int = 0, std: float = 0.05) -> torch.nn.Module:
    """Redraws every parameter: matrices and biases ~ N(0, std), 1-D norm weights ~ 1 + N(0, 0.1)."""
    gen = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        noise = torch.randn(param.shape, generator=gen, dtype=torch.float32)
        if name.endswith("norm.weight"):
            param.copy_(1.0 + 0.1 * noise)
        else:
            param.copy_(std * noise)
    return model


def build_hf_model(arch: str = "qwen2", *, seed: int = 0, **config_kwargs) -> torch.nn.Module:
    """A random tiny fp32 model in eval mode; `config_kwargs` go to `tiny_hf_config`."""
    _, model_cls = ARCHS[arch]
    config = tiny_hf_config(arch, **config_kwargs)
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    randomize_(model, seed)
    if config.tie_word_embeddings:
        assert model.lm_head.weight is model.model.embed_tokens.weight
    return model


def save_torch_bin(model: torch.nn.Module, folder: Path, max_shard_size: int | None = None,
                   extra: dict[str, torch.Tensor] | None = None) -> None:
    """`pytorch_model.bin` (or shards of at most `max_shard_size` bytes + index) and config.json.

    `extra` adds tensors to the state dict (e.g. a legacy `rotary_emb.inv_freq` buffer).
    """
    folder.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(folder)
    state = {**model.state_dict(), **(extra or {})}
    if max_shard_size is None:
        torch.save(state, folder / "pytorch_model.bin")
        return
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_size:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        file_name = f"pytorch_model-{i:05d}-of-{len(shards):05d}.bin"
        torch.save(shard, folder / file_name)
        weight_map.update(dict.fromkeys(shard, file_name))
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in state.values())},
             "weight_map": weight_map}
    (folder / "pytorch_model.bin.index.json").write_text(json.dumps(index, indent=2))


def make_hf_model_dir(folder: str | os.PathLike, arch: str = "qwen2", *, seed: int = 0, dtype: str = "float32",
                      max_shard_size: int | str | None = None, fmt: str = "safetensors",
                      **config_kwargs) -> HFModelDir:
    """Builds a random tiny model and saves it to `folder`; returns (folder, model in the saved dtype).

    fmt: "safetensors" (HF `save_pretrained`) or "bin" (`torch.save`); `max_shard_size` shards either
    (for "bin" it must be a byte count). For fp16/bf16 the returned model is the folder loaded back with
    `from_pretrained`: `model.to(bf16)` would also round the rotary `inv_freq` buffer, which HF keeps in
    float32, and give different logits.
    """
    folder = Path(folder)
    model = build_hf_model(arch, seed=seed, **config_kwargs).to(TORCH_DTYPES[dtype])
    if fmt == "safetensors":
        kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
        model.save_pretrained(folder, **kwargs)
    elif fmt == "bin":
        save_torch_bin(model, folder, max_shard_size)
    else:
        raise ValueError(f"fmt={fmt!r}; expected 'safetensors' or 'bin'")
    if dtype != "float32":
        model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
    return HFModelDir(folder, model)


@torch.no_grad()
def hf_logits(model: torch.nn.Module, input_ids) -> torch.Tensor:
    """float32 logits [batch, seq, vocab] of `input_ids` (list of lists or a LongTensor)."""
    ids = torch.as_tensor(input_ids, dtype=torch.long)
    return model(input_ids=ids).logits.float()


def safetensors_bytes(folder: Path) -> dict[str, tuple]:
    """name -> (dtype, shape, raw bytes) over every safetensors file of a folder."""
    from safetensors import safe_open

    out = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                t = f.get_tensor(name)
                out[name] = (t.dtype, tuple(t.shape), t.contiguous().view(torch.uint8).numpy().tobytes())
    return out
