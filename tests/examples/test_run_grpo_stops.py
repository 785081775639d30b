"""`bash run_grpo.sh` owns its job: a signal to the script (`kill`, `timeout`, a scheduler) or to its process group
(Ctrl-C) stops msrun, its scheduler and every worker, the script says so in one line and exits 128 + the signal;
the last complete checkpoint resumes, and a rerun into the same OUTPUT keeps the earlier run's logs."""
import json
import os
import signal
import time
import uuid

import pytest
from support.jobs import started_job
from support.msrun import free_port
from support.paths import RUN_GRPO
from support.processes import described, tagged_processes

from mindrlhf.checkpoint.step import complete_checkpoints

pytestmark = pytest.mark.msrun
JOB_TAG = "MINDRLHF_TEST_JOB"  # every process of one launch inherits it


def stop_when(out, log, extra_args, ready, stop) -> tuple[int, str, float]:
    """Launches run_grpo.sh on the bundled job into `out`; once `ready()`, `stop(pid)` signals the script; returns
    (its exit code, its output, the seconds it took to end)."""
    tag = uuid.uuid4().hex
    env = dict(os.environ, OUTPUT=str(out), EVAL_DATA="", MASTER_PORT=str(free_port()), GLOG_v="3", **{JOB_TAG: tag})
    cmd = ["bash", RUN_GRPO, "--steps", "50", "--save_interval", "1", "--keep_last", "3", *extra_args]
    with started_job(cmd, log, env) as job:
        deadline = time.time() + 600
        while not ready():
            assert job.poll() is None and time.time() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        stopped_at = time.time()
        stop(job.pid)
        code = job.wait(timeout=120)
        took = time.time() - stopped_at
        time.sleep(1.0)
        left = [described(p) for p in tagged_processes(JOB_TAG, tag)]
        assert left == [], f"processes of the stopped job still running: {left}"
    return code, log.read_text(errors="replace"), took


def test_a_signal_stops_the_whole_job_which_then_resumes_from_its_last_checkpoint(tmp_path):
    out = tmp_path / "out"
    checkpoints = str(out / "checkpoints")
    # `kill <pid>`, mid-step: SIGTERM to the script alone (msrun and each worker are in other process groups)
    code, output, took = stop_when(out, tmp_path / "first.out", [], lambda: len(complete_checkpoints(checkpoints)) > 0,
                                   lambda pid: (time.sleep(1.0), os.kill(pid, signal.SIGTERM)))
    assert code == 143 and took < 60, (code, took, output[-3000:])
    assert "run_grpo.sh: stopped by SIGTERM; stopping msrun and its workers" in output, output[-3000:]
    last = complete_checkpoints(checkpoints)[-1]
    step = json.loads((out / "checkpoints" / os.path.basename(last) / "meta.json").read_text())["step"]

    # Ctrl-C: SIGINT to the script's process group, once a run with --resume has loaded that checkpoint
    log = out / "msrun_log" / "worker_0.log"
    code, output, took = stop_when(out, tmp_path / "second.out", ["--resume"],
                                   lambda: log.is_file() and "resumed from" in log.read_text(errors="replace"),
                                   lambda pid: os.killpg(pid, signal.SIGINT))
    assert code == 130 and took < 60, (code, took, output[-3000:])
    assert "run_grpo.sh: stopped by SIGINT" in output, output[-3000:]
    assert f"resumed from {last} (step {step})" in log.read_text(errors="replace")
    # the first run's logs were kept, renamed after their time
    assert len(list(out.glob("msrun_log.*"))) == 1 and len(list(out.glob("msrun.out.*"))) == 1
    assert "step 1/50" in next(out.glob("msrun.out.*")).read_text(errors="replace")
