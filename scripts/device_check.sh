#!/usr/bin/env bash
# scripts/device_check.sh: the prepared GPU check for one lent H200 (or any one-GPU machine).
# Sized to finish within 8 minutes including setup (the step timeouts below add up to less),
# leaving room for a rerun inside a 15-minute device budget.
#
# Steps (each time-boxed with `timeout`; a failed or timed-out step is recorded and the next runs):
#   setup       the device has python3 (3.12), torch 2.11 and pytest, but no megatron-core and no
#               emerging-optimizers: install the carried wheels (.whl/) into $DEVICE_CHECK_SITE
#               with pip --no-index --no-deps --target, make .venv a thin shim over the device's
#               python3 (only when there is no .venv), then scripts/setup.sh (a no-op when the
#               trees and stamps were carried; else it builds them from the megatron-core wheel).
#   unit_tests  pytest tests/unit_tests -m "$DEVICE_CHECK_PYTEST_MARKERS" (default: the fast,
#               non-gloo tests; gloo tests drive CPU ranks through the CPU runtime, which refuses
#               to install next to a real GPU).
#   bench       scripts/bench_param_sync.py --device cuda (its simulated DP sizes on a fake process
#               group, with torch.cuda.max_memory_allocated deltas, upstream vs patched).
#   pretrain    harness.pretrain_gpt on the GPU, DP=1 on NCCL, 20 iterations of a tiny GPT, for:
#                 upstream_dist_muon  pristine tree, dist_muon + both overlaps (0.17.1 is expected
#                                     to crash at DP=1; recorded, not counted against the step)
#                 patched_dist_muon   patched tree, same flags
#                 upstream_muon       pristine tree, plain muon, no overlaps (the reference)
#               then compares lm loss, grad-norm and num-zeros exactly, and reports peak memory.
#               One GPU allows one NCCL rank (NCCL refuses two ranks on one device); gloo has no
#               reduce-scatter and no uneven all_gather on CUDA tensors, so DP>1 is not tried here.
#
# Usage: scripts/device_check.sh [--dry-run] [--wheels DIR] [--out DIR]
#   --dry-run     print the plan: steps, timeouts, commands, output files; run nothing
#   --wheels DIR  carried wheels (default .whl when there is no real .venv)
#   --out DIR     results (default $OUT, as the device tool sets it, else build/device_check/out)
# Env: DEVICE_CHECK_PYTEST_MARKERS ("not slow and not gloo"), DEVICE_CHECK_BENCH_ARGS ("--device
#      cuda"), DEVICE_CHECK_TRAIN_ITERS (20), DEVICE_CHECK_SITE (/tmp/site).
# Output ($OUT, flat, at most 8 files): summary.json setup.log unit_tests.log unit_tests.xml
#      bench.log param_sync.json pretrain.log pretrain_compare.json
# Exit: 0 every step ok; 1 a step failed or timed out (summary.json says which);
#       2 bad usage or missing inputs (e.g. no wheels); nothing was run.
#
# Prepare the carry and get the exact device-tool call with scripts/prepare_device_carry.sh.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PROG="device_check"
die() { echo "$PROG: error: $*" >&2; exit 2; }

# ---------------------------------------------------------------- budget (seconds)
# Sum of timeouts plus kill grace must stay under LIMIT_S (8 minutes).
LIMIT_S=480
KILL_AFTER_S=5
T_SETUP=45 T_UNIT=100 T_BENCH=100 T_PRETRAIN=200
T_RUN=55            # each of the 3 training runs inside the pretrain step
STEPS=(setup unit_tests bench pretrain)
OUT_FILES=(summary.json setup.log unit_tests.log unit_tests.xml bench.log param_sync.json pretrain.log pretrain_compare.json)
RUNS=(upstream_dist_muon patched_dist_muon upstream_muon)
SKIP_RC=97          # a step whose script is not in this tree yet

step_timeout() {
    case "$1" in setup) echo $T_SETUP ;; unit_tests) echo $T_UNIT ;; bench) echo $T_BENCH ;; pretrain) echo $T_PRETRAIN ;; esac
}

# ---------------------------------------------------------------- configuration
resolve_config() {
    DC_MARKERS="${DEVICE_CHECK_PYTEST_MARKERS:-not slow and not gloo}"
    DC_BENCH_ARGS="${DEVICE_CHECK_BENCH_ARGS:---device cuda}"
    DC_ITERS="${DEVICE_CHECK_TRAIN_ITERS:-20}"
    DC_SITE="${DEVICE_CHECK_SITE:-/tmp/site}"
    DC_WORK="$ROOT/build/device_check"
    DC_PY="$ROOT/.venv/bin/python"
    [[ "$DC_ITERS" =~ ^[1-9][0-9]*$ ]] || die "DEVICE_CHECK_TRAIN_ITERS must be a positive integer, got '$DC_ITERS'"
}

# Megatron flags of one training run; $1 = run name. Tiny GPT, DP=1, NCCL, mock data, local
# transformer impl and no apex/TE fusions (the device image has neither); the bias fusions are
# off too, since megatron-core compiles them with torch.compile, which costs tens of seconds.
train_args() {
    local run="$1" args
    args=(--num-layers 2 --hidden-size 256 --num-attention-heads 4 --seq-length 256
          --max-position-embeddings 256 --micro-batch-size 4 --global-batch-size 8
          --train-iters "$DC_ITERS" --lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine
          --lr-warmup-iters 2 --weight-decay 0.1 --clip-grad 1.0 --seed 1234
          --mock-data --tokenizer-type NullTokenizer --vocab-size 4096
          --bf16 --accumulate-allreduce-grads-in-fp32 --ddp-bucket-size 200000
          --transformer-impl local --no-gradient-accumulation-fusion --no-persist-layer-norm
          --no-masked-softmax-fusion --no-bias-gelu-fusion --no-bias-dropout-fusion
          --distributed-backend nccl
          --eval-interval 10 --eval-iters 2 --log-interval 1
          --log-num-zeros-in-grad --log-memory-to-tensorboard
          --tensorboard-dir "$DC_WORK/$run/tb")
    case "$run" in
        *_dist_muon) args+=(--optimizer dist_muon --overlap-param-gather --overlap-grad-reduce) ;;
        upstream_muon) args+=(--optimizer muon) ;;
    esac
    printf '%s\n' "${args[@]}"
}

# The tree a run imports, as harness/trees.py selects it: "<tree parent>:<repo root>" on
# PYTHONPATH (megatron is a namespace package; the first megatron/core wins), and
# MEGATRON_EXPECT_TREE for harness.trees.check_expected_tree().
tree_parent() { case "$1" in upstream_*) echo "$ROOT/build/upstream" ;; *) echo "$ROOT" ;; esac; }
tree_pythonpath() {
    local p; p="$(tree_parent "$1")"
    if [[ "$p" == "$ROOT" ]]; then echo "$ROOT"; else echo "$p:$ROOT"; fi
}

run_port() { case "$1" in upstream_dist_muon) echo 29511 ;; patched_dist_muon) echo 29512 ;; *) echo 29513 ;; esac; }

train_cmd() {   # prints the command words of one run, one per line (run from run_dir)
    local run="$1"
    printf '%s\n' env "PYTHONPATH=$(tree_pythonpath "$run")" \
        "MEGATRON_EXPECT_TREE=$(tree_parent "$run")/megatron" CUDA_DEVICE_MAX_CONNECTIONS=1 \
        CUBLAS_WORKSPACE_CONFIG=:4096:8 "$DC_PY" -m torch.distributed.run --nnodes 1 \
        --nproc-per-node 1 --master-addr 127.0.0.1 --master-port "$(run_port "$run")" \
        -m harness.pretrain_gpt
    train_args "$run"
}
# Each run starts in its own folder: `python -m` puts the working directory first on sys.path,
# and the repo root there would shadow the pristine tree with the patched megatron/.
run_dir() { echo "$DC_WORK/$1"; }

setup_pip_cmd() {   # prints the pip command words (wheels mode only)
    local w
    printf '%s\n' python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --upgrade --target "$DC_SITE"
    for w in "$DC_WHEELS"/*.whl; do [[ "$w" == "$DC_MCORE_WHEEL" ]] || printf '%s\n' "$w"; done
}

step_cmd() {    # prints the main command words of the unit_tests and bench steps, one per line
    case "$1" in
        unit_tests) printf '%s\n' env "PYTHONPATH=$ROOT" "$DC_PY" -m pytest tests/unit_tests -q \
                   -p no:cacheprovider -m "$DC_MARKERS" --junitxml "$DC_OUT/unit_tests.xml" ;;
        bench) local b; read -r -a b <<< "$DC_BENCH_ARGS"
               printf '%s\n' env "PYTHONPATH=$ROOT" "$DC_PY" scripts/bench_param_sync.py "${b[@]}" ;;
    esac
}

step_display() {    # one line per step for --dry-run
    case "$1" in
        setup) if [[ $DC_MODE == wheels ]]; then
                   echo "$(setup_pip_cmd | quote_lines) && cp $(printf '%q' "$DC_MCORE_WHEEL") build/wheels/ && <.venv shim if none> && scripts/setup.sh"
               else echo "scripts/setup.sh (existing .venv)"; fi ;;
        unit_tests|bench) step_cmd "$1" | quote_lines ;;
        pretrain) echo "${RUNS[*]} (run lines below), then compare -> pretrain_compare.json" ;;
    esac
}

quote_lines() { local w out=(); while IFS= read -r w; do out+=("$w"); done; printf '%q ' "${out[@]}" | sed 's/ $//'; }

# ---------------------------------------------------------------- wheels
find_wheels() {  # sets DC_MODE (wheels|venv), DC_WHEELS, DC_MCORE_WHEEL; dies on missing wheels
    local explicit="$1"
    if [[ -z "$explicit" && -x "$ROOT/.venv/bin/python" && ! -f "$ROOT/.venv/.device_check_shim" ]]; then
        DC_MODE=venv DC_WHEELS="" DC_MCORE_WHEEL=""
        return
    fi
    DC_MODE=wheels
    DC_WHEELS="${explicit:-$ROOT/.whl}"
    local hint="run scripts/prepare_device_carry.sh on the workstation and carry '.whl' (device README: wheels)"
    [[ -d "$DC_WHEELS" ]] || die "no wheel folder '$DC_WHEELS': the device has no megatron-core or emerging-optimizers; $hint"
    # shellcheck source=../requirements/megatron-core.lock
    source "$ROOT/requirements/megatron-core.lock"
    DC_MCORE_WHEEL="$DC_WHEELS/$MCORE_WHEEL"
    [[ -f "$DC_MCORE_WHEEL" ]] || die "missing $MCORE_WHEEL in '$DC_WHEELS' (megatron-core $MCORE_VERSION); $hint"
    compgen -G "$DC_WHEELS/emerging_optimizers-*.whl" >/dev/null \
        || die "missing emerging_optimizers-*.whl in '$DC_WHEELS' (dist_muon needs it); $hint"
}

# ---------------------------------------------------------------- steps (run as `$0 __step NAME`)
step_setup() {
    echo "== machine"; date -u +%FT%TZ; uname -a
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 || echo "nvidia-smi: unavailable"
    if [[ $DC_MODE == wheels ]]; then
        echo "== wheels from $DC_WHEELS"
        local pip=(); while IFS= read -r w; do pip+=("$w"); done < <(setup_pip_cmd)
        "${pip[@]}"
        mkdir -p build/wheels
        [[ -f "build/wheels/$(basename "$DC_MCORE_WHEEL")" ]] || cp "$DC_MCORE_WHEEL" build/wheels/
        if [[ ! -x .venv/bin/python ]]; then
            # sys.executable keeps a virtual environment's own path (the device's python3 is
            # /opt/torch/.venv/bin/python3); resolving symlinks would lose its site-packages.
            local real; real="$(python3 -c 'import sys; print(sys.executable)')"
            echo "== .venv shim over $real"
            mkdir -p .venv/bin && touch .venv/.device_check_shim
            printf '#!/usr/bin/env bash\n# Made by scripts/device_check.sh: the device python3 plus the carried wheels.\nexport PYTHONPATH="%s${PYTHONPATH:+:$PYTHONPATH}"\nexec %q "$@"\n' \
                "$DC_SITE" "$real" > .venv/bin/python
            printf '#!/usr/bin/env bash\nexec "$(dirname "$0")/python" -m torch.distributed.run "$@"\n' > .venv/bin/torchrun
            printf '#!/usr/bin/env bash\nexec "$(dirname "$0")/python" -m pytest "$@"\n' > .venv/bin/pytest
            ln -sf python .venv/bin/python3
            chmod +x .venv/bin/python .venv/bin/torchrun .venv/bin/pytest
        fi
        if [[ -f .venv/.device_check_shim ]]; then
            # The shim is the environment: tell setup.sh its packages are in place (no network here).
            mkdir -p build/stamps && sha256sum requirements/lock.txt | awk '{print $1}' > build/stamps/venv
        fi
    fi
    echo "== scripts/setup.sh"
    scripts/setup.sh
    echo "== versions (one interpreter start: imports cost seconds)"
    PYTHONPATH="$ROOT" "$DC_PY" - <<'PY'
import sys, torch, emerging_optimizers, megatron.core.package_info as mcore
print("python", sys.version.split()[0])
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available(),
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
print("emerging_optimizers", getattr(emerging_optimizers, "__version__", "?"))
print("patched tree: megatron-core", mcore.__version__, "from", mcore.__file__)
PY
}

step_unit_tests() {
    local cmd=(); while IFS= read -r w; do cmd+=("$w"); done < <(step_cmd unit_tests)
    "${cmd[@]}"
}

step_bench() {
    [[ -f scripts/bench_param_sync.py ]] || { echo "scripts/bench_param_sync.py is not in this tree"; return $SKIP_RC; }
    rm -f build/bench/param_sync.json
    local cmd=(); while IFS= read -r w; do cmd+=("$w"); done < <(step_cmd bench)
    local rc=0; "${cmd[@]}" || rc=$?
    if [[ -f build/bench/param_sync.json ]]; then cp build/bench/param_sync.json "$DC_OUT/param_sync.json"
    else echo "bench: build/bench/param_sync.json was not written"; [[ $rc != 0 ]] || rc=4; fi
    return $rc
}

step_pretrain() {
    [[ -f harness/pretrain_gpt.py ]] || { echo "harness/pretrain_gpt.py is not in this tree"; return $SKIP_RC; }
    local run rc cmd t0
    : > "$DC_WORK/runs.tsv"
    for run in "${RUNS[@]}"; do
        rm -rf "${DC_WORK:?}/$run"; mkdir -p "$DC_WORK/$run"
        # Which megatron.core does this run import? Guards against a tree selection that silently
        # picks the patched tree for an "upstream" run.
        (cd "$(run_dir "$run")" && PYTHONPATH="$(tree_pythonpath "$run")" "$DC_PY" -c \
            $'import os\ntry:\n    import harness.pretrain_gpt\nexcept BaseException as e:\n    print("import harness.pretrain_gpt:", repr(e))\nimport megatron.core as m\nprint(os.path.dirname(m.__file__))' \
            > tree.txt 2> tree.err) || true
        echo "== $run (megatron.core from $(tail -n1 "$DC_WORK/$run/tree.txt" 2>/dev/null || echo '?'))"
        cmd=(); while IFS= read -r w; do cmd+=("$w"); done < <(train_cmd "$run")
        echo "cd $(run_dir "$run") && $(train_cmd "$run" | quote_lines)"
        t0=$SECONDS rc=0
        (cd "$(run_dir "$run")" && timeout -k "$KILL_AFTER_S" "$T_RUN" "${cmd[@]}") || rc=$?
        printf '%s\t%s\t%s\n' "$run" "$rc" "$((SECONDS - t0))" >> "$DC_WORK/runs.tsv"
        echo "== $run: exit $rc after $((SECONDS - t0)) s"
    done
    DC_ROOT="$ROOT" "$DC_PY" - "$DC_WORK" "$DC_OUT/pretrain_compare.json" "$DC_ITERS" <<'PY'
import json, math, os, sys
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

work, out_path, iters = sys.argv[1], sys.argv[2], int(sys.argv[3])
root = os.environ["DC_ROOT"]
exact_tags = ["lm loss", "grad-norm", "num-zeros"]
info_tags = ["mem-max-allocated-bytes", "mem-allocated-bytes", "iteration-time"]
runs = {}
for line in open(os.path.join(work, "runs.tsv")):
    name, rc, secs = line.rstrip("\n").split("\t")
    tree_file = os.path.join(work, name, "tree.txt")
    tree = open(tree_file).read().split() if os.path.exists(tree_file) else []
    rec = {"rc": int(rc), "seconds": int(secs), "megatron_core_dir": tree[-1] if tree else None,
           "metrics": {}}
    tb = os.path.join(work, name, "tb")
    if os.path.isdir(tb):
        acc = EventAccumulator(tb, size_guidance={"scalars": 0}); acc.Reload()
        for tag in exact_tags + info_tags:
            if tag in acc.Tags().get("scalars", []):
                rec["metrics"][tag] = {str(e.step): e.value for e in acc.Scalars(tag)}
    want_upstream = name.startswith("upstream")
    d = rec["megatron_core_dir"] or ""
    rec["tree_ok"] = bool(d) and (d.startswith(os.path.join(root, "build", "upstream")) == want_upstream)
    rec["complete"] = rec["rc"] == 0 and len(rec["metrics"].get("lm loss", {})) == iters
    runs[name] = rec

def compare(a, b):
    ra, rb = runs.get(a), runs.get(b)
    res = {"a": a, "b": b}
    if not (ra and rb and ra["complete"] and rb["complete"]):
        res["verdict"] = "not_compared"; res["why"] = "a run failed or is incomplete"; return res
    first, maxdiff = None, {}
    for tag in exact_tags:
        va, vb = ra["metrics"].get(tag, {}), rb["metrics"].get(tag, {})
        steps = sorted(set(va) | set(vb), key=int)
        diffs = []
        for s in steps:
            x, y = va.get(s, math.nan), vb.get(s, math.nan)
            d = abs(x - y) if not (math.isnan(x) or math.isnan(y)) else math.inf
            diffs.append(d)
            if d != 0 and (first is None or int(s) < first[0]):
                first = (int(s), tag, x, y)
        maxdiff[tag] = max(diffs) if diffs else None
    res["max_abs_diff"] = maxdiff
    res["verdict"] = "identical" if first is None else "diverged"
    res["first_divergent_step"] = None if first is None else {"step": first[0], "metric": first[1], "a": first[2], "b": first[3]}
    return res

def peak(name):
    m = runs.get(name, {}).get("metrics", {}).get("mem-max-allocated-bytes", {})
    return max(m.values()) if m else None

result = {
    "dp_size": 1, "backend": "nccl", "iterations": iters, "runs": runs,
    "comparisons": [compare("upstream_dist_muon", "patched_dist_muon"),
                    compare("upstream_muon", "patched_dist_muon")],
    "peak_allocated_bytes": {n: peak(n) for n in runs},
    "note": "megatron-core 0.17.1 is expected to crash with dist_muon at DP=1 (UPSTREAM_NOTES); "
            "then upstream_muon (plain Muon, no overlap) is the reference for the patched run.",
}
json.dump(result, open(out_path, "w"), indent=1, sort_keys=True)
for c in result["comparisons"]:
    print(f"{c['a']} vs {c['b']}: {c['verdict']}", c.get("first_divergent_step") or "")
patched = runs.get("patched_dist_muon", {})
ok = patched.get("complete") and patched.get("tree_ok") and all(
    r["tree_ok"] for r in runs.values() if r.get("megatron_core_dir"))
sys.exit(0 if ok else 1)
PY
}

# ---------------------------------------------------------------- internal entry
if [[ "${1:-}" == "__step" ]]; then
    set -x
    "step_$2"
    exit $?
fi

# ---------------------------------------------------------------- options
dry_run=0 wheels_arg="" out_arg=""
while [[ $# -gt 0 ]]; do
    case "$1" in
        -h|--help) sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
        --dry-run) dry_run=1 ;;
        --wheels) [[ -n "${2:-}" ]] || die "--wheels needs a folder"; wheels_arg="$2"; shift ;;
        --out) [[ -n "${2:-}" ]] || die "--out needs a folder"; out_arg="$2"; shift ;;
        *) die "unknown argument '$1' (see --help)" ;;
    esac
    shift
done
resolve_config
find_wheels "$wheels_arg"
DC_OUT="${out_arg:-${OUT:-$ROOT/build/device_check/out}}"

total=0
for s in "${STEPS[@]}"; do total=$(( total + $(step_timeout "$s") + KILL_AFTER_S )); done
(( total <= LIMIT_S )) || die "internal: step timeouts add up to $total s > $LIMIT_S s"
(( ${#RUNS[@]} * (T_RUN + KILL_AFTER_S) + 15 <= T_PRETRAIN )) || die "internal: training runs do not fit the pretrain step"

if [[ $dry_run == 1 ]]; then
    echo "$PROG: plan (dry run; nothing is run)"
    echo "mode: $DC_MODE${DC_WHEELS:+ (wheels: $DC_WHEELS)}"
    echo "out: $DC_OUT"
    echo "files: ${OUT_FILES[*]}"
    for s in "${STEPS[@]}"; do
        echo "step $s timeout=$(step_timeout "$s")s kill_after=${KILL_AFTER_S}s: $(step_display "$s")"
    done
    for r in "${RUNS[@]}"; do
        echo "run $r timeout=${T_RUN}s kill_after=${KILL_AFTER_S}s: cd $(printf '%q' "$(run_dir "$r")") && $(train_cmd "$r" | quote_lines)"
    done
    echo "budget: total_s=$total limit_s=$LIMIT_S"
    exit 0
fi

mkdir -p "$DC_OUT" "$DC_WORK"
export DC_MARKERS DC_BENCH_ARGS DC_ITERS DC_SITE DC_WORK DC_PY DC_OUT DC_MODE DC_WHEELS DC_MCORE_WHEEL
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
: > "$DC_WORK/steps.tsv"
t_all=$SECONDS
any_failed=0
for s in "${STEPS[@]}"; do
    log="$DC_OUT/$s.log"
    t=$(step_timeout "$s") t0=$SECONDS rc=0
    echo "$PROG: step $s (timeout ${t}s) ..."
    timeout -k "$KILL_AFTER_S" "$t" "$ROOT/scripts/device_check.sh" __step "$s" > "$log" 2>&1 || rc=$?
    case $rc in 0) status=ok ;; 124|137) status=timeout ;; "$SKIP_RC") status=skipped ;; *) status=failed ;; esac
    [[ $status == ok || $status == skipped ]] || any_failed=1
    printf '%s\t%s\t%s\t%s\t%s\n' "$s" "$status" "$rc" "$((SECONDS - t0))" "$t" >> "$DC_WORK/steps.tsv"
    echo "$PROG: step $s: $status (exit $rc, $((SECONDS - t0)) s); log $log"
    [[ $status == ok ]] || tail -n 15 "$log" | sed 's/^/    | /'
done

python3 - "$DC_WORK/steps.tsv" "$DC_OUT" "$((SECONDS - t_all))" "$LIMIT_S" <<'PY'
import json, os, subprocess, sys, time
steps_tsv, out, total, limit = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
steps = []
for line in open(steps_tsv):
    name, status, rc, secs, tmo = line.rstrip("\n").split("\t")
    steps.append({"name": name, "status": status, "rc": int(rc), "seconds": int(secs),
                  "timeout_s": int(tmo), "log": f"{name}.log"})
def sh(cmd):
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=20).stdout.strip()
    except Exception as e:  # noqa: BLE001 - a summary must still be written
        return f"unavailable: {e}"
summary = {
    "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    "gpu": sh(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"]),
    "python_torch": sh([os.environ["DC_PY"], "-c", "import sys, torch; print(sys.version.split()[0], torch.__version__)"]),
    "mode": os.environ.get("DC_MODE"), "total_seconds": total, "limit_seconds": limit,
    "steps": steps,
    "ok": all(s["status"] in ("ok", "skipped") for s in steps),
}
cmp_path = os.path.join(out, "pretrain_compare.json")
if os.path.exists(cmp_path):
    summary["pretrain_comparisons"] = [
        {k: c.get(k) for k in ("a", "b", "verdict", "first_divergent_step")}
        for c in json.load(open(cmp_path)).get("comparisons", [])]
json.dump(summary, open(os.path.join(out, "summary.json"), "w"), indent=1)
print(json.dumps(summary, indent=1))
PY
exit $any_failed
