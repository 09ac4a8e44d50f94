#!/usr/bin/env python3
"""Run one upstream test file many times on both trees, under CPU load, and count outcomes.

For a test that failed once and would not fail again (a flake): each round runs the file
(``tests/upstream_tests/upstream_runner.run``, torchrun + pytest on gloo ranks in the
Megatron-LM checkouts that scripts/setup.sh builds) on the pristine and on the patched
tree, alternating which goes first, while ``--load`` busy processes spin on the same cores.
Every run keeps its own pytest log and rank reports in ``--out-dir/<round>-<tree>/``.

    .venv/bin/python scripts/repeat_upstream_test.py --runs 30 --nproc 4 --load 2 \\
        --file tests/unit_tests/test_layer_wise_optimizer.py

Prints one line per run and, at the end, per tree: runs, runs with every test passed, and
per test that failed at least once its failure count. Writes the same to
``--out-dir/summary.json``. Exit 0 when every run of both trees passed every test that
it ran, 1 otherwise (the logs say which), 2 on a usage error or a missing checkout.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
import time
from collections import Counter
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from tests.upstream_tests import upstream_runner as ur  # noqa: E402

TREES = ("pristine", "patched")


def _spin(stop) -> None:
    """A busy loop until ``stop`` is set: one core's worth of CPU load."""
    x = 0
    while not stop.is_set():
        for _ in range(100_000):
            x = (x * 1103515245 + 12345) & 0xFFFFFFFF


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--file", default="tests/unit_tests/test_layer_wise_optimizer.py",
                    help="upstream test file (or file::test), relative to the checkout")
    ap.add_argument("--runs", type=int, default=30, help="runs per tree (default 30)")
    ap.add_argument("--nproc", type=int, default=4, help="gloo ranks (default 4)")
    ap.add_argument("--load", type=int, default=2, help="busy processes beside the runs (default 2)")
    ap.add_argument("--timeout-s", type=float, default=900, help="per run (default 900)")
    ap.add_argument("--out-dir", default=str(REPO_ROOT / "build" / "repeat_upstream_test"))
    args = ap.parse_args(argv)
    if args.runs < 1 or args.nproc < 1 or args.load < 0:
        ap.error("--runs and --nproc must be >= 1, --load >= 0")
    for tree in TREES:
        if not (ur.CHECKOUTS[tree] / args.file.split("::")[0]).is_file():
            print(f"{ur.CHECKOUTS[tree] / args.file}: missing; run scripts/setup.sh", file=sys.stderr)
            return 2
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stop = multiprocessing.Event()
    load = [multiprocessing.Process(target=_spin, args=(stop,), daemon=True) for _ in range(args.load)]
    for p in load:
        p.start()
    tally = {t: {"runs": 0, "clean": 0, "failures": Counter(), "wall_s": 0.0} for t in TREES}
    t0 = time.monotonic()
    try:
        for i in range(args.runs):
            for tree in (TREES if i % 2 == 0 else TREES[::-1]):
                run = ur.run(tree, args.nproc, [args.file], timeout_s=args.timeout_s,
                             out_dir=out / f"{i:02d}-{tree}", retry=False)
                failed = sorted(k for k, v in run.results.items() if v == "failed")
                clean = run.returncode in (0, 5) and not failed and bool(run.results)
                t = tally[tree]
                t["runs"] += 1
                t["clean"] += clean
                t["failures"].update(failed)
                t["wall_s"] += run.wall_s
                print(f"[repeat] run {i + 1}/{args.runs} {tree}: rc {run.returncode}, "
                      f"{Counter(run.results.values())}, {run.wall_s:.0f} s"
                      + (f", FAILED {failed} (log {run.log})" if failed else ""), flush=True)
    finally:
        stop.set()
        for p in load:
            p.join(timeout=5)
    summary = dict(
        command=" ".join([".venv/bin/python", "scripts/repeat_upstream_test.py", *(argv or sys.argv[1:])]),
        file=args.file, nproc=args.nproc, load_processes=args.load, wall_s=round(time.monotonic() - t0, 1),
        trees={t: dict(runs=v["runs"], clean_runs=v["clean"], failures=dict(v["failures"]),
                       mean_run_s=round(v["wall_s"] / max(1, v["runs"]), 1)) for t, v in tally.items()},
    )
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    for tree, v in summary["trees"].items():
        print(f"[repeat] {tree}: {v['clean_runs']}/{v['runs']} clean runs; failures {v['failures'] or 'none'}")
    return 0 if all(v["clean_runs"] == v["runs"] for v in summary["trees"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
