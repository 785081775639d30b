#!/usr/bin/env bash
# Creates (or refreshes) the project virtualenv .venv and installs mindrlhf into it.
#   bash tools/bootstrap.sh          runtime dependencies
#   bash tools/bootstrap.sh test     runtime + test dependencies
# Re-running is cheap: it reinstalls only when a requirements file or setup.py changed.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${MINDRLHF_VENV:-$ROOT/.venv}"
EXTRA="${1:-}"
PY="$(command -v python3.11 || command -v python3)"
if [ ! -x "$VENV/bin/python" ]; then
  echo "[bootstrap] creating virtualenv $VENV with $PY"
  "$PY" -m venv "$VENV"
fi
STAMP="$VENV/.mindrlhf-installed${EXTRA:+-$EXTRA}"
# the checkout's path too: the editable install points at one checkout (a venv another checkout used is re-pointed)
HASH="$( (cat "$ROOT/requirements.txt" "$ROOT/requirements-test.txt" "$ROOT/setup.py"; echo "$ROOT") | sha256sum | cut -c1-16)"
installed() { [ -f "$1" ] && [ "$(cat "$1")" = "$HASH" ]; }
# the test install holds the runtime one (requirements-test.txt includes requirements.txt): reinstalling would
# uninstall mindrlhf for a moment, under any job of the same .venv that starts then (run_grpo.sh in the tests)
if ! installed "$STAMP" && ! { [ -z "$EXTRA" ] && installed "$VENV/.mindrlhf-installed-test"; }; then
  echo "[bootstrap] installing dependencies${EXTRA:+ ($EXTRA)} into $VENV"
  REQ="$ROOT/requirements.txt"
  [ "$EXTRA" = "test" ] && REQ="$ROOT/requirements-test.txt"
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check -r "$REQ"
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps -e "$ROOT"
  echo "$HASH" > "$STAMP"
fi
