#!/usr/bin/env bash
# scripts/setup.sh: make a fresh clone ready to run. Idempotent; a second run with
# nothing changed only checks stamps (seconds).
#
# Data flow (one way):
#   requirements/megatron-core.lock --(pip download, sha256 check)--> build/wheels/*.whl
#   0.17.1 wheel --(unzip megatron/)--> build/upstream/megatron        (pristine, read-only use)
#   0.19.2 wheel --(unzip megatron/)--> build/upstream-0.19/megatron   (pristine 0.19 base)
#   pristine + patches/0.17.1/series --(git am, one commit per patch)--> build/series-git
#   build/series-git HEAD --(git archive)--> megatron/                 (patched, gitignored)
#   0.19 pristine + patches/0.19/series --(git am)--> build/series-git-0.19 --> build/patched-0.19/megatron
#   requirements/lock.txt --(pip install)--> .venv                     (CPython 3.12.x)
#   Megatron-LM core_v0.17.1 source --(verify, unpack, git init + tag)--> build/megatron-lm/core_v0.17.1
#   that checkout --(git clone, scripts/apply_patches.sh = git am)--> build/megatron-lm/patched
#   Megatron-LM core_v0.18.2 source --(same)--> build/megatron-lm/core_v0.18.2  (refusal tests only)
#   Megatron-LM core_v0.19.0 source --(same)--> build/megatron-lm/core_v0.19.0  (the 0.19 base)
#   that checkout --(git clone, scripts/apply_patches.sh)--> build/megatron-lm/patched-0.19
#
# Megatron-LM checkouts (requirements/megatron-lm.lock; upstream's pretrain_gpt.py and
# tests/unit_tests/, which the wheel lacks). The source of each, first found wins:
#   1. MEGATRON_LM_SRC (core_v0.17.1) / MEGATRON_LM_NEXT_SRC (core_v0.18.2): a git checkout
#      (its committed HEAD is used) or a plain directory or a .tar.gz of one;
#   2. ../shared/upstream/Megatron-LM-<tag>.tar.gz beside the repository root (for a git
#      worktree: beside the main checkout's root);
#   3. git clone --depth 1 --branch <tag> https://github.com/NVIDIA/Megatron-LM (network).
# Verified by the lock's tarball sha256, or the commit (git HEAD, clone, or the commit id that
# `git archive` writes into the tarball), and always by megatron/core/package_info.py and, for
# core_v0.17.1, the sha256 of every file the series touches (patches/0.17.1/manifest.sha256). Then
# unpacked under build/ as a git repository with one commit tagged <tag>, so that `git am`
# runs on it as on a user's clone. A missing core_v0.17.1 is an error; a missing core_v0.18.2
# only skips the tests that need it.
#
# Usage: scripts/setup.sh [--quiet]
# Env:   PYTHON=/path/to/python3.12  use this interpreter for the venv (else python3.12,
#        pyenv's oldest 3.12.x, or python3 if it is 3.12). Only 3.12: the
#        pinned wheel's prebuilt extension (helpers_cpp) is cp312.
#        MEGATRON_LM_SRC, MEGATRON_LM_NEXT_SRC, MEGATRON_LM_019_SRC (core_v0.19.0): see above.
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
    for cand in python3.12; do
        if command -v "$cand" >/dev/null 2>&1 && "$cand" -c '' 2>/dev/null; then
            command -v "$cand"; return
        fi
    done
    if command -v pyenv >/dev/null 2>&1; then
        cand="$(pyenv versions --bare 2>/dev/null | grep -E '^3\.12\.[0-9]+$' | sort -V | head -n1 || true)"
        if [[ -n "$cand" ]]; then echo "$(pyenv root)/versions/$cand/bin/python"; return; fi
    fi
    if command -v python3 >/dev/null 2>&1; then command -v python3; return; fi
    echo ""
}

if [[ ! -x .venv/bin/python ]]; then
    PY="$(find_python)"
    [[ -n "$PY" ]] || die "no Python 3.12 found. Install it (e.g. 'pyenv install 3.12') or set PYTHON=/path/to/python3.12"
    "$PY" -c 'import sys; sys.exit(0 if sys.version_info[:2] == (3, 12) else 1)' \
        || die "$PY is Python $("$PY" -c 'import sys; print(sys.version.split()[0])'); the megatron-core $MCORE_VERSION wheel is cp312 (its helpers_cpp extension loads only on 3.12). Set PYTHON=/path/to/python3.12"
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

# ---------------------------------------------------------------- 3. pinned wheels
# fetch_wheel VERSION WHEEL SHA256: build/wheels/WHEEL, downloaded once, sha256 checked.
fetch_wheel() {
    local version="$1" wheel="$2" want="$3" path="build/wheels/$2" tmpd got
    if [[ ! -f "$path" ]]; then
        say "downloading megatron-core==$version wheel"
        tmpd="$(mktemp -d build/wheels/.dl.XXXXXX)"
        PIP_CONFIG_FILE=/dev/null "$VPY" -m pip download --disable-pip-version-check -q --no-deps \
            --only-binary :all: --python-version 3.12 -d "$tmpd" "megatron-core==$version" \
            || { rm -rf "$tmpd"; die "could not download megatron-core==$version (network/registry?)"; }
        [[ -f "$tmpd/$wheel" ]] || { ls "$tmpd" >&2; rm -rf "$tmpd"; die "registry served a different wheel than $wheel"; }
        mv "$tmpd/$wheel" "$path"; rm -rf "$tmpd"
    fi
    got="$(sha "$path")"
    if [[ "$got" != "$want" ]]; then
        rm -f "$path"
        die "sha256 of $wheel is $got, expected $want (requirements/megatron-core.lock). Deleted it; rerun to download again."
    fi
}
fetch_wheel "$MCORE_VERSION" "$MCORE_WHEEL" "$MCORE_WHEEL_SHA256"
fetch_wheel "$MCORE19_VERSION" "$MCORE19_WHEEL" "$MCORE19_WHEEL_SHA256"
WHEEL="build/wheels/$MCORE_WHEEL"
wheel_sha="$MCORE_WHEEL_SHA256"

# ---------------------------------------------------------------- 4. pristine trees
# extract_tree WHEEL SHA256 DEST NAME: DEST/megatron from the wheel, stamped by its sha256.
extract_tree() {
    local wheel="$1" want="$2" dest="$3" name="$4"
    if [[ "$(cat "build/stamps/$name" 2>/dev/null || true)" == "$want" && -d "$dest/megatron/core" ]]; then
        log "pristine tree $dest/megatron up to date"; return 1
    fi
    say "extracting pristine tree $dest/megatron"
    rm -rf "$dest.tmp" && mkdir -p "$dest.tmp"
    "$VPY" - "$wheel" "$dest.tmp" <<'PY'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as zf:
    zf.extractall(sys.argv[2], [n for n in zf.namelist() if n.startswith("megatron/")])
PY
    # Keep executable bits of the prebuilt extension, as pip would.
    chmod -R u+rwX,go+rX "$dest.tmp"
    rm -rf "$dest" && mv "$dest.tmp" "$dest"
    echo "$want" > "build/stamps/$name"
}
if extract_tree "$WHEEL" "$wheel_sha" build/upstream upstream; then rm -f build/stamps/series; fi
if extract_tree "build/wheels/$MCORE19_WHEEL" "$MCORE19_WHEEL_SHA256" build/upstream-0.19 upstream-0.19; then
    rm -f build/stamps/series-0.19
fi

# ---------------------------------------------------------------- 5. series repos + patched trees
# build_series SERIES PRISTINE SG OUT VERSION WHEEL_SHA STAMP [REFRESH_ENV...]
#   SERIES     patches/<base> (series, *.patch, manifest.sha256)
#   PRISTINE   the directory holding the pristine megatron/ of that base
#   SG         the series repo to build: commit `pristine` + git am of every patch (with its tests)
#   OUT        where the patched megatron/ goes (its parent directory)
#   STAMP      name under build/stamps; REFRESH_ENV: VAR=VALUE for refresh_patches.sh --check
build_series() {
    local series="$1" pristine="$2" sg="$3" out="$4" version="$5" wsha="$6" stamp="$7"; shift 7
    local refresh_env=("$@") sha sg_head built_head p
    sha="$( { echo "$wsha"; cat "$series/series"; while read -r p; do cat "$series/$p"; done < <(grep -vE '^\s*(#|$)' "$series/series"); } | sha256sum | awk '{print $1}' )" \
        || die "$series/series names a patch file that does not exist (see above)"
    # Commits a developer made in $sg (patches/README.md) must reach $series before a rebuild
    # replaces $sg: refuse while they are not refreshed; once they are, rebuild from $series.
    if [[ -d "$sg/.git" ]]; then
        sg_head="$(git -C "$sg" rev-parse -q --verify HEAD 2>/dev/null || true)"
        built_head="$(cat "build/stamps/$stamp-head" 2>/dev/null || git -C "$sg" rev-parse -q --verify 'pristine^{commit}' 2>/dev/null || true)"
        if [[ "$sg_head" != "$built_head" ]]; then
            [[ -z "$(git -C "$sg" status --porcelain 2>/dev/null)" ]] \
                || die "$sg has uncommitted edits. Commit them and run scripts/refresh_patches.sh, or discard them (git -C $sg checkout -- .), then rerun."
            env "${refresh_env[@]}" scripts/refresh_patches.sh --check >/dev/null \
                || die "$sg has commits that $series/ does not have (HEAD: $(git -C "$sg" log -1 --format='%h %s')). Run ${refresh_env[*]:+${refresh_env[*]} }scripts/refresh_patches.sh to write them to $series/, or drop them (rm -rf $sg), then rerun."
            rm -f "build/stamps/$stamp"
        fi
    fi
    if [[ "$(cat "build/stamps/$stamp" 2>/dev/null || true)" == "$sha" && -d "$out/megatron/core" ]]; then
        log "patched tree $out/megatron up to date ($(grep -cvE '^\s*(#|$)' "$series/series") patches)"; return 0
    fi
    if [[ -d "$sg/.git" ]] && [[ -n "$(git -C "$sg" status --porcelain 2>/dev/null)" ]]; then
        die "$sg has uncommitted edits. Commit them and run scripts/refresh_patches.sh, or discard them (git -C $sg checkout -- .), then rerun."
    fi
    say "building $sg: pristine commit + git am $series/series"
    rm -rf "$sg.tmp" && mkdir -p "$sg.tmp"
    cp -a "$pristine/megatron" "$sg.tmp/megatron"
    # The pristine commit holds the wheel's files only: not the make files place_helpers adds
    # to the pristine tree (neither wheel ships a Makefile there); megatron/ gets them again below.
    rm -f "$sg.tmp/megatron/core/datasets/GNUmakefile" "$sg.tmp/megatron/core/datasets/Makefile"
    (
        export GIT_AUTHOR_NAME="megatron-core wheel" GIT_AUTHOR_EMAIL="pristine@invalid" \
            GIT_COMMITTER_NAME="series-git" GIT_COMMITTER_EMAIL="series-git@invalid" \
            GIT_AUTHOR_DATE="2000-01-01T00:00:00Z" GIT_COMMITTER_DATE="2000-01-01T00:00:00Z"
        cd "$sg.tmp"
        git init -q -b main . && git config core.autocrlf false && git config commit.gpgsign false
        find megatron -name __pycache__ -prune -exec rm -rf {} +
        git add -A megatron && git commit -q -m "megatron-core $version pristine (wheel sha256 $wsha)"
        git tag pristine
    )
    while read -r p; do
        [[ -f "$series/$p" ]] || { rm -rf "$sg.tmp"; die "$series/series names $series/$p, which does not exist"; }
        GIT_COMMITTER_NAME="series-git" GIT_COMMITTER_EMAIL="series-git@invalid" GIT_COMMITTER_DATE="2000-01-01T00:00:00Z" \
            git -C "$sg.tmp" am -q --keep-cr "$ROOT/$series/$p" \
            || { git -C "$sg.tmp" am --abort 2>/dev/null || true; rm -rf "$sg.tmp"; die "$series/$p does not apply to megatron-core $version (git am failed). $out/megatron left as it was."; }
    done < <(grep -vE '^\s*(#|$)' "$series/series")
    rm -rf "$out/megatron.tmp" && mkdir -p "$out/megatron.tmp"
    # The patched tree is megatron/ alone: each patch's own tests (tests/unit_tests/) stay in $sg
    # and go to the Megatron-LM checkouts (scripts/apply_patches.sh).
    git -C "$sg.tmp" archive HEAD megatron | tar -x -C "$out/megatron.tmp"
    # The prebuilt extension is not text; git keeps it byte-exact but archive drops nothing else.
    rm -rf "$sg" && mv "$sg.tmp" "$sg"
    git -C "$sg" rev-parse HEAD > "build/stamps/$stamp-head"
    rm -rf "$out/megatron" && mv "$out/megatron.tmp/megatron" "$out/megatron" && rmdir "$out/megatron.tmp"
    echo "$sha" > "build/stamps/$stamp"
}
SERIES=patches/$MCORE_VERSION  # the series of the 0.17.1 base (series, *.patch, manifest.sha256)
build_series "$SERIES" build/upstream build/series-git . "$MCORE_VERSION" "$wheel_sha" series
SERIES19=patches/0.19  # the 0.19 base: 0.19.2's wheel, patched tree build/patched-0.19/megatron
mkdir -p build/patched-0.19
build_series "$SERIES19" build/upstream-0.19 build/series-git-0.19 build/patched-0.19 "$MCORE19_VERSION" \
    "$MCORE19_WHEEL_SHA256" series-0.19 SERIES_GIT=build/series-git-0.19 PATCHES_DIR="$SERIES19"

# ---------------------------------------------------------------- 6. Megatron-LM checkouts
# shellcheck source=../requirements/megatron-lm.lock
source requirements/megatron-lm.lock
MLM=build/megatron-lm
mkdir -p "$MLM"
# Where ../shared/upstream may be: beside this root, and for a git worktree beside the main
# checkout's root (git's common dir is <main root>/.git).
shared_dirs=("$ROOT/../shared/upstream")
if common="$(git -C "$ROOT" rev-parse --path-format=absolute --git-common-dir 2>/dev/null)"; then
    main_root="$(dirname "$common")"
    [[ "$main_root" != "$ROOT" ]] && shared_dirs+=("$main_root/../shared/upstream")
fi
pyver() { # <package_info.py>: MAJOR.MINOR.PATCH
    sed -nE 's/^(MAJOR|MINOR|PATCH)[[:space:]]*=[[:space:]]*([0-9]+).*/\2/p' "$1" | head -n3 | paste -sd.
}
# The pristine sha256 of every megatron/ file the series touches ('-': absent before).
touched_ok() { # <tree root>: every touched file is the pristine 0.17.1 one
    local kind pri pat f
    while read -r kind pri pat f; do
        [[ "$kind" == file && "$f" == megatron/* ]] || continue
        if [[ "$pri" == - ]]; then [[ ! -e "$1/$f" ]] || return 1
        else [[ -f "$1/$f" && "$(sha "$1/$f")" == "$pri" ]] || return 1; fi
    done < "$SERIES/manifest.sha256"
}

# mlm_checkout TAG VERSION COMMIT TARBALL TARBALL_SHA256 SRC REQUIRED VAR
# Builds $MLM/TAG (a git repo, one commit tagged TAG) from the first source found; VAR names the
# variable that gives SRC. Without SRC or a tarball in ../shared/upstream, a checkout an earlier
# run built (and verified) is kept rather than cloned again.
# Returns 1 (after a warning) when REQUIRED=0 and no source is usable.
mlm_checkout() {
    local tag="$1" version="$2" commit="$3" tarball="$4" tsha="$5" src="$6" required="$7" var="$8"
    local dest="$MLM/$tag" kind="" ident="" how="" d top got
    local fail; if [[ $required == 1 ]]; then fail=die; else fail=warn_skip; fi
    if [[ -n "$src" ]]; then
        [[ -e "$src" ]] || $fail "the Megatron-LM source '$src' ($var) does not exist" || return 1
        src="$(cd "$(dirname "$src")" && pwd -P)/$(basename "$src")"
        if [[ -f "$src" ]]; then kind=tarball; ident="tarball $(sha "$src")"
        elif git -C "$src" rev-parse -q --verify HEAD >/dev/null 2>&1 \
            && [[ "$(git -C "$src" rev-parse --show-toplevel)" == "$(cd "$src" && pwd -P)" ]]; then
            kind=git; ident="git $(git -C "$src" rev-parse HEAD)"
        else kind=dir; ident="dir $src $(find "$src" -path "$src/.git" -prune -o -type f -newer "$dest/.git/HEAD" -print -quit 2>/dev/null)"; fi
    else
        for d in "${shared_dirs[@]}"; do
            if [[ -f "$d/$tarball" ]]; then src="$(cd "$d" && pwd -P)/$tarball"; kind=tarball; ident="tarball $(sha "$src")"; break; fi
        done
        if [[ -z "$kind" && -d "$dest/.git" && -s "build/stamps/mlm-$tag" ]]; then
            log "Megatron-LM checkout $dest kept (no $var and no ../shared/upstream/$tarball this time)"; return 0
        fi
        if [[ -z "$kind" ]]; then
            kind=clone; ident="clone $commit"
        fi
    fi
    if [[ -d "$dest/.git" && "$(cat "build/stamps/mlm-$tag" 2>/dev/null || true)" == "$ident" ]]; then
        log "Megatron-LM checkout $dest up to date ($kind)"; return 0
    fi
    local tmp="$dest.tmp"
    rm -rf "$tmp" && mkdir -p "$tmp/x"
    case "$kind" in
        tarball)
            say "unpacking Megatron-LM $tag from $src"
            if [[ "${ident#tarball }" == "$tsha" ]]; then how="tarball sha256 $tsha"
            elif got="$(gzip -dc "$src" | git get-tar-commit-id 2>/dev/null)" && [[ "$got" == "$commit" ]]; then how="git archive commit id $got"
            fi
            tar -xzf "$src" -C "$tmp/x" || { rm -rf "$tmp"; $fail "cannot unpack $src (not a .tar.gz?)" || return 1; } ;;
        git)
            say "exporting Megatron-LM $tag from the git checkout $src (HEAD)"
            got="$(git -C "$src" rev-parse HEAD)"; [[ "$got" == "$commit" ]] && how="commit $got"
            git -C "$src" archive --format=tar HEAD | tar -x -C "$tmp/x" ;;
        dir)
            say "copying Megatron-LM $tag from $src"
            tar -C "$src" --exclude=./.git -cf - . | tar -x -C "$tmp/x" ;;
        clone)
            say "cloning Megatron-LM $tag from $MLM_REPO_URL (no local source found)"
            if ! timeout 600 git clone -q --depth 1 --branch "$tag" "$MLM_REPO_URL" "$tmp/clone" 2>"$tmp/clone.err"; then
                local why; why="$(tail -n1 "$tmp/clone.err")"; rm -rf "$tmp"
                $fail "could not get Megatron-LM $tag: no ../shared/upstream/$tarball and git clone failed ($why). Set $var=/path/to/Megatron-LM (a checkout at $tag or its tarball)" || return 1
            fi
            got="$(git -C "$tmp/clone" rev-parse HEAD)"
            [[ "$got" == "$commit" ]] || { rm -rf "$tmp"; $fail "git clone --branch $tag gave commit $got, expected $commit (requirements/megatron-lm.lock); the tag moved?" || return 1; }
            how="commit $got"
            git -C "$tmp/clone" archive --format=tar HEAD | tar -x -C "$tmp/x"; rm -rf "$tmp/clone" ;;
    esac
    # A tarball has one top folder (Megatron-LM-<tag>/); use it as the root.
    top="$tmp/x"
    if [[ $(find "$tmp/x" -mindepth 1 -maxdepth 1 | wc -l) == 1 ]] && [[ -d "$(find "$tmp/x" -mindepth 1 -maxdepth 1)" ]]; then
        top="$(find "$tmp/x" -mindepth 1 -maxdepth 1)"
    fi
    [[ -f "$top/megatron/core/package_info.py" && -f "$top/pretrain_gpt.py" ]] \
        || { rm -rf "$tmp"; $fail "$src is not a Megatron-LM source tree (no megatron/core/package_info.py or pretrain_gpt.py)" || return 1; }
    got="$(pyver "$top/megatron/core/package_info.py")"
    [[ "$got" == "$version" ]] || { rm -rf "$tmp"; $fail "$src has megatron-core $got, expected $version (tag $tag)" || return 1; }
    if [[ "$tag" == "$MLM_TAG" ]]; then
        touched_ok "$top" || { rm -rf "$tmp"; $fail "$src: a file the series touches differs from megatron-core $version's ($SERIES/manifest.sha256); use an unmodified $tag" || return 1; }
        how="${how:+$how, }touched files' sha256"
    fi
    [[ -n "$how" ]] || how="version $got only (unknown commit: not the lock's tarball or commit)"
    (
        cd "$top"
        export GIT_AUTHOR_NAME="Megatron-LM $tag" GIT_AUTHOR_EMAIL="upstream@invalid" \
            GIT_COMMITTER_NAME="Megatron-LM $tag" GIT_COMMITTER_EMAIL="upstream@invalid" \
            GIT_AUTHOR_DATE="2000-01-01T00:00:00Z" GIT_COMMITTER_DATE="2000-01-01T00:00:00Z"
        git init -q -b main . && git config core.autocrlf false && git config commit.gpgsign false
        git config user.name "megatron-layerwise-ag setup" && git config user.email "setup@invalid"
        git add -A . && git commit -q -m "Megatron-LM $tag (upstream commit $commit)" -m "Source: $src ($kind); verified by $how."
        git tag "$tag"
    )
    rm -rf "$dest" && mv "$top" "$dest" && rm -rf "$tmp"
    echo "$ident" > "build/stamps/mlm-$tag"
    say "Megatron-LM $tag: $dest (verified by $how)"
}
warn_skip() { echo "[setup] WARNING: $*; the tests that need it are skipped" >&2; return 1; }

mlm_checkout "$MLM_TAG" "$MLM_VERSION" "$MLM_COMMIT" "$MLM_TARBALL" "$MLM_TARBALL_SHA256" "${MEGATRON_LM_SRC:-}" 1 MEGATRON_LM_SRC
mlm_checkout "$MLM_NEXT_TAG" "$MLM_NEXT_VERSION" "$MLM_NEXT_COMMIT" "$MLM_NEXT_TARBALL" "$MLM_NEXT_TARBALL_SHA256" "${MEGATRON_LM_NEXT_SRC:-}" 0 MEGATRON_LM_NEXT_SRC || true
mlm_checkout "$MLM_019_TAG" "$MLM_019_VERSION" "$MLM_019_COMMIT" "$MLM_019_TARBALL" "$MLM_019_TARBALL_SHA256" "${MEGATRON_LM_019_SRC:-}" 0 MEGATRON_LM_019_SRC || true

# Upstream main at MLM_MAIN_COMMIT (optional; docs/own_tree.md): $MLM/$MLM_MAIN_NAME, the main
# tarball committed on top of the core_v0.19.0 checkout (git clone --local, about 4 s), so that
# its history holds 0.19's blobs as a real clone of main does: git am -3 merges from them.
# From MEGATRON_LM_MAIN_SRC (the tarball) or ../shared/upstream/; skipped without either.
mlm_main_checkout() {
    local dest="$MLM/$MLM_MAIN_NAME" base="$MLM/$MLM_019_TAG" src="${MEGATRON_LM_MAIN_SRC:-}" d ident got
    if [[ -z "$src" ]]; then
        for d in "${shared_dirs[@]}"; do [[ -f "$d/$MLM_MAIN_TARBALL" ]] && { src="$d/$MLM_MAIN_TARBALL"; break; }; done
    fi
    if [[ -z "$src" || ! -f "$src" ]]; then log "no $MLM_MAIN_TARBALL: $dest not built (only the tests of upstream main skip)"; return 0; fi
    [[ -d "$base/.git" ]] || { log "no $base: $dest not built"; return 0; }
    ident="tarball $(sha "$src") on $(git -C "$base" rev-parse HEAD)"
    if [[ -d "$dest/.git" && "$(cat "build/stamps/mlm-$MLM_MAIN_NAME" 2>/dev/null || true)" == "$ident" ]]; then
        log "Megatron-LM $MLM_MAIN_NAME checkout $dest up to date"; return 0
    fi
    if [[ "${ident%% on *}" != "tarball $MLM_MAIN_TARBALL_SHA256" ]]; then
        got="$(gzip -dc "$src" | git get-tar-commit-id 2>/dev/null || true)"
        [[ "$got" == "$MLM_MAIN_COMMIT" ]] || die "$src is neither the lock's tarball (sha256 $MLM_MAIN_TARBALL_SHA256) nor a git archive of $MLM_MAIN_COMMIT"
    fi
    say "building $dest: upstream main ${MLM_MAIN_COMMIT:0:10} committed on top of $MLM_019_TAG"
    rm -rf "$dest.tmp"
    git clone -q --local --no-checkout "$base" "$dest.tmp"
    git -C "$dest.tmp" remote remove origin
    tar -xzf "$src" -C "$dest.tmp" --strip-components=1 || { rm -rf "$dest.tmp"; die "cannot unpack $src"; }
    got="$(pyver "$dest.tmp/megatron/core/package_info.py")"
    [[ "$got" == "$MLM_MAIN_VERSION" ]] || { rm -rf "$dest.tmp"; die "$src has megatron-core $got, expected $MLM_MAIN_VERSION"; }
    (
        cd "$dest.tmp"
        export GIT_AUTHOR_NAME="Megatron-LM main" GIT_AUTHOR_EMAIL="upstream@invalid" \
            GIT_COMMITTER_NAME="Megatron-LM main" GIT_COMMITTER_EMAIL="upstream@invalid" \
            GIT_AUTHOR_DATE="2000-01-01T00:00:00Z" GIT_COMMITTER_DATE="2000-01-01T00:00:00Z"
        git add -A . && git commit -q -m "Megatron-LM main (upstream commit $MLM_MAIN_COMMIT)" \
            -m "Source: $src; committed on top of $MLM_019_TAG so that the history holds its blobs."
        git tag "$MLM_MAIN_NAME"
        git config user.name "megatron-layerwise-ag setup" && git config user.email "setup@invalid"
    )
    rm -rf "$dest" && mv "$dest.tmp" "$dest"
    echo "$ident" > "build/stamps/mlm-$MLM_MAIN_NAME"
    say "Megatron-LM $MLM_MAIN_NAME: $dest"
}
mlm_main_checkout

# The user's path: the series on the core_v0.17.1 checkout with scripts/apply_patches.sh
# (git am, one commit per patch). The prebuilt dataset helpers of the wheel go next to the
# sources in both 0.17.1 checkouts, as `make` would put them (*.so is in upstream's .gitignore).
EXT_SUFFIX="$("$VPY" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')"
MAKEFILE17="$MLM/$MLM_TAG/megatron/core/datasets/Makefile"
patched_sha="$( { cat "build/stamps/mlm-$MLM_TAG"; cat build/stamps/series; sha scripts/apply_patches.sh; } | sha256sum | awk '{print $1}')"
PC="$MLM/patched"
# place_helpers TREE WHEEL_TREE MAKEFILE: make megatron.training's dataset-helper step pass in
# TREE (a directory holding megatron/). On GPU ranks, rank 0 runs compile_helpers()
# (megatron/training/initialize.py:_compile_dependencies), i.e. `make -C
# TREE/megatron/core/datasets`; the wheel has no Makefile there, and make then fails ("no
# makefile found"). So, in TREE/megatron/core/datasets:
#   - the wheel's prebuilt helpers_cpp*.so (from WHEEL_TREE), as `make` would put them (*.so is
#     in upstream's .gitignore), only where helpers.cpp is byte-identical to the wheel's (the
#     source it was built from); present ones are kept;
#   - upstream's own Makefile (MAKEFILE, from the Megatron-LM checkout) where there is none;
#   - a GNUmakefile (make reads it before Makefile) that includes that Makefile with LIBEXT
#     pinned to the extension suffix of .venv's Python, the one that imports helpers_cpp:
#     upstream's Makefile asks the python3-config on PATH, which may be another Python's
#     (here: 3.11's), and then names a target that does not exist and tries to compile it;
#     and that, while helpers.cpp is byte-identical to the wheel's, gives the prebuilt .so the
#     time of helpers.cpp, so that make finds it up to date (the times of a wheel or tarball
#     unpack, a clone or a later git checkout say nothing about which was built from which);
# A helpers.cpp that differs from the wheel's gets no .so: make builds it (g++ and pybind11).
place_helpers() {
    local tree="$1" dest="$1/megatron/core/datasets" src="$2/megatron/core/datasets" makefile="$3" so
    if ! cmp -s "$src/helpers.cpp" "$dest/helpers.cpp"; then
        log "$dest/helpers.cpp differs from $src's: no prebuilt helpers placed (make builds them)"
    else
        for so in "$src"/helpers_cpp*.so; do [[ -f "$dest/${so##*/}" ]] || cp -p "$so" "$dest/"; done
    fi
    [[ -f "$dest/Makefile" ]] || cp -p "$makefile" "$dest/Makefile"
    local wheel_cpp; wheel_cpp="$(cd "$src" && pwd -P)/helpers.cpp"
    printf '%s\n' \
        "# Written by scripts/setup.sh (place_helpers). make reads this before upstream's Makefile:" \
        "# the prebuilt helpers_cpp is named for the Python that imports it ($VPY), not" \
        "# for whichever python3-config is first on PATH." \
        "override LIBEXT := $EXT_SUFFIX" \
        "# helpers_cpp\$(LIBEXT) is the wheel's build of $wheel_cpp: while helpers.cpp is" \
        "# byte-identical to that source it is up to date, whatever the file times say (a git" \
        "# checkout or a copy changes them); otherwise make rebuilds it (g++ and pybind11)." \
        "ifeq (\$(shell cmp -s helpers.cpp $wheel_cpp && echo same),same)" \
        "\$(shell touch -c -r helpers.cpp helpers_cpp\$(LIBEXT))" \
        "endif" \
        "include Makefile" > "$dest/GNUmakefile"
    # A Megatron-LM checkout stays clean for git (apply_patches.sh checks it).
    if [[ -d "$tree/.git" ]] && ! grep -qx '/megatron/core/datasets/GNUmakefile' "$tree/.git/info/exclude" 2>/dev/null; then
        mkdir -p "$tree/.git/info" && echo '/megatron/core/datasets/GNUmakefile' >> "$tree/.git/info/exclude"
    fi
    return 0
}
# patch_checkout TAG DEST STAMP SHA WHEEL_TREE MAKEFILE: DEST = a clone of $MLM/TAG with
# scripts/apply_patches.sh applied (git am), the dataset helpers placed (place_helpers);
# rebuilt when build/stamps/STAMP differs from SHA or DEST's HEAD is not the one it built (DEST
# is a build output: the series, its tests included, is edited in build/series-git).
patch_checkout() {
    local tag="$1" dest="$2" stamp="$3" want="$4" out
    if [[ "$(cat "build/stamps/$stamp" 2>/dev/null || true)" == "$want" && -d "$dest/.git" \
          && "$(git -C "$dest" rev-parse -q --verify HEAD)" == "$(cat "build/stamps/$stamp-head" 2>/dev/null)" ]]; then
        log "patched Megatron-LM checkout $dest up to date"; return 0
    fi
    say "building $dest: $tag + scripts/apply_patches.sh (git am)"
    rm -rf "$dest.tmp"
    git clone -q "$MLM/$tag" "$dest.tmp"
    git -C "$dest.tmp" config user.name "megatron-layerwise-ag setup"
    git -C "$dest.tmp" config user.email "setup@invalid"
    out="$(GIT_COMMITTER_DATE="2000-01-01T00:00:00Z" scripts/apply_patches.sh "$dest.tmp" 2>&1)" \
        || { rm -rf "$dest.tmp"; die "the series does not apply to the Megatron-LM $tag checkout: $out"; }
    log "$out"
    place_helpers "$dest.tmp" "$5" "$6"
    rm -rf "$dest" && mv "$dest.tmp" "$dest"
    git -C "$dest" rev-parse HEAD > "build/stamps/$stamp-head"
    echo "$want" > "build/stamps/$stamp"
}
patch_checkout "$MLM_TAG" "$PC" mlm-patched "$patched_sha" build/upstream "$MAKEFILE17"
# The 0.19 base's checkout with its series (git am), when the core_v0.19.0 source was found.
PC19="$MLM/patched-0.19"
if [[ -d "$MLM/$MLM_019_TAG/.git" ]]; then
    patched19_sha="$( { cat "build/stamps/mlm-$MLM_019_TAG"; cat build/stamps/series-0.19; sha scripts/apply_patches.sh; } | sha256sum | awk '{print $1}')"
    patch_checkout "$MLM_019_TAG" "$PC19" mlm-patched-0.19 "$patched19_sha" build/upstream-0.19 \
        "$MLM/$MLM_019_TAG/megatron/core/datasets/Makefile"
fi
# Every tree a GPU rank may import gets the dataset-helper step (place_helpers): the wheel trees
# with the Makefile of their base's checkout (0.19's from core_v0.17.1 when core_v0.19.0 is
# missing: the two files are identical), the checkouts with their own. Run on every setup, so a
# rebuilt tree gets them again. core_v0.18.2 (the audit and refusal tests; nothing trains on it)
# gets the 0.19.2 wheel's helpers: its helpers.cpp is byte-identical (place_helpers checks).
MAKEFILE19="$MLM/$MLM_019_TAG/megatron/core/datasets/Makefile"
[[ -f "$MAKEFILE19" ]] || MAKEFILE19="$MAKEFILE17"
place_helpers build/upstream build/upstream "$MAKEFILE17"
place_helpers . build/upstream "$MAKEFILE17"
place_helpers "$MLM/$MLM_TAG" build/upstream "$MAKEFILE17"
place_helpers "$PC" build/upstream "$MAKEFILE17"
place_helpers build/upstream-0.19 build/upstream-0.19 "$MAKEFILE19"
place_helpers build/patched-0.19 build/upstream-0.19 "$MAKEFILE19"
for t in "$MLM/$MLM_019_TAG" "$PC19" "$MLM/$MLM_NEXT_TAG" "$MLM/$MLM_MAIN_NAME"; do
    if [[ -d "$t/.git" ]]; then place_helpers "$t" build/upstream-0.19 "$MAKEFILE19"; fi
done
log "ready: .venv, build/upstream/megatron (pristine-0.17.1), megatron/ (series-0.17.1), build/upstream-0.19/megatron (pristine-0.19: $MCORE19_VERSION), build/patched-0.19/megatron (series-0.19), $MLM/{$MLM_TAG,patched$([[ -d "$MLM/$MLM_NEXT_TAG/.git" ]] && echo ",$MLM_NEXT_TAG")$([[ -d "$MLM/$MLM_019_TAG/.git" ]] && echo ",$MLM_019_TAG,patched-0.19")$([[ -d "$MLM/$MLM_MAIN_NAME/.git" ]] && echo ",$MLM_MAIN_NAME")}"
