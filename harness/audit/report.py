"""Tables, JSON and the plot of the real-shape audit (scripts/audit_param_sync.py).

Input: the cell records of ``harness/audit/worker.py`` (one per tree x model
x DP, rank ``dp_rank``). Output:

* ``slim(record)``: the published form of a record: bucket summaries (numel, params,
  largest param, non-empty shares, largest share, equal or not) instead of per-rank share
  lists, errors without tracebacks;
* ``write_markdown``: one table per model (every DP and tree), then the memory
  comparison of 0.18.2's layout path (persistent padding) with the legacy trees'
  transients;
* ``write_plot``: per model, param-sync memory per rank and NCCL group launches per step
  against DP, one line per tree;
* ``forced_table``: the forced sync's peak against megatron's own estimate of the step's
  peak (``theoretical_memory`` of each record);
* ``flags_text``: the flag path's stdout (legend, table, the series' claims per path).

Units: bytes in the records; GiB (2^30 bytes) in tables and plot; counts per rank and step
(async and optimizer path) or per sync (forced).
"""

from __future__ import annotations

import shlex
import statistics
import textwrap
from collections import Counter
from pathlib import Path
from typing import Dict, Iterable, List, Optional

from harness.audit import grid

GIB = float(1 << 30)
#: Short names of the collective model's forms (harness/cpu_runtime/collectives.py FORM_*).
FORM_NAMES = {
    "all_gather/unequal": "list≠",
    "all_gather/equal": "list=",
    "all_gather_into_tensor": "into",
    "broadcast": "bcast",
}
PATHS = ("async", "forced", "optimizer")
#: Where ``--publish`` copies the outputs, and the audit's hand-written prose
#: (real_shapes_findings.md: the reading of the tables, method, column legend and notes).
DOCS = Path(__file__).resolve().parents[2] / "docs" / "bench"
TEXT_FILE = DOCS / "real_shapes_findings.md"


def load_texts(path: Path = TEXT_FILE) -> Dict[str, str]:
    """{heading: text} of ``path``'s "## KEY" sections (the comment before the first heading
    left out): ``findings`` as written (Markdown); every other one a paragraph, its lines
    stripped and joined by one space."""
    sections: Dict[str, List[str]] = {}
    key = None
    for line in path.read_text().splitlines():
        if line.startswith("## "):
            key = line[3:].strip()
            sections[key] = []
        elif key is not None:
            sections[key].append(line)
    return {k: "\n".join(v).strip() if k == "findings" else " ".join(ln.strip() for ln in v if ln.strip())
            for k, v in sections.items()}  # fmt: skip


TEXTS = load_texts()


def gib(nbytes: Optional[float]) -> str:
    """Bytes as GiB with 2 decimals ('0' for exactly 0, '-' for None)."""
    if nbytes is None:
        return "-"
    return "0" if nbytes == 0 else f"{nbytes / GIB:.2f}"


def slim(record: dict) -> dict:
    """The published form of a worker record (see the module docstring); an empty
    ``megatron_layout_log`` (the legacy trees') is left out."""
    out = {k: v for k, v in record.items() if k not in ("buckets", "paths", "traceback")
           and (k != "megatron_layout_log" or v)}  # fmt: skip
    if "buckets" in record:
        out["buckets"] = []
        for b in record["buckets"]:
            out["buckets"].append({k: b[k] for k in ("expert", "layerwise", "numel", "param_numel", "params",
                                                     "max_param_numel")})  # fmt: skip
            shares = b.get("shares")
            if shares is not None:  # the per-rank list, summed up
                out["buckets"][-1].update(ranks=len(shares), nonempty_shares=sum(1 for x in shares if x),
                                          max_share=max(shares), shares_equal=len(set(shares)) == 1)  # fmt: skip
    out["paths"] = {p: {k: v for k, v in r.items() if k != "traceback"} for p, r in record.get("paths", {}).items()}
    return out


def forms_text(path_rec: dict) -> str:
    """'list≠ 98' or 'into 26, list≠ 16' (calls per form, most first)."""
    forms = Counter(path_rec.get("forms", {}))
    return ", ".join(f"{FORM_NAMES.get(f, f)} {n}" for f, n in forms.most_common()) or "none"


def _spread(values: List[int]) -> str:
    if not values:
        return "-"
    return f"{min(values)}/{int(statistics.median(values))}/{max(values)}"


def shares_text(record: dict) -> str:
    """Non-empty shares per layer-wise bucket, min/median/max, dense and expert apart,
    e.g. 'dense 1/1/3 of 64; expert 8/8/8 of 8'."""
    parts = []
    for expert, name in ((False, "dense"), (True, "expert")):
        bs = [b for b in record.get("buckets", []) if b["expert"] == expert and b.get("layerwise") and "ranks" in b]
        if bs:
            parts.append(f"{name} {_spread([b['nonempty_shares'] for b in bs])} of {bs[0]['ranks']}")
    return "; ".join(parts) or "-"


def buckets_text(record: dict) -> str:
    bs = record.get("buckets", [])
    dense = sum(1 for b in bs if not b["expert"])
    expert = len(bs) - dense
    return f"{dense}+{expert}" if expert else str(dense)


def nccl_peak(path_rec: dict) -> Optional[int]:
    """NCCL's peak temporaries of a path: the collective model's stand-ins as they lived
    (``nccl_peak_bytes``); None when the records list NCCL temporaries that no stand-in
    showed (the peak is then unknown)."""
    if path_rec.get("nccl_temporary_bytes", 0) and not path_rec.get("nccl_peak_bytes"):
        return None
    return path_rec.get("nccl_peak_bytes", 0)


def ops_text(path_rec: dict) -> str:
    """'784 (629) / 98': NCCL ops (zero-size ones) / group launches."""
    return f"{path_rec['ops']} ({path_rec['zero_size_ops']}) / {path_rec['launches']}"


def error_line(rec: dict) -> str:
    """First line of a record's error, safe inside a table."""
    return rec["error"].split("\n")[0][:160].replace("|", "/")


MIB = float(1 << 20)


def theory_bytes(record: dict) -> Optional[float]:
    """megatron's estimate of the step's peak memory per rank (``theoretical_memory``: the
    tree's ``megatron.training.theoretical_memory_usage.report_theoretical_memory``, weights
    and optimizer state plus activations), bytes; None where the record has none."""
    t = record.get("theoretical_memory") or {}
    return None if "total_mb" not in t else t["total_mb"] * MIB


def theory_text(record: dict) -> str:
    """'91.53 (67.31 + 24.23)': megatron's step estimate, GiB (weights and optimizer +
    activations); '-' where there is none."""
    t = record.get("theoretical_memory") or {}
    if "total_mb" not in t:
        return "-"
    return f"{gib(t['total_mb'] * MIB)} ({gib(t['weight_and_optimizer_mb'] * MIB)} + {gib(t['activation_mb'] * MIB)})"


def forced_against_step(record: dict) -> str:
    """'0.53 / 91.53 (0.6%)': the forced sync's peak temporaries (megatron + NCCL) and
    megatron's estimate of the step's peak, GiB, and the first as a share of the second."""
    peak, step = transient_peak(record, "forced"), theory_bytes(record)
    if peak is None:
        forced = record.get("paths", {}).get("forced")
        return "crash" if forced and "error" in forced else "-"
    share = f" ({100 * peak / step:.1f}%)" if step else ""
    return f"{gib(peak)} / {gib(step)}{share}"


def cell_cells(record: dict) -> List[str]:
    """The table cells of one record after DP and tree (see ``TABLE_HEADER``); a crashed
    path shows "crash" (``crash_notes`` lists the messages)."""
    if "error" in record:
        return ["crash"] + [""] * (len(TABLE_HEADER) - 3)
    paths = record.get("paths", {})
    a, o = paths.get("async", {}), paths.get("optimizer", {})

    def col(rec, fn):
        if not rec:
            return "-"
        return "crash" if "error" in rec else fn(rec)

    return [
        buckets_text(record),
        col(a, forms_text),
        shares_text(record),
        f"{col(a, lambda r: gib(r['megatron_peak_bytes']))} / {col(o, lambda r: gib(r['megatron_peak_bytes']))}",
        f"{col(a, lambda r: gib(nccl_peak(r)))} / {col(o, lambda r: gib(nccl_peak(r)))}",
        col(a, ops_text),
        col(o, ops_text),
        col(a, lambda r: gib(r["wire_bytes"])),
        f"{col(a, lambda r: gib(r['zeroed_grad_bytes']))} / {col(o, lambda r: gib(r['zeroed_grad_bytes']))}",
        f"{record.get('padding_elements', 0):,} ({gib(record.get('padding_bytes', 0))})",
        forced_against_step(record),
    ]


TABLE_HEADER = [
    "DP (exp. DP)", "tree", "buckets", "gather forms (async)", "non-empty shares / bucket (min/med/max)",
    "megatron temp. GiB: async peak / optimizer", "NCCL temp. GiB: async / optimizer",
    "ops (0-size) / launches: async", "ops (0-size) / launches: optimizer", "wire GiB recv.",
    "zeroed GiB: async / optimizer", "padding elems (GiB)", "forced sync peak / step estimate GiB",
]  # fmt: skip


def _dp_text(r: dict) -> str:
    edp = r.get("expert_dp")
    return f"{r['dp']} ({edp})" if r.get("ep", 1) > 1 and edp is not None else str(r["dp"])


def _ordered(records: Iterable[dict], trees: List[str]) -> List[dict]:
    order = {t: i for i, t in enumerate(trees)}
    return sorted(records, key=lambda r: (r["dp"], order.get(r["tree"], 99)))


def md_table(head: List[str], rows: Iterable[List[str]]) -> List[str]:
    """Markdown table lines: the header, its rule, one line per row of cells."""
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + ["| " + " | ".join(r) + " |" for r in rows]


def model_table(records: List[dict], trees: List[str]) -> str:
    """The markdown table of one model's records, then one line per crash."""
    records = _ordered(records, trees)
    notes = crash_notes(records)
    lines = md_table(TABLE_HEADER, ([_dp_text(r), r["tree"]] + cell_cells(r) for r in records))
    return "\n".join(lines + ([""] + notes if notes else []))


def crash_notes(records: List[dict]) -> List[str]:
    """'- crash: DP 8, pristine-0.17.1, async, forced: TypeError: ...' per distinct message."""
    seen: Dict[tuple, List[str]] = {}
    for r in records:
        errs = [("cell", r)] if "error" in r else [(p, v) for p, v in r.get("paths", {}).items() if "error" in v]
        for path, e in errs:
            seen.setdefault((r["dp"], r["tree"], error_line(e)), []).append(path)
    return [f"- crash: DP {dp}, `{tree}`, {', '.join(paths)}: `{msg}`" for (dp, tree, msg), paths in seen.items()]


def transient_peak(record: dict, path: str) -> Optional[int]:
    """megatron + NCCL peak temporaries of ``path`` (bytes), None if it crashed."""
    rec = record.get("paths", {}).get(path)
    if not rec or "error" in rec or nccl_peak(rec) is None:
        return None
    return rec["megatron_peak_bytes"] + nccl_peak(rec)


def memory_table(cells: List[dict], layout_tree: str, legacy_trees: List[str]) -> str:
    """Markdown: per model and DP, the persistent padding of the layout tree against each legacy
    tree's transient peaks (async path / optimizer path), GiB, and padding minus peak
    (negative: the layout path needs less memory than that tree; '-' where a peak is unknown,
    'crash' where the legacy cell crashed)."""
    by = {(c["model"], c["dp"], c["tree"]): c for c in cells}
    head = ["model", "DP", "params GiB/rank", f"{layout_tree} padding GiB (persistent)"] + [
        f"{t} peak GiB: async / optimizer" for t in legacy_trees] + [
        f"padding − {t} peak GiB: async / optimizer" for t in legacy_trees]  # fmt: skip
    rows = []
    for (model, dp, tree), r in sorted(by.items()):
        if tree != layout_tree or "error" in r:
            continue
        pad = r.get("padding_bytes")
        row, deltas = [model, str(dp), gib(r.get("param_bytes")), gib(pad)], []
        for t in legacy_trees:
            other = by.get((model, dp, t))
            if other is None or "error" in other:
                row.append("crash")
                deltas.append("crash")
                continue
            peaks = [transient_peak(other, p) for p in ("async", "optimizer")]
            row.append(" / ".join(gib(x) for x in peaks))
            deltas.append(" / ".join("-" if pad is None or x is None else f"{(pad - x) / GIB:+.2f}" for x in peaks))
        rows.append(row + deltas)
    return "\n".join(md_table(head, rows))


def _estimates_text(records: List[dict]) -> str:
    """megatron's step estimate (``theory_text``) of ``records``, once if they agree, else per
    release ("272.98 (264.61 + 8.38) on 0.17.1; 61.89 (53.51 + 8.38) on 0.18.2, 0.19.2")."""
    said: Dict[str, List[str]] = {}
    for r in records:
        text = theory_text(r)
        if text != "-":
            rel = grid.RELEASE_OF_TREE.get(r["tree"], r["tree"])
            said.setdefault(text, [])
            if rel not in said[text]:
                said[text].append(rel)
    if len(said) <= 1:
        return next(iter(said), "-")
    return "; ".join(f"{text} on {', '.join(rels)}" for text, rels in said.items())


def forced_table(cells: List[dict], trees: List[str]) -> str:
    """Markdown: per model and DP, megatron's estimate of the step's peak (``theory_text``)
    and each tree's forced-sync peak against it (``forced_against_step``)."""
    by = {(c["model"], c["dp"], c["tree"]): c for c in cells}
    keys = sorted({(c["model"], c["dp"]) for c in cells}, key=lambda k: (list(dict.fromkeys(
        c["model"] for c in cells)).index(k[0]), k[1]))  # fmt: skip
    head = ["model", "DP", "megatron's step estimate GiB (weights + optimizer, activations)"] + [
        f"{t}: forced peak / estimate GiB" for t in trees]  # fmt: skip
    rows = []
    for model, dp in keys:
        recs = [by.get((model, dp, t)) for t in trees]
        rows.append([model, str(dp), _estimates_text([r for r in recs if r])] + [
            forced_against_step(r) if r else "-" for r in recs])  # fmt: skip
    return "\n".join(md_table(head, rows))


def write_markdown(data: dict, path: Path, plot_name: str = "real_shapes.png") -> None:
    """docs/bench/real_shapes.md from the published JSON ``data`` ({"meta", "cells"}) and
    ``TEXTS``; ``scripts/audit_param_sync.py`` calls it, and so can anyone with the JSON:
    the Markdown needs no new audit run. A flag run's (``meta["flags"]``) leaves out
    the findings and the flags of the built-in models."""
    meta, cells = data["meta"], data["cells"]
    trees = list(meta["trees"])
    layout = [t for t, m in meta["trees"].items() if m.get("layout")]
    legacy = [t for t in trees if t not in layout]
    out = [
        "# The layer-wise param sync on real shapes",
        "",
        "Generated by `scripts/audit_param_sync.py` (do not edit by hand):",
        "",
        "```",
        meta["command"],
        "```",
        "",
        f"{meta['date']}, torch {meta['torch']}, {meta['wall_s']:.0f} s wall on {meta['cpus']} CPUs.",
        "",
        meta["method"],
        "",
        "Trees:",
        "",
    ]
    out += [f"- `{t}`: {m['title']} (`{m['dir']}`)" for t, m in meta["trees"].items()]
    out += ["", "Columns: " + meta["columns"], ""]
    if "flags" not in meta:  # the reading of the built-in models' tables; not of a flag run's
        out += ["## What the tables show, by release", "", TEXTS["findings"], ""]
    for label, spec in meta["models"].items():
        recs = [c for c in cells if c["model"] == label]
        if not recs:
            continue
        out += [f"## {spec['title']}", "", spec["summary"], ""]
        if spec.get("notes"):
            out += [spec["notes"], ""]
        out += [model_table(recs, trees), ""]
    out += reproduce_section(meta)
    if any(theory_bytes(c) is not None for c in cells):
        forced_trees = [t for t in trees if any("forced" in c.get("paths", {}) for c in cells if c["tree"] == t)]
        out += ["## Forced syncs against the step's peak", "", TEXTS["forced_note"], ""]
        if meta.get("theory_added"):
            out += [meta["theory_added"], ""]
        out += [forced_table(cells, forced_trees), ""]
    if layout:
        out += ["## Memory: the layout path's padding against the legacy transients", "", meta["memory_note"], ""]
        out += [memory_table(cells, layout[0], legacy), ""]
    out += [f"![param-sync memory and launches vs DP]({plot_name})", ""]
    Path(path).write_text("\n".join(out))


def reproduce_section(meta: dict) -> List[str]:
    """Markdown lines: how to audit each built-in model of ``meta["models"]`` from
    ``pretrain_gpt.py`` flags (``grid.MODEL_FLAGS``), at the run's DP sizes; none for
    a flag run (``meta["flags"]``)."""
    models = [m for m in meta["models"] if m in grid.MODEL_FLAGS]
    if not models or "flags" in meta:
        return []
    dps = ",".join(map(str, meta.get("dp_sizes", [])))
    out = [
        "## Reproduce a built-in model from pretrain_gpt.py flags",
        "",
        TEXTS["reproduce"],
        "",
    ]
    for m in models:
        stage = grid.MODELS[m].pp_stage if m in grid.MODELS else 0
        cmd = [".venv/bin/python", "scripts/audit_param_sync.py", "--label", m, "--dp-sizes", dps]
        cmd += ["--pp-stage", str(stage)] if stage else []
        out += [f"- {meta['models'][m]['title']}: `{shlex.join([*cmd, '--', *grid.MODEL_FLAGS[m]])}`"]
    return out + [""]


def write_plot(data: dict, path: Path) -> None:
    """Per model (columns), against DP: top, GiB per rank of the param sync's transient
    peak (megatron + NCCL; solid: async path, dotted: optimizer path) and of persistent
    buffer padding (dashed); bottom, NCCL group launches per step (solid: async, dotted:
    optimizer). Colours are trees; lines of equal values overlap (thicker lines below)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    cells, meta = data["cells"], data["meta"]
    models = [m for m in meta["models"] if any(c["model"] == m for c in cells)]
    trees = list(meta["trees"])
    ncol = max(1, len(models))
    # At least PLOT_MIN_WIDTH_IN wide (one model gave a 363 px figure that cut off its title and
    # legend); constrained layout places title and legend, bbox_inches="tight" keeps them in.
    width_in = max(PLOT_MIN_WIDTH_IN, 3.3 * ncol)
    fig, axes = plt.subplots(2, ncol, figsize=(width_in, 7.2), squeeze=False, layout="constrained")
    colors = {t: f"C{i}" for i, t in enumerate(trees)}
    width = {t: 1.0 + 0.9 * (len(trees) - 1 - i) for i, t in enumerate(trees)}
    for j, model in enumerate(models):
        top, bottom = axes[0][j], axes[1][j]
        for tree in trees:
            rs = sorted((c for c in cells if c["model"] == model and c["tree"] == tree and "error" not in c),
                        key=lambda c: c["dp"])  # fmt: skip
            kw = dict(color=colors[tree], lw=width[tree], alpha=0.85)
            for sync, ls in (("async", "-"), ("optimizer", ":")):
                pts = [(c["dp"], transient_peak(c, sync)) for c in rs]
                pts = [(x, y / GIB) for x, y in pts if y is not None]
                if pts:
                    top.plot(*zip(*pts), ls=ls, marker="o", ms=3, **kw)
                launches = [(c["dp"], c["paths"][sync]["launches"]) for c in rs
                            if "launches" in c.get("paths", {}).get(sync, {})]  # fmt: skip
                if launches:
                    bottom.plot(*zip(*launches), ls=ls, marker="o", ms=3, **kw)
            pads = [(c["dp"], c.get("padding_bytes", 0) / GIB) for c in rs]
            if any(y for _, y in pads):
                top.plot(*zip(*pads), ls="--", marker="s", ms=3, **kw)
        title = meta["models"][model]["title"].split(",")[0]
        top.set_title(f"{title}\n({model})", fontsize=8)
        top.set_yscale("symlog", linthresh=0.1)
        bottom.set_yscale("log")
        for ax in (top, bottom):
            ax.set_xscale("log", base=2)
            ax.grid(alpha=0.3)
            ax.set_xlabel("DP")
            ax.tick_params(labelsize=7)
        if j == 0:
            top.set_ylabel("GiB per rank", fontsize=8)
            bottom.set_ylabel("NCCL group launches per step", fontsize=8)
    handles = [Line2D([], [], color=colors[t], lw=3, label=t) for t in trees] + [
        Line2D([], [], color="k", ls="-", label="async path (--overlap-param-gather)"),
        Line2D([], [], color="k", ls=":", label="optimizer path (allgather_params)"),
        Line2D([], [], color="k", ls="--", marker="s", ms=3, label="persistent padding"),
    ]  # fmt: skip
    per_row = max(1, min(len(handles), int(width_in // 2.4)))
    fig.legend(handles=handles, loc="outside lower center", ncol=per_row, fontsize=7)
    title = ("Layer-wise param sync on real shapes: transient peak and padding per rank (top), "
             "launches per step (bottom)")  # fmt: skip
    fig.suptitle(textwrap.fill(title, width=int(width_in * 13)), fontsize=9)
    fig.savefig(path, dpi=110, bbox_inches="tight", pad_inches=0.1)
    plt.close(fig)


#: The plot's least width in inches (x 110 dpi: 880 px), whatever the number of models.
PLOT_MIN_WIDTH_IN = 8.0


# ---------------------------------------------------------------- the flag path's summary
#: What the series claims per cell and path (README): these are 0.
ZERO_KEYS = ("megatron_temporary_bytes", "megatron_peak_bytes", "nccl_temporary_bytes", "nccl_peak_bytes",
             "zero_size_ops")  # fmt: skip


#: Each path's name, when ``megatron.training`` takes it, and the series' claim on it (README,
#: "What the series claims"): the words ``flags_text`` prints and ``series_claims`` checks.
PATH_NAMES = {
    "async": "async forward gather",
    "optimizer": "optimizer-step gather",
    "forced": "forced sync",
}
PATH_WHEN = {
    "async": "with --overlap-param-gather: DDP's forward pre-hooks gather each bucket's params during the first "
             "forward of every training step",
    "optimizer": "without --overlap-param-gather: the layer-wise optimizer gathers every param at the end of "
                 "every step() (allgather_params)",
    "forced": "with --overlap-param-gather only: every bucket gathered at once outside the step, before each "
              "checkpoint save, at each evaluation (--eval-interval), at the weight-hash check and at the end "
              "of training (megatron.training's should_disable_forward_pre_hook)",
}  # fmt: skip
CLAIMS = {
    "async": "nothing allocated in megatron or inside NCCL, no zero-size operation, at most pristine's NCCL "
             "operations and group launches",
    "optimizer": "nothing allocated in megatron or inside NCCL, each param broadcast in place (one NCCL operation "
                 "per sharded param), no zero-size operation, at most pristine's group launches",
    "forced": "a temporary of one bucket at a time in megatron (peak at most the largest bucket's params, as "
              "0.17.1), nothing inside NCCL, no zero-size operation, at most pristine's NCCL operations and group "
              "launches",
}  # fmt: skip


def series_claims(cells: List[dict], pairs: Optional[Dict[str, str]] = None) -> List[dict]:
    """The series' claims on each series cell and path, against its pristine tree's same cell.

    Args:
        cells: slim records (any trees; ``model`` and ``dp`` match the pairs).
        pairs: series tree -> pristine tree (default ``grid.SERIES_PAIRS``).

    Returns:
        per series cell and path, ``{"tree", "pristine", "model", "dp", "path", "claim", "holds": bool,
        "why": str}`` (``claim``: ``CLAIMS[path]``, the words of what is checked): ``holds``
        when NCCL temporaries (bytes, peaks) and zero-size operations are 0 and the group
        launches at most pristine's; on the async and optimizer paths megatron's temporaries
        are 0 too; the NCCL operations are at most pristine's on the
        async and forced paths and one per sharded param on the optimizer path; the forced
        sync's megatron peak is at most the largest layer-wise bucket's params (one bucket's
        temporary at a time, as 0.17.1);
        ``why`` names each failed claim, or says what was not compared (pristine crashed
        there, or is not in the run).
    """
    pairs = grid.SERIES_PAIRS if pairs is None else pairs
    by = {(c["tree"], c["model"], c["dp"]): c for c in cells}
    out = []
    for c in cells:
        base = pairs.get(c["tree"])
        if base is None:
            continue
        u = by.get((base, c["model"], c["dp"]))
        for path in PATHS:
            r = c.get("paths", {}).get(path)
            if r is None:
                continue
            row = dict(tree=c["tree"], pristine=base, model=c["model"], dp=c["dp"], path=path, claim=CLAIMS[path],
                       holds=True, why="")  # fmt: skip
            why = []
            if "error" in r:
                why.append(f"the series raised: {error_line(r)}")
            else:
                # The forced sync takes one bucket's temporary at a time (as 0.17.1): megatron's
                # peak at most the largest layer-wise bucket's params; the optimizer's gather
                # broadcasts each sharded param in place: one NCCL operation per param.
                zero = [k for k in ZERO_KEYS if not (path == "forced" and k.startswith("megatron_"))]
                why += [f"{k} {r[k]}, claimed 0" for k in zero if r.get(k)]
                layerwise = [b for b in c.get("buckets", []) if b.get("layerwise")]
                if path == "forced" and layerwise:
                    largest = max(b["param_numel"] for b in layerwise) * c["param_bytes"] // c["param_numel"]
                    if r.get("megatron_peak_bytes", 0) > largest:
                        why.append(f"megatron_peak_bytes {r['megatron_peak_bytes']} > the largest bucket's {largest}")
                sharded = sum(b["params"] for b in layerwise if b.get("ranks", c["expert_dp"] if b["expert"] else c["dp"]) > 1)
                if path == "optimizer" and layerwise and r["ops"] != sharded:
                    why.append(f"ops {r['ops']}, claimed one per sharded param ({sharded})")
                ur = (u or {}).get("paths", {}).get(path)
                if u is None:
                    row["why"] = f"ops and launches not compared: {base} is not in the run"
                elif ur is None or "error" in ur:
                    row["why"] = (f"ops and launches not compared: {base} raised there"
                                  + (f" ({error_line(ur)})" if ur else ""))  # fmt: skip
                else:
                    keys = ("launches",) if path == "optimizer" else ("ops", "launches")
                    why += [f"{k} {r[k]} > {base}'s {ur[k]}" for k in keys if r[k] > ur[k]]
            if why:
                row.update(holds=False, why="; ".join(why))
            out.append(row)
    return out


def claims_lines(claims: List[dict]) -> List[str]:
    """The series' claims as ``flags_text`` prints them: per series tree and path, the claim in
    the README's words (``CLAIMS``) and whether it holds on this run's cells, from ``claims``
    (``series_claims``' rows, the same check): "holds (DP 8, 64)", or "does not hold" with the
    cells where it fails and why; notes where pristine was not compared."""
    lines = []
    for tree in dict.fromkeys(c["tree"] for c in claims):
        mine = [c for c in claims if c["tree"] == tree]
        lines.append(f"  {tree} against {mine[0]['pristine']}:")
        for path in [p for p in ("async", "optimizer", "forced") if any(c["path"] == p for c in mine)]:
            rows = [c for c in mine if c["path"] == path]
            failed = [c for c in rows if not c["holds"]]
            dps = ", ".join(str(c["dp"]) for c in rows)
            if failed:
                verdict = "does not hold: " + "; ".join(f"DP {c['dp']}: {c['why']}" for c in failed)
            else:
                verdict = f"holds (DP {dps})"
            lines.append(f"    {PATH_NAMES[path]}: {rows[0]['claim']}: {verdict}")
            lines += [f"      (DP {c['dp']}: {c['why']})" for c in rows if c["holds"] and c["why"]]
    return lines


def your_paths(cells: List[dict]) -> List[str]:
    """The paths the user's flags take (``flags.overlap_param_gather`` of a flag-path record,
    parsed by megatron): ["async", "forced"] or ["optimizer"]; [] for built-in cells."""
    parsed = [c["flags"]["overlap_param_gather"] for c in cells if "overlap_param_gather" in c.get("flags", {})]
    if not parsed:
        return []
    return ["async", "forced"] if parsed[0] else ["optimizer"]


#: What each tree is to a user of ``pretrain_gpt.py`` (the flag path's legend), beyond its title.
TREE_USE = {
    "pristine-0.17.1": "what a 0.17.1 run gets today",
    "series-0.17.1": "the same run with patches/0.17.1/ applied",
    "pristine-0.19": "what pretrain_gpt.py runs on 0.19.x today, whatever --use-layer-wise-param-layout says",
    "series-0.19": "the same run with patches/0.19/ applied",
    "pristine-0.19-layout": "pretrain()'s model-provider API by default; pretrain_gpt.py does not take this path",
    "pristine-0.18.2": "0.18.x with --no-use-layer-wise-param-layout (no series: update to 0.19.2)",
    "pristine-0.18.2-layout": "0.18.x by default (no series)",
}  # fmt: skip


def legend_lines(meta: dict, cells: List[dict]) -> List[str]:
    """The flag path's legend: the paths (what each is, when megatron.training takes it), the
    trees of the run (title, what each is to a pretrain_gpt.py user), which path the flags take,
    and the rows of the run's base (``meta["base"]``)."""
    mine = your_paths(cells)
    lines = ["", "Paths (one sync of the params each DP rank updated, as megatron.training runs it):"]
    lines += [f"  {p:<10}{PATH_NAMES[p]}: {PATH_WHEN[p]}" for p in ("async", "optimizer", "forced")]
    lines += ["Trees:"]
    lines += [f"  {t:<24}{m['title']}" + (f"; {TREE_USE[t]}" if t in TREE_USE else "")
              for t, m in meta["trees"].items()]  # fmt: skip
    if meta.get("base") == "all":
        lines.append("Rows of megatron-core 0.17.1 and 0.19 (--base all; --base 0.17.1 or 0.19 for one release).")
    elif meta.get("base"):
        lines.append(f"Rows of megatron-core {meta['base']} only (--base {meta['base']}; --base 0.17.1, 0.19 or all "
                     f"for the others).")  # fmt: skip
    if mine == ["optimizer"]:
        lines.append("Your flags take the optimizer-step gather (no --overlap-param-gather) every step; "
                     "megatron.training forces no sync without --overlap-param-gather. Their rows are marked * "
                     "(legacy trees: pretrain_gpt.py's path).")
    elif mine:
        lines.append("Your flags take the async forward gather (--overlap-param-gather) every step, and a forced "
                     "sync at each evaluation, checkpoint save and the end of training. Their rows are marked * (legacy "
                     "trees: pretrain_gpt.py's path).")
    lines.append("Step estimate: megatron's theoretical_memory_usage.report_theoretical_memory for these flags "
                 "(weights and optimizer state + activations, per rank), next to each path's peak temporaries.")
    return lines


def flags_text(data: dict) -> str:
    """The flag path's short table (stdout): the legend (``legend_lines``); per DP and path, per
    tree, megatron's temporaries (bytes allocated, peak), NCCL's (peak), NCCL operations
    (zero-size ones), group launches, bytes zeroed in ``grad_data``, and the path's peak
    temporaries (megatron + NCCL) next to megatron's estimate of the step's peak
    (``theoretical_memory``); rows of the paths the flags take marked *; per tree the persistent
    padding; then the series' claims per path (``claims_lines`` of ``data["meta"]
    ["series_claims"]``) and the trees that refused the flags. GiB = 2^30 bytes; counts per step
    (async, optimizer) or per forced sync."""
    meta, cells = data["meta"], data["cells"]
    trees = list(meta["trees"])
    mine = your_paths(cells)
    lines = []
    for label, m in meta["models"].items():
        lines += [f"== {m['title']}", f"   {m['summary']}", f"   {m['notes']}"]
    lines += legend_lines(meta, cells)
    head = f"   {'path':<10}{'tree':<24}{'megatron temp. GiB: all (peak)':>31}{'NCCL temp. GiB':>16}" \
           f"{'ops (0-size)':>16}{'launches':>10}{'zeroed GiB':>12}{'peak temp. / step estimate GiB':>34}"
    for dp in sorted({c["dp"] for c in cells}):
        rs = _ordered([c for c in cells if c["dp"] == dp], trees)
        edp = f", expert DP {rs[0]['expert_dp']}" if rs[0].get("ep", 1) > 1 and "expert_dp" in rs[0] else ""
        lines += ["", f"DP {dp}{edp}", head]
        lines += [f"   {'(cell)':<10}{r['tree']:<24}  crash: {error_line(r)[:90]}" for r in rs if "error" in r]
        for path in ("async", "optimizer", "forced"):
            for r in rs:
                # pretrain_gpt.py takes the legacy path (README), so the layout tree's rows are not the user's
                mark = "*" if path in mine and not meta["trees"][r["tree"]].get("layout") else " "
                p = r.get("paths", {}).get(path)
                if p is None:
                    continue
                if "error" in p:
                    lines.append(f" {mark} {path:<10}{r['tree']:<24}  crash: {error_line(p)[:90]}")
                    continue
                temp = f"{gib(p['megatron_temporary_bytes'])} ({gib(p['megatron_peak_bytes'])})"
                ops = f"{p['ops']} ({p['zero_size_ops']})"
                peak, step = transient_peak(r, path), theory_bytes(r)
                against = f"{gib(peak)} / {gib(step)}" + (f" ({100 * peak / step:.1f}%)" if peak and step else "")
                lines.append(f" {mark} {path:<10}{r['tree']:<24}{temp:>31}{gib(nccl_peak(p)):>16}{ops:>16}"
                             f"{p['launches']:>10}{gib(p['zeroed_grad_bytes']):>12}{against:>34}")  # fmt: skip
        pads = ", ".join(f"{r['tree']} {gib(r.get('padding_bytes', 0))}" for r in rs if "error" not in r)
        lines.append(f"   persistent padding GiB: {pads}")
        lines.append("   megatron's step estimate GiB, weights + optimizer state + activations: "
                     + _estimates_text([r for r in rs if "error" not in r]))
    claims = meta.get("series_claims") or []
    if claims:
        lines += ["", "The series' claims per path (README), checked on every cell of this run against pristine "
                  "(series_claims):"]  # fmt: skip
        lines += claims_lines(claims)
    for x in meta.get("flags_rejected") or []:
        lines.append(f"refused by {x['tree']} ({x['size']}): {x['message']}")
    return "\n".join(lines)
