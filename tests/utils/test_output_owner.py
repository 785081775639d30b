"""`mindrlhf.utils.output_owner`: one run per output folder. A live holder of `run.lock` refuses a second one in a
line naming its pid and host, a dead one's lock is taken, this process's ancestors' lock is its own run's; and what
an earlier run left (checkpoints, metrics) is found, described and deleted, while converted inputs and logs do not
count."""
import contextlib
import gc
import json
import os
import socket
import subprocess
import sys
import time

import pytest

from mindrlhf.utils import output_owner
from mindrlhf.utils.output_owner import (
    OutputInUse,
    check,
    claimed,
    find_leftovers,
    hold,
    job_of,
    job_owner_pid,
    release,
)

# a process that holds FOLDER's lock (as a run does) until its stdin closes
HOLDER = ("import sys\nfrom mindrlhf.utils import output_owner\noutput_owner.hold(sys.argv[1])\n"
          "print('held', flush=True)\nsys.stdin.read()\n")
# a process that takes FOLDER's flock and replaces the record there (an earlier run's) only after a while, then waits
SLOW_WRITER = ("import fcntl, json, os, socket, sys, time\n"
               "fd = os.open(sys.argv[1] + '/run.lock', os.O_RDWR | os.O_CREAT)\n"
               "fcntl.flock(fd, fcntl.LOCK_EX)\nprint('locked', flush=True)\ntime.sleep(0.5)\nos.ftruncate(fd, 0)\n"
               "record = {'pid': os.getpid(), 'host': socket.gethostname(), 'start': 'then'}\n"
               "os.write(fd, json.dumps(record).encode())\nsys.stdin.read()\n")
# a child of this process: whether it may take FOLDER (its parent, the test, holds it)
CHILD = ("import sys\nfrom mindrlhf.utils import output_owner\noutput_owner.check(sys.argv[1])\n"
         "output_owner.hold(sys.argv[1])\nprint(output_owner.claimed(sys.argv[1]))\n")


@contextlib.contextmanager
def started(script: str, folder, ready: str):
    """A Python process running `script` on `folder`, once it has printed `ready`; killed at the end."""
    proc = subprocess.Popen([sys.executable, "-c", script, str(folder)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == ready
        yield proc
    finally:
        proc.kill()
        proc.wait(timeout=30)


def test_a_second_run_is_refused_naming_the_first_and_a_dead_ones_lock_is_taken(tmp_path):
    folder = tmp_path / "out"
    with started(HOLDER, folder, "held") as first:
        record = json.loads((folder / "run.lock").read_text())
        assert record["pid"] == first.pid and record["host"] == socket.gethostname()
        assert "-c" in record["command"]
        message = (f"{folder}: in use by another run (pid {first.pid} on host {socket.gethostname()} since "
                   f"{record['start']}); wait for it to end or choose another --output_dir")
        for attempt in (hold, check):
            with pytest.raises(OutputInUse) as refused:
                attempt(str(folder))
            assert str(refused.value) == message
        assert not claimed(str(folder))
    # killed: its lock went with it, its record is overwritten
    hold(str(folder), keep_while=(owner := Run()))
    try:
        assert claimed(str(folder))
        assert json.loads((folder / "run.lock").read_text())["pid"] == os.getpid()
        check(str(folder))  # this process's own
    finally:
        release(str(folder))
    del owner


def test_the_record_written_after_the_lock_is_waited_for(tmp_path):
    """A run that has the flock but has not written its record yet (the lock file still names a dead earlier run) is
    waited for, up to `SETTLE_S`: the refusal names the run, not the stale record."""
    folder = tmp_path / "out"
    folder.mkdir()
    (folder / "run.lock").write_text(json.dumps({"pid": 999999999, "host": socket.gethostname(), "start": "x"}))
    with started(SLOW_WRITER, folder, "locked") as run:
        start = time.monotonic()
        with pytest.raises(OutputInUse, match=rf"\(pid {run.pid} on host .* since then\)"):
            check(str(folder))
        assert time.monotonic() - start < output_owner.SETTLE_S


def test_a_lock_an_ancestor_holds_is_this_runs(tmp_path):
    """The test process holds the lock (as run_grpo.sh or msrun would): its child is part of its run, and owns the
    folder with it."""
    folder = tmp_path / "out"
    owner = Run()
    hold(str(folder), keep_while=owner)
    try:
        child = subprocess.run([sys.executable, "-c", CHILD, str(folder)], capture_output=True, text=True,
                               timeout=60)
        assert child.returncode == 0 and child.stdout.strip() == "True", child.stderr
        assert json.loads((folder / "run.lock").read_text())["pid"] == os.getpid()  # the record left alone
    finally:
        release(str(folder))


class Run:
    """Stands for a job: the lock `hold` takes for it lives as long as it does."""


def test_the_lock_lives_as_long_as_its_job_and_a_folder_it_made_for_nothing_goes(tmp_path):
    made, used = tmp_path / "made", tmp_path / "used"
    for folder in (made, used):
        job = Run()
        hold(str(folder), keep_while=job)
        if folder == used:
            (folder / "metrics.jsonl").write_text('{"step": 1}\n')
        del job
        gc.collect()
        assert not claimed(str(folder))
    assert not made.exists()  # a job that failed before writing anything leaves nothing
    assert sorted(p.name for p in used.iterdir()) == ["metrics.jsonl", "run.lock"]
    with started(HOLDER, used, "held"):  # free for the next run
        pass


def test_who_takes_the_lock_of_a_job_and_who_is_part_of_it():
    """A process alone takes it; under msrun, rank 0 (node 0) takes it for msrun, its parent, and the job's other
    processes only check it. A process of the same msrun job (the same scheduler address, from another node) is
    part of the owning run."""
    assert job_owner_pid({}) == os.getpid()
    assert job_owner_pid({"MS_WORKER_NUM": "4"}) == os.getpid()  # run_grpo.sh's flag check
    assert job_owner_pid({"MS_ROLE": "MS_WORKER", "MS_NODE_ID": "0", "MS_WORKER_NUM": "2"}) == os.getppid()
    assert job_owner_pid({"MS_ROLE": "MS_WORKER", "MS_NODE_ID": "1"}) is None
    assert job_owner_pid({"MS_ROLE": "MS_WORKER"}) is None  # several nodes without msrun's --node_rank
    assert job_owner_pid({"MS_ROLE": "MS_SCHED"}) is None
    assert job_of({"MS_SCHED_HOST": "127.0.0.1", "MS_SCHED_PORT": "8118"}) == "127.0.0.1:8118"
    assert job_of({}) is None and output_owner.job_address("[::1]", 9) == "::1:9"


def test_a_process_of_the_owning_msrun_job_is_part_of_it(tmp_path):
    folder = tmp_path / "out"
    script = HOLDER.replace("output_owner.hold(sys.argv[1])", "output_owner.hold(sys.argv[1], job='10.0.0.1:8118')")
    with started(script, folder, "held") as node0:
        check(str(folder), job="10.0.0.1:8118")  # another node's rank, or its flag check
        with pytest.raises(OutputInUse, match=rf"in use by another run \(pid {node0.pid} "):
            check(str(folder), job="10.0.0.1:8119")


def test_the_command_line_holds_an_inherited_descriptor(tmp_path, capsys):
    """run_grpo.sh's form: the lock on a descriptor the script opened, for the script's pid."""
    folder = tmp_path / "out"
    with started(HOLDER, folder, "held") as first:
        fd = os.open(folder / "run.lock", os.O_WRONLY | os.O_APPEND)
        try:
            assert output_owner.main(["hold", "--fd", str(fd), "--pid", "1", str(folder)]) == output_owner.IN_USE
        finally:
            os.close(fd)
        err = capsys.readouterr().err
        assert err.startswith(f"error: {folder}: in use by another run (pid {first.pid} on host ")
        assert err.rstrip().endswith("wait for it to end or choose another OUTPUT")
    fd = os.open(folder / "run.lock", os.O_WRONLY | os.O_APPEND)
    try:
        assert output_owner.main(["hold", "--fd", str(fd), "--pid", "1", "--job", "127.0.0.1:8118", str(folder)]) == 0
        record = json.loads((folder / "run.lock").read_text())
        assert record["pid"] == 1 and record["job"] == "127.0.0.1:8118"
    finally:
        os.close(fd)
        release(str(folder))


# ---------------------------------------------------------------------- what an earlier run left
def a_run_folder(folder, complete=(1, 2), partial=(), metrics=(1, 2)):
    checkpoints = folder / "checkpoints"
    for step in complete:
        (checkpoints / f"step_{step:06d}" / "rank_0").mkdir(parents=True)
        (checkpoints / f"step_{step:06d}" / "meta.json").write_text("{}")
    for step in partial:
        (checkpoints / f".step_{step:06d}.partial").mkdir(parents=True)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 0.5}) + "\n" for s in metrics))
    return folder


@pytest.mark.parametrize("complete, partial, metrics, described", [
    ((1, 2), (), (1, 2), "checkpoints step_000001..step_000002 and metrics of 2 steps"),
    ((10,), (), (), "checkpoint step_000010"),
    ((), (3,), (), "partial checkpoint .step_000003.partial"),
    ((2,), (3,), (0, 1, 2, 3), "checkpoint step_000002, partial checkpoint .step_000003.partial and metrics of 3 "
                               "steps"),
    ((), (), (1,), "metrics of 1 step"),
    ((), (), (0,), "a metrics.jsonl of 1 line"),  # the evaluation before the first step
])
def test_each_kind_of_leftover_is_found_and_described(tmp_path, complete, partial, metrics, described):
    folder = a_run_folder(tmp_path / "out", complete, partial, metrics)
    leftovers = find_leftovers(str(folder), str(folder / "checkpoints"))
    assert leftovers and leftovers.describe() == described


def test_an_empty_folder_or_one_of_converted_inputs_and_logs_holds_no_run(tmp_path):
    folder = tmp_path / "out"
    assert not find_leftovers(str(folder), str(folder / "checkpoints"))  # not made yet
    folder.mkdir()
    assert not find_leftovers(str(folder), str(folder / "checkpoints"))
    for name in ("policy.ckpt", "prompts.mindrecord", "heldout.mindrecord", "msrun.out", "run.lock", "metrics.jsonl"):
        (folder / name).write_text("")  # an empty metrics.jsonl too
    for name in ("msrun_log", "strategy/train", "checkpoints", "node_1", "tensorboard"):
        (folder / name).mkdir(parents=True)
    (folder / "checkpoints" / "step_notes.txt").write_text("")
    assert not find_leftovers(str(folder), str(folder / "checkpoints"))
    (folder / "metrics.jsonl").unlink()
    (folder / "metrics.jsonl").symlink_to("/dev/zero")  # a device reads forever: not a run's metrics
    assert not find_leftovers(str(folder), str(folder / "checkpoints"))


def test_the_leftovers_are_deleted_and_the_rest_stays(tmp_path):
    folder = a_run_folder(tmp_path / "out", (1, 2), (3,), (1, 2))
    tensorboard = folder / "tensorboard"
    tensorboard.mkdir()
    (tensorboard / "events.out.tfevents.1.vm").write_text("")
    keep = [folder / name for name in ("policy.ckpt", "prompts.mindrecord", "msrun.out", "run.lock")]
    for path in keep:
        path.write_text("")
    (folder / "progress.png").write_bytes(b"\x89PNG")
    (folder / "completions.jsonl").write_text("{}\n")
    deleted = output_owner.delete_leftovers(str(folder), str(folder / "checkpoints"), [str(tensorboard)])
    assert len(deleted) == 7
    assert not find_leftovers(str(folder), str(folder / "checkpoints"))
    assert sorted(p.name for p in folder.iterdir()) == sorted(["checkpoints", "tensorboard", *(p.name for p in keep)])
    assert list((folder / "checkpoints").iterdir()) == [] and list(tensorboard.iterdir()) == []
