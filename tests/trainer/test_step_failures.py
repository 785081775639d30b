"""A failure inside a step of a 2-rank msrun job, on one rank only, ends every rank within seconds, each with one
`error:` line and no traceback on the console, through the same agreement the checkpoint uses: a reward function
that raises on rank 1, one that hangs there past `reward.reward_timeout`, and rank 0's metrics file on a full disk
(`/dev/full`). Without the agreement the healthy rank waited in the next collective until msrun killed it, and the
scheduler reported the killed node's missing heartbeats ~30 s later (`timed out` in scheduler.log)."""
import re
import time

import pytest
from support.jobs import grpo_msrun_command, job_args
from support.msrun import free_port, msrun_env, run_command

from mindrlhf.utils.postmortem import console_lines

pytestmark = pytest.mark.msrun

FLAKY = '''import os
import time


def flaky(completions, solutions):
    mode = os.environ.get("MINDRLHF_TEST_REWARD", "")
    if os.environ.get("RANK_ID") == "1":
        if mode == "raise":
            return [1 / 0]
        if mode == "hang":
            time.sleep(600)
    return [0.5 for _ in completions]
'''


def failed_job(tmp_path, mindrecord, mode: str, extra=(), metrics_file=None):
    """The tiny 2-rank job (train tp=2, infer dp=2) with the `flaky` reward in `mode` (and its metrics.jsonl a link
    to `metrics_file`): (its console, the worker logs by rank, the scheduler's log, the seconds it ran, its output
    folder)."""
    (tmp_path / "failing_rewards.py").write_text(FLAKY)
    out, logs = tmp_path / "out", tmp_path / "logs"
    out.mkdir()
    if metrics_file:
        (out / "metrics.jsonl").symlink_to(metrics_file)
    args = job_args(mindrecord, out, 2, ["--reward_funcs", "failing_rewards:flaky", "--reward_weights", "1",
                                         "--max_new_tokens", "8", *extra])
    env = msrun_env(PYTHONPATH=str(tmp_path), MINDRLHF_TEST_REWARD=mode)
    start = time.monotonic()
    proc = run_command(grpo_msrun_command(logs, free_port(), args), env, timeout=300)
    took = time.monotonic() - start
    assert proc.returncode != 0, proc.stdout[-3000:]
    workers = {rank: (logs / f"worker_{rank}.log").read_text(errors="replace") for rank in (0, 1)}
    console = "".join(console_lines((proc.stdout + proc.stderr).splitlines(keepends=True)))  # run_grpo.sh's console
    return console, workers, (logs / "scheduler.log").read_text(errors="replace"), took, out


def error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("error:")]


def assert_ended_cleanly(console: str, workers: dict, scheduler: str) -> None:
    """One error line per rank, no traceback on the console, no heartbeat wall in the scheduler's log."""
    for rank, log in workers.items():
        assert len(error_lines(log)) == 1, (rank, error_lines(log), log[-3000:])
    assert "Traceback" not in console and "C++ Call Stack" not in console, console[-3000:]
    assert "timed out" not in scheduler and "abnormal" not in scheduler, scheduler[-3000:]


def test_a_reward_function_that_raises_on_one_rank_ends_every_rank_in_one_line(tmp_path, mindrecord):
    console, workers, scheduler, took, out = failed_job(tmp_path, mindrecord, "raise")
    assert_ended_cleanly(console, workers, scheduler)
    [line] = error_lines(workers[1])
    assert re.fullmatch(r"error: rank 1: step 1: reward function 'failing_rewards:flaky' raised ZeroDivisionError: "
                        r"division by zero at .*failing_rewards.py:9 \(traceback: .*traceback_rank_1.txt\)", line), line
    assert "return [1 / 0]" in (out / "traceback_rank_1.txt").read_text()
    assert error_lines(workers[0]) == ["error: rank 0: step 1: stopped at the reward functions: rank 1 failed there "
                                       "(its error line says why)"]
    assert took < 150, took


def test_a_reward_function_that_hangs_on_one_rank_ends_the_job_at_its_time_limit(tmp_path, mindrecord):
    console, workers, scheduler, took, _ = failed_job(tmp_path, mindrecord, "hang", ["--reward_timeout", "4"])
    assert_ended_cleanly(console, workers, scheduler)
    assert error_lines(workers[1]) == ["error: rank 1: step 1: reward function 'failing_rewards:flaky' did not "
                                       "return within 4 s for 8 completions (reward.reward_timeout)"]
    assert error_lines(workers[0])[0].startswith("error: rank 0: step 1: stopped at the reward functions: rank 1")
    assert took < 150, took  # the hang is 600 s


def test_a_full_disk_under_the_metrics_on_rank_0_ends_every_rank_in_one_line(tmp_path, mindrecord):
    # no reference or old-policy pass before the metrics (2 graphs a rank fewer): the failure is at the step's end
    console, workers, scheduler, took, out = failed_job(tmp_path, mindrecord, "", metrics_file="/dev/full", extra=[
        "--beta", "0", "--ref_model_sync_steps", "0", "--num_iterations", "1"])
    assert_ended_cleanly(console, workers, scheduler)
    assert error_lines(workers[0]) == [f"error: rank 0: step 1: {out / 'metrics.jsonl'}: cannot write this step's "
                                       "metrics (No space left on device); the lines before it and the checkpoints "
                                       "are intact"]
    assert error_lines(workers[1]) == ["error: rank 1: step 1: stopped at writing the step's metrics: rank 0 failed "
                                       "there (its error line says why)"]
