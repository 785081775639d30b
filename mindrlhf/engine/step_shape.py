"""`StepShape`: a step's batch geometry, computed in one place. The plan (`JobPlan.shape`), the memory report, the
roles and the training engines read it; pure arithmetic (the plan checks that the splits are even).

Rows are responses: a step generates `group_size` responses to each of `batch_size` prompts, spread over the
inference data-parallel ranks; each pass over them makes one optimizer update per `prompts_per_update` prompts,
each train (or critic) data-parallel rank taking its share of every update.
"""
from __future__ import annotations

import dataclasses
import math

from mindrlhf.engine.batches import update_slices


@dataclasses.dataclass(frozen=True)
class StepShape:
    """The prompts and rows of one step on each data-parallel rank of each layout (`critic_dp` 0: no critic)."""

    batch_size: int  # prompts a step (schedule.batch_size)
    prompts_per_update: int  # prompts an optimizer update (schedule.prompts_per_update)
    num_iterations: int  # passes over the step's rows (schedule.num_iterations)
    group_size: int  # responses a prompt (generation.num_generations)
    infer_dp: int
    train_dp: int
    critic_dp: int = 0

    @classmethod
    def of(cls, schedule, group_size: int, infer_dp: int, train_dp: int, critic_dp: int = 0) -> StepShape:
        """The shape of `schedule` (a `ScheduleConfig`) with `group_size` responses a prompt over these dp sizes."""
        return cls(schedule.batch_size, schedule.prompts_per_update, schedule.num_iterations, group_size, infer_dp,
                   train_dp, critic_dp)

    def with_critic(self, critic_dp: int) -> StepShape:
        """The same shape with a critic of `critic_dp` data-parallel ranks."""
        return dataclasses.replace(self, critic_dp=critic_dp)

    @property
    def prompts_per_infer_rank(self) -> int:
        """Prompts an inference rank generates for in a step (its prompt batch, its prefill's prompts)."""
        return self.batch_size // self.infer_dp

    @property
    def rollout_rows_per_infer_rank(self) -> int:
        """Responses an inference rank generates in a step."""
        return self.prompts_per_infer_rank * self.group_size

    @property
    def rollout_rows(self) -> int:
        """Responses of a step, on all ranks."""
        return self.batch_size * self.group_size

    @property
    def update_rows(self) -> int:
        """Responses of one optimizer update, on all ranks."""
        return self.prompts_per_update * self.group_size

    def update_rows_per_rank(self, dp: int) -> int:
        """Responses a rank of a layout with `dp` data-parallel ranks gets per update."""
        return self.update_rows // dp

    @property
    def train_update_rows_per_rank(self) -> int:
        return self.update_rows_per_rank(self.train_dp)

    @property
    def critic_update_rows_per_rank(self) -> int:
        return self.update_rows_per_rank(self.critic_dp) if self.critic_dp else 0

    def pass_rows(self, dp: int, training: bool) -> int:
        """Responses a rank of a `dp`-rank layout reads in one pass: an update's (`training`) or the rollout's."""
        return (self.update_rows if training else self.rollout_rows) // dp

    @property
    def updates_per_pass(self) -> int:
        return math.ceil(self.batch_size / self.prompts_per_update)

    @property
    def updates_per_step(self) -> int:
        """Optimizer updates a trained net makes in a step: every pass's mini-batches."""
        return self.num_iterations * self.updates_per_pass

    def update_slices(self, rows_per_rank: int, dp: int) -> list[slice]:
        """A rank's runs of its `rows_per_rank` rows (in update order), one per update of a pass
        (`batches.update_slices`)."""
        return update_slices(rows_per_rank, self.prompts_per_update, self.group_size, dp)
