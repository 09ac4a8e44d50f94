#!/usr/bin/env bash
# scripts/setup.sh: make a fresh clone ready to run. Idempotent; a second run with
# nothing changed only checks stamps (seconds).
#
# Data flow (one way):
#   requirements/megatron-core.lock --(pip download, sha256 check)--> build/wheels/*.whl
#   wheel --(unzip megatron/)--> build/upstream/megatron               (pristine, read-only use)
#   pristine + patches/series --(git am, one commit per patch)--> build/series-git
#   build/series-git HEAD --(git archive)--> megatron/                 (patched, gitignored)
#   requirements/lock.txt --(pip install)--> .venv                     (Python >= 3.12)
#
# Usage: scripts/setup.sh [--quiet]
# Env:   PYTHON=/path/to/python3.12  use this interpreter for the venv (else python3.12,
#        pyenv's newest 3.12/3.13, or python3 if it is >= 3.12).
# Exit:  0 ready; 1 a step failed (the message says which and what to do).
#
# Developer workflow for changing the series: see patches/README.md, "Editing the series".
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
QUIET=0
[[ "${1:-}" == "--quiet" ]] && QUIET=1

log() { [[ $QUIET == 1 ]] || echo "[setup] $*"; }
# Work that takes time is always announced, --quiet or not (a silent first run looks hung).
say() { echo "[setup] $*"; }
die() { echo "[setup] ERROR: $*" >&2; exit 1; }
sha() { sha256sum "$@" | awk '{print $1}'; }

# shellcheck source=../requirements/megatron-core.lock
source requirements/megatron-core.lock
mkdir -p build/stamps build/wheels

# ---------------------------------------------------------------- 1. interpreter
find_python() {
    local cand
    if [[ -n "${PYTHON:-}" ]]; then echo "$PYTHON"; return; fi
    for cand in python3.12 python3.13; do
        if command -v "$cand" >/dev/null 2>&1 && "$cand" -c '' 2>/dev/null; then
            command -v "$cand"; return
        fi
    done
    if command -v pyenv >/dev/null 2>&1; then
        cand="$(pyenv versions --bare 2>/dev/null | grep -E '^3\.1[2-9]\.[0-9]+$' | sort -V | head -n1 || true)"
        if [[ -n "$cand" ]]; then echo "$(pyenv root)/versions/$cand/bin/python"; return; fi
    fi
    if command -v python3 >/dev/null 2>&1; then command -v python3; return; fi
    echo ""
}

if [[ ! -x .venv/bin/python ]]; then
    PY="$(find_python)"
    [[ -n "$PY" ]] || die "no Python found. Install Python >= 3.12 (e.g. 'pyenv install 3.12') or set PYTHON=/path/to/python3.12"
    "$PY" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)' \
        || die "$PY is Python $("$PY" -c 'import sys; print(sys.version.split()[0])'); megatron-core $MCORE_VERSION needs >= 3.12. Set PYTHON=/path/to/python3.12"
    "$PY" -c 'import venv, ensurepip' 2>/dev/null || die "$PY lacks venv/ensurepip (Debian: apt-get install python3.12-venv)"
    say "creating .venv from $PY"
    "$PY" -m venv .venv
fi
VPY="$ROOT/.venv/bin/python"

# ---------------------------------------------------------------- 2. packages
lock_sha="$(sha requirements/lock.txt)"
if [[ "$(cat build/stamps/venv 2>/dev/null || true)" != "$lock_sha" ]]; then
    say "installing requirements/lock.txt into .venv (first run: torch is a ~3 GB download, about 90 s)"
    # A machine-wide pip constraint (e.g. /etc/xdg/pip capping torch) must not override the lock.
    PIP_CONSTRAINT="" PIP_CONFIG_FILE=/dev/null "$VPY" -m pip install --disable-pip-version-check \
        -q -r requirements/lock.txt || die "pip install -r requirements/lock.txt failed (see above)"
    echo "$lock_sha" > build/stamps/venv
else
    log ".venv up to date"
fi

# ---------------------------------------------------------------- 3. pinned wheel
WHEEL="build/wheels/$MCORE_WHEEL"
if [[ ! -f "$WHEEL" ]]; then
    say "downloading megatron-core==$MCORE_VERSION wheel"
    tmpd="$(mktemp -d build/wheels/.dl.XXXXXX)"
    PIP_CONFIG_FILE=/dev/null "$VPY" -m pip download --disable-pip-version-check -q --no-deps \
        --only-binary :all: --python-version 3.12 -d "$tmpd" "megatron-core==$MCORE_VERSION" \
        || { rm -rf "$tmpd"; die "could not download megatron-core==$MCORE_VERSION (network/registry?)"; }
    [[ -f "$tmpd/$MCORE_WHEEL" ]] || { ls "$tmpd" >&2; rm -rf "$tmpd"; die "registry served a different wheel than $MCORE_WHEEL"; }
    mv "$tmpd/$MCORE_WHEEL" "$WHEEL"; rm -rf "$tmpd"
fi
wheel_sha="$(sha "$WHEEL")"
if [[ "$wheel_sha" != "$MCORE_WHEEL_SHA256" ]]; then
    rm -f "$WHEEL"
    die "sha256 of $MCORE_WHEEL is $wheel_sha, expected $MCORE_WHEEL_SHA256 (requirements/megatron-core.lock). Deleted it; rerun to download again."
fi

# ---------------------------------------------------------------- 4. pristine tree
if [[ "$(cat build/stamps/upstream 2>/dev/null || true)" != "$wheel_sha" || ! -d build/upstream/megatron/core ]]; then
    say "extracting pristine tree build/upstream/megatron"
    rm -rf build/upstream.tmp && mkdir -p build/upstream.tmp
    "$VPY" - "$WHEEL" build/upstream.tmp <<'PY'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as zf:
    zf.extractall(sys.argv[2], [n for n in zf.namelist() if n.startswith("megatron/")])
PY
    # Keep executable bits of the prebuilt extension, as pip would.
    chmod -R u+rwX,go+rX build/upstream.tmp
    rm -rf build/upstream && mv build/upstream.tmp build/upstream
    echo "$wheel_sha" > build/stamps/upstream
    rm -f build/stamps/series
else
    log "pristine tree up to date"
fi

# ---------------------------------------------------------------- 5. series repo + patched tree
series_sha="$( { echo "$wheel_sha"; cat patches/series; while read -r p; do cat "patches/$p"; done < <(grep -vE '^\s*(#|$)' patches/series); } | sha256sum | awk '{print $1}' )" \
    || die "patches/series names a patch file that does not exist (see above)"
SG=build/series-git
# Commits a developer made in $SG (patches/README.md) must reach patches/ before a rebuild
# replaces $SG: refuse while they are not refreshed; once they are, rebuild from patches/.
if [[ -d "$SG/.git" ]]; then
    sg_head="$(git -C "$SG" rev-parse -q --verify HEAD 2>/dev/null || true)"
    built_head="$(cat build/stamps/series-head 2>/dev/null || git -C "$SG" rev-parse -q --verify 'pristine^{commit}' 2>/dev/null || true)"
    if [[ "$sg_head" != "$built_head" ]]; then
        [[ -z "$(git -C "$SG" status --porcelain 2>/dev/null)" ]] \
            || die "$SG has uncommitted edits. Commit them and run scripts/refresh_patches.sh, or discard them (git -C $SG checkout -- .), then rerun."
        scripts/refresh_patches.sh --check >/dev/null \
            || die "$SG has commits that patches/ does not have (HEAD: $(git -C "$SG" log -1 --format='%h %s')). Run scripts/refresh_patches.sh to write them to patches/, or drop them (rm -rf $SG), then rerun."
        rm -f build/stamps/series
    fi
fi
if [[ "$(cat build/stamps/series 2>/dev/null || true)" != "$series_sha" || ! -d megatron/core ]]; then
    if [[ -d "$SG/.git" ]] && [[ -n "$(git -C "$SG" status --porcelain 2>/dev/null)" ]]; then
        die "$SG has uncommitted edits. Commit them and run scripts/refresh_patches.sh, or discard them (git -C $SG checkout -- .), then rerun."
    fi
    say "building $SG: pristine commit + git am patches/series"
    rm -rf "$SG.tmp" && mkdir -p "$SG.tmp"
    cp -a build/upstream/megatron "$SG.tmp/megatron"
    export GIT_AUTHOR_NAME="megatron-core wheel" GIT_AUTHOR_EMAIL="pristine@invalid" \
        GIT_COMMITTER_NAME="series-git" GIT_COMMITTER_EMAIL="series-git@invalid" \
        GIT_AUTHOR_DATE="2000-01-01T00:00:00Z" GIT_COMMITTER_DATE="2000-01-01T00:00:00Z"
    (
        cd "$SG.tmp"
        git init -q -b main . && git config core.autocrlf false && git config commit.gpgsign false
        find megatron -name __pycache__ -prune -exec rm -rf {} +
        git add -A megatron && git commit -q -m "megatron-core $MCORE_VERSION pristine (wheel sha256 $wheel_sha)"
        git tag pristine
    )
    while read -r p; do
        [[ -f "patches/$p" ]] || { rm -rf "$SG.tmp"; die "patches/series names patches/$p, which does not exist"; }
        unset GIT_AUTHOR_NAME GIT_AUTHOR_EMAIL GIT_AUTHOR_DATE
        git -C "$SG.tmp" am -q --keep-cr "$ROOT/patches/$p" \
            || { git -C "$SG.tmp" am --abort 2>/dev/null || true; rm -rf "$SG.tmp"; die "patches/$p does not apply to megatron-core $MCORE_VERSION (git am failed). megatron/ left as it was."; }
    done < <(grep -vE '^\s*(#|$)' patches/series)
    rm -rf megatron.tmp && mkdir megatron.tmp
    git -C "$SG.tmp" archive HEAD megatron | tar -x -C megatron.tmp
    # The prebuilt extension is not text; git keeps it byte-exact but archive drops nothing else.
    rm -rf "$SG" && mv "$SG.tmp" "$SG"
    git -C "$SG" rev-parse HEAD > build/stamps/series-head
    rm -rf megatron && mv megatron.tmp/megatron megatron && rmdir megatron.tmp
    echo "$series_sha" > build/stamps/series
else
    log "patched tree megatron/ up to date ($(grep -cvE '^\s*(#|$)' patches/series) patches)"
fi
log "ready: .venv, build/upstream/megatron (pristine), megatron/ (patched)"
