"""Checkpoint conversion between Hugging Face Qwen2/Llama folders and MindSpore `.ckpt` files.

Hugging Face side: a folder with `config.json` and `model.safetensors`, sharded
`model-0000x-of-0000y.safetensors` + `model.safetensors.index.json`, `pytorch_model.bin`, or sharded
`pytorch_model-*.bin` + `pytorch_model.bin.index.json`. safetensors files are parsed here (no torch);
torch is imported only to read `.bin` files.

MindSpore side: one `.ckpt` (`mindspore.save_checkpoint`) with the names of `names.py`; a model with
tied embeddings has no `lm_head.weight`.

bfloat16: numpy has no bf16, so bf16 sources are widened to float32 exactly (a bf16 value is the top
16 bits of a float32). bf16 outputs are rounded to nearest-even by `mindspore.Tensor(x, bfloat16)` and
travel as numpy arrays of MindSpore's registered numpy `bfloat16` dtype, which both
`mindspore.Tensor` and `safetensors.numpy.save_file` accept.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import shutil
import struct
from collections.abc import Callable, Iterable

import mindspore as ms
import numpy as np
from safetensors.numpy import save_file

from mindrlhf.configs.base import ConfigError
from mindrlhf.models.qwen2.config import Qwen2Config
from mindrlhf.models.qwen2.names import hf_to_ms_name, ms_to_hf_name
from mindrlhf.utils.atomic import atomic_output
from mindrlhf.utils.checkpoint_file import stored_tensors, write_checkpoint


class ConversionError(ValueError):
    """A checkpoint could not be converted; the message names the file and the problem."""


DTYPE_ALIASES = {
    "fp32": "float32", "float32": "float32",
    "fp16": "float16", "float16": "float16",
    "bf16": "bfloat16", "bfloat16": "bfloat16",
}

SAFE_WEIGHTS = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"
TORCH_WEIGHTS = "pytorch_model.bin"
TORCH_INDEX = "pytorch_model.bin.index.json"

# Persistent-in-old-checkpoints buffers that are not weights (recomputed from the config).
_HF_BUFFER = re.compile(r"(^|\.)rotary_emb\.(original_)?inv_freq$")

# safetensors dtype code -> numpy dtype (little endian, as the format prescribes). BF16 is handled apart.
_SAFETENSORS_DTYPES = {
    "F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"),
    "I64": np.dtype("<i8"), "I32": np.dtype("<i4"), "I16": np.dtype("<i2"), "I8": np.dtype("i1"),
    "U64": np.dtype("<u8"), "U32": np.dtype("<u4"), "U16": np.dtype("<u2"), "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
}
_MAX_LISTED = 8


def normalize_dtype(dtype: str) -> str:
    """'fp32'/'fp16'/'bf16' (or the long names) -> 'float32'/'float16'/'bfloat16'."""
    try:
        return DTYPE_ALIASES[str(dtype).lower()]
    except KeyError:
        raise ConversionError(f"dtype={dtype!r}; expected one of fp32, fp16, bf16") from None


def _listing(names: Iterable[str]) -> str:
    names = list(names)
    shown = ", ".join(names[:_MAX_LISTED])
    return shown + (f" ... and {len(names) - _MAX_LISTED} more" if len(names) > _MAX_LISTED else "")


# --------------------------------------------------------------------------- bfloat16 helpers
def bf16_bits_to_fp32(bits: np.ndarray) -> np.ndarray:
    """Exact float32 values of bf16 numbers given as their uint16 bit patterns."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def _is_bf16(arr: np.ndarray) -> bool:
    return arr.dtype.name == "bfloat16"


def _to_fp32(arr: np.ndarray) -> np.ndarray:
    """float32 view of a float array; bf16 (MindSpore's numpy dtype) is widened exactly."""
    if _is_bf16(arr):
        return bf16_bits_to_fp32(arr.view(np.uint16))
    return arr.astype(np.float32, copy=False)


def cast_array(arr: np.ndarray, dtype: str, name: str = "tensor") -> np.ndarray:
    """Correctly rounded cast to 'float32'/'float16'/'bfloat16' (bf16 as MindSpore's numpy bfloat16).

    A finite value that overflows the target type is an error naming the tensor.
    """
    dtype = normalize_dtype(dtype)
    if arr.dtype.name == dtype:
        return arr
    if arr.dtype.kind != "f" and not _is_bf16(arr):
        raise ConversionError(f"{name}: dtype {arr.dtype} is not a floating-point type")
    x = _to_fp32(arr)
    if dtype == "float32":
        return x
    if dtype == "float16":
        with np.errstate(over="ignore"):  # reported below, naming the tensor
            out = x.astype(np.float16)
    else:
        out = ms.Tensor(x, ms.bfloat16).asnumpy()
    if not np.array_equal(np.isfinite(_to_fp32(out)), np.isfinite(x)):
        peak = float(np.max(np.abs(x[np.isfinite(x)])))
        raise ConversionError(f"{name}: values overflow {dtype} (max |x| = {peak:g})")
    return out


# --------------------------------------------------------------------------- reading HF folders
def read_safetensors(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """Reads a safetensors file without torch; BF16 tensors come back as exact float32.

    The header is checked against the file size, so a truncated file is an error naming it.
    """
    path = os.fspath(path)
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        header, data_start = _read_safetensors_header(f, path, size)
        return {name: _read_safetensors_tensor(f, path, name, spec, data_start, size)
                for name, spec in header.items()}


def _read_safetensors_header(f, path: str, size: int) -> tuple[dict, int]:
    """The tensor entries of the JSON header (without `__metadata__`) and the offset of the data."""
    if size < 8:
        raise ConversionError(f"{path}: not a safetensors file (only {size} bytes); truncated?")
    (length,) = struct.unpack("<Q", f.read(8))
    if 8 + length > size:
        raise ConversionError(f"{path}: truncated safetensors file: header declares {length} bytes, "
                              f"file has {size - 8} after the length field")
    try:
        header = json.loads(f.read(length).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ConversionError(f"{path}: corrupt safetensors header: {err}") from None
    if not isinstance(header, dict):
        raise ConversionError(f"{path}: corrupt safetensors header: not a JSON object")
    header.pop("__metadata__", None)
    return header, 8 + length


def _read_safetensors_tensor(f, path: str, name: str, spec, base: int, size: int) -> np.ndarray:
    try:
        code, shape, (begin, end) = spec["dtype"], tuple(int(s) for s in spec["shape"]), spec["data_offsets"]
    except (TypeError, KeyError, ValueError) as err:
        raise ConversionError(f"{path}: corrupt safetensors header entry for {name}: {err}") from None
    dtype = np.dtype("<u2") if code == "BF16" else _SAFETENSORS_DTYPES.get(code)
    if dtype is None:
        raise ConversionError(f"{path}: tensor {name} has unsupported dtype {code}")
    count = math.prod(shape)
    if end - begin != count * dtype.itemsize or begin < 0:
        raise ConversionError(f"{path}: corrupt safetensors header: tensor {name} spans bytes [{begin}, {end}) "
                              f"but {code}{list(shape)} needs {count * dtype.itemsize}")
    if base + end > size:
        raise ConversionError(f"{path}: truncated safetensors file: tensor {name} ends at byte {base + end}, "
                              f"file has {size} bytes")
    f.seek(base + begin)
    arr = np.fromfile(f, dtype=dtype, count=count).reshape(shape)
    return bf16_bits_to_fp32(arr) if code == "BF16" else arr.astype(dtype.newbyteorder("="), copy=False)


def read_torch_bin(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """Reads a PyTorch `.bin` state dict (imports torch); bf16 comes back as exact float32."""
    import torch  # a test-only dependency (requirements-test.txt): only .bin weights need it

    path = os.fspath(path)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # torch raises many types for corrupt files
        raise ConversionError(f"{path}: cannot read PyTorch checkpoint: {err}") from None
    if not isinstance(state, dict):
        raise ConversionError(f"{path}: expected a state dict, got {type(state).__name__}")
    out = {}
    for name, tensor in state.items():
        if not isinstance(tensor, torch.Tensor):
            raise ConversionError(f"{path}: entry {name} is a {type(tensor).__name__}, not a tensor")
        tensor = tensor.detach()
        out[name] = (tensor.float() if tensor.dtype == torch.bfloat16 else tensor).contiguous().numpy()
    return out


def _read_index(index_path: str) -> dict[str, str]:
    """weight_map of a `*.index.json`: tensor name -> shard file name."""
    try:
        with open(index_path, encoding="utf-8") as f:
            weight_map = json.load(f)["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        raise ConversionError(f"{index_path}: not a valid checkpoint index ({type(err).__name__}: {err})") from None
    if not isinstance(weight_map, dict) or not weight_map:
        raise ConversionError(f"{index_path}: 'weight_map' must be a non-empty mapping")
    return weight_map


def _read_sharded(hf_dir: str, index_name: str, reader) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    index_path = os.path.join(hf_dir, index_name)
    weight_map = _read_index(index_path)
    shards = sorted(set(weight_map.values()))
    missing = [s for s in shards if not os.path.isfile(os.path.join(hf_dir, s))]
    if missing:
        raise ConversionError(f"{index_path}: names shard file(s) that do not exist: {_listing(missing)}")
    tensors, origin = {}, {}
    for shard in shards:
        shard_path = os.path.join(hf_dir, shard)
        for name, arr in reader(shard_path).items():
            if name in tensors:
                raise ConversionError(f"{shard_path}: tensor {name} also appears in {origin[name]}")
            tensors[name], origin[name] = arr, shard_path
    absent = [n for n, s in weight_map.items() if n not in tensors]
    if absent:
        raise ConversionError(f"{index_path}: tensor(s) listed in the index are not in their shard: "
                              f"{_listing(absent)}")
    return tensors, origin


def _weights_layout(hf_dir: str) -> tuple[str, bool]:
    """The weight file (or index) to read, HF's order of preference, and whether it is sharded."""
    for name, sharded in ((SAFE_WEIGHTS, False), (SAFE_INDEX, True), (TORCH_WEIGHTS, False), (TORCH_INDEX, True)):
        if os.path.isfile(os.path.join(hf_dir, name)):
            return name, sharded
    raise ConversionError(f"{hf_dir}: no weight files; expected {SAFE_WEIGHTS}, {SAFE_INDEX}, {TORCH_WEIGHTS} "
                          f"or {TORCH_INDEX}")


def read_hf_tensors(hf_dir: str | os.PathLike) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """All tensors of a HF folder and, per tensor, the file it came from (for error messages)."""
    hf_dir = os.fspath(hf_dir)
    if not os.path.isdir(hf_dir):
        raise ConversionError(f"{hf_dir}: Hugging Face model folder not found")
    name, sharded = _weights_layout(hf_dir)
    reader = read_safetensors if name.startswith("model.safetensors") else read_torch_bin
    if sharded:
        return _read_sharded(hf_dir, name, reader)
    path = os.path.join(hf_dir, name)
    tensors = reader(path)
    return tensors, dict.fromkeys(tensors, path)


def read_hf_state_dict(hf_dir: str | os.PathLike) -> dict[str, np.ndarray]:
    """HF name -> numpy array for a HF model folder (any of the four layouts).

    Arrays keep their stored dtype, except bf16 which is widened exactly to float32.
    """
    return read_hf_tensors(hf_dir)[0]


# --------------------------------------------------------------------------- names and shapes
def expected_shapes(cfg: Qwen2Config, value_head: bool = False) -> dict[str, tuple[int, ...]]:
    """MindSpore parameter name -> full shape, in network order (the table in names.py); `value_head`: a value
    model's `score.weight` [1, D] instead of the LM head."""
    d, inter, hd = cfg.hidden_size, cfg.intermediate_size, cfg.get_head_dim()
    q, kv = cfg.num_heads * hd, cfg.n_kv_heads * hd
    layer = {
        "attention_norm.weight": (d,),
        "attention.wq.weight": (q, d), "attention.wq.bias": (q,),
        "attention.wk.weight": (kv, d), "attention.wk.bias": (kv,),
        "attention.wv.weight": (kv, d), "attention.wv.bias": (kv,),
        "attention.wo.weight": (d, q),
        "ffn_norm.weight": (d,),
        "feed_forward.w1.weight": (inter, d),
        "feed_forward.w3.weight": (inter, d),
        "feed_forward.w2.weight": (d, inter),
    }
    if not cfg.qkv_has_bias:
        layer = {k: v for k, v in layer.items() if not k.endswith(".bias")}
    shapes = {"model.tok_embeddings.embedding_weight": (cfg.vocab_size, d)}
    for i in range(cfg.num_layers):
        shapes.update({f"model.layers.{i}.{k}": v for k, v in layer.items()})
    shapes["model.norm_out.weight"] = (d,)
    if value_head:
        shapes["score.weight"] = (1, d)
        if cfg.value_head_bias:
            shapes["score.bias"] = (1,)
    elif not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, d)
    return shapes


def check_state_dict(ms_tensors: dict[str, np.ndarray], cfg: Qwen2Config, source: str, config_source: str,
                     shown_name: Callable[[str], str] = lambda n: n, origin: dict[str, str] | None = None,
                     value_head: bool = False) -> None:
    """Checks MindSpore-named tensors against the config: no missing, no extra, every shape equal.

    `shown_name` maps a MindSpore name to the name used in messages; `origin` (by MindSpore name) names
    the file a tensor came from when it is not `source`.
    """
    origin = origin or {}
    shapes = expected_shapes(cfg, value_head)
    extra = [shown_name(n) for n in ms_tensors if n not in shapes]
    if extra:
        hint = " (a value head with a bias: set value_head_bias: true)" if extra == [shown_name("score.bias")] else ""
        raise ConversionError(
            f"{source}: tensor(s) not expected by {config_source} (num_layers={cfg.num_layers}, "
            f"qkv_has_bias={cfg.qkv_has_bias}, tie_word_embeddings={cfg.tie_word_embeddings}, value_head_bias="
            f"{cfg.value_head_bias}): {_listing(extra)}{hint}")
    missing = [shown_name(n) for n in shapes if n not in ms_tensors]
    if missing:
        hint = " (is the model tied? set tie_word_embeddings)" if missing == [shown_name("lm_head.weight")] else ""
        raise ConversionError(f"{source}: missing tensor(s) required by {config_source}: {_listing(missing)}{hint}")
    for name, shape in shapes.items():
        got = tuple(ms_tensors[name].shape)
        if got != shape:
            where = origin.get(name, source)
            raise ConversionError(f"{where}: tensor {shown_name(name)} has shape {list(got)}, but "
                                  f"{config_source} expects {list(shape)}")


def hf_to_ms_state_dict(hf_tensors: dict[str, np.ndarray], cfg: Qwen2Config, source: str = "<hf>",
                        config_source: str = "<config>", origin: dict[str, str] | None = None,
                        value_head: bool = False) -> dict[str, np.ndarray]:
    """Renames HF tensors to MindSpore names (network order), drops buffers and a tied lm_head, checks shapes
    (of a value model's `score` head with `value_head`)."""
    origin = origin or {}
    renamed, ms_origin, unknown = {}, {}, []
    for name, arr in hf_tensors.items():
        if _HF_BUFFER.search(name):
            continue
        ms_name = hf_to_ms_name(name)
        if ms_name is None:
            unknown.append(name)
        else:
            renamed[ms_name] = arr
            if name in origin:
                ms_origin[ms_name] = origin[name]
    if unknown:
        files = {origin.get(n, source) for n in unknown}
        where = files.pop() if len(files) == 1 else source
        raise ConversionError(f"{where}: unknown tensor(s), not part of a Qwen2/Llama model as supported: "
                              f"{_listing(unknown)}")
    if cfg.tie_word_embeddings and "lm_head.weight" in renamed:
        head = renamed.pop("lm_head.weight")
        emb = renamed.get("model.tok_embeddings.embedding_weight")
        if emb is not None and not np.array_equal(_to_fp32(head), _to_fp32(emb)):
            where = origin.get("lm_head.weight", source)
            raise ConversionError(f"{where}: lm_head.weight differs from model.embed_tokens.weight, but "
                                  f"{config_source} has tie_word_embeddings=true")
    check_state_dict(renamed, cfg, source, config_source, shown_name=lambda n: ms_to_hf_name(n) or n,
                     origin=ms_origin, value_head=value_head)
    return {n: renamed[n] for n in expected_shapes(cfg, value_head)}


def ms_to_hf_state_dict(ms_tensors: dict[str, np.ndarray], cfg: Qwen2Config, source: str = "<ckpt>",
                        config_source: str = "<config>") -> dict[str, np.ndarray]:
    """Checks MindSpore-named tensors against the config and renames them to HF names (a value model when the
    tensors hold `score.weight`)."""
    unknown = [n for n in ms_tensors if ms_to_hf_name(n) is None]
    if unknown:
        raise ConversionError(f"{source}: unknown parameter(s), not part of the Qwen2 network: {_listing(unknown)}")
    value_head = "score.weight" in ms_tensors
    check_state_dict(ms_tensors, cfg, source, config_source, value_head=value_head)
    return {ms_to_hf_name(n): ms_tensors[n] for n in expected_shapes(cfg, value_head)}


VALUE_MODEL_SUFFIXES = ("ForSequenceClassification", "ForTokenClassification")  # head without / with a bias


def hf_value_head(hf_dir: str) -> bool:
    """Whether the HF folder holds a value model (`*ForSequenceClassification` or `*ForTokenClassification`, one
    label): a reward model or a critic. Several labels are a one-line error."""
    path = os.path.join(hf_dir, "config.json")
    try:
        with open(path, encoding="utf-8") as f:
            hf = json.load(f)
    except (OSError, json.JSONDecodeError):
        return False  # the config reader names the problem
    archs = hf.get("architectures") or []
    if not any(a.endswith(VALUE_MODEL_SUFFIXES) for a in archs):
        return False
    labels = hf.get("num_labels", len(hf.get("id2label") or {}) or 2)
    if labels != 1:
        raise ConversionError(f"{path}: {archs[0]} with {labels} labels; a reward model or critic has one "
                              "(num_labels: 1)")
    return True


# --------------------------------------------------------------------------- configs
def _load_config(hf_dir: str, config_path: str | os.PathLike | None) -> tuple[Qwen2Config, str]:
    """The config and the file it came from: the YAML if given, else the folder's config.json. A folder's
    config.json is read either way: a model mindrlhf does not implement (its architecture, activation or rotary
    scaling) is refused even when a YAML gives the shapes."""
    hf_config = os.path.join(hf_dir, "config.json")
    source = os.fspath(config_path) if config_path is not None else hf_config
    try:
        if config_path is not None and os.path.isfile(hf_config):
            Qwen2Config.from_hf(hf_config)
        cfg = Qwen2Config.from_yaml(source) if config_path is not None else Qwen2Config.from_hf(source)
    except ConfigError as err:
        raise ConversionError(str(err)) from None
    return cfg, source


def hf_config_dict(cfg: Qwen2Config, dtype: str, value_head: bool = False) -> dict:
    """A HF `config.json` for the config: Qwen2 when q/k/v have biases, else Llama (Qwen2 always has them); with
    `value_head` a one-label `*ForSequenceClassification` (a reward model / critic), `*ForTokenClassification`
    when the head has a bias (`value_head_bias`).

    Writes the rope base both as `rope_theta` (transformers 4) and `rope_parameters` (transformers 5).
    """
    is_qwen2 = cfg.qkv_has_bias
    out = {
        "architectures": ["Qwen2ForCausalLM" if is_qwen2 else "LlamaForCausalLM"],
        "model_type": "qwen2" if is_qwen2 else "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.get_head_dim(),
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_position_embedding,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.theta},
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "use_cache": True,
        "torch_dtype": dtype,
        "dtype": dtype,
    }
    if value_head:
        out["architectures"] = [("Qwen2" if is_qwen2 else "Llama") + VALUE_MODEL_SUFFIXES[cfg.value_head_bias]]
        out.update(num_labels=1, id2label={"0": "LABEL_0"}, label2id={"LABEL_0": 0})
    if not is_qwen2:
        out.update(attention_bias=False, mlp_bias=False)
    else:
        out.update(use_sliding_window=False, sliding_window=None)
    # An id outside the vocabulary breaks HF (pad_token_id becomes the embedding's padding_idx).
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = getattr(cfg, key)
        out[key] = value if 0 <= value < cfg.vocab_size else None
    return out


# --------------------------------------------------------------------------- atomic writers
def save_ms_checkpoint(tensors: dict[str, np.ndarray], ckpt_path: str) -> None:
    """Writes {name: array} as one MindSpore ckpt (`write_checkpoint`: streamed, atomic)."""
    write_checkpoint(tensors.items(), ckpt_path)


def save_safetensors(tensors: dict[str, np.ndarray], path: str) -> None:
    """Writes {name: array} as one safetensors file (atomically), as torch's `save_pretrained` does."""
    with atomic_output(path, ".safetensors") as tmp:
        save_file({n: np.ascontiguousarray(a) for n, a in tensors.items()}, tmp, metadata={"format": "pt"})


def save_json(data: dict, path: str) -> None:
    """Writes `data` as indented JSON (atomically)."""
    with atomic_output(path, ".json") as tmp:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=2)
            f.write("\n")


# --------------------------------------------------------------------------- conversions
def convert_hf_to_ms(hf_dir: str | os.PathLike, ckpt_path: str | os.PathLike, dtype: str | None = None,
                     config_path: str | os.PathLike | None = None,
                     output_yaml: str | os.PathLike | None = None) -> Qwen2Config:
    """Converts a HF Qwen2/Llama folder into one MindSpore `.ckpt`; returns the matching config.

    The config is the YAML at `config_path` if given (shapes are checked against it), else the folder's
    config.json. `dtype` (fp32/fp16/bf16) defaults to the YAML's `param_init_type`, or fp32; the returned
    config (and `output_yaml`, if given) has `param_init_type` set to it. Nothing is written on error.
    """
    hf_dir, ckpt_path = os.fspath(hf_dir), os.fspath(ckpt_path)
    if not ckpt_path.endswith(".ckpt"):
        raise ConversionError(f"{ckpt_path}: the MindSpore checkpoint path must end with .ckpt")
    if not os.path.isdir(hf_dir):
        raise ConversionError(f"{hf_dir}: Hugging Face model folder not found")
    cfg, config_source = _load_config(hf_dir, config_path)
    dtype = normalize_dtype(dtype or (cfg.param_init_type if config_path is not None else "float32"))
    value_head = hf_value_head(hf_dir)
    tensors, origin = read_hf_tensors(hf_dir)
    ms_tensors = hf_to_ms_state_dict(tensors, cfg, hf_dir, config_source, origin, value_head)
    ms_tensors = {n: cast_array(a, dtype, ms_to_hf_name(n) or n) for n, a in ms_tensors.items()}
    cfg = dataclasses.replace(cfg, param_init_type=dtype)
    save_ms_checkpoint(ms_tensors, ckpt_path)
    if output_yaml is not None:
        os.makedirs(os.path.dirname(os.path.abspath(output_yaml)), exist_ok=True)
        cfg.to_yaml(output_yaml)
    return cfg


def read_ms_checkpoint(ckpt_path: str | os.PathLike) -> dict[str, np.ndarray]:
    """name -> numpy array of a MindSpore ckpt (bf16 as MindSpore's numpy bfloat16)."""
    ckpt_path = os.fspath(ckpt_path)
    if not os.path.isfile(ckpt_path):
        raise ConversionError(f"{ckpt_path}: MindSpore checkpoint not found")
    try:
        with stored_tensors(ckpt_path) as stored:
            return {name: tensor.array() for name, tensor in stored.items()}
    except (OSError, ValueError) as err:
        raise ConversionError(f"{ckpt_path}: cannot read MindSpore checkpoint: {err}") from None


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json",
                   "vocab.json", "merges.txt", "generation_config.json")


def tokenizer_files(tokenizer_dir: str | os.PathLike) -> list[str]:
    """Paths of the tokenizer files (those of `TOKENIZER_FILES`) in a Hugging Face folder; an error if none."""
    tokenizer_dir = os.fspath(tokenizer_dir)
    present = [name for name in TOKENIZER_FILES if os.path.isfile(os.path.join(tokenizer_dir, name))]
    if "tokenizer.json" not in present and not {"vocab.json", "merges.txt"} <= set(present):
        raise ConversionError(f"{tokenizer_dir}: no tokenizer files (expected tokenizer.json, or vocab.json and "
                              "merges.txt)")
    return [os.path.join(tokenizer_dir, name) for name in present]


def convert_ms_to_hf(ckpt_path: str | os.PathLike, config_path: str | os.PathLike, out_dir: str | os.PathLike,
                     dtype: str | None = None, weights: dict[str, np.ndarray] | None = None,
                     tokenizer_dir: str | os.PathLike | None = None) -> Qwen2Config:
    """Writes `out_dir/model.safetensors` + `config.json` (loadable by HF `from_pretrained`) from a ckpt.

    `config_path` is the model YAML the ckpt was made for (required: a ckpt does not carry its config).
    `weights`, when given, are used instead of reading `ckpt_path` (then only named in errors), e.g. the
    merged shards of a trainer checkpoint. `dtype` None keeps each tensor's dtype (so HF -> ckpt -> HF is
    bit-identical). `tokenizer_dir`: a folder whose tokenizer files are copied along.
    """
    ckpt_path, out_dir = os.fspath(ckpt_path), os.fspath(out_dir)
    try:
        cfg = Qwen2Config.from_yaml(config_path)
    except ConfigError as err:
        raise ConversionError(str(err)) from None
    if weights is None:
        _refuse_stale_weights(out_dir)
        if tokenizer_dir is not None:
            tokenizer_files(tokenizer_dir)
        weights = read_ms_checkpoint(ckpt_path)
    return write_hf_folder(weights, cfg, out_dir, dtype, tokenizer_dir, source=ckpt_path,
                           config_source=os.fspath(config_path))


def _refuse_stale_weights(out_dir: str) -> None:
    stale = [n for n in (SAFE_INDEX, TORCH_INDEX, TORCH_WEIGHTS) if os.path.exists(os.path.join(out_dir, n))]
    if stale:
        raise ConversionError(f"{out_dir}: already holds {_listing(stale)}, which HF would mix with the new "
                              f"{SAFE_WEIGHTS}; use an empty folder")


def write_hf_folder(weights: dict[str, np.ndarray], cfg: Qwen2Config, out_dir: str | os.PathLike,
                    dtype: str | None = None, tokenizer_dir: str | os.PathLike | None = None,
                    source: str = "<weights>", config_source: str = "<config>") -> Qwen2Config:
    """Writes MindSpore-named `weights` as a HF folder (`model.safetensors` + `config.json`, and the tokenizer
    files of `tokenizer_dir` unless it is `out_dir` itself); returns the config with the written dtype.

    `dtype` None keeps each tensor's dtype. `source`/`config_source` name the inputs in errors.
    """
    out_dir = os.fspath(out_dir)
    _refuse_stale_weights(out_dir)
    tokenizer_paths = [] if tokenizer_dir is None else tokenizer_files(tokenizer_dir)
    tensors = ms_to_hf_state_dict(weights, cfg, source, config_source)
    if dtype is not None:
        dtype = normalize_dtype(dtype)
        tensors = {n: cast_array(a, dtype, n) for n, a in tensors.items()}
    out_dtype = dtype or tensors["model.embed_tokens.weight"].dtype.name
    value_head = "score.weight" in tensors
    os.makedirs(out_dir, exist_ok=True)
    for path in tokenizer_paths:
        target = os.path.join(out_dir, os.path.basename(path))
        if os.path.exists(target) and os.path.samefile(path, target):
            continue
        with atomic_output(target) as tmp:
            shutil.copyfile(path, tmp)
    save_safetensors(tensors, os.path.join(out_dir, SAFE_WEIGHTS))
    save_json(hf_config_dict(cfg, out_dtype, value_head), os.path.join(out_dir, "config.json"))
    return dataclasses.replace(cfg, param_init_type=out_dtype)
