"""The tree is lint-clean under the project's ruff configuration (ruff.toml)."""
import subprocess
import sys
from pathlib import Path

from support.paths import ROOT


def test_ruff_reports_nothing():
    ruff = Path(sys.executable).parent / "ruff"
    proc = subprocess.run([str(ruff), "check", "--no-cache", str(ROOT)], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-2000:]
