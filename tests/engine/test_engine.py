"""The engines under the roles (`mindrlhf.engine`): batch arithmetic, micro-batch sizing, the forward engine's
passes and the training engine's update loop (skips, stops, empty batches) for the actor and the critic alike."""
import mindspore as ms
import numpy as np
import pytest
from support.experience import make_experience, with_critic_columns
from support.fake_engines import ACTOR_INPUTS, CRITIC_INPUTS, role_with_engine
from support.paths import ARITH, MODEL_CONFIGS

from mindrlhf.configs.grpo_configs import GRPOConfig
from mindrlhf.engine.batches import (
    RankRows,
    group_unit,
    prompt_micro_batches,
    prompt_run,
    response_widths,
    rows_of_rank,
    rows_of_updates,
    trimmed_width,
    update_slices,
)
from mindrlhf.engine.forward import ForwardEngine
from mindrlhf.engine.sizing import MicroBatchSizer
from mindrlhf.engine.step_shape import StepShape
from mindrlhf.engine.train import NonFiniteUpdates, total_updates
from mindrlhf.parallel.layout import Layout
from mindrlhf.trainer.roles import Actor, Critic, update_policy


def test_update_slices_and_rank_rows():
    # one rank: runs of whole updates, the last one shorter
    assert update_slices(rows_per_rank=12, groups_per_update=2, group_size=3, dp_size=1) == [slice(0, 6),
                                                                                             slice(6, 12)]
    assert update_slices(6, 2, 2, 1) == [slice(0, 4), slice(4, 6)]
    # two ranks: each rank's run is half an update (3 of a 2 x 3-row update), whatever the group boundaries
    assert update_slices(6, 2, 3, 2) == [slice(0, 3), slice(3, 6)]
    assert update_slices(0, 2, 3, 2) == []
    with pytest.raises(ValueError, match="an update of 1 prompts x 3 responses cannot be split evenly over "
                                         "data_parallel=2"):
        update_slices(6, 1, 3, 2)
    assert rows_of_rank(8, 2, 1) == slice(4, 8)
    with pytest.raises(ValueError, match="6 rows cannot be split evenly over data_parallel=4"):
        rows_of_rank(6, 4, 0)
    assert group_unit(4, 2) == 1 and group_unit(3, 2) == 2 and group_unit(2, 8) == 4
    assert type(group_unit(4, 2)) is int  # it reaches the metrics as sampling/kept_groups: JSON takes no numpy int


def grouped_rows(groups, group_size, prompt_width=6, seed=0):
    """(prompt ids, prompt mask) of `groups` distinct left-padded prompts, each repeated for its `group_size`
    responses (rows j G .. j G + G - 1), as a rollout lays them out."""
    exp = make_experience(groups, prompt_width, 3, seed=seed)
    return np.repeat(exp.prompt_ids, group_size, 0), np.repeat(exp.prompt_mask, group_size, 0)


def test_a_prompt_run_never_crosses_a_group_boundary():
    assert prompt_run(8, 0, 32) == 8  # whole groups: a prompt read once for its 8 responses
    assert prompt_run(4, 0, 32) == 4  # never more than a group
    assert prompt_run(8, 4, 8) == 4  # a dp rank's rows that start mid-group
    assert prompt_run(8, 2, 6) == 2
    assert prompt_run(8, 0, 7) == 1  # a run divides the rows
    assert prompt_run(1, 0, 32) == 1
    assert prompt_run(6, 12, 18) == 6 and prompt_run(6, 3, 9) == 3


def test_prompt_micro_batches_give_each_call_its_prompts_once_per_share():
    ids, mask = grouped_rows(2, 4)
    response = np.arange(8 * 3).reshape(8, 3)
    per_row = np.arange(8, dtype=np.float32)
    calls = prompt_micro_batches(dict(prompt_ids=ids, prompt_mask=mask, response_ids=response, rewards=per_row),
                                 size=4, share=2)
    assert len(calls) == 2
    for call, start in zip(calls, (0, 4)):
        assert [t.shape for t in call] == [(2, 6), (2, 6), (4, 3), (4,)]
        np.testing.assert_array_equal(call[0].asnumpy(), ids[start:start + 4:2])
        np.testing.assert_array_equal(call[1].asnumpy(), mask[start:start + 4:2])
        np.testing.assert_array_equal(call[2].asnumpy(), response[start:start + 4])
        np.testing.assert_array_equal(call[3].asnumpy(), per_row[start:start + 4])
    # the prompt columns are known by name, wherever a cell takes them; a name may come twice (a loss without a
    # reference reads the old log-probs in the reference's place)
    reordered = prompt_micro_batches(dict(response_ids=response, prompt_mask=mask), size=4, share=2)
    assert [t.shape for t in reordered[0]] == [(4, 3), (2, 6)]
    twice = prompt_micro_batches(dict(prompt_mask=mask, rewards=per_row), 4, 2, names=["rewards", "prompt_mask",
                                                                                       "rewards"])
    assert [t.shape for t in twice[1]] == [(4,), (2, 6), (4,)]
    np.testing.assert_array_equal(twice[1][2].asnumpy(), per_row[4:])
    with pytest.raises(ValueError, match="3 responses a prompt do not divide micro-batches of 4"):
        prompt_micro_batches(dict(prompt_ids=ids, prompt_mask=mask, response_ids=response), size=4, share=3)


def responses_of_length(rows, longest, width=48):
    """Response ids and mask [rows, width] whose longest response has `longest` tokens."""
    lengths = np.minimum(np.arange(rows) % longest + 1, longest)
    lengths[0] = longest
    mask = (np.arange(width)[None] < lengths[:, None]).astype(np.int32)
    return np.where(mask > 0, 7, 0).astype(np.int32), mask


@pytest.mark.parametrize("configured,share_prompts,longest,plan", [
    (0, True, 48, (16, 8, 48)),  # auto: every row in one call, each prompt read once for its 8 responses
    (0, False, 48, (16, 1, 48)),
    (4, True, 48, (4, 4, 48)),  # a set size: the prompt read once for the 4 responses of a call
    (2, True, 20, (2, 2, 32)),  # responses of at most 20 tokens: 32 of the 48 positions are read
    (0, True, 16, (16, 8, 16)),
])
def test_the_sizer_plans_calls_prompt_reads_and_width(configured, share_prompts, longest, plan):
    from mindrlhf.configs.grpo_configs import ScheduleConfig
    from mindrlhf.models.qwen2 import Qwen2Config

    cfg = Qwen2Config.from_yaml(ARITH / "train.yaml")
    sched = ScheduleConfig(micro_batch_size_per_device=configured, share_prompts=share_prompts)
    sizer = MicroBatchSizer.for_pass("train", sched, cfg, Layout(), 8, training=True)
    ids, mask = grouped_rows(2, 8, prompt_width=160)
    response, response_mask = responses_of_length(16, longest)
    per_token, per_row = np.ones((16, 48), np.float32), np.arange(16, dtype=np.float32)
    arrays = dict(prompt_ids=ids, prompt_mask=mask, response_ids=response, response_mask=response_mask,
                  advantages=per_token, rewards=per_row)
    assert sizer.plan(arrays) == plan
    calls = sizer.split(arrays)
    size, share, width = plan
    assert len(calls) == 16 // size
    assert [t.shape for t in calls[0]] == [(size // share, 160), (size // share, 160), (size, width), (size, width),
                                           (size, width), (size,)]
    assert sizer.plan(arrays, width=48)[2] == 48  # a caller's width (the update's on every dp rank) wins


def test_an_auto_log_prob_call_on_cpu_fits_its_graphs_kept_memory_in_the_budget():
    """SmolLM2's shape, a step's 32 responses (72 + 96 tokens), 1 GiB: 16 rows' activations fit (0.99 GiB) but
    their compiled graph keeps 0.76 GiB more on CPU (`GRAPH_MEMORY`), so a CPU call takes 8; Ascend's graphs keep
    nothing of their own, and a train call's auto size does not change."""
    from mindrlhf.configs.grpo_configs import ScheduleConfig
    from mindrlhf.engine.memory_plan import Call, NetShape, forward_graph_bytes
    from mindrlhf.models.qwen2 import Qwen2Config

    cfg = Qwen2Config.from_yaml(MODEL_CONFIGS / "smollm2" / "infer.yaml")
    ids, mask = grouped_rows(4, 8, prompt_width=72)
    response, response_mask = responses_of_length(32, 96, width=96)
    arrays = dict(prompt_ids=ids, prompt_mask=mask, response_ids=response, response_mask=response_mask)
    sizes = {device: MicroBatchSizer.for_pass("log_prob", ScheduleConfig(), cfg, Layout(), 8, training=False,
                                              device=device).plan(arrays)[0] for device in ("cpu", "ascend")}
    assert sizes == {"cpu": 8, "ascend": 16}
    kept = forward_graph_bytes(NetShape.of(cfg), Call(2, 16, 72, 96))
    assert 0.7 * 2**30 < kept < 0.8 * 2**30
    train = {device: MicroBatchSizer.for_pass("train", ScheduleConfig(), cfg, Layout(), 8, training=True,
                                              device=device).plan(arrays)[0] for device in ("cpu", "ascend")}
    assert train["cpu"] == train["ascend"]


def test_the_sizer_shares_a_prompt_only_within_the_group_the_rows_start_in():
    from mindrlhf.configs.grpo_configs import ScheduleConfig
    from mindrlhf.models.qwen2 import Qwen2Config

    cfg = Qwen2Config.from_yaml(ARITH / "train.yaml")
    sizer = MicroBatchSizer.for_pass("train", ScheduleConfig(), cfg, Layout(), 8, training=True)
    ids, mask = grouped_rows(2, 8, prompt_width=16)
    response, response_mask = responses_of_length(16, 16)
    arrays = dict(prompt_ids=ids, prompt_mask=mask, response_ids=response, response_mask=response_mask)
    assert sizer.plan(arrays)[:2] == (16, 8)
    middle = {name: a[4:12] for name, a in arrays.items()}  # the second half of group 0 and the first of group 1
    assert sizer.plan(middle, first_row=4)[:2] == (8, 4)
    calls = sizer.split(middle, first_row=4)
    np.testing.assert_array_equal(calls[0][0].asnumpy(), ids[[4, 8]])


def test_a_pass_reads_the_narrowest_width_that_holds_its_responses_and_pads_its_outputs_back():
    from mindrlhf.configs.grpo_configs import ScheduleConfig
    from mindrlhf.models.qwen2 import Qwen2Config

    assert response_widths(48, 3) == [16, 32, 48]
    assert response_widths(1024, 3) == [344, 688, 1024]
    assert response_widths(48, 1) == [48] and response_widths(10, 4) == [8, 10]
    assert trimmed_width(20, [16, 32, 48]) == 32 and trimmed_width(0, [16, 32, 48]) == 16
    assert trimmed_width(48, [16, 32, 48]) == 48 and trimmed_width(16, [16, 32, 48]) == 16

    cfg = Qwen2Config.from_yaml(ARITH / "train.yaml")
    sizer = MicroBatchSizer.for_pass("log_prob", ScheduleConfig(log_prob_micro_batch_size_per_device=4), cfg,
                                     Layout(), 8, training=False)
    ids, prompt_mask = grouped_rows(1, 8, prompt_width=12)
    response, response_mask = responses_of_length(8, 11)  # 16 of 48 positions hold every response
    seen = []

    class Cell:
        INPUTS = ("prompt_ids", "prompt_mask", "response_ids", "response_mask")

        def __call__(self, prompt_ids, prompt_mask, response_ids, response_mask):
            seen.append((prompt_ids.shape, response_ids.shape))
            return ms.Tensor(response_ids.asnumpy().astype(np.float32) + 1)

    columns = {"prompt_ids": ids, "prompt_mask": prompt_mask, "response_ids": response, "response_mask": response_mask}
    out = ForwardEngine(Cell(), sizer).run(columns)
    assert seen == [((1, 12), (4, 16))] * 2
    assert out.shape == (8, 48)
    np.testing.assert_array_equal(out[:, :16], response[:, :16] + 1)
    assert not out[:, 16:].any()  # zeros where the pass read nothing: padding after every response


def test_the_auto_size_counts_a_shared_prompt_once():
    from mindrlhf.configs.grpo_configs import ScheduleConfig
    from mindrlhf.models.qwen2 import Qwen2Config

    cfg = Qwen2Config.from_yaml(ARITH / "train.yaml")
    ids, mask = grouped_rows(1, 8, prompt_width=160)
    response, response_mask = responses_of_length(8, 48)
    arrays = dict(prompt_ids=ids, prompt_mask=mask, response_ids=response, response_mask=response_mask)
    plans = {}
    for share in (True, False):
        # a budget that holds the prompt once with 8 responses but not 8 copies of it
        sched = ScheduleConfig(share_prompts=share, activation_memory_gib=0.09)
        plans[share] = MicroBatchSizer.for_pass("train", sched, cfg, Layout(), 8, training=True).plan(arrays)
    assert plans[True] == (8, 8, 48) and plans[False] == (2, 1, 48)


@pytest.mark.parametrize("role_class,name,inputs,outputs", [
    (Actor, "actor", ACTOR_INPUTS, ("loss", "pg_loss", "kl_loss", "pg_clipfrac", "ratio_mean", "ppo_kl", "entropy")),
    (Critic, "critic", CRITIC_INPUTS, ("vf_loss", "vf_clipfrac")),
])
def test_skipped_updates_are_counted_left_out_of_the_means_and_stop_the_job_when_they_repeat(
        role_class, name, inputs, outputs):
    exp = with_critic_columns(make_experience(8, 3, 4))  # 4 groups of 2: 4 updates of one group each
    role = role_with_engine(role_class, name, [0.5, np.nan, 1.5, np.inf], 2, inputs, outputs)
    metrics = role.train(RankRows.of_batch(exp, 1, 0, exp.num_rows))
    assert metrics[f"{name}/skipped_updates"] == 2 and metrics[f"{name}/updates"] == 2
    # the finite updates only
    assert metrics[f"{name}/grad_norm"] == 1.0 and metrics[f"{name}/{outputs[0]}"] == 1.0
    assert role.engine.updates == 4 and role.engine.consecutive_skips == 1
    state = role.engine.state_dict()  # what a checkpoint keeps: a resumed run counts the skip before it
    assert state == {"updates": 4, "consecutive_skips": 1}
    resumed = role_with_engine(role_class, name, [np.nan, 1.0, 1.0, 1.0], 2, inputs, outputs)
    resumed.engine.load_state_dict(state)
    with pytest.raises(NonFiniteUpdates, match=f"2 {name} updates in a row had a non-finite loss or gradient"):
        resumed.train(RankRows.of_batch(exp, 1, 0, exp.num_rows))
    assert resumed.engine.updates == 5  # the learning-rate schedule goes on from the checkpoint's position
    role = role_with_engine(role_class, name, [0.5, np.nan, np.nan, 1.0], 2, inputs, outputs)
    with pytest.raises(NonFiniteUpdates, match=f"2 {name} updates in a row had a non-finite loss or gradient"):
        role.train(RankRows.of_batch(exp, 1, 0, exp.num_rows))
    role = role_with_engine(role_class, name, [np.nan] * 4, 0, inputs, outputs)  # 0: never stop
    assert role.train(RankRows.of_batch(exp, 1, 0, exp.num_rows))[f"{name}/skipped_updates"] == 4


@pytest.mark.parametrize("role_class,name,inputs", [(Actor, "actor", ACTOR_INPUTS),
                                                    (Critic, "critic", CRITIC_INPUTS)])
def test_an_empty_batch_makes_no_update_in_either_role(role_class, name, inputs):
    exp = with_critic_columns(make_experience(8, 3, 4)).rows(slice(0, 0))
    role = role_with_engine(role_class, name, [], 2, inputs, ("loss",))
    assert role.train(RankRows.of_batch(exp, 1, 0, update_rows=2)) == {f"{name}/updates": 0}
    assert role.engine.updates == 0


def test_the_engine_hands_the_loss_net_the_columns_it_declares_with_the_updates_token_weights():
    from mindrlhf.algorithms import aggregation_weights

    exp = with_critic_columns(make_experience(8, 3, 4))
    seen = []
    role = role_with_engine(Critic, "critic", [1.0] * 4, 2, CRITIC_INPUTS, ("vf_loss",), seen)
    role.train(RankRows.of_batch(exp, 1, 0, exp.num_rows))
    assert len(seen) == 4
    first = exp.rows(slice(0, 2))
    for got, name in zip(seen[0], CRITIC_INPUTS[:-1]):
        np.testing.assert_array_equal(got, first[name], err_msg=name)
    np.testing.assert_array_equal(seen[0][-1], aggregation_weights(first.response_mask, role.engine.policy.aggregation))


def test_a_data_parallel_rank_updates_on_its_share_of_each_update_with_the_whole_updates_weights_and_width():
    """Rank 1 of 2 of an 8-row batch whose updates are one 2-response prompt each: it holds rows 1, 3, 5, 7 (its
    half of each update, `rows_of_updates`). The loss weights of its row are the whole update's weights at that row,
    and it reads as many positions as the update's longest response, on either rank."""
    from support.fake_engines import fake_engine

    from mindrlhf.algorithms import aggregation_weights

    exp = with_critic_columns(make_experience(8, 3, 6, seed=3))
    seen, widths = [], []
    _, engine = fake_engine("critic", [1.0] * 4, 2, CRITIC_INPUTS, ("vf_loss",), seen)
    engine.layout = Layout(dp=2, rank=1)
    engine.shape = StepShape(batch_size=4, prompts_per_update=1, num_iterations=1, group_size=2, infer_dp=2,
                             train_dp=2)
    engine.sizer.width = lambda mask, longest=None: widths.append(longest) or mask.shape[1]
    share = RankRows.of_batch(exp, 2, 1, update_rows=2)
    assert share.batch_rows.tolist() == [1, 3, 5, 7] and share.rows.num_rows == 4
    lengths = exp.response_mask.sum(axis=1)
    np.testing.assert_array_equal(share.row_tokens, [lengths[[0, 2, 4, 6]], lengths[[1, 3, 5, 7]]])
    engine.update(share)
    assert widths == [max(lengths[2 * c], lengths[2 * c + 1]) for c in range(4)]
    for c, inputs in enumerate(seen):
        whole = aggregation_weights(exp.response_mask[[2 * c, 2 * c + 1]], engine.policy.aggregation)
        np.testing.assert_array_equal(inputs[-1], whole[1:].astype(np.float32))
        np.testing.assert_array_equal(inputs[2], exp.response_ids[[2 * c + 1]])


def test_each_layout_makes_the_same_updates_of_the_same_rows():
    """Update c is rows [c U, (c + 1) U) whatever the dp; a rank holds its share of each, in update order."""
    assert rows_of_updates(8, 4, 2, 1).tolist() == [2, 3, 6, 7]
    assert rows_of_updates(8, 4, 1, 0).tolist() == list(range(8))
    assert rows_of_updates(6, 4, 2, 0).tolist() == [0, 1, 4]  # the last update is shorter
    assert rows_of_updates(0, 4, 2, 0).size == 0
    whole = sorted(row for rank in range(4) for row in rows_of_updates(16, 8, 4, rank))
    assert whole == list(range(16))


def test_the_learning_rate_schedule_spans_every_update_of_the_run():
    config = GRPOConfig().replace({"schedule": {"batch_size": 8, "mini_batch_size": 2, "steps": 5,
                                                "num_iterations": 2}})
    shape = StepShape.of(config.schedule, 8, 1, 1)
    assert total_updates(shape, config.schedule.steps) == 5 * 2 * 4  # steps x passes x mini-batches a pass
    policy = update_policy(config.optimizer, config.schedule, shape, config.loss.aggregation, 1e-3, 2, 1.0)
    assert [policy.lr.at(u) for u in range(3)] == [5e-4, 1e-3, 1e-3]


@pytest.mark.parametrize("recompute,budget,size", [({}, 2, 2), ({"recompute": True}, 2, 4), ({}, 3, 4),
                                                    ({"recompute": True}, 3, 8), ({"select_recompute": True}, 3, 4)])
def test_recomputed_layers_let_the_sizer_take_larger_calls(recompute, budget, size):
    """Qwen2.5-0.5B's shape, a 256-token prompt and 8 responses of 64 under a 2 or 3 GiB activation budget: full
    recompute of every layer frees most of a layer's train-call bytes (`memory_budget.FULL_RECOMPUTE_FREES`,
    measured), so twice the responses of a prompt go into one call (all 8 at 3 GiB); attention-only recompute
    frees little on CPU (`SELECTIVE_RECOMPUTE_FREES`) and changes no call here."""
    import dataclasses

    from mindrlhf.configs.grpo_configs import ScheduleConfig
    from mindrlhf.configs.recompute import RecomputeConfig
    from mindrlhf.models.qwen2 import Qwen2Config

    cfg = dataclasses.replace(Qwen2Config.from_yaml(MODEL_CONFIGS / "qwen2_5" / "qwen2_5_0_5b.yaml"),
                              recompute=RecomputeConfig(**recompute))
    sizer = MicroBatchSizer.for_pass("train", ScheduleConfig(activation_memory_gib=budget, share_prompts=True), cfg,
                                     Layout(), 8, training=True)
    ids, response = np.ones((8, 256), np.int32), np.ones((8, 64), np.int32)
    columns = dict(prompt_ids=ids, prompt_mask=ids, response_ids=response, response_mask=response)
    assert sizer.plan(columns) == (size, size, 64)


def test_a_pass_over_pairs_keeps_each_pair_in_one_call():
    """call_unit 2 (a preference pair's answers): the auto size is a multiple of it, and a set size that is not is
    refused in one line."""
    from mindrlhf.configs.grpo_configs import ScheduleConfig
    from mindrlhf.models.qwen2 import Qwen2Config

    cfg = Qwen2Config.from_yaml(ARITH / "train.yaml")
    ids, mask = grouped_rows(4, 2, prompt_width=160)
    response, response_mask = responses_of_length(8, 48)
    columns = dict(prompt_ids=ids, prompt_mask=mask, response_ids=response, response_mask=response_mask)
    tight = ScheduleConfig(activation_memory_gib=0.05)
    size, share, _ = MicroBatchSizer.for_pass("train", tight, cfg, Layout(), 2, training=True, call_unit=2).plan(
        columns)
    assert size % 2 == 0 and share == 2
    odd = MicroBatchSizer.for_pass("train", ScheduleConfig(micro_batch_size_per_device=3), cfg, Layout(), 2,
                                   training=True, call_unit=2)
    with pytest.raises(ValueError, match="train: calls of 3 rows would split the 2 rows that must stay together"):
        odd.plan(columns)
