"""The suite's CPU log (`tests/support/cpu_log.py`, `MINDRLHF_TEST_CPU_LOG`): a test's CPU seconds count the
processes it started and waited for, not the time it waited."""
import os
import sys

from support.cpu_log import read_log
from support.msrun import run_command
from support.paths import TESTS

BUSY_CHILD = "import time\nend = time.process_time() + 0.6\nwhile time.process_time() < end:\n    pass\n"


def test_a_tests_cpu_seconds_are_its_childrens_and_a_wait_costs_none(tmp_path):
    (tmp_path / "test_timed.py").write_text(
        "import subprocess, sys, time\n"
        f"def test_busy_child():\n    subprocess.run([sys.executable, '-c', {BUSY_CHILD!r}], check=True)\n"
        "def test_waits():\n    time.sleep(0.5)\n")
    log = tmp_path / "log"
    log.mkdir()
    (log / "gw9.tsv").write_text("an earlier run's line\t1\t1\n")  # a new session starts the folder afresh
    env = dict(os.environ, MINDRLHF_TEST_CPU_LOG=str(log), PYTHONPATH=str(TESTS))
    done = run_command([sys.executable, "-m", "pytest", "-p", "support.cpu_log", "-p", "no:cacheprovider", "-q",
                        "-n", "0", "test_timed.py"], env, timeout=120, cwd=str(tmp_path))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = {nodeid: (wall, cpu) for nodeid, wall, cpu in read_log(log)}
    assert set(rows) == {"test_timed.py::test_busy_child", "test_timed.py::test_waits"}
    busy_wall, busy_cpu = rows["test_timed.py::test_busy_child"]
    assert busy_cpu >= 0.6 and busy_wall >= 0.6
    wait_wall, wait_cpu = rows["test_timed.py::test_waits"]
    assert wait_wall >= 0.5 and wait_cpu < 0.2
    summary = done.stdout[done.stdout.index("CPU seconds (2 tests"):]
    lines = summary.splitlines()
    assert lines[1].endswith("test_timed.py::test_busy_child") and "by module:" in summary
