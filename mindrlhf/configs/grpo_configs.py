"""`GRPOConfig`: every setting of a GRPO run, one dataclass per concern, loadable from YAML and CLI flags.

YAML layout (`--config grpo.yaml`), every section and field optional::

    algorithm:  {adv_estimator: grpo, advantage_eps: 1.0e-4, dynamic_sampling: false, ...}
    generation: {max_new_tokens: 256, num_generations: 8, temperature: 1.0, ...}
    loss:       {beta: 0.04, epsilon_low: 0.2, epsilon_high: 0.2, aggregation: seq-mean-token-mean, ...}
    reward:     {reward_funcs: [accuracy, format], reward_weights: [1.0, 0.5]}
    optimizer:  {learning_rate: 1.0e-6, beta1: 0.9, beta2: 0.95, ...}
    schedule:   {steps: 100, batch_size: 8, num_iterations: 1, ...}
    checkpoint: {save_interval: 0, keep_last: 3}
    eval:       {eval_interval: 0, eval_batch_size: 0}
    tools:      {tools: [calculator], tool_timeout: 10}  (with generation.max_tool_calling_iterations)

Each field is also a command-line flag of `grpo_one_stage.py` (`--num_generations 8`, or the dotted
`--generation.num_generations 8` where a name is used by two sections).

`--config` also reads MindSpeed-RL's GRPO trainer YAML as it is (`defaults`, `megatron_training`, `actor_config`,
`rl_config`, `generate_config`, ...), translated by `mindrlhf.configs.mindspeed`; it merges with mindrlhf YAMLs as
they merge with each other.

Only what a config can check alone is checked here; the names looked up in the algorithm and reward registries
(advantage estimator, loss aggregation and KL estimator, reward functions) are checked by
`mindrlhf.trainer.plan.check_registered_names`, with the rest of the job.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mindrlhf.configs.base import ConfigError, Validated, from_mapping, help_field, load_yaml
from mindrlhf.configs.foreign_keys import read_verl_keys
from mindrlhf.configs.generation import GenerationConfig, shown_as
from mindrlhf.configs.lora import LoraConfig
from mindrlhf.configs.mindspeed import is_mindspeed_yaml, translate
from mindrlhf.configs.stage_configs import DPOConfig, RewardModelConfig, SFTConfig
from mindrlhf.configs.tools import ToolsConfig


@dataclass(frozen=True)
class LossConfig(Validated):
    """The GRPO objective: clipped surrogate + beta * KL(policy || ref), and how it is normalised (checked by the
    algorithms' `check_loss_hyperparameters`, see `mindrlhf.trainer.plan.check_registered_names`)."""

    beta: float = help_field(
        0.04, "KL coefficient. 0.04 is DeepSeekMath's GRPO value (Shao et al. 2024); 0 (TRL's default; DAPO, "
              "Dr. GRPO) drops the KL term, and then, unless algorithm.use_kl_in_reward, the reference model: no "
              "reference net, no reference pass, no actor/kl_loss.")
    epsilon_low: float = help_field(
        0.2, "Lower clip range: ratios below 1 - epsilon_low stop pushing a negative-advantage token down "
             "(PPO's 0.2).")
    epsilon_high: float = help_field(
        0.2, "Upper clip range: ratios above 1 + epsilon_high stop pushing a positive-advantage token up. DAPO's "
             "'clip-higher' uses 0.28 to keep exploration alive; 0.2 is the symmetric PPO/GRPO value.")
    aggregation: str = help_field(
        "seq-mean-token-mean", "How per-token losses become one number: 'seq-mean-token-mean' (GRPO paper: each "
        "response weighs the same), 'token-mean' (DAPO: each token weighs the same, no length bias), "
        "'seq-mean-token-sum'. Normalised over the global mini-batch, whatever the data-parallel split.")
    kl_estimator: str = help_field(
        "k3", "Per-token KL estimator (Schulman 2020): 'k3' (the GRPO paper's, unbiased and >= 0), 'k1', 'k2'.")


@dataclass(frozen=True)
class AlgorithmConfig(Validated):
    """What is neither loss nor schedule: the advantage estimator and its settings, KL in the reward, sampling
    filters."""

    adv_estimator: str = help_field(
        "grpo", "Advantage estimator: 'grpo' ((r - group mean) / (group std + eps), DeepSeekMath), 'dr_grpo' (group "
                "mean removed only, Liu et al. 2025), 'rloo' (leave-one-out baseline, Ahmadian et al. 2024); "
                "'gae' (PPO: GAE over the critic's values, needs --sft_path_critic).")
    advantage_eps: float = help_field(1e-4, "Added to the group std before dividing (TRL and verl use 1e-4).")
    gamma: float = help_field(
        1.0, "GAE discount. 1.0 in verl, OpenRLHF and MindSpeed-RL: a response is one episode with the reward at "
             "its end, so discounting would only favour short answers.")
    lam: float = help_field(
        1.0, "GAE lambda. 1.0 (verl, OpenRLHF) makes the advantage the Monte-Carlo return minus the value, unbiased "
             "whatever the critic's early errors; MindSpeed-RL's 0.95 trades some bias for variance.")
    use_kl_in_reward: bool = help_field(
        False, "Subtract kl_coef * KL(policy || ref) from every response token's reward (classic PPO-RLHF, "
               "InstructGPT) instead of adding beta * KL to the loss; set loss.beta to 0 when using it.")
    kl_ctrl: str = help_field(
        "fixed", "KL-in-reward coefficient: 'fixed' or 'adaptive' (Ziegler et al. 2019: moves the coefficient so "
                 "that the KL tracks kl_target over kl_horizon samples).")
    kl_coef: float = help_field(0.001, "KL-in-reward coefficient (the adaptive controller's start), verl's default.")
    kl_target: float = help_field(0.1, "Adaptive controller: the KL per response to hold.")
    kl_horizon: int = help_field(10000, "Adaptive controller: samples over which the coefficient may double.")
    dynamic_sampling: bool = help_field(
        False, "DAPO dynamic sampling: drop prompt groups whose rewards are all equal (no gradient) and refill from "
               "the next prompts.")
    max_sampling_retries: int = help_field(
        3, "Dynamic sampling: extra rollout rounds per step before training on what was kept.")

    def validate(self) -> None:
        checks = [
            (self.advantage_eps >= 0, "advantage_eps", "must be >= 0"),
            (0 <= self.gamma <= 1, "gamma", "must be in [0, 1]"),
            (0 <= self.lam <= 1, "lam", "must be in [0, 1]"),
            (self.kl_ctrl in ("fixed", "adaptive"), "kl_ctrl", "must be 'fixed' or 'adaptive'"),
            (self.kl_coef >= 0, "kl_coef", "must be >= 0"),
            (self.kl_target > 0, "kl_target", "must be > 0"),
            (self.kl_horizon > 0, "kl_horizon", "must be > 0"),
            (self.max_sampling_retries >= 0, "max_sampling_retries", "must be >= 0"),
        ]
        for ok, name, requirement in checks:
            if not ok:
                raise ConfigError(f"algorithm.{name} {requirement}, got {getattr(self, name)!r}")


@dataclass(frozen=True)
class CriticConfig(Validated):
    """The PPO critic (`--sft_path_critic`): its learning rate and value loss (verl's `critic.*` names); AdamW
    betas, eps, weight decay and the lr schedule are the optimizer section's."""

    learning_rate: float = help_field(
        1e-5, "Critic peak learning rate (verl's default; usually above the actor's: the value head starts from "
              "zero and has to catch up with the returns).")
    lr_warmup_steps: int = help_field(0, "Linear warmup of the critic's learning rate over this many updates.")
    grad_clip: float = help_field(1.0, "Clip the critic's global gradient norm to this (0 = no clipping).")
    cliprange_value: float = help_field(
        0.5, "Value clipping: the loss of a value moved more than this from the rollout's value is taken at the "
             "clipped value when that is worse (PPO2; 0.5 in verl, OpenRLHF and MindSpeed-RL).")
    critic_warmup: int = help_field(
        0, "Steps at the start during which only the critic trains (the actor waits for useful advantages).")
    use_lora: bool = help_field(
        True, "With the job's LoRA adapters (lora.lora_rank > 0): true gives the critic adapters of the same rank, "
              "alpha and targets, trained with its value head on its frozen backbone (no gradients or AdamW moments "
              "for the backbone; OpenRLHF's --lora_rank covers actor and critic alike); false trains the whole "
              "critic.")

    def validate(self) -> None:
        checks = [
            (self.learning_rate > 0, "learning_rate", "must be > 0"),
            (self.lr_warmup_steps >= 0, "lr_warmup_steps", "must be >= 0"),
            (self.grad_clip >= 0, "grad_clip", "must be >= 0 (0 = no clipping)"),
            (self.cliprange_value >= 0, "cliprange_value", "must be >= 0"),
            (self.critic_warmup >= 0, "critic_warmup", "must be >= 0"),
        ]
        for ok, name, requirement in checks:
            if not ok:
                raise ConfigError(f"critic.{name} {requirement}, got {getattr(self, name)!r}")


@dataclass(frozen=True)
class RewardConfig(Validated):
    """Rule rewards (registered names `accuracy`, `format`, or user functions as `package.module:function`, either
    `fn(completions, solutions)` or TRL's `fn(prompts, completions, **kwargs)`, returning None = no opinion) and/or
    a reward model, summed with their weights."""

    reward_funcs: list[str] = help_field(
        ["accuracy", "format"], "Reward functions summed with reward_weights. 'accuracy' (1 when the answer, from "
        "<answer>, else \\boxed{}, else the first '#### N' line, else the last number, matches the gold: a number by "
        "value, a LaTeX answer such as \\sqrt{12} by meaning through math-verify, within 5 s per answer) and "
        "'format' (1 for <think>...</think><answer>...</answer>), as in DeepSeek-R1; 'hash_format' (1 when the "
        "response ends with one GSM8K answer line '#### N'); or 'package.module:function'. May be empty when a "
        "reward model is given.")
    reward_weights: list[float] | None = shown_as(help_field(
        None, "One weight per reward function, in their order; unset: 1.0 each (as TRL). The bundled grpo.yaml "
              "files weigh format at half of accuracy (1.0, 0.5) so that a correct answer always beats a "
              "well-formatted wrong one."), "1.0 per function")
    reward_model_path: str = help_field(
        "", "A reward model that scores each response at its last token: a checkpoint with a value head "
            "(`score.weight`), e.g. a Qwen2/LlamaForSequenceClassification converted by tools/convert_weight.py. Its "
            "architecture is --sft_path_reward (default: the inference YAML), its layout the inference layout; it "
            "is on device only in the reward phase. Empty: rule rewards only.")
    reward_model_weight: float = help_field(
        1.0, "Weight of the reward model's score in the sum with the reward functions (logged as "
             "reward/reward_model, unweighted).")
    reward_timeout: float = help_field(
        300.0, "Seconds one reward function may take for one step's responses on a rank; past it the job stops "
               "on every rank with one line naming the function (a hung verifier must not hang the job until the "
               "collectives time out). 0: no limit.")

    def validate(self) -> None:
        if not self.reward_funcs and not self.reward_model_path:
            raise ConfigError("reward.reward_funcs must list at least one reward function (or give "
                              "reward.reward_model_path)")
        if self.reward_weights is not None and len(self.reward_weights) != len(self.reward_funcs):
            raise ConfigError(f"reward.reward_weights has {len(self.reward_weights)} value(s) "
                              f"{self.reward_weights} but reward.reward_funcs has {len(self.reward_funcs)} "
                              f"{self.reward_funcs}: give one weight per function (or leave reward.reward_weights "
                              f"unset for 1.0 each)")
        if not math.isfinite(self.reward_model_weight):
            raise ConfigError(f"reward.reward_model_weight must be a finite number, got {self.reward_model_weight}")
        if not math.isfinite(self.reward_timeout) or self.reward_timeout < 0:
            raise ConfigError(f"reward.reward_timeout must be a number of seconds >= 0 (0 = no limit), got "
                              f"{self.reward_timeout}")


@dataclass(frozen=True)
class OptimizerConfig(Validated):
    """AdamW with bias correction (as `torch.optim.AdamW`), learning-rate schedule and gradient clipping."""

    learning_rate: float = help_field(
        1e-6, "Peak learning rate of the policy (the critic's is critic.learning_rate). 1e-6 is TRL's GRPO default "
              "for billion-parameter policies; a tiny model needs far more (the bundled runs set theirs in "
              "model_configs/<model>/grpo.yaml).")
    beta1: float = help_field(0.9, "Adam beta1 (first-moment decay), the usual value.")
    beta2: float = help_field(
        0.95, "Adam beta2. 0.95 rather than 0.999: the second moment adapts faster to the shifting gradient scale "
              "of RL (the value of the seed tutorial and of most LLM training recipes).")
    eps: float = help_field(1e-8, "Adam epsilon, as torch's default.")
    weight_decay: float = help_field(
        0.01, "Decoupled weight decay on matrices (norm weights and biases are not decayed), torch's AdamW default.")
    lr_schedule: str = help_field(
        "constant", "'constant' after warmup (TRL's GRPO default), or 'cosine' decay to min_lr_ratio at the last "
                    "step.")
    warmup_steps: int = help_field(0, "Linear warmup from 0 over this many optimizer updates.")
    min_lr_ratio: float = help_field(0.0, "Cosine schedule: final learning rate as a fraction of the peak.")
    max_grad_norm: float = help_field(
        1.0, "Clip the global gradient norm (across tensor-parallel shards and data-parallel ranks) to this; "
             "0 = no clipping. 1.0 is TRL's and verl's default.")
    max_consecutive_skips: int = help_field(
        5, "An update whose loss or gradient is NaN/inf is skipped (weights and moments untouched, counted in "
           "actor/skipped_updates); this many skipped in a row stop the job with an error, the last checkpoint "
           "intact. 0 = never stop.")

    def validate(self) -> None:
        checks = [
            (self.learning_rate > 0, "learning_rate", "must be > 0"),
            (0 <= self.beta1 < 1, "beta1", "must be in [0, 1)"),
            (0 <= self.beta2 < 1, "beta2", "must be in [0, 1)"),
            (self.eps > 0, "eps", "must be > 0"),
            (self.weight_decay >= 0, "weight_decay", "must be >= 0"),
            (self.lr_schedule in ("constant", "cosine"), "lr_schedule", "must be 'constant' or 'cosine'"),
            (self.warmup_steps >= 0, "warmup_steps", "must be >= 0"),
            (0 <= self.min_lr_ratio <= 1, "min_lr_ratio", "must be in [0, 1]"),
            (self.max_grad_norm >= 0, "max_grad_norm", "must be >= 0 (0 = no clipping)"),
            (self.max_consecutive_skips >= 0, "max_consecutive_skips", "must be >= 0 (0 = never stop)"),
        ]
        for ok, name, requirement in checks:
            if not ok:
                raise ConfigError(f"optimizer.{name} {requirement}, got {getattr(self, name)!r}")


@dataclass(frozen=True)
class ScheduleConfig(Validated):
    """How much data each step takes and how it is reused."""

    steps: int = help_field(100, "GRPO steps (one rollout batch each).")
    batch_size: int = help_field(
        8, "Prompts per step over all ranks (the global batch); each yields num_generations responses. Must be "
           "divisible by the inference layout's data_parallel.")
    num_iterations: int = help_field(
        1, "Passes over each rollout batch (GRPO's mu). With 1 the sampled policy is the trained one (ratio 1 at "
           "the first update); > 1 recomputes old-policy log-probs (phase 'old') and makes clipping matter.")
    mini_batch_size: int = help_field(
        0, "Prompts per optimizer update (their responses included); 0 = the whole batch (one update per "
           "iteration). Must divide batch_size; its responses must split evenly over the train data_parallel.")
    micro_batch_size_per_device: int = help_field(
        0, "Responses per forward/backward on each train rank; their gradients are summed before the mini-batch's "
           "one update (gradient accumulation, as verl's ppo_micro_batch_size_per_gpu). 0 = auto: the most of the "
           "rank's responses of the mini-batch whose activations fit activation_memory_gib (all of them for small "
           "models). The update is the same up to float rounding. Must divide the responses a train rank gets per "
           "update.")
    log_prob_micro_batch_size_per_device: int = help_field(
        0, "Responses per forward of the reference (and old-policy) log-prob passes on each inference rank (as "
           "verl's log_prob_micro_batch_size_per_gpu); 0 = auto, as micro_batch_size_per_device. The log-probs do "
           "not change. Must divide the responses an inference rank generates per round (batch_size / inference "
           "data_parallel x num_generations).")
    activation_memory_gib: float = help_field(
        1.0, "Activation memory per rank that the auto micro-batch sizes (0) aim at, in GiB, estimated from the "
             "model's shape and the padded lengths (mindrlhf.engine.memory_budget). Activations grow with "
             "responses x length x layers (and the model's width) when training, and the scored positions' logits "
             "with the vocabulary; on CPU a forward call also counts what its compiled graph keeps while it lives "
             "(mindrlhf.engine.memory_plan.GRAPH_MEMORY). Raise it on a large-memory device for fewer, larger calls.")
    share_prompts: bool = help_field(
        True, "Read each prompt once for all of its responses in a graph call (prefix sharing) in the train, "
              "reference, old-policy, critic and reward-model passes, instead of once per response: the prompt's "
              "tokens go through the layers once and every response attends to them, so a call costs P + K x R "
              "tokens instead of K x (P + R) for K responses of a prompt. The results are the same up to float "
              "rounding; false runs each [prompt | response] on its own, as TRL and verl do.")
    response_buckets: int = help_field(
        3, "Widths the train and log-prob passes may cut the padded responses to: a pass reads only as many response "
           "positions as its longest response needs, rounded up to one of this many even steps up to "
           "max_new_tokens (multiples of 8; 48 in 3: 16, 32, 48), and the results are the same (the positions cut "
           "are padding after every response's end). Each width is a compiled graph of its own per pass (memory "
           "and compile time on CPU); 1 = always max_new_tokens.")
    ref_model_sync_steps: int = help_field(
        0, "Copy the policy into the reference model every this many steps (TRL's sync_ref_model); 0 = never: "
           "the reference stays the starting policy, as in DeepSeekMath.")
    seed: int = help_field(0, "Seed of data order and sampling (each data-parallel rank derives its own stream).")

    def validate(self) -> None:
        checks = [
            (self.steps >= 1, "steps", "must be >= 1"),
            (self.batch_size >= 1, "batch_size", "must be >= 1"),
            (self.num_iterations >= 1, "num_iterations", "must be >= 1"),
            (self.mini_batch_size >= 0, "mini_batch_size", "must be >= 0 (0 = whole batch)"),
            (self.micro_batch_size_per_device >= 0, "micro_batch_size_per_device", "must be >= 0 (0 = auto)"),
            (self.log_prob_micro_batch_size_per_device >= 0, "log_prob_micro_batch_size_per_device",
             "must be >= 0 (0 = auto)"),
            (self.activation_memory_gib > 0, "activation_memory_gib", "must be > 0"),
            (self.response_buckets >= 1, "response_buckets", "must be >= 1 (1 = always max_new_tokens)"),
            (self.ref_model_sync_steps >= 0, "ref_model_sync_steps", "must be >= 0 (0 = never)"),
            (self.seed >= 0, "seed", "must be >= 0"),
        ]
        for ok, name, requirement in checks:
            if not ok:
                raise ConfigError(f"schedule.{name} {requirement}, got {getattr(self, name)!r}")
        if self.mini_batch_size and self.batch_size % self.mini_batch_size:
            raise ConfigError(f"schedule.mini_batch_size={self.mini_batch_size} must divide "
                              f"schedule.batch_size={self.batch_size}")

    @property
    def prompts_per_update(self) -> int:
        return self.mini_batch_size or self.batch_size


@dataclass(frozen=True)
class CheckpointConfig(Validated):
    """When checkpoints are written and how many are kept."""

    save_interval: int = help_field(
        0, "Write a checkpoint every this many steps (and always after the last one); 0 = only at the end.")
    keep_last: int = help_field(3, "Complete checkpoints kept; older ones are deleted after a newer one is written.")

    def validate(self) -> None:
        if self.save_interval < 0:
            raise ConfigError(f"checkpoint.save_interval must be >= 0, got {self.save_interval}")
        if self.keep_last < 1:
            raise ConfigError(f"checkpoint.keep_last must be >= 1, got {self.keep_last}")


@dataclass(frozen=True)
class EvalConfig(Validated):
    """Held-out evaluation (`--eval_dataset_file`): greedy accuracy on every prompt of the split."""

    eval_interval: int = help_field(
        0, "Evaluate every this many steps; 0 = only before the first step and after the last one (which is "
           "always done when there is an eval dataset).")
    eval_batch_size: int = help_field(
        0, "Prompts per generation call on each inference data-parallel rank (one compiled shape; the last "
           "batch is padded); 0 = the rollout's rows per rank (batch_size x num_generations / data_parallel), "
           "so that evaluation runs the rollout's compiled graphs and KV cache instead of compiling its own.")
    eval_max_new_tokens: int = help_field(
        0, "Longest evaluated answer; 0 = generation.max_new_tokens (another length compiles graphs of its own).")

    def validate(self) -> None:
        for name in ("eval_interval", "eval_max_new_tokens"):
            if getattr(self, name) < 0:
                raise ConfigError(f"eval.{name} must be >= 0, got {getattr(self, name)}")
        if self.eval_batch_size < 0:
            raise ConfigError(f"eval.eval_batch_size must be >= 0 (0 = the rollout's rows per rank), got "
                              f"{self.eval_batch_size}")


# Names of several sections whose plain flag `--name` sets one section only (not all of them, as `--seed`).
PLAIN_FLAG_SECTION: dict[str, str] = {
    "learning_rate": "optimizer",  # the policy's; the critic's is --critic.learning_rate
    "beta": "loss",  # the RL job's KL coefficient (TRL's and verl's --beta); DPO's is --dpo.beta
}

SECTIONS: dict[str, type] = {
    "algorithm": AlgorithmConfig,
    "generation": GenerationConfig,
    "loss": LossConfig,
    "reward": RewardConfig,
    "optimizer": OptimizerConfig,
    "critic": CriticConfig,
    "schedule": ScheduleConfig,
    "checkpoint": CheckpointConfig,
    "eval": EvalConfig,
    "sft": SFTConfig,
    "dpo": DPOConfig,
    "reward_model": RewardModelConfig,
    "tools": ToolsConfig,
    "lora": LoraConfig,
}


@dataclass(frozen=True)
class GRPOConfig:
    """All settings of a GRPO run (the model YAMLs hold the networks and their parallel layouts).

    Frozen, as its sections are: each section is validated once, as it is made (`Validated`); a changed config is
    a new one (`replace`, or `dataclasses.replace` of a section), whose changed sections are validated then. The
    checks across sections are `validate`'s, run by the job plan.
    """

    algorithm: AlgorithmConfig = dataclasses.field(default_factory=AlgorithmConfig)
    generation: GenerationConfig = dataclasses.field(
        default_factory=lambda: GenerationConfig(max_new_tokens=256, prompt_buckets=[64, 128, 256, 512]))
    loss: LossConfig = dataclasses.field(default_factory=LossConfig)
    reward: RewardConfig = dataclasses.field(default_factory=RewardConfig)
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    critic: CriticConfig = dataclasses.field(default_factory=CriticConfig)
    schedule: ScheduleConfig = dataclasses.field(default_factory=ScheduleConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    eval: EvalConfig = dataclasses.field(default_factory=EvalConfig)
    sft: SFTConfig = dataclasses.field(default_factory=SFTConfig)  # the stages before RL (--stage)
    dpo: DPOConfig = dataclasses.field(default_factory=DPOConfig)
    reward_model: RewardModelConfig = dataclasses.field(default_factory=RewardModelConfig)
    tools: ToolsConfig = dataclasses.field(default_factory=ToolsConfig)
    lora: LoraConfig = dataclasses.field(default_factory=LoraConfig)  # the policy's adapters (rank 0: none)
    # "section.field" -> the YAML file (or "command line") that gave its value, the latest last; not a setting
    sources: dict[str, str] = dataclasses.field(default_factory=dict, repr=False, compare=False)

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_dict(cls, data: Mapping, source: str = "<dict>") -> GRPOConfig:
        """Builds the config from a mapping of sections; unknown sections or fields are errors naming them."""
        return cls._build(data, source, cls(), _given_fields(data, {}, source))

    @classmethod
    def _build(cls, data: Mapping, source: str, base: GRPOConfig, sources: dict[str, str]) -> GRPOConfig:
        """`base` with the fields `data` gives ({section: {field: value}}), from `source`: each section given is
        built and so checked (once, `Validated`); the others are `base`'s, as they are (frozen, already checked)."""
        unknown = sorted(set(data) - set(SECTIONS))
        if unknown:
            raise ConfigError(f"{source}: unknown section(s) {unknown}; known sections: {list(SECTIONS)}")
        sections = {}
        for name, section_cls in SECTIONS.items():
            given = data.get(name) or {}
            if not isinstance(given, Mapping):
                raise ConfigError(f"{source}: section '{name}' must be a mapping, got {type(given).__name__}")
            if not given:
                sections[name] = getattr(base, name)
                continue
            values = {**dataclasses.asdict(getattr(base, name)), **read_verl_keys(name, given, source)}
            elsewhere = {other: [f.name for f in dataclasses.fields(other_cls)]
                         for other, other_cls in SECTIONS.items() if other != name}
            sections[name] = from_mapping(section_cls, values, f"{source}: {name}", elsewhere=elsewhere)
        return cls(**sections, sources=sources)

    @classmethod
    def from_yaml(cls, *paths: str) -> GRPOConfig:
        """The config of one YAML file, or of several merged field by field (later files win); each file is
        mindrlhf's layout or MindSpeed-RL's GRPO trainer YAML (`read_config_yaml`)."""
        config = cls.from_dict(read_config_yaml(paths[0]), source=paths[0])
        for path in paths[1:]:
            config = config.replace({k: v or {} for k, v in read_config_yaml(path).items()}, source=path)
        return config

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return {name: dataclasses.asdict(getattr(self, name)) for name in SECTIONS}

    def replace(self, overrides: Mapping[str, Mapping[str, Any]], source: str = "command line") -> GRPOConfig:
        """A copy with `{section: {field: value}}` applied, the sections it changes built and checked as a YAML's
        (errors name `source`)."""
        return GRPOConfig._build(overrides, source, self, _given_fields(overrides, self.sources, source))

    def source_of(self, section: str, *names: str) -> str | None:
        """The YAML file (or "command line") that gave the latest of `section.<name>`; None for defaults."""
        wanted = {f"{section}.{name}" for name in names}
        latest = None
        for key, source in self.sources.items():
            if key in wanted:
                latest = source
        return latest

    # --------------------------------------------------------------- validation
    def validate(self) -> None:
        """Cross-section checks that need no model, run once by the job plan (each section checked itself as it was
        made, `Validated`; the registered names are checked by `mindrlhf.trainer.plan.check_registered_names`)."""
        if self.algorithm.adv_estimator == "gae":
            if self.algorithm.dynamic_sampling:
                raise ConfigError("algorithm.dynamic_sampling filters prompt groups by their reward spread, a GRPO "
                                  "idea: it cannot be used with adv_estimator gae")
        elif self.generation.num_generations < 2:
            raise ConfigError(f"generation.num_generations must be >= 2 for {self.algorithm.adv_estimator} (a group of "
                              f"one has advantage 0 everywhere, so nothing would be learned), got "
                              f"{self.generation.num_generations}")
        iterations = self.generation.max_tool_calling_iterations
        if bool(self.tools.tools) != bool(iterations):
            raise ConfigError("tools.tools lists tools but generation.max_tool_calling_iterations is 0: set how many "
                              "tool turns a response may take (e.g. 2)" if self.tools.tools else
                              f"generation.max_tool_calling_iterations={iterations} but tools.tools lists no tool "
                              "(--tools calculator, or package.module:function)")
        if self.lora.enabled and self.schedule.ref_model_sync_steps:
            raise ConfigError(f"schedule.ref_model_sync_steps={self.schedule.ref_model_sync_steps}: with LoRA the "
                              "reference is the base model the adapters sit on, which never changes; set it to 0")
        if self.generation.greedy:
            raise ConfigError("generation: GRPO needs sampling (do_sample true and temperature > 0): with greedy "
                              "decoding every response of a group is identical and all advantages are zero")


def read_config_yaml(path: str) -> dict:
    """The sections of a config YAML: a mindrlhf one as written; MindSpeed-RL's GRPO trainer YAML translated
    (`mindrlhf.configs.mindspeed`), what it ignores or reads approximately said in short warning lines, one per
    reason."""
    data = load_yaml(path)
    if not is_mindspeed_yaml(data):
        return data
    mixed = sorted(set(data) & set(SECTIONS))
    if mixed:
        raise ConfigError(f"{path}: MindSpeed-RL sections and mindrlhf sections {mixed} in one file: put them in two "
                          "files and give both to --config (later files win)")
    sections, notes = translate(data, path)
    notes.warn()
    return sections


def _given_fields(data: Mapping, previous: Mapping[str, str], source: str) -> dict[str, str]:
    """`previous` provenance ("section.field" -> source) with the fields `data` gives attributed to `source`, last."""
    sources = dict(previous)
    for section, values in data.items():
        if section in SECTIONS and isinstance(values, Mapping):
            for name in values:
                sources.pop(f"{section}.{name}", None)
                sources[f"{section}.{name}"] = source
    return sources


def field_paths() -> dict[str, list[tuple[str, dataclasses.Field]]]:
    """Field name -> [(section, field)] over all sections (a name may appear in several sections)."""
    paths: dict[str, list[tuple[str, dataclasses.Field]]] = {}
    for section, section_cls in SECTIONS.items():
        for field in dataclasses.fields(section_cls):
            paths.setdefault(field.name, []).append((section, field))
    return paths
