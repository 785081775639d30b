#!/usr/bin/env bash
# Sets up .venv with the test dependencies (first run only) and runs the whole test suite.
# Extra arguments go to pytest, e.g. `bash tests/run.sh -m "not msrun"` or `bash tests/run.sh -k reward`.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/tools/bootstrap.sh" test
cd "$ROOT"
export GLOG_v="${GLOG_v:-3}"  # MindSpore: errors only
exec "$ROOT/.venv/bin/python" -m pytest -ra --durations=40 "$@"
