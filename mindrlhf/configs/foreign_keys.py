"""Keys of MindFormers / MindRLHF model YAMLs that are not fields of this implementation's configs, and what each
does here: a value that means what this implementation does anyway passes; any other value is ignored with a reason
(it has no effect on results or memory here) or refused (it asks for something not built here; the error says what
to set instead). The keys one YAML load ignores are said in short warning lines, one per reason naming its keys
(`IgnoredKeys`). An unknown key one edit away from a known one is taken for a typo of it and refused with a
did-you-mean (`refuse_typo`). Other names of fields (`MODEL_ALIASES`) are read as the field. No key is dropped without
a word. `docs/yaml_keys.md` lists them.
"""
from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from mindrlhf.configs.base import ConfigError, closest_key

logger = logging.getLogger("mindrlhf.config")

WARN, REFUSE = "warn", "refuse"


@dataclass(frozen=True)
class ForeignKey:
    """What a foreign key's value does here: `fine(value)` is True when it means what this implementation does;
    otherwise `action` (WARN or REFUSE) with `advice`."""

    fine: Callable[[Any], bool]
    action: str
    advice: str


def always(_value) -> bool:
    """`ForeignKey.fine` of a key whose every value is fine (it changes nothing here)."""
    return True


def never(_value) -> bool:
    """`ForeignKey.fine` of a key whose every value gets its action (warned about or refused)."""
    return False


def _falsy(value) -> bool:
    return not value or value in ("None", "none")


def _at_most_one(value) -> bool:
    return value in (None, 0, 1)


def _float32(value) -> bool:
    return value in (None, "float32", "fp32")


def _no_offset(value) -> bool:
    return not value or (isinstance(value, (list, tuple)) and not any(value))


# MindFormers' generation defaults inside model_config
_SAMPLING = ("MindFormers' generation defaults; here sampling is set by the GRPO config (grpo.yaml): "
             "generation.temperature, generation.top_k, generation.top_p, generation.do_sample and "
             "generation.max_new_tokens (for max_decode_length); no minimum length and no repetition penalty are "
             "applied")

MODEL_KEYS: dict[str, ForeignKey] = {
    "type": ForeignKey(always, WARN, "the config class name; the network is model.arch.type"),
    "batch_size": ForeignKey(always, WARN, "batch sizes come from the GRPO config (batch_size, num_generations, "
                                           "micro_batch_size_per_device)"),
    "model_name": ForeignKey(always, WARN, "a label only"),
    "auto_map": ForeignKey(always, WARN, "a label only"),
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
    "temperature": ForeignKey(never, WARN, _SAMPLING),
    "top_k": ForeignKey(never, WARN, _SAMPLING),
    "top_p": ForeignKey(never, WARN, _SAMPLING),
    "do_sample": ForeignKey(never, WARN, _SAMPLING),
    "max_decode_length": ForeignKey(never, WARN, _SAMPLING),
    "min_decode_length": ForeignKey(never, WARN, _SAMPLING),
    "is_dynamic": ForeignKey(always, WARN, "input shapes are bucketed here (generation.prompt_buckets, "
                                           "schedule.response_buckets)"),
    "block_size": ForeignKey(always, WARN, "the KV cache is static (no paged attention)"),
    "num_blocks": ForeignKey(always, WARN, "the KV cache is static (no paged attention)"),
    "use_past_shard": ForeignKey(_falsy, WARN, "the KV cache is split over model_parallel with the heads"),
    "qkv_concat": ForeignKey(_falsy, REFUSE, "q, k and v are separate projections here; set qkv_concat: false (and "
                                             "convert fused checkpoints with tools/convert_weight.py)"),
    "pretrain_seqlen": ForeignKey(always, WARN, "seq_length and max_position_embedding bound the positions"),
    "extend_method": ForeignKey(_falsy, REFUSE, "rotary scaling is not built here; set extend_method: None"),
    "scaling_factor": ForeignKey(always, WARN, "only read with extend_method, which is refused"),
    "layernorm_compute_type": ForeignKey(_float32, WARN, "RMSNorm always computes in float32 here"),
    "softmax_compute_type": ForeignKey(_float32, WARN, "softmax always computes in float32 here"),
    "rotary_dtype": ForeignKey(_float32, WARN, "rotary tables are always float32 here"),
    "emb_dropout_prob": ForeignKey(_falsy, WARN, "no dropout in RL post-training here"),
    "ignore_token_id": ForeignKey(always, WARN, "losses read the response mask, not an ignore id"),
    "fine_grain_interleave": ForeignKey(_at_most_one, WARN, "a communication-overlap knob of semi-auto parallel; "
                                                            "no effect here"),
    "use_rope_slice": ForeignKey(always, WARN, "rotary uses one rotate-half matmul here"),
    "multiple_of": ForeignKey(always, WARN, "intermediate_size is given directly"),
    "ffn_dim_multiplier": ForeignKey(always, WARN, "intermediate_size is given directly"),
    "hidden_act": ForeignKey(lambda v: v in (None, "silu", "swiglu"), REFUSE, "only SwiGLU (silu) is built here"),
    "use_attn_mask_compression": ForeignKey(always, WARN, "attention masks are built per call here"),
    "parallel_optimizer": ForeignKey(_falsy, WARN, "set parallel_config.optimizer_shard: true for ZeRO-1 "
                                                   "optimizer-state sharding"),
    # keys MindRLHF's Qwen2.5 YAMLs carry ("configuration items copied from Qwen")
    "compute_in_2d": ForeignKey(never, WARN, "a MindFormers layout detail (2-D activations for semi-auto sharding); "
                                             "no meaning here"),
    "rotary_pct": ForeignKey(lambda v: v in (None, 1, 1.0), REFUSE,
                             "rotary embeddings cover the whole head here (partial rotary is not built); set "
                             "rotary_pct: 1.0"),
}

# other names of `model.model_config` fields (Qwen's / Hugging Face's): read as the field; both given with different
# values is an error naming both
MODEL_ALIASES: dict[str, str] = {
    "rotary_emb_base": "theta",
    "max_position_embeddings": "max_position_embedding",
}

# verl's names of GRPO config fields, by section, read as the field (`read_verl_keys`)
VERL_ALIASES: dict[str, dict[str, str]] = {"lora": {"target_modules": "lora_target_modules"}}


def read_verl_keys(section: str, values: Mapping, source: str) -> dict:
    """A GRPO YAML section with verl's names read as this config's fields: `lora.target_modules`, and
    `generation.max_assistant_turns` (the model's turns: tool turns + 1); `max_tool_response_length` (characters of
    a tool's text in verl) is refused, naming the field that bounds a tool turn here (in tokens)."""
    out = read_aliases(values, VERL_ALIASES.get(section, {}), section, source)
    if section != "generation":
        return out
    if "max_tool_response_length" in out:
        raise ConfigError(f"{source}: generation.max_tool_response_length is verl's cut of a tool's text in "
                          "characters; here a tool turn is cut in tokens: give generation.max_tool_response_tokens")
    if "max_assistant_turns" in out:
        turns = out.pop("max_assistant_turns")
        if isinstance(turns, bool) or not isinstance(turns, int) or turns < 1:
            raise ConfigError(f"{source}: generation.max_assistant_turns must be an integer >= 1 (verl's count of "
                              f"the model's turns), got {turns!r}")
        given = out.get("max_tool_calling_iterations", turns - 1)
        if given != turns - 1:
            raise ConfigError(f"{source}: generation.max_assistant_turns={turns} (verl's: {turns - 1} tool turns) "
                              f"and generation.max_tool_calling_iterations={given} disagree; give one of them")
        out["max_tool_calling_iterations"] = turns - 1
    return out


# `model.model_config.eos_token_id` given as a list (MindFormers' predict YAMLs: [151645, 151643]): the first id is
# the model's eos_token_id; the rest is said with this reason
EOS_LIST_REASON = ("the first id is the model's eos_token_id; generation stops at the tokenizer's stop ids (Qwen2 "
                   "vocab.json/merges.txt: <|im_end|> and <|endoftext|>; a --tokenizer_dir: its eos token and "
                   "generation_config.json's eos_token_id), not at these")

PARALLEL_KEYS: dict[str, ForeignKey] = {
    "vocab_emb_dp": ForeignKey(_falsy, WARN, "the embedding is always split over model_parallel here (what "
                                             "vocab_emb_dp: false does; it holds less per device)"),
    "gradient_aggregation_group": ForeignKey(always, WARN, "gradients are summed over data parallel in one fused "
                                                           "call here"),
    "micro_batch_interleave_num": ForeignKey(_at_most_one, WARN, "a communication-overlap knob of semi-auto "
                                                                 "parallel; no effect here"),
    "expert_parallel": ForeignKey(_at_most_one, REFUSE, "no mixture-of-experts model is built here; set 1"),
    "context_parallel": ForeignKey(_at_most_one, REFUSE, "context parallel is not built here; set 1"),
}

# top-level settings of a MindFormers YAML (scalars)
TOP_LEVEL_KEYS: dict[str, ForeignKey] = {
    "seed": ForeignKey(always, WARN, "the GRPO config's seed"),
    "output_dir": ForeignKey(always, WARN, "--output_dir"),
    "run_mode": ForeignKey(always, WARN, "the job is GRPO/PPO post-training"),
    "use_parallel": ForeignKey(always, WARN, "--use_parallel (auto: when launched by msrun)"),
    "load_checkpoint": ForeignKey(_falsy, WARN, "weights are not loaded from the model YAML: pass "
                                                "--load_sft_checkpoint_train / --load_sft_checkpoint_infer"),
    "src_strategy_path_or_dir": ForeignKey(_falsy, WARN, "checkpoints carry their strategy files; "
                                                         "tools/convert_weight.py and the loaders read them"),
    "auto_trans_ckpt": ForeignKey(always, WARN, "checkpoints are resharded to the job's layouts automatically"),
    "resume_training": ForeignKey(_falsy, WARN, "resume with --resume auto (or a step folder)"),
    "only_save_strategy": ForeignKey(_falsy, WARN, "pass --only_save_strategy"),
    "micro_batch_interleave_num": PARALLEL_KEYS["micro_batch_interleave_num"],
    "load_ckpt_format": ForeignKey(lambda v: v in (None, "ckpt"), WARN, "checkpoints here are MindSpore .ckpt "
                                                                       "(tools/convert_weight.py converts Hugging "
                                                                       "Face safetensors)"),
    "do_eval": ForeignKey(_falsy, WARN, "no evaluation inside training epochs here: pass --eval_dataset_file (and "
                                        "the GRPO config's eval.eval_interval)"),
    "eval_step_interval": ForeignKey(always, WARN, "only read with do_eval"),
    "eval_epoch_interval": ForeignKey(always, WARN, "only read with do_eval"),
    "profile": ForeignKey(_falsy, WARN, "MindFormers' profiler is not wired here; phase timings are in the per-step "
                                        "metrics"),
    "profile_start_step": ForeignKey(always, WARN, "only read with profile"),
    "profile_stop_step": ForeignKey(always, WARN, "only read with profile"),
    "init_start_profile": ForeignKey(always, WARN, "only read with profile"),
    "profile_communication": ForeignKey(always, WARN, "only read with profile"),
    "profile_memory": ForeignKey(always, WARN, "only read with profile"),
    "auto_tune": ForeignKey(_falsy, WARN, "MindFormers' auto-tuning is not built here"),
    "filepath_prefix": ForeignKey(always, WARN, "only read with auto_tune"),
    "autotune_per_step": ForeignKey(always, WARN, "only read with auto_tune"),
    "layer_scale": ForeignKey(_falsy, WARN, "layer-wise learning-rate decay is not built here"),
    "layer_decay": ForeignKey(always, WARN, "only read with layer_scale"),
    "lr_scale_factor": ForeignKey(always, WARN, "only read with MindFormers' lr_scale (not built here)"),
    "remote_save_url": ForeignKey(always, WARN, "an upload address of Huawei's AICC platform; checkpoints are "
                                                "written to --save_ckpt_dir"),
}


UNREAD = "it is not a key this implementation reads"

# top-level sections of a MindFormers YAML besides model, parallel_config, recompute_config and parallel
SECTIONS: dict[str, str] = {
    "context": "MindSpore's context is set by mindrlhf (graph mode, on the device the installed MindSpore targets)",
    "runner_config": "epochs and batch sizes come from the GRPO config",
    "trainer": "the trainer is mindrlhf's",
    "optimizer": "the optimizer comes from the GRPO config's optimizer section",
    "lr_schedule": "the learning-rate schedule comes from the GRPO config's optimizer section",
    "processor": "the tokenizer comes from --vocab_path / --tokenizer_dir",
    "moe_config": "no mixture-of-experts model is built here",
    "runner_wrapper": "no loss scaling is applied here; gradient clipping is the GRPO config's optimizer.max_grad_norm",
    "train_dataset": "prompts come from --mind_dataset_dir",
    "train_dataset_task": "prompts come from --mind_dataset_dir",
    "eval_dataset": "held-out prompts come from --eval_dataset_file",
    "eval_dataset_task": "held-out prompts come from --eval_dataset_file",
    "callbacks": "logging and checkpoints are mindrlhf's (the per-step line, metrics.jsonl, --save_ckpt_dir and the "
                 "GRPO config's checkpoint section)",
    "eval_callbacks": "evaluation is mindrlhf's (--eval_dataset_file)",
    "metric": "held-out evaluation reports the accuracy reward of greedy answers (--eval_dataset_file)",
}


class IgnoredKeys:
    """The keys one YAML load ignores, grouped by reason (`add`), each reason said in a short warning line (`warn`)."""

    def __init__(self, source: str):
        self.source = source
        self.by_reason: dict[str, list[str]] = {}

    def add(self, where: str, reason: str) -> None:
        self.by_reason.setdefault(reason, []).append(where)

    def messages(self) -> list[str]:
        """One line a reason: '<source>: a=1, b=2 have no effect here: <reason>'."""
        return [f"{self.source}: {', '.join(keys)} {'has' if len(keys) == 1 else 'have'} no effect here: {reason}"
                for reason, keys in self.by_reason.items()]

    def warn(self) -> None:
        for message in self.messages():
            warn_once(message)


def refuse_typo(key: str, where: str, known: Iterable[str], source: str) -> None:
    """A key no rule knows that is one edit away from a known one (`closest_key`) is taken for a typo of it: a
    ConfigError '<source>: <where>: unknown key (did you mean '<known>'?)'. A key farther away passes (the caller
    warns that it is ignored)."""
    close = closest_key(key, known, one_edit=True)
    if close is not None:
        raise ConfigError(f"{source}: {where}: unknown key (did you mean '{close}'?)")


def check_foreign_keys(values: Mapping, rules: Mapping[str, ForeignKey], section: str, ignored: IgnoredKeys) -> None:
    """Refuses, or adds to `ignored`, each key of `values` that `rules` names and whose value is not fine there."""
    for key, value in values.items():
        rule = rules.get(key)
        if rule is None or rule.fine(value):
            continue
        where = f"{section + '.' if section else ''}{key}={value!r}"
        if rule.action == REFUSE:
            raise ConfigError(f"{ignored.source}: {where} is not supported: {rule.advice}")
        ignored.add(where, rule.advice)


def check_top_level(data: Mapping, known: tuple[str, ...], ignored: IgnoredKeys) -> None:
    """Checks the top-level keys of a model YAML besides the sections read here (`known`): settings by
    `TOP_LEVEL_KEYS`, other sections and settings added to `ignored` with the reason (`SECTIONS`); an unknown key one
    edit away from a known one is refused (`refuse_typo`)."""
    rest = {key: value for key, value in data.items() if key not in known}
    check_foreign_keys({k: v for k, v in rest.items() if k in TOP_LEVEL_KEYS}, TOP_LEVEL_KEYS, "", ignored)
    for name in rest:
        if name in TOP_LEVEL_KEYS:
            continue
        if name not in SECTIONS:
            refuse_typo(name, str(name), (*known, *TOP_LEVEL_KEYS, *SECTIONS), ignored.source)
        ignored.add(repr(name), SECTIONS.get(name, UNREAD))


def read_aliases(values: dict, aliases: Mapping[str, str], section: str, source: str) -> dict:
    """`values` with each alias key renamed to the field it names; an alias and its field given with different
    values is a ConfigError naming both."""
    out = dict(values)
    for alias, field in aliases.items():
        if alias not in out:
            continue
        value = out.pop(alias)
        if field in out and out[field] != value:
            raise ConfigError(f"{source}: {section}.{alias}={value!r} and {section}.{field}={out[field]!r} disagree: "
                              f"{alias} is another name of {field}; give one of them (or the same value)")
        out[field] = value
    return out


@functools.cache
def warn_once(message: str) -> None:
    """Logs `message` once per process (a YAML is read by several parts of a job)."""
    logger.warning(message)
