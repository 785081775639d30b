"""Which rank ended a failed msrun job first, from msrun's output and the workers' logs.

When a worker dies, msrun logs `Worker process <pid> exit with exception. Error code: <code>.` and kills the
others; MindSpore's scheduler then reports whichever node's heartbeat it missed first, which is often a rank
msrun killed, not the one that died. Each worker logs its pid at start-up (`run_job`), so the pid msrun names
maps back to a rank and its log file. A rank that crashes after every rank logged its successful end
(`launch.FINISHED`, after a barrier) is named as such: the job's work is complete, and the job counts as done
(`crashed_after_finishing`; MindSpore's exit handler, which must run for the scheduler to see the rank leave, now and
then crashes in its network threads' teardown).

The console shows msrun's output without what repeats the workers' own words in a less useful form: msrun's own
Python traceback ending in `RuntimeError: Distributed job exited with exception` (the failure is the workers'
`error:` lines and the rank named here), and MindSpore's INFO lines that its network threads print at exit
whatever `GLOG_v` says. `msrun.out` keeps everything.

    python -m mindrlhf.utils.postmortem MSRUN_OUTPUT LOG_DIR
    python -m mindrlhf.utils.postmortem --finished MSRUN_OUTPUT LOG_DIR   (exit 0: the job had finished)
    msrun ... | python -m mindrlhf.utils.postmortem --console
"""
from __future__ import annotations

import glob
import os
import re
import signal
import sys
from collections.abc import Iterable, Iterator

WORKER_EXIT = re.compile(r"Worker process (\d+) exit with exception\. Error code: (-?\d+)")
WORKER_PID = re.compile(r"\[rank (\d+)\] .*started as pid (\d+)")
RANK_FINISHED = re.compile(r"rank (\d+) finished with exit (-?\d+)")  # launch.FINISHED
MINDSPORE_INFO = re.compile(r"^\[(INFO|DEBUG)\] [A-Z_]+\(\d+,")
TRACEBACK = "Traceback (most recent call last):"
MSRUN_FRAME = re.compile(r'^  File ".*[/\\]msrun", line \d+')
MSRUN_FAILED = "RuntimeError: Distributed job exited with exception"
JOB_FINISHED = "the job finished; msrun failed after it: "  # crashed_after_finishing's line starts so


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
    failure = _failed_worker(msrun_output, log_dir)
    return failure[0] if failure else None


def crashed_after_finishing(msrun_output: str, log_dir: str) -> str | None:
    """The launchers' line (`JOB_FINISHED` and `first_failed_worker`'s report) when the worker msrun saw fail had
    crashed after every rank had logged its successful end: the job is done, and a launcher shows the line and exits
    0. None otherwise."""
    failure = _failed_worker(msrun_output, log_dir)
    return f"{JOB_FINISHED}{failure[0]}" if failure and failure[1] else None


def _failed_worker(msrun_output: str, log_dir: str) -> tuple[str, bool] | None:
    """(the report line, whether every rank had logged its successful end) for the worker msrun saw fail first."""
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
                            f"complete); its log: {log}", True)
                return f"rank {rank} (pid {pid}) failed first: {describe_exit_code(code)}; its log: {log}", False
    return None  # it failed before logging its pid (a bad flag or config: its `error:` line says why)


def console_lines(lines: Iterable[str]) -> Iterator[str]:
    """msrun's output as the console shows it: msrun's own traceback (first frame in `msrun`, last line
    `MSRUN_FAILED`) and MindSpore's INFO lines left out, every other line passed on as it comes."""
    held: list[str] = []  # a traceback not yet known to be msrun's own or another's
    for line in lines:
        if held:
            if len(held) == 1 and not MSRUN_FRAME.match(line):
                yield held.pop()  # another program's traceback: shown whole, as it comes
            elif line.startswith((" ", "\t")):
                held.append(line)
                continue
            else:
                if line.startswith(MSRUN_FAILED):
                    held = []
                    continue
                yield from held  # msrun failed otherwise: its traceback is the news
                held = []
        if line.rstrip("\n") == TRACEBACK:
            held = [line]
        elif not MINDSPORE_INFO.match(line):
            yield line
    yield from held


def _read(path: str) -> str:
    with open(path, errors="replace") as f:
        return f.read()


def _every_rank_succeeded(log_texts) -> bool:
    """Every worker log ends its rank with `launch.FINISHED` and exit 0."""
    codes = [[int(m.group(2)) for m in RANK_FINISHED.finditer(text)] for text in log_texts]
    return bool(codes) and all(found and found[-1] == 0 for found in codes)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv == ["--console"]:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C stops the job; the console shows its last lines
        for line in console_lines(iter(sys.stdin.readline, "")):
            sys.stdout.write(line)
            sys.stdout.flush()
        return 0
    finished = argv[:1] == ["--finished"]
    paths = argv[1:] if finished else argv
    if len(paths) != 2:
        print("\n".join(line.strip() for line in __doc__.strip().splitlines()[-3:]), file=sys.stderr)
        return 2
    with open(paths[0], errors="replace") as f:
        msrun_output = f.read()
    report = (crashed_after_finishing if finished else first_failed_worker)(msrun_output, paths[1])
    if report:
        print(report)
    return 0 if report or not finished else 1


if __name__ == "__main__":
    sys.exit(main())
