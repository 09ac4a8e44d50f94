"""Where a param sync's time goes: torch.profiler per op, grouped into categories.

Run by ``harness/bench/sync_worker.py --profile N`` on real ranks (every rank runs the syncs,
rank 0's profile is kept), one tree per run; ``python -m harness.bench.sync_profile
A.json B.json ...`` then prints one markdown table per (model, DP, path): milliseconds per
sync per category and tree, rank 0.

Each sync is profiled on its own (``torch.profiler.profile`` around the sync only, after an
unprofiled ``reset()`` and a barrier), so the reset's ``zero_`` is not counted. Times are
the ops' self CPU time summed over every thread of the process: gloo runs collectives on
its own threads, so the ``collective`` row is the work of those threads plus the caller's
wait, and rows can add up to more than the wall time. Waiting on a transfer that gloo's
threads run outside any op shows up only as *wall - ops*.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
import time
from collections import defaultdict
from typing import Dict, List

#: Category of an op by name prefix/substring, first match wins (checked in order).
CATEGORIES = (
    ("collective", ("c10d::", "gloo:", "nccl:", "record_param_comms", "ProcessGroup")),
    ("zeroing", ("aten::zero_", "aten::fill_")),
    ("copy", ("aten::copy_", "aten::_foreach_copy", "aten::cat", "aten::_to_copy", "aten::to")),
    ("allocation", ("aten::empty", "aten::new_empty", "aten::empty_like", "aten::empty_strided")),
    ("views", ("aten::view", "aten::narrow", "aten::slice", "aten::split", "aten::as_strided",
               "aten::flatten", "aten::reshape", "aten::_unsafe_view", "aten::detach", "aten::alias")),
)


def category(op: str) -> str:
    """The CATEGORIES label of op name ``op``; "other" when none matches."""
    for label, keys in CATEGORIES:
        if any(op.startswith(k) or k in op for k in keys):
            return label
    return "other"


def profile_sync(run, reset, barrier, n: int, sync_device=lambda: None) -> dict:
    """Profile ``n`` calls of ``run`` (each after ``reset()`` and ``barrier()``, unprofiled).

    Returns:
        ``{"n", "wall_ms" (median of the n syncs), "ops": {name: {"calls", "self_ms"}},
        "categories": {label: self_ms}}``, times per sync (divided by n), milliseconds.
    """
    from torch.profiler import ProfilerActivity, profile

    ops: Dict[str, Dict[str, float]] = defaultdict(lambda: {"calls": 0, "self_ms": 0.0})
    walls: List[float] = []
    for _ in range(n):
        reset()
        sync_device()
        barrier()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            t0 = time.perf_counter()
            run()
            sync_device()
            walls.append((time.perf_counter() - t0) * 1e3)
        for event in prof.key_averages():
            ops[event.key]["calls"] += event.count / n
            ops[event.key]["self_ms"] += event.self_cpu_time_total / 1e3 / n
    cats: Dict[str, float] = defaultdict(float)
    for name, row in ops.items():
        cats[category(name)] += row["self_ms"]
    walls.sort()
    return {"n": n, "wall_ms": walls[len(walls) // 2], "ops": dict(ops), "categories": dict(cats)}


def table(records: List[dict]) -> str:
    """Markdown: per (model, dp_size, path), one row per category, one column per tree."""
    groups: Dict[tuple, Dict[str, dict]] = defaultdict(dict)
    for rec in records:
        groups[(rec["model"], rec["dp_size"], rec["path"])][rec["tree"]] = rec["profile"]
    labels = [c for c, _ in CATEGORIES] + ["other"]
    out = []
    for (model, dp, path), by_tree in sorted(groups.items()):
        trees = list(by_tree)
        ops_ms = {t: sum(by_tree[t]["categories"].values()) for t in trees}
        out.append(f"\n**{model}, DP {dp}, {path}** (ms per sync, rank 0, self CPU time of all threads)\n")
        out.append("| category | " + " | ".join(trees) + " |")
        out.append("|---|" + "--:|" * len(trees))
        for label in labels:
            out.append(f"| {label} | " + " | ".join(f"{by_tree[t]['categories'].get(label, 0.0):.2f}" for t in trees) + " |")
        out.append("| **ops, all categories** | " + " | ".join(f"{ops_ms[t]:.2f}" for t in trees) + " |")
        out.append("| wall (median) | " + " | ".join(f"{by_tree[t]['wall_ms']:.2f}" for t in trees) + " |")
        out.append("| wall - ops: waiting on the transfer | " + " | ".join(
            f"{by_tree[t]['wall_ms'] - ops_ms[t]:.2f}" for t in trees) + " |")
        tops = []
        for t in trees:
            ops = sorted(by_tree[t]["ops"].items(), key=lambda kv: -kv[1]["self_ms"])[:4]
            tops.append(f"{t}: " + ", ".join(f"`{k}` {v['self_ms']:.2f} ms x{v['calls']:.0f}" for k, v in ops))
        out.append("\nTop ops: " + "; ".join(tops))
    return "\n".join(out)


def main(argv=None) -> int:
    """``python -m harness.bench.sync_profile FILE.json ...``: print the comparison tables."""
    files = list(sys.argv[1:] if argv is None else argv)
    if not files:
        print("usage: python -m harness.bench.sync_profile PROFILE.json [PROFILE.json ...]", file=sys.stderr)
        return 2
    records = [rec for f in files for rec in json.loads(Path(f).read_text())]
    print(table(records))
    return 0


if __name__ == "__main__":
    sys.exit(main())
