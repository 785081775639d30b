"""One step's rollout: generate, score, reference (and old-policy) log-probs, values, advantages, and the rows each
trained role takes on this rank (`StepBatch`).

Two paths, chosen once by the plan (`JobPlan.rollout_rows_stay`): each rank keeps the rows it generated and only
their statistics are gathered (the metrics' and the updates' counts), or the whole rollout is gathered (dynamic
sampling, a critic, KL in the reward, an experience file, layouts that place ranks differently) and every rank
keeps its share of each trained role's rows.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mindrlhf.algorithms import (
    dynamic_sampling_mask,
    expand_group_mask,
    get_advantage_estimator,
    kl_penalty,
    token_level_rewards,
)
from mindrlhf.data.experience import Experience, concat_experiences, trained_tokens
from mindrlhf.engine.batches import RankRows, group_unit
from mindrlhf.engine.sizing import RESPONSE_COLUMNS
from mindrlhf.generation.trajectories import call_counts
from mindrlhf.reward import columns_per_completion
from mindrlhf.reward.rules import take_answer_check_timeouts
from mindrlhf.trainer.metrics import row_statistics, token_count


def tool_columns(out) -> dict[str, np.ndarray]:
    """The experience columns of a multi-turn rollout (`GenerationOutput` with a tool mask): `loss_mask`, the model's
    own tokens (what the policy trains), and per response its turns and how its tool calls went."""
    counts = [call_counts(calls) for calls in out.tool_calls]
    tool_turns = (np.diff(out.tool_mask, axis=1, prepend=0) == 1).sum(axis=1)
    columns = {"loss_mask": out.model_mask,
               "num_turns": (1 + tool_turns).astype(np.int32)}
    for name in ("calls", "errors", "timeouts", "truncated"):
        columns[f"tool/{name}"] = np.array([c[name] for c in counts], np.int32)
    return columns


@dataclass(frozen=True)
class StepBatch:
    """What one step trains on and reports, the same on both paths: `rows`, per-row statistics of every generated
    row of the step (`metrics.row_statistics`, on every rank); `generated`, every generated row this rank holds
    (the whole rollout when it was gathered, `gathered`; else this rank's own); `rank_rows`, each trained role's rows
    on this rank (`RankRows`) by role name; `trained_tokens`, the prompt and response tokens of the rows trained on;
    `sampling`, the sampling rounds' metrics; `decode_rows`, this rank's rollouts' decode rows (computed, idle);
    `answer_check_timeouts`, this rank's answer checks by meaning that ran past their time limit; `tool_seconds`, this
    rank's rollouts' seconds in tool calls."""

    rows: Experience
    generated: Experience
    gathered: bool
    rank_rows: dict[str, RankRows]
    trained_tokens: int
    sampling: dict
    decode_rows: tuple[int, int]
    answer_check_timeouts: int = 0
    tool_seconds: float = 0.0


class ExperienceMaker:
    """Makes each step's `StepBatch` for one rank of the planned job, from its prompt `dataset` and its roles."""

    def __init__(self, plan, dataset, actor, reference, critic, reward, comm, phases, kl_ctrl=None):
        self.plan, self.config, self.generation = plan, plan.config, plan.generation
        self.dataset, self.actor, self.reference, self.critic, self.reward = dataset, actor, reference, critic, reward
        self.comm, self.phases, self.kl_ctrl = comm, phases, kl_ctrl
        self.train_layout, self.infer_layout = plan.actor.train.layout, plan.actor.infer.layout
        self.advantage_estimator = get_advantage_estimator(self.config.algorithm.adv_estimator)
        self._decode_rows = np.zeros(2, np.int64)
        self._answer_timeouts = 0
        self._tool_seconds = 0.0  # this step's rollouts' seconds in tool calls (timing/tools)

    def make(self) -> StepBatch:
        """The step's batch, with advantages (see the module doc for its two paths)."""
        self._decode_rows = np.zeros(2, np.int64)
        self._answer_timeouts = 0
        self._tool_seconds = 0.0
        take_answer_check_timeouts()  # the held-out evaluation's are not this step's
        if self.plan.rollout_rows_stay:
            return self._own_rows()
        generated, train, sampling = self._gathered_rows()
        update_rows = self.plan.shape.update_rows
        rank_rows = {"actor": RankRows.of_batch(train, self.train_layout.dp, self.train_layout.dp_rank, update_rows,
                                                trained_tokens(train))}
        if self.critic:
            rank_rows["critic"] = RankRows.of_batch(train, self.critic.layout.dp, self.critic.layout.dp_rank,
                                                    update_rows, trained_tokens(train))
        eos = self.generation.eos_token_ids
        rows = row_statistics(generated, eos)
        # dynamic sampling trains on some of the generated rows only
        train_rows = rows if train is generated else row_statistics(train, eos)
        return StepBatch(rows, generated, True, rank_rows, token_count(train_rows), sampling,
                         self._decode_rows_seen(), self._answer_timeouts, self._tool_seconds)

    def _own_rows(self) -> StepBatch:
        own = self._with_advantages(self._rollout())
        with self.phases("gather"):  # the per-row statistics only: the metrics' and the updates' counts
            packed = row_statistics(own, self.generation.eos_token_ids)
            rows = packed.unpack(self.comm.gather_data_parallel_rows(packed.pack(), self.infer_layout))
        layout = self.train_layout
        batch_positions = np.arange(layout.dp_rank * own.num_rows, (layout.dp_rank + 1) * own.num_rows)
        lengths = rows["response_length"].reshape(layout.dp, -1)
        trained = rows["model_length"].reshape(layout.dp, -1) if "model_length" in rows else None
        share = RankRows(own, lengths, batch_positions) if trained is None else \
            RankRows(own, trained, batch_positions, lengths)
        return StepBatch(rows, own, False, {"actor": share}, token_count(rows), {"sampling/rounds": 1},
                         self._decode_rows_seen(), self._answer_timeouts, self._tool_seconds)

    def _decode_rows_seen(self) -> tuple[int, int]:
        return int(self._decode_rows[0]), int(self._decode_rows[1])

    def _rollout(self) -> Experience:
        """One generation round for this rank's prompts, scored, with ref (and old) log-probs."""
        group_size = self.plan.shape.group_size
        batch = self.dataset.next_batch()
        with self.phases("generate"):
            out = self.actor.generate(batch["prompt_ids"], batch["attention_mask"], progress=self.plan.rank == 0)
        self._decode_rows += (out.stats["computed_rows"], out.stats["idle_rows"])
        inputs = {name: getattr(out, name) for name in RESPONSE_COLUMNS}
        columns = columns_per_completion(batch["columns"], group_size)
        tools = tool_columns(out) if out.tool_mask is not None else {}
        if tools:
            self._tool_seconds += out.stats["tool_seconds"]
            columns["tool_calls"] = out.tool_calls
        with self.phases("reward"):
            solutions = [s for s in batch["solution"] for _ in range(group_size)]
            scores = self.reward.score({**inputs, **tools}, solutions, columns)
            self._answer_timeouts += take_answer_check_timeouts()
        ref_logp = None
        if self.reference:
            with self.phases("ref"):
                ref_logp = self.reference.log_probs(inputs)
        old_logp = out.log_probs
        if self.config.schedule.num_iterations > 1:
            with self.phases("old"):
                old_logp = self.actor.log_probs(inputs)
        mask = out.response_mask.astype(np.float32)
        columns = {**inputs, **tools, "old_logp": (old_logp * mask).astype(np.float32)}
        if ref_logp is not None:
            columns["ref_logp"] = (ref_logp * mask).astype(np.float32)
        columns["rewards"] = scores.total.astype(np.float32)
        columns.update({f"reward/{k}": np.asarray(v, np.float32) for k, v in scores.terms.items()})
        return Experience(columns)

    def _score_tokens(self, exp: Experience) -> Experience:
        """With a critic: the `values` of every response token and the `token_rewards` GAE reads (the sequence
        reward on the last token, minus kl_coef * KL(policy || ref) per token with algorithm.use_kl_in_reward)."""
        if self.critic is None:
            return exp
        with self.phases("values"):
            values = self.critic.values(exp)
        kl, coef = None, 0.0
        if self.kl_ctrl is not None:  # on the model's own tokens (a tool's answer is no action of the policy)
            kl = kl_penalty(exp.old_logp, exp.ref_logp, "k1") * exp[trained_tokens(exp)]
            coef = self.kl_ctrl.value
        token_rewards = token_level_rewards(exp.rewards, exp.response_mask, kl, coef)
        return exp.with_columns(values=values, token_rewards=token_rewards)

    def _with_advantages(self, exp: Experience) -> Experience:
        """`exp` with token-level `advantages` and `returns` from the configured estimator (whole batch)."""
        advantages, returns = self.advantage_estimator(exp, self.plan.shape.group_size, self.config.algorithm)
        return exp.with_columns(advantages=advantages.astype(np.float32), returns=returns.astype(np.float32))

    def _gathered_rows(self) -> tuple[Experience, Experience, dict]:
        """(all generated rows, the rows to train on, sampling stats), on every rank, with advantages."""
        algo, group_size = self.config.algorithm, self.plan.shape.group_size
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
        stats["sampling/kept_groups"] = groups
        return generated, train, stats
