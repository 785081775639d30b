"""Qwen2 / Qwen2.5 / Llama model configuration (MindFormers YAML layout, or Hugging Face config.json)."""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass

import yaml

from mindrlhf.configs.base import ConfigError, from_mapping, get_section, help_field, load_yaml, required_field
from mindrlhf.configs.foreign_keys import (
    EOS_LIST_REASON,
    MODEL_ALIASES,
    MODEL_KEYS,
    PARALLEL_KEYS,
    UNREAD,
    IgnoredKeys,
    check_foreign_keys,
    check_top_level,
    read_aliases,
    refuse_typo,
)
from mindrlhf.configs.lora import LoraConfig
from mindrlhf.configs.parallel import ParallelConfig
from mindrlhf.configs.recompute import RecomputeConfig
from mindrlhf.utils.atomic import atomic_output

DTYPES = ("float32", "float16", "bfloat16")

SUPPORTED_HF_ARCHS = {"qwen2": True, "llama": False}  # model_type -> default qkv bias

# `model.arch.type` -> the network it names: a causal LM (policy) or a scalar-head value model (critic, reward
# model). LlamaForCausalLM is the name MindFormers' Llama and Qwen2 YAMLs use.
ARCHS = {"Qwen2ForCausalLM": "Qwen2ForCausalLM", "LlamaForCausalLM": "Qwen2ForCausalLM",
         "Qwen2ForValue": "Qwen2ForValue"}
DEFAULT_ARCH = "Qwen2ForCausalLM"
MODEL_SECTION_KEYS = ("model_config", "arch")  # the keys of a model YAML's `model` section


@dataclass
class Qwen2Config:
    """Architecture of a Qwen2/Qwen2.5 (or Llama) decoder; the YAML section `model.model_config`.

    Softmax, RMSNorm, rotary tables and log-probs are always computed in float32, whatever
    `compute_dtype` is: they are where low precision costs accuracy and they are cheap.
    """

    vocab_size: int = required_field("Vocabulary size (rows of the embedding and of lm_head).")
    hidden_size: int = required_field("Width of the residual stream.")
    num_layers: int = required_field("Number of decoder layers.")
    num_heads: int = required_field("Number of attention (query) heads.")
    n_kv_heads: int = required_field(
        "Number of key/value heads (grouped-query attention); must divide num_heads. Equal to num_heads = MHA.")
    intermediate_size: int = required_field("Width of the SwiGLU MLP.")
    seq_length: int = help_field(
        2048, "Longest sequence (prompt + response) the network handles; sizes the rotary table and KV cache.")
    max_position_embedding: int = help_field(
        32768, "Longest position the checkpoint was trained for (HF max_position_embeddings); seq_length must "
        "not exceed it.")
    head_dim: int = help_field(0, "Per-head width; 0 means hidden_size // num_heads (the Qwen2 default).")
    rms_norm_eps: float = help_field(1e-6, "Epsilon of RMSNorm (Qwen2.5: 1e-6; Llama 2: 1e-5).")
    theta: float = help_field(1000000.0, "Rotary embedding base (HF rope_theta). Qwen2.5: 1e6; Llama 2: 1e4.")
    qkv_has_bias: bool = help_field(True, "Whether q/k/v projections have a bias. Qwen2: true; Llama: false.")
    tie_word_embeddings: bool = help_field(
        False, "Share the token embedding with lm_head (Qwen2.5-0.5B/1.5B: true; 7B: false).")
    value_head_bias: bool = help_field(
        False, "Value models only (critic, reward model): the scalar `score` head has a bias, as HF's "
               "*ForTokenClassification (verl's critic format); *ForSequenceClassification heads have none.")
    compute_dtype: str = help_field(
        "float32", "dtype of matmuls: float32 or float16 on CPU, bfloat16 on Ascend (no bf16 CPU kernels).")
    param_init_type: str = help_field("float32", "dtype the weights are stored in on device.")
    bos_token_id: int = help_field(151643, "Begin-of-text token id.")
    eos_token_id: int = help_field(
        151645, "End-of-sequence token id of the checkpoint (<|im_end|> for Qwen chat; written to config.json by "
                "tools/convert_weight.py). Generation stops at the tokenizer's stop ids, not at this. A list "
                "(MindFormers: [151645, 151643]) is read as its first id.")
    pad_token_id: int = help_field(151643, "Padding token id (<|endoftext|> for Qwen).")
    parallel_config: ParallelConfig = dataclasses.field(
        default_factory=ParallelConfig, metadata={"help": "Layout of this network (top-level `parallel_config`)."})
    use_flash_attention: bool = help_field(
        False, "MindFormers' flash attention: not built here (attention is softmax(q k^T) v): warned about on CPU, "
               "refused on Ascend/GPU.")
    recompute: RecomputeConfig = dataclasses.field(
        default_factory=RecomputeConfig, metadata={"help": "Activation recompute of trained nets (top-level "
                                                           "`recompute_config`)."})
    lora: LoraConfig = dataclasses.field(
        default_factory=LoraConfig, metadata={"help": "LoRA adapters of this network (the job's `lora` section): "
                                                      "rank 0 = none."})
    arch: str = help_field(DEFAULT_ARCH, "The network the YAML describes (`model.arch.type`, not a model_config "
                           "field): Qwen2ForCausalLM (alias LlamaForCausalLM) or Qwen2ForValue (critic, reward model).")

    def validate(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "n_kv_heads", "intermediate_size",
                     "seq_length"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"model_config.{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.n_kv_heads:
            raise ConfigError(f"model_config.num_heads={self.num_heads} is not a multiple of "
                              f"n_kv_heads={self.n_kv_heads}")
        if self.head_dim == 0 and self.hidden_size % self.num_heads:
            raise ConfigError(f"model_config.hidden_size={self.hidden_size} is not divisible by "
                              f"num_heads={self.num_heads}; set head_dim explicitly")
        if self.get_head_dim() % 2:
            raise ConfigError(f"model_config.head_dim={self.get_head_dim()} must be even for rotary embeddings")
        for name in ("compute_dtype", "param_init_type"):
            if getattr(self, name) not in DTYPES:
                raise ConfigError(f"model_config.{name}={getattr(self, name)!r}; expected one of {', '.join(DTYPES)}")
        if self.seq_length > self.max_position_embedding:
            raise ConfigError(f"model_config.seq_length={self.seq_length} exceeds "
                              f"max_position_embedding={self.max_position_embedding}")
        if self.rms_norm_eps <= 0 or self.theta <= 0:
            raise ConfigError("model_config.rms_norm_eps and theta must be positive")
        if self.lora.enabled:
            self.lora.check_widths(self.linear_widths())

    def linear_widths(self) -> dict[str, tuple[int, int]]:
        """(in, out) features of each linear layer of a decoder layer, by its Hugging Face name."""
        d, q, kv, i = self.hidden_size, self.num_heads * self.get_head_dim(), \
            self.n_kv_heads * self.get_head_dim(), self.intermediate_size
        return {"q_proj": (d, q), "k_proj": (d, kv), "v_proj": (d, kv), "o_proj": (q, d), "gate_proj": (d, i),
                "up_proj": (d, i), "down_proj": (i, d)}

    def get_head_dim(self) -> int:
        return self.head_dim or self.hidden_size // self.num_heads

    def num_parameters(self) -> int:
        """Parameter count of the full (unsplit) network."""
        d, hd = self.hidden_size, self.get_head_dim()
        q, kv = self.num_heads * hd, self.n_kv_heads * hd
        attn = d * q + 2 * d * kv + q * d + (q + 2 * kv if self.qkv_has_bias else 0)
        mlp = 3 * d * self.intermediate_size
        per_layer = attn + mlp + 2 * d
        emb = self.vocab_size * d
        return self.num_layers * per_layer + emb + d + (0 if self.tie_word_embeddings else emb)

    def memory_features(self) -> str:
        """The memory features this net's YAML turns on, for the log ('' when none)."""
        parallel = self.parallel_config
        stages, per_stage = parallel.pipeline_stage, self.num_layers // parallel.pipeline_stage
        full, selective = self.recompute.layers_of_stage(0, stages, per_stage)
        of_layers = f"{per_stage} layers" + (" of the first stage" if stages > 1 else "")
        features = ["sequence parallel"] if parallel.use_seq_parallel and parallel.model_parallel > 1 else []
        if full:
            features.append(f"full recompute of {full} of {of_layers}")
        if selective:
            features.append(f"attention recompute of {selective} of {of_layers}")
        if parallel.optimizer_shard and parallel.data_parallel > 1:
            features.append(f"AdamW moments sharded over data parallel {parallel.data_parallel}")
        return ", ".join(features)

    # ------------------------------------------------------------------ YAML
    @classmethod
    def from_yaml(cls, path: str | os.PathLike) -> Qwen2Config:
        """Loads `model.model_config` (and the top-level `parallel_config`) of a MindFormers-layout YAML."""
        path = os.fspath(path)
        data = load_yaml(path)
        return cls.from_dict(data, source=path)

    @classmethod
    def from_dict(cls, data: dict, source: str = "<dict>") -> Qwen2Config:
        """The config of a MindFormers-layout mapping. Foreign keys (`mindrlhf.configs.foreign_keys`) pass, are
        refused, or are ignored: the keys ignored are said in short warning lines, one a reason; an unknown key one
        edit away from a known one is refused with a did-you-mean."""
        model_cfg = get_section(data, "model.model_config", source)
        model_cfg.pop("parallel_config", None)
        if "arch" in model_cfg:
            raise ConfigError(f"{source}: unknown field 'arch' in model.model_config; the architecture is "
                              "model.arch.type")
        arch = read_arch(data, source)
        ignored = IgnoredKeys(source)
        check_top_level(data, ("model", "parallel_config", "recompute_config", "parallel"), ignored)
        for key in get_section(data, "model", source):
            if key not in MODEL_SECTION_KEYS:
                refuse_typo(key, f"model.{key}", MODEL_SECTION_KEYS, source)
                ignored.add(f"model.{key}", UNREAD)
        model_cfg, kv_channels = read_mindformers_names(model_cfg, ignored)
        check_foreign_keys(model_cfg, MODEL_KEYS, "model.model_config", ignored)
        cfg = from_mapping(cls, model_cfg, f"{source}: model.model_config",
                           frozenset(MODEL_KEYS) | frozenset(MODEL_ALIASES) | {"kv_channels"})
        cfg.check_kv_channels(kv_channels, source)
        cfg.parallel_config, cfg.recompute = read_parallel(data, source, ignored)
        cfg.arch = arch
        try:
            cfg.check_pipeline_stages()
        except ConfigError as err:
            raise ConfigError(f"{source}: {err}") from None
        ignored.warn()
        return cfg

    def check_kv_channels(self, kv_channels, source: str) -> None:
        """MindFormers' `kv_channels` (Qwen's name of the head width; its Llama builds hidden_size / num_heads wide
        heads whatever it says) must be this config's head width."""
        if kv_channels is None or kv_channels == self.get_head_dim():
            return
        width = (f"head_dim={self.head_dim}" if self.head_dim else
                 f"hidden_size / num_heads = {self.hidden_size} / {self.num_heads} = {self.get_head_dim()}")
        raise ConfigError(f"{source}: model.model_config.kv_channels={kv_channels!r} does not match the head width "
                          f"{width}; set kv_channels: {self.get_head_dim()} or remove it (head_dim sets heads of "
                          "another width)")

    def check_pipeline_stages(self) -> None:
        """The decoder must split into `parallel_config.pipeline_stage` equal shares (and a per-stage recompute list
        must have one entry per stage)."""
        stages = self.parallel_config.pipeline_stage
        self.recompute.layers_of_stage(0, stages, self.num_layers // stages)
        if stages == 1:
            return
        if self.num_layers % stages:
            raise ConfigError(f"model_config.num_layers={self.num_layers} is not divisible by parallel_config."
                              f"pipeline_stage={stages}")

    def to_dict(self) -> dict:
        model_cfg = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                     if f.name not in ("parallel_config", "arch", "recompute", "lora")}  # lora: the job's
        model_cfg = {"type": "Qwen2Config", **model_cfg}
        data = {
            "model": {"model_config": model_cfg, "arch": {"type": self.arch}},
            "parallel_config": dataclasses.asdict(self.parallel_config),
        }
        if self.recompute != RecomputeConfig():
            data["recompute_config"] = dataclasses.asdict(self.recompute)
        return data

    def to_yaml(self, path: str | os.PathLike) -> None:
        """Writes the MindFormers-layout YAML (atomically)."""
        with atomic_output(path, ".yaml") as tmp:
            with open(tmp, "w", encoding="utf-8") as f:
                yaml.safe_dump(self.to_dict(), f, sort_keys=False)

    # ------------------------------------------------------------ HF config
    @classmethod
    def from_hf(cls, config_json_path: str | os.PathLike, seq_length: int | None = None, **overrides) -> Qwen2Config:
        """Builds the config from a Hugging Face `config.json` (Qwen2 or Llama)."""
        path = os.fspath(config_json_path)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        if not os.path.isfile(path):
            raise ConfigError(f"{path}: Hugging Face config.json not found")
        try:
            with open(path, encoding="utf-8") as f:
                hf = json.load(f)
        except json.JSONDecodeError as err:
            raise ConfigError(f"{path}: not valid JSON: {err}") from None
        model_type = hf.get("model_type")
        if model_type not in SUPPORTED_HF_ARCHS:
            archs = hf.get("architectures")
            raise ConfigError(f"{path}: model_type={model_type!r} (architectures={archs}) is not supported; "
                              f"expected one of {', '.join(SUPPORTED_HF_ARCHS)}")
        if hf.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"{path}: hidden_act={hf['hidden_act']!r}; only 'silu' (SwiGLU) is supported")
        scaling = hf.get("rope_scaling")
        if scaling and (scaling.get("rope_type") or scaling.get("type")) not in (None, "default"):
            raise ConfigError(f"{path}: rope_scaling={scaling} is not supported; only plain rotary embeddings")
        try:
            max_pos = int(hf.get("max_position_embeddings", 32768))
            theta = hf.get("rope_theta")
            if theta is None:
                theta = (hf.get("rope_parameters") or {}).get("rope_theta", 10000.0)
            values = dict(
                vocab_size=hf["vocab_size"],
                hidden_size=hf["hidden_size"],
                num_layers=hf["num_hidden_layers"],
                num_heads=hf["num_attention_heads"],
                n_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
                intermediate_size=hf["intermediate_size"],
                seq_length=seq_length or min(max_pos, 4096),
                max_position_embedding=max_pos,
                head_dim=hf.get("head_dim") or 0,
                rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
                theta=float(theta),
                qkv_has_bias=bool(hf.get("attention_bias", SUPPORTED_HF_ARCHS[model_type])),
                tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
                value_head_bias=any(a.endswith("ForTokenClassification") for a in hf.get("architectures") or []),
                arch="Qwen2ForValue" if any(a.endswith(("ForSequenceClassification", "ForTokenClassification"))
                                            for a in hf.get("architectures") or []) else DEFAULT_ARCH,
            )
        except KeyError as err:
            raise ConfigError(f"{path}: missing field {err.args[0]!r}") from None
        for key, hf_key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                            ("pad_token_id", "pad_token_id")):
            val = hf.get(hf_key)
            if isinstance(val, list):
                val = val[0] if val else None
            if val is not None:
                values[key] = int(val)
        if values["head_dim"] == values["hidden_size"] // values["num_heads"]:
            values["head_dim"] = 0
        values.update(overrides)
        return from_mapping(cls, values, path)


def read_parallel(data: dict, source: str, ignored: IgnoredKeys) -> tuple[ParallelConfig, RecomputeConfig]:
    """The top-level `parallel_config` and `recompute_config` of a MindFormers YAML, with the older places of their
    keys: `parallel_config.recompute` (a bool or a recompute mapping) and `parallel.enable_parallel_optimizer` (the
    rest of MindFormers' `parallel` section configures semi-auto parallel, which is not used here: its keys are added
    to `ignored`)."""
    section = get_section(data, "parallel_config", source, required=False)
    legacy_recompute = section.pop("recompute", None)
    check_foreign_keys(section, PARALLEL_KEYS, "parallel_config", ignored)
    parallel = from_mapping(ParallelConfig, section, f"{source}: parallel_config", frozenset(PARALLEL_KEYS))
    context = get_section(data, "parallel", source, required=False)
    if context.pop("enable_parallel_optimizer", False):
        parallel.optimizer_shard = True
    for key in context:
        refuse_typo(key, f"parallel.{key}", ("enable_parallel_optimizer",), source)
        ignored.add(f"parallel.{key}", "layouts are explicit per network (parallel_config), not MindSpore's "
                                       "semi-auto parallel")
    recompute = get_section(data, "recompute_config", source, required=False)
    if not recompute and legacy_recompute is not None:
        recompute = dict(legacy_recompute) if isinstance(legacy_recompute, dict) else {"recompute": legacy_recompute}
    return parallel, from_mapping(RecomputeConfig, recompute, f"{source}: recompute_config")


def read_mindformers_names(model_cfg: dict, ignored: IgnoredKeys) -> tuple[dict, object]:
    """`model.model_config` with MindFormers' / Hugging Face's other names of fields read as the fields
    (`MODEL_ALIASES`), a list `eos_token_id` read as its first id (the rest added to `ignored`), and `kv_channels`
    taken out: (the mapping, kv_channels or None) for `Qwen2Config.check_kv_channels`."""
    values = read_aliases(model_cfg, MODEL_ALIASES, "model.model_config", ignored.source)
    kv_channels = values.pop("kv_channels", None)
    eos = values.get("eos_token_id")
    if isinstance(eos, (list, tuple)):
        if not eos:
            raise ConfigError(f"{ignored.source}: model.model_config.eos_token_id=[] names no token; give the "
                              "end-of-sequence id (e.g. 151645)")
        values["eos_token_id"] = eos[0]
        if len(eos) > 1:
            ignored.add(f"model.model_config.eos_token_id[1:]={list(eos[1:])!r}", EOS_LIST_REASON)
    return values, kv_channels


def read_arch(data: dict, source: str) -> str:
    """`model.arch.type` (default Qwen2ForCausalLM) as the name of the network it describes (`ARCHS`)."""
    arch = get_section(data, "model.arch", source, required=False).get("type", DEFAULT_ARCH)
    if not isinstance(arch, str) or arch not in ARCHS:
        raise ConfigError(f"{source}: model.arch.type={arch!r} is not a known architecture; expected one of "
                          f"{', '.join(ARCHS)}")
    return ARCHS[arch]
