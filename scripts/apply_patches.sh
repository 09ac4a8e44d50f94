#!/usr/bin/env bash
# scripts/apply_patches.sh: apply, check or reverse the patch series on your own megatron-core.
#
# Two bases, one series each; a series' manifest.sha256 names its versions (`base`, `also`):
#   patches/0.17.1/  megatron-core 0.17.1 exactly (Megatron-LM tag core_v0.17.1)
#   patches/0.19/    megatron-core 0.19.2, and 0.19.1 and 0.19.0, which carry 0.19.2's touched files
#                    byte for byte (Megatron-LM tag core_v0.19.0; its package_info.py says 0.19.1)
# The series is the one whose manifest names the version in TARGET's megatron/core/package_info.py
# (PATCHES_DIR overrides). It applies exactly (git am, or files rewritten in place) when every
# touched file also has the manifest's pristine sha256. Other versions get one line, exit 5, that
# says what you have and what to do:
#   another 0.17.x or 0.19.x (0.17.0, 0.19.3): update to the base first (core_v0.17.1 / core_v0.19.0,
#     or pip install megatron-core==0.17.1 / ==0.19.2).
#   0.18.x: no series; update to 0.19.2 and apply patches/0.19/. 0.18 already receives the layer-wise
#     param all-gather into grad_data and zeroes it after the copy-back (upstream #3751 + #4609);
#     the line also says what it still lacks that the series fixes.
#   0.20.x, the minor version after the newest base (upstream main carries it until its release):
#     patches/0.19/, exactly where its touched files are 0.19.2's, else three-way (below).
#   0.16 and older, 0.21 and later: no series here.
#
# Your own tree (docs/own_tree.md): a git checkout that is not exactly a base (a fork with its own
# commits in the touched files, or upstream main: main at d98e8a64dd says 0.20.0 and gets
# patches/0.19/) gets the series by a three-way merge (git am -3), one commit per patch; the
# first stdout line names the series and why. It is worked out in a scratch clone (--shared,
# sparse: only the touched files); the checkout moves only when every patch went in, by a
# fast-forward. Refusals: exit 5, 6 and 7 below. --check lists per patch "applies", "applies at
# shifted lines", "merges three-way" or "conflicts in FILE, hunk @@ ... @@ (markers from line
# N)", one entry per conflicting file. "Applied" there means: every patch's subject is a commit
# in HEAD's history (newer than any revert of it); --reverse reverts those commits.
#
# Usage: scripts/apply_patches.sh TARGET [--check | --reverse]
#   TARGET   a Megatron-LM git checkout (at tag core_v0.17.1 or core_v0.19.0, a fork of one,
#            upstream main), or any directory that holds megatron/core (e.g. .../site-packages of
#            an env with megatron-core==0.17.1 or ==0.19.2).
#            Not the megatron/ package itself: pass the directory above it.
#            The series' tests/unit_tests/ parts (each patch's own tests) apply only to a
#            Megatron-LM checkout (TARGET has pretrain_gpt.py and tests/unit_tests/); any
#            other TARGET gets the megatron/ parts alone.
#   (none)     apply the whole series. On a git checkout whose top level is TARGET and that
#              tracks megatron/: one commit per patch (git am, your identity as committer).
#              Anywhere else: the files are rewritten in place (mode and owner kept).
#   --check    report the state and exit 0 / 3 / 4 (below); changes nothing.
#   --reverse  undo the series. On a git checkout: one commit per patch, newest first,
#              "Revert "<subject>"", made by reverse-applying the patch (works however the
#              series got there: git am, cherry-pick, squash). Elsewhere: files rewritten.
# Env:   PATCHES_DIR=DIR  use the series in DIR (series, *.patch, manifest.sha256) instead of
#                         the folder of patches/ next to this script whose manifest names
#                         TARGET's version (patches/0.17.1/, patches/0.19/; the tests use
#                         synthetic series).
#
# Exit codes (every error is one line on stderr that says what is wrong and what to do; on any
# non-zero exit TARGET's files, and on a git checkout its HEAD, are as they were before):
#   0  done: applied / reversed, or nothing to do (already applied / not applied); --check: applied
#   1  error: TARGET does not exist, is a file, an empty directory, the megatron/ package itself
#      or holds no megatron/core/package_info.py (the line says what belongs there: a Megatron-LM
#      git checkout or the directory that holds megatron/core); series/manifest missing, empty
#      or corrupt; the dry run failed (or needed offsets/fuzz); TARGET not writable; in a git
#      checkout, uncommitted changes to files the series touches (commit or stash them) or an
#      unfinished am/rebase/merge; a git command failed (rolled back)
#   2  usage error
#   3  --check: not applied (every touched file is the pristine upstream one)
#   4  partly applied or foreign changes: some touched file matches neither the pristine nor
#      the patched sha256 in manifest.sha256, or they are mixed (all modes; nothing is changed);
#      three-way: some of the series' commits are in HEAD's history, not all
#   5  wrong base: megatron/core/package_info.py names no version a series is for (manifest.sha256
#      `base` or `also`: 0.17.1; 0.19.0 to 0.19.2) and is not the minor version after the newest
#      base (0.20); three-way: the touched code lacks what the series builds on (e.g. no
#      grad_data gather), or the tree is not a git checkout
#   6  three-way (a git checkout that is not exactly a base): a patch conflicts. The line names
#      every conflicting file, the hunk and the line of its first conflict marker, and how to merge
#      by hand; HEAD, refs, status and files are unchanged (applying stores, as unreferenced
#      objects, the series' intermediate file states that the hand merge's git am -3 needs)
#   7  three-way: the repository (a shallow clone, a copy without history) lacks the base's blobs
#      the merge starts from; the line names the fetch that gets them; nothing changed
#   130 interrupted (INT/TERM/HUP) while writing; the touched files (git: HEAD too) were restored
#
# How it stays all-or-nothing:
#   1. Validate everything first: the series file, every patch's sha256 against manifest.sha256
#      (a truncated or corrupt patch is caught here), the target's version, and the state of
#      each touched file (pristine / patched / foreign) by sha256.
#   2. Dry-run the whole series on a scratch copy of the touched files with `git apply -v`: what
#      `git am` uses (so the dry run predicts the git path exactly), never fuzzes, applies each
#      patch atomically; -v reports a hunk that lands at an offset, which is refused. It runs
#      outside any repository with the user's and the system's git config ignored (no
#      `apply.whitespace=fix`). The result must hash to the manifest's patched (or, reversing,
#      pristine) sha256.
#   3. Check that every touched file and its directory can be written (a probe file: root
#      ignores permission bits, but not read-only mounts or `chattr +i`).
#   4. Apply: plain directory -> stage every new file next to its target, then rename them in;
#      git checkout -> `git am`; reverse -> `git apply -R --index` + `git commit` per patch. A
#      failure restores the touched files (and HEAD) from the scratch copy / the original HEAD.
#   5. Verify the touched files now hash to the expected state.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PD="${PATCHES_DIR:-}"
# git status and friends must not refresh TARGET's index behind a check that "changes nothing".
export GIT_OPTIONAL_LOCKS=0
ME=apply_patches.sh
die() { local code="$1"; shift; echo "$ME: error: $*" >&2; exit "$code"; }
usage() { die 2 "usage: scripts/apply_patches.sh TARGET [--check | --reverse]${1:+ ($1)}"; }
sha() { sha256sum -- "$1" | cut -d' ' -f1; }
# git for scratch work: no user/system config, never inside a surrounding repository.
gscratch() { GIT_CONFIG_NOSYSTEM=1 GIT_CONFIG_GLOBAL=/dev/null GIT_CEILING_DIRECTORIES="$SCRATCH" LC_ALL=C git "$@"; }
mkscratch() { SCRATCH="$(mktemp -d "${TMPDIR:-/tmp}/apply_patches.XXXXXX")"; trap 'rm -rf "$SCRATCH"' EXIT; }
# join SEP ITEM...: the items with SEP between them.
join() { local sep="$1" out; shift; out="$(printf "%s$sep" "$@")"; echo "${out%"$sep"}"; }
# git_why OUTPUT: git's first error/fatal line, without its prefix.
git_why() { grep -m1 -E '^(error|fatal):' <<<"$1" | sed -E 's/^(error|fatal): //; s/\.+$//' || true; }

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

# ---------------------------------------------------------------- the target: what it must be
# Checked before anything reads it (the series is picked by its version): a wrong path gets
# one line, exit 1, whatever PATCHES_DIR says.
EXPECT="pass a Megatron-LM git checkout or the directory that holds megatron/core (e.g. site-packages)"
[[ -e "$TARGET" ]] || die 1 "TARGET '$TARGET' does not exist: $EXPECT"
[[ -d "$TARGET" ]] || die 1 "TARGET '$TARGET' is not a directory: $EXPECT"
T="$(cd "$TARGET" && pwd -P)"
PINFO="$T/megatron/core/package_info.py"
if [[ ! -f "$PINFO" ]]; then
    [[ -f "$T/core/package_info.py" ]] \
        && die 1 "TARGET '$TARGET' is the megatron package itself: pass the directory above it, $(dirname "$T")"
    [[ -n "$(ls -A "$T" 2>/dev/null)" ]] || die 1 "TARGET '$TARGET' is an empty directory, so it is not megatron-core: $EXPECT"
    die 1 "TARGET '$TARGET' holds no megatron/core/package_info.py, so it is not megatron-core: $EXPECT"
fi

# ---------------------------------------------------------------- the series
# version_field PACKAGE_INFO NAME: MAJOR, MINOR or PATCH of megatron/core/package_info.py.
version_field() { { sed -nE "s/^$2[[:space:]]*=[[:space:]]*([0-9A-Za-z]+).*/\\1/p" "$1" 2>/dev/null || true; } | head -n1; }
latest() { printf '%s\n' "$@" | sort -V | tail -n1; }
manifests() { for m in "$ROOT"/patches/*/manifest.sha256; do [[ ! -f "$m" ]] || echo "$m"; done; }
base_of() { awk '$1 == "base" {print $2; exit}' "$1"; }
# Without PATCHES_DIR: the patches/<base>/ folder whose manifest names TARGET's version (`base`
# or `also`), else one of the same minor version (0.19.3: its refusal says which release to
# take), else the newest base's if TARGET is the minor version after it (upstream main between
# two releases), else the first folder: its checks below refuse TARGET with a line that says
# what to do.
if [[ -z "$PD" ]]; then
    want="$(version_field "$PINFO" MAJOR).$(version_field "$PINFO" MINOR).$(version_field "$PINFO" PATCH)"
    first="" newest="" newest_v="" matched="" sameminor=""
    while read -r m; do
        d="$(dirname "$m")" b="$(base_of "$m")"
        first="${first:-$d}"
        [[ -z "$b" || "$(latest "$newest_v" "$b")" != "$b" ]] || newest="$d" newest_v="$b"
        if [[ -z "$matched" ]] && awk -v v="$want" '($1 == "base" || $1 == "also") { for (i = 2; i <= NF; i++) if ($i == v) f = 1 } END { exit !f }' "$m"; then
            matched="$d"
        fi
        [[ -n "$sameminor" || -z "$b" || "${b%.*}" != "${want%.*}" ]] || sameminor="$d"
    done < <(manifests)
    [[ -n "$first" ]] || die 1 "no series under $ROOT/patches/ (patches/<base>/series); restore patches/ (git checkout -- patches) or set PATCHES_DIR to a series directory"
    IFS=. read -r tmaj tmin _ <<<"$want"
    IFS=. read -r nmaj nmin _ <<<"$newest_v"
    if [[ -n "$matched" ]]; then PD="$matched"
    elif [[ -n "$sameminor" ]]; then PD="$sameminor"
    elif [[ -n "$newest" && "$tmaj" =~ ^[0-9]+$ && "$tmin" =~ ^[0-9]+$ && "$tmaj" == "$nmaj" && "$tmin" == "$((nmin + 1))" ]]; then PD="$newest"
    else PD="$first"; fi
fi
# Every base patches/ has a series for, for a refusal: "0.17.1; 0.19.2 (also 0.19.1, 0.19.0)".
supported_bases() {
    manifests | while read -r m; do
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
[[ ${#PATCHES[@]} -gt 0 ]] || die 1 "$PD/series names no patch; restore patches/ from git (git checkout -- patches) or set PATCHES_DIR to a series directory"

# The tests/unit_tests/ parts of the series (each patch's own tests) apply only to a Megatron-LM
# checkout: elsewhere (site-packages, a copy of megatron/) every git apply / git am leaves them
# out (XCL) and their files are not checked.
XCL=()
[[ -d "$T/tests/unit_tests" && -f "$T/pretrain_gpt.py" ]] || XCL=(--exclude='tests/*')
BASE="" ALSO=() MPATCH=() MPSHA=() FILES=() PRI=() PAT=()
while IFS= read -r line || [[ -n "$line" ]]; do
    [[ "$line" =~ ^[[:space:]]*(#|$) ]] && continue
    read -r kind f1 f2 f3 <<<"$line"
    case "$kind" in
        base)  BASE="$f1" ;;
        also)  read -r -a ALSO <<<"${line#also}" ;;
        patch) MPSHA+=("$f1"); MPATCH+=("$f2") ;;
        file)  [[ ${#XCL[@]} -gt 0 && "$f3" == tests/unit_tests/* ]] || { PRI+=("$f1"); PAT+=("$f2"); FILES+=("$f3"); } ;;
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

# ---------------------------------------------------------------- the target
vmaj="$(version_field "$PINFO" MAJOR)" vmin="$(version_field "$PINFO" MINOR)" vpat="$(version_field "$PINFO" PATCH)"
[[ "$vmaj" =~ ^[0-9]+$ && "$vmin" =~ ^[0-9]+$ ]] || die 1 "cannot read MAJOR/MINOR from $PINFO; is '$TARGET' really megatron-core?"
HAVE="$vmaj.$vmin${vpat:+.$vpat}"
IFS=. read -r bmaj bmin bpat <<<"$BASE"
# `also` versions carry the base's touched files byte for byte (their sha256 is checked below).
for v in "${ALSO[@]}"; do if [[ "$HAVE" == "$v" ]]; then HAVE="$BASE"; fi; done
# The Megatron-LM tag a refusal names for this series: the oldest of its versions (base, also);
# for patches/0.19/ that is core_v0.19.0, the tag there is (0.19.1 and 0.19.2 are wheels only).
TAGV="$(printf '%s\n' "$BASE" "${ALSO[@]}" | sort -V | head -n1)"
# LATEST: the newest base here (this series' or one under patches/), for the refusal of a version past it.
LATEST="$(latest "$BASE" $(manifests | while read -r m; do base_of "$m"; done))"
IFS=. read -r lmaj lmin _ <<<"$LATEST"
# NEXT=1: TARGET is the minor version after the newest base (upstream main between two
# releases says the next one): this series, if it is the newest base's, serves it three-way,
# on a git checkout (decided below).
NEXT=0
if [[ "$HAVE" != "$BASE" && "$LATEST" == "$BASE" && "$vmaj" == "$bmaj" && "$vmin" == "$((bmin + 1))" ]]; then NEXT=1; fi
if [[ "$HAVE" != "$BASE" && $NEXT == 0 ]]; then
    update="update to $BASE first (git checkout core_v$TAGV in a Megatron-LM clone, or pip install megatron-core==$BASE), then rerun"
    if (( vmaj > lmaj || (vmaj == lmaj && vmin > lmin + 1) )); then
        die 5 "target '$TARGET' has megatron-core $HAVE, past $LATEST, the newest base here, by more than one minor version (the one after it, $lmaj.$((lmin + 1)), is what upstream main carries until its release, and gets the newest base's series three-way): no series here is made or checked for $vmaj.$vmin, so do not apply one. This repository has series for: $(supported_bases). Use a tree at a base (pip install megatron-core==$LATEST, or a Megatron-LM checkout at its tag) or port the series by hand (patches/README.md)"
    elif (( vmaj > bmaj || (vmaj == bmaj && vmin > bmin) )); then
        later=""
        (( vmaj > 0 || vmin >= 19 )) && later=" 0.19 also adds full_param_layout, which gathers in place into param_data with no grad_data reuse."
        die 5 "target '$TARGET' has megatron-core $HAVE, newer than $BASE (patches/$BASE/) and older than the 0.19 series (patches/0.19/): apply neither as it is. $vmaj.$vmin already receives the layer-wise param all-gather into grad_data.view(param_dtype) and zeroes grad_data after the copy-back (upstream #3751 + #4609), and skips the gather at DP size 1.$later What 0.18 still lacks, which this series fixes on $BASE: a forced sync (start_param_sync(force_sync=True)) or free_overlap_buffers() with a gather pending waits but drops the gathered params and leaves grad_data dirty; nothing guards a param sync while the grad buffers are offloaded; the local params are still flattened into a temporary; the optimizer's synchronous all-gather (no --overlap-param-gather) still allocates a receive tensor per rank every step. This repository has series for: $(supported_bases). On 0.18 update to 0.19.2 (pip install megatron-core==0.19.2, or git checkout core_v0.19.0) and apply patches/0.19/ with this script; otherwise keep your version (README.md says what that means for you)"
    elif (( vmaj == bmaj && vmin == bmin )); then
        die 5 "target '$TARGET' has megatron-core $HAVE, not $BASE, the exact base of this series (made and verified on $BASE's files only): $update"
    else
        die 5 "target '$TARGET' has megatron-core $HAVE, older than $BASE, the exact base of this series: $update"
    fi
fi

NOTE=""
# The state/result line, then NOTE (a three-way --check's note on uncommitted changes), if any.
report() { echo "$*"; [[ -z "$NOTE" ]] || echo "$NOTE"; }
# The commits a git mode made: "abc1234..def5678".
span() { echo "$(git -C "$T" rev-parse --short "$ORIG_HEAD")..$(git -C "$T" rev-parse --short HEAD)"; }
N=${#PATCHES[@]}

# Git mode: TARGET is the top level of a work tree that tracks megatron/.
GIT=0
if top="$(git -C "$T" rev-parse --show-toplevel 2>/dev/null)" && [[ "$(cd "$top" && pwd -P)" == "$T" ]] \
    && git -C "$T" ls-files --error-unmatch megatron/core/package_info.py >/dev/null 2>&1; then
    GIT=1
fi

set_orig_head() {
    ORIG_HEAD="$(git -C "$T" rev-parse -q --verify 'HEAD^{commit}')" \
        || die 1 "git checkout '$TARGET' has no commit yet; commit megatron-core first"
}
# git_preconditions: a checkout that git am can work on (sets gd, ORIG_HEAD); dies otherwise.
git_preconditions() {
    gd="$(git -C "$T" rev-parse --absolute-git-dir)"
    for st in rebase-merge rebase-apply MERGE_HEAD CHERRY_PICK_HEAD REVERT_HEAD; do
        [[ ! -e "$gd/$st" ]] || die 1 "git checkout '$TARGET' is in the middle of an am/rebase/merge ($st); finish or abort it, then rerun"
    done
    set_orig_head
    dirty="$(git -C "$T" status --porcelain --untracked-files=all -- "${FILES[@]}")"
    [[ -z "$dirty" ]] || die 1 "git checkout '$TARGET' has uncommitted changes in files the series touches ($(tr '\n' ' ' <<<"$dirty")); commit or stash them, then rerun"
    git -C "$T" var GIT_COMMITTER_IDENT >/dev/null 2>&1 \
        || die 1 "git in '$TARGET' has no committer identity; set one (git config user.name ...; git config user.email ...), then rerun"
}

subject_of() { # the Subject of a format-patch file, unfolded, without [PATCH]
    awk '/^Subject: /{s = substr($0, 10); f = 1; next} f && /^[ \t]/{s = s $0; next} f{print s; exit}' "$1" \
        | sed -E 's/^\[PATCH[^]]*\] *//'
}

# ---------------------------------------------------------------- state of the touched files
cur_sha() { if [[ -f "$1" && ! -L "$1" ]]; then sha "$1"; elif [[ -e "$1" || -L "$1" ]]; then echo other; else echo -; fi; }
# (A touched file's pristine and patched sha256 always differ: the manifest lists the files
# that differ between the two.)
n_pri=0 n_pat=0 details=()
for i in "${!FILES[@]}"; do
    case "$(cur_sha "$T/${FILES[$i]}")" in
        "${PRI[$i]}") n_pri=$((n_pri + 1)) st=pristine ;;
        "${PAT[$i]}") n_pat=$((n_pat + 1)) st=patched ;;
        -)            st=missing ;;
        *)            st="foreign changes" ;;
    esac
    details+=("${FILES[$i]}: $st")
done
if [[ $n_pat -eq ${#FILES[@]} ]]; then STATE=applied
elif [[ $n_pri -eq ${#FILES[@]} ]]; then STATE=pristine
else STATE=partial; fi
partial_msg() {
    echo "partly applied or foreign changes in '$TARGET' ($(join '; ' "${details[@]}")); restore those files to megatron-core $BASE (git checkout core_v$TAGV -- <files> / pip install --force-reinstall megatron-core==$BASE) or to the fully patched state, then rerun; a fork of $BASE in a git checkout (whose history holds $BASE's files) gets the series by a three-way merge"
}

# ---------------------------------------------------------------- three-way: a tree that is not exactly a base
# A git checkout whose touched files are neither the base's nor the series' (a fork of the base,
# or NEXT: the version after the newest base, upstream main) gets the series by git am -3, one
# commit per patch, worked out in a scratch clone first; TARGET changes only when every patch
# went in, by a fast-forward to the scratch clone's commits.
WHY=""
[[ $NEXT == 0 ]] || WHY="megatron-core $HAVE is the minor version after $BASE, the newest base here, and no release any series is made for: upstream main after $bmaj.$bmin carries it until $vmaj.$vmin is released, so the series of $BASE applies"
if [[ $NEXT == 1 && $STATE != partial ]]; then
    # The next minor version with the base's touched files byte for byte: the series applies exactly.
    echo "series: $PD ($WHY; its touched files are $BASE's byte for byte)"
elif [[ $STATE == partial ]] && [[ $NEXT == 1 || $GIT == 1 ]]; then
    [[ -n "$WHY" ]] || WHY="megatron-core $HAVE, the base of this series, with its own changes in the files the series touches (a fork, or a commit after the release)"
    [[ $GIT == 1 ]] \
        || die 5 "target '$TARGET': $WHY, but only by a three-way merge, which needs a git checkout whose history holds megatron-core $BASE's files, and '$TARGET' is not a git checkout (or not its top level); nothing was changed. Clone Megatron-LM (git clone https://github.com/NVIDIA/Megatron-LM), check out the commit this tree came from, and rerun on the clone"
    if [[ $MODE == check ]]; then set_orig_head; else git_preconditions; fi
    echo "series: $PD ($WHY; three-way merge, git am -3)"
    # Is the series there already? git am keeps each patch's subject as its commit's subject.
    FOUND=() MISSING=() FOUND_AT=()
    hist="$(git -C "$T" log --format='%H %s' -n 5000 HEAD -- "${FILES[@]}")"
    for p in "${PATCHES[@]}"; do
        s="$(subject_of "$PD/$p")"
        # the newest commit with that subject, unless a revert of it is newer still
        c="$(awk -v s="$s" 'substr($0, 42) == s {print $1; exit} substr($0, 42) == "Revert \"" s "\"" {exit}' <<<"$hist")"
        if [[ -n "$c" ]]; then FOUND+=("$p"); FOUND_AT+=("$c"); else MISSING+=("$p"); fi
    done
    if [[ ${#FOUND[@]} -gt 0 && ${#MISSING[@]} -gt 0 ]]; then
        die 4 "partly applied: the history of '$TARGET' has the commits of ${FOUND[*]} but not of ${MISSING[*]}; nothing was changed. Revert those commits (git -C '$TARGET' revert ${FOUND_AT[*]}) or apply the rest by hand (git -C '$TARGET' am -3 ...), then rerun"
    fi
    if [[ ${#FOUND[@]} -gt 0 ]]; then
        case "$MODE" in
            check) report "applied: all $N patches of the series are commits in the history of '$TARGET' (merged three-way)"; exit 0 ;;
            apply) report "already applied: all $N patches are commits in the history of '$TARGET'; nothing to do"; exit 0 ;;
        esac
    elif [[ $MODE == reverse ]]; then
        report "not applied: no commit of the series in the history of '$TARGET'; nothing to reverse"; exit 0
    fi

    # What the series builds on must be there: a tree without it gets one line, not a conflict.
    # series base minor -> "file|extended regex|what it is" (the series of 0.19 works on the
    # layer-wise gather into grad_data of upstream #3751/#4609; 0.17.1's adds that gather).
    if [[ $MODE != reverse ]]; then
        NEEDS=("megatron/core/distributed/param_and_grad_buffer.py|layerwise_params_list|layerwise_params_list, the buckets' layer-wise param lists"
               "megatron/core/optimizer/layer_wise_optimizer.py|def allgather_params\(|allgather_params(), the layer-wise optimizer's gather after the step")
        if (( bmaj == 0 && bmin >= 18 )); then
            NEEDS+=("megatron/core/distributed/param_and_grad_buffer.py|grad_data\.view\(|grad_data gather: the layer-wise param all-gather into bucket.grad_data.view(...) of upstream #3751 + #4609"
                    "megatron/core/optimizer/layer_wise_optimizer.py|def set_bucket_layerwise_params_list\(|set_bucket_layerwise_params_list(), which hands the optimizer's shards to the buckets")
        fi
        for need in "${NEEDS[@]}"; do
            IFS='|' read -r nf nre nwhat <<<"$need"
            if ! git -C "$T" cat-file -e "HEAD:$nf" 2>/dev/null; then
                die 5 "target '$TARGET' cannot take the series of $BASE: its HEAD has no $nf, which the series changes; nothing was changed. Apply it to a Megatron-LM checkout that has it"
            fi
            git -C "$T" show "HEAD:$nf" | grep -E -- "$nre" >/dev/null \
                || die 5 "target '$TARGET' cannot take the series of $BASE: its $nf has no $nwhat, which the series builds on (a fork that removed or rewrote it); nothing was changed. Apply the series to a tree that has it (upstream's $bmaj.$bmin or later), or port it by hand"
        done
    fi

    # The blobs a three-way merge starts from: each touched file as the base has it (the first
    # preimage of each file in the series), written to W, where the series' own intermediate
    # states are made below. A shallow clone or a history-less copy lacks them.
    mkscratch
    W="$SCRATCH/states"
    declare -A FIRST=()
    for p in "${PATCHES[@]}"; do
        while read -r f pre; do
            [[ -n "${FIRST[$f]+x}" ]] || FIRST[$f]="$pre"
        done < <(awk '/^diff --git a\//{f = substr($3, 3)} /^index [0-9a-f]+\.\.[0-9a-f]+/{split($2, a, "\\.\\."); print f, a[1]}' "$PD/$p")
    done
    lacking=()
    for f in "${!FIRST[@]}"; do
        pre="${FIRST[$f]}"
        [[ "$pre" =~ ^0+$ ]] && continue
        mkdir -p "$W/$(dirname "$f")"
        git -C "$T" cat-file blob "$pre" > "$W/$f" 2>/dev/null || lacking+=("$f (blob ${pre:0:12})")
    done
    if [[ ${#lacking[@]} -gt 0 ]]; then
        how="git -C '$TARGET' fetch https://github.com/NVIDIA/Megatron-LM tag core_v$TAGV --no-tags"
        [[ "$(git -C "$T" rev-parse --is-shallow-repository 2>/dev/null)" == true ]] \
            && how="git -C '$TARGET' fetch --unshallow (it is a shallow clone), or $how"
        die 7 "'$TARGET' lacks the git objects of megatron-core $BASE's files that a three-way merge starts from ($(join ', ' "${lacking[@]}")): a shallow clone or a checkout without history. Fetch them: $how, then rerun; nothing was changed"
    fi

    # The scratch clone: TARGET's objects borrowed (--shared), only the files the patches touch
    # checked out, at TARGET's HEAD.
    S="$SCRATCH/clone"
    ident="$(git -C "$T" var GIT_COMMITTER_IDENT 2>/dev/null || true)"
    if [[ -n "$ident" ]]; then
        export GIT_COMMITTER_NAME="${GIT_COMMITTER_NAME:-${ident%% <*}}"
        ident="${ident#*<}"; export GIT_COMMITTER_EMAIL="${GIT_COMMITTER_EMAIL:-${ident%%>*}}"
    fi
    sg() { git -C "$S" -c core.hooksPath=/dev/null -c gc.auto=0 -c maintenance.auto=false -c advice.detachedHead=false "$@"; }
    git clone -q --shared --no-checkout "$T" "$S" 2>/dev/null || die 1 "cannot make a scratch clone of '$TARGET' in $SCRATCH; nothing was changed"
    mapfile -t PFILES < <(for p in "${PATCHES[@]}"; do sed -n 's#^diff --git a/\(.*\) b/\(.*\)$#\1\n\2#p' "$PD/$p"; done | sort -u)
    sg sparse-checkout set --no-cone "${PFILES[@]/#//}" >/dev/null 2>&1 \
        && sg checkout -q --detach "$ORIG_HEAD" 2>/dev/null \
        || die 1 "cannot check out HEAD of '$TARGET' in the scratch clone $S; nothing was changed"
    # The series' own intermediate states of each file (base + patches 1..k-1): git am -3 merges
    # patch k from the blob its index line names, which exists nowhere else.
    for p in "${PATCHES[@]}"; do
        (cd "$W" && gscratch apply --whitespace=nowarn "${XCL[@]}" -- "$PD/$p") >/dev/null 2>&1 \
            || die 1 "the series does not apply to megatron-core $BASE's own files ($p); restore patches/ from git; nothing was changed"
        while read -r f; do [[ -f "$W/$f" ]] && sg hash-object -w -- "$W/$f" >/dev/null; done \
            < <(sed -n 's#^diff --git a/.* b/\(.*\)$#\1#p' "$PD/$p")
    done

    # After a failed git am -3 or revert in the scratch clone: the unmerged paths, as git has them
    # (git am -q hides its CONFLICT lines, and the first hunk `git apply --check` rejects may be
    # one that merges cleanly).
    unmerged() { { sg diff --name-only --diff-filter=U 2>/dev/null; sg ls-files -u 2>/dev/null | cut -f2; } | sort -u | grep -v '^$' || true; }
    # conflict_hunk PATCH FILE MERGED: the header of FILE's hunk of PATCH that the first conflict
    # block of MERGED comes from: the hunk most of whose added lines are in the block's patch side
    # and removed lines in its base side (merge.conflictStyle=diff3); without a match, the hunk
    # that starts nearest the block's <<<<<<< line; without a block, FILE's first hunk.
    conflict_hunk() {
        awk -v f="$2" '
            function trim(t) { gsub(/^[ \t]+|[ \t]+$/, "", t); return t }
            FNR == NR {
                if (/^diff --git a\//) { in_f = (substr($3, 3) == f); inh = 0; next }
                if (!in_f) next
                if (/^@@ /) { nh++; inh = 1; hdr[nh] = $0; split($2, a, ","); start[nh] = substr(a[1], 2) + 0; next }
                if (!inh) next
                t = trim(substr($0, 2))
                if (t == "") next
                if (/^\+/) add[nh, t] = 1; else if (/^-/) del[nh, t] = 1
                next
            }
            /^<<<<<<< / && !side { side = "ours"; mark = FNR; next }
            side && /^\|\|\|\|\|\|\| / { side = "base"; next }
            side && /^=======$/ { side = "theirs"; next }
            side && /^>>>>>>> / { exit }
            side { t = trim($0); if (t != "") { if (side == "theirs") th[t] = 1; else if (side == "base") bs[t] = 1 } }
            END {
                if (!nh) exit
                bi = 0; best = 0
                for (i = 1; i <= nh; i++) {
                    sc = 0
                    for (t in th) if ((i, t) in add) sc++
                    for (t in bs) if ((i, t) in del) sc++
                    if (sc > best) { best = sc; bi = i }
                }
                if (!bi && mark) { bi = 1; for (i = 2; i <= nh; i++) if ((start[i] - mark) ^ 2 < (start[bi] - mark) ^ 2) bi = i }
                print hdr[bi ? bi : 1]
            }' "$1" "$3" 2>/dev/null || true
    }
    marker_line() { grep -n -m1 '^<<<<<<<' "$1" 2>/dev/null | cut -d: -f1 || true; }
    if [[ $MODE == reverse ]]; then
        for ((i = ${#FOUND_AT[@]} - 1; i >= 0; i--)); do
            if ! out="$(sg -c merge.conflictStyle=diff3 revert --no-edit "${FOUND_AT[$i]}" 2>&1)"; then
                cf="$(unmerged | while read -r f; do m="$(marker_line "$S/$f")"; printf '%s%s; ' "$f" "${m:+, conflict markers from line $m}"; done)"
                [[ -n "$cf" ]] || cf="$(sed -n 's/^CONFLICT ([^)]*): Merge conflict in //p' <<<"$out" | paste -sd' ')"
                cf="${cf%; }"
                die 6 "conflict: the revert of ${FOUND[$i]} (commit ${FOUND_AT[$i]:0:12}) does not merge in '$TARGET'${cf:+ ($cf)}: later commits changed its lines; nothing was changed (HEAD and status as before). Revert it by hand: git -C '$TARGET' revert ${FOUND_AT[$i]}, resolve, git revert --continue"
            fi
            echo "  ${FOUND[$i]}: reverted"
        done
    else
        for i in "${!PATCHES[@]}"; do
            p="${PATCHES[$i]}"
            if out="$(sg apply --check -v "${XCL[@]}" -- "$PD/$p" 2>&1)"; then
                grep -qi 'offset' <<<"$out" && how="applies at shifted lines" || how="applies"
            else
                how="merges three-way"
            fi
            if ! out="$(sg -c merge.conflictStyle=diff3 am -q -3 --keep-cr --no-scissors --whitespace=nowarn "${XCL[@]}" -- "$PD/$p" 2>&1)"; then
                # Every conflicting file, the patch's hunk its first conflict block comes from, and
                # the line of its first <<<<<<< marker in HEAD + the patches before this one.
                CF=() where=() short=()
                while read -r f; do
                    [[ -n "$f" ]] || continue
                    hk="$(conflict_hunk "$PD/$p" "$f" "$S/$f")"; mark="$(marker_line "$S/$f")"
                    CF+=("$f")
                    short+=("$f, hunk ${hk:-?}${mark:+ (markers from line $mark)}")
                    where+=("$f, hunk '${hk:-?}'${mark:+, conflict markers from line $mark}")
                done < <(unmerged)
                why="$(git_why "$out")"
                sg am --abort >/dev/null 2>&1 || true
                if [[ ${#CF[@]} -eq 0 ]]; then short=("its files (git am: ${why:-failed}, no unmerged path)"); where=("${short[@]}"); fi
                echo "  $p: conflicts in $(join '; ' "${short[@]}")"
                for q in "${PATCHES[@]:$((i + 1))}"; do echo "  $q: not tried (after the conflict)"; done
                all_list="$(printf "'%s' " "${PATCHES[@]/#/"$PD"/}")"
                # git am -3 in TARGET merges each patch from the blobs its index lines name: the
                # base's files (TARGET has them, checked above) and the series' intermediate states,
                # which only the scratch clone has. Applying stores the ones TARGET lacks (loose,
                # unreferenced objects: HEAD, refs, index and files stay as they were), so that the
                # advice below works; --check only says so.
                need=()
                for q in "${PATCHES[@]:0:$((i + 1))}"; do
                    while read -r b; do
                        [[ "$b" =~ ^0+$ ]] || git -C "$T" cat-file -e "$b^{blob}" 2>/dev/null || need+=("$b")
                    done < <(sed -nE 's/^index ([0-9a-f]+)\.\.[0-9a-f]+.*$/\1/p' "$PD/$q" | sort -u)
                done
                blobs="" nb="${#need[@]} blob"; [[ ${#need[@]} -eq 1 ]] || nb+=s
                if [[ ${#need[@]} -gt 0 && $MODE == check ]]; then
                    blobs=" (git am -3 needs $nb of the series' intermediate file states that '$TARGET' lacks: rerun without --check, which stores them, first)"
                elif [[ ${#need[@]} -gt 0 ]]; then
                    for b in "${need[@]}"; do
                        got="$(sg cat-file blob "$b" | git -C "$T" hash-object -w --no-filters --stdin 2>/dev/null)" && [[ "$got" == "$b"* ]] \
                            || die 1 "cannot store blob $b of the series' intermediate file states in '$TARGET', which merging $p by hand needs; nothing else was changed"
                    done
                    blobs=" (the $nb of the series' intermediate file states it needs, which '$TARGET' lacked, now stored in its objects, unreferenced)"
                fi
                if [[ ${#CF[@]} -gt 1 ]]; then files="$(join ', ' "${CF[@]:0:${#CF[@]}-1}") and ${CF[-1]}, git add them"
                else files="${CF[0]:-the conflicting files}, git add it"; fi
                die 6 "conflict: $p does not merge into '$TARGET': $(join '; ' "${where[@]}") (lines of the file as git am -3 leaves it, HEAD and the patches before merged)${why:+; git am: $why}. The checkout's own changes touch the lines the patch changes there; nothing was changed (HEAD and status as before). Either move your change off those lines and rerun, or merge by hand: git -C '$TARGET' am -3 ${all_list}(it stops at $p)${blobs}, then in '$TARGET' resolve $files, git am --continue, and resolve likewise any later patch that stops; then check the result with scripts/run_functional_test.sh --checkout '$TARGET', which compares it with the commit before the series"
            fi
            echo "  $p: $how"
        done
    fi
    NEW="$(sg rev-parse HEAD)"
    if [[ $MODE == check ]]; then
        dirty="$(git -C "$T" status --porcelain --untracked-files=all -- "${FILES[@]}")"
        [[ -z "$dirty" ]] || NOTE="note: '$TARGET' has uncommitted changes in files the series touches ($(tr '\n' ' ' <<<"$dirty")); this check merged into HEAD, and applying refuses until they are committed or stashed${NOTE:+; $NOTE}"
        report "not applied: all $N patches would go into '$TARGET' (three-way); nothing was changed"; exit 3
    fi
    changed="$(sg diff --name-only "$ORIG_HEAD" "$NEW" | sort -u)"
    unexpected="$(comm -23 <(echo "$changed") <(printf '%s\n' "${PFILES[@]}" | sort -u) | grep -v '^$' || true)"
    [[ -z "$unexpected" ]] || die 1 "the three-way merge changed files the series does not name ($unexpected); nothing was changed"
    sg branch -q -f apply-patches-result "$NEW"
    git -C "$T" -c gc.auto=0 -c maintenance.auto=false fetch -q --no-write-fetch-head --no-tags "$S" refs/heads/apply-patches-result 2>/dev/null \
        || die 1 "cannot fetch the merged commits from the scratch clone into '$TARGET'; nothing was changed"
    if ! out="$(git -C "$T" -c core.hooksPath=/dev/null merge -q --ff-only "$NEW" 2>&1)"; then
        git -C "$T" rev-parse -q --verify HEAD | grep -qx "$ORIG_HEAD" || git -C "$T" reset -q --keep "$ORIG_HEAD" 2>/dev/null || true
        die 1 "cannot fast-forward '$TARGET' to the merged commits ($(head -n1 <<<"$out")); nothing was changed"
    fi
    if [[ $MODE == apply ]]; then report "applied $N patches three-way to git checkout '$TARGET' as $N commits ($(span))"
    else report "reversed $N patches in git checkout '$TARGET' as $N revert commits ($(span))"; fi
    exit 0
fi

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
if [[ $GIT == 1 ]]; then git_preconditions; fi

# Checked after the git preconditions: "uncommitted changes" is the more useful message.
[[ $STATE == partial ]] && die 4 "$(partial_msg)"

# ---------------------------------------------------------------- dry run on a scratch copy
mkscratch
mkdir "$SCRATCH/orig"
for f in "${FILES[@]}"; do
    [[ -f "$T/$f" ]] || continue
    mkdir -p "$SCRATCH/orig/$(dirname "$f")"
    cp -p -- "$T/$f" "$SCRATCH/orig/$f"
done
cp -pR -- "$SCRATCH/orig" "$SCRATCH/work"
ORDER=("${PATCHES[@]}") RFLAG=()
if [[ $MODE == reverse ]]; then mapfile -t ORDER < <(printf '%s\n' "${PATCHES[@]}" | tac); RFLAG=(-R); fi
for p in "${ORDER[@]}"; do
    if ! out="$(cd "$SCRATCH/work" && gscratch apply -v --whitespace=nowarn "${RFLAG[@]}" "${XCL[@]}" -- "$PD/$p" 2>&1)"; then
        why="$(git_why "$out")"
        die 1 "dry run: $p does not apply${RFLAG:+ in reverse} to '$TARGET' (git apply: ${why:-failed}); nothing was changed. Restore the patch files from git, or check that TARGET is megatron-core $BASE"
    fi
    if grep -qiE 'offset|fuzz' <<<"$out"; then
        die 1 "dry run: $p applies only at shifted lines ($(grep -m1 -iE 'offset|fuzz' <<<"$out")); refusing, nothing was changed. The series must apply exactly; regenerate it (scripts/refresh_patches.sh)"
    fi
done
# off_file DIR: the first touched file under DIR without the wanted sha256 (then status 1).
off_file() {
    local i
    for i in "${!FILES[@]}"; do
        [[ "$(cur_sha "$1/${FILES[$i]}")" == "${WANT[$i]}" ]] || { echo "${FILES[$i]}"; return 1; }
    done
}
off="$(off_file "$SCRATCH/work")" \
    || die 1 "dry run: the series produced $off with a sha256 that manifest.sha256 does not expect (series and manifest disagree); nothing was changed. Restore patches/ from git or run scripts/refresh_patches.sh"

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
        f="${FILES[$i]}"; MOVED+=("$f")
        if [[ "${WANT[$i]}" == - ]]; then rm -f -- "$T/$f" || fail_plain "cannot remove $f"
        else mv -f -- "$T/$f.apply_patches.tmp" "$T/$f" || fail_plain "cannot replace $f"; fi
    done
    STAGED=()
    off_file "$T" >/dev/null || fail_plain "after writing, the touched files do not have the expected sha256"
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

if [[ $MODE == apply ]]; then
    if ! out="$(git -C "$T" am --quiet --keep-cr --no-3way --no-scissors --whitespace=nowarn "${XCL[@]}" -- "${PATCHES[@]/#/"$PD"/}" 2>&1)"; then
        fail_git "git am failed ($(grep -m1 -vE '^\s*$' <<<"$out" || echo unknown))"
    fi
    off_file "$T" >/dev/null || fail_git "after git am the touched files do not have the expected sha256 (a filter or eol setting?)"
    report "applied $N patches to git checkout '$TARGET' as $N commits ($(span))"
else
    for p in "${ORDER[@]}"; do
        mapfile -t ppaths < <(sed -n 's#^diff --git a/\(.*\) b/.*$#\1#p' "$PD/$p" | { if [[ ${#XCL[@]} -gt 0 ]]; then grep -v '^tests/'; else cat; fi; })
        out="$(git -C "$T" apply --index --whitespace=nowarn -R "${XCL[@]}" -- "$PD/$p" 2>&1)" \
            || fail_git "git apply -R --index $p failed ($(head -n1 <<<"$out"))"
        subj="$(subject_of "$PD/$p")"
        out="$(git -C "$T" commit -q -m "Revert \"$subj\"" \
            -m "This reverts patch $p of the series (scripts/apply_patches.sh --reverse)." -- "${ppaths[@]}" 2>&1)" \
            || fail_git "git commit of the revert of $p failed ($(head -n1 <<<"$out"))"
    done
    off_file "$T" >/dev/null || fail_git "after reversing, the touched files are not pristine"
    report "reversed $N patches in git checkout '$TARGET' as $N revert commits ($(span))"
fi
