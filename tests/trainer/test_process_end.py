"""How a launched process ends (`mindrlhf.trainer.launch.run_script` / `end_process`) and how a failure after the end
is reported (`mindrlhf.utils.postmortem`)."""
import sys

import pytest
from support.msrun import msrun_command, msrun_env, run_command
from support.paths import ROOT

from mindrlhf.trainer.launch import (
    CPU_COLLECTIVE_TIMEOUT_S,
    FINISHED,
    HEARTBEAT_S,
    PEER_GRACE_S,
    QUICK_HEARTBEAT_MAX_RANKS,
    collective_environment,
)
from mindrlhf.utils.jobs import run_job_command
from mindrlhf.utils.postmortem import crashed_after_finishing, first_failed_worker, main


def _worker_log(rank: int, pid: int, finished: int | None) -> str:
    lines = [f"10:00:00 [rank {rank}] INFO mindrlhf.trainer: rank {rank} of 2 started as pid {pid} on host",
             f"10:00:09 [rank {rank}] INFO mindrlhf.trainer: step 2/2 | critic/score/mean 0.5"]
    if finished is not None:
        lines.append(f"10:00:10 [rank {rank}] INFO mindrlhf.trainer: " + FINISHED % (rank, finished))
    return "\n".join(lines) + "\n"


def test_a_crash_after_every_rank_finished_is_named_as_such_and_the_job_is_done(tmp_path):
    """The report names the crash after the end, `--finished` exits 0 on it (run_grpo.sh then exits 0); a rank that
    never logged its end, or ended with an error, makes it an ordinary failure (`--finished` exits 1)."""
    msrun_output = "Worker process 4242 exit with exception. Error code: -11.\n"
    (tmp_path / "msrun.out").write_text(msrun_output)
    (tmp_path / "worker_0.log").write_text(_worker_log(0, 4242, 0))
    (tmp_path / "worker_1.log").write_text(_worker_log(1, 4343, 0))
    report = first_failed_worker(msrun_output, str(tmp_path))
    assert report == (f"rank 0 (pid 4242) crashed after the job had finished: killed by SIGSEGV (exit -11) once "
                      f"every rank had logged its exit 0 (the steps, checkpoints and metrics are complete); its log: "
                      f"{tmp_path}/worker_0.log")
    assert crashed_after_finishing(msrun_output, str(tmp_path)) == f"the job finished; msrun failed after it: {report}"
    assert main(["--finished", str(tmp_path / "msrun.out"), str(tmp_path)]) == 0
    for other in (None, 1):
        (tmp_path / "worker_1.log").write_text(_worker_log(1, 4343, other))
        assert first_failed_worker(msrun_output, str(tmp_path)).startswith(
            "rank 0 (pid 4242) failed first: killed by SIGSEGV (exit -11)")
        assert crashed_after_finishing(msrun_output, str(tmp_path)) is None
        assert main(["--finished", str(tmp_path / "msrun.out"), str(tmp_path)]) == 1
    assert crashed_after_finishing("All workers successfully exit!", str(tmp_path)) is None


def test_an_msrun_job_whose_rank_crashed_after_every_rank_finished_succeeds(tmp_path):
    """`run_job_command` on an msrun command line (here a stand-in `msrun` writing the workers' logs and failing as
    msrun does when a worker crashes in MindSpore's exit handler): exit 0 with the report when every rank had logged
    its end, msrun's own exit otherwise; another program's exit stays its own."""
    fake = tmp_path / "bin" / "msrun"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\necho 'Worker process 4242 exit with exception. Error code: -11.' >&2\nexit 1\n")
    fake.chmod(0o755)
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "worker_0.log").write_text(_worker_log(0, 4242, 0))
    (logs / "worker_1.log").write_text(_worker_log(1, 4343, 0))
    cmd = [str(fake), "--worker_num=2", f"--log_dir={logs}", "job.py"]
    done = run_job_command(cmd, timeout=60)
    assert done.returncode == 0
    assert done.stderr.endswith(f"\n{crashed_after_finishing(done.stderr, str(logs))}\n")
    assert "crashed after the job had finished: killed by SIGSEGV" in done.stderr
    (logs / "worker_1.log").write_text(_worker_log(1, 4343, None))
    assert run_job_command(cmd, timeout=60).returncode == 1
    (logs / "worker_1.log").write_text(_worker_log(1, 4343, 0))
    other = tmp_path / "bin" / "other"
    other.write_text(fake.read_text())
    other.chmod(0o755)
    assert run_job_command([str(other), f"--log_dir={logs}"], timeout=60).returncode == 1


def test_a_script_ends_with_mains_code_after_its_exit_handlers_and_logs_its_end(tmp_path):
    """`run_script(main)` outside msrun: the exit handlers registered by the job run (MindSpore's, the shared memory
    groups', the logging flush), the rank logs `FINISHED`, and the process exits with main's code, without the
    interpreter's own teardown (an object's finaliser that would run at teardown does not)."""
    marker = tmp_path / "atexit_ran"
    script = tmp_path / "job.py"
    script.write_text(
        "import atexit, sys\n"
        f"sys.path.insert(0, {str(ROOT)!r})\n"
        "from mindrlhf.trainer.launch import run_script\n"
        "from mindrlhf.utils.logging import setup_logging\n"
        "setup_logging(rank=0)\n"
        f"atexit.register(lambda: open({str(marker)!r}, 'w').write('yes'))\n"
        "class Teardown:\n"
        "    def __del__(self):\n"
        "        print('interpreter teardown ran', flush=True)\n"
        "kept = Teardown()\n"
        "run_script(lambda: 3)\n")
    done = run_command([sys.executable, str(script)], timeout=120)
    assert done.returncode == 3, done.stderr[-2000:]
    assert marker.read_text() == "yes"
    assert "rank 0 finished with exit 3" in done.stderr
    assert "interpreter teardown ran" not in done.stdout


def test_jobs_of_up_to_64_ranks_beat_within_a_second_unless_the_user_set_the_period():
    """MindSpore's 3-5 s heartbeat period made each launch wait up to a period at `init()` and one at exit."""
    quick = {"MS_RETRY_INTERVAL_LOWER": str(HEARTBEAT_S[0]), "MS_RETRY_INTERVAL_UPPER": str(HEARTBEAT_S[1])}
    timeout = {"MS_CPU_COMM_OP_TIMEOUT": "60"}  # set by the user: only the heartbeat is added
    assert max(HEARTBEAT_S) < 3 and QUICK_HEARTBEAT_MAX_RANKS == 64
    for ranks in ("1", "2", "64"):
        assert collective_environment({**timeout, "MS_WORKER_NUM": ranks}) == quick, ranks
    assert collective_environment({**timeout, "MS_WORKER_NUM": "65"}) == {}  # MindSpore's period at scale
    assert collective_environment(timeout) == {}  # not launched by msrun: no world size known
    for users in ({"MS_RETRY_INTERVAL_LOWER": "2"}, {"MS_RETRY_INTERVAL_UPPER": "7"}):
        assert collective_environment({**timeout, "MS_WORKER_NUM": "2", **users}) == {}, users


@pytest.mark.msrun
def test_ranks_that_fail_alike_end_the_job_without_a_heartbeat_wait(tmp_path):
    """Both ranks of an msrun job fail once the cluster formed (as a bad flag or checkpoint fails every rank): msrun
    kills every worker when the first exits non-zero, so a failed rank waits `PEER_GRACE_S` after unregistering from
    MindSpore's scheduler, in which time its peer unregisters too; the scheduler then ends with the job instead of
    waiting ~30 s for a killed rank's heartbeats and failing with a C++ stack."""
    assert PEER_GRACE_S > 1
    script = tmp_path / "job.py"
    script.write_text(
        "import sys\n"
        f"sys.path.insert(0, {str(ROOT)!r})\n"
        "from mindrlhf.trainer.launch import run_script, start_communication\n"
        "def main():\n"
        "    start_communication()\n"
        "    print('error: a bad input', file=sys.stderr, flush=True)\n"
        "    return 2\n"
        "run_script(main)\n")
    logs = tmp_path / "logs"
    done = run_command(msrun_command(script, [], 2, logs), msrun_env(), timeout=300)
    assert done.returncode != 0
    for rank in (0, 1):
        assert "error: a bad input" in (logs / f"worker_{rank}.log").read_text(errors="replace")
    scheduler = (logs / "scheduler.log").read_text(errors="replace")
    assert "timed out" not in scheduler and "abnormal" not in scheduler, scheduler[-3000:]


@pytest.mark.msrun
def test_a_rank_waits_for_a_late_peer_as_long_as_the_collective_timeout_allows(tmp_path):
    """MindSpore's CPU collectives give up on a peer that joins a call later than `MS_CPU_COMM_OP_TIMEOUT` seconds
    (their own default, 30-45 s, failed a 4-stage pipeline job on a loaded CPU: the first stage waited in its first
    exchange while the last one compiled its loss and backward): with 2 s, rank 0 fails waiting 6 s for rank 1;
    without it, `start_communication` (every rank of a job) sets `CPU_COLLECTIVE_TIMEOUT_S`, and rank 0 waits."""
    assert collective_environment({}) == {"MS_CPU_COMM_OP_TIMEOUT": str(CPU_COLLECTIVE_TIMEOUT_S)}
    assert CPU_COLLECTIVE_TIMEOUT_S >= 600 and collective_environment({"MS_CPU_COMM_OP_TIMEOUT": "60"}) == {}
    script = tmp_path / "job.py"
    script.write_text(
        "import os, sys, time\n"
        f"sys.path.insert(0, {str(ROOT)!r})\n"
        "from mindrlhf.trainer.launch import run_script, start_communication\n"
        "def main():\n"
        "    import mindspore as ms, numpy as np\n"
        "    from mindspore import nn, ops\n"
        "    ms.set_context(mode=ms.GRAPH_MODE, device_target='CPU')\n"
        "    _, rank = start_communication()\n"
        "    print('heartbeat period', os.environ.get('MS_RETRY_INTERVAL_LOWER'),\n"
        "          os.environ.get('MS_RETRY_INTERVAL_UPPER'), flush=True)\n"
        "    class Sum(nn.Cell):\n"
        "        def __init__(self):\n"
        "            super().__init__()\n"
        "            self.all_reduce = ops.AllReduce()\n"
        "        def construct(self, x):\n"
        "            return self.all_reduce(x)\n"
        "    total = Sum()\n"
        "    x = ms.Tensor(np.ones(4096, np.float32))\n"
        "    total(x)  # compiled and joined by both\n"
        "    if rank == 1:\n"
        "        time.sleep(6)\n"
        "    started = time.time()\n"
        "    assert float(total(x).asnumpy()[0]) == 2.0\n"
        "    print(f'rank {rank} waited {time.time() - started:.0f} s', flush=True)\n"
        "    return 0\n"
        "run_script(main)\n")
    env = {k: v for k, v in msrun_env().items() if k != "MS_CPU_COMM_OP_TIMEOUT"}
    # the failing half: rank 1 is killed before it leaves the cluster, so the scheduler waits out its heartbeat
    # (MS_NODE_TIMEOUT, 30 s by default) before the job ends; 10 s ends it sooner
    for name, extra in (("short", {"MS_CPU_COMM_OP_TIMEOUT": "2", "MS_NODE_TIMEOUT": "10"}), ("default", {})):
        done = run_command(msrun_command(script, [], 2, tmp_path / name), dict(env, **extra), timeout=300)
        log = (tmp_path / name / "worker_0.log").read_text(errors="replace")
        if name == "short":
            assert done.returncode != 0 and "wait receiving" in log, log[-3000:]
        else:
            assert done.returncode == 0, log[-3000:]
            assert "heartbeat period {} {}".format(*HEARTBEAT_S) in log, log[-3000:]  # set in a real job
            assert int(log.split("rank 0 waited ")[1].split(" s")[0]) >= 5

