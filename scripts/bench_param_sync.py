"""Benchmark the layer-wise param sync, pristine megatron-core 0.17.1 vs the patch series.

Usage (from the repo root, after scripts/setup.sh):

    .venv/bin/python scripts/bench_param_sync.py            # default: 1-2 min on 2 CPU cores
    .venv/bin/python scripts/bench_param_sync.py --quick    # smoke run for tests (< 60 s)
    .venv/bin/python scripts/bench_param_sync.py --publish  # also copy PNG + MD to docs/bench/
    .venv/bin/python scripts/bench_param_sync.py --device cuda   # on a GPU machine

Both trees are measured in the same run: for each tree this script starts worker
subprocesses (harness/param_sync_bench.py) with that tree first on PYTHONPATH
(harness.trees.env_for_tree), then merges their records:

* real ranks: DP 2 and 4 under `python -m torch.distributed.run --standalone`, gloo on CPU
  (env MEGATRON_CPU_RUNTIME=1, OMP_NUM_THREADS=1), or NCCL with --device cuda (one GPU
  per rank; DP sizes above the GPU count are skipped and listed in meta.skipped);
* scale: DP 8, 64 and 512 in one process each with PyTorch's fake process group,
  simulating rank 0 and rank DP/2, for several DDP bucket sizes.

Outputs (in --out-dir, default build/bench; harness/param_sync_report.py writes the MD
and the PNG):

* param_sync.json: {"meta": {...}, "records": [...]}, one record per
  (tree, path, dp_size, device, bucket_size, rank, pg). Fields: tree ("upstream" or
  "patched"), path ("async", "forced", "optimizer"), dp_size, rank, device, pg ("real" or
  "fake"), backend, bucket_size (elements; null = DDP default, one bucket here),
  num_buckets; per sync: temporary_bytes, alloc_calls, peak_extra_bytes (bytes),
  cuda_peak_extra_bytes (torch.cuda.max_memory_allocated delta, bytes; --device cuda
  only); wall seconds per sync median_s, min_s, max_s, q1_s, q3_s (raw: times_s) and
  process CPU seconds cpu_median_s (raw: cpu_times_s); theory_upstream_bytes,
  theory_3751_bytes, theory_series_bytes, theory_upstream_peak_bytes (bytes),
  theory_match / peak_theory_match (measured == the tree's theory); and, on both records
  of a pair, the patched/upstream ratios temporary_bytes_ratio, alloc_calls_ratio,
  peak_extra_bytes_ratio, cuda_peak_extra_bytes_ratio, time_ratio (of the medians),
  time_ratio_lo / time_ratio_hi (q1/q3 and q3/q1: the spread), time_ratio_min (of the
  minima) and cpu_time_ratio. Real-rank records add all_ranks_* lists and params_synced;
  profiled ones add profile (torch.profiler) or cprofile (cProfile) tables.
* param_sync.png: (a) temporary bytes vs DP size, (b) allocator calls vs DP size,
  (c) upstream temporaries and peak vs DDP bucket size; symlog, so that 0 shows.
* param_sync.md: summary, tables, profiles and notes, with the exact command at the top.

Exit status: 0 when every patched record has 0 temporary bytes, every upstream record
equals the theory exactly and every real-rank sync left all params synced; 1 otherwise
(outputs are written either way); 2 when a worker fails.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from harness.param_sync_report import write_markdown, write_plot  # noqa: E402
from harness.trees import TREES, env_for_tree  # noqa: E402

WORKER = REPO_ROOT / "harness" / "param_sync_bench.py"
PATHS = ("async", "forced", "optimizer")
KEY = ("path", "dp_size", "rank", "device", "bucket_size", "pg")
WORKER_TIMEOUT_S = 600

DEFAULTS = dict(
    real_dp="2,4",
    fake_dp="8,64,512",
    fake_ranks="0,mid",
    real_bucket_sizes="default",
    fake_bucket_sizes="default,1000000,250000",
    reps=30,
    fake_reps=10,
    warmup=2,
    profile_reps=5,
    cprofile="8:0:default:async,512:0:250000:optimizer,512:0:250000:async",
)
QUICK = dict(
    real_dp="2",
    fake_dp="8,64",
    fake_ranks="0",
    real_bucket_sizes="default",
    fake_bucket_sizes="default,250000",
    reps=3,
    fake_reps=2,
    warmup=1,
    profile_reps=0,
    cprofile="",
)


class WorkerError(RuntimeError):
    """A worker subprocess failed; the message holds its command and output tail."""


def _run_worker(cmd, env, what: str) -> None:
    """Run one worker command; raise WorkerError with its output tail on failure."""
    proc = subprocess.run(
        cmd, env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=WORKER_TIMEOUT_S
    )
    if proc.returncode != 0:
        raise WorkerError(
            f"{what} failed (rc={proc.returncode}): {shlex.join(cmd)}\n"
            + (proc.stdout + proc.stderr)[-4000:]
        )


def _worker_env(tree: str, device: str) -> dict:
    env = env_for_tree(tree)
    env["OMP_NUM_THREADS"] = "1"
    if device == "cpu":
        env["MEGATRON_CPU_RUNTIME"] = "1"
    else:
        env.pop("MEGATRON_CPU_RUNTIME", None)
    env["PYTHONWARNINGS"] = "ignore"
    return env


def run_real(tree: str, dp: int, cfg: dict, device: str, raw: Path, profile: bool) -> list:
    """torchrun `dp` ranks of the worker on `tree`; returns rank 0's records."""
    out = raw / f"{tree}-real-dp{dp}.json"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc-per-node={dp}", str(WORKER),
        "--mode", "real", "--tree", tree, "--out", str(out), "--device", device,
        "--bucket-sizes", cfg["real_bucket_sizes"], "--reps", str(cfg["reps"]),
        "--warmup", str(cfg["warmup"]),
        "--profile-path", "async" if profile else "", "--profile-reps", str(cfg["profile_reps"]),
    ]  # fmt: skip
    _run_worker(cmd, _worker_env(tree, device), f"{tree} real DP={dp}")
    return json.loads(out.read_text())


def run_fake(tree: str, cfg: dict, device: str, raw: Path) -> list:
    """One process on `tree` simulating every fake DP size and rank."""
    out = raw / f"{tree}-fake.json"
    cmd = [
        sys.executable, str(WORKER),
        "--mode", "fake", "--tree", tree, "--out", str(out), "--device", device,
        "--dp-sizes", cfg["fake_dp"], "--ranks", cfg["fake_ranks"],
        "--bucket-sizes", cfg["fake_bucket_sizes"], "--reps", str(cfg["fake_reps"]),
        "--warmup", str(cfg["warmup"]), "--cprofile", cfg["cprofile"],
    ]  # fmt: skip
    _run_worker(cmd, _worker_env(tree, device), f"{tree} fake DP={cfg['fake_dp']}")
    return json.loads(out.read_text())


# ---------------------------------------------------------------- merging
def _quantile(xs, q: float) -> float:
    xs = sorted(xs)
    pos = q * (len(xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _ratio(num, den):
    if num is None or den is None:
        return None
    if den == 0:
        return None if num else 1.0
    return num / den


def merge(records: list) -> list:
    """Add time statistics, theory_match and patched/upstream ratios; sort the records."""
    for r in records:
        ts, cs = r["times_s"], r["cpu_times_s"]
        r.update(
            median_s=statistics.median(ts),
            min_s=min(ts),
            max_s=max(ts),
            q1_s=_quantile(ts, 0.25),
            q3_s=_quantile(ts, 0.75),
            cpu_median_s=statistics.median(cs),
        )
        r["peak_theory_match"] = r["peak_extra_bytes"] == (
            r["theory_upstream_peak_bytes"] if r["tree"] == "upstream" else 0
        )
        r["theory_match"] = (
            r["temporary_bytes"] == r["theory_upstream_bytes"]
            if r["tree"] == "upstream"
            else r["temporary_bytes"] == r["theory_series_bytes"]
        )
    by_key = {}
    for r in records:
        by_key.setdefault(tuple(r[k] for k in KEY), {})[r["tree"]] = r
    for pair in by_key.values():
        u, p = pair.get("upstream"), pair.get("patched")
        if u is None or p is None:
            continue
        ratios = {
            f"{f}_ratio": _ratio(p[f], u[f])
            for f in ("temporary_bytes", "alloc_calls", "peak_extra_bytes", "cuda_peak_extra_bytes")
        }
        ratios["time_ratio"] = _ratio(p["median_s"], u["median_s"])
        ratios["time_ratio_lo"] = _ratio(p["q1_s"], u["q3_s"])
        ratios["time_ratio_hi"] = _ratio(p["q3_s"], u["q1_s"])
        ratios["time_ratio_min"] = _ratio(p["min_s"], u["min_s"])
        ratios["cpu_time_ratio"] = _ratio(p["cpu_median_s"], u["cpu_median_s"])
        u.update(ratios)
        p.update(ratios)
    order = {t: i for i, t in enumerate(TREES)}
    paths = {p: i for i, p in enumerate(PATHS)}
    return sorted(
        records,
        key=lambda r: (
            r["pg"] != "real", r["dp_size"], r["rank"], -1 if r["bucket_size"] is None
            else r["bucket_size"], paths[r["path"]], order[r["tree"]],
        ),
    )  # fmt: skip


def checks(records: list) -> dict:
    """The claims of issue 5, each a list of failing record keys (empty = holds)."""

    def key(r):
        return {k: r[k] for k in ("tree",) + KEY}

    return {
        "patched_zero_temporary_bytes": [
            key(r) for r in records if r["tree"] == "patched" and r["temporary_bytes"] != 0
        ],
        "upstream_equals_theory": [
            key(r) for r in records if r["tree"] == "upstream" and not r["theory_match"]
        ],
        "peak_equals_theory": [key(r) for r in records if not r["peak_theory_match"]],
        "upstream_equals_theory_on_every_real_rank": [
            key(r)
            for r in records
            if r["tree"] == "upstream"
            and r["pg"] == "real"
            and r["all_ranks_temporary_bytes"] != r["all_ranks_theory_upstream_bytes"]
        ],
        "patched_zero_on_every_real_rank": [
            key(r)
            for r in records
            if r["tree"] == "patched" and r["pg"] == "real" and any(r["all_ranks_temporary_bytes"])
        ],
        "real_params_synced": [
            key(r) for r in records if r["pg"] == "real" and r["params_synced"] is not True
        ],
    }


# ---------------------------------------------------------------- main
def parse_args(argv):
    ap = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="smoke-test sizes (for tests)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--out-dir", type=Path, default=REPO_ROOT / "build" / "bench")
    ap.add_argument("--publish", action="store_true",
                    help="copy param_sync.png and param_sync.md to docs/bench/")  # fmt: skip
    for name, value in DEFAULTS.items():
        ap.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=None,
                        help=f"default {value!r} (--quick: {QUICK[name]!r})")  # fmt: skip
    args = ap.parse_args(argv)
    base = QUICK if args.quick else DEFAULTS
    cfg = {k: getattr(args, k) if getattr(args, k) is not None else v for k, v in base.items()}
    return args, cfg


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args, cfg = parse_args(argv)
    t0 = time.perf_counter()
    out_dir: Path = args.out_dir
    raw = out_dir / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    skipped = []
    real_dps = [int(x) for x in cfg["real_dp"].split(",") if x]
    if args.device == "cuda":
        import torch

        n_gpus = torch.cuda.device_count()
        skipped += [f"real DP={d}: needs {d} GPUs, found {n_gpus}" for d in real_dps if d > n_gpus]
        real_dps = [d for d in real_dps if d <= n_gpus]
    records = []
    try:
        for i, dp in enumerate(real_dps):
            # Alternate the order of the trees so that drifting background load on a
            # shared machine does not always favour the same tree.
            for tree in TREES if i % 2 == 0 else TREES[::-1]:
                print(f"[bench] {tree}: real DP={dp}", flush=True)
                profile = cfg["profile_reps"] > 0 and dp == real_dps[0]
                records += run_real(tree, dp, cfg, args.device, raw, profile)
        if cfg["fake_dp"]:
            for tree in TREES:
                print(f"[bench] {tree}: fake DP={cfg['fake_dp']}", flush=True)
                records += run_fake(tree, cfg, args.device, raw)
    except (WorkerError, subprocess.TimeoutExpired) as exc:
        print(f"[bench] {exc}", file=sys.stderr)
        return 2
    records = merge(records)
    runtime = time.perf_counter() - t0
    cmd_args = [a for a in argv]
    meta = dict(
        command=shlex.join([".venv/bin/python", "scripts/bench_param_sync.py", *cmd_args]),
        date=datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        torch=_torch_version(),
        cpus=os.cpu_count(),
        host=platform.machine(),
        device=args.device,
        config=cfg,
        runtime_s=runtime,
        model="4 layers, hidden 256, 4 heads, FFN 1024, vocab 1024, 128 positions, untied "
        "output layer; bf16 params, fp32 grad buffers; Muon layer-wise optimizer",
        param_bytes=records[0]["param_bytes"] if records else 0,
        skipped=skipped,
        checks=checks(records),
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "param_sync.json").write_text(
        json.dumps({"meta": meta, "records": records}, indent=1) + "\n"
    )
    write_plot(out_dir / "param_sync.png", records, meta)
    write_markdown(out_dir / "param_sync.md", meta, records)
    if args.publish:
        docs = REPO_ROOT / "docs" / "bench"
        docs.mkdir(parents=True, exist_ok=True)
        for name in ("param_sync.png", "param_sync.md"):
            shutil.copy2(out_dir / name, docs / name)
    ok = not any(meta["checks"].values())
    print(
        f"[bench] {len(records)} records in {runtime:.0f} s -> {out_dir}; checks "
        + ("hold" if ok else f"FAIL: {json.dumps(meta['checks'])[:2000]}"),
        flush=True,
    )
    return 0 if ok else 1


def _torch_version() -> str:
    try:
        from importlib.metadata import version

        return version("torch")
    except Exception:  # pragma: no cover - torch always installed in .venv
        return "unknown"


if __name__ == "__main__":
    sys.exit(main())
