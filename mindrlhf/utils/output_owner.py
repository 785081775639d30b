"""Who owns an output folder: the run that holds the exclusive `flock` on `<folder>/run.lock` (its JSON content names
the owner: pid, host, start time, command, and for an msrun job the address of its scheduler), and what an earlier
run left there (checkpoints, metrics), which a new run must not mix with.

The lock is released when its holder ends, however it ends: a lock file left by a dead run is no obstacle. A process
finding the lock held is part of the owning run when the owner is itself or one of its ancestors on this host
(run_grpo.sh, msrun), or the same msrun job (its scheduler's address: another node's). Standard library and psutil
only. run_grpo.sh takes the lock on a descriptor its processes inherit::

    exec 9>>"$OUTPUT/run.lock"
    python -m mindrlhf.utils.output_owner hold --fd 9 --pid $$ --job "$MASTER_ADDR:$MASTER_PORT" "$OUTPUT"
"""
from __future__ import annotations

import argparse
import fcntl
import glob
import ipaddress
import json
import os
import re
import shlex
import shutil
import socket
import sys
import time
import weakref
from dataclasses import dataclass

import psutil

LOCK_FILE = "run.lock"
METRICS_FILE = "metrics.jsonl"
COMPLETIONS_FILE = "completions.jsonl"  # --log_completions
PROGRESS_PLOT = "progress.png"
TENSORBOARD_EVENTS = "events.out.tfevents.*"
IN_USE = 2  # exit code of `python -m mindrlhf.utils.output_owner hold` when another run holds the folder
# a held lock whose record does not (yet) name a live owner is retried this long: the holder may not have written
# it yet, or a check (which holds the lock for an instant) may stand in the owner's way
SETTLE_S = 2.0
_POLL_S = 0.05
_STEP = re.compile(r"^step_(\d+)$")
_PARTIAL = re.compile(r"^\.step_(\d+)\.partial$")
# folders this process owns (real path -> the descriptor it holds the lock on, or None: an ancestor holds it)
_CLAIMED: dict[str, int | None] = {}


class OutputInUse(ValueError):
    """Another live run holds the folder's lock; the message names it (pid, host, since when)."""


def lock_path(folder: str) -> str:
    return os.path.join(folder, LOCK_FILE)


def job_address(host: str, port) -> str:
    """`ip:port` of an msrun job's scheduler, as msrun gives it its workers (`MS_SCHED_HOST`: a host name resolved)."""
    host = host.strip().removeprefix("[").removesuffix("]")
    try:
        ip = str(ipaddress.ip_address(host))
    except ValueError:
        try:
            ip = socket.getaddrinfo(host, None, socket.AF_UNSPEC, socket.SOCK_STREAM)[0][4][0]
        except (OSError, IndexError):
            ip = host
    return f"{ip}:{port}"


def job_of(environ) -> str | None:
    """The msrun job this process belongs to (its scheduler's `job_address`), if any."""
    host, port = environ.get("MS_SCHED_HOST"), environ.get("MS_SCHED_PORT")
    return job_address(host, port) if host and port else None


def job_owner_pid(environ) -> int | None:
    """The pid a job's lock is taken for, if this process takes it: its own when alone, msrun's (the workers' parent)
    for msrun's rank 0 (`MS_NODE_ID` 0, on node 0); None for msrun's other processes, which only check it."""
    if "MS_ROLE" not in environ:
        return os.getpid()
    return os.getppid() if environ["MS_ROLE"] == "MS_WORKER" and environ.get("MS_NODE_ID") == "0" else None


def owner_record(pid: int, job: str | None = None) -> dict:
    """The lock file's content for the run of process `pid` on this host (`start` to read, `time` to compare)."""
    try:
        command = shlex.join(psutil.Process(pid).cmdline())
    except psutil.Error:
        command = shlex.join(sys.argv)
    return {"pid": pid, "host": socket.gethostname(), "start": time.strftime("%Y-%m-%d %H:%M:%S"),
            "time": time.time(), "command": command, "job": job}


def read_record(folder: str) -> dict | None:
    """The owner record in the folder's lock file; None when there is none or it is not (yet) complete."""
    try:
        with open(lock_path(folder), encoding="utf-8") as f:
            record = json.load(f)
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and isinstance(record.get("pid"), int) else None


def is_own_run(record: dict, job: str | None = None) -> bool:
    """Whether this process is part of the run `record` names: it is the owner or its descendant on this host, or
    of its msrun `job`."""
    if job and record.get("job") == job:
        return True
    if record.get("host") != socket.gethostname():
        return False
    me = psutil.Process()
    return record.get("pid") in {me.pid, *(parent.pid for parent in me.parents())}


def _names_live_owner(record: dict | None) -> bool:
    """Whether `record` names a live process (one of another host is taken as live; a reused pid is not)."""
    if record is None:
        return False
    if record.get("host") != socket.gethostname():
        return True
    try:
        return psutil.Process(record["pid"]).create_time() <= record.get("time", float("inf")) + 1
    except psutil.Error:
        return False


def _locked(fd: int, shared: bool) -> bool:
    try:
        fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _lock_or_owner(fd: int, folder: str, shared: bool, job: str | None) -> dict | None:
    """Locks `fd` (None), or the record of the run that holds the lock ({} when none could be read in
    `SETTLE_S`)."""
    deadline = time.monotonic() + SETTLE_S
    while not _locked(fd, shared):
        record = read_record(folder)
        if record and (_names_live_owner(record) or is_own_run(record, job)) or time.monotonic() > deadline:
            return record or {}
        time.sleep(_POLL_S)
    return None


def in_use(folder: str, record: dict, other: str) -> OutputInUse:
    """The one-line refusal of a folder the run of `record` holds; `other`: what to choose instead."""
    pid, host, start = (record.get(key, "?") for key in ("pid", "host", "start"))
    return OutputInUse(f"{folder}: in use by another run (pid {pid} on host {host} since {start}); wait for it to "
                       f"end or choose another {other}")


def hold(folder: str, owner_pid: int | None = None, fd: int | None = None, other: str = "--output_dir",
         keep_while: object = None, job: str | None = None) -> None:
    """Takes the folder's lock for the run of `owner_pid` (default: this process) and writes its record, or
    OutputInUse when another live run holds it. On `fd` (run_grpo.sh's descriptor), or held until `keep_while` is
    gone or the process ends (`release`, tidying a folder made for it)."""
    key = os.path.realpath(folder)
    if key in _CLAIMED:
        return
    made = fd is None and not os.path.isdir(folder)
    own_fd = fd is None
    fd, record = _open_and_lock(folder, job) if own_fd else (fd, _lock_or_owner(fd, folder, False, None))
    if record is not None:
        if own_fd:
            os.close(fd)
        if not is_own_run(record, job if own_fd else None):
            raise in_use(folder, record, other)
        _CLAIMED[key] = None
        return
    os.ftruncate(fd, 0)
    os.lseek(fd, 0, os.SEEK_SET)
    os.write(fd, (json.dumps(owner_record(owner_pid or os.getpid(), job)) + "\n").encode())
    _CLAIMED[key] = fd if own_fd else None
    if own_fd:
        weakref.finalize(keep_while if keep_while is not None else sys.modules[__name__], release, folder, made)


def _open_and_lock(folder: str, job: str | None) -> tuple[int, dict | None]:
    """The folder's lock file, made if need be and locked (`_lock_or_owner`); reopened if `release` removed it."""
    while True:
        os.makedirs(folder, exist_ok=True)
        fd = os.open(lock_path(folder), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        record = _lock_or_owner(fd, folder, False, job)
        try:
            current = record is not None or os.stat(lock_path(folder)).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            current = False
        if current:
            return fd, record
        os.close(fd)


def check(folder: str, other: str = "--output_dir", job: str | None = None) -> None:
    """Refuses (OutputInUse) a folder whose lock another live run holds; makes and writes nothing."""
    if os.path.realpath(folder) in _CLAIMED:
        return
    try:
        fd = os.open(lock_path(folder), os.O_RDONLY | os.O_CLOEXEC)
    except OSError:  # no lock file (or no folder): nobody holds it
        return
    try:
        record = _lock_or_owner(fd, folder, True, job)
    finally:
        os.close(fd)  # and with it the shared lock a free folder gave
    if record is not None and not is_own_run(record, job):
        raise in_use(folder, record, other)


def claimed(folder: str) -> bool:
    """Whether this process's run owns the folder (`hold` took its lock, or found it held by its run)."""
    return os.path.realpath(folder) in _CLAIMED


def release(folder: str, tidy: bool = False) -> None:
    """Gives up this process's lock on the folder; with `tidy`, a folder left holding only the lock file goes."""
    fd = _CLAIMED.pop(os.path.realpath(folder), None)
    if fd is None:
        return
    try:
        if tidy and os.listdir(folder) == [LOCK_FILE]:  # removed while still locked: no other run holds it
            os.remove(lock_path(folder))
            os.rmdir(folder)
    except OSError:
        pass
    os.close(fd)


# ---------------------------------------------------------------------- what an earlier run left
@dataclass(frozen=True)
class RunLeftovers:
    """What a run left in its output folder: its checkpoints (complete `step_*` and cut-off `.step_*.partial`
    folders, oldest first) and its metrics.jsonl (the steps it has lines of, and its lines)."""

    checkpoints: tuple[str, ...]
    partial: tuple[str, ...]
    metric_steps: int
    metric_lines: int

    def __bool__(self) -> bool:
        return bool(self.checkpoints or self.partial or self.metric_lines)

    def describe(self, checkpoint_dir: str = "") -> str:
        """E.g. "checkpoints step_000001..step_000002 and metrics of 2 steps"; `checkpoint_dir`: where the
        checkpoints are, when it is worth naming."""
        where = f" in {checkpoint_dir}" if checkpoint_dir else ""
        parts = [_named("checkpoint", self.checkpoints) + where if self.checkpoints else "",
                 _named("partial checkpoint", self.partial) + where if self.partial else ""]
        if self.metric_steps:
            parts.append(f"metrics of {self.metric_steps} step{'s' if self.metric_steps != 1 else ''}")
        elif self.metric_lines:
            parts.append(f"a {METRICS_FILE} of {self.metric_lines} line{'s' if self.metric_lines != 1 else ''}")
        parts = [part for part in parts if part]
        return " and ".join(parts) if len(parts) < 3 else f"{', '.join(parts[:-1])} and {parts[-1]}"


def _named(kind: str, names: tuple[str, ...]) -> str:
    return f"{kind} {names[0]}" if len(names) == 1 else f"{kind}s {names[0]}..{names[-1]}"


def _step_folders(checkpoint_dir: str, pattern: re.Pattern) -> tuple[str, ...]:
    try:
        names = os.listdir(checkpoint_dir)
    except OSError:
        return ()
    found = [(int(match.group(1)), name) for name in names if (match := pattern.match(name))
             and os.path.isdir(os.path.join(checkpoint_dir, name))]
    return tuple(name for _, name in sorted(found))


def _metric_counts(path: str) -> tuple[int, int]:
    """(steps >= 1 with a line, non-empty lines) of a metrics.jsonl; (0, 0) when there is none, or it is not a
    regular file (a device such as /dev/null reads as nothing, or forever)."""
    if not os.path.isfile(path):
        return 0, 0
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            lines = [line for line in f if line.strip()]
    except OSError:
        return 0, 0
    steps = set()
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        step = record.get("step") if isinstance(record, dict) else None
        if isinstance(step, int) and step >= 1:
            steps.add(step)
    return len(steps), len(lines)


def find_leftovers(output_dir: str, checkpoint_dir: str) -> RunLeftovers:
    """What a run left in `output_dir` (metrics.jsonl) and `checkpoint_dir`; converted inputs, logs and the lock
    file do not count."""
    steps, lines = _metric_counts(os.path.join(output_dir, METRICS_FILE))
    return RunLeftovers(_step_folders(checkpoint_dir, _STEP), _step_folders(checkpoint_dir, _PARTIAL), steps, lines)


def delete_leftovers(output_dir: str, checkpoint_dir: str, tensorboard_dirs=()) -> list[str]:
    """Deletes what a run left (`find_leftovers`), its TensorBoard event files in `tensorboard_dirs`, its
    progress.png and completions.jsonl; returns the paths deleted."""
    found = find_leftovers(output_dir, checkpoint_dir)
    folders = [os.path.join(checkpoint_dir, name) for name in found.checkpoints + found.partial]
    files = [os.path.join(output_dir, name) for name in (METRICS_FILE, COMPLETIONS_FILE, PROGRESS_PLOT)]
    files += [path for folder in tensorboard_dirs if folder for path in
              sorted(glob.glob(os.path.join(glob.escape(folder), TENSORBOARD_EVENTS)))]
    deleted = []
    for path in folders:
        shutil.rmtree(path, ignore_errors=True)
        deleted.append(path)
    for path in files:
        try:
            os.remove(path)
        except FileNotFoundError:
            continue
        deleted.append(path)
    return deleted


def main(argv: list[str] | None = None) -> int:
    """`hold --fd N --pid P [--job HOST:PORT] FOLDER`: run_grpo.sh's lock (exit 0, or `IN_USE` with one line)."""
    parser = argparse.ArgumentParser(prog="python -m mindrlhf.utils.output_owner")
    commands = parser.add_subparsers(dest="command", required=True)
    take = commands.add_parser("hold", help="lock FOLDER's run.lock on the inherited descriptor --fd for --pid")
    take.add_argument("folder")
    take.add_argument("--fd", type=int, required=True, help="an open descriptor of FOLDER/run.lock")
    take.add_argument("--pid", type=int, required=True, help="the owning process (the script)")
    take.add_argument("--job", default="", help="MASTER_ADDR:MASTER_PORT of the msrun job it launches")
    args = parser.parse_args(argv)
    host, _, port = args.job.rpartition(":")
    try:
        hold(args.folder, args.pid, fd=args.fd, other="OUTPUT", job=job_address(host, port) if host else None)
    except OutputInUse as err:
        print(f"error: {err}", file=sys.stderr)
        return IN_USE
    return 0


if __name__ == "__main__":
    sys.exit(main())
