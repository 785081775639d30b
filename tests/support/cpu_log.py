"""Each test's wall and CPU seconds, with `MINDRLHF_TEST_CPU_LOG=<folder> bash tests/run.sh`: CPU counts this process
and the children it waited for (an msrun job: msrun, its scheduler and every rank), one `<worker>.tsv` a pytest-xdist
worker (node id, wall, CPU), and the summary lists the tests and modules that took the most CPU. On a machine the
suite keeps busy a test's duration is mostly how it shared the cores; its CPU seconds are what a cut saves."""
import os
import resource
import time
from pathlib import Path

import pytest

LOG_VARIABLE = "MINDRLHF_TEST_CPU_LOG"


def cpu_seconds() -> float:
    """User + system seconds of this process and of its waited-for children."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def log_folder() -> Path | None:
    folder = os.environ.get(LOG_VARIABLE)
    return Path(folder) if folder else None


def worker_id(config) -> str | None:
    """This process's pytest-xdist worker id, None on the controller or in a run without workers (a pytest started
    by a test inherits its worker's environment, so the environment cannot tell)."""
    workerinput = getattr(config, "workerinput", None)
    return workerinput["workerid"] if workerinput else None


def pytest_configure(config):
    """The controller (or a run without workers) starts the folder afresh, before any worker writes to it."""
    folder = log_folder()
    if folder is not None and worker_id(config) is None:
        folder.mkdir(parents=True, exist_ok=True)
        for old in folder.glob("*.tsv"):
            old.unlink()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    folder = log_folder()
    wall, cpu = time.time(), cpu_seconds()
    yield
    if folder is not None:
        wall, cpu = time.time() - wall, cpu_seconds() - cpu
        with open(folder / f"{worker_id(item.config) or 'main'}.tsv", "a") as log:
            log.write(f"{item.nodeid}\t{wall:.2f}\t{cpu:.2f}\n")


def read_log(folder: Path) -> list[tuple[str, float, float]]:
    """(node id, wall seconds, CPU seconds) of every test the folder's files record."""
    rows = []
    for path in sorted(folder.glob("*.tsv")):
        for line in path.read_text().splitlines():
            nodeid, wall, cpu = line.split("\t")
            rows.append((nodeid, float(wall), float(cpu)))
    return rows


def pytest_terminal_summary(terminalreporter):
    folder = log_folder()
    if folder is None or worker_id(terminalreporter.config) is not None:
        return
    rows = read_log(folder)
    modules: dict[str, list[float]] = {}
    for nodeid, wall, cpu in rows:
        totals = modules.setdefault(nodeid.split("::", 1)[0], [0.0, 0.0])
        totals[0] += wall
        totals[1] += cpu
    write = terminalreporter.write_line
    terminalreporter.section(f"CPU seconds ({len(rows)} tests: {sum(r[2] for r in rows):.0f} CPU-s, "
                             f"{sum(r[1] for r in rows):.0f} test-s; {folder})")
    for nodeid, wall, cpu in sorted(rows, key=lambda row: -row[2])[:25]:
        write(f"{cpu:8.1f} CPU-s {wall:8.1f} s  {nodeid}")
    write("by module:")
    for module, (wall, cpu) in sorted(modules.items(), key=lambda item: -item[1][1])[:15]:
        write(f"{cpu:8.1f} CPU-s {wall:8.1f} s  {module}")
