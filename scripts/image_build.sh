#!/usr/bin/env bash
# scripts/image_build.sh: the GPU image's build steps (Dockerfile runs each as one RUN), so that
# they can run, and be tested, outside Docker on a copy of the build context
# (tests/unit_tests/test_dockerfile.py does that in CI, with the base image's packages taken
# from the repo's .venv).
#
# Usage: scripts/image_build.sh STEP [STEP...]     (run in the repo copy, i.e. $HARNESS)
#
#   base          Python >= 3.12, torch, and every module of $BASE_MODULES importable by
#                 find_spec (default "transformer_engine apex": importing TE needs a driver)
#   requirements  pip install -r requirements/docker.txt (the base's pip constraints stay)
#   megatron-lm   git clone --depth 1 --branch $MEGATRON_LM_REF $MEGATRON_LM_REPO $MEGATRON_LM,
#                 check its HEAD against the locked commit (requirements/megatron-lm.lock,
#                 MLM_COMMIT, when the ref is MLM_TAG; else $MEGATRON_LM_COMMIT if set), then
#                 build megatron's C++ dataset helpers (make; MEGATRON_LM_HELPERS=0 skips it)
#   trees         keep a pristine copy of the clone's megatron/ in build/upstream/megatron, apply
#                 patches/ to the clone (scripts/apply_patches.sh, all or nothing), confirm with
#                 --check, link megatron/ to the patched clone
#   wheel         pip download the megatron-core wheel of requirements/megatron-core.lock into
#                 build/wheels, sha256-checked by pip (--require-hashes); the data step reads it
#   data          python -m harness.data: the functional tests' training data in build/data
#   unit-tests    pytest $UNIT_TEST_PATHS -m "$UNIT_TEST_MARKERS" $UNIT_TEST_ARGS
#
# Environment: PYTHON (python3), MEGATRON_LM, MEGATRON_LM_REPO, MEGATRON_LM_REF,
# MEGATRON_LM_COMMIT, MEGATRON_LM_HELPERS, BASE_MODULES, UNIT_TEST_MARKERS
# ("not slow and not gloo"), UNIT_TEST_PATHS (tests/unit_tests), UNIT_TEST_ARGS (extra pytest
# words; both split on spaces). pip reads its
# own PIP_* variables (PIP_INDEX_URL, PIP_FIND_LINKS, PIP_NO_INDEX, ...).
#
# Exit: 0 every step done; 2 bad usage; otherwise the failing step's code, with a line naming
# the step and what to do.
set -euo pipefail

PROG="image_build.sh"
die() { echo "$PROG: error: $1" >&2; exit "${2:-1}"; }
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
STEPS="base requirements megatron-lm trees wheel data unit-tests"

lock_value() {  # lock_value FILE KEY: KEY=VALUE of a requirements/*.lock file
    local v
    v="$(sed -n "s/^$2=//p" "$1" | tail -n1)"
    [[ -n "$v" ]] || die "$1 has no $2="
    echo "$v"
}

step_base() {
    "$PY" - "${BASE_MODULES-transformer_engine apex}" <<'PY'
import importlib.util, sys
assert sys.version_info >= (3, 12), "need Python >= 3.12 (megatron-core 0.17.1's wheel is cp312), base has " + sys.version
import torch
missing = [m for m in sys.argv[1].split() if importlib.util.find_spec(m) is None]
assert not missing, f"the base image lacks {missing}: use an NGC PyTorch image that ships them"
print("torch", torch.__version__)
PY
}

step_requirements() {
    "$PY" -m pip install --no-cache-dir --disable-pip-version-check -r requirements/docker.txt
}

step_megatron_lm() {
    : "${MEGATRON_LM:?set MEGATRON_LM to the folder the clone goes to}"
    local repo="${MEGATRON_LM_REPO:-https://github.com/NVIDIA/Megatron-LM.git}"
    local ref="${MEGATRON_LM_REF:-core_v0.17.1}" lock=requirements/megatron-lm.lock want head
    git clone --quiet --depth 1 --branch "$ref" "$repo" "$MEGATRON_LM" \
        || die "git clone --branch $ref $repo failed"
    want="${MEGATRON_LM_COMMIT:-}"
    if [[ -z "$want" && "$ref" == "$(lock_value "$lock" MLM_TAG)" ]]; then want="$(lock_value "$lock" MLM_COMMIT)"; fi
    if [[ -z "$want" && "$ref" == "$(lock_value "$lock" MLM_019_TAG)" ]]; then want="$(lock_value "$lock" MLM_019_COMMIT)"; fi
    head="$(git -C "$MEGATRON_LM" rev-parse HEAD)"
    if [[ -n "$want" ]]; then
        [[ "$head" == "$want" ]] \
            || die "$repo at $ref is commit $head, but $lock pins $want: the tag moved or the repo is another one; pass --build-arg MEGATRON_LM_COMMIT=$head only if you trust it"
        echo "$PROG: Megatron-LM $ref at $head (the expected commit)"
    else
        echo "$PROG: warning: Megatron-LM $ref at $head, not checked (no MEGATRON_LM_COMMIT for a ref other than the lock's)" >&2
    fi
    if [[ "${MEGATRON_LM_HELPERS:-1}" != 0 ]]; then
        make -C "$MEGATRON_LM/megatron/core/datasets" || die "building megatron's dataset helpers failed (needs g++ and pybind11)"
    fi
}

step_trees() {
    : "${MEGATRON_LM:?set MEGATRON_LM to the Megatron-LM clone}"
    [[ -d "$MEGATRON_LM/megatron/core" ]] || die "$MEGATRON_LM has no megatron/core: run the megatron-lm step first"
    rm -rf build/upstream/megatron
    mkdir -p build/upstream
    cp -a "$MEGATRON_LM/megatron" build/upstream/megatron
    GIT_COMMITTER_NAME="${GIT_COMMITTER_NAME:-megatron-layerwise-ag image}" \
    GIT_COMMITTER_EMAIL="${GIT_COMMITTER_EMAIL:-image@invalid}" \
        bash scripts/apply_patches.sh "$MEGATRON_LM"
    bash scripts/apply_patches.sh "$MEGATRON_LM" --check
    ln -sfn "$MEGATRON_LM/megatron" megatron
}

step_wheel() {
    local lock=requirements/megatron-core.lock version wheel sha tmp
    version="$(lock_value "$lock" MCORE_VERSION)" wheel="$(lock_value "$lock" MCORE_WHEEL)"
    sha="$(lock_value "$lock" MCORE_WHEEL_SHA256)"
    mkdir -p build/wheels
    tmp="$(mktemp -d)"
    echo "megatron-core==$version --hash=sha256:$sha" > "$tmp/req.txt"
    # No constraints: the base's pip constraints are for installed packages; this only fetches a file.
    PIP_CONSTRAINT="" "$PY" -m pip download --disable-pip-version-check --no-cache-dir --no-deps --only-binary=:all: \
        --require-hashes -d "$tmp/dl" -r "$tmp/req.txt" \
        || die "could not download $wheel with sha256 $sha ($lock); on another platform than x86_64 the lock's wheel does not apply"
    [[ -f "$tmp/dl/$wheel" ]] || die "pip fetched $(ls "$tmp/dl"), not $wheel ($lock)"
    mv "$tmp/dl/$wheel" "build/wheels/$wheel"
    rm -rf "$tmp"
}

step_data() {
    PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" "$PY" -m harness.data
}

step_unit_tests() {
    local extra=() paths=()
    read -r -a extra <<< "${UNIT_TEST_ARGS:-}"
    read -r -a paths <<< "${UNIT_TEST_PATHS:-tests/unit_tests}"
    PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" "$PY" -m pytest "${paths[@]}" -q -p no:cacheprovider \
        -m "${UNIT_TEST_MARKERS:-not slow and not gloo}" "${extra[@]+"${extra[@]}"}"
}

[[ $# -gt 0 ]] || die "no step given; steps: $STEPS" 2
for s in "$@"; do
    [[ " $STEPS " == *" $s "* ]] || die "unknown step '$s'; steps: $STEPS" 2
done
current=""
trap 'rc=$?; [[ $rc == 0 || -z "$current" ]] || echo "$PROG: error: step $current failed (exit $rc)" >&2' EXIT
for s in "$@"; do
    echo "$PROG: step $s" >&2
    current="$s"
    "step_${s//-/_}"   # not in an `||` list: set -e stays in force inside the step
done
current=""
