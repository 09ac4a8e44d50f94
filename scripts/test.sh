#!/usr/bin/env bash
# scripts/test.sh: set up on first use (scripts/setup.sh), then run every test with pytest.
# Usage: scripts/test.sh [PYTEST_ARGS...]     e.g. scripts/test.sh tests/unit_tests -k patch
# Exit:  pytest's exit code (non-zero on any failure, or when no test ran).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
scripts/setup.sh
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
exec .venv/bin/python -m pytest "$@"
