"""The processes the tests start: each carries this session's tag in its environment, so that the ones still running
when the session ends (an msrun worker whose msrun was stopped, a job a test forgot) are found, stopped and
reported, whoever their parent is now."""
import os

SESSION_TAG = "MINDRLHF_TEST_SESSION"


def tag_this_session() -> None:
    """Every process started from now on by this session (and theirs) carries the tag (pytest-xdist's workers keep
    their controller's)."""
    os.environ.setdefault(SESSION_TAG, str(os.getpid()))


def leftover_processes() -> list:
    """The tagged processes still running, other than this one (psutil.Process objects)."""
    import psutil

    tag, mine = os.environ.get(SESSION_TAG), os.getpid()
    found = []
    for process in psutil.process_iter(["pid", "cmdline"]):
        if process.pid == mine or is_xdist_worker(process):
            continue
        try:
            if process.environ().get(SESSION_TAG) == tag:
                found.append(process)
        except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
    return found


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
    lines = [f"{p.pid}: {' '.join(p.info['cmdline'] or [])[:200]}" for p in found]
    for process in found:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(found, timeout=10)
    return lines
