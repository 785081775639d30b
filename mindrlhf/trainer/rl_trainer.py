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

import json
import logging
import os
import time
from collections.abc import Callable

import numpy as np

from mindrlhf.algorithms import (
    build_kl_controller,
    dynamic_sampling_mask,
    expand_group_mask,
    get_advantage_estimator,
    kl_penalty,
    token_level_rewards,
)
from mindrlhf.checkpoint.step import (
    RANK_STATE,
    CheckpointError,
    CheckpointWriter,
    check_resumable,
    find_resume_checkpoint,
    rank_dir,
    read_meta,
    role_states,
    save_parameters,
)
from mindrlhf.checkpoint.weights import load_rank_params
from mindrlhf.data.mindrecord import write_mindrecord_atomically
from mindrlhf.data.reader import PromptDataset
from mindrlhf.engine.batches import RankRows, group_unit
from mindrlhf.engine.sizing import RESPONSE_COLUMNS
from mindrlhf.parallel.array_collectives import ArrayCollectives
from mindrlhf.parallel.strategy import strategy_file_name, write_strategy_file
from mindrlhf.parallel.swap import SwapManager
from mindrlhf.reward import columns_per_completion
from mindrlhf.reward.rules import accuracy_reward
from mindrlhf.trainer.evaluation import score_greedy
from mindrlhf.trainer.experience import Experience, StepBatch, concat_experiences
from mindrlhf.trainer.metrics import (
    MetricsWriter,
    critic_metrics,
    length_metrics,
    memory_metrics,
    rollout_rank_metrics,
    row_statistics,
    score_metrics,
    throughput_metrics,
    token_count,
)
from mindrlhf.trainer.phases import PHASES, Phases, peak_rss_gib
from mindrlhf.trainer.plan import JobPlan
from mindrlhf.trainer.plot import plot_progress
from mindrlhf.trainer.roles import Actor, Critic, Reference, Reward, Role
from mindrlhf.trainer.specs import REF_WEIGHTS, phase_plan

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
        self.advantage_estimator = get_advantage_estimator(algo.adv_estimator)
        self.kl_ctrl = build_kl_controller(algo.kl_ctrl, algo.kl_coef, algo.kl_target, algo.kl_horizon) \
            if algo.use_kl_in_reward else None
        self._load_data()
        self.eval_before: float | None = None
        resume_dir = find_resume_checkpoint(job.resume, job.checkpoint_dir) if job.resume else None
        self._create_roles()
        if job.only_save_strategy:
            return
        self._build_engines(host_sums or {})
        self.step = 0
        self.decode_rows = np.zeros(2)  # this step's rollouts' decode rows on this rank: computed, idle
        if resume_dir:
            self._resume(resume_dir)
        self.metrics_writer = MetricsWriter(job.output_dir, job.tensorboard_dir or None, enabled=self.rank == 0,
                                            resume_step=self.step)
        self.ckpt_writer = CheckpointWriter(job.checkpoint_dir, self.rank, self.world_size, self.comm.barrier)
        self._log_job()

    def _load_data(self) -> None:
        sched, gen, layout = self.config.schedule, self.generation, self.infer_layout
        self.dataset = PromptDataset(self.job.mind_dataset_dir, sched.batch_size // layout.dp, gen.pad_token_id,
                                     dp_rank=layout.dp_rank, dp_size=layout.dp, seed=sched.seed,
                                     length_buckets=gen.prompt_buckets)

    def _create_roles(self) -> None:
        """The roles' nets (their strategy files need nothing else)."""
        plan = self.plan
        self.reward = Reward(plan.reward, self.tokenizer)
        self.actor = Actor(plan.actor, self.tokenizer.completion)
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
        self.reward.build()
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
        def rank_files(folder: str) -> None:
            for name, params in self._rank_files().items():
                save_parameters(params, os.path.join(folder, name))
            _write_json(os.path.join(folder, RANK_STATE), {role.name: role.state_dict() for role in self.roles})

        def shared_files(folder: str) -> None:
            for role in self.roles:
                for name, (layouts, stages) in role.shared_files().items():
                    write_strategy_file(os.path.join(folder, name), layouts, stages=stages)

        meta = {"step": self.step, "world_size": self.world_size, "layouts": self._layouts_meta(),
                "data": self.dataset.state_dict(), "config": self.config.to_dict(), "eval_before": self.eval_before}
        if self.kl_ctrl:
            meta["kl_ctrl"] = self.kl_ctrl.state_dict()
        path = self.ckpt_writer.save(self.step, rank_files, shared_files, meta, self.config.checkpoint.keep_last)
        logger.info("checkpoint written: %s", path)
        return path

    def _resume(self, step_dir: str) -> None:
        meta = read_meta(step_dir)
        rank_files = self._rank_files()
        check_resumable(step_dir, meta, self.world_size, self._layouts_meta(), self.config.to_dict(),
                        [*rank_files, RANK_STATE])
        folder = rank_dir(step_dir, self.rank)
        failure = None
        try:
            for name, params in rank_files.items():
                load_rank_params(params, os.path.join(folder, name))
            self._load_role_states(os.path.join(folder, RANK_STATE), meta)
        except (OSError, ValueError) as err:  # CheckpointError is a ValueError
            failure = err if isinstance(err, CheckpointError) else \
                CheckpointError(f"{folder}: not readable ({err})")
        # every rank reads its own files: the ranks agree on the outcome before going on, so that one rank's damaged
        # file ends every rank here at once (a rank that went on would wait in the first step's collectives for a
        # peer that is gone, and MindSpore's scheduler would wait out its heartbeat)
        failed = int(self.comm.world_sum(np.array([failure is not None], np.float32))[0])
        if failure is not None:
            raise failure
        if failed:
            raise CheckpointError(f"{step_dir}: {failed} other rank(s) could not read their files of this checkpoint "
                                  "(their logs name them)")
        self.dataset.load_state_dict(meta["data"])
        self.step = int(meta["step"])
        self.eval_before = meta.get("eval_before")
        if self.kl_ctrl:
            self.kl_ctrl.load_state_dict(meta["kl_ctrl"])
        for role in self.roles:
            role.after_resume()
        logger.info("resumed from %s (step %d)", step_dir, self.step)

    def _load_role_states(self, path: str, meta: dict) -> None:
        """Each role's state from this rank's `RANK_STATE` file."""
        with open(path, encoding="utf-8") as f:
            saved = json.load(f)
        try:  # an earlier form of the file takes its counts from the meta (`role_states`)
            states = role_states(saved, meta)
            for role in self.roles:
                role.load_state_dict(states.get(role.name, {}))
        except (KeyError, TypeError) as err:
            raise CheckpointError(f"{path}: not the state this job saves (no {err} for its roles "
                                  f"{[role.name for role in self.roles]})") from None

    # ------------------------------------------------------------------ one step
    def _rollout(self) -> Experience:
        """One generation round for this rank's prompts, scored, with ref (and old) log-probs."""
        group_size = self.num_generations
        batch = self.dataset.next_batch()
        with self.phases("generate"):
            out = self.actor.generate(batch["prompt_ids"], batch["attention_mask"], progress=self.rank == 0)
        stats = self.actor.generator.last_stats
        self.decode_rows += (stats["computed_rows"], stats["idle_rows"])
        with self.phases("reward"):
            solutions = [s for s in batch["solution"] for _ in range(group_size)]
            rewards, terms, _ = self.reward(out.prompt_ids, out.prompt_mask, out.response_ids, out.response_mask,
                                            solutions, columns_per_completion(batch["columns"], group_size))
        inputs = {name: getattr(out, name) for name in RESPONSE_COLUMNS}
        ref_logp = None
        if self.reference:
            with self.phases("ref"):
                ref_logp = self.reference.log_probs(inputs)
        old_logp = out.log_probs
        if self.config.schedule.num_iterations > 1:
            with self.phases("old"):
                old_logp = self.actor.log_probs(inputs)
        mask = out.response_mask.astype(np.float32)
        columns = {**inputs, "old_logp": (old_logp * mask).astype(np.float32)}
        if ref_logp is not None:
            columns["ref_logp"] = (ref_logp * mask).astype(np.float32)
        columns["rewards"] = rewards.astype(np.float32)
        columns.update({f"reward/{k}": np.asarray(v, np.float32) for k, v in terms.items()})
        return Experience(columns)

    def _score_tokens(self, exp: Experience) -> Experience:
        """With a critic: the `values` of every response token and the `token_rewards` GAE reads (the sequence
        reward on the last token, minus kl_coef * KL(policy || ref) per token with algorithm.use_kl_in_reward)."""
        if self.critic is None:
            return exp
        with self.phases("values"):
            values = self.critic.values(exp)
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

    def _collect_experience(self) -> StepBatch:
        """The step's batch, with advantages: each rank keeps the rows it generated when it trains on them
        (`JobPlan.rollout_rows_stay`); otherwise every rank gathers the rollout and keeps its rows of each trained
        role."""
        if self.plan.rollout_rows_stay:
            own = self._with_advantages(self._rollout())
            with self.phases("gather"):  # the per-row statistics only: the metrics' and the updates' counts
                packed = row_statistics(own, self.generation.eos_token_ids)
                rows = packed.unpack(self.comm.gather_data_parallel_rows(packed.pack(), self.infer_layout))
            layout = self.train_layout
            batch_positions = np.arange(layout.dp_rank * own.num_rows, (layout.dp_rank + 1) * own.num_rows)
            share = RankRows(own, rows["response_length"].reshape(layout.dp, -1), batch_positions)
            return StepBatch(rows, None, {"actor": share}, token_count(rows), {"sampling/rounds": 1})
        generated, train, sampling = self._gather_experience()
        update_rows = self.config.schedule.prompts_per_update * self.num_generations
        rank_rows = {"actor": RankRows.of_batch(train, self.train_layout.dp, self.train_layout.dp_rank, update_rows)}
        if self.critic:
            rank_rows["critic"] = RankRows.of_batch(train, self.critic.layout.dp, self.critic.layout.dp_rank,
                                                 update_rows)
        rows = row_statistics(generated, self.generation.eos_token_ids)
        # dynamic sampling trains on some of the generated rows only
        train_rows = rows if train is generated else row_statistics(train, self.generation.eos_token_ids)
        return StepBatch(rows, generated, rank_rows, token_count(train_rows), sampling)

    def _gather_experience(self) -> tuple[Experience, Experience, dict]:
        """(all generated rows, the rows to train on, sampling stats), on every rank, with advantages."""
        algo, group_size = self.config.algorithm, self.num_generations
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
            keep = dynamic_sampling_mask(round_exp.rewards, group_size)
            if keep.any():
                kept_parts.append(round_exp.rows(expand_group_mask(keep, group_size)))
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
        groups = min(train.num_rows // group_size, batch_size)
        groups -= groups % group_unit(group_size, self.train_layout.dp)
        train = self._with_advantages(train.rows(slice(0, groups * group_size))) if groups else train.rows(slice(0, 0))
        if algo.dynamic_sampling:
            stats["sampling/kept_groups"] = groups
        return generated, train, stats

    def train_one_step(self) -> dict:
        """Runs one RL step; returns its metrics (the same on every rank)."""
        start = time.perf_counter()
        self.phases.start_step()
        self.decode_rows = np.zeros(2)
        self.step += 1
        batch = self._collect_experience()
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
        with self.phases("reshard", also_resident=(REF_WEIGHTS,) if sync_ref else ()):
            self.actor.sync_inference()
            if sync_ref:
                self.reference.sync_from_actor()
        elapsed = time.perf_counter() - start
        trained_tokens = batch.trained_tokens * self.config.schedule.num_iterations if actor["actor/updates"] else 0
        metrics = self._step_metrics(batch, actor, elapsed, trained_tokens)
        if self.job.save_data_file and self.rank == 0:
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

    def _step_metrics(self, batch: StepBatch, actor: dict, elapsed: float, trained_tokens: int) -> dict:
        """The step's metrics (docs/metrics.md): scores and lengths of every generated row, the actor's (and
        critic's) update statistics, sampling rounds, phase times and memory, throughput."""
        rows = batch.rows
        metrics = score_metrics(rows.rewards, rows.reward_terms, self.num_generations)
        metrics.update(actor)
        if self.critic:
            generated = batch.generated
            metrics.update(critic_metrics(generated["values"], generated.returns, generated.advantages,
                                          generated.response_mask))
        metrics.update(length_metrics(rows))
        metrics.update(batch.sampling)
        metrics.update(self.phases.step_metrics())
        metrics["timing/step"] = round(elapsed, 4)
        metrics.update(throughput_metrics(token_count(rows), trained_tokens, self.world_size, metrics))
        own = np.array([peak_rss_gib(), self.phases.seconds.get("generate", 0.0), *self.decode_rows], np.float32)
        ranks = self.comm.all_gather(own).reshape(-1, own.size)
        metrics.update(memory_metrics(ranks[:, 0]))
        metrics.update(rollout_rank_metrics(ranks[:, 1], ranks[:, 2], ranks[:, 3]))
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
        with self.phases("eval"):
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


def _write_json(path: str, data: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f)


EXPERIENCE_SCHEMA = {
    "prompt_ids": {"type": "int32", "shape": [-1]}, "response_ids": {"type": "int32", "shape": [-1]},
    "response_mask": {"type": "int32", "shape": [-1]}, "ref_logp": {"type": "float32", "shape": [-1]},
    "old_logp": {"type": "float32", "shape": [-1]}, "reward": {"type": "float32"},
    "advantages": {"type": "float32", "shape": [-1]}, "returns": {"type": "float32", "shape": [-1]},
}


def write_experience(path: str, exp: Experience) -> None:
    """One step's experience as MindRecord (real prompt tokens only; responses padded to the step's width; no
    `ref_logp` in a job without a reference model)."""
    per_token = [name for name in ("ref_logp", "old_logp", "advantages", "returns") if name in exp]
    records = []
    for i in range(exp.num_rows):
        record = {"prompt_ids": exp.prompt_ids[i][exp.prompt_mask[i].astype(bool)].astype(np.int32),
                  "reward": float(exp.rewards[i])}
        for name in ("response_ids", "response_mask"):
            record[name] = exp[name][i].astype(np.int32)
        for name in per_token:
            record[name] = exp[name][i].astype(np.float32)
        records.append(record)
    schema = {name: field for name, field in EXPERIENCE_SCHEMA.items() if name != "ref_logp" or "ref_logp" in exp}
    write_mindrecord_atomically(records, path, "mindrlhf experience", schema=schema)
