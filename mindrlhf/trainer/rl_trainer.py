"""`RLTrainer`: one loop over the roles of the job (:mod:`mindrlhf.trainer.roles`), on the same ranks in
their own layouts. The algorithm (GRPO, PPO, ...) is a config choice, not a subclass.

One step (each block is a phase, see :mod:`mindrlhf.trainer.phases`)::

    generate  actor's infer net (infer layout): num_generations samples for this dp rank's prompts
    reward    rule rewards
    ref       reference net (infer layout): log-probs of the sampled tokens (only with a KL term: no reference
              net at all when loss.beta is 0 and algorithm.use_kl_in_reward is off, `JobPlan.uses_reference`)
    old       actor's infer net: old-policy log-probs (only when num_iterations > 1)
    gather    (no model resident) when every rank trains on the rows it generated (`JobPlan.rollout_rows_stay`:
              the same data-parallel places in both layouts, one update a pass, group advantages, no critic, no
              dynamic sampling),
              only each response's statistics (score, lengths: the metrics and the updates' counts); otherwise
              the whole experience, every rank then keeping its train share
    values    PPO: the critic's value of every response token (critic layout); token rewards (minus the KL
              penalty with algorithm.use_kl_in_reward)
              advantages and returns (`algorithm.adv_estimator`) on the host: over a rank's own prompt groups, or
              the whole batch when it was gathered
    update_critic  PPO: the critic's clipped value-loss updates
    train     num_iterations passes of mini-batch updates on the actor's train net (train layout): each rank's
              share of each mini-batch, the loss normalised over the whole mini-batch (from step
              critic.critic_warmup + 1 with a critic)
    reshard   actor train -> infer every step, train -> ref every ref_model_sync_steps
"""
from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

import numpy as np

from mindrlhf.algorithms import build_kl_controller, kl_penalty
from mindrlhf.checkpoint.coordinator import CheckpointCoordinator, write_strategies
from mindrlhf.checkpoint.step import find_resume_checkpoint
from mindrlhf.data.experience import Experience, trained_tokens, write_experience
from mindrlhf.data.reader import PromptDataset
from mindrlhf.parallel.array_collectives import ArrayCollectives
from mindrlhf.parallel.swap import SwapManager
from mindrlhf.reward.rules import accuracy_reward
from mindrlhf.trainer.completions import CompletionsLog
from mindrlhf.trainer.evaluation import score_greedy
from mindrlhf.trainer.experience_maker import ExperienceMaker, StepBatch
from mindrlhf.trainer.metrics import (
    MetricsWriter,
    critic_metrics,
    length_metrics,
    memory_metrics,
    rollout_rank_metrics,
    score_metrics,
    throughput_metrics,
    token_count,
    tool_metrics,
)
from mindrlhf.trainer.phases import PHASES, Phases, peak_rss_gib
from mindrlhf.trainer.plan import JobPlan
from mindrlhf.trainer.plot import plot_progress
from mindrlhf.trainer.roles import Actor, Critic, Reference, Reward, Role, tool_turns_of
from mindrlhf.trainer.specs import phase_plan
from mindrlhf.utils.agreement import agreed

logger = logging.getLogger("mindrlhf.trainer")


class RLTrainer:
    """Builds the roles, data, swap plan and checkpoints of one planned job (`JobPlan`: configs and layouts, all
    checked) and runs its steps.

    `host_sums` maps a data-parallel group name to its shared-memory gradient sums (`mindrlhf.parallel.host_setup`;
    empty: MindSpore's AllReduce). `callbacks` are called as `callback(trainer, step, metrics)` after each step
    (tests use them to check weights and the swap plan on every rank).
    """

    def __init__(self, plan: JobPlan, tokenizer, host_sums: dict | None = None,
                 callbacks: list[Callable] | None = None):
        self.plan, self.config, self.job, self.tokenizer = plan, plan.config, plan.job, tokenizer
        self.world_size, self.rank = plan.world_size, plan.rank
        self.callbacks = list(callbacks or [])
        self.generation, self.eval_batch_size = plan.generation, plan.eval_batch_size
        self.num_generations = self.generation.num_generations
        self.train_layout, self.infer_layout = plan.actor.train.layout, plan.actor.infer.layout
        algo, job = self.config.algorithm, self.job
        self.kl_ctrl = build_kl_controller(algo.kl_ctrl, algo.kl_coef, algo.kl_target, algo.kl_horizon) \
            if algo.use_kl_in_reward else None
        self._load_data()
        self.eval_before: float | None = None
        self.step = 0
        resume_dir = find_resume_checkpoint(job.resume, job.checkpoint_dir) if job.resume else None
        self._create_roles()
        if job.only_save_strategy:
            return
        self._build_engines(host_sums or {})
        self.checkpoints = CheckpointCoordinator(self.roles, job.checkpoint_dir, self.rank, self.world_size,
                                                 self.comm.failed_ranks, self._layouts_meta(), self.config.to_dict())
        self.experience = ExperienceMaker(plan, self.dataset, self.actor, self.reference, self.critic, self.reward,
                                          self.comm, self.phases, self.kl_ctrl)
        if resume_dir:
            self._resume(resume_dir)
        with agreed(self.comm.failed_ranks, "opening the metrics"):
            self.metrics_writer = MetricsWriter(job.output_dir, job.tensorboard_dir or None, enabled=self.rank == 0,
                                                resume_step=self.step)
            self.completions_log = CompletionsLog(job.output_dir, job.log_completions and self.rank == 0, self.step)
        self._log_job()

    def _load_data(self) -> None:
        sched, gen, layout = self.config.schedule, self.generation, self.infer_layout
        self.dataset = PromptDataset(self.job.mind_dataset_dir, self.plan.shape.prompts_per_infer_rank,
                                     gen.pad_token_id, dp_rank=layout.dp_rank, dp_size=layout.dp, seed=sched.seed,
                                     length_buckets=gen.prompt_buckets)

    def _create_roles(self) -> None:
        """The roles' nets (their strategy files need nothing else)."""
        plan = self.plan
        self.reward = Reward(plan.reward, self.tokenizer)
        self.actor = Actor(plan.actor, self.tokenizer.completion, tool_turns_of(plan.actor, self.tokenizer))
        self.reference = Reference(plan.reference) if plan.reference else None
        self.critic = Critic(plan.critic) if plan.critic else None
        self.roles: list[Role] = [role for role in (self.actor, self.reference, self.reward, self.critic) if role]

    def _build_engines(self, host_sums: dict) -> None:
        """Weights, engines and reshards of every role, then the swap plan of the phases."""
        self.comm = ArrayCollectives(self.world_size, self.rank)
        self.actor.build(self.comm, host_sums.get(self.train_layout.dp_group))
        if self.reference:
            self.reference.build(self.actor)
        if self.critic:
            self.critic.build(self.actor, self.comm, host_sums.get(self.critic.layout.dp_group))
        self.reward.build(self.comm.failed_ranks)
        self.swap = SwapManager()
        for role in self.roles:
            role.attach(self.swap)
        self.phases = Phases(self.swap, phase_plan(self.roles, PHASES))

    def _log_job(self) -> None:
        plan, sched = self.plan, self.config.schedule
        critic = f", critic layout {plan.critic.net.layout}" if plan.critic else ""
        logger.info("train layout %s, infer layout %s%s, %d ranks; policy %.2fM parameters; %d prompts, global "
                    "batch %d x %d generations; roles: %s; advantages: %s", self.train_layout, self.infer_layout,
                    critic, self.world_size, plan.actor.train.model.num_parameters() / 1e6, self.dataset.num_samples,
                    sched.batch_size, self.num_generations, ", ".join(role.name for role in self.roles),
                    self.config.algorithm.adv_estimator)
        for net, cfg in (("train net", plan.actor.train.model), ("critic", plan.critic and plan.critic.net.model)):
            if cfg is not None and cfg.memory_features():
                logger.info("%s memory features: %s", net, cfg.memory_features())

    # ------------------------------------------------------------------ state
    def save_strategies(self, folder: str) -> dict[str, str]:
        """Writes the strategy file of each net for this rank under `folder/<net>/`; returns the paths."""
        return write_strategies(self.roles, folder, self.rank)

    def _layouts_meta(self) -> dict:
        layouts = {"train": str(self.train_layout), "infer": str(self.infer_layout)}
        if self.critic:
            layouts["critic"] = str(self.critic.layout)
        return layouts

    def save_checkpoint(self) -> str:
        """Writes a checkpoint of the current step (every rank must call it): the roles' state and the loop's (data
        position, the held-out score before training, the KL controller)."""
        loop = {"data": self.dataset.state_dict(), "eval_before": self.eval_before}
        if self.kl_ctrl:
            loop["kl_ctrl"] = self.kl_ctrl.state_dict()
        return self.checkpoints.save(self.step, loop, self.config.checkpoint.keep_last)

    def _resume(self, step_dir: str) -> None:
        meta = self.checkpoints.restore(step_dir)
        self.dataset.load_state_dict(meta["data"])
        self.step = int(meta["step"])
        self.eval_before = meta.get("eval_before")
        if self.kl_ctrl:
            self.kl_ctrl.load_state_dict(meta["kl_ctrl"])
        logger.info("resumed from %s (step %d)", step_dir, self.step)

    # ------------------------------------------------------------------ one step
    def train_one_step(self) -> dict:
        """Runs one RL step; returns its metrics (the same on every rank)."""
        start = time.perf_counter()
        self.phases.start_step()
        self.step += 1
        batch = self.experience.make()
        critic = {}
        if self.critic:
            with self.phases("update_critic"):
                critic = self.critic.train(batch.rank_rows["critic"])
        actor = {"actor/updates": 0}
        if self.step > (self.config.critic.critic_warmup if self.critic else 0):
            with self.phases("train"):
                actor = self.actor.train(batch.rank_rows["actor"])
        actor.update(critic)
        if self.kl_ctrl is not None:
            actor.update(self._update_kl_controller(batch.generated))
        sync_ref = bool(self.reference and self.config.schedule.ref_model_sync_steps) and \
            self.step % self.config.schedule.ref_model_sync_steps == 0
        with self.phases("reshard"):
            self.actor.sync_inference()
        if sync_ref:
            with self.phases("sync_ref"):
                self.reference.sync_from_actor(self.actor)
        elapsed = time.perf_counter() - start
        updated_tokens = batch.trained_tokens * self.config.schedule.num_iterations if actor["actor/updates"] else 0
        metrics = self._step_metrics(batch, actor, elapsed, updated_tokens)
        if self.job.log_completions:  # an agreement is a collective: none on steps that write nothing
            with agreed(self.comm.failed_ranks, "writing the step's completions"):
                self.completions_log.write(self.step, batch.generated, self.tokenizer)
        if self.job.save_data_file:
            with agreed(self.comm.failed_ranks, "writing the step's experience"):
                if self.rank == 0:
                    write_experience(f"{self.job.save_data_file}.step_{self.step:06d}.mindrecord", batch.generated)
        return metrics

    def _update_kl_controller(self, exp: Experience) -> dict:
        """Feeds the step's KL (per response, summed over its tokens, averaged over the batch) to the KL-in-reward
        controller, as verl does; returns the coefficient used this step and the KL."""
        mask = exp.response_mask.astype(np.float64)
        kl = float((kl_penalty(exp.old_logp, exp.ref_logp, "k1") * mask).sum(axis=1).mean())
        used = self.kl_ctrl.value
        self.kl_ctrl.update(kl, exp.num_rows)
        return {"actor/reward_kl_penalty": kl, "actor/reward_kl_penalty_coeff": used}

    def _step_metrics(self, batch: StepBatch, actor: dict, elapsed: float, updated_tokens: int) -> dict:
        """The step's metrics (docs/metrics.md): scores and lengths of every generated row, the actor's (and
        critic's) update statistics, sampling rounds, phase times and memory, throughput."""
        rows = batch.rows
        metrics = score_metrics(rows.rewards, rows.reward_terms, self.num_generations)
        metrics.update(actor)
        if self.critic:
            generated = batch.generated
            metrics.update(critic_metrics(generated["values"], generated.returns, generated.advantages,
                                          generated[trained_tokens(generated)]))
        metrics.update(length_metrics(rows))
        metrics.update(batch.sampling)
        metrics.update(self.phases.step_metrics())
        metrics["timing/step"] = round(elapsed, 4)
        metrics.update(throughput_metrics(token_count(rows), updated_tokens, self.world_size, metrics))
        own = np.array([peak_rss_gib(), self.phases.seconds.get("generate", 0.0), *batch.decode_rows,
                        batch.answer_check_timeouts, batch.tool_seconds], np.float32)
        ranks = self.comm.all_gather(own).reshape(-1, own.size)
        metrics.update(memory_metrics(ranks[:, 0]))
        metrics.update(rollout_rank_metrics(ranks[:, 1], ranks[:, 2], ranks[:, 3]), **tool_metrics(rows, ranks[:, 5]))
        # the ranks that own rows scored them (tensor-parallel peers scored the same rows again)
        metrics["reward/answer_check_timeouts"] = int(ranks[self.infer_layout.row_owners(), 4].sum())
        return metrics

    def evaluate(self) -> dict[str, float]:
        """Greedy scores on every held-out prompt (`--eval_dataset_file`), split over the infer dp ranks: the
        accuracy, and the share of answers each other rule reward of the job (`fn(completions, solutions)`, e.g.
        `format`, `hash_format`) gives."""
        prompts, solutions = self.plan.eval_set
        layout = self.infer_layout
        my_prompts = np.array_split(np.arange(len(prompts)), layout.dp)[layout.dp_rank]
        rules = self.reward.rules
        scorers = {"accuracy": accuracy_reward}
        if rules is not None:
            scorers.update((name, fn) for name, fn, trl_form in zip(rules.names, rules.functions, rules.trl_form)
                           if not trl_form and name not in scorers)
        with self.phases("eval"), agreed(self.comm.failed_ranks, "the held-out evaluation"):
            sums = score_greedy(self.actor.greedy_generator(), self.tokenizer, [prompts[i] for i in my_prompts],
                                [solutions[i] for i in my_prompts], self.eval_batch_size, scorers,
                                progress=self.rank == 0)
        totals = self.comm.group_sum(np.array([*sums.values(), len(my_prompts)]), layout.dp_group)
        return {name: float(total / totals[-1]) for name, total in zip(sums, totals)}

    def _eval_metrics(self) -> dict[str, float]:
        """`evaluate()` as metrics: `eval/<score>` and its `timing/eval`."""
        start = time.perf_counter()
        metrics = {f"eval/{name}": value for name, value in self.evaluate().items()}
        metrics["timing/eval"] = round(time.perf_counter() - start, 4)
        return metrics

    def _evaluate_now(self) -> bool:
        interval = self.config.eval.eval_interval
        return self.plan.eval_set is not None and (self.step == self.config.schedule.steps or
                                              bool(interval and self.step % interval == 0))

    def fit(self) -> list[dict]:
        """Runs the remaining steps (checkpoints every save_interval and at the end); returns their metrics.

        With an eval set: held-out accuracy before the first step, every eval_interval steps and after the
        last one (`eval/accuracy`), and a final line `held-out accuracy: before=.. after=..`."""
        sched, ckpt = self.config.schedule, self.config.checkpoint
        history = []
        if self.plan.eval_set is not None and self.step == 0:
            scores = self._eval_metrics()
            self.eval_before = scores["eval/accuracy"]
            with agreed(self.comm.failed_ranks, "writing the held-out scores"):
                self.metrics_writer.record(0, scores)
            others = "".join(f"; {name[len('eval/'):]} {100 * value:.1f}%" for name, value in scores.items()
                             if name.startswith("eval/") and name != "eval/accuracy")
            logger.info("held-out accuracy before training: %.1f%% (%d prompts%s)", 100 * self.eval_before,
                        len(self.plan.eval_set[0]), others)
        if self.step >= sched.steps:
            logger.info("nothing to do: the checkpoint is at step %d of %d", self.step, sched.steps)
        while self.step < sched.steps:
            metrics = self.train_one_step()
            if self._evaluate_now():
                metrics.update(self._eval_metrics())
            history.append(metrics)
            # rank 0 writes them: a full disk there stops every rank here, not in the next step's collectives
            with agreed(self.comm.failed_ranks, "writing the step's metrics"):
                self.metrics_writer.write(self.step, sched.steps, metrics)
            for callback in self.callbacks:
                callback(self, self.step, metrics)
            if self.step == sched.steps or (ckpt.save_interval and self.step % ckpt.save_interval == 0):
                self.save_checkpoint()
        self.metrics_writer.close()
        if self.metrics_writer.enabled and self.metrics_writer.jsonl_path:
            png = os.path.join(os.path.dirname(self.metrics_writer.jsonl_path), "progress.png")
            plot_progress(self.metrics_writer.jsonl_path, png)
            logger.info("plot of reward and held-out accuracy: %s", png)
        logger.info("%s", self.swap.summary())
        if history and "eval/accuracy" in history[-1] and self.eval_before is not None:
            logger.info("held-out accuracy: before=%.1f%% after=%.1f%%", 100 * self.eval_before,
                        100 * history[-1]["eval/accuracy"])
        return history
