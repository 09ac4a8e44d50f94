"""Benchmark the layer-wise param sync: pristine megatron-core 0.17.1 against the series.

Usage (from the repo root, after scripts/setup.sh):

    .venv/bin/python scripts/bench_param_sync.py            # a few minutes on 2 CPU cores
    .venv/bin/python scripts/bench_param_sync.py --quick    # smoke run for tests (about a minute)
    .venv/bin/python scripts/bench_param_sync.py --publish  # also copy PNG + MD to docs/bench/

Both trees (``TREES``: pristine-0.17.1, series-0.17.1) are measured in the same run:

* gloo ranks, DP 2 and 4 (torchrun): one worker group per tree
  (harness/bench/sync_worker.py), both alive at once. Each counts one sync of every case,
  then serves timing blocks; this script asks the groups for blocks in ABBA order (trees
  in order in even rounds, reversed in odd ones) and forms the series/pristine ratio per
  round (harness/bench/stats.py). The "control" path (every grad buffer's reset(), code
  no tree changes) is the negative control.
* step memory (DP 2 and 4; not in --quick): peak memory per phase of a real training
  step (harness/gpu_check/memory_worker.py, config ``bench``, the CPU probe), overlap on
  and off.

Large DP sizes and real model shapes are the real-shape audit's (scripts/audit_param_sync.py).

Outputs in --out-dir (default build/bench): param_sync.json ({"meta", "records",
"timing", "step_memory"}), param_sync.md and param_sync.png (harness/bench/report.py).
Per record (tree, model, path, dp_size, rank): temporary_bytes, alloc_calls,
peak_extra_bytes (dispatch level), nccl_model_temporary_bytes, collective_ops (NCCL calls),
collective_launches (NCCL group launches), zero_size_ops, wire_bytes (received by this
rank), shares_equal, bucket_shares, profiler_alloc_bytes / _calls / _peak_bytes /
_caller_thread_bytes (torch.profiler, all threads), theory_* and their matches,
params_synced. "timing" holds, per (dp_size, model, path), the per-round block medians of
both trees and the series/pristine ratio with its bootstrap CI.

Exit status: 0 when the structural checks hold (see checks()); 1 otherwise (outputs are
written either way); 2 when a worker fails (WorkerError, harness.launch.LaunchError).
Timing never decides the exit status.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import socket
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from importlib.metadata import version
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from harness.bench import stats  # noqa: E402
from harness.bench.report import write_markdown, write_plot  # noqa: E402
from harness.cpu_runtime import FORM_LIST_EQUAL, FORM_LIST_UNEQUAL, model_call  # noqa: E402
from harness.launch import CORE_PRELOAD, LaunchError, run_command, torchrun_command  # noqa: E402
from harness.model import CONTROL, PARAM_DTYPE, PATHS  # noqa: E402

WORKER = REPO_ROOT / "harness" / "bench" / "sync_worker.py"
STEP_WORKER = REPO_ROOT / "harness" / "gpu_check" / "memory_worker.py"
#: The step-memory runs: a warm-up step (optimizer state exists), then the step reported.
STEP_MEMORY_STEPS = 2
#: The trees, in the order tables show them (harness.trees labels).
TREES = ("pristine-0.17.1", "series-0.17.1")
PRISTINE, SERIES = TREES
KEY = ("model", "path", "dp_size", "rank")
WORKER_TIMEOUT_S = 900
#: Sizes of a run: DP sizes of the gloo ranks, ABBA rounds, syncs per timing block, DP sizes
#: of the step-memory runs. meta["config"] of the JSON.
DEFAULTS = dict(real_dp=[2, 4], rounds=20, block=4, step_memory=[2, 4])
QUICK = dict(DEFAULTS, real_dp=[2], rounds=3, block=2, step_memory=[])
#: Worker environment: torchrun_command's, with Python warnings off (they flood the logs).
QUIET = {"PYTHONWARNINGS": "ignore"}


class WorkerError(RuntimeError):
    """A worker failed; the message holds its command and output tail."""


def _tail(proc_out: Path) -> str:
    try:
        return proc_out.read_text(errors="replace")[-4000:]
    except OSError:
        return ""


# ---------------------------------------------------------------- gloo ranks: counts + ABBA timing
def run_real(trees, dp: int, cfg: dict, raw: Path):
    """One worker group per tree, all at once; counts, then ABBA timing rounds.

    Returns:
        (records, timing): rank 0's count records of every tree, and
        {case_key: {tree: [block median seconds per round]}}.
    """
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(WORKER_TIMEOUT_S)
    address = f"127.0.0.1:{listener.getsockname()[1]}"
    procs, logs = {}, {}
    try:
        for label in trees:
            argv, env = torchrun_command(WORKER, ["--tree", label, "--serve", address], nproc=dp, tree=label,
                                         cpu=True, preload=CORE_PRELOAD, extra_env=QUIET)  # fmt: skip
            logs[label] = raw / f"{label}-real-dp{dp}.log"
            procs[label] = subprocess.Popen(
                argv, env=env, cwd=REPO_ROOT, stdout=logs[label].open("w"),
                stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        conns, records = {}, []
        deadline = time.monotonic() + WORKER_TIMEOUT_S
        while len(conns) < len(trees):
            for label, p in procs.items():
                if p.poll() is not None and label not in conns:
                    raise WorkerError(f"{label} real DP={dp} exited rc={p.returncode}\n{_tail(logs[label])}")
            listener.settimeout(max(1.0, min(10.0, deadline - time.monotonic())))
            try:
                sock, _ = listener.accept()
            except socket.timeout:
                if time.monotonic() > deadline:
                    raise WorkerError(f"real DP={dp}: workers did not connect in {WORKER_TIMEOUT_S} s")
                continue
            sock.settimeout(WORKER_TIMEOUT_S)
            f = sock.makefile("rw")
            hello = json.loads(f.readline())
            label = hello["records"][0]["tree"]
            conns[label] = (sock, f)
            records += hello["records"]
        cases = [(r["model"], r["path"]) for r in records if r["tree"] == trees[0]]
        timing = {c: {label: [] for label in trees} for c in cases}
        for rnd in range(cfg["rounds"]):
            for i, case in enumerate(cases):
                for label in stats.abba_order(list(trees), rnd + i):
                    sock, f = conns[label]
                    f.write(json.dumps({"op": "time", "case": i, "n": cfg["block"]}) + "\n")
                    f.flush()
                    line = f.readline()
                    if not line:
                        raise WorkerError(f"{label} real DP={dp} closed the connection\n{_tail(logs[label])}")
                    timing[case][label].append(statistics.median(json.loads(line)["times_s"]))
            print(f"[bench] real DP={dp}: round {rnd + 1}/{cfg['rounds']}", flush=True)
        for sock, f in conns.values():
            f.write(json.dumps({"op": "quit"}) + "\n")
            f.flush()
        for label, p in procs.items():
            if p.wait(timeout=120) != 0:
                raise WorkerError(f"{label} real DP={dp} exited rc={p.returncode}\n{_tail(logs[label])}")
        return records, {(dp,) + c: v for c, v in timing.items()}
    finally:
        listener.close()
        for p in procs.values():
            if p.poll() is None:
                os.killpg(p.pid, 9)
                p.wait()


# ---------------------------------------------------------------- merging
def gathers(rec: dict) -> list:
    """Per-rank shares of each all-gather one sync of this record issues: one per bucket
    with anything to gather, except the pristine tree's optimizer path
    (LayerWiseDistributedOptimizer.allgather_params), which gathers the whole model at once."""
    if rec["path"] == CONTROL:
        return []
    if rec["path"] == "optimizer" and rec["tree"] == PRISTINE:
        return [rec["model_shares"]] if rec["model_shares"] and max(rec["model_shares"]) else []
    return [s for s in rec["bucket_shares"] if max(s) > 0]


def expected_nccl(rec: dict) -> tuple:
    """(NCCL ops, NCCL temporary bytes) of one sync if every gather is a list all_gather on
    ProcessGroupNCCL, as pristine 0.17.1 issues them (the collective model's ``model_call``)."""
    calls = [model_call(FORM_LIST_EQUAL if len(set(s)) == 1 else FORM_LIST_UNEQUAL, s, rec["rank"], PARAM_DTYPE)
             for s in gathers(rec)]  # fmt: skip
    return sum(c.ops for c in calls), sum(c.nccl_temporary_bytes for c in calls)


def merge(records: list, timing: dict) -> list:
    """Add theory matches and timing summaries to the records; sort them."""
    for r in records:
        r["theory_match"] = r["temporary_bytes"] == (
            r["theory_pristine_bytes"] if r["tree"] == PRISTINE else r["theory_series_bytes"]
        )
        # The peak includes the collective model's stand-ins for NCCL's temporaries
        # (gloo ranks); it is compared with the theory only where there are none.
        r["peak_theory_match"] = r.get("model_standin_bytes", 0) > 0 or r["peak_extra_bytes"] == (
            r["theory_pristine_peak_bytes"] if r["tree"] == PRISTINE else 0
        )
        ops, temp = expected_nccl(r)
        r["list_gather_ops"], r["list_gather_nccl_temporary_bytes"] = ops, temp
        g = gathers(r)
        r["num_gathers"] = len(g)
        r["shares_equal"] = bool(g) and all(len(set(x)) == 1 for x in g)
        r["ops_per_gather"] = r["collective_ops"] / max(1, len(g))
        blocks = timing.get((r["dp_size"], r["model"], r["path"]), {})
        mine = blocks.get(r["tree"], [])
        r["block_median_s"] = mine
        r["median_s"] = statistics.median(mine) if mine else None
        r["time_ratio_vs_pristine"] = (
            stats.ratio_summary(blocks, r["tree"], PRISTINE) if r["tree"] != PRISTINE else None
        )
    order = {t: i for i, t in enumerate(TREES)}
    paths = {p: i for i, p in enumerate(PATHS + (CONTROL,))}
    return sorted(records, key=lambda r: (r["model"], r["dp_size"], r["rank"], paths[r["path"]], order[r["tree"]]))


def checks(records: list) -> dict:
    """Structural claims, each a list of failing record keys (empty = holds). No timing."""

    def key(r):
        return {k: r[k] for k in ("tree",) + KEY}

    sync = [r for r in records if r["path"] != CONTROL]
    shas = {r["control_code_sha"] for r in records}
    return {
        # The forced sync receives into a temporary by design (grad_data may hold grads
        # there), one bucket at a time, as 0.17.1 does.
        "series_zero_temporary_bytes": [
            key(r) for r in sync
            if r["tree"] == SERIES and r["path"] != "forced" and r["temporary_bytes"] != 0
        ],  # fmt: skip
        "series_zero_nccl_model_temporary_bytes": [
            key(r) for r in sync if r["tree"] == SERIES and r["nccl_model_temporary_bytes"] != 0
        ],
        "series_one_op_per_gather_where_shares_equal": [
            key(r) for r in sync
            if r["tree"] == SERIES and r["path"] != "optimizer" and r["shares_equal"]
            and r["ops_per_gather"] != 1
        ],  # fmt: skip
        "series_no_zero_size_ops": [
            key(r) for r in sync if r["tree"] == SERIES and r["zero_size_ops"] != 0
        ],
        "series_ops_and_launches_at_most_pristine": [
            key(r) for r in sync if r["tree"] == SERIES
            for u in sync if u["tree"] == PRISTINE and all(u[k] == r[k] for k in KEY)
            # the optimizer path broadcasts each param in place: one op per param, one launch
            if (r["path"] != "optimizer" and r["collective_ops"] > u["collective_ops"])
            or r["collective_launches"] > u["collective_launches"]
        ],  # fmt: skip
        "pristine_equals_theory": [
            key(r) for r in sync if r["tree"] == PRISTINE and not (r["theory_match"] and r["peak_theory_match"])
        ],
        "pristine_nccl_equals_theory": [
            key(r) for r in sync
            if r["tree"] == PRISTINE
            and (r["collective_ops"], r["nccl_model_temporary_bytes"])
            != (r["list_gather_ops"], r["list_gather_nccl_temporary_bytes"])
        ],  # fmt: skip
        "params_synced": [key(r) for r in sync if r["params_synced"] is not True],
        "control_code_identical_in_every_tree": [] if len(shas) <= 1 else sorted(shas),
    }


def timing_table(timing: dict) -> list:
    """Rows {dp_size, model, path, median_s per tree, series_vs_pristine}."""
    rows = []
    for (dp, model, path), blocks in timing.items():
        row = dict(dp_size=dp, model=model, path=path,
                   median_s={t: statistics.median(v) for t, v in blocks.items() if v},
                   series_vs_pristine=stats.ratio_summary(blocks, SERIES, PRISTINE))  # fmt: skip
        rows.append(row)
    return rows


def model_desc(cfg: dict) -> str:
    """The memory worker's config in words, as the step-memory table names its model."""
    return (f"GPT, {cfg['num_layers']} layers, hidden {cfg['hidden_size']}, FFN {cfg['ffn_hidden_size']}, "
            f"{cfg['num_attention_heads']} heads, vocab {cfg['vocab']}, seq {cfg['seq']}, "
            f"micro-batch {cfg['micro_batch']}, untied output layer")


def step_memory_record(doc: dict, tree: str) -> dict:
    """The step-memory table's record of one memory-worker result (its rank 0, last step):
    overlap, phases, phase_peak_bytes, step_peak_bytes, peak_phase, param_bytes, grad_data_bytes,
    loss, tree, tree_dir, dp_size, model_desc, phase_desc, steps (1: the step reported)."""
    rank0 = doc["ranks"][0]
    step = rank0["steps"][-1]
    peaks = step["phase_peak_bytes"]
    ran = [p for p in doc["phases"] if peaks.get(p) is not None]
    return dict(
        overlap=doc["overlap"], phases=doc["phases"], phase_peak_bytes=peaks,
        step_peak_bytes=step["step_peak_extra_bytes"],
        # Ties go to the later (inner) phase: the gather nests in the step.
        peak_phase=max(reversed(ran), key=lambda p: peaks[p]),
        param_bytes=rank0["param_bytes"], grad_data_bytes=rank0["grad_data_bytes"], loss=step["loss"],
        tree=tree, tree_dir=rank0["megatron_core_dir"], dp_size=doc["world"], model_desc=model_desc(doc["config"]),
        phase_desc=doc["phase_desc"], steps=1,
    )  # fmt: skip


def run_step_memory(trees, dps, raw: Path, timeout_s: float = WORKER_TIMEOUT_S, small: bool = False) -> list:
    """The memory worker (``STEP_WORKER``) on CPU gloo ranks for each DP size in ``dps``, each
    tree and overlap on and off (memory does not drift with load, so one after the other),
    through ``harness.launch.run_command`` (logs in ``raw/<run>/``); one
    ``step_memory_record`` per run.

    ``small``: the worker's ``bench_small`` config (a quick check; the bench's figures use
    ``bench``). Each run gets ``timeout_s`` seconds; its ranks print every thread's stack
    (to stderr) and exit 10 s before that (``--watchdog-s``), and run_command kills the
    whole process group at the deadline, so that no rank outlives a failed run.

    Raises:
        LaunchError: a run exited non-zero or ran out of time (its command and stderr tail).
    """
    records = []
    for dp, label, overlap in ((d, t, o) for d in dps for t in trees for o in ("on", "off")):
        run_dir = raw / f"{label}-step-memory-dp{dp}-overlap-{overlap}"
        argv, env = torchrun_command(STEP_WORKER, ["--out", str(run_dir / "result.json"), "--backend", "gloo",
                                                   "--config", "bench_small" if small else "bench",
                                                   "--steps", str(STEP_MEMORY_STEPS), "--overlap", overlap,
                                                   "--watchdog-s", str(max(timeout_s - 10, 1))],
                                     nproc=dp, tree=label, cpu=True, preload=CORE_PRELOAD, extra_env=QUIET)  # fmt: skip
        print(f"[bench] {label}: step memory, DP={dp}, overlap {overlap}", flush=True)
        run_command(argv, env, run_dir=run_dir, timeout_s=timeout_s,
                    what=f"{label} step memory DP={dp} overlap {overlap}")  # fmt: skip
        records.append(step_memory_record(json.loads((run_dir / "result.json").read_text()), label))
    return records


# ---------------------------------------------------------------- main
def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help=f"smoke-test sizes (for tests): {QUICK}")
    ap.add_argument("--out-dir", type=Path, default=REPO_ROOT / "build" / "bench")
    ap.add_argument("--publish", action="store_true", help="copy param_sync.png and param_sync.md to docs/bench/")
    args = ap.parse_args(argv)
    cfg = QUICK if args.quick else DEFAULTS
    t0 = time.perf_counter()
    out_dir: Path = args.out_dir
    raw = out_dir / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    records, timing = [], {}
    try:
        for dp in cfg["real_dp"]:
            print(f"[bench] real DP={dp}: {', '.join(TREES)}", flush=True)
            recs, tim = run_real(TREES, dp, cfg, raw)
            records += recs
            timing.update(tim)
        step = run_step_memory(TREES, cfg["step_memory"], raw)
    except (WorkerError, LaunchError, subprocess.TimeoutExpired) as exc:
        print(f"[bench] {exc}", file=sys.stderr)
        return 2
    records = merge(records, timing)
    runtime = time.perf_counter() - t0
    meta = dict(
        command=shlex.join([".venv/bin/python", "scripts/bench_param_sync.py", *argv]),
        date=datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        torch=version("torch"),
        cpus=os.cpu_count(),
        host=platform.machine(),
        trees=list(TREES),
        config=cfg,
        runtime_s=runtime,
        checks=checks(records),
    )
    result = {"meta": meta, "records": records, "timing": timing_table(timing), "step_memory": step}
    (out_dir / "param_sync.json").write_text(json.dumps(result, indent=1) + "\n")
    write_plot(out_dir / "param_sync.png", result)
    write_markdown(out_dir / "param_sync.md", result)
    if args.publish:
        docs = REPO_ROOT / "docs" / "bench"
        docs.mkdir(parents=True, exist_ok=True)
        for name in ("param_sync.png", "param_sync.md"):
            shutil.copy2(out_dir / name, docs / name)
    ok = not any(meta["checks"].values())
    print(f"[bench] {len(records)} records in {runtime:.0f} s -> {out_dir}; checks "
          + ("hold" if ok else f"FAIL: {json.dumps(meta['checks'])[:2000]}"), flush=True)  # fmt: skip
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
