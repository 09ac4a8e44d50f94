#!/usr/bin/env bash
# scripts/apply_patches.sh: apply, check or reverse the patch series on your own megatron-core.
#
# The base is exactly megatron-core 0.17.1 (Megatron-LM tag core_v0.17.1): the version in
# megatron/core/package_info.py and the sha256 of every touched file must be 0.17.1's. Other
# versions are refused (exit 5) with one line that says what you have and what to do:
#   0.17.0 and other 0.17.x: update to 0.17.1 first; the series is made and verified on its files.
#   0.18 and later: do not apply. They already receive the layer-wise param all-gather into
#     grad_data and zero it after the copy-back (upstream #3751 + #4609); the line also says
#     what they still lack that this series fixes.
#
# Usage: scripts/apply_patches.sh TARGET [--check | --reverse]
#   TARGET   a Megatron-LM git checkout (at tag core_v0.17.1), or any directory that holds
#            megatron/core (e.g. .../site-packages of an env with megatron-core==0.17.1).
#            Not the megatron/ package itself: pass the directory above it.
#            A patch that touches only tests/unit_tests/ (upstream's own tests, updated for
#            the series) applies only to a Megatron-LM checkout (TARGET has pretrain_gpt.py
#            and tests/unit_tests/); for any other TARGET it is skipped, with a note.
#   (none)     apply the whole series. On a git checkout whose top level is TARGET and that
#              tracks megatron/: one commit per patch (git am, your identity as committer).
#              Anywhere else: the files are rewritten in place (mode and owner kept).
#   --check    report the state and exit 0 / 3 / 4 (below); changes nothing.
#   --reverse  undo the series. On a git checkout: one commit per patch, newest first,
#              "Revert "<subject>"", made by reverse-applying the patch (works however the
#              series got there: git am, cherry-pick, squash). Elsewhere: files rewritten.
# Env:   PATCHES_DIR=DIR  use the series in DIR (series, *.patch, manifest.sha256) instead of
#                         the folder of patches/ next to this script whose manifest's base is
#                         TARGET's version (patches/0.17.1/; the tests use synthetic series).
#
# Exit codes (every error is one line on stderr that says what is wrong and what to do; on any
# non-zero exit TARGET's files, and on a git checkout its HEAD, are as they were before):
#   0  done: applied / reversed, or nothing to do (already applied / not applied); --check: applied
#   1  error: TARGET missing or not megatron, series/manifest missing or corrupt, the dry run
#      failed (or needed offsets/fuzz), TARGET not writable, uncommitted changes to touched
#      files or an unfinished am/rebase in a git checkout, a git command failed (rolled back)
#   2  usage error
#   3  --check: not applied (every touched file is the pristine upstream one)
#   4  partly applied or foreign changes: some touched file matches neither the pristine nor
#      the patched sha256 in manifest.sha256, or they are mixed (all modes; nothing is changed)
#   5  wrong base: megatron/core/package_info.py is not exactly the version the series is for
#      (manifest.sha256 `base`, 0.17.1)
#   130 interrupted (INT/TERM/HUP) while writing; the touched files (git: HEAD too) were restored
#
# How it stays all-or-nothing:
#   1. Validate everything first: the series file, every patch's sha256 against
#      manifest.sha256 (a truncated or corrupt patch is caught here), the target's version,
#      and the state of each touched file (pristine / patched / foreign) by sha256.
#   2. Dry-run the whole series, in order, on a scratch copy of the touched files with
#      `git apply -v`, for plain directories and git checkouts alike. Why git apply and not
#      patch(1): it never fuzzes, applies each patch atomically, understands git's new-file and
#      mode headers, is what `git am` uses (so the dry run predicts the git path exactly), and
#      -v reports any hunk that lands at an offset, which we refuse. The result must hash to the manifest's patched (or, reversing, pristine) sha256.
#      git apply runs outside any repository (GIT_CEILING_DIRECTORIES) with the user's and the
#      system's git config ignored, so an `apply.whitespace=fix` or a surrounding repo cannot
#      change or silently skip anything.
#   3. Check that every touched file and its directory can be written (an explicit probe: for
#      root, permission bits do not stop writes, but read-only mounts and `chattr +i` do).
#   4. Apply: plain directory -> stage every new file next to its target, then rename them in;
#      a failure restores the originals from the scratch copy. Git checkout -> `git am` (on
#      failure `git am --abort` and a restore of the touched files to the original HEAD);
#      reverse -> `git apply -R --index` + `git commit` per patch, rolled back on failure.
#   5. Verify the touched files now hash to the expected state.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PD="${PATCHES_DIR:-}"
ME=apply_patches.sh
die() { local code="$1"; shift; echo "$ME: error: $*" >&2; exit "$code"; }
usage() { die 2 "usage: scripts/apply_patches.sh TARGET [--check | --reverse]${1:+ ($1)}"; }
sha() { sha256sum -- "$1" | cut -d' ' -f1; }
# git for scratch work: no user/system config, never inside a surrounding repository.
gscratch() { GIT_CONFIG_NOSYSTEM=1 GIT_CONFIG_GLOBAL=/dev/null GIT_CEILING_DIRECTORIES="$SCRATCH" LC_ALL=C git "$@"; }

# ---------------------------------------------------------------- arguments
MODE=apply TARGET=""
for a in "$@"; do
    case "$a" in
        --check)   [[ $MODE == apply ]] || usage "choose one of --check and --reverse"; MODE=check ;;
        --reverse) [[ $MODE == apply ]] || usage "choose one of --check and --reverse"; MODE=reverse ;;
        -h|--help) sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        -*)        usage "unknown option '$a'" ;;
        *)         [[ -z "$TARGET" ]] || usage "more than one TARGET: '$TARGET' and '$a'"; TARGET="$a" ;;
    esac
done
[[ -n "$TARGET" ]] || usage "TARGET is missing"

# ---------------------------------------------------------------- the series
# patches/<base>/ holds the series of one base (its manifest.sha256 names it). Without
# PATCHES_DIR, take the folder whose base is the version in TARGET's package_info.py, else
# the first folder: its checks below refuse TARGET with a line that says what to do.
# version_field PACKAGE_INFO NAME: MAJOR, MINOR or PATCH of megatron/core/package_info.py.
version_field() { sed -nE "s/^$2[[:space:]]*=[[:space:]]*([0-9A-Za-z]+).*/\\1/p" "$1" 2>/dev/null | head -n1; }
if [[ -z "$PD" ]]; then
    pinfo="$TARGET/megatron/core/package_info.py"
    want="$(version_field "$pinfo" MAJOR).$(version_field "$pinfo" MINOR).$(version_field "$pinfo" PATCH)"
    for m in "$ROOT"/patches/*/manifest.sha256; do
        [[ -f "$m" ]] || continue
        [[ -n "$PD" ]] || PD="$(dirname "$m")"
        if awk -v v="$want" '($1 == "base" || $1 == "also") { for (i = 2; i <= NF; i++) if ($i == v) f = 1 } END { exit !f }' "$m"; then
            PD="$(dirname "$m")"; break
        fi
    done
    [[ -n "$PD" ]] || die 1 "no series under $ROOT/patches/ (patches/<base>/series); restore patches/ (git checkout -- patches) or set PATCHES_DIR to a series directory"
fi
# Every base patches/ has a series for, for a refusal: "0.17.1; 0.19.2 (also 0.19.1, 0.19.0)".
supported_bases() {
    for m in "$ROOT"/patches/*/manifest.sha256; do [[ -f "$m" ]] || continue
        awk '$1 == "base" {b = $2} $1 == "also" {for (i = 2; i <= NF; i++) a = a (a ? ", " : "") $i}
             END {if (b) printf "%s%s\n", b, (a ? " (also " a ")" : "")}' "$m"; done | paste -sd';' | sed 's/;/; /g'
}
[[ -f "$PD/series" ]] || die 1 "no series file $PD/series; restore patches/ (git checkout -- patches) or set PATCHES_DIR to a series directory"
[[ -f "$PD/manifest.sha256" ]] || die 1 "$PD/manifest.sha256 is missing; restore patches/ from git, or (developers) run scripts/refresh_patches.sh"
PATCHES=()
while IFS= read -r line || [[ -n "$line" ]]; do
    [[ "$line" =~ ^[[:space:]]*(#|$) ]] && continue
    read -r name extra <<<"$line"
    [[ -z "${extra:-}" && "$name" != */* && "$name" != .* ]] \
        || die 1 "$PD/series has a bad line '$line' (expected one patch file name per line); restore it from git"
    [[ -f "$PD/$name" ]] \
        || die 1 "$PD/series names $name, but $PD/$name does not exist; restore patches/ from git (git checkout -- patches) or, developers, run scripts/refresh_patches.sh"
    PATCHES+=("$name")
done < "$PD/series"

BASE="" ALSO=() MPATCH=() MPSHA=() FILES=() PRI=() PAT=()
while IFS= read -r line || [[ -n "$line" ]]; do
    [[ "$line" =~ ^[[:space:]]*(#|$) ]] && continue
    read -r kind f1 f2 f3 <<<"$line"
    case "$kind" in
        base)  BASE="$f1" ;;
        also)  read -r -a ALSO <<<"${line#also}" ;;
        patch) MPSHA+=("$f1"); MPATCH+=("$f2") ;;
        file)  PRI+=("$f1"); PAT+=("$f2"); FILES+=("$f3") ;;
        *)     die 1 "$PD/manifest.sha256 has an unknown line '$line'; restore it from git or run scripts/refresh_patches.sh" ;;
    esac
done < "$PD/manifest.sha256"
[[ "$BASE" =~ ^[0-9]+\.[0-9]+\.[0-9]+$ ]] || die 1 "$PD/manifest.sha256 has no 'base MAJOR.MINOR.PATCH' line; restore it from git or run scripts/refresh_patches.sh"
[[ "${PATCHES[*]}" == "${MPATCH[*]}" ]] \
    || die 1 "$PD/series and $PD/manifest.sha256 list different patches; restore patches/ from git or run scripts/refresh_patches.sh"
for i in "${!PATCHES[@]}"; do
    [[ "$(sha "$PD/${PATCHES[$i]}")" == "${MPSHA[$i]}" ]] \
        || die 1 "$PD/${PATCHES[$i]} is corrupt or truncated (its sha256 differs from manifest.sha256); restore it (git checkout -- patches) or, developers, run scripts/refresh_patches.sh"
done
for f in "${FILES[@]}"; do
    [[ ( "$f" == megatron/* || "$f" == tests/unit_tests/* ) && "$f" != *..* ]] \
        || die 1 "$PD/manifest.sha256 names '$f', outside megatron/ and tests/unit_tests/; restore it from git"
done
# A checkout-only patch touches nothing but upstream's tests/unit_tests/ (see the header).
checkout_only() { ! grep -E '^diff --git a/' "$PD/$1" | grep -vqE '^diff --git a/tests/unit_tests/[^ ]* b/tests/unit_tests/'; }

# ---------------------------------------------------------------- the target
[[ -e "$TARGET" ]] || die 1 "target '$TARGET' does not exist; pass a Megatron-LM checkout or the directory that holds megatron/core (e.g. site-packages)"
[[ -d "$TARGET" ]] || die 1 "target '$TARGET' is not a directory; pass a Megatron-LM checkout or the directory that holds megatron/core (e.g. site-packages)"
T="$(cd "$TARGET" && pwd -P)"
PINFO="$T/megatron/core/package_info.py"
if [[ ! -f "$PINFO" ]]; then
    [[ -f "$T/core/package_info.py" ]] \
        && die 1 "target '$TARGET' is the megatron package itself; pass the directory above it: $(dirname "$T")"
    die 1 "target '$TARGET' holds no megatron/core/package_info.py, so it is not megatron-core; pass a Megatron-LM checkout or the directory that holds megatron/core"
fi
vmaj="$(version_field "$PINFO" MAJOR)" vmin="$(version_field "$PINFO" MINOR)" vpat="$(version_field "$PINFO" PATCH)"
[[ "$vmaj" =~ ^[0-9]+$ && "$vmin" =~ ^[0-9]+$ ]] || die 1 "cannot read MAJOR/MINOR from $PINFO; is '$TARGET' really megatron-core?"
HAVE="$vmaj.$vmin${vpat:+.$vpat}"
IFS=. read -r bmaj bmin bpat <<<"$BASE"
# `also` versions carry the base's touched files byte for byte (their sha256 is checked below).
for v in "${ALSO[@]}"; do if [[ "$HAVE" == "$v" ]]; then HAVE="$BASE"; fi; done
if [[ "$HAVE" != "$BASE" ]]; then
    if (( vmaj > bmaj || (vmaj == bmaj && vmin > bmin) )); then
        later=""
        (( vmaj > 0 || vmin >= 19 )) && later=" 0.19 also adds full_param_layout, which gathers in place into param_data with no grad_data reuse."
        die 5 "target '$TARGET' has megatron-core $HAVE, newer than $BASE, the exact base of this series: do not apply it. $vmaj.$vmin already receives the layer-wise param all-gather into grad_data.view(param_dtype) and zeroes grad_data after the copy-back (upstream #3751 + #4609), and skips the gather at DP size 1.$later What 0.18 still lacks, which this series fixes on $BASE: a forced sync (start_param_sync(force_sync=True)) or free_overlap_buffers() with a gather pending waits but drops the gathered params and leaves grad_data dirty; nothing guards a param sync while the grad buffers are offloaded; the local params are still flattened into a temporary; the optimizer's synchronous all-gather (no --overlap-param-gather) still allocates a receive tensor per rank every step. This repository has series for: $(supported_bases). On 0.18 update to 0.19.2 (pip install megatron-core==0.19.2, or git checkout core_v0.19.0) and apply patches/0.19/ with this script; otherwise keep your version (README.md says what that means for you)"
    elif (( vmaj == bmaj && vmin == bmin )); then
        die 5 "target '$TARGET' has megatron-core $HAVE, not $BASE, the exact base of this series (made and verified on $BASE's files only): update to $BASE first (git checkout core_v$BASE in a Megatron-LM clone, or pip install megatron-core==$BASE), then rerun"
    else
        die 5 "target '$TARGET' has megatron-core $HAVE, older than $BASE, the exact base of this series: update to $BASE first (git checkout core_v$BASE in a Megatron-LM clone, or pip install megatron-core==$BASE), then rerun"
    fi
fi

# Checkout-only patches (tests/unit_tests/) apply only to a Megatron-LM checkout.
SKIPPED=() NOTE=""
# The state/result line, then the note about skipped checkout-only patches, if any.
report() { echo "$*"; [[ -z "$NOTE" ]] || echo "$NOTE"; }
if [[ ! -d "$T/tests/unit_tests" || ! -f "$T/pretrain_gpt.py" ]]; then
    keep=()
    for p in "${PATCHES[@]}"; do if checkout_only "$p"; then SKIPPED+=("$p"); else keep+=("$p"); fi; done
    PATCHES=("${keep[@]}")
    if [[ ${#SKIPPED[@]} -gt 0 ]]; then
        kf=() kpri=() kpat=()
        for i in "${!FILES[@]}"; do
            [[ "${FILES[$i]}" == tests/unit_tests/* ]] && continue
            kf+=("${FILES[$i]}"); kpri+=("${PRI[$i]}"); kpat+=("${PAT[$i]}")
        done
        FILES=("${kf[@]}") PRI=("${kpri[@]}") PAT=("${kpat[@]}")
        NOTE="note: skipped ${SKIPPED[*]}: it updates upstream's tests/unit_tests/, and '$TARGET' is not a Megatron-LM checkout (no pretrain_gpt.py and tests/unit_tests/)"
    fi
fi

N=${#PATCHES[@]}
if [[ $N -eq 0 ]]; then
    [[ $MODE == check ]] && { report "applied: the series in $PD is empty, so there is nothing to apply"; exit 0; }
    report "nothing to do: the series in $PD is empty"; exit 0
fi

# Git mode: TARGET is the top level of a work tree that tracks megatron/.
GIT=0
if top="$(git -C "$T" rev-parse --show-toplevel 2>/dev/null)" && [[ "$(cd "$top" && pwd -P)" == "$T" ]] \
    && git -C "$T" ls-files --error-unmatch megatron/core/package_info.py >/dev/null 2>&1; then
    GIT=1
fi

# ---------------------------------------------------------------- state of the touched files
cur_sha() { if [[ -f "$1" && ! -L "$1" ]]; then sha "$1"; elif [[ -e "$1" || -L "$1" ]]; then echo other; else echo -; fi; }
n_pri=0 n_pat=0 details=()
for i in "${!FILES[@]}"; do
    c="$(cur_sha "$T/${FILES[$i]}")"
    is_pri=0 is_pat=0
    [[ "$c" == "${PRI[$i]}" ]] && is_pri=1
    [[ "$c" == "${PAT[$i]}" ]] && is_pat=1
    n_pri=$((n_pri + is_pri)) n_pat=$((n_pat + is_pat))
    if [[ $is_pri == 1 && $is_pat == 0 ]]; then details+=("${FILES[$i]}: pristine")
    elif [[ $is_pat == 1 && $is_pri == 0 ]]; then details+=("${FILES[$i]}: patched")
    elif [[ $is_pat == 0 && $is_pri == 0 ]]; then
        [[ "$c" == - ]] && details+=("${FILES[$i]}: missing") || details+=("${FILES[$i]}: foreign changes")
    fi
done
NF=${#FILES[@]}
if [[ $n_pat -eq $NF ]]; then STATE=applied
elif [[ $n_pri -eq $NF ]]; then STATE=pristine
else STATE=partial; fi
partial_msg() {
    local joined
    joined="$(printf '%s; ' "${details[@]}")"
    echo "partly applied or foreign changes in '$TARGET' (${joined%; }); restore those files to megatron-core $BASE (git checkout core_v$BASE -- <files> / pip install --force-reinstall megatron-core==$BASE) or to the fully patched state, then rerun"
}

case "$MODE" in
    check)
        case "$STATE" in
            applied)  report "applied: all $N patches of the series are in '$TARGET'"; exit 0 ;;
            pristine) report "not applied: '$TARGET' has the pristine megatron-core $vmaj.$vmin${vpat:+.$vpat} files"; exit 3 ;;
            partial)  partial_msg; exit 4 ;;
        esac ;;
    apply)
        [[ $STATE == applied ]] && { report "already applied: all $N patches are in '$TARGET'; nothing to do"; exit 0; } ;;
    reverse)
        [[ $STATE == pristine ]] && { report "not applied: '$TARGET' has the pristine files; nothing to reverse"; exit 0; } ;;
esac
if [[ $MODE == apply ]]; then WANT=("${PAT[@]}"); else WANT=("${PRI[@]}"); fi

# ---------------------------------------------------------------- git preconditions
if [[ $GIT == 1 ]]; then
    gd="$(git -C "$T" rev-parse --absolute-git-dir)"
    for st in rebase-merge rebase-apply MERGE_HEAD CHERRY_PICK_HEAD REVERT_HEAD; do
        [[ ! -e "$gd/$st" ]] || die 1 "git checkout '$TARGET' is in the middle of an am/rebase/merge ($st); finish or abort it, then rerun"
    done
    ORIG_HEAD="$(git -C "$T" rev-parse -q --verify 'HEAD^{commit}')" \
        || die 1 "git checkout '$TARGET' has no commit yet; commit megatron-core first"
    dirty="$(git -C "$T" status --porcelain --untracked-files=all -- "${FILES[@]}")"
    [[ -z "$dirty" ]] || die 1 "git checkout '$TARGET' has uncommitted changes in files the series touches ($(tr '\n' ' ' <<<"$dirty")); commit or stash them, then rerun"
    git -C "$T" var GIT_COMMITTER_IDENT >/dev/null 2>&1 \
        || die 1 "git in '$TARGET' has no committer identity; set one (git config user.name ...; git config user.email ...), then rerun"
fi

# Checked after the git preconditions: "uncommitted changes" is the more useful message.
[[ $STATE == partial ]] && die 4 "$(partial_msg)"

# ---------------------------------------------------------------- dry run on a scratch copy
SCRATCH="$(mktemp -d "${TMPDIR:-/tmp}/apply_patches.XXXXXX")"
trap 'rm -rf "$SCRATCH"' EXIT
mkdir "$SCRATCH/orig" "$SCRATCH/work"
for f in "${FILES[@]}"; do
    [[ -f "$T/$f" ]] || continue
    mkdir -p "$SCRATCH/orig/$(dirname "$f")" "$SCRATCH/work/$(dirname "$f")"
    cp -p -- "$T/$f" "$SCRATCH/orig/$f"
    cp -p -- "$T/$f" "$SCRATCH/work/$f"
done
ORDER=("${PATCHES[@]}") RFLAG=()
if [[ $MODE == reverse ]]; then
    ORDER=() RFLAG=(-R)
    for ((i = N - 1; i >= 0; i--)); do ORDER+=("${PATCHES[$i]}"); done
fi
for p in "${ORDER[@]}"; do
    if ! out="$(cd "$SCRATCH/work" && gscratch apply -v --whitespace=nowarn "${RFLAG[@]}" -- "$PD/$p" 2>&1)"; then
        why="$(grep -m1 -E '^(error|fatal):' <<<"$out" | sed -E 's/^(error|fatal): //' || true)"
        die 1 "dry run: $p does not apply${RFLAG:+ in reverse} to '$TARGET' (git apply: ${why:-failed}); nothing was changed. Restore the patch files from git, or check that TARGET is megatron-core $BASE"
    fi
    if grep -qiE 'offset|fuzz' <<<"$out"; then
        die 1 "dry run: $p applies only at shifted lines ($(grep -m1 -iE 'offset|fuzz' <<<"$out")); refusing, nothing was changed. The series must apply exactly; regenerate it (scripts/refresh_patches.sh)"
    fi
done
for i in "${!FILES[@]}"; do
    [[ "$(cur_sha "$SCRATCH/work/${FILES[$i]}")" == "${WANT[$i]}" ]] \
        || die 1 "dry run: the series produced ${FILES[$i]} with a sha256 that manifest.sha256 does not expect (series and manifest disagree); nothing was changed. Restore patches/ from git or run scripts/refresh_patches.sh"
done

# ---------------------------------------------------------------- writability
probe_dir() { # <dir>: can we create a file in it? (nearest existing ancestor for a new dir)
    local d="$1" t
    while [[ ! -d "$d" ]]; do d="$(dirname "$d")"; done
    t="$(mktemp "$d/.apply_patches_probe.XXXXXX" 2>/dev/null)" || return 1
    rm -f -- "$t"
}
for f in "${FILES[@]}"; do
    if [[ -e "$T/$f" && ! -w "$T/$f" ]] || ! probe_dir "$(dirname "$T/$f")"; then
        die 1 "target '$TARGET' is not writable: cannot write $f (read-only file system, permissions or immutable attribute); nothing was changed. Run as a user who may write it, or apply to a writable copy"
    fi
done
if [[ $GIT == 1 ]]; then
    { probe_dir "$gd" && probe_dir "$gd/objects"; } \
        || die 1 "git checkout '$TARGET' is not writable ($gd cannot be written); nothing was changed. Run as a user who may write it"
fi

verify_final() { # every touched file in TARGET has the wanted sha256
    local i
    for i in "${!FILES[@]}"; do
        [[ "$(cur_sha "$T/${FILES[$i]}")" == "${WANT[$i]}" ]] || return 1
    done
}

# ---------------------------------------------------------------- plain directory
if [[ $GIT == 0 ]]; then
    STAGED=() MOVED=() MADE_DIRS=()
    rollback_plain() {
        local f d
        for f in "${STAGED[@]}"; do rm -f -- "$T/$f.apply_patches.tmp"; done
        for f in "${MOVED[@]}"; do
            if [[ -f "$SCRATCH/orig/$f" ]]; then cp -p -- "$SCRATCH/orig/$f" "$T/$f"; else rm -f -- "$T/$f"; fi
        done
        for ((d = ${#MADE_DIRS[@]} - 1; d >= 0; d--)); do rmdir -- "${MADE_DIRS[$d]}" 2>/dev/null || true; done
    }
    fail_plain() { rollback_plain; die 1 "$1; '$TARGET' was restored, nothing changed"; }
    trap 'rollback_plain; die 130 "interrupted; '"'"'$TARGET'"'"' was restored"' INT TERM HUP
    for i in "${!FILES[@]}"; do
        f="${FILES[$i]}"
        [[ "${WANT[$i]}" == - ]] && continue
        d="$(dirname "$T/$f")"
        if [[ ! -d "$d" ]]; then
            # remember each directory we create, outermost first
            new=() x="$d"
            while [[ ! -d "$x" ]]; do new=("$x" "${new[@]}"); x="$(dirname "$x")"; done
            mkdir -p -- "$d" || fail_plain "cannot create directory $d"
            MADE_DIRS+=("${new[@]}")
        fi
        tmpf="$T/$f.apply_patches.tmp"
        STAGED+=("$f")
        if [[ -f "$T/$f" ]]; then
            { cp -p -- "$T/$f" "$tmpf" && cat -- "$SCRATCH/work/$f" > "$tmpf"; } || fail_plain "cannot write $tmpf"
        else
            cp -- "$SCRATCH/work/$f" "$tmpf" || fail_plain "cannot write $tmpf"
        fi
    done
    for i in "${!FILES[@]}"; do
        f="${FILES[$i]}"
        if [[ "${WANT[$i]}" == - ]]; then
            MOVED+=("$f"); rm -f -- "$T/$f" || fail_plain "cannot remove $f"
        else
            MOVED+=("$f"); mv -f -- "$T/$f.apply_patches.tmp" "$T/$f" || fail_plain "cannot replace $f"
        fi
    done
    STAGED=()
    verify_final || fail_plain "after writing, the touched files do not have the expected sha256"
    if [[ $MODE == apply ]]; then
        report "applied $N patches to '$TARGET' (${#FILES[@]} files rewritten in place)"
    else
        report "reversed $N patches in '$TARGET'; the touched files are pristine megatron-core $vmaj.$vmin${vpat:+.$vpat} again"
    fi
    exit 0
fi

# ---------------------------------------------------------------- git checkout
restore_git() { # back to ORIG_HEAD: HEAD, index and work tree of the touched files
    local f
    git -C "$T" am --abort >/dev/null 2>&1 || true
    git -C "$T" reset -q --soft "$ORIG_HEAD" || true
    for f in "${FILES[@]}"; do
        if git -C "$T" cat-file -e "$ORIG_HEAD:$f" 2>/dev/null; then
            git -C "$T" checkout -q "$ORIG_HEAD" -- "$f" || true
        else
            git -C "$T" rm -q -f --cached --ignore-unmatch -- "$f" >/dev/null 2>&1 || true
            rm -f -- "$T/$f"
        fi
    done
}
fail_git() { restore_git; die 1 "$1; '$TARGET' was reset to $(git -C "$T" rev-parse --short HEAD), its touched files restored"; }
trap 'restore_git; die 130 "interrupted; '"'"'$TARGET'"'"' was reset to its original HEAD"' INT TERM HUP

subject_of() { # the Subject of a format-patch file, unfolded, without [PATCH]
    awk '/^Subject: /{s = substr($0, 10); f = 1; next} f && /^[ \t]/{s = s $0; next} f{print s; exit}' "$1" \
        | sed -E 's/^\[PATCH[^]]*\] *//'
}
if [[ $MODE == apply ]]; then
    paths=()
    for p in "${PATCHES[@]}"; do paths+=("$PD/$p"); done
    if ! out="$(git -C "$T" am --quiet --keep-cr --no-3way --no-scissors --whitespace=nowarn -- "${paths[@]}" 2>&1)"; then
        fail_git "git am failed ($(grep -m1 -vE '^\s*$' <<<"$out" || echo unknown))"
    fi
    verify_final || fail_git "after git am the touched files do not have the expected sha256 (a filter or eol setting?)"
    report "applied $N patches to git checkout '$TARGET' as $N commits ($(git -C "$T" rev-parse --short "$ORIG_HEAD")..$(git -C "$T" rev-parse --short HEAD))"
else
    for p in "${ORDER[@]}"; do
        mapfile -t ppaths < <(sed -n 's#^diff --git a/\(.*\) b/.*$#\1#p' "$PD/$p")
        out="$(git -C "$T" apply --index --whitespace=nowarn -R -- "$PD/$p" 2>&1)" \
            || fail_git "git apply -R --index $p failed ($(head -n1 <<<"$out"))"
        subj="$(subject_of "$PD/$p")"
        out="$(git -C "$T" commit -q -m "Revert \"$subj\"" \
            -m "This reverts patch $p of the series (scripts/apply_patches.sh --reverse)." -- "${ppaths[@]}" 2>&1)" \
            || fail_git "git commit of the revert of $p failed ($(head -n1 <<<"$out"))"
    done
    verify_final || fail_git "after reversing, the touched files are not pristine"
    report "reversed $N patches in git checkout '$TARGET' as $N revert commits ($(git -C "$T" rev-parse --short "$ORIG_HEAD")..$(git -C "$T" rev-parse --short HEAD))"
fi
