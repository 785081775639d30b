"""MindSpeed-RL's GRPO trainer YAML read as a GRPO config (`--config grpo_trainer_qwen25_7b.yaml`).

MindSpeed-RL describes a GRPO job in one YAML, `configs/grpo_trainer_<model>_<size>_<device>.yaml`, with the sections
`defaults`, `megatron_training`, `actor_config` (and `ref_config`, `reward_config`), `rl_config` and `generate_config`.
`translate` turns such a file into the `{section: {field: value}}` mapping `GRPOConfig.from_dict` takes. Each key is
read as MindSpeed-RL reads it (`actor_config` over `megatron_training`, Megatron's `a-b` or `a_b` spelling;
`rl_config.mini_batch_size` in prompts, which its `RLConfig` multiplies by n_samples_per_prompt) and is mapped onto a
field, accepted (its value means what mindrlhf does anyway), ignored with its reason, or refused with what to set
instead (a `ConfigError` naming the file and `section.key=value`). An unknown key (or section, or verifier name) one
edit away from a known one is taken for a typo and refused with a did-you-mean (MindSpeed-RL itself would train on
its default); the keys a file ignores, an unknown key farther from every known one included, and the keys read only
approximately (a verifier that scores a little differently, ...) are said in short warning lines, one a reason or
approximation (`MindSpeedNotes`, the `IgnoredKeys` way). Only what the file says is translated: a key it leaves out
keeps mindrlhf's value. docs/yaml_keys.md lists every key.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mindrlhf.configs.base import ConfigError, closest_key
from mindrlhf.configs.foreign_keys import REFUSE, WARN, ForeignKey, IgnoredKeys, always, never, refuse_typo

TOP_SECTIONS = ("defaults", "megatron_training", "actor_config", "ref_config", "reward_config", "rl_config",
                "generate_config")


@dataclass(frozen=True)
class ToFields:
    """A key whose value becomes each of `fields` ('section.field') here, checked to be a `kind` (int or float)."""

    fields: tuple[str, ...]
    kind: type = int


COMPUTED = "computed"  # a key read by its section's function: it depends on other keys or its values are mapped
Rule = ForeignKey | ToFields | str


def _falsy(value) -> bool:
    return not value


def _true_or_unset(value) -> bool:
    return value is None or value is True


def _one(value) -> bool:
    return value is None or value == 1


def _zero(value) -> bool:
    return value is None or value == 0


UNKNOWN_KEY = "not a key of MindSpeed-RL's GRPO trainer YAML that this reader knows"
UNKNOWN_SECTION = "not a section of MindSpeed-RL's GRPO trainer YAML"
_NETWORKS = ("the networks are the model YAMLs (MindFormers layout) given as --sft_path_train and --sft_path_infer, "
             "e.g. model_configs/qwen_grpo/finetune_qwen2_5_7b.yaml and predict_qwen2_5_7b_instruct.yaml")
_TRAIN_TP = "the train layout is the train model YAML's (--sft_path_train): set parallel_config.model_parallel there"
_TRAIN_PP = "the train layout is the train model YAML's (--sft_path_train): set parallel_config.pipeline_stage there"
_INFER_TP = ("the inference layout is the inference model YAML's (--sft_path_infer): set "
             "parallel_config.model_parallel there")
_INFER_PP = ("the inference layout is the inference model YAML's (--sft_path_infer): set "
             "parallel_config.pipeline_stage there")
_REF_LAYOUT = ("the reference net runs on the inference layout here: parallel_config of the inference model YAML "
               "(--sft_path_infer)")
_NO_MOE = "no mixture-of-experts model is built here; set 1"
_KERNELS = ("a Megatron/MindSpeed kernel or runtime switch (the same math); the nets here are mindrlhf's MindSpore "
            "graphs")
_DTYPES = "dtypes are the model YAMLs' (model_config.compute_dtype and param_init_type)"
_DROPOUT = "no dropout in RL post-training here"
_SEQ_LENGTH = ("sequence lengths are model_config.seq_length of the model YAMLs; the inference one must hold the "
               "largest of generation.prompt_buckets (rl_config.max_prompt_length) + generation.max_new_tokens "
               "(max_tokens)")
_RECOMPUTE = ("recompute is set in the train model YAML (--sft_path_train): its recompute_config reads "
              "recompute_granularity, recompute_method and recompute_num_layers as MindSpeed-RL does")
_DATA = ("prompts come from --mind_dataset_dir: convert the raw problems with mindrlhf-prepare-data (MindSpeed-RL's "
         "preprocessed data is not read)")
_LOAD = ("pass the starting policy as --load_sft_checkpoint_train (a MindSpore checkpoint: mindrlhf-convert-weight "
         "converts Hugging Face weights)")
_SAVE = "checkpoints are written to --save_ckpt_dir (default <output_dir>/checkpoints)"
_LOAD_STATE = ("--load_sft_checkpoint_train loads the weights only and starts at step 0; to continue a run with its "
               "optimizer and sampling state pass --resume")
_SAVE_STATE = "checkpoints always hold the AdamW moments and the sampling stream (--resume needs them)"
_VLLM = ("vLLM engine settings: mindrlhf's generator decodes at most generation.max_num_seqs rows of an inference "
         "rank at once against a static KV cache of max(generation.prompt_buckets) + generation.max_new_tokens "
         "positions a row")
_OFFLOAD = "mindrlhf swaps idle nets to host memory by itself (docs/memory_plan.md); there is no switch"
_COLOCATED = "every net shares each device here (the integrated worker's placement), idle ones swapped to host"
_RESOURCES = ("the devices are the model YAMLs' layouts (data_parallel x model_parallel x pipeline_stage), launched "
              "by msrun --worker_num")
_WANDB = ("no Weights & Biases logger here: metrics go to <output_dir>/metrics.jsonl (and to TensorBoard with "
          "--tensorboard_dir)")
_REWARD_MODEL = ("a reward model here is reward.reward_model_path (a checkpoint with a value head, converted by "
                 "mindrlhf-convert-weight) with its architecture --sft_path_reward")
_ADAPTIVE_KL = ("MindSpeed-RL's GRPO trainer never updates the KL controller (only its PPO trainer does, for KL in the "
                "reward): the coefficient stays init_kl_coef, as loss.beta here; an adaptive KL-in-reward "
                "coefficient here is algorithm.use_kl_in_reward: true with algorithm.kl_ctrl: adaptive")
_STAGE = ("this reads MindSpeed-RL's GRPO trainer YAML (stage: ray_grpo); for PPO or DAPO write a mindrlhf config "
          "(algorithm.adv_estimator: gae, algorithm.dynamic_sampling, loss.epsilon_high, ...)")

KERNEL_SWITCHES = ("use_mcore_models", "use_fused_rmsnorm", "use_fused_swiglu", "use_fused_rotary_pos_emb",
                   "use_flash_attn", "no_masked_softmax_fusion", "no_gradient_accumulation_fusion", "reuse_fp32_param",
                   "variable_seq_lengths", "distributed_backend", "no_shared_storage")

# megatron_training and actor_config (MindSpeed-RL's actor arguments: actor_config over megatron_training)
# MindSpeed-LLM's LoRA target names (Megatron's fused modules) -> the Hugging Face modules they hold
MEGATRON_LORA_MODULES = {"linear_qkv": ("q_proj", "k_proj", "v_proj"), "linear_proj": ("o_proj",),
                         "linear_fc1": ("gate_proj", "up_proj"), "linear_fc2": ("down_proj",)}

MEGATRON_KEYS: dict[str, Rule] = {
    "stage": ForeignKey(lambda v: v in (None, "ray_grpo"), REFUSE, _STAGE),
    "lora_r": ToFields(("lora.lora_rank",)),
    "lora_alpha": ToFields(("lora.lora_alpha",), float),
    "lora_target_modules": COMPUTED,
    "global_batch_size": COMPUTED,
    "seed": ToFields(("schedule.seed", "generation.seed")),
    "train_iters": ToFields(("schedule.steps",)),
    "save_interval": ToFields(("checkpoint.save_interval",)),
    "micro_batch_size": ToFields(("schedule.micro_batch_size_per_device",)),
    "lr": ToFields(("optimizer.learning_rate",), float),
    "lr_decay_style": COMPUTED,
    "min_lr": COMPUTED,
    "lr_warmup_fraction": COMPUTED,
    "weight_decay": ToFields(("optimizer.weight_decay",), float),
    "clip_grad": ToFields(("optimizer.max_grad_norm",), float),
    "adam_beta1": ToFields(("optimizer.beta1",), float),
    "adam_beta2": ToFields(("optimizer.beta2",), float),
    "adam_eps": ToFields(("optimizer.eps",), float),
    "model": ForeignKey(never, WARN, _NETWORKS),
    "tensor_model_parallel_size": ForeignKey(_one, WARN, _TRAIN_TP),
    "pipeline_model_parallel_size": ForeignKey(_one, WARN, _TRAIN_PP),
    "context_parallel_size": ForeignKey(_one, REFUSE, "context parallel is not built here; set 1"),
    "expert_model_parallel_size": ForeignKey(_one, REFUSE, _NO_MOE),
    "sequence_parallel": ForeignKey(_falsy, WARN, "set parallel_config.use_seq_parallel: true in the model YAMLs"),
    "use_distributed_optimizer": ForeignKey(_falsy, WARN, "set parallel_config.optimizer_shard: true in the train "
                                                          "model YAML (ZeRO-1)"),
    "bf16": ForeignKey(_falsy, WARN, _DTYPES),
    "fp16": ForeignKey(_falsy, WARN, _DTYPES),
    "seq_length": ForeignKey(never, WARN, _SEQ_LENGTH),
    "recompute_granularity": ForeignKey(_falsy, WARN, _RECOMPUTE),
    "recompute_method": ForeignKey(_falsy, WARN, _RECOMPUTE),
    "recompute_num_layers": ForeignKey(_falsy, WARN, _RECOMPUTE),
    "tokenizer_name_or_path": ForeignKey(never, WARN, "pass the same Hugging Face folder as --tokenizer_dir"),
    "tokenizer_type": ForeignKey(lambda v: v in (None, "PretrainedFromHF"), WARN,
                                 "the tokenizer is a Hugging Face folder here (--tokenizer_dir)"),
    "data_path": ForeignKey(never, WARN, _DATA),
    "dataset_additional_keys": ForeignKey(lambda v: v in (None, [], ["labels"]), WARN,
                                          "the gold answers are the prompt MindRecord's, written by "
                                          "mindrlhf-prepare-data (--answer_key)"),
    "split": ForeignKey(lambda v: v is None or str(v).replace(" ", "") in ("100,0,0", "100"), WARN,
                        "every prompt of --mind_dataset_dir is trained on; held-out prompts are --eval_dataset_file"),
    "no_shuffle": ForeignKey(_falsy, WARN, "prompts are always shuffled here (by schedule.seed)"),
    "full_shuffle_instruction_dataset": ForeignKey(always, WARN, "an SFT dataset setting"),
    "load": ForeignKey(_falsy, WARN, _LOAD),
    "save": ForeignKey(_falsy, WARN, _SAVE),
    "no_load_optim": ForeignKey(_true_or_unset, WARN, _LOAD_STATE),
    "no_load_rng": ForeignKey(_true_or_unset, WARN, _LOAD_STATE),
    "finetune": ForeignKey(_true_or_unset, WARN, _LOAD_STATE),
    "no_save_optim": ForeignKey(_falsy, WARN, _SAVE_STATE),
    "no_save_rng": ForeignKey(_falsy, WARN, _SAVE_STATE),
    "initial_loss_scale": ForeignKey(never, WARN, "no loss scaling is applied here"),
    "attention_dropout": ForeignKey(_zero, WARN, _DROPOUT),
    "hidden_dropout": ForeignKey(_zero, WARN, _DROPOUT),
    "init_method_std": ForeignKey(always, WARN, "random initialisation; the weights come from the checkpoint"),
    "norm_epsilon": ForeignKey(never, WARN, "set model_config.rms_norm_eps in the model YAMLs"),
    "attention_softmax_in_fp32": ForeignKey(_true_or_unset, WARN, "softmax always computes in float32 here"),
    **{name: ForeignKey(always, WARN, _KERNELS) for name in KERNEL_SWITCHES},
}

REF_KEYS: dict[str, Rule] = {
    "model": ForeignKey(never, WARN, _NETWORKS),
    "micro_batch_size": COMPUTED,
    "tensor_model_parallel_size": ForeignKey(_one, WARN, _REF_LAYOUT),
    "pipeline_model_parallel_size": ForeignKey(_one, WARN, _REF_LAYOUT),
    "load": COMPUTED,
    "no_load_optim": ForeignKey(always, WARN, "the reference is not trained"),
    "no_load_rng": ForeignKey(always, WARN, "the reference is not trained"),
}

RL_KEYS: dict[str, Rule] = {
    "n_samples_per_prompt": ToFields(("generation.num_generations",)),
    "mini_batch_size": COMPUTED,
    "epochs": ToFields(("schedule.num_iterations",)),
    "actor_forward_micro_batch_size": COMPUTED,
    "ref_forward_micro_batch_size": COMPUTED,
    "max_prompt_length": COMPUTED,
    "adv_estimator": COMPUTED,
    "clip_ratio": ToFields(("loss.epsilon_low", "loss.epsilon_high"), float),
    "entropy_coeff": ForeignKey(_zero, REFUSE, "mindrlhf's loss has no entropy term; set entropy_coeff: 0 (as "
                                               "MindSpeed-RL's current GRPO examples do)"),
    "init_kl_coef": ToFields(("loss.beta",), float),
    "kl_penalty": COMPUTED,
    "kl_ctrl_type": COMPUTED,
    "kl_target": ForeignKey(always, WARN, "only read by the adaptive KL controller"),
    "kl_horizon": ForeignKey(always, WARN, "only read by the adaptive KL controller"),
    "use_kl_in_reward": ForeignKey(_falsy, WARN, "MindSpeed-RL's GRPO trainer does not read it (its PPO trainer "
                                                 "does); KL in the reward here: algorithm.use_kl_in_reward: true"),
    "gamma": ToFields(("algorithm.gamma",), float),
    "lam": ToFields(("algorithm.lam",), float),
    "advantage_whiten": ForeignKey(always, WARN, "only read by GAE"),
    "rule_reward": COMPUTED,
    "verifier_function": COMPUTED,
    "verifier_weight": COMPUTED,
    "verifier_parallel": ForeignKey(always, WARN, "rule rewards are computed in the trainer process"),
    "verifier_timeout": ForeignKey(always, WARN, "rule rewards are computed in the trainer process"),
    "use_integrated_worker": ForeignKey(_true_or_unset, WARN, _COLOCATED),
    "colocate_actor_ref": ForeignKey(_true_or_unset, WARN, _COLOCATED),
    "colocate_all_models": ForeignKey(_true_or_unset, WARN, _COLOCATED),
    "blocking": ForeignKey(_true_or_unset, WARN, "the phases of a step run one after another here"),
    "guarantee_order": ForeignKey(always, WARN, "samples keep their order here"),
    "shuffle_mini_batch": ForeignKey(_falsy, WARN, "mini-batches are taken in rollout order here"),
    "token_level_loss": ForeignKey(always, WARN, "MindSpeed-RL's GRPO loss does not read it"),
    "use_tensorboard": ForeignKey(_falsy, WARN, "pass --tensorboard_dir <folder> for TensorBoard event files"),
    "use_wandb": ForeignKey(_falsy, WARN, _WANDB),
    "wandb_project": ForeignKey(_falsy, WARN, _WANDB),
    "wandb_exp_name": ForeignKey(_falsy, WARN, _WANDB),
    "wandb_save_dir": ForeignKey(_falsy, WARN, _WANDB),
    "actor_resource": ForeignKey(never, WARN, _RESOURCES),
    "reference_resource": ForeignKey(never, WARN, _RESOURCES),
    "reward_resource": ForeignKey(never, WARN, _RESOURCES),
    "num_cpus_for_local_task": ForeignKey(always, WARN, "a Ray setting"),
    "num_cpus_for_placement_group": ForeignKey(always, WARN, "a Ray setting"),
    "log_max_throughput": ForeignKey(always, WARN, "a logging choice"),
    # multi-turn rollouts with tools (MindSpeed-RL's ReTool recipe)
    "multi_turn_enable": ForeignKey(_falsy, WARN, "multi-turn rollouts are on when tools.tools lists tools (with "
                                                  "generation.max_tool_calling_iterations, max_tool_calls here)"),
    "tool_config_path": ForeignKey(_falsy, REFUSE, "tools here are Python functions (TRL's form): list them as "
                                                   "tools.tools in a mindrlhf YAML given after this one, or --tools "
                                                   "calculator python package.module:function"),
    "max_tool_calls": ToFields(("generation.max_tool_calling_iterations",)),
    "max_tool_response_length": ToFields(("generation.max_tool_response_tokens",)),
    "max_parallel_calls": ForeignKey(always, WARN, "a turn's calls all run at once here (tools.tool_workers threads)"),
    "max_total_response_length": ForeignKey(always, WARN, "a response row here is generation.max_new_tokens (the "
                                                          "model's own tokens) + max_tool_calls x "
                                                          "max_tool_response_length"),
    "tool_response_truncate_side": ForeignKey(lambda v: v in (None, "right"), WARN,
                                              "a tool answer too long for its turn is cut at its end here"),
    "tool_parser_format": ForeignKey(lambda v: v in (None, "hermes"), REFUSE,
                                     "tool calls are read in the Hermes format here (<tool_call>{...}</tool_call>)"),
}

GENERATE_KEYS: dict[str, Rule] = {
    "sampling_config": COMPUTED,
    "trust_remote_code": ForeignKey(always, WARN, "the tokenizer is read from its files"),
    "infer_tensor_parallel_size": ForeignKey(_one, WARN, _INFER_TP),
    "infer_pipeline_parallel_size": ForeignKey(_one, WARN, _INFER_PP),
    "infer_expert_parallel_size": ForeignKey(_one, REFUSE, _NO_MOE),
    "enable_expert_parallel": ForeignKey(_falsy, REFUSE, _NO_MOE),
    "max_num_seqs": ToFields(("generation.max_num_seqs",)),
    "max_num_batched_tokens": ToFields(("generation.max_num_batched_tokens",)),
    "max_model_len": ToFields(("generation.max_model_len",)),
    "gpu_memory_utilization": ForeignKey(never, WARN, _VLLM),
    "num_scheduler_steps": ForeignKey(never, WARN, _VLLM),
    "enforce_eager": ForeignKey(never, WARN, _VLLM),
    "micro_batch_size": ForeignKey(never, WARN, _VLLM),
    "dtype": ForeignKey(never, WARN, _DTYPES),
    "offload_train_optimizer": ForeignKey(_true_or_unset, WARN, _OFFLOAD),
    "offload_train_grad": ForeignKey(_true_or_unset, WARN, _OFFLOAD),
    "offload_train_param": ForeignKey(_true_or_unset, WARN, _OFFLOAD),
}

SAMPLING_KEYS: dict[str, Rule] = {
    "max_tokens": ToFields(("generation.max_new_tokens",)),
    "temperature": ToFields(("generation.temperature",), float),
    "top_p": ToFields(("generation.top_p",), float),
    "top_k": COMPUTED,
    "min_p": ToFields(("generation.min_p",), float),
    "logprobs": ForeignKey(always, WARN, "the sampled tokens' log-probs are always kept"),
    "detokenize": ForeignKey(always, WARN, "responses are decoded for the rewards anyway"),
}

# MindSpeed-RL's rule verifiers (mindspeed_rl/models/rule_verifier.py) -> (mindrlhf's reward, how they differ)
VERIFIERS: dict[str, tuple[str, str]] = {
    "base_acc": ("accuracy", "MindSpeed-RL's base_acc gives 1 only to a right \\boxed{} answer inside "
                             "<think>...</think><answer>...</answer>; accuracy here gives 1 to a right number (from "
                             "<answer>, else \\boxed{}) whatever the template, else 0"),
    "acc": ("accuracy", "MindSpeed-RL's acc gives 1 (right), -0.5 (wrong) or -1 (no \\boxed{}); accuracy here gives 1 "
                        "or 0, numeric answers"),
    "math_17k_acc": ("accuracy", "both give 1 to a right \\boxed{} answer, else 0; accuracy here compares numbers and "
                                 "reads an <answer> tag first"),
    "acc_for_ppo": ("accuracy", "both give 1 to a right \\boxed{} answer, else 0; accuracy here compares numbers and "
                                "reads an <answer> tag first"),
    "acc_for_dapo": ("accuracy", "MindSpeed-RL's acc_for_dapo gives 1 (right) or -1 (wrong) to the 'Answer:' line at "
                                 "the response's end; accuracy here gives 1 or 0 to its final number (<answer>, else "
                                 "\\boxed{}, else the last number)"),
    "format": ("format", ""),
    "strict_format": ("format", "MindSpeed-RL's strict_format also wants \\boxed{} inside <answer> and gives -0.5 "
                                "otherwise; format here gives 1 or 0"),
}
KL_ESTIMATORS = {"kl": "k1", "mse": "k2", "low_var_kl": "k3"}  # MindSpeed-RL's kl_penalty -> loss.kl_estimator
GROUP_NORM_EPS = 1e-6  # MindSpeed-RL's group_norm: (r - group mean) / (group std + 1e-6)

_View = dict[str, tuple[str, Any]]  # key (a-b spelt a_b) -> ('section.key' as written, value)


def known_keys() -> dict[str, list[str]]:
    """Where -> the keys this reader knows there (for docs/yaml_keys.md and its test)."""
    return {"top level": list(TOP_SECTIONS), "megatron_training / actor_config": list(MEGATRON_KEYS),
            "ref_config": list(REF_KEYS), "rl_config": list(RL_KEYS), "generate_config": list(GENERATE_KEYS),
            "generate_config.sampling_config": list(SAMPLING_KEYS), "rl_config.verifier_function": list(VERIFIERS),
            "rl_config.kl_penalty": list(KL_ESTIMATORS)}


def is_mindspeed_yaml(data: Mapping) -> bool:
    """Whether a config YAML's top level is MindSpeed-RL's (it has rl_config or megatron_training)."""
    return isinstance(data, Mapping) and ("rl_config" in data or "megatron_training" in data)


class MindSpeedNotes(IgnoredKeys):
    """The keys one MindSpeed-RL YAML ignores (`add`, by reason) and the keys it reads only approximately
    (`read_as`), each said in a short warning line (`warn`)."""

    def __init__(self, source: str):
        super().__init__(source)
        self.approximate: list[str] = []

    def read_as(self, where: str, meaning: str) -> None:
        self.approximate.append(f"{where} is read as {meaning}")

    def messages(self) -> list[str]:
        """'<source>: a=1 is read as <meaning>' for each approximate key, then the ignored keys' lines."""
        return [f"{self.source}: {line}" for line in self.approximate] + super().messages()


class _Translation:
    """The GRPO config sections built from one file, its notes, and the file's name for errors."""

    def __init__(self, source: str):
        self.source = source
        self.sections: dict[str, dict[str, Any]] = {}
        self.notes = MindSpeedNotes(source)

    def set(self, *fields: str, value: Any) -> None:
        for field in fields:
            section, name = field.split(".")
            self.sections.setdefault(section, {})[name] = value

    def refuse(self, where: str, advice: str) -> ConfigError:
        return ConfigError(f"{self.source}: {where} is not supported: {advice}")

    def number(self, where: str, value: Any, kind: type = int) -> int | float:
        """`value` as an int (kind int) or a float (kind float: a number, or YAML 1.1's string "1e-6")."""
        if not isinstance(value, bool):
            if kind is int and isinstance(value, int):
                return value
            if kind is float and isinstance(value, (int, float)):
                return float(value)
            if kind is float and isinstance(value, str):
                try:
                    return float(value)
                except ValueError:
                    pass
        raise ConfigError(f"{self.source}: {where}={value!r} must be {'an integer' if kind is int else 'a number'}")

    def get(self, view: _View, key: str, kind: type = int) -> int | float | None:
        """The number `view` gives for `key`, or None when it does not give it."""
        if key not in view:
            return None
        where, value = view[key]
        return self.number(where, value, kind)


def translate(data: Mapping, source: str) -> tuple[dict[str, dict[str, Any]], MindSpeedNotes]:
    """The GRPO config sections of MindSpeed-RL GRPO trainer YAML `data` (read from `source`), and what it ignores or
    reads approximately (`notes.warn()` says it in short lines); a key asking for what is not built here raises a
    ConfigError naming the file, `section.key=value` and what to set instead, and so does a key one edit away from a
    known one (`refuse_typo`)."""
    t = _Translation(source)
    for name, value in data.items():
        if name == "defaults":
            t.notes.add(f"defaults={value!r}", _NETWORKS)
        elif name == "reward_config":
            t.notes.add("'reward_config'", _REWARD_MODEL)
        elif name not in TOP_SECTIONS:
            refuse_typo(name, str(name), TOP_SECTIONS, source)
            t.notes.add(repr(name), UNKNOWN_SECTION)
    actor = _actor_view(data, t)
    ref = _view("ref_config", _section(data, "ref_config", source))
    rl = _view("rl_config", _section(data, "rl_config", source))
    generate = _view("generate_config", _section(data, "generate_config", source))
    sampling_where, sampling = generate.get("sampling_config", ("", None))
    sampling = _view(sampling_where, _mapping(sampling, sampling_where, source))
    for view, rules in ((actor, MEGATRON_KEYS), (ref, REF_KEYS), (rl, RL_KEYS), (generate, GENERATE_KEYS),
                        (sampling, SAMPLING_KEYS)):
        _apply(view, rules, t)
    _read_batches(actor, rl, ref, t)
    _read_learning_rate(actor, rl, t)
    _read_algorithm(actor, rl, t)
    _read_reward(rl, t)
    _read_generation(rl, sampling, t)
    _read_reference_load(actor, ref, t)
    _read_lora_targets(actor, t)
    return t.sections, t.notes


def _read_lora_targets(actor: _View, t: _Translation) -> None:
    """lora_target_modules in Megatron's names (linear_qkv, linear_proj, linear_fc1, linear_fc2) or Hugging Face's."""
    if "lora_target_modules" not in actor:
        return
    where, value = actor["lora_target_modules"]
    names = [value] if isinstance(value, str) else list(value or ())
    modules = []
    for name in names:
        modules += MEGATRON_LORA_MODULES.get(name, (name,))
    t.set("lora.lora_target_modules", value=modules)


def _mapping(value: Any, where: str, source: str) -> dict:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ConfigError(f"{source}: section '{where}' must be a mapping, got {type(value).__name__}")
    return dict(value)


def _section(data: Mapping, name: str, source: str) -> dict:
    return _mapping(data.get(name), name, source)


def _view(section: str, values: Mapping) -> _View:
    return {str(key).replace("-", "_"): (f"{section}.{key}", value) for key, value in values.items()}


def _actor_view(data: Mapping, t: _Translation) -> _View:
    """megatron_training under actor_config, as MindSpeed-RL builds the actor's arguments; a megatron_training value
    that actor_config replaces is named in the notes."""
    view = _view("megatron_training", _section(data, "megatron_training", t.source))
    for name, (where, value) in _view("actor_config", _section(data, "actor_config", t.source)).items():
        if name in view and view[name][1] != value:
            t.notes.add(f"{view[name][0]}={view[name][1]!r}",
                        "actor_config gives it too, and wins (as in MindSpeed-RL)")
        view[name] = (where, value)
    return view


def _apply(view: _View, rules: Mapping[str, Rule], t: _Translation) -> None:
    """Maps (`ToFields`), accepts, ignores or refuses (`ForeignKey`) each key of `view` by `rules`; COMPUTED keys are
    read by their section's function; a key `rules` does not name is refused when one edit away from one it names
    (a typo), else named in the notes."""
    for name, (where, value) in view.items():
        rule = rules.get(name)
        if rule is None:
            refuse_typo(name, where, rules, t.source)
            t.notes.add(f"{where}={value!r}", UNKNOWN_KEY)
        elif isinstance(rule, ToFields):
            t.set(*rule.fields, value=t.number(where, value, rule.kind))
        elif isinstance(rule, ForeignKey) and not rule.fine(value):
            if rule.action == REFUSE:
                raise t.refuse(f"{where}={value!r}", rule.advice)
            t.notes.add(f"{where}={value!r}", rule.advice)


def _read_batches(actor: _View, rl: _View, ref: _View, t: _Translation) -> None:
    """global_batch_size (prompts), rl_config.mini_batch_size (prompts per actor update) and the log-prob passes'
    micro-batch (responses)."""
    batch = t.get(actor, "global_batch_size")
    if batch is not None:
        t.set("schedule.batch_size", value=batch)
    mini = t.get(rl, "mini_batch_size")
    if mini is not None:
        if mini < 1 or (batch is not None and batch % mini):
            raise ConfigError(_mini_batch_error(actor, rl, t))
        t.set("schedule.mini_batch_size", value=0 if mini == batch else mini)  # 0: the whole batch
    # the reference's forward micro-batch: ref_forward_micro_batch_size, else ref_config.micro_batch_size
    ref_key = (rl, "ref_forward_micro_batch_size") if "ref_forward_micro_batch_size" in rl else \
        (ref, "micro_batch_size")
    sizes = {}
    for view, key in ((rl, "actor_forward_micro_batch_size"), ref_key):
        if key in view:
            sizes[view[key][0]] = t.get(view, key)
    if sizes:
        smallest = min(sizes.values())
        t.set("schedule.log_prob_micro_batch_size_per_device", value=smallest)
        if len(set(sizes.values())) > 1:
            t.notes.read_as(", ".join(f"{where}={size}" for where, size in sizes.items()),
                            f"schedule.log_prob_micro_batch_size_per_device={smallest} (one size serves the "
                            "reference and old-policy passes here: the smaller)")


def _mini_batch_error(actor: _View, rl: _View, t: _Translation) -> str:
    where, mini = rl["mini_batch_size"]
    batch_where, batch = actor.get("global_batch_size", ("megatron_training.global_batch_size", None))
    message = (f"{t.source}: {where}={mini!r} must be >= 1 and divide {batch_where}={batch}: MindSpeed-RL counts it in "
               "prompts (its RLConfig multiplies it by n_samples_per_prompt), one actor update each; set a divisor of "
               f"global_batch_size ({batch} = the whole batch, one update per step)")
    samples = t.get(rl, "n_samples_per_prompt")
    if samples and mini > 0 and mini % samples == 0 and batch and batch % (mini // samples) == 0:
        message += (f"; a YAML written before it counted prompts (May 2025) gave responses: {mini} responses are "
                    f"mini_batch_size: {mini // samples}")
    return message


def _read_learning_rate(actor: _View, rl: _View, t: _Translation) -> None:
    """lr_decay_style, min_lr (a fraction of lr here) and lr_warmup_fraction (optimizer updates here)."""
    lr = t.get(actor, "lr", float)
    style = actor.get("lr_decay_style", ("", None))[1]
    if style is None and lr is not None:
        raise ConfigError(f"{t.source}: {actor['lr'][0]} is given without lr_decay_style, whose MindSpeed-RL default "
                          "is Megatron's linear decay to min_lr, not built here; set lr_decay_style: constant or "
                          "cosine")
    if style is not None:
        if style not in ("constant", "cosine"):
            raise t.refuse(f"{actor['lr_decay_style'][0]}={style!r}", "the learning rate here is constant or cosine "
                                                                      "(optimizer.lr_schedule); set lr_decay_style: "
                                                                      "constant or cosine")
        t.set("optimizer.lr_schedule", value=style)
    min_lr = t.get(actor, "min_lr", float)
    if min_lr and style == "cosine":  # Megatron's constant schedule does not read min_lr
        where = actor["min_lr"][0]
        if lr is None or not 0 <= min_lr <= lr:
            raise ConfigError(f"{t.source}: {where}={min_lr} must be between 0 and actor_config.lr={lr}: it is read as "
                              "optimizer.min_lr_ratio = min_lr / lr")
        t.set("optimizer.min_lr_ratio", value=min_lr / lr)
    fraction = t.get(actor, "lr_warmup_fraction", float)
    if fraction is None:
        return
    where = actor["lr_warmup_fraction"][0]
    steps, batch, mini = t.get(actor, "train_iters"), t.get(actor, "global_batch_size"), t.get(rl, "mini_batch_size")
    if fraction and (steps is None or batch is None):
        raise ConfigError(f"{t.source}: {where}={fraction} is a fraction of the run, which needs "
                          "megatron_training.train_iters and global_batch_size; give them, or set "
                          "optimizer.warmup_steps (optimizer updates) in a mindrlhf config")
    if not 0 <= fraction <= 1:
        raise ConfigError(f"{t.source}: {where}={fraction} must be between 0 and 1")
    # Megatron warms up over fraction x train_iters x global batch samples; an update here takes a mini-batch
    t.set("optimizer.warmup_steps", value=round(fraction * steps * batch / (mini or batch)) if fraction else 0)


def _read_algorithm(actor: _View, rl: _View, t: _Translation) -> None:
    """stage (MindSpeed-RL's GRPO loss: a token mean), adv_estimator, kl_penalty and kl_ctrl_type."""
    if "stage" in actor:
        t.set("loss.aggregation", value="token-mean")
    if "adv_estimator" in rl:
        where, value = rl["adv_estimator"]
        if value != "group_norm":
            advice = ("MindSpeed-RL's GAE is its PPO trainer's; here write a mindrlhf config with "
                      "algorithm.adv_estimator: gae (and --sft_path_critic)") if value == "gae" else \
                "MindSpeed-RL's GRPO advantage is group_norm (algorithm.adv_estimator grpo here)"
            raise t.refuse(f"{where}={value!r}", advice)
        t.set("algorithm.adv_estimator", value="grpo")
        t.set("algorithm.advantage_eps", value=GROUP_NORM_EPS)
    if "kl_penalty" in rl:
        where, value = rl["kl_penalty"]
        if value not in KL_ESTIMATORS:
            raise t.refuse(f"{where}={value!r}", "the KL estimators here are k1 (kl), k2 (mse) and k3 (low_var_kl); "
                                                 "set kl_penalty: kl, mse or low_var_kl")
        t.set("loss.kl_estimator", value=KL_ESTIMATORS[value])
    if "kl_ctrl_type" in rl:
        where, value = rl["kl_ctrl_type"]
        if value == "adaptive":
            t.notes.add(f"{where}={value!r}", _ADAPTIVE_KL)
        elif value != "fixed":
            raise t.refuse(f"{where}={value!r}", "MindSpeed-RL's KL controllers are fixed and adaptive; set "
                                                 "kl_ctrl_type: fixed")


def _read_reward(rl: _View, t: _Translation) -> None:
    """rule_reward, verifier_function (mindrlhf's rule rewards) and verifier_weight."""
    if "rule_reward" in rl and rl["rule_reward"][1] is False:
        raise t.refuse(f"{rl['rule_reward'][0]}=False",
                       "MindSpeed-RL then scores with its reward model only; here: reward.reward_model_path (a "
                       "checkpoint with a value head, converted by mindrlhf-convert-weight) and "
                       "reward.reward_funcs: [] in a mindrlhf config")
    functions = None
    if "verifier_function" in rl:
        where, names = rl["verifier_function"]
        names = [names] if isinstance(names, str) else names
        if not isinstance(names, list) or not names:
            raise ConfigError(f"{t.source}: {where}={names!r} must be a list of verifier names, e.g. ['base_acc']")
        functions = []
        for index, name in enumerate(names):
            item = f"{where}[{index}]={name!r}"
            close = closest_key(name, VERIFIERS, one_edit=True)
            if name not in VERIFIERS and close:
                raise ConfigError(f"{t.source}: {where}[{index}]: unknown verifier {name!r} (did you mean "
                                  f"'{close}'?)")
            if name not in VERIFIERS:
                raise t.refuse(item, f"the MindSpeed-RL verifiers read here are {', '.join(VERIFIERS)}; for another "
                                     "rule give a function 'package.module:function' in reward.reward_funcs of a "
                                     "mindrlhf config")
            reward, difference = VERIFIERS[name]
            functions.append(reward)
            if difference:
                t.notes.read_as(item, f"reward '{reward}': {difference}")
        t.set("reward.reward_funcs", value=functions)
    if "verifier_weight" in rl:
        where, weights = rl["verifier_weight"]
        if not isinstance(weights, list):
            raise ConfigError(f"{t.source}: {where}={weights!r} must be a list of numbers, one per verifier function")
        weights = [t.number(f"{where}[{index}]", weight, float) for index, weight in enumerate(weights)]
        if functions is not None and len(weights) != len(functions):
            raise ConfigError(f"{t.source}: {where}={weights} has {len(weights)} weight(s) for the "
                              f"{len(functions)} verifier function(s) {rl['verifier_function'][1]}: give one weight "
                              "per function")
        t.set("reward.reward_weights", value=weights)


def _read_reference_load(actor: _View, ref: _View, t: _Translation) -> None:
    """ref_config.load: the actor's `load` means the default here (the reference starts as the policy)."""
    where, path = ref.get("load", ("", None))
    if path and path != actor.get("load", ("", None))[1]:
        t.notes.add(f"{where}={path!r}", "pass the reference weights as --load_ref_checkpoint (default: a copy of the "
                                         "starting policy)")


def _read_generation(rl: _View, sampling: _View, t: _Translation) -> None:
    """max_prompt_length (the largest prompt bucket here) and top_k (vLLM's -1 = off is 0 here)."""
    length = t.get(rl, "max_prompt_length")
    if length is not None:
        where = rl["max_prompt_length"][0]
        if length < 1:
            raise ConfigError(f"{t.source}: {where}={length} must be >= 1")
        buckets, bucket = [], 64
        while bucket < length:
            buckets.append(bucket)
            bucket *= 2
        buckets.append(length)
        t.set("generation.prompt_buckets", value=buckets)
        t.notes.read_as(f"{where}={length}", f"generation.prompt_buckets {buckets} (the longest prompt a rollout "
                                             "takes); prompts are filtered by length when the data is converted: "
                                             f"mindrlhf-prepare-data --max_prompt_length {length}")
    top_k = t.get(sampling, "top_k")
    if top_k is not None:
        t.set("generation.top_k", value=max(top_k, 0))
