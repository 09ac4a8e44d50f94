#!/usr/bin/env bash
# scripts/test.sh: set up on first use (scripts/setup.sh), then run every test with pytest,
# on 2 pytest-xdist workers that each take whole test files (--dist loadfile: a file's
# module-scoped runs stay on one worker). On 2 cores that fills the core a single pytest
# leaves idle while a rank launcher imports or a test parses and plots: 1078 s -> 791 s.
# Two tiers (pytest.ini's `extended` marker; what each runs and takes: tests/README.md):
#   scripts/test.sh          every test but the sweeps: what CI runs
#   scripts/test.sh --all    the sweeps too: every prefix of each series, every mutant, every
#                            functional case, ...
#   scripts/test.sh -m extended   the sweeps alone
# A run of all of either that passes writes docs/full_run.json (tests/tiers.py); the default
# run fails while that record's series or mutants differ from the commit's (test_tiers.py).
# Usage: scripts/test.sh [--all] [PYTEST_ARGS...]   e.g. scripts/test.sh tests/unit_tests -k patch
#        scripts/test.sh -n 0 ...             one process, no workers (-n N: N workers)
# Exit:  pytest's exit code (non-zero on any failure, or when no test ran).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
scripts/setup.sh
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
tier=()
if [[ "${1:-}" == "--all" ]]; then shift; tier=(-m "extended or not extended"); fi
exec .venv/bin/python -m pytest -n 2 --dist loadfile "${tier[@]}" "$@"
