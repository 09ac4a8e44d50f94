"""Report of scripts/bench_param_sync.py: param_sync.md (tables, notes) and param_sync.png.

Input: the dict the script writes to build/bench/param_sync.json ({"meta", "records",
"timing", "step_memory"}; fields in the script's docstring). Nothing here measures; every
number comes from the records. The plot uses matplotlib's Agg canvas directly (no pyplot
global state), so it works headless. Units in the tables: MiB (2**20 bytes), ms.
"""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

#: Column names of the trees (harness.trees labels; the first in meta["trees"] is the pristine one).
SHORT = {"pristine-0.17.1": "pristine", "series-0.17.1": "series"}


def _legend(text: str) -> List[str]:
    """A table's legend paragraph, with the blank lines around it."""
    return ["", text, ""]


def _mib(b) -> str:
    return "n/a" if b is None else ("0" if b == 0 else f"{b / 2**20:.2f}")


def _change(d: int) -> str:
    """A step peak's drop ``d`` (bytes; negative: a rise) in words: in MiB, or in bytes where
    it is under 0.01 MiB (the allocator's few bytes of bookkeeping, which MiB would show as 0.00)."""
    if d == 0:
        return "unchanged"
    size = f"{_mib(abs(d))} MiB" if abs(d) >= 0.01 * 2**20 else f"{abs(d)} B"
    return f"{'lower' if d > 0 else 'higher'} by {size}"


def _ratio(s: Optional[dict]) -> str:
    if not s:
        return "n/a"
    return f"{s['ratio']:.2f} [{s['ci_lo']:.2f}, {s['ci_hi']:.2f}]"


def _find(records, **want) -> Optional[dict]:
    for r in records:
        if all(r.get(k) == v for k, v in want.items()):
            return r
    return None


def _trees(result) -> List[str]:
    return list(result["meta"]["trees"])


def _peers(result, r) -> List[Optional[dict]]:
    """The record of each tree for the same sync as ``r`` (model, path, DP size, rank)."""
    key = {k: r[k] for k in ("model", "path", "dp_size", "rank")}
    return [_find(result["records"], tree=t, **key) for t in _trees(result)]


# ---------------------------------------------------------------- markdown
def write_markdown(path: Path, result: dict) -> None:
    """Write param_sync.md: command, headline, tables, step memory, method, checks."""
    meta, records = result["meta"], result["records"]
    lines = _header(meta)
    lines += _headline(result)
    lines += _step_memory_section(result.get("step_memory") or [])
    lines += _real_table(result)
    lines += _timing_table(result)
    lines += _allocator_table(result)
    lines += ["![bytes, launches and time ratios](param_sync.png)", ""]
    lines += _method(meta)
    lines += ["## Checks", ""]
    for name, bad in meta["checks"].items():
        lines.append(f"- `{name}`: {'holds' if not bad else f'FAILS for {len(bad)} records'}")
    path.write_text("\n".join(lines).rstrip() + "\n")


def _header(meta) -> List[str]:
    return [
        "# Layer-wise param sync: memory, NCCL operations and time, pristine vs series",
        "",
        "Produced by (repo root):",
        "",
        "```bash",
        meta["command"],
        "```",
        "",
        f"{meta['date']}; torch {meta['torch']}; {meta['cpus']} CPU cores shared with other "
        f"jobs; gloo ranks; whole run {meta['runtime_s']:.0f} s; trees: "
        + ", ".join(f"`{t}`" for t in meta["trees"])
        + ". Raw data: `build/bench/param_sync.json` (not committed).",
        "",
        "Trees: `pristine-0.17.1` = megatron-core 0.17.1 as released; `series-0.17.1` = it with this series. Large DP sizes, real "
        "model shapes and the other releases: [real_shapes.md](real_shapes.md). Models: `gpt_equal` = a middle pipeline stage of a GPT, 16 "
        "identical layers, hidden 128 (every bucket's per-rank shares equal at DP 2/4/8); "
        "`gpt_unequal` = a whole GPT, 4 layers, hidden 256, embedding and untied output layer "
        "(shares differ). bf16 params, fp32 `grad_data`, Muon layer-wise optimizer.",
        "",
    ]


def _headline(result) -> List[str]:
    records, timing = result["records"], result["timing"]
    lines = ["## Headline", ""]
    step = result.get("step_memory") or []
    pristine, series = _trees(result)
    for s in step:
        if s["tree"] != series:
            continue
        pr = _find(step, tree=pristine, overlap=s["overlap"], dp_size=s["dp_size"])
        if not pr:
            continue
        d = pr["step_peak_bytes"] - s["step_peak_bytes"]
        where = "forward" if s["overlap"] else "optimizer gather"
        moved = (pr["phase_peak_bytes"][where] or 0) - (s["phase_peak_bytes"][where] or 0)
        lines.append(
            f"- **Step peak memory, DP {s['dp_size']}, {'--overlap-param-gather' if s['overlap'] else 'no overlap'}**: "
            f"pristine {_mib(pr['step_peak_bytes'])} MiB (in *{pr['peak_phase']}*), series "
            f"{_mib(s['step_peak_bytes'])} MiB (in *{s['peak_phase']}*): "
            f"{_change(d)}. "
            f"The param gather's transient ({where}) drops by {_mib(moved)} MiB"
            + ("; it set the pristine tree's step peak." if pr["peak_phase"] == where or
               (where == "optimizer gather" and pr["phase_peak_bytes"][where] == pr["step_peak_bytes"])
               else f"; it stays {_mib(pr['step_peak_bytes'] - (pr['phase_peak_bytes'][where] or 0))} MiB below the pristine tree's step peak, so the peak does not move.")
        )
    for tree in _trees(result):
        rs = [r for r in records if r["tree"] == tree and r["path"] != "control"]
        if not rs:
            continue
        nccl = max(r["nccl_model_temporary_bytes"] for r in rs)
        disp = max(r["temporary_bytes"] for r in rs)
        eq = [r for r in rs if r["shares_equal"]]
        lpb = sorted({r["ops_per_gather"] for r in eq})
        lines.append(
            f"- **{tree}**: per sync up to {_mib(disp)} MiB of tensors plus up to {_mib(nccl)} MiB "
            f"inside ProcessGroupNCCL ({len(rs)} records); NCCL ops per gather where shares are "
            f"equal: {', '.join(f'{x:g}' for x in lpb) or 'n/a'}."
        )
    for row in timing:
        lines.append(
            f"- {row['model']}, DP {row['dp_size']}, {row['path']}: series/pristine wall time "
            f"{_ratio(row.get('series_vs_pristine'))}" + (" (negative control)" if row["path"] == "control" else "")
        )
    return lines + [""]


def _step_memory_section(step) -> List[str]:
    if not step:
        return []
    phases = step[0]["phases"]
    lines = [
        "## Peak memory per phase of a training step",
        "",
        "Bytes alive above the step's start, peak within each phase (torch.profiler memory "
        "events: every allocation made during the step, every thread of rank 0); *step peak* "
        "is the largest, and *to peak* says how far each phase's peak stays below it. "
        f"Model: {step[0]['model_desc']}; "
        f"{_mib(step[0]['param_bytes'])} MiB of bf16 params, {_mib(step[0]['grad_data_bytes'])} MiB of fp32 grad_data.",
        "",
        "| DP | overlap | tree | " + " | ".join(phases) + " | step peak | peak phase |",
        "|--:|---|---|" + "--:|" * len(phases) + "--:|---|",
    ]
    for s in step:
        cells = []
        for p in phases:
            v = s["phase_peak_bytes"][p]
            cells.append("n/a" if v is None else f"{_mib(v)} ({'peak' if v == s['step_peak_bytes'] else '-' + _mib(s['step_peak_bytes'] - v)})")
        lines.append(
            f"| {s['dp_size']} | {'on' if s['overlap'] else 'off'} | {s['tree']} | " + " | ".join(cells)
            + f" | **{_mib(s['step_peak_bytes'])}** | {s['peak_phase']} |"
        )
    lines += ["", "MiB (to peak). Phases: " + "; ".join(f"*{k}*: {v}" for k, v in step[0]["phase_desc"].items()), ""]
    return lines


def _real_table(result) -> List[str]:
    trees = _trees(result)
    lines = [
        "## Real ranks: bytes, NCCL ops, wire bytes (rank 0, one sync)",
        "",
        "| model | DP | path | buckets | shares equal | "
        + " | ".join(f"{SHORT.get(t, t)} MiB (+NCCL)" for t in trees)
        + " | " + " | ".join(f"{SHORT.get(t, t)} NCCL ops (launches)" for t in trees)
        + " | wire MiB " + "/".join(SHORT.get(t, t) for t in trees) + " |",
        "|---|--:|---|--:|---|" + "--:|" * (2 * len(trees) + 1),
    ]  # fmt: skip
    for r in result["records"]:
        if r["tree"] != trees[0] or r["path"] == "control":
            continue
        peers = _peers(result, r)
        mem = [f"{_mib(p['temporary_bytes'])} (+{_mib(p['nccl_model_temporary_bytes'])})" if p else "n/a" for p in peers]
        la = [f"{p['collective_ops']} ({p['collective_launches']})" if p else "n/a" for p in peers]
        wire = "/".join(_mib(p["wire_bytes"]) if p else "n/a" for p in peers)
        lines.append(
            f"| {r['model']} | {r['dp_size']} | {r['path']} | {r['num_buckets']} | "
            f"{'yes' if r['shares_equal'] else 'no'} | " + " | ".join(mem) + " | "
            + " | ".join(la) + f" | {wire} |"
        )
    return lines + _legend(
        "*MiB*: tensor storages the sync's ATen ops allocate (dispatch level); *(+NCCL)*: what "
        "ProcessGroupNCCL allocates on top (the flat output of a list `all_gather` with equal "
        "slots). *NCCL ops (launches)*: NCCL operations per sync (one per all-gather, one per "
        "broadcast; a list `all_gather` with unequal slots issues one broadcast per rank) and "
        "NCCL group launches (the operations inside one coalesced group share one). *wire*: "
        "bytes this rank receives."
    )


def _timing_table(result) -> List[str]:
    pristine, _ = _trees(result)
    rows = result["timing"]
    if not rows:
        return []
    lines = [
        "## Time: interleaved ratios with 95 % bootstrap CIs",
        "",
        "| model | DP | path | pristine ms | series/pristine |",
        "|---|--:|---|--:|--:|",
    ]
    cfg = result["meta"]["config"]
    for row in rows:
        name = row["path"] + (" (negative control)" if row["path"] == "control" else "")
        lines.append(
            f"| {row['model']} | {row['dp_size']} | {name} | "
            f"{row['median_s'].get(pristine, float('nan')) * 1e3:.2f} | {_ratio(row.get('series_vs_pristine'))} |"
        )
    return lines + _legend(
        f"{cfg['rounds']} rounds; each round times one block of {cfg['block']} syncs per tree "
        "(the slowest rank's time per sync, median over the block), trees in order in even "
        "rounds and reversed in odd ones (ABBA); the ratio is the median over rounds of the "
        "per-round ratios, the CI the percentile bootstrap of that median. *control* is "
        "every grad buffer's `reset()` (`grad_data.zero_()`), whose code is identical in every tree (source hash "
        "checked): its ratio measures the method's own bias and noise."
    )


def _allocator_table(result) -> List[str]:
    trees = _trees(result)
    recs = [r for r in result["records"] if r["tree"] == trees[0] and r["path"] != "control"]
    if not recs:
        return []
    lines = [
        "## Allocator level (torch.profiler) next to the dispatch-level counter",
        "",
        "| model | DP | path | " + " | ".join(f"{SHORT.get(t, t)} dispatch / profiler / caller thread MiB" for t in trees) + " |",
        "|---|--:|---|" + "--:|" * len(trees),
    ]  # fmt: skip
    for r in recs:
        peers = _peers(result, r)
        cells = [f"{_mib(p['temporary_bytes'])} / {_mib(p['profiler_alloc_bytes'])} / {_mib(p['profiler_caller_thread_bytes'])}"
                 if p else "n/a" for p in peers]  # fmt: skip
        lines.append(f"| {r['model']} | {r['dp_size']} | {r['path']} | " + " | ".join(cells) + " |")
    return lines + _legend(
        "*profiler*: every C++ allocation during the sync on every thread "
        "(`torch.profiler`, `profile_memory=True`); on gloo that includes gloo's own buffers "
        "(its list and flat all-gathers stage through internal tensors), which NCCL does not "
        "have; *caller thread*: those made on the thread that ran the sync."
    )


def _method(meta) -> List[str]:
    return [
        "## Method",
        "",
        "Bytes, NCCL operations and group launches per sync on the rank shown, one sync after a warm-up: "
        "`harness/alloc_counter.py` (a `TorchDispatchMode` that sees every ATen op) and the CPU "
        "runtime's collective model (`harness/cpu_runtime/collectives.py`: every `c10d` all-gather and "
        "broadcast). NCCL's own allocations follow ProcessGroupNCCL's `allgather`: "
        "a list `all_gather` with equal slots allocates a flat `world_size x numel` output and "
        "copies out of it (one launch); with unequal slots it issues one broadcast per rank "
        "(no temporary); `all_gather_into_tensor` writes into its output (one launch, nothing "
        "allocated). *theory* (`harness/bench/theory.py`): pristine = every other rank's share "
        "plus the local flatten; the series = 0. The CPU runtime layer's device-mapping "
        "`TorchFunctionMode` is suspended during measured syncs (it would add microseconds per "
        "torch call that no GPU run pays).",
        "",
        "**Paths.** *async*: the forward pre-hook chain, `start_param_sync()` of the first "
        "bucket group then `finish_param_sync()` of every group (`--overlap-param-gather`). "
        "*forced*: `DistributedDataParallel.start_param_sync(force_sync=True)` (eval, "
        "checkpoint save). *optimizer*: `LayerWiseDistributedOptimizer.allgather_params()`, "
        "the synchronous gather at the end of `step()` without overlap.",
        "",
    ]


# ---------------------------------------------------------------- plot
def write_plot(path: Path, result: dict) -> None:
    """Three panels: (a) NCCL-model + dispatch temporaries vs DP (gpt_equal, async);
    (b) NCCL ops per sync vs DP (optimizer path, gpt_unequal);
    (c) series/pristine wall-time ratio with CIs, per DP and path, incl. the negative control."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    trees = _trees(result)
    records = result["records"]
    fig = Figure(figsize=(15, 4.6))
    FigureCanvasAgg(fig)
    ax1, ax2, ax3 = fig.subplots(1, 3)
    markers = dict(zip(trees, "osD^v"))

    def series(model, path, value):
        out = {}
        for t in trees:
            pts = sorted(
                (r["dp_size"], value(r)) for r in records
                if r["tree"] == t and r["model"] == model and r["path"] == path
                and r["rank"] == 0
            )  # fmt: skip
            out[t] = pts
        return out

    for t, pts in series("gpt_equal", "async", lambda r: (r["temporary_bytes"] + r["nccl_model_temporary_bytes"]) / 2**20).items():
        if pts:
            ax1.plot([p[0] for p in pts], [p[1] for p in pts], marker=markers[t], label=t)
    ax1.set_xscale("log", base=2)
    ax1.set_yscale("symlog", linthresh=0.1)
    ax1.set_ylim(bottom=0)
    ax1.set_xlabel("DP size")
    ax1.set_ylabel("MiB per sync (tensors + inside NCCL)")
    ax1.set_title("(a) temporaries, gpt_equal, async path")
    ax1.legend(fontsize=8)

    for t, pts in series("gpt_unequal", "optimizer", lambda r: r["collective_ops"]).items():
        if pts:
            ax2.plot([p[0] for p in pts], [p[1] for p in pts], marker=markers[t], label=t)
    ax2.set_xscale("log", base=2)
    ax2.set_yscale("log")
    ax2.set_xlabel("DP size")
    ax2.set_ylabel("NCCL ops per sync")
    ax2.set_title("(b) NCCL ops, gpt_unequal, optimizer path")
    ax2.legend(fontsize=8)

    rows = result["timing"]
    labels, x = [], 0
    for row in rows:
        s = row.get("series_vs_pristine")
        if s:
            ax3.errorbar([x], [s["ratio"]], yerr=[[s["ratio"] - s["ci_lo"]], [s["ci_hi"] - s["ratio"]]],
                         fmt=markers[trees[1]], color="C1", capsize=3,
                         label=trees[1] if x == 0 else None)  # fmt: skip
        labels.append(f"{row['model'].replace('gpt_', '')}\nDP{row['dp_size']} {row['path']}")
        x += 1
    ax3.axhline(1.0, color="grey", lw=0.8)
    ax3.set_xticks(range(len(labels)), labels, fontsize=6, rotation=60)
    ax3.set_ylabel("wall time series / pristine (95 % CI)")
    ax3.set_title("(c) interleaved time ratios (control = same code)")
    if rows:
        ax3.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
