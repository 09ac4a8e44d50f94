#!/usr/bin/env bash
# scripts/refresh_patches.sh: regenerate patches/0.17.1/ from build/series-git, byte-stable
# (the same commits give the same bytes, run after run, machine after machine).
#
# Usage: scripts/refresh_patches.sh [--check]
#   (none)   write NNNN-<subject>.patch (one per commit in pristine..HEAD),
#            series and manifest.sha256 in patches/0.17.1/; remove *.patch files that are no
#            longer in the series. Files that already hold the right bytes are not rewritten.
#   --check  write nothing; say whether patches/0.17.1/ already equals what a refresh would write.
# Env:   SERIES_GIT=DIR   the series repo (default build/series-git; tag `pristine` + commits)
#        PATCHES_DIR=DIR  where the series lives (default patches/0.17.1/, the 0.17.1 base)
# Exit:  0 patches/ written or already up to date (--check: up to date)
#        1 error: no series repo, no `pristine` tag, uncommitted edits, a merge or an empty
#          commit in pristine..HEAD, an unreadable package_info.py (message says what to do)
#        2 usage error
#        3 --check only: patches/ differs from what a refresh would write
#
# What is generated:
#   NNNN-<subject>.patch  `git format-patch --zero-commit --no-signature --full-index -N
#                         --no-renames --diff-algorithm=myers`, global/system git config ignored,
#                         so no hash of ours, no git version, no local diff settings leak in.
#   series                the comment/blank lines that open the existing series file (kept
#                         verbatim; a default header if there is none), then one patch per line.
#                         Comments placed between patch names are not kept.
#   manifest.sha256       read by scripts/apply_patches.sh: `base MAJOR.MINOR.PATCH` (the exact
#                         base, from package_info.py at tag `pristine`), the sha256 of every
#                         patch file, and per touched file its pristine and patched sha256
#                         (`-` = the file does not exist on that side).
#
# Editing workflow (the series is a git history; patches/ is its serialized form): patches/README.md,
# "Editing the series".
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SG="${SERIES_GIT:-$ROOT/build/series-git}"
PD="${PATCHES_DIR:-$ROOT/patches/0.17.1}"
usage() { echo "refresh_patches.sh: usage: scripts/refresh_patches.sh [--check]${1:+ (got '$1')}" >&2; exit 2; }
die() { echo "refresh_patches.sh: error: $*" >&2; exit 1; }
[[ $# -le 1 ]] || usage
CHECK=0
case "${1:-}" in
    "") ;;
    --check) CHECK=1 ;;
    -h|--help) sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) usage "$1" ;;
esac
# Only the repository's own config counts; user/system settings must not change the bytes.
g() { GIT_CONFIG_NOSYSTEM=1 GIT_CONFIG_GLOBAL=/dev/null LC_ALL=C git -C "$SG" "$@"; }

[[ -d "$SG/.git" ]] || die "$SG is not a git repository. Run scripts/setup.sh to build it from patches/."
g rev-parse -q --verify 'refs/tags/pristine^{commit}' >/dev/null \
    || die "$SG has no tag 'pristine'. Rebuild it: rm -rf $SG && scripts/setup.sh"
gitdir="$(g rev-parse --absolute-git-dir)"
for st in rebase-merge rebase-apply MERGE_HEAD CHERRY_PICK_HEAD; do
    [[ ! -e "$gitdir/$st" ]] || die "$SG is in the middle of a rebase/am/merge ($st). Finish it (git rebase --continue) or abort it, then rerun."
done
[[ -z "$(g status --porcelain)" ]] \
    || die "$SG has uncommitted changes ($(g status --porcelain | head -n3 | tr '\n' ' ')). Commit them (git commit -a --amend, or --fixup) or discard them (git checkout -- . ; git clean -fd), then rerun."
g merge-base --is-ancestor pristine HEAD || die "$SG HEAD does not descend from tag 'pristine'. Rebase your commits onto it: git rebase pristine"
[[ -z "$(g rev-list --merges pristine..HEAD)" ]] || die "$SG has merge commits in pristine..HEAD; a patch series must be linear. Run: git rebase pristine"
while read -r c; do
    [[ -z "$c" ]] && continue
    g diff-tree --quiet "$c^" "$c" -- && die "commit $(g log -1 --format='%h %s' "$c") in $SG changes nothing; drop it (git rebase -i pristine)."
done < <(g rev-list pristine..HEAD)

pinfo="$(g show pristine:megatron/core/package_info.py 2>/dev/null)" \
    || die "tag 'pristine' in $SG has no megatron/core/package_info.py; rebuild it: rm -rf $SG && scripts/setup.sh"
field() { sed -nE "s/^$1[[:space:]]*=[[:space:]]*([0-9]+).*/\\1/p" <<<"$pinfo" | head -n1; }
major="$(field MAJOR)" minor="$(field MINOR)" patchv="$(field PATCH)"
[[ -n "$major" && -n "$minor" && -n "$patchv" ]] || die "cannot read MAJOR/MINOR/PATCH from megatron/core/package_info.py at tag 'pristine'"

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
mkdir "$tmp/out"

# ---------------------------------------------------------------- patches
g -c core.quotePath=true -c diff.noprefix=false -c diff.mnemonicPrefix=false \
    -c diff.relative=false -c diff.orderFile=/dev/null -c diff.context=3 -c diff.interHunkContext=0 \
    -c diff.suppressBlankEmpty=false -c format.signature= -c format.suffix=.patch \
    format-patch --quiet --zero-commit --no-signature --full-index -N --no-renames \
    --diff-algorithm=myers --no-thread --no-cover-letter --no-attach --filename-max-length=64 \
    -o "$tmp/out" pristine..HEAD >/dev/null \
    || die "git format-patch failed in $SG (see above)"
mapfile -t names < <(cd "$tmp/out" && LC_ALL=C ls -1 -- *.patch 2>/dev/null || true)

# ---------------------------------------------------------------- cover letter
# 0000-cover-letter.patch, in `git format-patch --cover-letter`'s form: its subject and blurb
# are the maintainer's words, kept from the file in $PD; the shortlog and the diffstat under
# them are regenerated from the commits. It is not in `series` or the manifest (git am stops
# on a patch without a diff), so `git am 000[1-9]-*.patch` and apply_patches.sh skip it.
COVER=0000-cover-letter.patch
if [[ -f "$PD/$COVER" ]]; then
    mkdir "$tmp/cover"
    GIT_COMMITTER_NAME="$(g log -1 --format=%an HEAD)" GIT_COMMITTER_EMAIL="$(g log -1 --format=%ae HEAD)" \
        GIT_COMMITTER_DATE="$(g log -1 --format=%ad --date=rfc2822 HEAD)" \
        g -c format.signature= -c diff.orderFile=/dev/null format-patch --quiet --zero-commit \
        --no-signature --cover-letter --no-thread --stat=80 -o "$tmp/cover" pristine..HEAD >/dev/null \
        || die "git format-patch --cover-letter failed in $SG (see above)"
    python3 - "$PD/$COVER" "$tmp/cover/$COVER" "$tmp/out/$COVER" <<'PY' || die "$PD/$COVER: cannot keep its subject and blurb (see above); restore it from git"
import re, sys
old = open(sys.argv[1]).read()
new = open(sys.argv[2]).read()
head, _, rest = old.partition("\n\n")
subject = re.search(r"^Subject: (.*(?:\n .*)*)", head, re.M)
shortlog = re.search(r"^\S.* \(\d+\):$", rest, re.M)
if not subject or not shortlog:
    sys.exit(f"{sys.argv[1]}: no Subject header or no shortlog ('Author (N):') line")
blurb = rest[: shortlog.start()]
new = re.sub(r"^Subject: .*(?:\n .*)*", lambda m: "Subject: " + subject.group(1), new, count=1, flags=re.M)
assert "*** BLURB HERE ***\n" in new
new = new.replace("*** BLURB HERE ***\n", blurb.rstrip("\n") + "\n", 1)
open(sys.argv[3], "w").write(new)
PY
fi

# ---------------------------------------------------------------- series
{
    if [[ -f "$PD/series" ]]; then
        # Keep the opening block of comment/blank lines verbatim.
        while IFS= read -r line || [[ -n "$line" ]]; do
            [[ "$line" =~ ^[[:space:]]*(#|$) ]] || break
            printf '%s\n' "$line"
        done < "$PD/series"
    else
        echo "# Patch series against megatron-core $major.$minor.$patchv."
        echo "# Apply in this order. Every prefix is meant to pass scripts/test.sh."
    fi
    for n in "${names[@]}"; do printf '%s\n' "$n"; done
} > "$tmp/out/series"

# ---------------------------------------------------------------- manifest
# `also` (other releases whose touched files are the base's) is a maintainer's statement: kept.
also_line="$(grep -m1 -E '^also( [0-9]+\.[0-9]+\.[0-9]+)+$' "$PD/manifest.sha256" 2>/dev/null || true)"
blobsha() { # <rev> <path>: sha256 of the file at rev, or '-' when it does not exist there
    if g cat-file -e "$1:$2" 2>/dev/null; then g cat-file blob "$1:$2" | sha256sum | cut -d' ' -f1; else echo -; fi
}
{
    echo "# manifest.sha256: generated by scripts/refresh_patches.sh; do not edit by hand."
    echo "# Read by scripts/apply_patches.sh to verify the series and to recognize a target's state."
    echo "#   base MAJOR.MINOR.PATCH                  the exact megatron-core version the series applies to"
    [[ -z "$also_line" ]] || echo "#   also VERSION...                         versions with the base's touched files (kept from the last manifest)"
    echo "#   patch SHA256 FILE                       every patch file, in series order"
    echo "#   file PRISTINE-SHA256 PATCHED-SHA256 PATH every touched file; '-' = absent on that side"
    echo "base $major.$minor.$patchv"
    [[ -z "$also_line" ]] || echo "$also_line"
    for n in "${names[@]}"; do echo "patch $(sha256sum "$tmp/out/$n" | cut -d' ' -f1) $n"; done
    while IFS= read -r -d '' p; do
        echo "file $(blobsha pristine "$p") $(blobsha HEAD "$p") $p"
    done < <(g diff -z --name-only --no-renames pristine HEAD | LC_ALL=C sort -z)
} > "$tmp/out/manifest.sha256"

# ---------------------------------------------------------------- compare / write
changed=()
covers=(); [[ -f "$tmp/out/$COVER" ]] && covers=("$COVER")
for n in "${names[@]}" "${covers[@]}" series manifest.sha256; do
    cmp -s "$tmp/out/$n" "$PD/$n" 2>/dev/null || changed+=("$n")
done
stale=()
for f in "$PD"/*.patch; do
    [[ -e "$f" ]] || continue
    b="$(basename "$f")"
    [[ " ${names[*]} ${covers[*]} " == *" $b "* ]] || stale+=("$b")
done

if [[ ${#changed[@]} -eq 0 && ${#stale[@]} -eq 0 ]]; then
    echo "refresh_patches.sh: $PD is up to date (${#names[@]} patches)"
    exit 0
fi
if [[ $CHECK == 1 ]]; then
    echo "refresh_patches.sh: $PD differs from $SG: ${changed[*]:+would write ${changed[*]}}${stale[*]:+; would remove ${stale[*]}}. Run scripts/refresh_patches.sh" >&2
    exit 3
fi
mkdir -p "$PD"
for b in "${stale[@]}"; do rm -f -- "$PD/$b"; done
for n in "${changed[@]}"; do cp -- "$tmp/out/$n" "$PD/$n.tmp" && mv -f -- "$PD/$n.tmp" "$PD/$n"; done
echo "refresh_patches.sh: wrote ${changed[*]:-nothing}${stale[*]:+; removed ${stale[*]}} in $PD (${#names[@]} patches)"
