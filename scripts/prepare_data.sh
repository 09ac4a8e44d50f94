#!/usr/bin/env bash
# scripts/prepare_data.sh: build (or confirm) the offline training data under build/data/.
# Thin wrapper around `python -m harness.data` (see harness/data.py for what it makes);
# it does not run scripts/setup.sh, only needs .venv and the megatron/ tree from it.
# Usage: scripts/prepare_data.sh [--out DIR] [--vocab-size N] [--max-documents N] [--force]
# Exit:  0 data ready (flags printed); 1 build failed; 2 not set up.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
if [[ ! -x .venv/bin/python || ! -d megatron/core ]]; then
    echo "[data] ERROR: .venv or megatron/ missing; run scripts/setup.sh first" >&2
    exit 2
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
exec .venv/bin/python -m harness.data "$@"
