#!/usr/bin/env bash
# scripts/prepare_device_carry.sh: get everything scripts/device_check.sh needs on a lent GPU
# machine (which has python3 3.12, torch 2.11 and pytest, but no network, no megatron-core and no
# emerging-optimizers), then print the exact device-tool call.
#
#   1. scripts/setup.sh: the pinned megatron-core wheel, build/upstream (pristine), megatron/
#      (patched) and their stamps, so that setup.sh on the device has nothing to rebuild.
#   2. .whl/: that megatron-core wheel, plus emerging-optimizers and dockerfile-parse at the
#      versions of requirements/lock.txt, fetched with `pip download` as the device README says
#      (pure-Python wheels; their other needs, absl-py and torch, are on the device already).
#   3. /.whl/ added to .git/info/exclude (the folder travels only through `carry`).
#   4. Prints the `run` call: command, timeout_s and carry list.
#
# Usage: scripts/prepare_device_carry.sh [--print-only]
#   --print-only   skip 1-3 (no network, no writes); only print the call
# Exit: 0 ready; 1 a step failed (the message says which); 2 bad usage.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PROG="prepare_device_carry"
die() { echo "$PROG: error: $*" >&2; exit "${2:-1}"; }

print_only=0
case "${1:-}" in
    "") ;;
    --print-only) print_only=1 ;;
    -h|--help) sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown argument '$1' (see --help)" 2 ;;
esac

# Paths the device call must carry (ignored here, so they travel only when named). Order matters
# only for reading; at most 8.
CARRY=(.whl megatron build/upstream build/stamps)
# device_check.sh keeps its whole run under 8 minutes; the tool's limit for one command is 600 s.
TIMEOUT_S=540
COMMAND='bash scripts/device_check.sh'

lock_version() {  # version of $1 in requirements/lock.txt (names compared case- and -_-insensitively)
    local want; want="$(echo "$1" | tr 'A-Z_' 'a-z-')"
    awk -F'==' -v w="$want" '{n=tolower($1); gsub("_","-",n)} n==w {print $2; exit}' requirements/lock.txt
}

if [[ $print_only == 0 ]]; then
    echo "[$PROG] scripts/setup.sh"
    scripts/setup.sh --quiet || die "scripts/setup.sh failed (see above)"
    # shellcheck source=../requirements/megatron-core.lock
    source requirements/megatron-core.lock
    mkdir -p .whl
    exclude="$(git rev-parse --git-path info/exclude)"
    mkdir -p "$(dirname "$exclude")"
    grep -qxF '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >> "$exclude"
    cp -f "build/wheels/$MCORE_WHEEL" .whl/
    for pkg in emerging-optimizers dockerfile-parse; do
        ver="$(lock_version "$pkg")"
        [[ -n "$ver" ]] || die "$pkg is not pinned in requirements/lock.txt"
        stem="$(echo "$pkg" | tr '-' '_')"
        if compgen -G ".whl/${stem}-${ver}-*.whl" >/dev/null; then
            echo "[$PROG] .whl/ has $pkg==$ver"
            continue
        fi
        rm -f .whl/"${stem}"-*.whl   # one version of each, or the device install stops
        echo "[$PROG] pip download $pkg==$ver"
        PIP_CONFIG_FILE=/dev/null .venv/bin/python -m pip download -q --disable-pip-version-check \
            --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
            --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
            --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
            --platform manylinux1_x86_64 -d .whl "$pkg==$ver" \
            || die "pip download $pkg==$ver failed (network/registry?)"
    done
    size_kb="$(du -skL .whl megatron build/upstream build/stamps | awk '{s+=$1} END {print s}')"
    (( size_kb < 48 * 1024 )) || die "carried paths are ${size_kb} KiB; the device call takes 64 MiB with the tree"
    echo "[$PROG] .whl/: $(cd .whl && ls | tr '\n' ' ')(carry total ${size_kb} KiB)"
    scripts/device_check.sh --dry-run --wheels .whl > /dev/null \
        || die "scripts/device_check.sh --dry-run rejects the prepared carry (see above)"
fi

carry_json="$(printf '"%s",' "${CARRY[@]}")"
echo "Device call (tool 'run'; check 'status' first, and give_back after unless rerunning at once):"
echo "  command:   $COMMAND"
echo "  timeout_s: $TIMEOUT_S"
echo "  carry:     [${carry_json%,}]"
echo "Results come back as summary.json, *.log, unit_tests.xml, param_sync.json, pretrain_compare.json."
