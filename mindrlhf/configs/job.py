"""`JobOptions`: where a run reads and writes and how it is launched (the MindRLHF flag names), separate from the
algorithm's settings. The dataclass is the one definition: the command-line flags are generated from it."""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
import typing
from dataclasses import dataclass

from mindrlhf.configs.base import help_field
from mindrlhf.configs.cli import flag_help, parse_bool, type_metavar


def _flag(default, help: str, required: bool = False, **argparse_kwargs):
    """A job field: `help_field` plus how its flag parses (`required`, `choices`, `nargs`/`const`)."""
    field = help_field(default, help)
    field.metadata = {**field.metadata, "required": required, "argparse": argparse_kwargs}
    return field


def _choice_parser(choices):
    """A flag value among lowercase `choices`, in any case (MindRLHF's `--use_parallel True`); where the choices
    include true/false, 1 and 0 mean them too."""
    def parse(value: str) -> str:
        value = value.strip().lower()
        if {"true", "false"} <= set(choices):
            value = {"1": "true", "0": "false"}.get(value, value)
        return value
    return parse


def _finite_float(text: str) -> float:
    """A flag's number; nan and inf are refused (argparse's float takes them)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


@dataclass
class JobOptions:
    """Where a run reads and writes (the MindRLHF flag names), separate from the algorithm's hyper-parameters."""

    stage: str = _flag("rl", "What the job trains: rl (GRPO/PPO, as the config's algorithm says); sft (supervised "
                             "fine-tuning on rlhf_data.py --kind sft data: mindrlhf-sft), reward (a reward model on "
                             "--kind pairwise data: mindrlhf-reward) or dpo (the policy on the pairs: mindrlhf-dpo), "
                             "each of the train YAML's net.", choices=["rl", "sft", "reward", "dpo"])
    sft_path_train: str = _flag("", "Model YAML of the train net; its parallel_config is the train layout.",
                                required=True)
    sft_path_infer: str = _flag("", "Model YAML of the inference (and reference) net: the infer layout.",
                                required=True)
    sft_path_critic: str = _flag("", "Model YAML of the PPO critic (a value head on the policy's backbone); its "
                                     "parallel_config is the critic layout. Needed by algorithm.adv_estimator gae.")
    sft_path_reward: str = _flag("", "Model YAML of the reward model (reward.reward_model_path); default: the "
                                     "inference YAML. Its parallel_config must be the inference layout's.")
    mind_dataset_dir: str = _flag("", "Prompt MindRecord file written by rlhf_data.py (MindRLHF's flag name).",
                                  required=True)
    eval_dataset_file: str = _flag("", "Held-out prompt MindRecord file: greedy accuracy on every prompt before the "
                                       "first step, every eval_interval steps and after the last.")
    tokenizer_dir: str = _flag("", "Hugging Face tokenizer folder (tokenizer.json or vocab.json + merges.txt).")
    vocab_path: str = _flag("", "vocab.json (with --merges_file_path).")
    merges_file_path: str = _flag("", "merges.txt (with --vocab_path).")
    config: list[str] = _flag([], "GRPOConfig YAML(s) (sections algorithm, generation, loss, reward, optimizer, "
                                  "critic, schedule, checkpoint, eval), or MindSpeed-RL's GRPO trainer YAML as it is "
                                  "(docs/yaml_keys.md); several are merged field by field, later ones winning; flags "
                                  "override them.", nargs="+")
    output_dir: str = _flag("output/grpo", "Logs, metrics.jsonl, strategy files: one run's (it holds the lock "
                                           "<output_dir>/run.lock while it runs; a rerun needs --resume or "
                                           "--overwrite_output).")
    save_ckpt_dir: str = _flag("", "Checkpoint folder (default: <output_dir>/checkpoints).")
    load_sft_checkpoint_train: str = _flag(
        "", "Starting policy: a whole .ckpt (split onto the train layout at load time), a folder of per-rank shards "
            "rank_<i>/*.ckpt (tools/transform_checkpoint.py --dst_strategy <output_dir>/strategy/train: each rank "
            "reads its own; shards of another layout, with their strategy.ckpt, are resharded on load) or a trainer "
            "step folder (default: seeded random weights).")
    load_lora_adapter: str = _flag(
        "", "A PEFT LoRA adapter folder (adapter_config.json, adapter_model.safetensors; e.g. written by "
            "tools/convert_weight.py --reverse) the policy's adapters start from, on the base weights of "
            "--load_sft_checkpoint_train; its r, lora_alpha and target_modules must be the job's lora section's.")
    load_sft_checkpoint_infer: str = _flag(
        "", "Inference weights, in the same forms (shards for <output_dir>/strategy/infer); default: resharded "
            "from the train net (the usual case).")
    load_ref_checkpoint: str = _flag(
        "", "Reference weights, in the same forms (shards for <output_dir>/strategy/ref); default: a copy of the "
            "starting policy.")
    load_critic_checkpoint: str = _flag(
        "", "Critic weights with a value head (`score.weight`), e.g. a reward model converted by "
            "tools/convert_weight.py: a whole .ckpt, a trainer step folder or a shard folder with its strategy.ckpt "
            "(merged, then split); default: the starting policy's backbone with a zero head (verl's default).")
    save_data_file: str = _flag("", "Write each step's experience as MindRecord <path>.step_<N>.mindrecord.")
    log_completions: bool = _flag(False, "Write each step's sampled responses to <output_dir>/completions.jsonl, "
                                         "a line each: prompt, completion, reward, reward terms, advantage (TRL's "
                                         "log_completions; the rows rank 0 holds: every row when the rollout is "
                                         "gathered).")
    tensorboard_dir: str = _flag("", "Write TensorBoard event files here.")
    resume: str = _flag("", "'auto' (newest complete checkpoint in save_ckpt_dir; with none there the run starts "
                            "from step 0 and logs so) or a step folder; --resume alone means auto.", nargs="?",
                        const="auto")
    overwrite_output: bool = _flag(False, "Start afresh in an --output_dir that holds a run's checkpoints (step_* or "
                                          ".step_*.partial in the checkpoint folder) or metrics.jsonl: delete "
                                          "them, its TensorBoard event files and progress.png first (Hugging Face's "
                                          "overwrite_output_dir). Without it or --resume such a rerun is refused.")
    use_parallel: str = _flag("auto", "Initialise MindSpore communication (auto: when launched by msrun).",
                              choices=["auto", "true", "false"])
    only_save_strategy: bool = _flag(False, "Build the nets, write their strategy files and stop.")
    enable_compile_cache: bool = _flag(
        False, "MindSpore's compile cache under <output_dir>/compile_cache/<run key>/rank_<r>: a rerun of the same "
               "job (same flags, config, data and start) loads its graphs instead of compiling them. MindSpore "
               "matches cached graphs by compile order, so any other run (a resumed one, a new seed) gets its own "
               "cache. Off while CPU gradient sums go through shared memory (Python callbacks in the graphs); "
               "delete the folder after changing mindrlhf's own code (MindSpore detects only some changes).")
    cpu_threads: int = _flag(0, "CPU backend: kernel threads per rank (0 = the host's cores / the ranks on this "
                                "host).")
    cpu_affinity: str = _flag("auto", "CPU backend with several ranks on a host: auto = each rank keeps to its own "
                                      "share of the cores (MindSpore's matmuls use every core a process may, so ranks "
                                      "would oversubscribe them); off = the ranks share every core.",
                              choices=["auto", "off"])
    cpu_collectives: str = _flag("auto", "CPU backend, every rank on one host: auto = the data-parallel gradient sums "
                                         "go through shared memory (MindSpore's CPU AllReduce runs over TCP and costs "
                                         "CPU time per byte); native = MindSpore's AllReduce.",
                                 choices=["auto", "native"])
    init_seed: int = _flag(0, "Seed of random weights when no checkpoint is given (tests, smoke runs).")
    plan: bool = _flag(False, "Print the memory plan (bytes per rank and phase: weights, gradients, optimizer "
                              "moments, activations, KV cache, logits, host swap; the peaks) and whether it fits "
                              "--device_memory_gib, then exit: reads the YAMLs and flags only, needs no msrun or "
                              "devices (the world size comes from the YAML layouts).")
    device_memory_gib: float = _flag(0.0, "With --plan: memory of one device, GiB (0 = this host's memory divided by "
                                          "the job's ranks, as on CPU).", type=_finite_float)
    check_flags: bool = _flag(False, "Check the flags and the YAMLs (the config, the model YAMLs, their layouts and "
                                     "batch splits, the tokenizer) and exit: 0, or 2 with a one-line error. The files "
                                     "the job reads need not exist yet: run_grpo.sh runs it before converting the "
                                     "policy and the prompts. Needs no msrun (the world size comes from the YAMLs).")

    @property
    def checkpoint_dir(self) -> str:
        return self.save_ckpt_dir or os.path.join(self.output_dir, "checkpoints")

    @classmethod
    def add_flags(cls, parser, optional: tuple[str, ...] = (), defaults: dict | None = None) -> None:
        """One `--<field>` flag per field (booleans: `--flag` alone is true, or `--flag true|false`, MindRLHF's
        `--flag True`); the fields in `optional` are not required, and `defaults` replaces some defaults (a stage's
        own command)."""
        hints, defaults = typing.get_type_hints(cls), cls(**(defaults or {}))
        for field in dataclasses.fields(cls):
            extra = dict(field.metadata.get("argparse", {}))
            hint = hints[field.name]
            if hint is bool:
                kwargs = {"type": parse_bool, "nargs": "?", "const": True, "default": field.default}
            elif typing.get_origin(hint) is list:
                kwargs = {"type": typing.get_args(hint)[0], "default": [], **extra}
            elif "choices" in extra:
                kwargs = {"type": _choice_parser(extra["choices"]), "default": field.default, **extra}
            else:
                kwargs = {"type": hint, "default": field.default, **extra}
            if "choices" not in kwargs:
                kwargs["metavar"] = type_metavar(hint)
            help_text = flag_help(field.metadata["help"], field, getattr(defaults, field.name))
            if typing.get_origin(hint) is not list:
                kwargs["default"] = getattr(defaults, field.name)
            if field.metadata.get("required") and field.name not in optional:
                kwargs["required"] = True
                kwargs.pop("default", None)
                help_text = f"{field.metadata['help']} (required)".replace("%", "%%")
            parser.add_argument(f"--{field.name}", help=help_text, **kwargs)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> JobOptions:
        """The job options of parsed flags (`add_flags`)."""
        return cls(**{field.name: getattr(args, field.name) for field in dataclasses.fields(cls)})
