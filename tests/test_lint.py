"""The tree is lint-clean under the project's ruff configuration (ruff.toml)."""
import sys
from pathlib import Path

from support.msrun import run_command
from support.paths import ROOT


def test_ruff_reports_nothing():
    ruff = Path(sys.executable).parent / "ruff"
    proc = run_command([ruff, "check", "--no-cache", ROOT], timeout=300, cwd=str(ROOT))
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-2000:]
