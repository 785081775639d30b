#!/usr/bin/env bash
# Sets up .venv with the test dependencies (first run only) and runs the test suite.
#   bash tests/run.sh            the whole suite (what CI runs)
#   bash tests/run.sh --quick    the quick tier: no msrun job, no trainer job (a few minutes; a developer's loop)
# Other arguments go to pytest, e.g. `bash tests/run.sh -k reward` or `bash tests/run.sh tests/parallel`.
# MINDRLHF_TEST_CPU_LOG=<folder> bash tests/run.sh also logs each test's CPU seconds, its jobs' included, and lists
# the largest (tests/support/cpu_log.py): on the busy machine a test's duration is mostly how it shared the cores.
# Two pytest-xdist workers, each taking whole test modules, those that launch msrun jobs first (tests/conftest.py);
# `-n 0` runs everything in this process.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/tools/bootstrap.sh" test
cd "$ROOT"
export GLOG_v="${GLOG_v:-3}"  # MindSpore: errors only
export PYTHONFAULTHANDLER=1   # a test process that crashes prints its threads' stacks
# the project's own .pyc files, once: with PYTHONDONTWRITEBYTECODE set (as on CI) every process of every msrun job
# would compile mindrlhf and the test helpers from source at import (~0.5 s a process)
"$ROOT/.venv/bin/python" -m compileall -q -j 0 mindrlhf tests examples tools > /dev/null
TIER=()
if [ "${1:-}" = "--quick" ]; then
  shift
  TIER=(-m "not msrun and not slow")
fi
exec "$ROOT/.venv/bin/python" -m pytest -ra --durations=40 -n 2 "${TIER[@]}" "$@"
