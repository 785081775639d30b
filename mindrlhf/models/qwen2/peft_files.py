"""A LoRA policy's adapters in PEFT's files (#68), in numpy: written as a PEFT folder (`adapter_config.json`,
`adapter_model.safetensors` under PEFT's key names, what `peft.PeftModel.from_pretrained(base, folder)` loads) or
merged into the base weights (W + (alpha / r) B A) for a plain Hugging Face model, and read back from such a folder
(a job's starting adapters)."""
from __future__ import annotations

import json
import os

import numpy as np

from mindrlhf.configs.lora import TARGET_MODULES, is_adapter
from mindrlhf.models.qwen2.convert import read_safetensors, save_json, save_safetensors
from mindrlhf.models.qwen2.names import hf_to_ms_name, ms_to_hf_name

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_PEFT_PREFIX = "base_model.model."  # PEFT's key prefix of a causal LM's modules


class LoraFilesError(ValueError):
    """Adapters that cannot be written or read as asked (none, mixed ranks, a layer without its pair, a folder of
    another kind or shape)."""


def split_adapters(weights: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], dict[str, tuple]]:
    """(the base weights, layer -> (A, B)) of a LoRA policy's weights (MindSpore names); `layer` is the name of the
    layer's weight (`model.layers.0.attention.wq.weight`)."""
    base = {name: value for name, value in weights.items() if not is_adapter(name)}
    layers: dict[str, tuple] = {}
    for name in weights:
        if name.endswith(".lora_a"):
            stem = name[:-len(".lora_a")]
            if stem + ".lora_b" not in weights:
                raise LoraFilesError(f"adapter {name} has no {stem}.lora_b")
            layers[stem + ".weight"] = (weights[name], weights[stem + ".lora_b"])
    return base, layers


def adapter_rank(layers: dict[str, tuple]) -> int:
    """The adapters' one rank (the rows of A)."""
    ranks = {a.shape[0] for a, _ in layers.values()}
    if len(ranks) != 1:
        raise LoraFilesError(f"expected adapters of one rank, found ranks {sorted(ranks)}" if ranks else
                              "the checkpoint holds no LoRA adapters")
    return ranks.pop()


def merged_weights(weights: dict[str, np.ndarray], lora_alpha: float) -> dict[str, np.ndarray]:
    """The base weights with each adapter's delta (lora_alpha / r) B A added in (float32 sums, the weight's dtype
    kept)."""
    base, layers = split_adapters(weights)
    scaling = lora_alpha / adapter_rank(layers)
    merged = dict(base)
    for layer, (a, b) in layers.items():
        weight = base[layer]
        delta = scaling * (b.astype(np.float32) @ a.astype(np.float32))
        merged[layer] = (weight.astype(np.float32) + delta).astype(weight.dtype)
    return merged


def peft_tensors(layers: dict[str, tuple]) -> dict[str, np.ndarray]:
    """The adapters under PEFT's names: `base_model.model.<module>.lora_A.weight` [r, in] and `.lora_B.weight`
    [out, r]."""
    tensors = {}
    for layer, (a, b) in layers.items():
        module = ms_to_hf_name(layer)
        if module is None or not module.endswith(".weight"):
            raise LoraFilesError(f"adapter on {layer}, which is no linear layer of the Qwen2 network")
        stem = _PEFT_PREFIX + module[:-len(".weight")]
        tensors[stem + ".lora_A.weight"] = np.ascontiguousarray(a)
        tensors[stem + ".lora_B.weight"] = np.ascontiguousarray(b)
    return tensors


def target_modules(layers: dict[str, tuple]) -> list[str]:
    """The Hugging Face module names the adapters sit on, in `TARGET_MODULES` order."""
    names = {ms_to_hf_name(layer).rsplit(".", 2)[-2] for layer in layers}
    return [module for module in TARGET_MODULES if module in names]


def adapter_config(layers: dict[str, tuple], lora_alpha: float, base_model: str | None) -> dict:
    """PEFT's `LoraConfig` of the adapters, as `save_pretrained` writes it."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
            "r": adapter_rank(layers), "lora_alpha": lora_alpha, "lora_dropout": 0.0,
            "target_modules": target_modules(layers), "bias": "none", "fan_in_fan_out": False,
            "init_lora_weights": True, "use_rslora": False, "use_dora": False, "modules_to_save": None,
            "inference_mode": True}


def write_peft_folder(weights: dict[str, np.ndarray], lora_alpha: float, out_dir: str,
                      base_model: str | None = None) -> dict:
    """Writes the adapters of `weights` (MindSpore names) as a PEFT folder; returns its adapter config."""
    _, layers = split_adapters(weights)
    config = adapter_config(layers, lora_alpha, base_model)
    os.makedirs(out_dir, exist_ok=True)
    save_safetensors(peft_tensors(layers), os.path.join(out_dir, ADAPTER_WEIGHTS))
    save_json(config, os.path.join(out_dir, ADAPTER_CONFIG))
    return config


def read_peft_folder(folder: str) -> tuple[dict, dict[str, np.ndarray]]:
    """(adapter config, the adapters under this net's names `<layer>.lora_a` / `.lora_b`) of a PEFT LoRA folder."""
    config_path, weights_path = os.path.join(folder, ADAPTER_CONFIG), os.path.join(folder, ADAPTER_WEIGHTS)
    for path in (config_path, weights_path):
        if not os.path.isfile(path):
            raise LoraFilesError(f"{folder}: no {os.path.basename(path)} (expected a PEFT LoRA adapter folder)")
    with open(config_path, encoding="utf-8") as f:
        config = json.load(f)
    if config.get("peft_type") != "LORA":
        raise LoraFilesError(f"{config_path}: peft_type is {config.get('peft_type')!r}, expected 'LORA'")
    adapters = {}
    for key, value in read_safetensors(weights_path).items():
        stem, _, kind = key.removeprefix(_PEFT_PREFIX).rpartition(".lora_")
        layer = hf_to_ms_name(stem + ".weight")
        if layer is None or kind not in ("A.weight", "B.weight"):
            raise LoraFilesError(f"{weights_path}: {key} is no LoRA weight of a Qwen2 linear layer")
        adapters[layer[:-len(".weight")] + (".lora_a" if kind == "A.weight" else ".lora_b")] = value
    return config, adapters


def check_adapter_config(config: dict, lora, folder: str) -> None:
    """Refuses a PEFT adapter whose rank, alpha or target modules are not the job's `lora` section's."""
    targets = set(config.get("target_modules") or ())
    theirs = (config.get("r"), float(config.get("lora_alpha", 0)), targets)
    ours = (lora.lora_rank, float(lora.lora_alpha), set(lora.modules()))
    if theirs != ours:
        raise LoraFilesError(
            f"{folder}: the adapter has r={theirs[0]}, lora_alpha={theirs[1]:g}, target_modules="
            f"{sorted(theirs[2])}; the job's lora section has lora_rank={ours[0]}, lora_alpha={ours[1]:g}, "
            f"lora_target_modules={sorted(ours[2])}: give the adapter's")
