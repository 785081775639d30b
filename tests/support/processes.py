"""The processes the tests start: each carries this session's tag in its environment, so that the ones still running
when the session ends (an msrun worker whose msrun was stopped, a job a test forgot) are found, stopped and
reported, whoever their parent is now."""
import os

SESSION_TAG = "MINDRLHF_TEST_SESSION"


def tag_this_session() -> None:
    """Every process started from now on by this session (and theirs) carries the tag (pytest-xdist's workers keep
    their controller's)."""
    os.environ.setdefault(SESSION_TAG, str(os.getpid()))


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


def rank_process(launcher_pid: int, script: str, rank: int):
    """The process of msrun rank `rank` running `script` among the descendants of `launcher_pid`, or None yet."""
    import psutil

    for process in psutil.Process(launcher_pid).children(recursive=True):
        try:
            if any(script in part for part in process.cmdline()) and process.environ().get("MS_NODE_ID") == str(rank):
                return process
        except psutil.NoSuchProcess:
            continue
    return None


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
