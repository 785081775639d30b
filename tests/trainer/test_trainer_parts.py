"""Host-side pieces of the trainer: experience packing, phases and swap plans, checkpoint picking, host set-up."""
import json
import logging
import os
import resource
import subprocess
import sys

import mindspore as ms
import numpy as np
import pytest
from support.experience import make_experience
from support.msrun import run_worker
from support.paths import TINY

from mindrlhf.checkpoint.step import (
    CheckpointError,
    CheckpointWriter,
    check_resumable,
    complete_checkpoints,
    find_resume_checkpoint,
    save_parameters,
)
from mindrlhf.data.experience import Experience, concat_experiences
from mindrlhf.parallel.swap import SwapError, SwapManager
from mindrlhf.trainer.phases import PHASES, Phases
from mindrlhf.trainer.roles import Role
from mindrlhf.trainer.specs import INFER_WEIGHTS, OPTIMIZER_MOMENTS, REF_WEIGHTS, TRAIN_WEIGHTS


def assert_same(a: Experience, b: Experience):
    assert list(a) == list(b)
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)
        assert a[name].dtype == b[name].dtype, name


def test_experience_is_a_table_of_named_columns():
    exp = make_experience(4, 3, 5)
    assert exp.num_rows == 4 and "advantages" in exp and exp.advantages is exp["advantages"]
    assert set(exp.reward_terms) == {"accuracy"}
    values = np.ones((4, 5), np.float32)
    with_values = exp.with_columns(values=values)
    assert with_values.values is values and "values" not in exp  # a column may be called "values"
    np.testing.assert_array_equal(with_values.rows(np.array([True, False, True, False])).values, values[:2])
    with pytest.raises(AttributeError, match="no column 'returns'"):
        exp.returns  # noqa: B018
    with pytest.raises(ValueError, match="different row counts"):
        exp.with_columns(values=values[:3])
    with pytest.raises(ValueError, match="cannot concatenate"):
        concat_experiences([exp, with_values], 0)


def test_pack_unpack_round_trips_exactly_including_large_token_ids():
    exp = make_experience(6, 5, 7)
    packed = exp.pack()
    assert packed.dtype == np.float32 and packed.shape == (6, 5 * 2 + 7 * 5 + 2)
    assert_same(exp.unpack(packed), exp)
    # rows of another rank (as after a gather) unpack with the same layout
    assert_same(exp.unpack(np.concatenate([packed, packed])), concat_experiences([exp, exp], 0))


def test_concat_left_pads_narrower_prompts():
    a, b = make_experience(2, 3, 4, seed=1), make_experience(2, 6, 4, seed=2)
    both = concat_experiences([a, b], pad_token_id=0)
    assert both.prompt_ids.shape == (4, 6)
    for row in range(2):
        kept = a.prompt_ids[row][a.prompt_mask[row] > 0]
        np.testing.assert_array_equal(both.prompt_ids[row][both.prompt_mask[row] > 0], kept)
        assert both.prompt_mask[row][:3].sum() == 0  # padding on the left
    np.testing.assert_array_equal(both.prompt_ids[2:], b.prompt_ids)


def make_swap():
    swap = SwapManager(device_target="CPU")
    for i, group in enumerate((TRAIN_WEIGHTS, OPTIMIZER_MOMENTS, INFER_WEIGHTS, REF_WEIGHTS)):
        swap.register(group, [ms.Parameter(ms.Tensor(np.zeros(4 * (i + 1), np.float32)), name=f"{group}.p")])
    return swap


# a GRPO job's phase plan (`specs.phase_plan` of its roles' specs: tests/trainer/test_job_plan.py)
GRPO_PHASE_PLAN = {"generate": (INFER_WEIGHTS,), "reward": (), "ref": (REF_WEIGHTS,), "old": (INFER_WEIGHTS,),
                   "gather": (), "values": (), "update_critic": (), "train": (TRAIN_WEIGHTS, OPTIMIZER_MOMENTS),
                   "reshard": (TRAIN_WEIGHTS, INFER_WEIGHTS), "sync_ref": (INFER_WEIGHTS, REF_WEIGHTS),
                   "eval": (INFER_WEIGHTS,)}


def test_a_role_refuses_to_run_a_net_whose_group_is_offloaded():
    swap = make_swap()

    class Probe(Role):
        name = "probe"

    role = Probe()
    role.assert_resident((REF_WEIGHTS,), "log_probs")  # not attached: nothing to check
    role.attach(swap)
    role.assert_resident((REF_WEIGHTS, INFER_WEIGHTS), "log_probs")
    swap.offload(REF_WEIGHTS, "train")
    with pytest.raises(SwapError, match="'probe.log_probs' uses offloaded swap group\\(s\\) ref_weights"):
        role.assert_resident((REF_WEIGHTS,), "log_probs")


def test_phases_apply_their_swap_plan_and_time_themselves():
    swap = make_swap()
    plan = GRPO_PHASE_PLAN
    phases = Phases(swap, plan)
    phases.start_step()
    for name in ("generate", "reward", "ref", "gather", "train", "reshard", "sync_ref"):
        with phases(name):
            assert {g for g in swap.groups if swap.is_resident(g)} == set(plan[name])
    import psutil
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    # enough to raise the process's lifetime peak (earlier tests may have set it) by 256 MiB inside this phase
    ballast = bytearray(max(0, peak - psutil.Process().memory_info().rss) + (256 << 20))
    with phases("eval"):
        ballast[::4096] = b"\1" * len(ballast[::4096])
    metrics = phases.step_metrics()
    names = ("generate", "reward", "ref", "gather", "train", "reshard", "sync_ref", "eval")
    assert set(metrics) == {f"timing/{n}" for n in names} | {f"memory/peak_gib_after_{n}" for n in names} | {
        "swap/bytes_moved"}
    peaks = [metrics[f"memory/peak_gib_after_{n}"] for n in names]
    assert peaks == sorted(peaks) and peaks[-1] - peaks[-2] > 0.2, peaks  # the jump is in the phase that made it
    del ballast
    # generate offloads train (16 B) + moments (32 B) + ref (64 B); ref loads ref (64 B) ... all counted
    assert metrics["swap/bytes_moved"] == sum(e.nbytes for e in swap.events)
    with pytest.raises(KeyError, match="unknown phase 'sleep'"):
        with phases("sleep"):
            pass


def write_fake_checkpoint(tmp_path, step, world=2, config=None):
    writer = CheckpointWriter(str(tmp_path), rank=0, world_size=1, failed_ranks=lambda failed: [0] if failed else [])

    def rank_files(folder):
        for rank in range(world):
            target = os.path.join(os.path.dirname(folder), f"rank_{rank}")
            os.makedirs(target, exist_ok=True)
            for name in ("train.ckpt", "ref.ckpt", "state.json"):
                open(os.path.join(target, name), "w").close()

    meta = {"step": step, "world_size": world, "layouts": {"train": "dp=1 x tp=2", "infer": "dp=2 x tp=1"},
            "config": config or {"schedule": {"steps": 4, "batch_size": 4}}}
    return writer.save(step, rank_files, lambda folder: None, meta, keep_last=2)


def test_only_complete_checkpoints_are_picked_and_old_ones_pruned(tmp_path, caplog):
    for step in (1, 2, 3):
        write_fake_checkpoint(tmp_path, step)
    assert [os.path.basename(p) for p in complete_checkpoints(str(tmp_path))] == ["step_000002", "step_000003"]
    # a checkpoint cut off mid-write: no meta (or still the partial folder) -> never picked
    os.makedirs(tmp_path / "step_000009" / "rank_0")
    os.makedirs(tmp_path / ".step_000010.partial" / "rank_0")
    assert find_resume_checkpoint("auto", str(tmp_path)).endswith("step_000003")
    with pytest.raises(CheckpointError, match="step_000009: not a complete checkpoint"):
        find_resume_checkpoint(str(tmp_path / "step_000009"), None)
    with pytest.raises(CheckpointError, match=r"nowhere: no such folder \(--resume takes a step_\* folder"):
        find_resume_checkpoint(str(tmp_path / "nowhere"), None)
    # nothing to resume: the run starts from step 0, and says so
    with caplog.at_level(logging.WARNING, logger="mindrlhf.checkpoint.step"):
        assert find_resume_checkpoint("auto", str(tmp_path / "empty")) is None
    assert caplog.messages == [f"--resume: no complete checkpoint in {tmp_path / 'empty'}; starting from step 0"]


def test_a_checkpoint_that_cannot_be_written_is_one_error_and_keeps_the_last_one(tmp_path):
    write_fake_checkpoint(tmp_path, 1)
    writer = CheckpointWriter(str(tmp_path), rank=0, world_size=1, failed_ranks=lambda failed: [0] if failed else [])

    def full_disk(folder):
        open(os.path.join(folder, "train.ckpt"), "w").close()
        raise OSError(28, "No space left on device")

    with pytest.raises(CheckpointError, match=r"step_000002: cannot write this checkpoint \(No space left on device\); "
                                              r"the last complete one \(.*step_000001\) is untouched"):
        writer.save(2, full_disk, lambda folder: None, {"step": 2}, keep_last=2)
    assert [os.path.basename(p) for p in complete_checkpoints(str(tmp_path))] == ["step_000001"]
    assert not os.path.exists(tmp_path / ".step_000002.partial" / "rank_0")  # its space is given back


def test_a_checkpoint_past_the_file_size_limit_is_one_error_and_leaves_no_rank_file(tmp_path):
    """The streamed `.ckpt` writer under a real file size limit (ulimit -f): the same one error, and the rank's files
    of the step are gone (the limit, not a simulated OSError)."""
    params = [ms.Parameter(ms.Tensor(np.ones((64, 64), np.float32)), name=f"w{i}") for i in range(4)]
    writer = CheckpointWriter(str(tmp_path), rank=0, world_size=1, failed_ranks=lambda failed: [0] if failed else [])
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, hard))  # a quarter of the 64 KiB of weights
    try:
        with pytest.raises(CheckpointError, match=r"step_000001: cannot write this checkpoint \(File too large\); "
                                                  r"the last complete one \(none\) is untouched"):
            writer.save(1, lambda folder: save_parameters(params, os.path.join(folder, "train.ckpt")),
                        lambda folder: None, {"step": 1}, keep_last=2)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert complete_checkpoints(str(tmp_path)) == []
    assert not os.path.exists(tmp_path / ".step_000001.partial" / "rank_0")


def test_saved_parameters_load_as_mindspore_saves_them_in_any_chunking(tmp_path, monkeypatch):
    from mindspore import Parameter, Tensor

    import mindrlhf.utils.checkpoint_file as checkpoint_file
    from mindrlhf.checkpoint.step import save_parameters

    rng = np.random.default_rng(0)
    params = [Parameter(Tensor(rng.standard_normal((7, 13)).astype(np.float32)), name="w"),
              Parameter(Tensor(rng.standard_normal(9).astype(np.float16)), name="half"),
              Parameter(Tensor(np.int32(5)), name="count"), Parameter(Tensor(3.5, ms.float32), name="scalar"),
              Parameter(Tensor(rng.standard_normal((4, 30)).astype(np.float32), ms.bfloat16), name="bf16")]
    ms.save_checkpoint(params, str(tmp_path / "theirs.ckpt"))
    theirs = ms.load_checkpoint(str(tmp_path / "theirs.ckpt"))
    arrays = [(p.name, p.asnumpy()) for p in params]  # the converter's input (bfloat16: MindSpore's numpy dtype)
    for chunk, source in ((100, "params"), (1 << 20, "params"), (100, "arrays")):  # 7 x 13 float32: 4 records, 1
        monkeypatch.setattr(checkpoint_file, "CHECKPOINT_CHUNK_BYTES", chunk)
        path = tmp_path / f"ours_{source}_{chunk}.ckpt"
        if source == "params":
            save_parameters(params, str(path))
        else:
            checkpoint_file.write_checkpoint(arrays, str(path))
        ours = ms.load_checkpoint(str(path))
        assert list(ours) == list(theirs)
        for name, value in theirs.items():
            assert ours[name].dtype == value.dtype and ours[name].shape == value.shape, name
            np.testing.assert_array_equal(ours[name].float().asnumpy(), value.float().asnumpy(), err_msg=name)
        assert oct(os.stat(path).st_mode & 0o777) != oct(0o400)  # not MindSpore's read-only
    assert sorted(os.listdir(tmp_path)) == ["ours_arrays_100.ckpt", "ours_params_100.ckpt",
                                            f"ours_params_{1 << 20}.ckpt", "theirs.ckpt"]


def test_resume_refuses_another_world_size_layout_or_config(tmp_path):
    path = write_fake_checkpoint(tmp_path, 2)
    meta = json.loads(open(os.path.join(path, "meta.json")).read())
    layouts = meta["layouts"]
    check_resumable(path, meta, 2, layouts, {"schedule": {"steps": 8, "batch_size": 4}})  # more steps: fine
    with pytest.raises(CheckpointError, match="written by a job of 2 ranks, this job has 4"):
        check_resumable(path, meta, 4, layouts, meta["config"])
    with pytest.raises(CheckpointError, match="train layout dp=1 x tp=2 differs from this job's dp=2 x tp=1"):
        check_resumable(path, meta, 2, {"train": "dp=2 x tp=1", "infer": "dp=2 x tp=1"}, meta["config"])
    with pytest.raises(CheckpointError, match=r"schedule.batch_size 4 -> 8"):
        check_resumable(path, meta, 2, layouts, {"schedule": {"steps": 4, "batch_size": 8}})
    os.remove(os.path.join(path, "rank_1", "train.ckpt"))
    with pytest.raises(CheckpointError, match="rank_1/train.ckpt: missing"):
        check_resumable(path, meta, 2, layouts, meta["config"])


def test_metrics_that_cannot_be_written_are_one_error_and_leave_only_whole_lines(tmp_path):
    """A file size limit (or a full disk) while appending a step's line: one error naming the file and the cause,
    and the part of the line that was written is cut back off (the file still parses line by line)."""
    import re

    from mindrlhf.trainer.metrics import MetricsError, MetricsWriter
    writer = MetricsWriter(str(tmp_path))
    writer.record(1, {"actor/pg_loss": 0.5})
    path = tmp_path / "metrics.jsonl"
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (path.stat().st_size + 10, hard))  # room for part of the next line
    try:
        with pytest.raises(MetricsError, match=rf"^{re.escape(str(path))}: cannot write this step's metrics \(File "
                                               r"too large\); the lines before it and the checkpoints are intact$"):
            writer.record(2, {"actor/pg_loss": 0.25, "actor/kl_loss": 0.125})
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1]


def test_metrics_jsonl_is_cut_back_to_the_resumed_step(tmp_path):
    from mindrlhf.trainer.metrics import MetricsWriter
    writer = MetricsWriter(str(tmp_path))
    for step in (1, 2, 3):
        writer.write(step, 3, {"critic/score/mean": step / 10})
    resumed = MetricsWriter(str(tmp_path), resume_step=2)
    resumed.write(3, 3, {"critic/score/mean": 0.5})
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(line["step"], line["critic/score/mean"]) for line in lines] == [(1, 0.1), (2, 0.2), (3, 0.5)]


def read_event_scalars(folder):
    """(tag, step, value) of every scalar in the TensorBoard event files of `folder` (TFRecord framing)."""
    import struct

    from tensorboardX.proto import event_pb2
    scalars = []
    for path in sorted(folder.glob("events.out.tfevents.*")):
        data = path.read_bytes()
        offset = 0
        while offset < len(data):
            (length,) = struct.unpack("<Q", data[offset:offset + 8])
            event = event_pb2.Event.FromString(data[offset + 12:offset + 12 + length])
            offset += 12 + length + 4
            scalars += [(v.tag, event.step, v.simple_value) for v in event.summary.value]
    return scalars


def test_score_length_and_throughput_metrics_by_hand():
    from mindrlhf.data.experience import Experience
    from mindrlhf.trainer.metrics import length_metrics, row_statistics, score_metrics, throughput_metrics, token_count

    terms = {"accuracy": np.array([1.0, 0.0, np.nan, np.nan]), "format": np.full(4, np.nan)}
    metrics = score_metrics(np.array([1.0, 0.0, 0.5, 0.5], np.float32), terms, group_size=2)
    assert np.isnan(metrics.pop("reward/format"))  # the function scored no response
    assert metrics == pytest.approx({"critic/score/mean": 0.5, "critic/score/std": np.sqrt(0.125),
                                     "critic/score/max": 1.0, "critic/score/min": 0.0, "reward/accuracy": 0.5,
                                     "reward/frac_zero_std": 0.5})  # the second group scored 0.5 twice
    prompt_mask = np.array([[0, 1, 1], [0, 1, 1], [1, 1, 1], [1, 1, 1]])
    response_mask = np.array([[1, 1, 1], [1, 0, 0], [1, 1, 1], [1, 1, 0]])
    response_ids = np.array([[7, 8, 1], [1, 0, 0], [7, 8, 5], [7, 1, 0]])  # row 2 is cut at the width, no end
    exp = Experience({"prompt_ids": prompt_mask, "prompt_mask": prompt_mask, "response_ids": response_ids,
                      "response_mask": response_mask, "rewards": np.array([1.0, 0.0, 0.5, 0.5], np.float32),
                      "reward/accuracy": terms["accuracy"], "old_logp": np.zeros((4, 3), np.float32)})
    rows = row_statistics(exp, [1, 2])
    assert sorted(rows) == ["clipped", "prompt_length", "response_length", "reward/accuracy", "rewards"]
    np.testing.assert_array_equal(rows.clipped, [False, False, True, False])
    assert token_count(rows) == 10 + 9
    # what a data-parallel gather sends: the statistics survive the float32 packing
    assert rows.unpack(rows.pack()).response_length.tolist() == [3, 1, 3, 2]
    assert length_metrics(rows) == pytest.approx({
        "response_length/mean": 2.25, "response_length/max": 3, "response_length/min": 1,
        "response_length/clip_ratio": 0.25, "prompt_length/mean": 2.5, "prompt_length/max": 3,
        "prompt_length/min": 2})
    timings = {"timing/step": 5.0, "timing/train": 3.0, "timing/generate": 1.0}
    assert throughput_metrics(100, 300, 2, timings) == {"e2e_tps": 10.0, "update_tps": 50.0, "vllm_tps": 50.0}
    assert throughput_metrics(100, 0, 2, timings) == {"e2e_tps": 10.0, "vllm_tps": 50.0}  # no update this step


class RolloutGather:
    """A stand-in for the ranks' gather (`ArrayCollectives.gather_data_parallel_rows`) around one rank of a 2-rank
    job whose whole rollout is `whole`: it checks the rank sends its own rows of what is gathered (the per-row
    statistics or the whole experience, told apart by their width) and returns every rank's."""

    def __init__(self, whole):
        from mindrlhf.trainer.metrics import row_statistics

        self.whole = {len(t): t for t in (whole.pack().T, row_statistics(whole, [1]).pack().T)}
        self.widths = []

    def gather_data_parallel_rows(self, array, layout):
        whole = self.whole[array.shape[1]].T
        rows = len(array)
        np.testing.assert_array_equal(array, whole[layout.dp_rank * rows:(layout.dp_rank + 1) * rows])
        self.widths.append(array.shape[1])
        return whole


def collected_step(whole, rank, stays):
    """What rank `rank` of 2 (train and infer dp=2) trains on and reports after the rollout `whole` (each rank
    generated its half), its rows kept (`stays`) or the rollout gathered."""
    from types import SimpleNamespace

    from mindrlhf.configs.grpo_configs import GRPOConfig
    from mindrlhf.engine.batches import rows_of_rank
    from mindrlhf.engine.step_shape import StepShape
    from mindrlhf.parallel.layout import Layout
    from mindrlhf.trainer.experience_maker import ExperienceMaker

    net = SimpleNamespace(layout=Layout(dp=2, rank=rank))
    config = GRPOConfig()
    plan = SimpleNamespace(rollout_rows_stay=stays, config=config, rank=rank,
                           shape=StepShape.of(config.schedule, 4, infer_dp=2, train_dp=2),
                           generation=SimpleNamespace(num_generations=4, eos_token_ids=[1], pad_token_id=0),
                           actor=SimpleNamespace(train=net, infer=net))
    phases = Phases(SwapManager(), {name: () for name in PHASES})
    phases.start_step()
    comm = RolloutGather(whole)
    maker = ExperienceMaker(plan, None, None, None, None, None, comm, phases)
    maker._rollout = lambda: whole.rows(rows_of_rank(whole.num_rows, 2, rank))
    return maker.make(), comm.widths


def test_a_rank_that_keeps_its_rows_trains_and_reports_as_if_the_rollout_were_gathered():
    """Each rank of a dp=2 job generated 2 prompts x 4 responses. Kept on their rank, the rows get the advantages,
    the updates' counts and the metrics' per-row statistics the gathered rollout gives, bit for bit; only those
    statistics (5 numbers a row, not the 40-odd of a row's columns) go to the other rank."""
    whole = make_experience(16, 6, 8, seed=4)
    whole = Experience({name: whole[name] for name in whole if name != "advantages"})
    for rank in (0, 1):
        kept, sent = collected_step(whole, rank, stays=True)
        gathered, _ = collected_step(whole, rank, stays=False)
        assert sent == [5]  # rewards, reward/accuracy, response_length, prompt_length, clipped
        assert not kept.gathered and kept.generated.num_rows == 8 and gathered.generated.num_rows == 16
        mine, theirs = kept.rank_rows["actor"], gathered.rank_rows["actor"]
        assert mine.batch_rows.tolist() == theirs.batch_rows.tolist() == list(range(8 * rank, 8 * rank + 8))
        assert list(kept.rank_rows) == ["actor"]
        np.testing.assert_array_equal(mine.row_tokens, theirs.row_tokens)
        assert sorted(mine.rows) == sorted(theirs.rows)
        for name in theirs.rows:
            np.testing.assert_array_equal(mine.rows[name], theirs.rows[name], err_msg=name)
        assert mine.rows.advantages.any()  # the groups' rewards differ: real advantages were compared
        for name in gathered.rows:
            np.testing.assert_array_equal(kept.rows[name], gathered.rows[name], err_msg=name)
        assert kept.trained_tokens == gathered.trained_tokens == int(whole.prompt_mask.sum() +
                                                                      whole.response_mask.sum())


def test_rollout_rank_metrics_pool_the_ranks_rows_and_spread_their_times():
    from mindrlhf.trainer.metrics import rollout_rank_metrics

    # the share over all rows, not the mean of the ranks' shares (0.5 and 0.1 would give 0.3)
    assert rollout_rank_metrics([10.0, 12.5], [100, 300], [50, 30]) == {"perf/idle_decode_rows": 0.2,
                                                                         "timing/generate_spread": 2.5}
    assert rollout_rank_metrics(np.array([3.0], np.float32), [0], [0]) == {"perf/idle_decode_rows": 0.0,
                                                                           "timing/generate_spread": 0.0}


def test_memory_metrics_sum_the_rounded_peaks():
    from mindrlhf.trainer.metrics import memory_metrics

    # rounded after summing, 1.3334 + 1.3336 would log 2.667 beside a max of 1.334 (2 x 1.334 = 2.668 holds), and
    # 1.3334 + 1.3334 would log 2.667 beside a max of 1.333: more than two ranks can hold
    assert memory_metrics(np.array([1.3334, 1.3334], np.float32)) == {"perf/max_rss_gib": 1.333,
                                                                     "perf/sum_rss_gib": 2.666}
    assert memory_metrics([0.5, 2.25, 1.0]) == {"perf/max_rss_gib": 2.25, "perf/sum_rss_gib": 3.75}


def test_the_step_line_names_each_metric_as_jsonl_does():
    from mindrlhf.trainer.metrics import step_line

    metrics = {"reward/accuracy": 0.25, "critic/score/mean": 0.75, "reward/frac_zero_std": 0.5, "eval/format": 1.0,
               "actor/pg_loss": -0.0015834, "timing/step": 8.92712, "e2e_tps": 600.6, "timing/train": 3.0,
               "eval/accuracy": 0.5, "actor/updates": 4}
    assert step_line(3, 40, metrics) == ("step 3/40 | critic/score/mean 0.75 | actor/pg_loss -0.001583 | timing/step "
                                         "8.927 s | e2e_tps 600.6 | eval/accuracy 0.5 | reward/accuracy 0.25 | "
                                         "eval/format 1")


def test_tensorboard_events_are_written_without_loading_torch(tmp_path):
    """tensorboardX imports torch when it is installed (as in the test virtualenv): the trainer's writer must not
    pay its ~190 MB for scalars. A fresh process, as a job's rank 0."""
    import importlib.util

    assert importlib.util.find_spec("torch") is not None  # installed here, so its absence below means something
    code = ("import sys; from mindrlhf.trainer.metrics import MetricsWriter; "
            f"w = MetricsWriter({str(tmp_path / 'out')!r}, {str(tmp_path / 'tb')!r}); "
            "w.write(1, 1, {'critic/score/mean': 0.5}); w.close(); print('torch' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert result.stdout.split()[-1] == "False"
    assert ("critic/score/mean", 1, 0.5) in read_event_scalars(tmp_path / "tb")


def test_tensorboard_events_hold_every_metric(tmp_path):
    from mindrlhf.trainer.metrics import MetricsWriter
    writer = MetricsWriter(str(tmp_path / "out"), str(tmp_path / "tb"))
    writer.write(1, 2, {"critic/score/mean": 0.25, "actor/kl_loss": 0.5})
    writer.write(2, 2, {"critic/score/mean": 0.75, "actor/kl_loss": float("nan")})
    writer.close()
    scalars = read_event_scalars(tmp_path / "tb")
    assert ("critic/score/mean", 1, 0.25) in scalars and ("critic/score/mean", 2, 0.75) in scalars
    assert ("actor/kl_loss", 1, 0.5) in scalars
    assert not any(tag == "actor/kl_loss" and step == 2 for tag, step, _ in scalars)


def test_record_adds_a_step_without_a_log_line(tmp_path, caplog):
    from mindrlhf.trainer.metrics import MetricsWriter
    writer = MetricsWriter(str(tmp_path), str(tmp_path / "tb"))
    with caplog.at_level("INFO", logger="mindrlhf"):
        writer.record(0, {"eval/accuracy": 0.25})
        writer.write(1, 1, {"critic/score/mean": 0.5, "eval/accuracy": 0.5, "eval/hash_format": 0.125})
    writer.close()
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert lines == [{"step": 0, "eval/accuracy": 0.25},
                     {"step": 1, "critic/score/mean": 0.5, "eval/accuracy": 0.5, "eval/hash_format": 0.125}]
    assert not [r for r in caplog.records if "0.25" in r.getMessage()]
    step_line = [r.getMessage() for r in caplog.records if "step 1/1" in r.getMessage()]
    assert step_line and "eval/accuracy 0.5" in step_line[0] and "eval/hash_format 0.125" in step_line[0]
    assert ("eval/accuracy", 0, 0.25) in read_event_scalars(tmp_path / "tb")


def test_progress_series_and_plot(tmp_path):
    from mindrlhf.trainer.plot import plot_progress, progress_series
    records = [{"step": 0, "eval/accuracy": 0.2, "eval/format": 0.0},
               {"step": 1, "critic/score/mean": 0.5, "reward/accuracy": 0.1},
               {"step": 2, "critic/score/mean": 0.9, "reward/accuracy": 0.4, "eval/accuracy": 0.35},
               {"step": 2, "critic/score/mean": 0.7, "reward/accuracy": 0.3, "eval/accuracy": 0.3,
                "eval/format": 0.5}]  # step 2 rewritten
    series = progress_series(records)
    assert series["eval/format"] == ([0, 2], [0.0, 0.5])
    assert series["critic/score/mean"] == ([1, 2], [0.5, 0.7])
    assert series["reward/accuracy"] == ([1, 2], [0.1, 0.3])
    assert series["eval/accuracy"] == ([0, 2], [0.2, 0.3])
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(r) + "\n" for r in records))
    plot_progress(str(metrics), str(tmp_path / "progress.png"))
    data = (tmp_path / "progress.png").read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_a_fresh_run_starts_a_new_metrics_file(tmp_path):
    from mindrlhf.trainer.metrics import MetricsWriter
    MetricsWriter(str(tmp_path)).record(0, {"eval/accuracy": 0.1})
    fresh = MetricsWriter(str(tmp_path))
    fresh.record(0, {"eval/accuracy": 0.2})
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert lines == [{"step": 0, "eval/accuracy": 0.2}]


def test_postmortem_maps_the_pid_msrun_saw_fail_first_to_its_rank(tmp_path):
    from mindrlhf.utils.postmortem import first_failed_worker, main

    (tmp_path / "worker_0.log").write_text("12:00:00 [rank 0] INFO mindrlhf.trainer: rank 0 of 2 started as pid 4242 "
                                           "on host\n")
    (tmp_path / "worker_1.log").write_text("12:00:00 [rank 1] INFO mindrlhf.trainer: rank 1 of 2 started as pid 4343 "
                                           "on host\nstep 3/50 ...\n")
    msrun_output = ("[ERROR] ME(1:2,python):... Worker process 4343 exit with exception. Error code: -9.\n"
                    "[ERROR] ME(1:2,python):... Worker process 4242 exit with exception. Error code: -15.\n"
                    "The node: 0 is timed out.\n")
    report = first_failed_worker(msrun_output, str(tmp_path))
    assert report == f"rank 1 (pid 4343) failed first: killed by SIGKILL (exit -9); its log: {tmp_path}/worker_1.log"
    assert first_failed_worker("Worker process 4242 exit with exception. Error code: 3.", str(tmp_path)) == \
        f"rank 0 (pid 4242) failed first: exit 3; its log: {tmp_path}/worker_0.log"
    assert first_failed_worker("Worker process 99 exit with exception. Error code: 1.", str(tmp_path)) is None
    assert first_failed_worker("All workers successfully exit!", str(tmp_path)) is None
    (tmp_path / "msrun.out").write_text(msrun_output)
    assert main([str(tmp_path / "msrun.out"), str(tmp_path)]) == 0


MSRUN_TRACEBACK = """Traceback (most recent call last):
  File "/venv/bin/msrun", line 8, in <module>
    sys.exit(main())
             ^^^^^^
  File "/venv/lib/python3.11/site-packages/mindspore/parallel/cluster/process_entity/_api.py", line 389, in join
    raise RuntimeError("Distributed job exited with exception. Please check logs in "
"""


def test_the_console_leaves_out_msruns_own_traceback_and_mindspores_info_lines():
    from mindrlhf.utils.postmortem import console_lines

    worker_traceback = ('Traceback (most recent call last):\n  File "/job/grpo_one_stage.py", line 3, in <module>\n'
                        "    main()\nValueError: bad\n")
    output = ("12:00:00 [rank 0] INFO mindrlhf.trainer: step 1/2\n"
              "[INFO] DISTRIBUTED(5354,7ff2e77fe6c0,python):2026-11-28 [tcp_client.cc:367] Start] Event base "
              "dispatch success!\n"
              + worker_traceback +
              "[ERROR] ME(5345:1,MainProcess):2026 [_api.py:365] Worker process 5352 exit with exception. Error "
              "code: 2.\n"
              + MSRUN_TRACEBACK +
              "RuntimeError: Distributed job exited with exception. Please check logs in directory: /o/msrun_log.\n"
              "run_grpo.sh: the job failed (exit 1)\n")
    shown = "".join(console_lines(output.splitlines(keepends=True)))
    assert shown == ("12:00:00 [rank 0] INFO mindrlhf.trainer: step 1/2\n" + worker_traceback +
                     "[ERROR] ME(5345:1,MainProcess):2026 [_api.py:365] Worker process 5352 exit with exception. "
                     "Error code: 2.\nrun_grpo.sh: the job failed (exit 1)\n")
    # msrun failing otherwise (another exception, or its output cut short) is shown whole
    other = MSRUN_TRACEBACK + "KeyError: 'RANK_ID'\n"
    assert "".join(console_lines(other.splitlines(keepends=True))) == other
    assert "".join(console_lines(MSRUN_TRACEBACK.splitlines(keepends=True))) == MSRUN_TRACEBACK


def test_the_console_filter_passes_each_line_on_as_it_comes():
    """`--console` runs behind msrun for the whole job: a line must reach the console before the next one is
    written, not when the job ends."""

    console = subprocess.Popen([sys.executable, "-m", "mindrlhf.utils.postmortem", "--console"],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        for line in ("step 1/2\n", "[INFO] DISTRIBUTED(1,2,python): noise\n", "step 2/2\n"):
            console.stdin.write(line)
            console.stdin.flush()
            if not line.startswith("[INFO]"):
                assert console.stdout.readline() == line
        console.stdin.close()
        assert console.stdout.read() == "" and console.wait(timeout=10) == 0
    finally:
        console.kill()


def test_cpu_threads_share_the_host_cores_between_its_ranks():
    from mindrlhf.parallel.host_setup import threads_per_rank

    assert threads_per_rank(cores=2, ranks_on_host=2) == 1
    assert threads_per_rank(cores=2, ranks_on_host=1) == 2
    assert threads_per_rank(cores=16, ranks_on_host=3) == 5
    assert threads_per_rank(cores=2, ranks_on_host=4) == 1  # never 0
    assert threads_per_rank(cores=2, ranks_on_host=2, requested=3) == 3  # an explicit --cpu_threads wins


def test_each_rank_keeps_to_its_own_share_of_the_cores():
    from mindrlhf.parallel.host_setup import cores_of_rank

    assert [cores_of_rank([0, 1], 2, r) for r in range(2)] == [[0], [1]]
    assert [cores_of_rank(list(range(8)), 3, r) for r in range(3)] == [[0, 1], [2, 3, 4], [5, 6, 7]]
    assert cores_of_rank([4, 5, 6, 7], 2, 1) == [6, 7]  # the cores the host gave the job, not 0..n-1
    assert cores_of_rank([0, 1], 4, 3) == [0, 1]  # more ranks than cores: they share every core
    assert cores_of_rank([0, 1], 1, 0) == [0, 1]


def test_pipeline_layouts_the_trainer_cannot_take_are_one_line_errors():
    import dataclasses

    from mindrlhf.configs.base import ConfigError
    from mindrlhf.configs.grpo_configs import ScheduleConfig
    from mindrlhf.configs.parallel import ParallelConfig
    from mindrlhf.models.qwen2 import Qwen2Config
    from mindrlhf.parallel.layout import Layout
    from mindrlhf.trainer.plan import check_pipeline, check_unstaged

    cfg = Qwen2Config.from_yaml(TINY / "train_pp2.yaml")
    staged = Layout(pp=2, rank=1)
    check_pipeline(cfg, staged, ScheduleConfig(), 8, "pp.yaml")  # 2 micro-batches of 4 rows
    check_pipeline(cfg, Layout(), ScheduleConfig(micro_batch_size_per_device=3), 7, "flat.yaml")  # no stages
    with pytest.raises(ConfigError, match=r"pp.yaml: parallel_config.micro_batch_num=2 must divide the 7 responses"):
        check_pipeline(cfg, staged, ScheduleConfig(), 7, "pp.yaml")
    with pytest.raises(ConfigError, match=r"micro_batch_size_per_device=4: with pipeline stages the train "
                                          r"micro-batches are pp.yaml's parallel_config.micro_batch_num"):
        check_pipeline(cfg, staged, ScheduleConfig(micro_batch_size_per_device=4), 8, "pp.yaml")
    four = dataclasses.replace(cfg, num_layers=4, parallel_config=ParallelConfig(pipeline_stage=4))
    check_pipeline(four, Layout(pp=4, rank=2), ScheduleConfig(), 8, "pp4.yaml")  # a layer a stage
    three = dataclasses.replace(four, parallel_config=ParallelConfig(pipeline_stage=3))
    with pytest.raises(ConfigError, match=r"pp3.yaml: parallel_config.pipeline_stage=3 must divide "
                                          r"model_config.num_layers=4"):
        check_pipeline(three, Layout(pp=3, rank=0), ScheduleConfig(), 8, "pp3.yaml")
    check_unstaged(Layout(dp=2, rank=1), "infer.yaml", "the inference net")
    with pytest.raises(ConfigError, match=r"infer.yaml: parallel_config.pipeline_stage=2, but the inference net runs "
                                          r"without pipeline stages; use pipeline_stage: 1"):
        check_unstaged(staged, "infer.yaml", "the inference net")


def test_the_cpu_memory_pool_is_one_block_of_the_ranks_share_of_the_host():
    from mindrlhf.parallel.host_setup import memory_pool_gib

    assert memory_pool_gib(host_memory_gib=23.4, ranks_on_host=2) == 11
    assert memory_pool_gib(host_memory_gib=23.4, ranks_on_host=1) == 23
    assert memory_pool_gib(host_memory_gib=7.9, ranks_on_host=8) == 2  # never below MindSpore's default block


def test_long_lived_objects_are_frozen_after_the_garbage_is_collected():
    """What the trainer (before its first compile), the test workers and this test session do: garbage is freed, not
    frozen; live objects leave the walk MindSpore's compiles start with a gc.collect()."""
    import gc
    import weakref

    from mindrlhf.trainer.launch import freeze_long_lived_objects

    class Node:
        pass

    live, garbage = Node(), Node()
    garbage.itself = garbage  # a cycle: only the collector frees it
    freed = weakref.ref(garbage)
    del garbage
    freeze_long_lived_objects()
    assert freed() is None

    def walked(obj) -> bool:  # in one of the collector's generations (frozen objects are in none)
        return any(o is obj for generation in range(3) for o in gc.get_objects(generation=generation))

    later = Node()
    assert not walked(live) and walked(later)


@pytest.mark.slow
def test_one_pool_block_stops_a_train_steps_memory_growing_from_call_to_call(tmp_path):
    """With MindSpore's default pool (2 GiB blocks) a train step whose logits, embedding and its gradient are each
    hundreds of MiB takes more memory at every call as the blocks fragment; in one block of the rank's share
    (what the trainer sets) its memory after the first call stays put."""
    rss = {}
    for name, extra in (("trainer", []), ("default", ["--default_pool"])):
        out = tmp_path / f"{name}.json"
        run_worker("pool_growth_worker.py", ["--out", str(out), *extra], workers=1, log_dir=tmp_path, timeout=600)
        rss[name] = json.loads(out.read_text())
    assert rss["trainer"]["pool_gib"] >= 2
    trainer, default = rss["trainer"]["rss_gib"], rss["default"]["rss_gib"]
    assert default[-1] - default[0] > 0.5, default  # the problem, reproduced
    assert trainer[-1] - trainer[0] < 0.1, trainer
    assert trainer[-1] < default[-1] - 0.5, (trainer, default)
