#!/usr/bin/env bash
# scripts/gpu_check.sh: the patch series on CUDA, pristine vs series trees, results in a folder.
#
#   scripts/gpu_check.sh OUT              # both bases; on one GPU scheduled within 8 min (runs share the GPU)
#   scripts/gpu_check.sh --dry-run OUT    # print the runs and commands; works without a GPU
#   scripts/gpu_check.sh --dry-run --assume-gpus 1 OUT   # the one-GPU plan: NCCL ranks share cuda:0
#   scripts/gpu_check.sh --checkout PATH OUT   # your own Megatron-LM checkout (docs/own_tree.md): its series' cases
#                                           # on PATH as it is and with the series; the pinned-tree runs skipped
#   scripts/gpu_check.sh --help
#
# In the image: docker run --gpus all --ipc=host --rm -v "$PWD/out:/out" IMAGE scripts/gpu_check.sh /out/gpu
# The logic is harness/gpu_check (python -m harness.gpu_check); this wrapper picks the Python:
# $PYTHON, else the repo's .venv (scripts/setup.sh), else python3 (the Docker image).
# Exit: 0 all runs passed; 1 a run failed or timed out; 2 bad usage or no usable GPU.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
if [[ -n "${PYTHON:-}" ]]; then py="$PYTHON"
elif [[ -x .venv/bin/python ]]; then py=.venv/bin/python
else py=python3; fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
exec "$py" -m harness.gpu_check "$@"
