"""Running a launched job (msrun, `run_grpo.sh`) as a subprocess that can always be stopped whole.

msrun starts each worker in a process group of its own, so a signal to msrun's group does not reach them; a job is
therefore stopped by its process tree, as seen before the first signal: SIGINT to the job's group (msrun then stops
its workers and exits), SIGKILL to every process of the tree still there after a grace period.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import psutil

from mindrlhf.utils.postmortem import crashed_after_finishing


def free_port() -> int:
    """A TCP port of this machine that is free now (for msrun's `--master_port`)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def msrun_env(**extra: str) -> dict:
    """This process's environment for an msrun job: the running virtualenv's `msrun` first on PATH, MindSpore's
    errors only (unless GLOG_v is set) and every worker's thread stacks printed if it crashes."""
    env = dict(os.environ, PATH=str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", ""))
    env.setdefault("GLOG_v", "3")
    env["PYTHONFAULTHANDLER"] = "1"
    env.update(extra)
    return env


def msrun_command(script: str | Path, args: list[str], workers: int, log_dir: str | Path,
                  port: int | None = None) -> list[str]:
    """`msrun` running `workers` processes of `script args` on this machine, logs in `log_dir`."""
    return [str(Path(sys.executable).parent / "msrun"), f"--worker_num={workers}", f"--local_worker_num={workers}",
            f"--master_port={port or free_port()}", "--join=True", f"--log_dir={log_dir}", str(script), *args]


def worker_log_tails(log_dir: str | Path, lines: int = 40) -> str:
    """The last `lines` lines of each `worker_*.log` in `log_dir` (MindSpore's warnings left out), for a failure
    report."""
    tails = ""
    for log in sorted(Path(log_dir).glob("worker_*.log")):
        kept = [line for line in log.read_text(errors="replace").splitlines() if "WARNING" not in line]
        tails += f"\n--- {log} (tail) ---\n" + "\n".join(kept[-lines:])
    return tails


def run_job_command(cmd: list[str], env: dict | None = None, timeout: float | None = None,
                    cwd: str | None = None) -> subprocess.CompletedProcess:
    """`subprocess.run(cmd, capture_output=True, text=True)` in a session of its own. Past `timeout` seconds, or
    when the caller is interrupted (Ctrl-C, a test's timeout), the whole job is stopped (`stop_job`); a timeout
    then raises `subprocess.TimeoutExpired` with the output so far. An msrun job that failed only because a rank
    crashed after every rank had logged its successful end is done (`postmortem.crashed_after_finishing`): exit 0,
    the report at the end of its stderr."""
    proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        stop_job(proc)
        stdout, stderr = proc.communicate()
        raise subprocess.TimeoutExpired(cmd, timeout, stdout, stderr) from None
    except BaseException:
        stop_job(proc)
        raise
    code = proc.returncode
    log_dir = _msrun_log_dir(cmd)
    if code != 0 and log_dir is not None:
        report = crashed_after_finishing(stdout + stderr, log_dir)
        if report is not None:
            code, stderr = 0, f"{stderr}{report}\n"
    return subprocess.CompletedProcess(cmd, code, stdout, stderr)


def _msrun_log_dir(cmd: list[str]) -> str | None:
    """The `--log_dir` of an msrun command line; None for any other command."""
    if not cmd or Path(cmd[0]).name != "msrun":
        return None
    return next((part.split("=", 1)[1] for part in cmd if part.startswith("--log_dir=")), None)


def stop_job(proc: subprocess.Popen, grace: float = 15.0) -> None:
    """Stops a job started in a session of its own and everything it started: SIGINT to its process group first
    (msrun then stops its workers), SIGKILL after `grace` seconds to every process of its tree still running."""
    stop_process_tree(proc.pid, grace, whole_group=True)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def stop_process_tree(pid: int, grace: float = 15.0, whole_group: bool = False) -> list[int]:
    """Stops process `pid` and every process it started, whatever their process groups (msrun puts each worker in
    one of its own): SIGINT to `pid` (or its process group), so that msrun stops its workers and scheduler, then
    SIGKILL to whatever of the tree (as seen before the signal) still runs after `grace` seconds. Returns the pids
    that had to be killed."""
    try:
        tree = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        tree = []
    try:
        (os.killpg if whole_group else os.kill)(pid, signal.SIGINT)
    except ProcessLookupError:
        pass
    _, alive = psutil.wait_procs(tree, timeout=grace)
    for process in alive:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=grace)
    return [process.pid for process in alive]


def main(argv: list[str] | None = None) -> int:
    """`python -m mindrlhf.utils.jobs stop PID [GRACE]`: `stop_process_tree` for a shell script (run_grpo.sh)."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) not in (2, 3) or args[0] != "stop" or not args[1].isdigit():
        print("usage: python -m mindrlhf.utils.jobs stop PID [GRACE_SECONDS]", file=sys.stderr)
        return 2
    stop_process_tree(int(args[1]), float(args[2]) if len(args) == 3 else 15.0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
