#!/usr/bin/env bash
# scripts/run_functional_test.sh: the main job. Sets up on first use (scripts/setup.sh),
# prepares the offline training data if missing, then, for each test case, trains the
# pristine tree (megatron-core as released) and the series tree (it + patches/<base>/)
# (CPU ranks forked by harness/fork_ranks.py, GPU ranks by torchrun) and compares them:
# exactly with each other, per step with the committed golden values.
#
# Usage: scripts/run_functional_test.sh [--base 0.19|0.17.1|all] [--device cpu|cuda] [--update-golden] [--list] [--checkout PATH] [CASE ...|all]
#   no CASE: each base's default case, 0.19 first: gpt019_dp2_bf16_fp32grad_overlap_legacy
#     (megatron-core 0.19.2 vs 0.19.2 + patches/0.19, --no-use-layer-wise-param-layout), then
#     gpt_dp2_bf16_fp32grad_overlap_layerwise (0.17.1 vs 0.17.1 + patches/0.17.1)
#   --base: only that base's cases (its default case, or 'all' of them)
#   --device cuda: NCCL on GPUs (golden_values_dgx_h200.json) instead of CPU gloo ranks
#   --update-golden: rewrite the golden values from this run; refused unless series == pristine
#   --checkout PATH: your own Megatron-LM git checkout (a fork, upstream main): PATH's HEAD as it
#     is vs the same + the series its version picks (scripts/apply_patches.sh, three-way where
#     PATH is not exactly a base), in scratch clones under build/checkouts/ (PATH is never
#     written), with PATH's own pretrain_gpt.py and megatron.training; the default case is that
#     series' base's; golden values are shown for information unless PATH is a release
#     (docs/own_tree.md). Outputs under build/functional/checkout-<name>-<commit>/<case>/.
#     A PATH that already carries the series (scripts/apply_patches.sh PATH ran, or you merged it
#     by hand after a conflict) is compared with its commit before the series instead (the
#     parent of the oldest commit with a patch's subject): HEAD as it is, nothing applied.
# Writes: build/functional/<case>/{pristine,series}/{metrics,memory}.json, comparison.json, loss_curves.png
#         (memory.json: the param sync's megatron and NCCL bytes and the step peak per step, printed
#         next to the verdict)
# Exit:   0 when every case is "identical"; 1 diverged / outside golden tolerance / failed;
#         2 bad arguments, nothing trained, one line on stderr that says why: an unknown case or
#           one of another base; --checkout PATH that does not exist, is a file or an empty
#           directory, is not the top level of a Megatron-LM git checkout (the line says what
#           belongs there), has uncommitted changes to tracked files, or that the series cannot
#           serve (scripts/apply_patches.sh's line: a conflict, missing blobs, a version without
#           a series); a PATH that carries the series without one commit per patch.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
scripts/setup.sh --quiet
export PYTHONPATH="$ROOT"
exec .venv/bin/python -m tests.functional_tests.python_test_utils.run_case "$@"
