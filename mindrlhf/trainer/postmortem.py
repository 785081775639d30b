"""Which rank ended a failed msrun job first, from msrun's output and the workers' logs.

When a worker dies, msrun logs `Worker process <pid> exit with exception. Error code: <code>.` and kills the
others; MindSpore's scheduler then reports whichever node's heartbeat it missed first, which is often a rank
msrun killed, not the one that died. Each worker logs its pid at start-up (`run_job`), so the pid msrun names
maps back to a rank and its log file. A rank that crashes after every rank logged its successful end
(`launch.FINISHED`) is named as such: the job's work is complete.

    python -m mindrlhf.trainer.postmortem MSRUN_OUTPUT LOG_DIR
"""
from __future__ import annotations

import glob
import os
import re
import signal
import sys

WORKER_EXIT = re.compile(r"Worker process (\d+) exit with exception\. Error code: (-?\d+)")
WORKER_PID = re.compile(r"\[rank (\d+)\] .*started as pid (\d+)")
RANK_FINISHED = re.compile(r"rank (\d+) finished with exit (-?\d+)")  # launch.FINISHED


def describe_exit_code(code: int) -> str:
    """'exit 3', or 'killed by SIGKILL (exit -9)' for a negative (signal) code."""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name} (exit {code})"
        except ValueError:
            return f"killed by signal {-code} (exit {code})"
    return f"exit {code}"


def first_failed_worker(msrun_output: str, log_dir: str) -> str | None:
    """One line naming the rank msrun saw fail first, its exit and its log; None if msrun names no worker or
    no log names its pid."""
    found = WORKER_EXIT.search(msrun_output)
    if found is None:
        return None
    pid, code = int(found.group(1)), int(found.group(2))
    logs = {log: _read(log) for log in sorted(glob.glob(os.path.join(log_dir, "worker_*.log")))}
    for log, text in logs.items():
        for started in WORKER_PID.finditer(text):
            if int(started.group(2)) == pid:
                rank = started.group(1)
                if _every_rank_succeeded(logs.values()):
                    return (f"rank {rank} (pid {pid}) crashed after the job had finished: {describe_exit_code(code)} "
                            f"once every rank had logged its exit 0 (the steps, checkpoints and metrics are "
                            f"complete); its log: {log}")
                return f"rank {rank} (pid {pid}) failed first: {describe_exit_code(code)}; its log: {log}"
    return None  # it failed before logging its pid (a bad flag or config: its `error:` line says why)


def _read(path: str) -> str:
    with open(path, errors="replace") as f:
        return f.read()


def _every_rank_succeeded(log_texts) -> bool:
    """Every worker log ends its rank with `launch.FINISHED` and exit 0."""
    codes = [[int(m.group(2)) for m in RANK_FINISHED.finditer(text)] for text in log_texts]
    return bool(codes) and all(found and found[-1] == 0 for found in codes)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print(__doc__.strip().splitlines()[-1].strip(), file=sys.stderr)
        return 2
    with open(argv[0], errors="replace") as f:
        report = first_failed_worker(f.read(), argv[1])
    if report:
        print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
