"""`StepShape`, a step's batch geometry: the prompts and rows of each data-parallel rank of each layout, the rows of
an update and the updates of a pass and a step, as the plan, the memory report, the roles and the engines read
them."""
import dataclasses
import math

import pytest

from mindrlhf.configs.grpo_configs import ScheduleConfig
from mindrlhf.engine.step_shape import StepShape


def test_a_rollout_of_4_prompts_x_8_on_2_inference_ranks_and_one_train_rank():
    shape = StepShape.of(ScheduleConfig(batch_size=4), 8, infer_dp=2, train_dp=1)
    assert (shape.prompts_per_update, shape.num_iterations, shape.critic_dp) == (4, 1, 0)  # the whole batch
    assert shape.prompts_per_infer_rank == 2 and shape.rollout_rows_per_infer_rank == 16
    assert shape.rollout_rows == 32 and shape.update_rows == 32 and shape.train_update_rows_per_rank == 32
    assert shape.updates_per_pass == 1 and shape.updates_per_step == 1
    assert shape.pass_rows(2, training=False) == 16 and shape.pass_rows(1, training=True) == 32
    assert shape.critic_update_rows_per_rank == 0  # no critic


def test_mini_batches_and_passes_over_3_ranks():
    sched = ScheduleConfig(batch_size=6, mini_batch_size=2, num_iterations=2)
    shape = StepShape.of(sched, 3, infer_dp=3, train_dp=3)
    assert shape.prompts_per_infer_rank == 2 and shape.rollout_rows_per_infer_rank == 6
    assert shape.update_rows == 6 and shape.train_update_rows_per_rank == 2
    assert shape.updates_per_pass == 3 and shape.updates_per_step == 6
    assert shape.pass_rows(3, training=True) == 2 and shape.pass_rows(3, training=False) == 6
    # a rank's 6 rows of the step, in update order: its 2 rows of each of the 3 updates
    assert shape.update_slices(6, 3) == [slice(0, 2), slice(2, 4), slice(4, 6)]
    assert shape.update_slices(4, 3) == [slice(0, 2), slice(2, 4)]  # fewer rows (dynamic sampling): fewer updates


def test_a_critic_in_its_own_layout_gets_its_share_of_each_update():
    shape = StepShape.of(ScheduleConfig(batch_size=8, mini_batch_size=4), 2, infer_dp=2, train_dp=4)
    critic = shape.with_critic(2)
    assert critic.critic_dp == 2 and shape.critic_dp == 0  # a new shape: the plan's is frozen
    assert critic.train_update_rows_per_rank == 2 and critic.critic_update_rows_per_rank == 4
    assert critic.update_rows_per_rank(8) == 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        shape.critic_dp = 2


def test_the_shape_gives_the_numbers_the_sites_computed_before_it():
    """The expressions the plan, the memory report, the roles, the data reader and the rollout each wrote out."""
    for batch, mini, passes, group, infer_dp, train_dp in ((4, 0, 1, 8, 2, 1), (6, 2, 2, 3, 3, 3), (8, 4, 1, 2, 2, 4),
                                                           (16, 8, 3, 4, 4, 2), (1, 1, 1, 1, 1, 1)):
        sched = ScheduleConfig(batch_size=batch, mini_batch_size=mini, num_iterations=passes, steps=7)
        shape = StepShape.of(sched, group, infer_dp, train_dp)
        assert shape.prompts_per_infer_rank == sched.batch_size // infer_dp
        assert shape.rollout_rows_per_infer_rank == sched.batch_size // infer_dp * group
        assert shape.update_rows == sched.prompts_per_update * group
        assert shape.train_update_rows_per_rank == sched.prompts_per_update * group // train_dp
        for training in (True, False):
            prompts = sched.prompts_per_update if training else sched.batch_size
            assert shape.pass_rows(train_dp, training) == prompts * group // train_dp
        assert 7 * shape.updates_per_step == 7 * passes * math.ceil(batch / sched.prompts_per_update)


def test_an_uneven_last_mini_batch_still_counts_as_an_update():
    assert StepShape(batch_size=5, prompts_per_update=2, num_iterations=1, group_size=2, infer_dp=1,
                     train_dp=1).updates_per_pass == 3
