"""The processes the tests start: each carries this session's tag in its environment, so that the ones still running
when the session ends (an msrun worker whose msrun was stopped, a job a test forgot) are found, stopped and
reported, whoever their parent is now."""
import contextlib
import fcntl
import os
import tempfile

SESSION_TAG = "MINDRLHF_TEST_SESSION"
JOB_LOCK = "MINDRLHF_TEST_JOB_LOCK"
_alone = False  # this process holds the job lock exclusively


def tag_this_session() -> None:
    """Every process started from now on by this session (and theirs) carries the tag (pytest-xdist's workers keep
    their controller's)."""
    os.environ.setdefault(SESSION_TAG, str(os.getpid()))


def share_job_lock() -> None:
    """A lock file for the session (its path in the environment, which pytest-xdist's workers keep): every job a test
    launches holds it shared, a job that needs the machine's memory to itself (`job_slot(alone=True)`) exclusively."""
    if JOB_LOCK not in os.environ:
        handle, path = tempfile.mkstemp(prefix="mindrlhf-test-jobs-", suffix=".lock")
        os.close(handle)
        os.environ[JOB_LOCK] = path


@contextlib.contextmanager
def job_slot(alone: bool = False):
    """Holds the session's job lock while a launched job runs: shared, or exclusively with `alone` (SmolLM2's two
    ranks take ~15 GiB of the machine's 24: no other job may run beside them). Within an exclusive hold the jobs
    the test launches need no lock of their own."""
    global _alone
    path = os.environ.get(JOB_LOCK)
    if not path or _alone:
        yield
        return
    with open(path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        _alone = alone
        try:
            yield
        finally:
            _alone = False
            fcntl.flock(lock, fcntl.LOCK_UN)


def tagged_processes(name: str, value: str) -> list:
    """The running processes (psutil.Process objects, zombies left out) whose environment has `name`=`value`."""
    import psutil

    found = []
    for process in psutil.process_iter(["pid", "cmdline", "status"]):
        try:
            if process.info["status"] != psutil.STATUS_ZOMBIE and process.environ().get(name) == value:
                found.append(process)
        except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
    return found


def described(process, width: int = 200) -> str:
    """'pid: command line' (cut to `width`), for a report."""
    return f"{process.pid}: {' '.join(process.info['cmdline'] or [])[:width]}"


def leftover_processes() -> list:
    """The tagged processes still running, other than this one and xdist's workers (psutil.Process objects)."""
    return [process for process in tagged_processes(SESSION_TAG, os.environ.get(SESSION_TAG))
            if process.pid != os.getpid() and not is_xdist_worker(process)]


def is_xdist_worker(process) -> bool:
    """A pytest-xdist worker of this session (execnet starts it reading its code from stdin); it ends with the
    session."""
    import psutil

    try:
        return "sys.stdin.readline()" in " ".join(process.cmdline())
    except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess):
        return False


def stop_leftovers() -> list[str]:
    """Kills the leftover processes; returns a line for each ('pid: command line')."""
    import psutil

    found = leftover_processes()
    lines = [described(p) for p in found]
    for process in found:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(found, timeout=10)
    return lines
