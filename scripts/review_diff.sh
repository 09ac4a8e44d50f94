#!/usr/bin/env bash
# scripts/review_diff.sh: what the series changes, for reviewers: a diffstat, then the combined
# unified diff of the patched tree against the pristine tree (paths a/megatron/..., b/megatron/...,
# no timestamps; __pycache__ and *.pyc ignored). The output applies with `patch -p1` / `git apply`.
#
# Usage: scripts/review_diff.sh [PRISTINE_PARENT PATCHED_PARENT]
#   defaults: build/upstream (pristine, from the wheel) and the repo root (megatron/, patched);
#   each argument is the directory that holds megatron/. Run scripts/setup.sh first.
# Exit:  0 printed (also when the trees are identical: "no differences")
#        1 error: a tree is missing (message says what to run)
#        2 usage error
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
ME=review_diff.sh
case $# in
    0) A="$ROOT/build/upstream" B="$ROOT" ;;
    2) A="$1" B="$2" ;;
    *) echo "$ME: usage: scripts/review_diff.sh [PRISTINE_PARENT PATCHED_PARENT]" >&2; exit 2 ;;
esac
for d in "$A" "$B"; do
    [[ -d "$d/megatron/core" ]] || { echo "$ME: error: $d/megatron/core does not exist; run scripts/setup.sh (or pass the directories that hold megatron/)" >&2; exit 1; }
done

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
# diff exits 1 when the trees differ; only >1 is an error.
rc=0
(cd "$tmp" && ln -s "$(cd "$A" && pwd -P)" a && ln -s "$(cd "$B" && pwd -P)" b \
    && LC_ALL=C TZ=UTC diff -ruN -x __pycache__ -x '*.pyc' a/megatron b/megatron) > "$tmp/raw.diff" || rc=$?
[[ $rc -le 1 ]] || { echo "$ME: error: diff failed (exit $rc)" >&2; exit 1; }
# diff -N writes an absent side as an empty file dated the epoch: make it /dev/null, as git does.
# Then drop the timestamps and diff's own command lines.
sed -E -e '/^(---|\+\+\+) [^\t]*\t1970-01-01 00:00:00(\.0+)? \+0000$/s#^(---|\+\+\+) [^\t]*#\1 /dev/null#' \
    -e '/^(---|\+\+\+) /s/\t.*$//' -e '/^diff -ruN /d' "$tmp/raw.diff" > "$tmp/review.diff"

if [[ ! -s "$tmp/review.diff" ]]; then
    echo "no differences between $A/megatron and $B/megatron"
    exit 0
fi
echo "# megatron-core: patched ($B/megatron) against pristine ($A/megatron)"
# git apply --stat only reads the patch; nothing is applied.
(cd "$tmp" && GIT_CEILING_DIRECTORIES="$tmp" git apply --stat review.diff)
echo
cat "$tmp/review.diff"
