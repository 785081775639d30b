"""Keys of MindFormers / MindRLHF model YAMLs that are not fields of this implementation's configs, and what each
does here: a value that means what this implementation does anyway passes; any other value is warned about (it has
no effect on results or memory here, said in one line naming the key) or refused (it asks for something not built
here; the error says what to set instead). No key is dropped without a word. `docs/yaml_keys.md` lists them.
"""
from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from mindrlhf.configs.base import ConfigError

logger = logging.getLogger("mindrlhf.config")

WARN, REFUSE = "warn", "refuse"


@dataclass(frozen=True)
class ForeignKey:
    """What a foreign key's value does here: `fine(value)` is True when it means what this implementation does;
    otherwise `action` (WARN or REFUSE) with `advice`."""

    fine: Callable[[Any], bool]
    action: str
    advice: str


def _always(_value) -> bool:
    return True


def _falsy(value) -> bool:
    return not value or value in ("None", "none")


def _at_most_one(value) -> bool:
    return value in (None, 0, 1)


def _float32(value) -> bool:
    return value in (None, "float32", "fp32")


def _no_offset(value) -> bool:
    return not value or (isinstance(value, (list, tuple)) and not any(value))


_SAMPLING = "sampling comes from the GRPO config's generation section (temperature, top_k, top_p, max_new_tokens)"

MODEL_KEYS: dict[str, ForeignKey] = {
    "type": ForeignKey(_always, WARN, "the config class name; the network is model.arch.type"),
    "batch_size": ForeignKey(_always, WARN, "batch sizes come from the GRPO config (batch_size, num_generations, "
                                            "micro_batch_size_per_device)"),
    "model_name": ForeignKey(_always, WARN, "a label only"),
    "auto_map": ForeignKey(_always, WARN, "a label only"),
    "use_past": ForeignKey(lambda v: v in (None, True), WARN,
                           "generation always uses the KV cache unless the GRPO config sets generation.use_kv_cache: "
                           "false; set use_past: true"),
    "use_flash_attention": ForeignKey(_falsy, WARN,
                                      "attention is computed as softmax(q k^T) v (flash attention is not built here; "
                                      "on Ascend/GPU a job with it true is refused); set it to false"),
    "checkpoint_name_or_path": ForeignKey(_falsy, WARN,
                                          "weights are not loaded from the model YAML: pass "
                                          "--load_sft_checkpoint_train / --load_sft_checkpoint_infer (--resume to "
                                          "continue a run)"),
    "offset": ForeignKey(_no_offset, REFUSE, "pipeline stages take equal shares of the layers here; set offset: 0"),
    "repetition_penalty": ForeignKey(lambda v: v in (None, 1, 1.0), WARN, _SAMPLING),
    "top_k": ForeignKey(_always, WARN, _SAMPLING),
    "top_p": ForeignKey(_always, WARN, _SAMPLING),
    "do_sample": ForeignKey(_always, WARN, _SAMPLING),
    "max_decode_length": ForeignKey(_always, WARN, _SAMPLING),
    "is_dynamic": ForeignKey(_always, WARN, "input shapes are bucketed here (generation.prompt_buckets, "
                                            "schedule.response_buckets)"),
    "block_size": ForeignKey(_always, WARN, "the KV cache is static (no paged attention)"),
    "num_blocks": ForeignKey(_always, WARN, "the KV cache is static (no paged attention)"),
    "use_past_shard": ForeignKey(_falsy, WARN, "the KV cache is split over model_parallel with the heads"),
    "qkv_concat": ForeignKey(_falsy, REFUSE, "q, k and v are separate projections here; set qkv_concat: false (and "
                                             "convert fused checkpoints with tools/convert_weight.py)"),
    "pretrain_seqlen": ForeignKey(_always, WARN, "seq_length and max_position_embedding bound the positions"),
    "extend_method": ForeignKey(_falsy, REFUSE, "rotary scaling is not built here; set extend_method: None"),
    "scaling_factor": ForeignKey(_always, WARN, "only read with extend_method, which is refused"),
    "layernorm_compute_type": ForeignKey(_float32, WARN, "RMSNorm always computes in float32 here"),
    "softmax_compute_type": ForeignKey(_float32, WARN, "softmax always computes in float32 here"),
    "rotary_dtype": ForeignKey(_float32, WARN, "rotary tables are always float32 here"),
    "emb_dropout_prob": ForeignKey(_falsy, WARN, "no dropout in RL post-training here"),
    "ignore_token_id": ForeignKey(_always, WARN, "losses read the response mask, not an ignore id"),
    "fine_grain_interleave": ForeignKey(_at_most_one, WARN, "a communication-overlap knob of semi-auto parallel; "
                                                            "no effect here"),
    "use_rope_slice": ForeignKey(_always, WARN, "rotary uses one rotate-half matmul here"),
    "multiple_of": ForeignKey(_always, WARN, "intermediate_size is given directly"),
    "ffn_dim_multiplier": ForeignKey(_always, WARN, "intermediate_size is given directly"),
    "hidden_act": ForeignKey(lambda v: v in (None, "silu", "swiglu"), REFUSE, "only SwiGLU (silu) is built here"),
    "use_attn_mask_compression": ForeignKey(_always, WARN, "attention masks are built per call here"),
    "parallel_optimizer": ForeignKey(_falsy, WARN, "set parallel_config.optimizer_shard: true for ZeRO-1 "
                                                   "optimizer-state sharding"),
}

PARALLEL_KEYS: dict[str, ForeignKey] = {
    "vocab_emb_dp": ForeignKey(_falsy, WARN, "the embedding is always split over model_parallel here (what "
                                             "vocab_emb_dp: false does; it holds less per device)"),
    "gradient_aggregation_group": ForeignKey(_always, WARN, "gradients are summed over data parallel in one fused "
                                                            "call here"),
    "micro_batch_interleave_num": ForeignKey(_at_most_one, WARN, "a communication-overlap knob of semi-auto "
                                                                 "parallel; no effect here"),
    "expert_parallel": ForeignKey(_at_most_one, REFUSE, "no mixture-of-experts model is built here; set 1"),
    "context_parallel": ForeignKey(_at_most_one, REFUSE, "context parallel is not built here; set 1"),
}

# top-level settings of a MindFormers YAML (scalars)
TOP_LEVEL_KEYS: dict[str, ForeignKey] = {
    "seed": ForeignKey(_always, WARN, "the GRPO config's seed"),
    "output_dir": ForeignKey(_always, WARN, "--output_dir"),
    "run_mode": ForeignKey(_always, WARN, "the job is GRPO/PPO post-training"),
    "use_parallel": ForeignKey(_always, WARN, "--use_parallel (auto: when launched by msrun)"),
    "load_checkpoint": ForeignKey(_falsy, WARN, "weights are not loaded from the model YAML: pass "
                                                "--load_sft_checkpoint_train / --load_sft_checkpoint_infer"),
    "src_strategy_path_or_dir": ForeignKey(_falsy, WARN, "checkpoints carry their strategy files; "
                                                         "tools/convert_weight.py and the loaders read them"),
    "auto_trans_ckpt": ForeignKey(_always, WARN, "checkpoints are resharded to the job's layouts automatically"),
    "resume_training": ForeignKey(_falsy, WARN, "resume with --resume auto (or a step folder)"),
    "only_save_strategy": ForeignKey(_falsy, WARN, "pass --only_save_strategy"),
}


# top-level sections of a MindFormers YAML besides model, parallel_config, recompute_config and parallel
SECTIONS: dict[str, str] = {
    "context": "MindSpore's context is set by mindrlhf (graph mode, on the device the installed MindSpore targets)",
    "runner_config": "epochs and batch sizes come from the GRPO config",
    "trainer": "the trainer is mindrlhf's",
    "optimizer": "the optimizer comes from the GRPO config's optimizer section",
    "lr_schedule": "the learning-rate schedule comes from the GRPO config's optimizer section",
    "processor": "the tokenizer comes from --vocab_path / --tokenizer_dir",
    "moe_config": "no mixture-of-experts model is built here",
}


def check_foreign_keys(values: Mapping, rules: Mapping[str, ForeignKey], section: str, source: str) -> None:
    """Warns about, or refuses, each key of `values` that `rules` names and whose value is not fine there."""
    for key, value in values.items():
        rule = rules.get(key)
        if rule is None or rule.fine(value):
            continue
        where = f"{source}: {section + '.' if section else ''}{key}={value!r}"
        if rule.action == REFUSE:
            raise ConfigError(f"{where} is not supported: {rule.advice}")
        warn_once(f"{where} has no effect here: {rule.advice}")


def check_top_level(data: Mapping, known: tuple[str, ...], source: str) -> None:
    """Checks the top-level keys of a model YAML besides the sections read here (`known`): settings by
    `TOP_LEVEL_KEYS`, other sections and settings with a warning naming each."""
    rest = {key: value for key, value in data.items() if key not in known}
    check_foreign_keys({k: v for k, v in rest.items() if k in TOP_LEVEL_KEYS}, TOP_LEVEL_KEYS, "", source)
    for name in rest:
        if name in TOP_LEVEL_KEYS:
            continue
        reason = SECTIONS.get(name, "it is not a key this implementation reads")
        warn_once(f"{source}: {name!r} has no effect here: {reason}")


@functools.cache
def warn_once(message: str) -> None:
    """Logs `message` once per process (a YAML is read by several parts of a job)."""
    logger.warning(message)

