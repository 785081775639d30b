"""Launching test workers and jobs (msrun, CPU, several processes on this machine): always with a timeout, past which
the whole job is stopped, workers included (`mindrlhf.utils.jobs`)."""
import subprocess
import sys
from pathlib import Path

import numpy as np

from mindrlhf.utils.jobs import free_port, msrun_command, msrun_env, run_job_command, worker_log_tails
from support.paths import WORKERS_DIR

__all__ = ["free_port", "load_ranks", "msrun_command", "msrun_env", "run_command", "run_worker"]


def run_worker(script: str, args: list[str], workers: int, log_dir: Path, timeout: int = 600) -> None:
    """Runs tests/workers/<script> with `workers` processes (plain python when 1); fails with the logs and, for an
    msrun job, the rank that failed first."""
    script_path = WORKERS_DIR / script
    if workers == 1:
        cmd = [sys.executable, str(script_path), *args]
    else:
        cmd = msrun_command(script_path, args, workers, log_dir)
    try:
        proc = run_command(cmd, msrun_env(), timeout)
        stdout, stderr = proc.stdout, proc.stderr
        failure = f"failed ({proc.returncode})" if proc.returncode != 0 else None
    except subprocess.TimeoutExpired as timed_out:
        stdout, stderr = timed_out.stdout or "", timed_out.stderr or ""
        failure = f"did not finish in {timeout} s (stopped, workers included)"
    if failure:
        from mindrlhf.utils.postmortem import first_failed_worker

        first = first_failed_worker(stdout + stderr, str(log_dir)) if log_dir.exists() else None
        logs = worker_log_tails(log_dir) if log_dir.exists() else ""
        raise AssertionError(f"{' '.join(cmd)} {failure}{': ' + first if first else ''}:\n{stdout[-3000:]}\n"
                             f"{stderr[-3000:]}{logs}")


def run_command(cmd: list[str], env: dict | None = None, timeout: float = 600,
                cwd: str | None = None) -> subprocess.CompletedProcess:
    """Every subprocess of the tests: `subprocess.run(cmd, capture_output=True, text=True)` in a session of its own,
    stopped whole (its process tree) past `timeout` seconds (`subprocess.TimeoutExpired`) or when the test is
    interrupted (pytest-timeout, Ctrl-C)."""
    return run_job_command([str(part) for part in cmd], env, timeout, cwd)


def load_ranks(out_dir: Path, world: int) -> list[dict]:
    return [dict(np.load(out_dir / f"rank_{r}.npz")) for r in range(world)]
