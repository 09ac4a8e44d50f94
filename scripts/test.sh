#!/usr/bin/env bash
# scripts/test.sh: set up on first use (scripts/setup.sh), then run every test with pytest,
# on 2 pytest-xdist workers that each take whole test files (--dist loadfile: a file's
# module-scoped runs stay on one worker). On 2 cores that fills the core a single pytest
# leaves idle while a rank launcher imports or a test parses and plots: 1078 s -> 791 s.
# Usage: scripts/test.sh [PYTEST_ARGS...]     e.g. scripts/test.sh tests/unit_tests -k patch
#        scripts/test.sh -n 0 ...             one process, no workers (-n N: N workers)
# Exit:  pytest's exit code (non-zero on any failure, or when no test ran).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
scripts/setup.sh
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
exec .venv/bin/python -m pytest -n 2 --dist loadfile "$@"
