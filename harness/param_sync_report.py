"""Report of scripts/bench_param_sync.py: param_sync.md (tables, notes) and param_sync.png.

Input: the merged records and meta of build/bench/param_sync.json (see the script's
docstring for the fields). Nothing here measures; every number comes from the records.
The plot uses matplotlib's Agg canvas directly (no pyplot global state), so it works
headless.
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Optional

PATHS = ("async", "forced", "optimizer")
KEY = ("path", "dp_size", "rank", "device", "bucket_size", "pg")


def _mib(b) -> str:
    return "n/a" if b is None else f"{b / 2**20:.2f}"


def _ms(s) -> str:
    return "n/a" if s is None else f"{s * 1e3:.2f}"


def _x(r) -> str:
    return "n/a" if r is None else f"{r:.2f}"


def _bucket(b) -> str:
    return "default" if b is None else f"{b:,}"


def pairs(records: List[dict], pg: Optional[str] = None) -> List[Dict[str, dict]]:
    """[{"upstream": rec, "patched": rec}, ...] in record order, for one pg ("real"/"fake")."""
    out: Dict[tuple, Dict[str, dict]] = {}
    for r in records:
        if pg is None or r["pg"] == pg:
            out.setdefault(tuple(r[k] for k in KEY), {})[r["tree"]] = r
    return [v for v in out.values() if "upstream" in v and "patched" in v]


def _time_ratio(r) -> str:
    if r.get("time_ratio") is None:
        return "n/a"
    return f"{r['time_ratio']:.2f} [{r['time_ratio_lo']:.2f}, {r['time_ratio_hi']:.2f}]"


def _find(records, **want) -> Optional[dict]:
    for r in records:
        if all(r.get(k) == v for k, v in want.items()):
            return r
    return None


# ---------------------------------------------------------------- markdown
def write_markdown(path: Path, meta: dict, records: List[dict]) -> None:
    """Write param_sync.md: command, method, summary, tables, profile, notes, checks."""
    lines = _header(meta)
    lines += _summary(meta, records)
    lines += _real_table(meta, records)
    lines += _fake_table(records)
    lines += ["![temporary bytes vs DP size and bucket size](param_sync.png)", ""]
    lines += _profile_section(records)
    lines += _notes(meta, records)
    lines += ["## Checks", ""]
    for name, bad in meta["checks"].items():
        lines.append(f"- `{name}`: {'holds' if not bad else f'FAILS for {len(bad)} records'}")
    if meta.get("skipped"):
        lines += ["", "Skipped: " + "; ".join(meta["skipped"])]
    path.write_text("\n".join(lines).rstrip() + "\n")


def _header(meta) -> List[str]:
    cfg = meta["config"]
    return [
        "# Layer-wise param sync: temporaries and time, upstream vs patched",
        "",
        "Produced by (repo root):",
        "",
        "```bash",
        meta["command"],
        "```",
        "",
        f"{meta['date']}; torch {meta['torch']}; {meta['cpus']} CPU cores shared with other "
        f"jobs; device `{meta['device']}`; whole run {meta['runtime_s']:.0f} s. Model: "
        f"megatron-core `GPTModel` (local layer spec), {meta['model']}: "
        f"{meta['param_bytes']:,} param bytes. Raw data: `build/bench/param_sync.json` (not committed).",
        "",
        "**Method.** Bytes are per sync on the rank shown, counted by "
        "`harness/alloc_counter.py`: a `TorchDispatchMode` that records every ATen op whose "
        "output storage is new (*allocs*), their bytes (*MiB*), and the most of those "
        "bytes alive at once (*peak*). Gloo's internal buffers are not tensors and are not "
        "counted; the CPU runtime's uneven `all_gather` allocates nothing, so the counts are "
        "megatron's own. The CPU runtime layer's device-mapping `TorchFunctionMode` is "
        "suspended during the measured syncs: it is needed to build the objects on CPU, and "
        "would add microseconds per torch call that no GPU run pays. *theory* is `harness/param_sync_theory.py`: upstream = every other "
        "rank's share plus the local flatten (a view when the rank owns one param), "
        "#3751 = the local flatten only, series = 0. Times are wall milliseconds per sync, "
        f"median [min, max] over {cfg['reps']} timed syncs after {cfg['warmup']} untimed "
        f"ones on real ranks (the slowest rank's time per sync), {cfg['fake_reps']} with the "
        "fake group; "
        "*ratio* = patched/upstream of the medians with [q1/q3, q3/q1] as the spread; "
        "*CPU ratio* = the same for process CPU time, which other jobs on the machine "
        "disturb less than wall time.",
        "",
        "**Paths.** *async*: the forward pre-hook chain, `start_param_sync()` of the first "
        "bucket group then `finish_param_sync()` of every group in forward order "
        "(`--overlap-param-gather`). *forced*: `DistributedDataParallel.start_param_sync("
        "force_sync=True)` (eval, checkpoint save). *optimizer*: "
        "`LayerWiseDistributedOptimizer.allgather_params()`, the synchronous gather at the "
        "end of `step()` without overlap.",
        "",
    ]


def _summary(meta, records) -> List[str]:
    patched = [r for r in records if r["tree"] == "patched"]
    upstream = [r for r in records if r["tree"] == "upstream"]
    dps = sorted({r["dp_size"] for r in records})
    lines = ["## Summary", ""]
    zero = all(r["temporary_bytes"] == 0 and r["alloc_calls"] == 0 for r in patched)
    lines.append(
        f"- **patched**: {'0 bytes and 0 allocator calls' if zero else 'NOT zero'} in the "
        f"layer-wise param sync, in all {len(patched)} records (paths {', '.join(PATHS)}; "
        f"DP {', '.join(map(str, dps))}; every rank and bucket size measured)."
    )
    exact = all(r["theory_match"] and r["peak_theory_match"] for r in upstream)
    worst = max((r["temporary_bytes"] for r in upstream), default=0)
    lines.append(
        f"- **upstream**: measured == theory {'exactly (0 % gap)' if exact else 'NOT everywhere'}"
        f" in all {len(upstream)} records, bytes and peak alike; up to {_mib(worst)} MiB per "
        f"sync, i.e. {worst / max(meta['param_bytes'], 1):.0%} of the model's param bytes."
    )
    for pair in pairs(records, "real"):
        u = pair["upstream"]
        if u["bucket_size"] is None and u["rank"] == 0:
            lines.append(
                f"- real DP {u['dp_size']}, {u['path']}: wall-time ratio {_time_ratio(u)}, "
                f"CPU ratio {_x(u.get('cpu_time_ratio'))}."
            )
    return lines + [""]


def _real_table(meta, records) -> List[str]:
    cuda = meta["device"] == "cuda"
    lines = [
        "## Real ranks (torchrun, " + ("NCCL" if cuda else "gloo on CPU") + "), rank 0",
        "",
        "| path | DP | bucket | upstream MiB | = theory | #3751 theory MiB | patched MiB "
        "| allocs up → patched | peak MiB up → patched | "
        + ("CUDA peak MiB up → patched | " if cuda else "")
        + "upstream ms | patched ms | ratio | CPU ratio |",
        "|---|--:|--:|--:|:-:|--:|--:|--:|--:|" + ("--:|" if cuda else "") + "--:|--:|--:|--:|",
    ]
    for pair in pairs(records, "real"):
        u, p = pair["upstream"], pair["patched"]
        cuda_col = (
            f"{_mib(u['cuda_peak_extra_bytes'])} → {_mib(p['cuda_peak_extra_bytes'])} | "
            if cuda
            else ""
        )
        lines.append(
            f"| {u['path']} | {u['dp_size']} | {_bucket(u['bucket_size'])} | "
            f"{_mib(u['temporary_bytes'])} | {'yes' if u['theory_match'] else 'NO'} | "
            f"{_mib(u['theory_3751_bytes'])} | {_mib(p['temporary_bytes'])} | "
            f"{u['alloc_calls']} → {p['alloc_calls']} | "
            f"{_mib(u['peak_extra_bytes'])} → {_mib(p['peak_extra_bytes'])} | {cuda_col}"
            f"{_ms(u['median_s'])} [{_ms(u['min_s'])}, {_ms(u['max_s'])}] | "
            f"{_ms(p['median_s'])} [{_ms(p['min_s'])}, {_ms(p['max_s'])}] | "
            f"{_time_ratio(u)} | {_x(u.get('cpu_time_ratio'))} |"
        )
    return lines + [""]


def _fake_table(records) -> List[str]:
    lines = [
        "## Scale (PyTorch fake process group: one process simulates one rank)",
        "",
        "No data moves (the all-gather only checks the slot sizes), so bytes and allocator "
        "calls are exact and times are the local work only (ms: median).",
        "",
        "| path | DP | rank | bucket | buckets | upstream MiB | = theory | #3751 theory MiB "
        "| patched MiB | allocs up → patched | upstream peak MiB | upstream ms | patched ms "
        "| ratio | CPU ratio |",
        "|---|--:|--:|--:|--:|--:|:-:|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for pair in pairs(records, "fake"):
        u, p = pair["upstream"], pair["patched"]
        lines.append(
            f"| {u['path']} | {u['dp_size']} | {u['rank']} | {_bucket(u['bucket_size'])} | "
            f"{u['num_buckets']} | {_mib(u['temporary_bytes'])} | "
            f"{'yes' if u['theory_match'] else 'NO'} | {_mib(u['theory_3751_bytes'])} | "
            f"{_mib(p['temporary_bytes'])} | {u['alloc_calls']} → {p['alloc_calls']} | "
            f"{_mib(u['peak_extra_bytes'])} | {_ms(u['median_s'])} | {_ms(p['median_s'])} | "
            f"{_time_ratio(u)} | {_x(u.get('cpu_time_ratio'))} |"
        )
    return lines + [""]


def _profile_section(records) -> List[str]:
    profiled = [r for r in records if r.get("profile")]
    cprofiled = [r for r in records if r.get("cprofile")]
    if not profiled and not cprofiled:
        return []
    lines = ["## Where the time goes", ""]
    for r in profiled:
        prof = r["profile"]
        lines += [
            f"**torch.profiler, {r['tree']}**, real DP {r['dp_size']}, {r['path']} path, rank "
            f"0, {_bucket(r['bucket_size'])} bucket: profiled sync {_ms(prof['sync_s'])} ms. "
            f"Zeroing every bucket's grad_data once ({_mib(prof['grad_data_bytes'])} MiB) "
            f"takes {_ms(prof['zero_grad_data_s'])} ms on its own.",
            "",
            "| op | calls/sync | self CPU ms/sync |",
            "|---|--:|--:|",
        ]
        lines += [f"| `{n}` | {c:g} | {_ms(s)} |" for n, c, s in prof["ops"]]
        lines.append("")
    ablated = [r for r in records if (r.get("profile") or {}).get("zeroing_ablation")]
    ablated += [r for r in records if r.get("zeroing_ablation")]
    if ablated:
        lines += [
            "**Ablation of the copy-out zeroing** (patched tree; normal syncs interleaved with "
            "syncs whose `grad_data.zero_()` is a no-op, in one process; median CPU ms per "
            "sync; upstream's median CPU ms from its own run for reference):",
            "",
            "| where | path | patched | patched without zeroing | upstream | share of the gap |",
            "|---|---|--:|--:|--:|--:|",
        ]
        for r in ablated:
            abl = r.get("zeroing_ablation") or r["profile"]["zeroing_ablation"]
            u = _find(records, tree="upstream", **{k: r[k] for k in KEY})
            up = u["cpu_median_s"] if u else None
            gap = None if up is None else abl["with_s"] - up
            share = f"{(abl['with_s'] - abl['without_s']) / gap:.0%}" if gap and gap > 0 else "n/a"
            lines.append(
                f"| {r['pg']} DP {r['dp_size']}, rank {r['rank']}, bucket "
                f"{_bucket(r['bucket_size'])} | {r['path']} | {_ms(abl['with_s'])} | "
                f"{_ms(abl['without_s'])} | {_ms(up)} | {share} |"
            )
        lines.append("")
    largest = max((r["dp_size"] for r in cprofiled), default=0)
    for r in (r for r in cprofiled if r["dp_size"] == largest):
        lines += [
            f"**cProfile, {r['tree']}**, fake DP {r['dp_size']}, rank {r['rank']}, "
            f"{r['path']} path, bucket {_bucket(r['bucket_size'])} ({r['num_buckets']} "
            f"buckets): CPU {_ms(r['cpu_median_s'])} ms per sync.",
            "",
            "| function | calls/sync | own ms/sync | cumulative ms/sync |",
            "|---|--:|--:|--:|",
        ]
        lines += [
            f"| `{f}` | {c:g} | {_ms(own)} | {_ms(cum)} |" for f, c, own, cum in r["cprofile"]
        ]
        lines.append("")
    return lines


def _notes(meta, records) -> List[str]:
    """Reading the numbers: growth, gaps vs theory, time. Numbers from the records."""
    lines = ["## Reading the numbers", ""]
    param_mib = _mib(meta["param_bytes"])
    lines.append(
        "- **Theory vs measured.** No gap: the counter sees exactly the tensors upstream "
        "creates (one `torch.empty` per other rank with a non-empty share, plus the "
        "`torch.cat` of the local flatten), and none of them depends on data. "
        "`torch.empty(0)` for ranks owning nothing in a bucket has no storage bytes and is "
        "not counted. A rank owning exactly one param of a bucket flattens it as a view, so "
        "its share is no temporary; that is why the DP 64/512 figures equal the whole model "
        f"({param_mib} MiB) although the rank owns part of it."
    )
    lines.append(
        "- **Growth with DP.** Per sync, upstream allocates every other rank's share, so the "
        f"total approaches all param bytes ({param_mib} MiB) as the local share shrinks "
        "with DP; the allocator calls grow with the number of ranks owning something in a "
        "bucket (up to min(DP, params per bucket) per bucket). #3751 keeps only the local "
        "flatten, which shrinks like 1/DP and is 0 once each rank owns at most one param "
        "per bucket; it left the optimizer path as upstream has it. The series is 0 on every "
        "path."
    )
    peaks = []
    for bucket in sorted(
        {r["bucket_size"] for r in records if r["pg"] == "fake"},
        key=lambda b: float("inf") if b is None else b,
    ):
        r = _find(records, tree="upstream", pg="fake", path="async", rank=0, bucket_size=bucket)
        if r:
            peaks.append(f"{_mib(r['peak_extra_bytes'])} MiB at bucket {_bucket(bucket)}")
    if peaks:
        lines.append(
            "- **Growth with bucket size.** The temporaries of one sync add up to about the "
            "model whatever the bucket size, but the peak alive grows with it: the async "
            "chain holds two bucket groups at once (finish_param_sync dispatches the next "
            "group before copying back the current one), the forced path one group, the "
            "optimizer path the whole model. Upstream async peak, fake DP 8+, rank 0: "
            + "; ".join(peaks)
            + "."
        )
    lines.append(_time_note(records))
    return lines + [""]


def _time_note(records) -> str:
    prof = {r["tree"]: r["profile"] for r in records if r.get("profile")}
    real = [p["upstream"] for p in pairs(records, "real") if p["upstream"]["time_ratio"]]
    above = [u for u in real if round(u["time_ratio"], 2) > 1.0]
    text = (
        "- **Time.** The sync's work differs in kind: upstream allocates the receive tensors "
        "and frees them after the copy-back (plus the `torch.cat` of the local params); the "
        "series allocates nothing but copies the local params into their grad_data slot and, "
        "after the copy-back, zeroes the bucket's whole grad_data (`aten::zero_`, shown as "
        "`aten::fill_`), because `main_grad` views it and backward accumulates there. "
    )
    if "patched" in prof:
        p = prof["patched"]
        text += (
            f"That zeroing is {_mib(p['grad_data_bytes'])} MiB of fp32 per sync here (2x the "
            f"bf16 param bytes), {_ms(p['zero_grad_data_s'])} ms of memory bandwidth on this "
            "machine (on a GPU's HBM, microseconds). "
        )
    if "upstream" in prof:
        cat = [o for o in prof["upstream"]["ops"] if o[0] == "aten::cat"]
        if cat:
            text += (
                f"Upstream's `aten::cat` ({_ms(cat[0][2])} ms) is slow for its size on CPU, "
                "consistent with page faults: it writes into freshly allocated memory, "
                "while the series writes into grad_data, which stays mapped (on a GPU the "
                "caching allocator hides that cost). "
            )
    if above:
        noisy = [u for u in above if u["time_ratio_lo"] <= 1.0]
        firm = [u for u in above if u["time_ratio_lo"] > 1.0]
        text += (
            f"On real ranks the wall-time ratio is above 1.00 in {len(above)} of {len(real)} cases"
        )
        if noisy:
            text += (
                f"; in {len(noisy)} of them the spread includes 1.00 ("
                + ", ".join(f"DP {u['dp_size']} {u['path']} {_time_ratio(u)}" for u in noisy)
                + "), i.e. within the noise of this shared machine (other jobs, and DP 4 "
                "ranks on 2 cores), where wall time is mostly the scheduling of the gloo ranks"
            )
        if firm:
            text += "; clearly above 1.00: " + ", ".join(
                f"DP {u['dp_size']} {u['path']} {_time_ratio(u)} (CPU ratio "
                f"{_x(u.get('cpu_time_ratio'))})"
                for u in firm
            )
        text += ". "
    opt = _find(records, tree="patched", pg="fake", path="optimizer", dp_size=512, rank=0)
    opt_small = [
        r
        for r in records
        if r["tree"] == "patched" and r["pg"] == "fake" and r["path"] == "optimizer"
        and r["dp_size"] == 512 and r["rank"] == 0 and r["bucket_size"] is not None
    ]  # fmt: skip
    if opt and opt_small:
        r = min(opt_small, key=lambda r: r["bucket_size"])
        text += (
            f"At large DP with small buckets the series' optimizer path costs more CPU than "
            f"upstream's (fake DP 512, {r['num_buckets']} buckets: CPU ratio "
            f"{_x(r.get('cpu_time_ratio'))}): it gathers bucket by bucket and splits each "
            "bucket's grad_data into DP slot views every time (`split_with_sizes` in the "
            "cProfile table), where upstream gathers the whole model once. "
        )
    text += (
        "What would remove the extra time: (1) zero only the received prefix of grad_data "
        "(`layerwise_recv_numel` elements of the param dtype, half the bytes with fp32 "
        "grads), the only part the gather writes; (2) on the optimizer path skip the "
        "copy-out zeroing, since `zero_grad_buffer()` zeroes grad_data again before the next "
        "backward (today it is zeroed twice per step); (3) cache each bucket's slot views, "
        "which depend only on the sharding and grad_data's storage, so that a sync costs "
        "O(params) rather than O(DP) views per bucket."
    )
    return text


# ---------------------------------------------------------------- plot
def write_plot(path: Path, records: List[dict], meta: dict) -> None:
    """Write param_sync.png: three panels, y axes symlog (linear below 10^4) so 0 shows.

    (a) temporary bytes per sync (rank 0, default bucket) vs DP size: upstream measured
        per path, upstream and #3751 theory, patched (max over paths);
    (b) allocator calls per sync (rank 0, async path) vs DP size, per bucket size;
    (c) upstream temporary bytes (solid) and peak live bytes (dashed) of the async path
        vs DDP bucket size, per fake DP size; patched is 0.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(19, 5.4))
    FigureCanvasAgg(fig)
    ax, cx, bx = fig.subplots(1, 3)
    _plot_dp(ax, records, meta)
    _plot_calls(cx, records)
    _plot_buckets(bx, records)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def _sizes(records) -> list:
    """Bucket sizes present, ascending, None (DDP default: one bucket) last."""
    return sorted(
        {r["bucket_size"] for r in records}, key=lambda b: float("inf") if b is None else b
    )


def _plot_dp(ax, records, meta) -> None:
    base = [r for r in records if r["rank"] == 0 and r["bucket_size"] is None]
    colors = {"async": "tab:blue", "forced": "tab:green", "optimizer": "tab:purple"}
    sizes = {"async": 11, "forced": 8, "optimizer": 5}
    for path_name in PATHS:
        up = sorted(
            (r for r in base if r["tree"] == "upstream" and r["path"] == path_name),
            key=lambda r: r["dp_size"],
        )
        if not up:
            continue
        xs = [r["dp_size"] for r in up]
        ax.plot(xs, [r["temporary_bytes"] for r in up], "o-", color=colors[path_name],
                ms=sizes[path_name], label=f"upstream {path_name} (measured)")  # fmt: skip
        ax.plot(xs, [r["theory_upstream_bytes"] for r in up], "x", color="black", ms=9,
                label="upstream theory" if path_name == "async" else None)  # fmt: skip
        if path_name == "async":
            ax.plot(xs, [r["theory_3751_bytes"] for r in up], "s--", color="tab:red",
                    mfc="none", label="#3751 theory (async, forced)")  # fmt: skip
    pat = [r for r in base if r["tree"] == "patched"]
    if pat:
        dps = sorted({r["dp_size"] for r in pat})
        worst = [max(r["temporary_bytes"] for r in pat if r["dp_size"] == d) for d in dps]
        ax.plot(
            dps, worst, "D-", color="tab:orange", lw=2.5, label="patched, every path (measured)"
        )
    ax.set_xscale("log", base=2)
    ax.set_yscale("symlog", linthresh=1e4)
    ax.set_ylim(bottom=-1e3, top=max(meta["param_bytes"], 1) * 4)
    ax.set_xlabel("DP size (2, 4: real gloo ranks; 8 and up: fake process group)")
    ax.set_ylabel("temporary bytes per sync, rank 0")
    ax.set_title("(a) Bytes allocated by one sync (default bucket)")
    ax.axhline(meta["param_bytes"], color="0.6", lw=0.8, ls=":")
    ax.text(ax.get_xlim()[0] * 1.05, meta["param_bytes"] * 1.2, "all param bytes (bf16)",
            color="0.4", fontsize=8)  # fmt: skip
    ax.legend(fontsize=8, loc="center right")
    ax.grid(True, which="major", alpha=0.3)


def _plot_calls(cx, records) -> None:
    rows = [r for r in records if r["rank"] == 0 and r["path"] == "async"]
    for i, bucket in enumerate(_sizes(rows)):
        up = sorted(
            (r for r in rows if r["tree"] == "upstream" and r["bucket_size"] == bucket),
            key=lambda r: r["dp_size"],
        )
        if up:
            label = "default (one bucket)" if bucket is None else f"bucket {bucket:,}"
            cx.plot([r["dp_size"] for r in up], [r["alloc_calls"] for r in up], "o-",
                    color=f"C{i}", label=f"upstream, {label}")  # fmt: skip
    pat = sorted((r for r in rows if r["tree"] == "patched"), key=lambda r: r["dp_size"])
    if pat:
        dps = sorted({r["dp_size"] for r in pat})
        worst = [max(r["alloc_calls"] for r in pat if r["dp_size"] == d) for d in dps]
        cx.plot(dps, worst, "D-", color="tab:orange", lw=2.5, label="patched, every bucket size")
    cx.set_xscale("log", base=2)
    cx.set_yscale("symlog", linthresh=1)
    cx.set_ylim(bottom=-0.3, top=max([r["alloc_calls"] for r in rows] + [1]) * 3)
    cx.set_xlabel("DP size")
    cx.set_ylabel("allocator calls per sync, rank 0, async path")
    cx.set_title("(b) Allocator calls grow with DP (up to one per param)")
    cx.legend(fontsize=8, loc="center right")
    cx.grid(True, which="major", alpha=0.3)


def _plot_buckets(bx, records) -> None:
    fake = [r for r in records if r["pg"] == "fake" and r["rank"] == 0 and r["path"] == "async"]
    sizes = _sizes(fake)
    if not sizes:
        bx.set_axis_off()
        return
    xs = list(range(len(sizes)))
    dps = sorted({r["dp_size"] for r in fake})
    for i, dp in enumerate(dps):
        row = {r["bucket_size"]: r for r in fake if r["dp_size"] == dp and r["tree"] == "upstream"}
        if len(row) != len(sizes):
            continue
        ms = 12 - 3 * i  # larger markers first, so that coinciding DP sizes stay visible
        bx.plot(xs, [row[b]["temporary_bytes"] for b in sizes], "o-", color=f"C{i}", ms=ms,
                mfc="none", label=f"upstream DP {dp}: temporary bytes")  # fmt: skip
        bx.plot(xs, [row[b]["peak_extra_bytes"] for b in sizes], "^--", color=f"C{i}", ms=ms,
                mfc="none", label=f"upstream DP {dp}: peak live bytes")  # fmt: skip
    worst = [
        max(r["temporary_bytes"] for r in fake if r["tree"] == "patched" and r["bucket_size"] == b)
        for b in sizes
    ]
    bx.plot(xs, worst, "D-", color="tab:orange", lw=2.5, label="patched, every DP (measured)")
    bx.set_xticks(xs, [f"{b:,}" if b is not None else "default\n(one bucket)" for b in sizes])
    bx.set_xlim(-0.3, len(xs) - 0.7)
    bx.set_yscale("symlog", linthresh=1e4)
    bx.set_ylim(bottom=-1e3, top=max([r["temporary_bytes"] for r in fake] + [1]) * 4)
    bx.set_xlabel("DDP bucket_size (elements)")
    bx.set_ylabel("bytes per sync, rank 0, async path")
    bx.set_title(f"(c) Upstream peak grows with the bucket size (DP {', '.join(map(str, dps))})")
    bx.legend(fontsize=7, loc="center right")
    bx.grid(True, which="major", alpha=0.3)
