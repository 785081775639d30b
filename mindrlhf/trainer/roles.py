"""Roles of an RL job (actor, reference, reward, critic), each a composition of engines (`mindrlhf.engine`):

    actor       a training engine (the policy in the train layout) + the generators and an old-policy forward
                engine on the inference net + the online reshard train -> infer
    critic      a training engine (the value model) + a forward engine for its values
    reference   a forward engine (log-probs in the inference layout), resharded from the actor now and then
    reward      the rule functions + a forward engine for the reward model's scores, if there is one

A role is built from its spec (`mindrlhf.trainer.specs`, resolved once by `JobPlan`) and declares what the job
does with its nets:
    swap_groups()      group name -> parameters (registered with the job's `SwapManager`)
    resident_in        phase -> its groups that must be on device in that phase (all others are offloaded): its
                       spec's
    strategies()       net name -> per-parameter layouts (`--only_save_strategy` writes them; a net in
                       pipeline stages: this rank's stage, `strategy_stage`)
    rank_files()       rank file name -> parameters; shared_files(): strategy file name -> (layouts, stages)
    state_dict()       JSON-able per-rank state (its engines' counters, random streams), restored by
                       `load_state_dict`; the trainer saves `{role.name: role.state_dict()}`
"""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from typing import NamedTuple

import numpy as np

from mindrlhf.algorithms import GRPOLossCell, ValueLossCell
from mindrlhf.algorithms.policy_cells import GRPOLossNet, ResponseLogProbs, ResponseScores, ResponseValues, ValueLossNet
from mindrlhf.checkpoint.step import (
    CRITIC_CKPT,
    CRITIC_PREFIX,
    CRITIC_STRATEGY,
    INFER_PREFIX,
    INFER_STRATEGY,
    REF_CKPT,
    REF_PREFIX,
    REWARD_MODEL_PREFIX,
    ROLLOUT_PREFIX,
    TRAIN_CKPT,
    TRAIN_STRATEGY,
)
from mindrlhf.checkpoint.weights import (
    load_adapters,
    load_value_model,
    load_weights,
    read_weights,
    start_from,
    with_zero_value_head,
)
from mindrlhf.configs.lora import LoraConfig, is_adapter
from mindrlhf.engine.batches import rows_of_rank
from mindrlhf.engine.forward import ForwardEngine
from mindrlhf.engine.sizing import MicroBatchSizer
from mindrlhf.engine.train import LearningRateSchedule, TrainEngine, UpdatePolicy, total_updates
from mindrlhf.generation import Generator
from mindrlhf.models.qwen2 import Qwen2ForCausalLM, Qwen2ForValue
from mindrlhf.models.qwen2.modeling import MergedAdapters, copy_weights, share_weights
from mindrlhf.optim import AdamW, ShardedAdamW
from mindrlhf.parallel.layers import random_full_state
from mindrlhf.parallel.reshard import Resharder
from mindrlhf.parallel.strategy import net_layouts
from mindrlhf.reward import build_reward_fn
from mindrlhf.tool_use import GroupToolTurns, ToolRunner, ToolTurns, load_tools
from mindrlhf.trainer.completions import response_turns
from mindrlhf.trainer.specs import (
    CRITIC_MOMENTS,
    CRITIC_WEIGHTS,
    INFER_WEIGHTS,
    KV_CACHES,
    OPTIMIZER_MOMENTS,
    REF_WEIGHTS,
    REWARD_MODEL_WEIGHTS,
    ROLLOUT_WEIGHTS,
    TRAIN_WEIGHTS,
    ActorSpec,
    CriticSpec,
    ReferenceSpec,
    RewardSpec,
)
from mindrlhf.utils.agreement import FailedRanks, agreed

logger = logging.getLogger("mindrlhf.trainer")

class Role:
    """Base of the roles: no nets, nothing to swap, checkpoint or restore. `spec` is the role's spec."""

    name = "role"
    spec = None
    swap = None

    @property
    def resident_in(self) -> dict[str, tuple[str, ...]]:
        return self.spec.resident_in if self.spec is not None else {}

    def attach(self, swap) -> None:
        """Registers the role's swap groups with the job's `SwapManager`; its nets then check residency."""
        for group, params in self.swap_groups().items():
            swap.register(group, params)
        self.swap = swap

    def assert_resident(self, groups: tuple[str, ...], operation: str) -> None:
        """Raises `SwapError` when one of `groups` is offloaded (a phase plan that forgot a net)."""
        if self.swap is not None:
            self.swap.check_resident(groups, f"{self.name}.{operation}")

    def swap_groups(self) -> dict[str, list]:
        return {}

    def strategies(self) -> dict[str, dict]:
        return {}

    def rank_files(self) -> dict[str, list]:
        """Per-rank checkpoint file name -> the parameters saved in it."""
        return {}

    def shared_files(self) -> dict[str, tuple[dict, dict | None]]:
        """Checkpoint strategy file name -> (layouts, parameter name -> pipeline stage or None), written once, by
        rank 0."""
        return {}

    def strategy_stage(self, net: str) -> int:
        """The pipeline stage of this rank's part of `net` (0 for nets without stages)."""
        del net
        return 0

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        del state

    def after_resume(self) -> None:
        """Called once every role has loaded its checkpoint state."""


def update_policy(optimizer, schedule, shape, aggregation: str, learning_rate: float, warmup_steps: int,
                  max_grad_norm: float) -> UpdatePolicy:
    """A trained net's `UpdatePolicy` from the `optimizer` and `schedule` sections and the step's `shape` (a
    `StepShape`: the schedule's updates a step), with its own peak learning rate, warmup and clip, and the loss's
    token `aggregation`."""
    schedule_of_lr = LearningRateSchedule(learning_rate, warmup_steps, total_updates(shape, schedule.steps),
                                          optimizer.lr_schedule, optimizer.min_lr_ratio)
    return UpdatePolicy(schedule_of_lr, max_grad_norm, aggregation, optimizer.max_consecutive_skips)


def adamw(opt, net, params, state_prefix: str = "", learning_rate: float | None = None):
    """AdamW of the `optimizer` section `opt` over `params` of `net` (a `NetSpec`); its moments sharded over the
    net's data-parallel group (`ShardedAdamW`) when its `parallel_config.optimizer_shard` is set and dp > 1."""
    kwargs = dict(learning_rate=opt.learning_rate if learning_rate is None else learning_rate, beta1=opt.beta1,
                  beta2=opt.beta2, eps=opt.eps, weight_decay=opt.weight_decay, state_prefix=state_prefix)
    layout = net.layout
    if net.model.parallel_config.optimizer_shard and layout.dp > 1:
        return ShardedAdamW(params, layout.dp, layout.dp_rank, layout.dp_group, **kwargs)
    return AdamW(params, **kwargs)


def actor_update_policy(spec: ActorSpec) -> UpdatePolicy:
    """How the policy's updates are made: its optimizer's rate, warmup and clip, the loss's aggregation, over the
    tokens it trains (`ActorSpec.token_mask`: with tools the model's own, never a tool's answer)."""
    opt = spec.optimizer
    policy = update_policy(opt, spec.schedule, spec.shape, spec.loss.aggregation, opt.learning_rate,
                           opt.warmup_steps, opt.max_grad_norm)
    return dataclasses.replace(policy, token_mask=spec.token_mask)


def critic_update_policy(spec: CriticSpec, token_mask: str) -> UpdatePolicy:
    """How the critic's updates are made: its own rate, warmup and clip, the loss's aggregation, over the tokens the
    policy trains (`token_mask`, the actor's: a tool turn's tokens are no action, their values are not fitted)."""
    critic = spec.critic
    policy = update_policy(spec.optimizer, spec.schedule, spec.shape, spec.aggregation, critic.learning_rate,
                           critic.lr_warmup_steps, critic.grad_clip)
    return dataclasses.replace(policy, token_mask=token_mask)


def tool_turns_of(spec: ActorSpec, tokenizer) -> ToolTurns | None:
    """The tool turns of the actor's rollouts (its spec's tools, their answers in `tokenizer`'s chat template), or
    None for a job without tools."""
    tools = spec.tools
    if not tools.tools:
        return None
    runner = ToolRunner(load_tools(tools.tools), tools.tool_timeout, tools.max_tool_result_chars, tools.tool_workers)
    return ToolTurns(runner, tokenizer, spec.generation.max_tool_response_tokens)


class Actor(Role):
    """The policy: a train net (train layout, possibly in pipeline stages) in a training engine with the GRPO loss,
    an inference net (infer layout) with the sampling generator and an old-policy forward engine, and the online
    train -> infer reshard.

    When both nets would hold the same shards (`ActorSpec.shares_train_weights`), the inference net is the train
    net: one set of weights, nothing to reshard, and the inference phases keep `TRAIN_WEIGHTS` resident.

    The rollout (generation, old-policy log-probs, evaluation) runs `rollout_net`: the inference net, or with LoRA
    adapters merged for it (`ActorSpec.merges_adapters`) the model without adapters on the inference net's weights
    but for the adapted layers', its own copies W + (alpha / r) B A, made again at each sync."""

    name = "actor"

    def __init__(self, spec: ActorSpec, detokenize=None, tool_turns=None):
        self.spec = spec
        self.detokenize = detokenize  # token ids -> the rewards' text: the generators' stop strings read it
        self.tool_turns = tool_turns  # the tools' turns of a multi-turn rollout (`tool_use.ToolTurns`), or None
        self.train_layout, self.infer_layout = spec.train.layout, spec.infer.layout
        self.train_net = Qwen2ForCausalLM(spec.train.model, self.train_layout)
        self.train_strategy = net_layouts(self.train_net, self.train_layout)  # of this rank's stage
        self.shares_weights, self.infer_group = spec.shares_train_weights, spec.infer_group
        self.infer_prefix = "" if self.shares_weights else INFER_PREFIX  # of the inference net's parameter names
        if self.shares_weights:
            self.infer_net, self.infer_strategy = self.train_net, self.train_strategy
        else:
            self.infer_net = Qwen2ForCausalLM(spec.infer.model, self.infer_layout)
            self.infer_net.update_parameters_name(INFER_PREFIX)
            self.infer_strategy = net_layouts(self.infer_net, self.infer_layout)
        self.engine: TrainEngine | None = None  # from build()
        self.rollout_net, self.merge = self.infer_net, None
        if spec.merges_adapters:
            self.rollout_net = Qwen2ForCausalLM(dataclasses.replace(spec.infer.model, lora=LoraConfig()),
                                                self.infer_layout)
            self.rollout_net.update_parameters_name(ROLLOUT_PREFIX)
            self.merge = MergedAdapters(self.rollout_net, self.infer_net)

    def build(self, comm, dp_sums=None) -> None:
        """Weights, the training engine, resharder, forward engine and generators (skipped by
        --only_save_strategy). `comm` sums metrics over ranks; `dp_sums`: the train dp group's shared-memory
        gradient sums, if any."""
        spec, train, infer = self.spec, self.spec.train, self.spec.infer
        gen, sched, opt, loss = spec.generation, spec.schedule, spec.optimizer, spec.loss
        start_from(self.train_net, self.train_layout, train.checkpoint, spec.init_seed)
        if spec.lora_adapter:
            load_adapters(self.train_net, self.train_layout, spec.lora_adapter)
        loss_cell = GRPOLossCell(beta=loss.beta, epsilon_low=loss.epsilon_low, epsilon_high=loss.epsilon_high,
                                 kl_estimator=loss.kl_estimator)
        self.engine = TrainEngine(
            "actor", self.train_net, GRPOLossNet(self.train_net, loss_cell, gen.temperature),
            adamw(opt, train, self.train_net.trainable_params()), self.train_layout, train.model,
            MicroBatchSizer.for_pass("train", sched, train.model, self.train_layout, spec.group_size, training=True),
            spec.shape, comm,
            actor_update_policy(spec), self.train_strategy, stage_shared=self.train_net.stage_shared_params,
            dp_sums=dp_sums)
        self.to_infer = None if self.shares_weights else \
            self.resharder_to(self.infer_net, self.infer_strategy, INFER_PREFIX)
        # with LoRA the base weights never change: after the first reshard a step moves the adapters alone
        self.adapters_to_infer = self.resharder_to(self.infer_net, self.infer_strategy, INFER_PREFIX, is_adapter) \
            if self.to_infer is not None and spec.train.model.lora.enabled else None
        self.old_log_probs = ForwardEngine(
            ResponseLogProbs(self.rollout_net, gen.temperature),
            MicroBatchSizer.for_pass("log_prob", sched, infer.model, self.infer_layout, spec.group_size,
                                     training=False))
        self._build_generators(comm)
        lora = train.model.lora
        if lora.enabled:
            logger.info("actor: %s (the reference is the base model)",
                        lora.describe(sum(p.size for p in self.train_net.trainable_params())))
        if self.shares_weights:
            logger.info("actor: the inference net uses the train net's weights (same model and layout %s): no "
                        "second copy, no reshard", self.infer_layout)
        elif infer.checkpoint:
            load_weights(self.infer_net, self.infer_layout, infer.checkpoint, INFER_PREFIX, spec.init_seed)
            if spec.lora_adapter:
                load_adapters(self.infer_net, self.infer_layout, spec.lora_adapter, INFER_PREFIX)
        else:
            self.to_infer.run()
        if self.merge is not None:
            self.merge()
            logger.info("actor: the rollout generates with the adapters merged into a copy of the adapted weights "
                        "(%.1f MiB, made again after each update; lora.lora_merged_rollout)",
                        sum(p.size * p.itemsize for p in self.merge.targets) / 2**20)

    def _build_generators(self, comm) -> None:
        spec, gen, layout = self.spec, self.spec.generation, self.infer_layout
        tools = self.tool_turns
        if tools is not None and layout.tp > 1:  # the tp peers roll out the same samples: one rank calls the tools
            tools = GroupToolTurns(tools, comm, layout.tp_group, leader=layout.tp_rank == 0)
        self.generator = Generator(self.rollout_net, gen, detokenize=self.detokenize, tools=tools)
        self.generator.reseed([gen.seed, self.infer_layout.dp_rank])  # each dp rank samples a stream of its own
        # the evaluation prefills as many prompts a call as the rollout: both run one prefill graph
        self.eval_generator = Generator(self.rollout_net, dataclasses.replace(
            gen, do_sample=False, num_generations=1, max_new_tokens=spec.eval_max_new_tokens),
            graphs=self.generator.graphs, prefill_prompts=spec.shape.prompts_per_infer_rank,
            detokenize=self.detokenize, tools=tools)

    def resharder_to(self, net, strategy: dict, prefix: str, only=None):
        """The online reshard of the train net's weights into `net` (its parameters named `prefix` + the train
        net's names; both nets carry the job's adapters, if any), from every pipeline stage when the train net has
        them; `only`: a test of the names to move (default: all `net` has)."""
        names = {name[len(prefix):]: name for name in strategy}
        return Resharder(self.train_net, net, self.train_strategy, strategy, names, rank=self.train_layout.rank,
                         src_pipeline=self.train_layout, src_stage_layouts=self.engine.stages, only=only)

    # ------------------------------------------------------------------ state
    def attach(self, swap) -> None:
        """The nets' groups, and the rollout's KV caches as they are made (resident in generate and eval only)."""
        super().attach(swap)
        swap.register(KV_CACHES, (), growing=True)
        self.generator.graphs.watch_caches(lambda cache: swap.extend(KV_CACHES, cache.parameters()))

    def swap_groups(self) -> dict[str, list]:
        groups = {TRAIN_WEIGHTS: self.engine.weights(), OPTIMIZER_MOMENTS: self.engine.optimizer_state()}
        if not self.shares_weights:
            groups[INFER_WEIGHTS] = list(self.infer_net.get_parameters())
        if self.merge is not None:
            groups[ROLLOUT_WEIGHTS] = list(self.merge.targets)
        return groups

    def strategies(self) -> dict[str, dict]:
        return {"train": self.train_strategy, "infer": self.infer_strategy}

    def rank_files(self) -> dict[str, list]:
        return {TRAIN_CKPT: self.engine.weights() + self.engine.optimizer_state()}

    def shared_files(self) -> dict[str, tuple[dict, dict | None]]:
        return self.engine.strategy_file(TRAIN_STRATEGY)

    def strategy_stage(self, net: str) -> int:
        return self.train_layout.stage if net == "train" else 0

    def state_dict(self) -> dict:
        return {"engine": self.engine.state_dict(), "generator_rng": self.generator.rng_state()}

    def load_state_dict(self, state: dict) -> None:
        self.engine.load_state_dict(state["engine"])
        self.generator.load_rng_state(state["generator_rng"])

    def after_resume(self) -> None:
        self.sync_inference(everything=True)

    # ------------------------------------------------------------------ work
    def generate(self, prompt_ids, attention_mask, progress: bool = False):
        """`num_generations` samples per prompt with their log-probs (`GenerationOutput`)."""
        self.assert_resident((*self.spec.rollout_groups, KV_CACHES), "generate")
        return self.generator.generate(prompt_ids, attention_mask, return_log_probs=True, progress=progress,
                                       min_prompt_width=prompt_ids.shape[1])

    def greedy_generator(self):
        """The greedy generator of held-out evaluation (after checking the inference net is resident)."""
        self.assert_resident((*self.spec.rollout_groups, KV_CACHES), "evaluate")
        return self.eval_generator

    @property
    def log_prob_sizer(self) -> MicroBatchSizer:
        """How the log-prob passes in the inference layout split their rows into graph calls (the reference's pass
        reads the same rows in the same layout)."""
        return self.old_log_probs.sizer

    def random_weights(self, seed: int) -> dict:
        """The whole train net's weights as random initialisation with `seed` gives them (the critic's backbone when
        there is no checkpoint to start from); adapters left out (the policy starts them with B = 0: it is its base)."""
        return {name: value for name, value in random_full_state(self.train_net, self.train_layout, seed).items()
                if not is_adapter(name)}

    def log_probs(self, columns) -> np.ndarray:
        """Old-policy log-probs of the rows of `columns` (prompt and response ids and masks by name) under the
        rollout net."""
        self.assert_resident(self.spec.rollout_groups, "log_probs")
        return self.old_log_probs.run(columns)

    def train(self, share) -> dict:
        """`schedule.num_iterations` passes of mini-batch updates on this train rank's rows of the experience
        (`RankRows`); returns the `actor/*` metrics averaged over the updates."""
        self.assert_resident((TRAIN_WEIGHTS, OPTIMIZER_MOMENTS), "train")
        return self.engine.update(share)

    def sync_inference(self, everything: bool = False) -> None:
        """Reshards the train net's weights into the inference net (nothing to do when it is the train net): with
        LoRA the adapters alone unless `everything`; then merges them into the rollout's copy, if it has one."""
        self.assert_resident((TRAIN_WEIGHTS, *self.spec.rollout_groups), "sync_inference")
        if self.adapters_to_infer is not None and not everything:
            self.adapters_to_infer.run()
        elif self.to_infer is not None:
            self.to_infer.run()
        if self.merge is not None:
            self.merge()


class Reference(Role):
    """The reference policy in the inference layout: log-probs for the KL term; a local copy of the actor's
    inference net (the same layout: nothing to reshard) at the start and every `schedule.ref_model_sync_steps`
    steps, after the actor's reshard. With LoRA, the base model: a net without adapters on the actor's inference
    net's own base weights (no copy, nothing to reshard, save or swap)."""

    name = "reference"

    def __init__(self, spec: ReferenceSpec):
        self.spec, self.layout = spec, spec.net.layout
        self.net = Qwen2ForCausalLM(spec.net.model, self.layout)
        self.net.update_parameters_name(REF_PREFIX)
        self.strategy = net_layouts(self.net, self.layout)
        self.own_weights = not spec.shares_policy_base

    def build(self, actor: Actor) -> None:
        """Weights: --load_ref_checkpoint, or the actor's inference net's (the starting policy, once built)."""
        if not self.own_weights:
            share_weights(self.net, actor.infer_net)
        # the actor's sizer: both passes read the same rows in the same layout
        self.engine = ForwardEngine(ResponseLogProbs(self.net, self.spec.temperature), actor.log_prob_sizer)
        if self.spec.net.checkpoint:
            load_weights(self.net, self.layout, self.spec.net.checkpoint, REF_PREFIX)
        elif self.own_weights:
            copy_weights(self.net, actor.infer_net)

    def swap_groups(self) -> dict[str, list]:
        return {REF_WEIGHTS: list(self.net.get_parameters())} if self.own_weights else {}

    def strategies(self) -> dict[str, dict]:
        return {"ref": self.strategy} if self.own_weights else {}

    def rank_files(self) -> dict[str, list]:
        return {REF_CKPT: list(self.net.get_parameters())} if self.own_weights else {}

    def shared_files(self) -> dict[str, tuple[dict, dict | None]]:
        return {INFER_STRATEGY: (self.strategy, None)} if self.own_weights else {}

    def log_probs(self, columns) -> np.ndarray:
        """Reference log-probs of the rows of `columns` (prompt and response ids and masks by name)."""
        self.assert_resident((self.spec.weights_group,), "log_probs")
        return self.engine.run(columns)

    def sync_from_actor(self, actor: Actor) -> None:
        """Copies the actor's inference weights (its train weights, resharded this step) into the reference."""
        self.assert_resident((actor.infer_group, REF_WEIGHTS), "sync_from_actor")
        copy_weights(self.net, actor.infer_net)


class Critic(Role):
    """The PPO value function: `Qwen2ForValue` in its own layout (`--sft_path_critic`) in a training engine with the
    clipped value loss, and a forward engine for its values. It scores every response token of the rollout (phase
    `values`) and trains on the returns (phase `update_critic`); it is offloaded in every other phase."""

    name = "critic"

    def __init__(self, spec: CriticSpec):
        self.spec, self.layout = spec, spec.net.layout
        self.net = Qwen2ForValue(spec.net.model, self.layout)
        self.net.update_parameters_name(CRITIC_PREFIX)
        self.strategy = net_layouts(self.net, self.layout)  # of this rank's stage
        self.engine: TrainEngine | None = None  # from build()

    def build(self, actor: Actor, comm, dp_sums=None) -> None:
        """Weights (a critic checkpoint, or the starting policy's backbone with a zero head), the training engine
        and the values' forward engine."""
        spec, critic, model = self.spec, self.spec.critic, self.spec.net.model
        sched, opt, group = spec.schedule, spec.optimizer, spec.group_size
        self._load_weights(actor)
        self.comm = comm
        self.engine = TrainEngine(
            "critic", self.net, ValueLossNet(self.net, ValueLossCell(critic.cliprange_value)),
            adamw(opt, spec.net, self.net.trainable_params(), "critic_", critic.learning_rate), self.layout, model,
            MicroBatchSizer.for_pass("critic train", sched, model, self.layout, group, training=True),
            spec.shape, comm, critic_update_policy(spec, actor.spec.token_mask), self.strategy, dp_sums=dp_sums)
        self.values_engine = ForwardEngine(
            ResponseValues(self.net),
            MicroBatchSizer.for_pass("values", sched, model, self.layout, group, training=False),
            self.net, self.layout, model)
        if model.lora.enabled:
            logger.info("critic: %s; the value head trains with the adapters (counted)",
                        model.lora.describe(sum(p.size for p in self.net.trainable_params())))

    def _load_weights(self, actor: Actor) -> None:
        net, policy, model = self.spec.net, self.spec.policy, self.spec.net.model
        if net.checkpoint:
            source = net.checkpoint
            state = read_weights(source, "critic")
        else:
            source = policy.checkpoint or f"random weights (seed {self.spec.init_seed})"
            state = read_weights(policy.checkpoint) if policy.checkpoint else \
                actor.random_weights(self.spec.init_seed)
            state = with_zero_value_head(state, model.hidden_size, model.value_head_bias)
            logger.info("critic: the starting policy's backbone with a zero value head (--load_critic_checkpoint "
                        "not given)")
        load_value_model(self.net, self.layout, state, source, CRITIC_PREFIX, f"critic {net.yaml}")

    def swap_groups(self) -> dict[str, list]:
        return {CRITIC_WEIGHTS: self.engine.weights(), CRITIC_MOMENTS: self.engine.optimizer_state()}

    def strategies(self) -> dict[str, dict]:
        return {"critic": self.strategy}

    def rank_files(self) -> dict[str, list]:
        return {CRITIC_CKPT: self.engine.weights() + self.engine.optimizer_state()}

    def shared_files(self) -> dict[str, tuple[dict, dict | None]]:
        return self.engine.strategy_file(CRITIC_STRATEGY)

    def strategy_stage(self, net: str) -> int:
        return self.layout.stage if net == "critic" else 0

    def state_dict(self) -> dict:
        return {"engine": self.engine.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.engine.load_state_dict(state["engine"])

    def values(self, exp) -> np.ndarray:
        """Values of every row of `exp` [N, R] (0 on padding): each critic dp rank scores its share of the rows,
        then the shares are gathered."""
        self.assert_resident((CRITIC_WEIGHTS,), "values")
        my_rows = rows_of_rank(exp.num_rows, self.layout.dp, self.layout.dp_rank)
        local = self.values_engine.run(exp.rows(my_rows), first_row=my_rows.start).astype(np.float32)
        values = self.comm.gather_data_parallel_rows(local, self.layout) if self.layout.world_size > 1 else local
        return values * exp.response_mask.astype(np.float32)

    def train(self, share) -> dict:
        """`schedule.num_iterations` passes of mini-batches on the value loss over this critic rank's rows of the
        experience (`RankRows`); `critic/*` metrics."""
        self.assert_resident((CRITIC_WEIGHTS, CRITIC_MOMENTS), "train")
        return self.engine.update(share)


class RewardScores(NamedTuple):
    """A rollout's rewards: `total` [N] (the weighted sum), `terms` (each function's unweighted rewards by name,
    `reward_model` for the model's scores) and the `completions` they scored (the responses' text)."""

    total: np.ndarray
    terms: dict[str, np.ndarray]
    completions: list[str]


class Reward(Role):
    """Rewards of a rollout: the rule functions (`reward.reward_funcs`, weighted, on the host) plus, with
    `reward.reward_model_path`, a reward model's score at the last response token (`Qwen2ForValue` in the
    inference layout, on device only in the `reward` phase), weighted by `reward.reward_model_weight`."""

    name = "reward"

    def __init__(self, spec: RewardSpec, tokenizer):
        reward = spec.reward
        self.spec, self.tokenizer = spec, tokenizer
        self.rules = build_reward_fn(reward.reward_funcs, reward.reward_weights, reward.reward_timeout) \
            if reward.reward_funcs else None
        self.net = None
        self.failed_ranks: FailedRanks = lambda failed: [0] if failed else []
        if spec.model is not None:
            self.layout = spec.model.layout
            self.net = Qwen2ForValue(spec.model.model, self.layout)
            self.net.update_parameters_name(REWARD_MODEL_PREFIX)
            self.strategy = net_layouts(self.net, self.layout)

    def build(self, failed_ranks: FailedRanks) -> None:
        """Loads the reward model (a checkpoint with a value head) and its scoring engine; `failed_ranks` is the
        job's agreement (`ArrayCollectives.failed_ranks`): the ranks agree that their rule rewards succeeded."""
        self.failed_ranks = failed_ranks
        if self.net is None:
            return
        model, path = self.spec.model, self.spec.model.checkpoint
        state = read_weights(path, "critic")  # a step folder's value model is its critic
        load_value_model(self.net, self.layout, state, path, REWARD_MODEL_PREFIX, f"reward model {model.yaml}")
        self.engine = ForwardEngine(ResponseScores(self.net), MicroBatchSizer.for_pass(
            "reward model", self.spec.schedule, model.model, self.layout, self.spec.group_size, training=False))
        logger.info("reward model %s (weight %g)%s", path, self.spec.reward.reward_model_weight,
                    f" + rule rewards {self.rules}" if self.rules else "")

    def swap_groups(self) -> dict[str, list]:
        return {REWARD_MODEL_WEIGHTS: list(self.net.get_parameters())} if self.net is not None else {}

    def strategies(self) -> dict[str, dict]:
        return {"reward_model": self.strategy} if self.net is not None else {}

    def model_scores(self, columns) -> np.ndarray:
        """The reward model's score of each row of `columns` (prompt and response ids and masks by name)."""
        self.assert_resident((REWARD_MODEL_WEIGHTS,), "model_scores")
        return self.engine.run(columns).astype(np.float32)

    def score(self, rollout: Mapping[str, np.ndarray], solutions, columns=None) -> RewardScores:
        """The rewards of the responses of `rollout` (prompt and response ids and masks by name), given each one's
        gold answer (`solutions`); `columns`: the prompts' other dataset fields, one list per name with a value per
        response, passed to TRL-form reward functions as keyword arguments. A multi-turn rollout (a `loss_mask`) also
        gives them `turns`, each response's turns as {"role", "content"} messages (its `tool_calls` come in
        `columns`), and the two-argument functions (`accuracy`, ...) the model's own text (a number a tool returned is
        no answer of the model's)."""
        prompt_ids, prompt_mask = rollout["prompt_ids"], rollout["prompt_mask"]
        response_ids, response_mask = rollout["response_ids"], rollout["response_mask"]
        completions = self.tokenizer.completions(response_ids, response_mask)
        rewards, terms = np.zeros(len(completions), np.float32), {}
        # every rank's rule functions, agreed on before the reward model's collectives: one rank's failing or hung
        # function stops every rank here, in one line each
        with agreed(self.failed_ranks, "the reward functions"):
            if self.rules is not None:
                extra = {}
                if "loss_mask" in rollout:
                    extra["model_completions"] = self.tokenizer.completions(response_ids, rollout["loss_mask"])
                if self.rules.needs_prompts:  # TRL-form functions also get the prompts, completion ids and columns
                    extra.update(columns or {})
                    extra["prompts"] = self.tokenizer.decode_masked(prompt_ids, prompt_mask,
                                                                    skip_special_tokens=False)
                    extra["completion_ids"] = [ids[mask.astype(bool)].tolist()
                                               for ids, mask in zip(response_ids, response_mask)]
                    if "loss_mask" in rollout:
                        extra["turns"] = response_turns(self.tokenizer, response_ids, response_mask,
                                                        rollout["loss_mask"])
                rewards, terms = self.rules(completions, solutions, **extra)
        if self.net is not None:
            scores = self.model_scores(rollout)
            rewards = (rewards + self.spec.reward.reward_model_weight * scores).astype(np.float32)
            terms = {**terms, "reward_model": scores}
        return RewardScores(rewards, terms, completions)
