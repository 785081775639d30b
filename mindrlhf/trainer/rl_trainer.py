"""`RLTrainer`: one loop over the roles of the job (:mod:`mindrlhf.trainer.roles`), on the same ranks in
their own layouts. `GRPOTrainer` is its GRPO configuration (the algorithm is a config choice, not a subclass).

One step (each block is a phase, see :mod:`mindrlhf.trainer.phases`)::

    generate  actor's infer net (infer layout): num_generations samples for this dp rank's prompts
    reward    rule rewards
    ref       reference net (infer layout): log-probs of the sampled tokens
    old       actor's infer net: old-policy log-probs (only when num_iterations > 1)
    gather    experience gathered to every rank (no model resident)
    values    PPO: the critic's value of every response token (critic layout); token rewards (minus the KL
              penalty with algorithm.use_kl_in_reward)
              advantages and returns (`algorithm.adv_estimator`) over the whole batch, on the host
    update_critic  PPO: the critic's clipped value-loss updates
    train     num_iterations passes of mini-batch updates on the actor's train net (train layout), loss
              normalised over each global mini-batch (from step critic.critic_warmup + 1 with a critic)
    reshard   actor train -> infer every step, train -> ref every ref_model_sync_steps
"""
from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable

import numpy as np

from mindrlhf.configs.base import ConfigError
from mindrlhf.configs.grpo_configs import GRPOConfig
from mindrlhf.configs.job import JobOptions
from mindrlhf.reward import columns_per_completion
from mindrlhf.trainer.checkpoint import (
    RANK_STATE,
    CheckpointWriter,
    check_resumable,
    find_resume_checkpoint,
    rank_dir,
    read_meta,
    save_parameters,
)
from mindrlhf.trainer.experience import Experience, concat_experiences, group_unit
from mindrlhf.trainer.phases import PHASES, Phases, peak_rss_gib
from mindrlhf.trainer.roles import (
    REF_WEIGHTS,
    Actor,
    Critic,
    Reference,
    Reward,
    Role,
    load_rank_params,
    phase_plan,
)

logger = logging.getLogger("mindrlhf.trainer")


def _model_signature(cfg) -> dict:
    """Fields that must agree between the train and the infer nets (everything but dtypes and layout)."""
    skip = {"parallel_config", "compute_dtype", "param_init_type", "softmax_compute_type", "rotary_dtype",
            "layernorm_compute_type", "value_head_bias"}
    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name not in skip}


def check_model_configs(train_cfg, infer_cfg, train_path: str, infer_path: str) -> None:
    """The train and infer YAMLs must describe the same network."""
    train_sig, infer_sig = _model_signature(train_cfg), _model_signature(infer_cfg)
    differing = [f"{k}: {train_sig[k]!r} vs {infer_sig[k]!r}" for k in train_sig if train_sig[k] != infer_sig[k]]
    if differing:
        raise ConfigError(f"{train_path} and {infer_path} describe different models ({'; '.join(differing)}); "
                          "only dtypes and parallel_config may differ")


def check_tensor_parallel(cfg, tp: int, path: str) -> None:
    """The model's widths split over `tp`; the kv heads may also be fewer (a divisor of tp: each is replicated)."""
    from mindrlhf.models.qwen2.modeling import kv_head_shards
    from mindrlhf.parallel.layout import LayoutError

    for name in ("num_heads", "vocab_size", "intermediate_size"):
        value = getattr(cfg, name)
        if value % tp:
            raise ConfigError(f"{path}: model_config.{name}={value} is not divisible by parallel_config."
                              f"model_parallel={tp}")
    try:
        kv_head_shards(cfg.n_kv_heads, tp)
    except LayoutError as err:
        raise ConfigError(f"{path}: model_config.{err} (parallel_config.model_parallel; fewer kv heads than tp ranks "
                          "are replicated)") from None


def check_unstaged(layout, path: str, what: str) -> None:
    """Nets that only run forward have no pipeline stages."""
    if layout.pp > 1:
        raise ConfigError(f"{path}: parallel_config.pipeline_stage={layout.pp}, but {what} runs without pipeline "
                          "stages; use pipeline_stage: 1 (only the actor's train net is split into stages)")


def check_pipeline(cfg, layout, sched, rows_per_rank: int, path: str) -> None:
    """A train layout with pipeline stages: an equal share of the decoder layers for every stage, and
    `micro_batch_num` micro-batches that split each rank's rows of an update evenly (and stand for
    schedule.micro_batch_size_per_device)."""
    if layout.pp == 1:
        return
    if cfg.num_layers % layout.pp:
        raise ConfigError(f"{path}: parallel_config.pipeline_stage={layout.pp} must divide model_config.num_layers="
                          f"{cfg.num_layers} (each stage holds an equal share of the decoder layers)")
    count = cfg.parallel_config.micro_batch_num
    if rows_per_rank % count:
        raise ConfigError(f"{path}: parallel_config.micro_batch_num={count} must divide the {rows_per_rank} "
                          "responses each train rank gets per update")
    if sched.micro_batch_size_per_device:
        raise ConfigError(f"schedule.micro_batch_size_per_device={sched.micro_batch_size_per_device}: with pipeline "
                          f"stages the train micro-batches are {path}'s parallel_config.micro_batch_num; leave it 0")


def _check_micro_batch_size(sched, field: str, rows: int, whose: str) -> None:
    """`schedule.<field>` (0 = auto) must divide the `rows` it splits ("responses <whose>")."""
    size = getattr(sched, field)
    if size and rows % size:
        raise ConfigError(f"schedule.{field}={size} must divide the {rows} responses {whose}")


class RLTrainer:
    """Builds the roles, data, swap plan and checkpoints of one job and runs its steps.

    `callbacks` are called as `callback(trainer, step, metrics)` after each step (tests use them to check
    weights and the swap plan on every rank).
    """

    def __init__(self, config: GRPOConfig, job: JobOptions, tokenizer, world_size: int = 1, rank: int = 0,
                 callbacks: list[Callable] | None = None):
        import mindspore as ms

        from mindrlhf.algorithms import build_kl_controller, get_advantage_estimator
        from mindrlhf.data import PromptDataset
        from mindrlhf.models.qwen2 import Qwen2Config
        from mindrlhf.parallel import Layout
        from mindrlhf.parallel.host import HostCollectives
        from mindrlhf.parallel.swap import SwapManager

        config.validate()
        self.config, self.job, self.tokenizer = config, job, tokenizer
        self.world_size, self.rank = world_size, rank
        self.callbacks = list(callbacks or [])
        sched, gen = config.schedule, config.generation
        self.num_generations = G = gen.num_generations

        # ---- configs and layouts, all checked before anything is built or written
        train_cfg = Qwen2Config.from_yaml(job.sft_path_train)
        infer_cfg = Qwen2Config.from_yaml(job.sft_path_infer)
        check_model_configs(train_cfg, infer_cfg, job.sft_path_train, job.sft_path_infer)
        train_layout = Layout.from_config(train_cfg.parallel_config, world_size, rank,
                                          f"{job.sft_path_train}: parallel_config")
        infer_layout = Layout.from_config(infer_cfg.parallel_config, world_size, rank,
                                          f"{job.sft_path_infer}: parallel_config")
        self.train_layout, self.infer_layout = train_layout, infer_layout
        check_unstaged(infer_layout, job.sft_path_infer, "the inference net (and the reference and the reward model "
                                                         "in its layout)")
        check_pipeline(train_cfg, train_layout, sched, sched.prompts_per_update * G // train_layout.dp,
                       job.sft_path_train)
        check_tensor_parallel(train_cfg, train_layout.tp, job.sft_path_train)
        check_tensor_parallel(infer_cfg, infer_layout.tp, job.sft_path_infer)
        if sched.batch_size % infer_layout.dp:
            raise ConfigError(f"schedule.batch_size={sched.batch_size} is not divisible by the inference "
                              f"data_parallel={infer_layout.dp} ({job.sft_path_infer})")
        # prompts per evaluation call on this rank: by default the rollout's rows, so the same graphs serve both
        self.eval_batch_size = config.eval.eval_batch_size or sched.batch_size // infer_layout.dp * G
        unit = group_unit(G, train_layout.dp)
        if sched.prompts_per_update % unit:
            raise ConfigError(f"schedule.mini_batch_size: {sched.prompts_per_update} prompts x {G} generations "
                              f"per update do not split evenly over the train data_parallel="
                              f"{train_layout.dp} ({job.sft_path_train})")
        _check_micro_batch_size(sched, "micro_batch_size_per_device",
                                sched.prompts_per_update * G // train_layout.dp,
                                f"each train rank gets per update ({sched.prompts_per_update} prompts x {G} "
                                f"generations / train data_parallel={train_layout.dp})")
        _check_micro_batch_size(sched, "log_prob_micro_batch_size_per_device",
                                sched.batch_size // infer_layout.dp * G,
                                f"each inference rank generates per round ({sched.batch_size} prompts / "
                                f"inference data_parallel={infer_layout.dp} x {G} generations)")
        if len(tokenizer) > train_cfg.vocab_size:
            raise ConfigError(f"{tokenizer.source}: the tokenizer has {len(tokenizer)} "
                              f"ids but {job.sft_path_train} model_config.vocab_size is {train_cfg.vocab_size}: "
                              "tokenizer and model do not belong together")
        gen = dataclasses.replace(gen, eos_token_ids=list(tokenizer.stop_token_ids),
                                  pad_token_id=int(tokenizer.pad_token_id))
        self.generation = gen
        try:
            gen.check_model(infer_cfg.vocab_size, infer_cfg.seq_length)
            gen.check_model(train_cfg.vocab_size, train_cfg.seq_length)
        except ConfigError as err:
            raise ConfigError(f"{job.sft_path_infer}: {err}") from None
        algo = config.algorithm
        if (algo.adv_estimator == "gae") != bool(job.sft_path_critic):
            raise ConfigError("algorithm.adv_estimator: 'gae' needs a critic (--sft_path_critic)"
                              if not job.sft_path_critic else
                              f"--sft_path_critic: a critic is only used by algorithm.adv_estimator gae, not "
                              f"{algo.adv_estimator!r}")
        critic_cfg = critic_layout = None
        if job.sft_path_critic:
            critic_cfg = Qwen2Config.from_yaml(job.sft_path_critic)
            if job.load_critic_checkpoint:
                if critic_cfg.vocab_size != train_cfg.vocab_size:
                    raise ConfigError(f"{job.sft_path_critic}: model_config.vocab_size={critic_cfg.vocab_size}, but "
                                      f"the policy's is {train_cfg.vocab_size}: the critic must read the same tokens")
            else:  # the critic starts from the policy: the same network
                check_model_configs(train_cfg, critic_cfg, job.sft_path_train, job.sft_path_critic)
            critic_layout = Layout.from_config(critic_cfg.parallel_config, world_size, rank,
                                               f"{job.sft_path_critic}: parallel_config")
            check_pipeline(critic_cfg, critic_layout, sched, sched.prompts_per_update * G // critic_layout.dp,
                           job.sft_path_critic)
            check_tensor_parallel(critic_cfg, critic_layout.tp, job.sft_path_critic)
            if sched.batch_size * G % critic_layout.dp:
                raise ConfigError(f"{job.sft_path_critic}: the {sched.batch_size * G} responses of a step do not "
                                  f"split over the critic's data_parallel={critic_layout.dp}")
            unit = group_unit(G, critic_layout.dp)
            if sched.prompts_per_update % unit:
                raise ConfigError(f"schedule.mini_batch_size: {sched.prompts_per_update} prompts x {G} generations "
                                  f"per update do not split evenly over the critic data_parallel="
                                  f"{critic_layout.dp} ({job.sft_path_critic})")
        self.advantage_estimator = get_advantage_estimator(algo.adv_estimator)
        self.kl_ctrl = build_kl_controller(algo.kl_ctrl, algo.kl_coef, algo.kl_target, algo.kl_horizon) \
            if algo.use_kl_in_reward else None
        reward_cfg = self._reward_model_config(infer_cfg, infer_layout) if config.reward.reward_model_path else None
        self.reward = Reward(config, job, tokenizer, reward_cfg, infer_layout, rank)
        self.dataset = PromptDataset(job.mind_dataset_dir, sched.batch_size // infer_layout.dp,
                                     gen.pad_token_id, dp_rank=infer_layout.dp_rank,
                                     dp_size=infer_layout.dp, seed=sched.seed,
                                     length_buckets=gen.prompt_buckets)
        self.eval_set = load_eval_set(job.eval_dataset_dir, gen.prompt_buckets) if job.eval_dataset_dir else None
        self.eval_before: float | None = None
        resume_dir = find_resume_checkpoint(job.resume, job.checkpoint_dir) if job.resume else None

        if world_size > 1:
            from mindrlhf.trainer.launch import share_data_parallel_sums

            for layout in (train_layout, infer_layout, critic_layout):
                if layout is not None:
                    layout.init_groups()
            shared = share_data_parallel_sums(job.cpu_collectives, (train_layout, critic_layout), world_size, rank)
            if shared:
                logger.info("data-parallel gradient sums through shared memory (CPU, one host): %s", ", ".join(shared))
        if job.enable_compile_cache:
            ms.set_context(enable_compile_cache=True,
                           compile_cache_path=os.path.join(job.output_dir, "compile_cache", f"rank_{rank}"))

        # ---- roles: nets first (their strategy files need nothing else), then weights, optimizers, reshards
        self.actor = Actor(config, job, train_cfg, infer_cfg, train_layout, infer_layout, gen, rank)
        self.reference = Reference(config, job, infer_cfg, infer_layout, gen.temperature, rank)
        self.critic = Critic(config, job, critic_cfg, critic_layout, rank) if critic_cfg else None
        self.roles: list[Role] = [self.actor, self.reference, self.reward] + ([self.critic] if self.critic else [])
        if job.only_save_strategy:
            return
        self.actor.build()
        self.reference.build(self.actor)
        if self.critic:
            self.critic.build(self.actor)
        self.reward.build()

        self.swap = SwapManager()
        for role in self.roles:
            role.attach(self.swap)
        self.phases = Phases(self.swap, phase_plan(self.roles, PHASES))
        self.comm = HostCollectives(world_size, rank)
        self.step = 0
        if resume_dir:
            self._resume(resume_dir)
        from mindrlhf.trainer.metrics import MetricsWriter
        self.metrics_writer = MetricsWriter(job.output_dir, job.tensorboard_dir or None, enabled=rank == 0,
                                            resume_step=self.step)
        self.ckpt_writer = CheckpointWriter(job.checkpoint_dir, rank, world_size, self.comm.barrier)
        critic = f", critic layout {critic_layout}" if critic_layout else ""
        logger.info("train layout %s, infer layout %s%s, %d ranks; policy %.2fM parameters; %d prompts, global "
                    "batch %d x %d generations; roles: %s; advantages: %s", train_layout, infer_layout, critic,
                    world_size, train_cfg.num_parameters() / 1e6, self.dataset.num_samples, sched.batch_size, G,
                    ", ".join(role.name for role in self.roles), config.algorithm.adv_estimator)

    def _reward_model_config(self, infer_cfg, infer_layout):
        """The reward model's architecture (--sft_path_reward, default the inference YAML), checked against the
        policy's tokens and the inference layout it runs in."""
        from mindrlhf.models.qwen2 import Qwen2Config

        path = self.job.sft_path_reward
        if not path:
            return infer_cfg
        cfg = Qwen2Config.from_yaml(path)
        if cfg.vocab_size != infer_cfg.vocab_size:
            raise ConfigError(f"{path}: model_config.vocab_size={cfg.vocab_size}, but the policy's is "
                              f"{infer_cfg.vocab_size}: the reward model must read the same tokens")
        mine = (cfg.parallel_config.data_parallel, cfg.parallel_config.model_parallel)
        infer = (infer_layout.dp, infer_layout.tp)
        if mine != infer:
            raise ConfigError(f"{path}: parallel_config data_parallel x model_parallel = {mine[0]} x {mine[1]}, "
                              f"but the reward model runs in the inference layout ({infer[0]} x {infer[1]}, "
                              f"{self.job.sft_path_infer})")
        check_tensor_parallel(cfg, infer_layout.tp, path)
        return cfg

    # ------------------------------------------------------------------ state
    def save_strategies(self, folder: str) -> dict[str, str]:
        """Writes the strategy file of each net for this rank under `folder/<net>/`; returns the paths."""
        from mindrlhf.parallel.strategy import strategy_file_name, write_strategy_file

        paths = {}
        for role in self.roles:
            for net, layouts in role.strategies().items():
                paths[net] = write_strategy_file(os.path.join(folder, net, strategy_file_name(self.rank)), layouts,
                                                 stage=role.strategy_stage(net))
        return paths

    def _layouts_meta(self) -> dict:
        layouts = {"train": str(self.train_layout), "infer": str(self.infer_layout)}
        if self.critic:
            layouts["critic"] = str(self.critic.layout)
        return layouts

    def _rank_files(self) -> dict[str, list]:
        files = {}
        for role in self.roles:
            files.update(role.rank_files())
        return files

    def save_checkpoint(self) -> str:
        """Writes a checkpoint of the current step (every rank must call it): each role's rank files, shared
        strategy files and rank state, and the job's meta."""
        from mindrlhf.parallel.strategy import write_strategy_file

        def rank_files(folder: str) -> None:
            for name, params in self._rank_files().items():
                save_parameters(params, os.path.join(folder, name))
            state = {}
            for role in self.roles:
                state.update(role.rank_state())
            _write_json(os.path.join(folder, RANK_STATE), state)

        def shared_files(folder: str) -> None:
            for role in self.roles:
                for name, (layouts, stages) in role.shared_files().items():
                    write_strategy_file(os.path.join(folder, name), layouts, stages=stages)

        meta = {"step": self.step, "updates": self.actor.updates, "world_size": self.world_size,
                "layouts": self._layouts_meta(), "data": self.dataset.state_dict(), "config": self.config.to_dict(),
                "eval_before": self.eval_before}
        if self.critic:
            meta["critic_updates"] = self.critic.updates
        if self.kl_ctrl:
            meta["kl_ctrl"] = self.kl_ctrl.state_dict()
        path = self.ckpt_writer.save(self.step, rank_files, shared_files, meta, self.config.checkpoint.keep_last)
        logger.info("checkpoint written: %s", path)
        return path

    def _resume(self, step_dir: str) -> None:
        import json

        meta = read_meta(step_dir)
        rank_files = self._rank_files()
        check_resumable(step_dir, meta, self.world_size, self._layouts_meta(), self.config.to_dict(),
                        [*rank_files, RANK_STATE])
        folder = rank_dir(step_dir, self.rank)
        for name, params in rank_files.items():
            load_rank_params(params, os.path.join(folder, name))
        with open(os.path.join(folder, RANK_STATE), encoding="utf-8") as f:
            state = json.load(f)
        for role in self.roles:
            role.load_rank_state(state)
        self.dataset.load_state_dict(meta["data"])
        self.step, self.actor.updates = int(meta["step"]), int(meta["updates"])
        self.eval_before = meta.get("eval_before")
        if self.critic:
            self.critic.updates = int(meta["critic_updates"])
        if self.kl_ctrl:
            self.kl_ctrl.load_state_dict(meta["kl_ctrl"])
        for role in self.roles:
            role.after_resume()
        logger.info("resumed from %s (step %d)", step_dir, self.step)

    # ------------------------------------------------------------------ one step
    def _rollout(self) -> Experience:
        """One generation round for this rank's prompts, scored, with ref (and old) log-probs."""
        G = self.num_generations
        batch = self.dataset.next_batch()
        with self.phases("generate"):
            out = self.actor.generate(batch["prompt_ids"], batch["attention_mask"], progress=self.rank == 0)
        with self.phases("reward"):
            solutions = [s for s in batch["solution"] for _ in range(G)]
            rewards, terms, _ = self.reward(out.prompt_ids, out.prompt_mask, out.response_ids, out.response_mask,
                                            solutions, columns_per_completion(batch["columns"], G))
        inputs = (out.prompt_ids, out.prompt_mask, out.response_ids, out.response_mask)
        with self.phases("ref"):
            ref_logp = self.reference.log_probs(inputs)
        old_logp = out.log_probs
        if self.config.schedule.num_iterations > 1:
            with self.phases("old"):
                old_logp = self.actor.log_probs(inputs)
        mask = out.response_mask.astype(np.float32)
        columns = {"prompt_ids": out.prompt_ids, "prompt_mask": out.prompt_mask, "response_ids": out.response_ids,
                   "response_mask": out.response_mask, "old_logp": (old_logp * mask).astype(np.float32),
                   "ref_logp": (ref_logp * mask).astype(np.float32), "rewards": rewards.astype(np.float32)}
        columns.update({f"reward/{k}": np.asarray(v, np.float32) for k, v in terms.items()})
        return Experience(columns)

    def _score_tokens(self, exp: Experience) -> Experience:
        """With a critic: the `values` of every response token and the `token_rewards` GAE reads (the sequence
        reward on the last token, minus kl_coef * KL(policy || ref) per token with algorithm.use_kl_in_reward)."""
        from mindrlhf.algorithms import kl_penalty, token_level_rewards

        if self.critic is None:
            return exp
        with self.phases("values"):
            values = self.critic.values(exp, self.comm)
        kl, coef = None, 0.0
        if self.kl_ctrl is not None:
            kl = kl_penalty(exp.old_logp, exp.ref_logp, "k1") * exp.response_mask
            coef = self.kl_ctrl.value
        token_rewards = token_level_rewards(exp.rewards, exp.response_mask, kl, coef)
        return exp.with_columns(values=values, token_rewards=token_rewards)

    def _with_advantages(self, exp: Experience) -> Experience:
        """`exp` with token-level `advantages` and `returns` from the configured estimator (whole batch)."""
        advantages, returns = self.advantage_estimator(exp, self.num_generations, self.config.algorithm)
        return exp.with_columns(advantages=advantages.astype(np.float32), returns=returns.astype(np.float32))

    def _collect_experience(self) -> tuple[Experience, Experience, dict]:
        """(all generated rows, the rows to train on, sampling stats), on every rank, with advantages."""
        from mindrlhf.algorithms import dynamic_sampling_mask, expand_group_mask

        algo, G = self.config.algorithm, self.num_generations
        batch_size = self.config.schedule.batch_size
        rounds, kept_parts, all_parts = 0, [], []
        kept_groups = 0
        while True:
            local = self._rollout()
            with self.phases("gather"):
                round_exp = local.unpack(self.comm.gather_data_parallel_rows(local.pack(), self.infer_layout))
            rounds += 1
            all_parts.append(round_exp)
            if not algo.dynamic_sampling:
                kept_parts.append(round_exp)
                break
            keep = dynamic_sampling_mask(round_exp.rewards, G)
            if keep.any():
                kept_parts.append(round_exp.rows(expand_group_mask(keep, G)))
                kept_groups += int(keep.sum())
            if kept_groups >= batch_size or rounds > algo.max_sampling_retries:
                break
        pad = self.generation.pad_token_id
        generated = self._with_advantages(self._score_tokens(concat_experiences(all_parts, pad)))
        stats = {"sampling/rounds": rounds}
        if not algo.dynamic_sampling:
            return generated, generated, stats
        if not kept_parts:
            return generated, generated.rows(slice(0, 0)), {**stats, "sampling/kept_groups": 0}
        train = concat_experiences(kept_parts, pad)
        groups = min(train.num_rows // G, batch_size)
        groups -= groups % group_unit(G, self.train_layout.dp)
        train = self._with_advantages(train.rows(slice(0, groups * G))) if groups else train.rows(slice(0, 0))
        if algo.dynamic_sampling:
            stats["sampling/kept_groups"] = groups
        return generated, train, stats

    def train_one_step(self) -> dict:
        """Runs one RL step; returns its metrics (the same on every rank)."""
        start = time.perf_counter()
        self.phases.start_step()
        self.step += 1
        generated, train_exp, sampling = self._collect_experience()
        critic = {}
        if self.critic:
            with self.phases("update_critic"):
                critic = self.critic.train(train_exp, self.comm, self.num_generations)
        actor = {"actor/updates": 0}
        if self.step > (self.config.critic.critic_warmup if self.critic else 0):
            with self.phases("train"):
                actor = self.actor.train(train_exp, self.comm)
        actor.update(critic)
        if self.kl_ctrl is not None:
            actor.update(self._update_kl_controller(generated))
        sync_ref = bool(self.config.schedule.ref_model_sync_steps) and \
            self.step % self.config.schedule.ref_model_sync_steps == 0
        with self.phases("reshard", also_resident=(REF_WEIGHTS,) if sync_ref else ()):
            self.actor.sync_inference()
            if sync_ref:
                self.reference.sync_from_actor()
        elapsed = time.perf_counter() - start
        trained_tokens = int(train_exp.prompt_mask.sum() + train_exp.response_mask.sum()) * \
            self.config.schedule.num_iterations if actor["actor/updates"] else 0
        metrics = self._step_metrics(generated, actor, sampling, elapsed, trained_tokens)
        if self.job.save_data_file and self.rank == 0:
            write_experience(f"{self.job.save_data_file}.step_{self.step:06d}.mindrecord", generated)
        return metrics

    def _update_kl_controller(self, exp: Experience) -> dict:
        """Feeds the step's KL (per response, summed over its tokens, averaged over the batch) to the KL-in-reward
        controller, as verl does; returns the coefficient used this step and the KL."""
        from mindrlhf.algorithms import kl_penalty

        mask = exp.response_mask.astype(np.float64)
        kl = float((kl_penalty(exp.old_logp, exp.ref_logp, "k1") * mask).sum(axis=1).mean())
        used = self.kl_ctrl.value
        self.kl_ctrl.update(kl, exp.num_rows)
        return {"actor/reward_kl_penalty": kl, "actor/reward_kl_penalty_coeff": used}

    def _critic_metrics(self, exp: Experience) -> dict:
        from mindrlhf.algorithms import explained_variance

        valid = exp.response_mask > 0
        metrics = {}
        for name in ("values", "returns", "advantages"):
            tokens = exp[name][valid]
            metrics.update({f"critic/{name}/mean": float(tokens.mean()), f"critic/{name}/max": float(tokens.max()),
                            f"critic/{name}/min": float(tokens.min())})
        metrics["critic/vf_explained_var"] = explained_variance(exp.returns, exp["values"], exp.response_mask)
        return metrics

    def _step_metrics(self, generated: Experience, actor: dict, sampling: dict, elapsed: float,
                      trained_tokens: int) -> dict:
        from mindrlhf.algorithms import dynamic_sampling_mask

        G = self.num_generations
        rewards = generated.rewards.astype(np.float64)
        lengths = generated.response_mask.sum(axis=1)
        max_new = generated.response_mask.shape[1]
        eos = np.isin(generated.response_ids[np.arange(len(lengths)), np.maximum(lengths - 1, 0)],
                      self.generation.eos_token_ids)
        metrics = {"reward/mean": float(rewards.mean()), "reward/std": float(rewards.std())}
        with np.errstate(invalid="ignore"):  # a term may be NaN where its function had no opinion (None)
            metrics.update({f"reward/{k}": float(np.nanmean(v)) if np.isfinite(v).any() else float("nan")
                            for k, v in generated.reward_terms.items()})
        metrics["reward/frac_zero_std"] = float(1.0 - dynamic_sampling_mask(rewards, G).mean())
        metrics.update(actor)
        if self.critic:
            metrics.update(self._critic_metrics(generated))
        metrics.update({"response_length/mean": float(lengths.mean()), "response_length/max": int(lengths.max()),
                        "response_length/clip_ratio": float(((lengths == max_new) & ~eos).mean())})
        metrics.update(sampling)
        metrics.update(self.phases.step_metrics())
        metrics["timing_s/step"] = round(elapsed, 4)
        # tokens per second per device (MindSpeed-RL's e2e / update / rollout tps): the step's prompt + response
        # tokens over the step, the tokens the actor's updates read over the train phase, and the generated
        # rows' tokens over the generate phase
        tokens = int(generated.prompt_mask.sum() + lengths.sum())
        metrics["perf/tokens_per_s_per_device"] = round(tokens / self.world_size / elapsed, 2)
        for name, phase_tokens, phase in (("update", trained_tokens, "train"), ("rollout", tokens, "generate")):
            seconds = metrics.get(f"timing_s/{phase}", 0.0)
            if phase_tokens and seconds > 0:
                metrics[f"perf/{name}_tokens_per_s_per_device"] = round(phase_tokens / self.world_size / seconds, 2)
        peaks = self.comm.all_gather(np.array([peak_rss_gib()], np.float32))
        metrics["perf/max_rss_gib"] = round(float(peaks.max()), 3)
        return metrics

    def evaluate(self) -> float:
        """Greedy accuracy on every held-out prompt (`--eval_dataset_dir`), split over the infer dp ranks."""
        from mindrlhf.trainer.evaluation import count_correct

        prompts, solutions = self.eval_set
        layout = self.infer_layout
        mine = np.array_split(np.arange(len(prompts)), layout.dp)[layout.dp_rank]
        with self.phases("eval"):
            correct = count_correct(self.actor.greedy_generator(), self.tokenizer, [prompts[i] for i in mine],
                                    [solutions[i] for i in mine], self.eval_batch_size,
                                    progress=self.rank == 0)
        totals = self.comm.group_sum(np.array([correct, len(mine)]), layout.dp_group)
        return float(totals[0] / totals[1])

    def _evaluate_now(self) -> bool:
        interval = self.config.eval.eval_interval
        return self.eval_set is not None and (self.step == self.config.schedule.steps or
                                              bool(interval and self.step % interval == 0))

    def fit(self) -> list[dict]:
        """Runs the remaining steps (checkpoints every save_interval and at the end); returns their metrics.

        With an eval set: held-out accuracy before the first step, every eval_interval steps and after the
        last one (`eval/accuracy`), and a final line `held-out accuracy: before=.. after=..`."""
        sched, ckpt = self.config.schedule, self.config.checkpoint
        history = []
        if self.eval_set is not None and self.step == 0:
            start = time.perf_counter()
            self.eval_before = self.evaluate()
            self.metrics_writer.record(0, {"eval/accuracy": self.eval_before,
                                           "timing_s/eval": round(time.perf_counter() - start, 4)})
            logger.info("held-out accuracy before training: %.1f%% (%d prompts)", 100 * self.eval_before,
                        len(self.eval_set[0]))
        if self.step >= sched.steps:
            logger.info("nothing to do: the checkpoint is at step %d of %d", self.step, sched.steps)
        while self.step < sched.steps:
            metrics = self.train_one_step()
            if self._evaluate_now():
                start = time.perf_counter()
                metrics["eval/accuracy"] = self.evaluate()
                metrics["timing_s/eval"] = round(time.perf_counter() - start, 4)
            history.append(metrics)
            self.metrics_writer.write(self.step, sched.steps, metrics)
            for callback in self.callbacks:
                callback(self, self.step, metrics)
            if self.step == sched.steps or (ckpt.save_interval and self.step % ckpt.save_interval == 0):
                self.save_checkpoint()
        self.metrics_writer.close()
        if self.metrics_writer.enabled and self.metrics_writer.jsonl_path:
            from mindrlhf.trainer.plot import plot_progress

            png = os.path.join(os.path.dirname(self.metrics_writer.jsonl_path), "progress.png")
            plot_progress(self.metrics_writer.jsonl_path, png)
            logger.info("plot of reward and held-out accuracy: %s", png)
        logger.info("%s", self.swap.summary())
        if history and "eval/accuracy" in history[-1] and self.eval_before is not None:
            logger.info("held-out accuracy: before=%.1f%% after=%.1f%%", 100 * self.eval_before,
                        100 * history[-1]["eval/accuracy"])
        return history


GRPOTrainer = RLTrainer  # the GRPO configuration of the loop (algorithm.adv_estimator: grpo, the default)


def load_eval_set(path: str, prompt_buckets) -> tuple[list[list[int]], list[str]]:
    """(prompt ids, solutions) of a held-out prompt MindRecord; errors name the file."""
    from mindrlhf.data.reader import read_prompt_records

    try:
        ids, solutions = read_prompt_records(path)
    except (OSError, RuntimeError, ValueError) as err:
        raise ConfigError(f"{path}: cannot read the eval MindRecord ({str(err).splitlines()[0]})") from None
    if not ids:
        raise ConfigError(f"{path}: the eval MindRecord holds no prompt")
    longest = max(len(row) for row in ids)
    if prompt_buckets and longest > max(prompt_buckets):
        raise ConfigError(f"{path}: an eval prompt has {longest} tokens, more than the largest prompt bucket "
                          f"{max(prompt_buckets)} (generation.prompt_buckets)")
    return [row.tolist() for row in ids], solutions


def _write_json(path: str, data: dict) -> None:
    import json
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f)


EXPERIENCE_SCHEMA = {
    "prompt_ids": {"type": "int32", "shape": [-1]}, "response_ids": {"type": "int32", "shape": [-1]},
    "response_mask": {"type": "int32", "shape": [-1]}, "ref_logp": {"type": "float32", "shape": [-1]},
    "old_logp": {"type": "float32", "shape": [-1]}, "reward": {"type": "float32"},
    "advantages": {"type": "float32", "shape": [-1]}, "returns": {"type": "float32", "shape": [-1]},
}


def write_experience(path: str, exp: Experience) -> None:
    """One step's experience as MindRecord (real prompt tokens only; responses padded to the step's width)."""
    from mindrlhf.data.mindrecord import write_mindrecord_atomically

    records = []
    for i in range(exp.num_rows):
        record = {"prompt_ids": exp.prompt_ids[i][exp.prompt_mask[i].astype(bool)].astype(np.int32),
                  "reward": float(exp.rewards[i])}
        for name in ("response_ids", "response_mask"):
            record[name] = exp[name][i].astype(np.int32)
        for name in ("ref_logp", "old_logp", "advantages", "returns"):
            record[name] = exp[name][i].astype(np.float32)
        records.append(record)
    write_mindrecord_atomically(records, path, "mindrlhf experience", schema=EXPERIENCE_SCHEMA)
