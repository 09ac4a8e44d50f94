"""``memory.json`` of a run from its ranks' param-sync records, and the memory block of the verdict.

The ranks of a functional run write ``<run>/param_sync/rank<R>.json``
(``harness.param_sync_recorder``: per training step, what the layer-wise param sync
allocated in megatron tensors, what ProcessGroupNCCL would allocate for the same calls
according to the collective model, and the step peak). This module reduces them, per run, to
``<run>/memory.json`` next to ``metrics.json``; ``run_case`` puts both runs' files into
``comparison.json`` (key ``memory``), prints ``format_memory`` next to the verdict and
``plot`` draws the per-step series. Nothing here decides a verdict.

``memory.json`` (bytes; per step the maximum over ranks, since the rank with the most is
the one that runs out of memory)::

    {"schema": 1, "ranks": 2, "tree": ..., "what": {field: description},
     "steps": {"1": {"megatron_bytes": 0, "nccl_temporary_bytes": 0, "step_peak_bytes": 4452112}, ...},
     "between_steps": {"50": {"megatron_bytes": ..., "nccl_temporary_bytes": ...}},
     "kinds": {"dense": {"entry_calls", "megatron_bytes", ..., "wire_bytes", "group_size"}, ...}}

``kinds`` sums every step and every rank, per kind of param sync: "dense" (DDP bucket
groups on the DP group), "expert" (``expert_parallel_bucket_groups`` on the expert-DP group),
"optimizer" (``allgather_params``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, Mapping, Optional

from harness import param_sync_recorder as psr

MEMORY_FILE = "memory.json"
SCHEMA = 1
MIB = 1024 * 1024
STEP_FIELDS = ("megatron_bytes", "nccl_temporary_bytes", "step_peak_bytes")
WHAT = {
    "megatron_bytes": "tensors megatron allocates inside the layer-wise param sync per step "
    "(allocation counter around start_param_sync/finish_param_sync/allgather_params)",
    "nccl_temporary_bytes": "what ProcessGroupNCCL would allocate for the same collective calls "
    "(harness.cpu_runtime collective model)",
    "step_peak_bytes": psr.STEP_PEAK_DESC,
}


class MemoryRecordError(ValueError):
    """A run's param-sync records are missing, unreadable or inconsistent."""


def load_rank_records(record_dir: Path) -> Dict[int, dict]:
    """{rank: record} of every ``rank<R>.json`` in ``record_dir``.

    Raises:
        MemoryRecordError: no such folder or file, a file that is not JSON or of another
            schema, or ranks missing from 0..world-1.
    """
    record_dir = Path(record_dir)
    files = sorted(record_dir.glob("rank*.json")) if record_dir.is_dir() else []
    if not files:
        raise MemoryRecordError(f"no param-sync records (rank*.json) in {record_dir}")
    records = {}
    for path in files:
        try:
            record = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise MemoryRecordError(f"{path}: {e}") from e
        if record.get("schema") != psr.SCHEMA:
            raise MemoryRecordError(f"{path}: schema {record.get('schema')!r}, expected {psr.SCHEMA}")
        records[int(record["rank"])] = record
    world = max(int(r["world"]) for r in records.values())
    missing = sorted(set(range(world)) - set(records))
    if missing:
        raise MemoryRecordError(f"{record_dir}: no records of ranks {missing} (world {world})")
    return records


def _sync_bytes(slot: Mapping) -> Dict[str, int]:
    kinds = slot.get("param_sync", {}).values()
    return {
        "megatron_bytes": sum(int(k["megatron_bytes"]) for k in kinds),
        "nccl_temporary_bytes": sum(int(k["nccl_temporary_bytes"]) for k in kinds),
    }


def summarize_records(records: Mapping[int, dict]) -> dict:
    """The ``memory.json`` dict of one run from its ranks' records (see module docstring).

    Raises:
        MemoryRecordError: ranks that recorded different training steps.
    """
    step_sets = {rank: set(r["steps"]) for rank, r in records.items()}
    if len({frozenset(s) for s in step_sets.values()}) > 1:
        raise MemoryRecordError(f"ranks recorded different steps: { {k: len(v) for k, v in step_sets.items()} }")
    steps: Dict[str, Dict[str, int]] = {}
    between: Dict[str, Dict[str, int]] = {}
    kinds: Dict[str, Dict[str, int]] = {}
    for record in records.values():
        for section, out in (("steps", steps), ("between_steps", between)):
            for step, slot in record[section].items():
                row = _sync_bytes(slot)
                if section == "steps":
                    row["step_peak_bytes"] = int(slot.get("step_peak_bytes", 0))
                into = out.setdefault(step, {k: 0 for k in row})
                for k, v in row.items():
                    into[k] = max(into[k], v)
                for kind, totals in slot.get("param_sync", {}).items():
                    psr.add_totals(kinds.setdefault(kind, psr.empty_totals()), totals)
    order = lambda d: {k: d[k] for k in sorted(d, key=int)}  # noqa: E731
    any_record = next(iter(records.values()))
    return {
        "schema": SCHEMA,
        "ranks": len(records),
        "tree": any_record.get("tree", ""),
        "what": WHAT,
        "steps": order(steps),
        "between_steps": order(between),
        "kinds": {k: kinds[k] for k in psr.KINDS if k in kinds},
    }


def write_run_memory(record_dir: Path, out_dir: Path) -> dict:
    """Read ``record_dir``'s rank files, write ``out_dir/memory.json``; returns its dict.

    Raises:
        MemoryRecordError: see ``load_rank_records`` / ``summarize_records``.
    """
    summary = summarize_records(load_rank_records(record_dir))
    (Path(out_dir) / MEMORY_FILE).write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def load_run_memory(out_dir: Path) -> Optional[dict]:
    """``out_dir/memory.json``, or None when the run wrote none.

    Raises:
        MemoryRecordError: the file exists but is not a memory.json of this schema.
    """
    path = Path(out_dir) / MEMORY_FILE
    if not path.is_file():
        return None
    try:
        summary = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise MemoryRecordError(f"{path}: {e}") from e
    if summary.get("schema") != SCHEMA or "steps" not in summary:
        raise MemoryRecordError(f"{path}: not a memory.json of schema {SCHEMA}")
    return summary


def series(summary: Mapping, field: str) -> Dict[int, int]:
    """{step: bytes} of one of ``STEP_FIELDS`` over the training steps of a summary."""
    return {int(step): int(row[field]) for step, row in summary["steps"].items()}


def step_maxima(summary: Mapping) -> Dict[str, int]:
    """Per ``STEP_FIELDS`` field, its maximum over the training steps; plus the forced syncs
    between steps (eval, checkpoint saves) as ``between_megatron_bytes`` /
    ``between_nccl_temporary_bytes``."""
    rows = list(summary["steps"].values())
    between = list(summary.get("between_steps", {}).values())
    out = {f: max((int(r[f]) for r in rows), default=0) for f in STEP_FIELDS}
    for f in ("megatron_bytes", "nccl_temporary_bytes"):
        out[f"between_{f}"] = max((int(r[f]) for r in between), default=0)
    return out


def check_expected_syncs(summary: Mapping, expected: Mapping[str, Mapping[str, int]]) -> list:
    """Failure messages unless, for every kind in ``expected`` (a case's EXPECT_PARAM_SYNC),
    the run recorded collective calls of that kind with bytes on the wire, on a group of
    ``expected[kind]["group_size"]`` ranks. Empty when all hold."""
    failures = []
    for kind, want in expected.items():
        got = summary.get("kinds", {}).get(kind)
        if not got or not got["calls"] or not got["wire_bytes"]:
            failures.append(f"no {kind} param-sync gather was recorded ({psr.KIND_DESC.get(kind, kind)}): {got}")
        elif got["group_size"] != want["group_size"]:
            failures.append(f"{kind} param sync ran on a group of {got['group_size']} ranks, "
                            f"expected {want['group_size']}")
    return failures


#: The three counts of a param sync, defined once; printed under the memory block.
TERMS = (
    "c10d call: one torch.distributed function call",
    "NCCL operation: one ncclAllGather or ncclBroadcast that a call issues (a list all_gather "
    "of unequal sizes issues one broadcast per rank)",
    "group launch: the operations between one ncclGroupStart/ncclGroupEnd, launched together "
    "(a call outside a group is one launch)",
)


def format_counts(totals: Mapping) -> str:
    """"C c10d calls, O NCCL operations (Z zero-size) in L group launches, W MiB received"
    from a ``kinds`` entry of ``memory.json`` (see ``TERMS``)."""
    zero = f" ({totals['zero_size_ops']} zero-size)" if totals.get("zero_size_ops") else ""
    return (f"{totals['calls']} c10d calls, {totals['ops']} NCCL operations{zero} in "
            f"{totals['launches']} group launches, {totals['wire_bytes'] / MIB:.2f} MiB received")


def _mib(n: Optional[int]) -> str:
    return "-" if n is None else f"{n / MIB:.3f}"


def format_memory(memories: Mapping[str, Optional[Mapping]]) -> str:
    """The memory block printed next to the verdict: both runs, MiB, max per training step.

    Args:
        memories: {"pristine": summary or None, "series": summary or None}.
    """
    names = list(memories)
    maxima = {n: (step_maxima(m) if m else None) for n, m in memories.items()}
    first = next((m for m in memories.values() if m), None)
    if first is None:
        return "memory: no param-sync records"
    steps = [int(s) for s in first["steps"]]
    span = f"steps {min(steps)}..{max(steps)}" if steps else "no steps"
    rows = [
        ("param sync, megatron tensors", "megatron_bytes"),
        ("param sync, NCCL temporaries (model)", "nccl_temporary_bytes"),
        ("step peak above the step's start", "step_peak_bytes"),
    ]
    if any(m and (m["between_megatron_bytes"] or m["between_nccl_temporary_bytes"]) for m in maxima.values()):
        rows += [
            ("forced syncs between steps, megatron", "between_megatron_bytes"),
            ("forced syncs between steps, NCCL", "between_nccl_temporary_bytes"),
        ]
    width = max(len(label) for label, _ in rows)
    lines = [
        f"memory (MiB, max over {span}; per step the max over {first['ranks']} ranks):",
        "  " + " " * width + "".join(f"{n:>11}" for n in names),
    ]
    for label, key in rows:
        cells = "".join(f"{_mib(maxima[n][key] if maxima[n] else None):>11}" for n in names)
        lines.append(f"  {label:<{width}}{cells}")
    kinds = sorted({k for m in memories.values() if m for k in m.get("kinds", {})}, key=psr.KINDS.index)
    for kind in kinds:
        per = {n: (memories[n] or {}).get("kinds", {}).get(kind) for n in names}
        group = max((t["group_size"] for t in per.values() if t), default=0)
        lines.append(f"  {kind} param sync on a group of {group} ranks, totals over the run and all ranks:")
        for n, t in per.items():
            if t:
                lines.append(f"    {n + ':':<{max(map(len, names)) + 1}} {format_counts(t)}")
    lines.append("  (megatron: allocation counter in the param sync; NCCL: collective model; "
                 "step peak: allocation counter around train_step)")
    if kinds:
        lines += [f"  {term}" for term in TERMS]
    return "\n".join(lines)
