"""The GRPO trainer under msrun: two layouts on the same ranks (train tp=2, infer dp=2), reshard and swap every
step, checkpoints, exact resume, strategy files; the same step on two nodes; a killed worker; PPO with a tensor-
parallel critic. The straight runs (GRPO and PPO) are session fixtures (tests/conftest.py): other modules compare
their jobs with them too."""
import json
import os
import shutil
import time
from contextlib import ExitStack
from pathlib import Path

import numpy as np
import pytest
from support.jobs import (
    grpo_msrun_command,
    ppo_args,
    run_job,
    started_job,
    straight_args,
    without_timing,
)
from support.metrics_doc import assert_documented
from support.msrun import free_port, msrun_env, run_command
from support.processes import rank_process
from support.tolerances import assert_weights_close_after_adam

from mindrlhf.parallel.host_setup import cores_of_rank

pytestmark = pytest.mark.msrun


def test_every_step_reshards_into_the_infer_net_and_keeps_the_swap_plan(straight_run):
    tmp_path, ranks = straight_run
    for rank, result in enumerate(ranks):
        assert result["exit_code"] == 0
        assert [s["step"] for s in result["steps"]] == [1, 2, 3, 4]
        for step in result["steps"]:
            assert step["mismatched"] == [], f"rank {rank} step {step['step']}: infer != train"
            assert step["plan_errors"] == [], f"rank {rank} step {step['step']}"
            # num_iterations 2 in grpo.yaml: the old-policy phase runs; every phase of the step is there
            assert [p for p in step["phases"] if p != "train"][:4] == ["generate", "reward", "ref", "old"]
            # the reference syncs from the train net every ref_model_sync_steps (3), in a phase of its own
            assert step["phases"][-2:] == (["reshard", "sync_ref"] if step["step"] == 3 else ["train", "reshard"])
    # each rank kept to its share of this host's cores (all of them with fewer cores than ranks)
    host_cores = sorted(os.sched_getaffinity(0))
    assert [result["cores"] for result in ranks] == [cores_of_rank(host_cores, 2, rank) for rank in range(2)]
    if len(host_cores) >= 2:
        assert not set(ranks[0]["cores"]) & set(ranks[1]["cores"])
    # metrics are global: both ranks log the same values
    assert len(ranks[0]["steps"]) == len(ranks[1]["steps"]) == 4
    for a, b in zip(ranks[0]["steps"], ranks[1]["steps"]):
        assert without_timing(a["metrics"]) == pytest.approx(without_timing(b["metrics"]), rel=1e-6)
    lines = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2, 3, 4]
    for key in ("critic/score/mean", "critic/score/std", "critic/score/max", "critic/score/min", "reward/accuracy",
                "reward/format", "reward/frac_zero_std", "actor/pg_loss", "actor/kl_loss", "actor/pg_clipfrac",
                "actor/ppo_kl", "actor/entropy", "actor/grad_norm", "actor/lr", "response_length/mean",
                "response_length/max", "response_length/min", "response_length/clip_ratio", "prompt_length/mean",
                "prompt_length/max", "prompt_length/min", "timing/generate", "timing/reward", "timing/ref",
                "timing/old", "timing/train", "timing/reshard", "timing/step", "e2e_tps", "update_tps", "vllm_tps",
                "perf/max_rss_gib", "swap/bytes_moved"):
        assert key in lines[0], key
    assert_documented(lines)
    for line in lines:  # the step's tokens over the generate phase; the 2 update passes' tokens over the train phase
        assert line["vllm_tps"] > line["e2e_tps"]
        step_tokens = line["e2e_tps"] * line["timing/step"]
        assert line["vllm_tps"] * line["timing/generate"] == pytest.approx(step_tokens, rel=1e-3)
        assert line["update_tps"] * line["timing/train"] == pytest.approx(2 * step_tokens, rel=1e-3)
        assert line["critic/score/min"] <= line["critic/score/mean"] <= line["critic/score/max"]
        assert 0 < line["prompt_length/min"] <= line["prompt_length/mean"] <= line["prompt_length/max"]
    assert 0.1 < lines[0]["perf/max_rss_gib"] <= lines[-1]["perf/max_rss_gib"] < 24  # a peak: never decreases
    assert all(line["perf/max_rss_gib"] < line["perf/sum_rss_gib"] <= 2 * line["perf/max_rss_gib"]
               for line in lines)  # two ranks, each with its own process
    assert all(line["actor/kl_loss"] >= 0 for line in lines) and lines[-1]["actor/kl_loss"] > 0  # k3 >= 0: moved
    assert lines[0]["actor/updates"] == 4  # 2 iterations x (batch 4 / mini-batch 2)
    assert any(line["actor/pg_clipfrac"] > 0 for line in lines)  # several updates per batch: clipping happens
    assert any(line["actor/ppo_kl"] != 0 for line in lines)  # and the later updates see a policy that moved
    assert 0 < lines[0]["actor/entropy"] < np.log(704)
    assert lines[0]["swap/bytes_moved"] > 0


def test_checkpoints_are_complete_and_readable_by_mindspore(straight_run):
    import mindspore as ms
    tmp_path, _ = straight_run
    ckpt_dir = tmp_path / "out" / "checkpoints"
    assert sorted(p.name for p in ckpt_dir.iterdir()) == ["step_000002", "step_000004"]
    step = ckpt_dir / "step_000004"
    meta = json.loads((step / "meta.json").read_text())
    assert meta["step"] == 4 and meta["world_size"] == 2
    for rank in range(2):  # each role's state: the engines' counters (16 actor updates), the sampling stream
        state = json.loads((step / f"rank_{rank}" / "state.json").read_text())
        assert set(state) == {"actor", "reference", "reward"} and state["reference"] == state["reward"] == {}
        assert state["actor"]["engine"] == {"updates": 16, "consecutive_skips": 0}
        assert state["actor"]["generator_rng"]["bit_generator"] == "PCG64"
    strategy = ms.build_searched_strategy(str(step / "train_strategy.ckpt"))
    assert "model.layers.0.attention.wq.weight" in strategy
    for rank in range(2):
        params = ms.load_checkpoint(str(step / f"rank_{rank}" / "train.ckpt"))
        assert any(name.startswith("adam_m.") for name in params) and "adam_step" in params
        assert (step / f"rank_{rank}" / "train.ckpt").stat().st_mode & 0o644 == 0o644


def test_two_nodes_of_one_worker_each_compute_the_straight_runs_first_step(straight_run, tmp_path, mindrecord):
    """The straight run's flags for 1 step, launched as a user launches two machines (an msrun per node, one worker
    each): both workers complete the step and its checkpoint, and the step's metrics are the straight run's step 1
    (one node of 2 workers)."""
    straight_dir, _ = straight_run
    port = free_port()
    args = straight_args(mindrecord, tmp_path / "out", steps=1)
    with ExitStack() as stack:  # both msruns, workers included, stopped whatever happens
        nodes = [stack.enter_context(started_job(
            grpo_msrun_command(tmp_path / f"node{n}", port, args, local_worker_num=1, node_rank=n),
            tmp_path / f"msrun_node{n}.out", msrun_env())) for n in (0, 1)]
        deadline = time.time() + 600
        for node in nodes:
            node.wait(timeout=max(1.0, deadline - time.time()))
    outputs = [(tmp_path / f"msrun_node{n}.out").read_text(errors="replace") for n in (0, 1)]
    logs = "".join(log.read_text(errors="replace") for log in sorted(tmp_path.glob("node*/worker_*.log")))
    # On one machine both msrun calls see the master address as their own and start a scheduler; the one that
    # comes second cannot bind the port and its msrun exits non-zero although its worker completed (on two
    # machines only node 0 starts one). So each node is judged by its worker's log, and one msrun must succeed.
    assert 0 in [node.returncode for node in nodes], outputs[0][-2000:] + outputs[1][-2000:] + logs[-3000:]
    for n in (0, 1):
        worker_log = (tmp_path / f"node{n}" / f"worker_{n}.log").read_text(errors="replace")
        assert "Traceback" not in worker_log and "error:" not in worker_log, worker_log[-3000:]
    lines = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1]
    assert (tmp_path / "out" / "checkpoints" / "step_000001" / "meta.json").is_file()
    straight_first = json.loads((straight_dir / "out" / "metrics.jsonl").read_text().splitlines()[0])
    assert straight_first["step"] == 1
    # the same step as on one node (the resume test's tolerance: the same kernels on the same inputs)
    assert without_timing(lines[0]) == pytest.approx(without_timing(straight_first), rel=1e-6, abs=1e-9)


def test_a_killed_worker_ends_the_job_whose_last_checkpoint_resumes_exactly(straight_run, tmp_path, mindrecord):
    """The straight run's job (grpo_one_stage.py under msrun, as a user launches it) loses rank 1 to SIGKILL in
    step 3: the job ends within a minute and the postmortem names that rank first. Its last complete checkpoint
    (step 2) resumed gives the straight run's steps 3 and 4: the same metrics, the same weights, AdamW moments and
    step count at step 4. The compile cache is on, as a user may have it: the resumed run must not load the killed
    run's graphs."""
    import signal

    import mindspore as ms

    from mindrlhf.checkpoint.step import complete_checkpoints, is_optimizer_state
    from mindrlhf.utils.postmortem import first_failed_worker

    straight_dir, _ = straight_run
    out = tmp_path / "out"
    cache = ["--enable_compile_cache", "True"]
    # 50 steps: the straight run's first 4 steps whatever the count (support.jobs.straight_args)
    args = [*straight_args(mindrecord, out, steps=50), *cache]
    msrun_out = tmp_path / "msrun.out"
    with started_job(grpo_msrun_command(tmp_path / "logs", free_port(), args), msrun_out, msrun_env()) as job:
        deadline = time.time() + 600
        victim = None
        # the kill follows the second checkpoint at once: a step of this job takes ~1 s once its graphs are compiled
        while not (out / "checkpoints" / "step_000002" / "meta.json").is_file():
            assert job.poll() is None and time.time() < deadline, "the job ended before its second checkpoint"
            victim = victim or rank_process(job.pid, "grpo_one_stage.py", 1)
            time.sleep(0.05)
        victim = victim or rank_process(job.pid, "grpo_one_stage.py", 1)
        assert victim is not None, "no rank 1 process found"
        killed_at = time.time()
        victim.send_signal(signal.SIGKILL)
        job.wait(timeout=120)
        took = time.time() - killed_at
    msrun_output = msrun_out.read_text(errors="replace")
    assert job.returncode != 0
    assert took < 60, f"the job took {took:.0f} s to end after a worker was killed"
    # MindSpore's scheduler names whichever heartbeat it missed first (often rank 0, which msrun killed after
    # rank 1 died); the postmortem goes by the pid msrun saw exit first
    report = first_failed_worker(msrun_output, str(tmp_path / "logs"))
    assert report is not None and report.startswith(f"rank 1 (pid {victim.pid}) failed first: killed by SIGKILL"), \
        (report, msrun_output[-2000:])
    last = complete_checkpoints(str(out / "checkpoints"))[-1]
    assert json.loads((Path(last) / "meta.json").read_text())["step"] == 2, last

    resumed = run_command(grpo_msrun_command(tmp_path / "resume_logs", free_port(),
                                             [*straight_args(mindrecord, out), *cache, "--resume"]),
                          msrun_env(), timeout=600)
    assert resumed.returncode == 0, resumed.stdout[-3000:]
    assert len(list((out / "compile_cache").iterdir())) == 2  # the killed run's cache and the resumed run's
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    straight = [json.loads(line) for line in (straight_dir / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [line["step"] for line in straight] == [1, 2, 3, 4]
    for a, b in zip(lines[2:], straight[2:]):
        assert without_timing(a) == pytest.approx(without_timing(b), rel=1e-6, abs=1e-9)
    # the completions logged before the kill and after the resume are the straight run's, none twice
    logged, straight_logged = ([json.loads(line) for line in (folder / "completions.jsonl").read_text().splitlines()]
                               for folder in (out, straight_dir / "out"))
    assert [line["step"] for line in logged] == [line["step"] for line in straight_logged]
    assert {line["step"] for line in logged} == {1, 2, 3, 4}
    assert [line["completion"] for line in logged] == [line["completion"] for line in straight_logged]
    for rank in range(2):
        resumed, reference = ({k: v.asnumpy() for k, v in ms.load_checkpoint(
            str(folder / "checkpoints" / "step_000004" / f"rank_{rank}" / "train.ckpt")).items()}
            for folder in (out, straight_dir / "out"))
        assert resumed.keys() == reference.keys()
        weights = [name for name in reference if not is_optimizer_state(name)]
        # weights after 8 AdamW updates since step 2 (2 steps x 4, lr 1e-3 in tiny/grpo.yaml): Adam turns float noise
        # in near-zero gradients into a fraction of lr, so they are compared in lr units (tests/support/tolerances.py)
        assert_weights_close_after_adam({n: resumed[n] for n in weights}, {n: reference[n] for n in weights},
                                        lr=1e-3, updates=8, what=f"rank {rank} resumed vs straight")
        # AdamW moments (gradient averages: no Adam normalisation), step count and lr stay tight: the resume replays
        # the same kernels on the same inputs, no float sum changes order (bit-identical in practice)
        for name in reference:
            if name not in weights:
                np.testing.assert_allclose(resumed[name], reference[name], rtol=1e-6, atol=1e-7, err_msg=name)


def test_ppo_on_two_workers_with_a_tensor_parallel_critic_resumes_exactly(tp_critic_ppo_run, tmp_path, mindrecord,
                                                                          monkeypatch):
    """PPO under msrun (tests/conftest.py's `tp_critic_ppo_run`): actor train tp=2, infer dp=2, critic tp=2 on the
    same 2 ranks, 3 steps; after every step the infer net holds the train weights, each phase ran with its swap
    plan (the critic resident only in `values` and `update_critic`), and both ranks log the same metrics. The
    step-2 checkpoint (critic weights and moments, the adaptive KL controller) resumes into the same step 3: the
    suite's PPO resume test. The actor's train net and the critic run the memory features of big recipes: sequence
    parallel over their tp pair and full recompute of every layer."""
    import mindspore as ms

    run_dir, ranks = tp_critic_ppo_run
    train_yaml = run_dir / "train_sp_recompute.yaml"
    straight_out = run_dir / "out"
    for rank, result in enumerate(ranks):
        assert result["exit_code"] == 0
        assert [s["step"] for s in result["steps"]] == [1, 2, 3]
        for step in result["steps"]:
            assert step["mismatched"] == [] and step["plan_errors"] == [], (rank, step["step"])
            assert "values" in step["phases"] and "update_critic" in step["phases"]
    assert len(ranks[0]["steps"]) == len(ranks[1]["steps"]) == 3
    for a, b in zip(ranks[0]["steps"], ranks[1]["steps"]):
        # (explained variance is NaN while the returns do not vary)
        assert without_timing(a["metrics"]) == pytest.approx(without_timing(b["metrics"]), rel=1e-6, nan_ok=True)
    log = (run_dir / "ppo_logs" / "worker_0.log").read_text()
    for net in ("train net", "critic"):
        assert f"{net} memory features: sequence parallel, full recompute of 2 of 2 layers" in log
    second = ranks[0]["steps"][1]["metrics"]
    assert second["critic/updates"] == 4 and np.isfinite(second["critic/vf_loss"])
    assert second["critic/values/max"] > second["critic/values/min"]  # the critic trained in step 1
    step_dir = straight_out / "checkpoints" / "step_000002"
    strategy = ms.build_searched_strategy(str(step_dir / "critic_strategy.ckpt"))
    assert "critic.score.weight" in strategy and "critic.model.layers.0.attention.wq.weight" in strategy
    assert all((step_dir / f"rank_{r}" / "critic.ckpt").is_file() for r in range(2))

    resumed_out = tmp_path / "resumed"
    (resumed_out / "checkpoints").mkdir(parents=True)
    shutil.copytree(step_dir, resumed_out / "checkpoints" / "step_000002")
    resumed = run_job(tmp_path, monkeypatch, "ppo_resumed",
                      ppo_args(mindrecord, resumed_out, 3, actor_yaml=train_yaml, critic_yaml=train_yaml,
                               extra=["--resume"]))
    assert [s["step"] for s in resumed[0]["steps"]] == [3]
    assert resumed[0]["steps"][0]["mismatched"] == [] and resumed[0]["steps"][0]["plan_errors"] == []
    straight_third = ranks[0]["steps"][2]["metrics"]
    assert straight_third["actor/reward_kl_penalty_coeff"] != second["actor/reward_kl_penalty_coeff"]  # it moves
    assert without_timing(resumed[0]["steps"][0]["metrics"]) == pytest.approx(without_timing(straight_third),
                                                                             rel=1e-6, abs=1e-9, nan_ok=True)
    for rank in range(2):
        a, b = (ms.load_checkpoint(str(out / "checkpoints" / "step_000003" / f"rank_{rank}" / "critic.ckpt"))
                for out in (straight_out, resumed_out))
        assert a.keys() == b.keys() and "critic_adam_step" in a
        a, b = ({k: v.asnumpy() for k, v in c.items()} for c in (a, b))
        weights = [name for name in a if name.startswith("critic.")]
        assert_weights_close_after_adam({n: b[n] for n in weights}, {n: a[n] for n in weights}, lr=1e-3, updates=4,
                                        what=f"rank {rank} critic resumed vs straight")
        for name in set(a) - set(weights):  # moments, step count, lr: tight (see the GRPO resume test)
            np.testing.assert_allclose(b[name], a[name], rtol=1e-6, atol=1e-7, err_msg=f"rank {rank} {name}")
