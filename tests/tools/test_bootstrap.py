"""tools/bootstrap.sh installs only what a .venv lacks: run_grpo.sh's runtime bootstrap after the tests' one changes
nothing (a reinstall uninstalls mindrlhf for a moment, and a job of the same .venv starting then cannot import it)."""
import os
import subprocess

from support.paths import ROOT


def bootstrap(venv, calls, *extra) -> list[str]:
    """Runs tools/bootstrap.sh on `venv`, whose python only records its arguments: the pip commands it ran."""
    subprocess.run(["bash", str(ROOT / "tools" / "bootstrap.sh"), *extra], check=True, capture_output=True,
                   env=dict(os.environ, MINDRLHF_VENV=str(venv), CALLS=str(calls)))
    return calls.read_text().splitlines() if calls.exists() else []


def test_a_runtime_bootstrap_after_the_test_install_installs_nothing(tmp_path):
    venv, calls = tmp_path / "venv", tmp_path / "calls.txt"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"
    python.write_text('#!/bin/sh\necho "$*" >> "$CALLS"\n')
    python.chmod(0o755)
    first = bootstrap(venv, calls, "test")
    assert len(first) == 2 and "requirements-test.txt" in first[0] and f"-e {ROOT}" in first[1], first
    assert bootstrap(venv, calls) == first  # the runtime set is part of the test set
    assert bootstrap(venv, calls, "test") == first

    runtime_only = tmp_path / "runtime"
    (runtime_only / "bin").mkdir(parents=True)
    (runtime_only / "bin" / "python").write_text(python.read_text())
    (runtime_only / "bin" / "python").chmod(0o755)
    calls.unlink()
    assert len(bootstrap(runtime_only, calls)) == 2
    after_test = bootstrap(runtime_only, calls, "test")  # the test dependencies are still missing
    assert len(after_test) == 4 and "requirements-test.txt" in after_test[2], after_test
