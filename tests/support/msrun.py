"""Launching test workers under msrun (CPU, several processes on this machine)."""
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np

from support.paths import WORKERS_DIR


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_worker(script: str, args: list[str], workers: int, log_dir: Path, timeout: int = 600) -> None:
    """Runs tests/workers/<script> with `workers` processes (plain python when 1); fails with the logs."""
    env = dict(os.environ)
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    env.setdefault("GLOG_v", "3")
    script_path = str(WORKERS_DIR / script)
    if workers == 1:
        cmd = [sys.executable, script_path, *args]
    else:
        cmd = [str(Path(sys.executable).parent / "msrun"), f"--worker_num={workers}", f"--local_worker_num={workers}",
               f"--master_port={free_port()}", "--join=True", f"--log_dir={log_dir}", script_path, *args]
    try:
        proc = run_command(cmd, env, timeout)
        stdout, stderr = proc.stdout, proc.stderr
        failure = f"failed ({proc.returncode})" if proc.returncode != 0 else None
    except subprocess.TimeoutExpired as timed_out:
        stdout, stderr = timed_out.stdout or "", timed_out.stderr or ""
        failure = f"did not finish in {timeout} s"
    if failure:
        logs = ""
        if log_dir.exists():
            for log in sorted(log_dir.glob("worker_*.log")):
                lines = [ln for ln in log.read_text(errors="replace").splitlines() if "WARNING" not in ln]
                logs += f"\n--- {log.name} (tail) ---\n" + "\n".join(lines[-40:])
        raise AssertionError(f"{' '.join(cmd)} {failure}:\n{stdout[-3000:]}\n{stderr[-3000:]}{logs}")


def run_command(cmd: list[str], env: dict, timeout: float) -> subprocess.CompletedProcess:
    """`subprocess.run(cmd, capture_output=True, text=True)` in a session of its own; past `timeout` the whole job
    is stopped (`stop_job`) and `subprocess.TimeoutExpired` raised with the output so far."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        stop_job(proc)
        stdout, stderr = proc.communicate()
        raise subprocess.TimeoutExpired(cmd, timeout, stdout, stderr) from None
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def stop_job(proc: subprocess.Popen, grace: float = 15.0) -> None:
    """Stops a job started in a session of its own: SIGINT to its process group first (msrun, also under
    `bash run_grpo.sh`, then kills its workers, which run in process groups of their own and would otherwise keep
    computing after msrun is gone), SIGKILL to the group after `grace` seconds."""
    try:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=grace)
    except ProcessLookupError:
        return
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def load_ranks(out_dir: Path, world: int) -> list[dict]:
    return [dict(np.load(out_dir / f"rank_{r}.npz")) for r in range(world)]
