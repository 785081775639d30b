"""What each role of a job is built from: `JobPlan.build` resolves one spec per role, once, from the config, the
flags and the model YAMLs; a role (`mindrlhf.trainer.roles`) reads its spec and nothing else of the job.

A spec holds its nets (`NetSpec`: model config, layout on this rank, the checkpoint to load and the YAML it came
from), the config sections its engines use, and its residency (`resident_in`: phase -> the swap groups it must
have on device). The memory plan reads the same specs, so what it counts is what the trainer builds. No MindSpore
here: `--plan` and the config tools import this module.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from typing import ClassVar

from mindrlhf.configs.generation import GenerationConfig
from mindrlhf.configs.grpo_configs import CriticConfig, LossConfig, OptimizerConfig, RewardConfig, ScheduleConfig
from mindrlhf.configs.tools import ToolsConfig
from mindrlhf.engine.step_shape import StepShape
from mindrlhf.models.qwen2.config import Qwen2Config
from mindrlhf.parallel.layout import Layout

# Swap groups (names as they appear in the swap log and the phase plan)
TRAIN_WEIGHTS = "train_weights"
OPTIMIZER_MOMENTS = "optimizer_moments"
INFER_WEIGHTS = "infer_weights"
REF_WEIGHTS = "ref_weights"
CRITIC_WEIGHTS = "critic_weights"
CRITIC_MOMENTS = "critic_moments"
REWARD_MODEL_WEIGHTS = "reward_model_weights"
ROLLOUT_WEIGHTS = "rollout_weights"  # with LoRA, the adapted layers' weights with the adapters merged in
KV_CACHES = "kv_caches"  # the rollout's KV caches, made in its first generation (a growing group)


@dataclass(frozen=True)
class NetSpec:
    """One net of a role: its architecture (`model`, from the model YAML `yaml`), its layout on this rank, and the
    checkpoint its weights are loaded from ("": the role makes them: random, or resharded from the actor)."""

    model: Qwen2Config
    layout: Layout
    yaml: str
    checkpoint: str = ""

    def for_rank(self, world_size: int, rank: int) -> NetSpec:
        """The same net placed at `rank` (nothing is checked again)."""
        return dataclasses.replace(self, layout=Layout.from_config(self.model.parallel_config, world_size, rank))


@dataclass(frozen=True)
class ActorSpec:
    """The policy: its train net, its inference net (the train net itself when `shares_train_weights`), the
    generation, loss, optimizer and schedule settings, the step's geometry (`shape`), and the seed of random weights
    (no train checkpoint)."""

    name: ClassVar[str] = "actor"
    train: NetSpec
    infer: NetSpec
    shares_train_weights: bool  # `plan.shares_train_weights`: one set of weights, nothing to reshard
    generation: GenerationConfig
    loss: LossConfig
    optimizer: OptimizerConfig
    schedule: ScheduleConfig
    shape: StepShape  # the plan's (`JobPlan.shape`)
    eval_max_new_tokens: int  # the greedy evaluation's longest answer
    init_seed: int
    tools: ToolsConfig = dataclasses.field(default_factory=ToolsConfig)  # the tools its rollouts may call
    lora_adapter: str = ""  # a PEFT folder its adapters start from (--load_lora_adapter; "": PEFT's start)

    @property
    def group_size(self) -> int:
        return self.shape.group_size

    @property
    def token_mask(self) -> str:
        """The experience column of the tokens the policy loss trains: with tools the model's own (`loss_mask`, the
        tool turns' tokens left out), else every response token."""
        return "loss_mask" if self.tools.tools else "response_mask"

    @property
    def infer_group(self) -> str:
        """The swap group of the inference net's weights."""
        return TRAIN_WEIGHTS if self.shares_train_weights else INFER_WEIGHTS

    @property
    def merges_adapters(self) -> bool:
        """Whether the rollout runs on a copy of the adapted layers' weights with the adapters merged in
        (`lora.lora_merged_rollout`), made in the reshard phase."""
        lora = self.infer.model.lora
        return lora.enabled and lora.lora_merged_rollout

    @property
    def rollout_groups(self) -> tuple[str, ...]:
        """The swap groups of the net that generates and scores the old policy: the inference net's, and with
        merged adapters their copy."""
        return (self.infer_group, ROLLOUT_WEIGHTS) if self.merges_adapters else (self.infer_group,)

    @property
    def resident_in(self) -> dict[str, tuple[str, ...]]:
        infer, rollout_net = (self.infer_group,), self.rollout_groups
        # the inference weights stay on device while the reference syncs: the next phase (generate) reads them
        rollout = rollout_net + (KV_CACHES,)
        return {"generate": rollout, "eval": rollout, "old": rollout_net, "train": (TRAIN_WEIGHTS, OPTIMIZER_MOMENTS),
                "reshard": tuple(dict.fromkeys((TRAIN_WEIGHTS, *rollout_net))), "sync_ref": infer}


@dataclass(frozen=True)
class ReferenceSpec:
    """The reference policy: a net in the inference layout, loaded from `net.checkpoint` or copied from the actor's
    inference net (and again every `ref_model_sync_steps`, in the `sync_ref` phase after the actor's reshard).
    With LoRA it is the base model and holds no weights of its own: its net shares the base weights of the actor's
    inference net (`weights_group`, that net's swap group)."""

    name: ClassVar[str] = "reference"
    net: NetSpec
    temperature: float
    weights_group: str = REF_WEIGHTS  # the swap group of its weights: its own, or the actor's inference group

    @property
    def shares_policy_base(self) -> bool:
        return self.weights_group != REF_WEIGHTS

    @property
    def resident_in(self) -> dict[str, tuple[str, ...]]:
        if self.shares_policy_base:
            return {"ref": (self.weights_group,)}
        return {"ref": (REF_WEIGHTS,), "sync_ref": (REF_WEIGHTS,)}  # with the actor's inference weights


@dataclass(frozen=True)
class CriticSpec:
    """The PPO critic: a value model in its own layout, from `net.checkpoint` or else the starting policy
    (`policy`: its checkpoint, or random weights of `init_seed`) with a zero value head; `shape` is the step's
    geometry (`JobPlan.shape`)."""

    name: ClassVar[str] = "critic"
    resident_in: ClassVar[dict[str, tuple[str, ...]]] = {"values": (CRITIC_WEIGHTS,),
                                                         "update_critic": (CRITIC_WEIGHTS, CRITIC_MOMENTS)}
    net: NetSpec
    policy: NetSpec
    critic: CriticConfig
    optimizer: OptimizerConfig
    schedule: ScheduleConfig
    aggregation: str  # the loss's token weighting (`loss.aggregation`), as the actor's
    shape: StepShape
    init_seed: int

    @property
    def group_size(self) -> int:
        return self.shape.group_size


@dataclass(frozen=True)
class RewardSpec:
    """The rewards: the rule functions and, with `reward.reward_model_path`, a reward model (`model`, in the
    inference layout, its checkpoint the reward model path); `shape` is the step's geometry (`JobPlan.shape`)."""

    name: ClassVar[str] = "reward"
    reward: RewardConfig
    model: NetSpec | None
    schedule: ScheduleConfig
    shape: StepShape

    @property
    def group_size(self) -> int:
        return self.shape.group_size

    @property
    def resident_in(self) -> dict[str, tuple[str, ...]]:
        return {"reward": (REWARD_MODEL_WEIGHTS,)} if self.model is not None else {}


def phase_plan(roles: Iterable, phases: Iterable[str]) -> dict[str, tuple[str, ...]]:
    """Phase -> the swap groups resident in it: the union of what each role (or its spec) declares in
    `resident_in`."""
    plan: dict[str, tuple[str, ...]] = {phase: () for phase in phases}
    for role in roles:
        for phase, groups in role.resident_in.items():
            plan[phase] = plan.get(phase, ()) + tuple(groups)
    return plan
