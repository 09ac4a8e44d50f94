"""Audit the layer-wise param sync on real model shapes at real DP, with megatron's own code.

The driver behind ``scripts/audit_param_sync.py`` (its command line: ``main``). Usage (from the repo root, after scripts/setup.sh):

    .venv/bin/python scripts/audit_param_sync.py              # every cell: 7 models x DP 8..1024 x 7 trees (grid.py)
    .venv/bin/python scripts/audit_param_sync.py --quick      # 2 models x DP 8, 64 (the unit test's run)
    .venv/bin/python scripts/audit_param_sync.py --publish    # also docs/bench/real_shapes.{md,json,png}
    .venv/bin/python scripts/audit_param_sync.py --trees pristine-0.17.1,series-0.17.1 --models llama3_8b_tp1 --dp-sizes 64
    .venv/bin/python scripts/audit_param_sync.py --dp-sizes 8,64 --label mine -- <pretrain_gpt.py flags> --vocab-size N
    .venv/bin/python scripts/audit_param_sync.py --render-from docs/bench/real_shapes.json --publish  # no audit run

Your model (after ``--``, the flags of your ``pretrain_gpt.py`` run; docs/harness.md, "The
benchmarks", says what is audited and printed): each tree's own ``megatron.training`` parses the
flags and its ``gpt_builder`` builds the model (harness/audit/worker.py ``FlagsSpec``). DP sizes
come from ``--dp-sizes`` or ``--world-size``; ``--label`` names the model, ``--pp-stage`` the
stage audited (default 0). Trees: ``--trees``, or those of ``--base`` (``TREES_OF_BASE``; default
``DEFAULT_BASE``; ``all``: ``FLAGS_TREES``), less the layout path with
``--no-use-layer-wise-param-layout``. Flags one tree refuses and another accepts are reported per
tree. A short table goes to stdout (``report.flags_text``).

``--render-from JSON``: no audit run; the outputs again from a published JSON, each cell that
lacks megatron's step estimate given it by its tree's worker (``--theory-only``), the cells of
trees no longer in grid.py left out.

Models, trees and DP sizes are in harness/audit/grid.py. One worker process per
tree (harness/audit/worker.py, that tree first on PYTHONPATH) runs every cell
of that tree on PyTorch's fake process group with storage-free (meta) tensors: the
tree's DDP buckets, its layer-wise sharding and its param sync, run, not re-planned. So a
change of a tree (e.g. the series) changes the numbers on the next run, with no change
here. Up to --jobs workers run at once.

Outputs in --out-dir (default build/audit): real_shapes.json ({"meta", "cells"}: one record
per tree x model x DP, rank 0 of DP, with megatron's step estimate ``theoretical_memory``;
harness/audit/report.py slim()),
real_shapes.md (a table per model), real_shapes.png, and raw/<tree>.json (the workers'
full records, per-rank shares included).

Exit status: 0 when every cell ran and the structural checks hold (``checks()``); 1 when
a check fails (outputs are written either way); 2 when a worker process fails, or on bad
input (unknown options, flags that every tree refuses, a DP size no tree accepts): then a
message and no traceback, and nothing is written.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

from harness.audit import grid, report
from harness.trees import REPO_ROOT, env_for_tree

WORKER = REPO_ROOT / "harness" / "audit" / "worker.py"
WORKER_TIMEOUT_S = 1800

#: The fixed texts of the JSON's meta (docs/bench/real_shapes_findings.md): the method, with the
#: built-in models' sentence (``_BUILTIN_MODEL``; the flag path puts ``_FLAGS_MODEL`` there), the
#: column legend and the memory note.
_BUILTIN_MODEL = report.TEXTS["builtin_model"]
_FLAGS_MODEL = report.TEXTS["flags_model"]
METHOD = report.TEXTS["method"].replace("{model}", _BUILTIN_MODEL)
COLUMNS = report.TEXTS["columns"]
MEMORY_NOTE = report.TEXTS["memory_note"]


class WorkerError(RuntimeError):
    """A worker process failed; the message holds its command and output tail."""


class FlagsRejected(ValueError):
    """The pretrain_gpt.py flags describe no cell any tree can audit; the message says why,
    per tree, in megatron's words."""


#: Trees of the flag path: pristine and the series on each base, and 0.19.2's layout path
#: (dropped when the flags say --no-use-layer-wise-param-layout). ``--base`` picks one base's
#: (default ``DEFAULT_BASE``, the newest release with a series), or all of them.
FLAGS_TREES = ("pristine-0.17.1", "series-0.17.1", "pristine-0.19", "series-0.19", "pristine-0.19-layout")
TREES_OF_BASE = {"0.17.1": ("pristine-0.17.1", "series-0.17.1"), "0.19": ("pristine-0.19", "series-0.19", "pristine-0.19-layout")}
DEFAULT_BASE = "0.19"


def audited(tree: str, model: str) -> bool:
    """Whether the audit runs ``model`` on ``tree``: every pair but VPP models on a layout
    tree (not audited there; see grid.MODELS)."""
    return not (grid.TREES[tree].layout and grid.ALL_MODELS[model].vpp > 1)


def build_cells(models, dp_sizes, tree: str) -> str:
    """The worker's --cells argument for ``tree``: every audited model at every DP size
    (DP rank 0)."""
    return ",".join(f"{m}:{dp}" for m in models if audited(tree, m) for dp in dp_sizes)


def worker_command(label: str, cells: str, out: Path, theory_only: bool = False):
    """(argv, env) of the worker for tree ``label`` (harness.trees.env_for_tree of its tree).
    ``cells``: the worker's --cells, or a Path: its --flags job file (``main_flags``);
    ``theory_only``: megatron's step estimate per cell only (the worker's --theory-only)."""
    spec = grid.TREES[label]
    env = env_for_tree(grid.tree_dir(spec))
    env.update(MEGATRON_CPU_RUNTIME="force", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", PYTHONUNBUFFERED="1")
    what = ["--flags", str(cells)] if isinstance(cells, Path) else ["--cells", cells]
    argv = [sys.executable, str(WORKER), "--tree", label, *what, "--out", str(out)]
    return argv + (["--theory-only"] if theory_only else []), env


def run_workers(labels, cells, raw: Path, jobs: int, theory_only: bool = False) -> dict:
    """Run one worker per tree on ``cells[tree]`` (``build_cells``), at most ``jobs`` at
    once; {tree: [records]}.

    Raises:
        WorkerError: a worker exited non-zero or ran past WORKER_TIMEOUT_S (its log tail).
    """
    raw.mkdir(parents=True, exist_ok=True)
    pending, running, results = list(labels), {}, {}
    deadline = time.monotonic() + WORKER_TIMEOUT_S
    try:
        while pending or running:
            while pending and len(running) < jobs:
                label = pending.pop(0)
                out = raw / f"{label}.json"
                log = raw / f"{label}.log"
                argv, env = worker_command(label, cells[label], out, theory_only=theory_only)
                proc = subprocess.Popen(argv, env=env, cwd=REPO_ROOT, stdout=log.open("w"),
                                        stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
                running[label] = (proc, out, log, time.monotonic())
            for label, (proc, out, log, t0) in list(running.items()):
                rc = proc.poll()
                if rc is None:
                    continue
                del running[label]
                if rc != 0:
                    tail = log.read_text(errors="replace")[-4000:]
                    raise WorkerError(f"worker {label} exited rc={rc}: {shlex.join(proc.args)}\n{tail}")
                results[label] = json.loads(out.read_text())
                print(f"[audit] {label}: {len(results[label])} cells in {time.monotonic() - t0:.0f} s", flush=True)
            if time.monotonic() > deadline:
                raise WorkerError(f"workers {sorted(running)} ran past {WORKER_TIMEOUT_S} s")
            time.sleep(0.2)
    finally:
        for proc, *_ in running.values():
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.wait()
    return results


def exact_receive_bytes(record: dict, itemsize: int = 2) -> int:
    """Bytes of params other ranks own in this rank's buckets (the least any gather must
    receive): per bucket with shares, the sum of the other ranks' shares (DP rank for dense
    buckets, expert-DP rank for expert buckets), bf16."""
    total = 0
    for b in record.get("buckets", []):
        shares = b.get("shares")
        if shares:
            own = record["expert_dp_rank"] if b["expert"] else record["dp_rank"]
            total += (sum(shares) - shares[own]) * itemsize
    return total


def published_cells(records) -> list:
    """The workers' records as the JSON publishes them: ``exact_receive_bytes`` added, ``slim``."""
    for rec in records:
        rec["exact_receive_bytes"] = exact_receive_bytes(rec)
    return [report.slim(rec) for rec in records]


def checks(cells: list, want: set) -> list:
    """Structural checks of the run; returns failure messages (empty: all hold).

    Every wanted (tree, model, DP) cell is present; per counted path: the form histogram
    adds up to the c10d calls, zero-size ops <= ops, launches <= calls, and the bytes
    received are at least the params the other ranks own (``exact_receive_bytes``).
    """
    fails = []
    got = {(c["tree"], c["model"], c["dp"]) for c in cells}
    for key in sorted(want - got):
        fails.append(f"missing cell {key}")
    for c in cells:
        for path, r in c.get("paths", {}).items():
            if "error" in r:
                continue
            where = f"{c['tree']}/{c['model']}/dp{c['dp']}/{path}"
            if sum(r["forms"].values()) != r["calls"]:
                fails.append(f"{where}: forms {r['forms']} do not add up to {r['calls']} calls")
            if not r["zero_size_ops"] <= r["ops"] or r["launches"] > r["calls"]:
                fails.append(f"{where}: ops {r['ops']}, zero-size {r['zero_size_ops']}, launches {r['launches']}")
            if path != "forced" and r["wire_bytes"] < c.get("exact_receive_bytes", 0):
                fails.append(f"{where}: received {r['wire_bytes']} B < {c['exact_receive_bytes']} B owned by others")
    return fails


def dump_json(data: dict) -> str:
    """``{"meta": ..., "cells": [...]}`` with meta indented and one line per cell (a rerun
    shows as a per-cell diff)."""
    cells = ",\n".join("  " + json.dumps(c, separators=(",", ":")) for c in data["cells"])
    return '{"meta": ' + json.dumps(data["meta"], indent=1) + ',\n "cells": [\n' + cells + "\n ]}\n"


def model_summary(spec, records: list) -> str:
    """One line per model: params and buffers per rank, from a record that ran."""
    ok = [r for r in records if "param_bytes" in r and not grid.TREES[r["tree"]].layout]
    if not ok:
        return ""
    layers = spec.config["num_layers"] // spec.pp
    return _layout_text(ok[0]) + f"{layers} layers on this rank; " + _params_text(ok[0], fp32_grad=True)


def _layout_text(r: dict) -> str:
    vpp = f", VPP {r['vpp']} (one DDP per model chunk)" if r.get("vpp", 1) > 1 else ""
    return f"TP {r['tp']}, PP {r['pp']}{vpp}, EP {r['ep']}; "


def _params_text(r: dict, fp32_grad: bool) -> str:
    """'8.03 B params per rank (14.96 GiB bf16, fp32 grad_data 29.92 GiB); padded vocab 128256.'"""
    grad = 4 if fp32_grad else 2
    return (f"{r['param_numel'] / 1e9:.2f} B params per rank ({report.gib(r['param_bytes'])} GiB bf16, "
            f"{'fp32' if fp32_grad else 'bf16'} grad_data {report.gib(r['param_bytes'] // 2 * grad)} GiB); "
            f"padded vocab {r.get('padded_vocab_size')}.")  # fmt: skip


def split_flags(argv):
    """(the audit's own arguments, the pretrain_gpt.py flags after the first ``--`` or None)."""
    argv = list(argv)
    if "--" not in argv:
        return argv, None
    i = argv.index("--")
    return argv[:i], argv[i + 1 :]


def positive_ints(text: str):
    """argparse type: '8,64' -> [8, 64] (each >= 1)."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated integers, e.g. 8,64") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected integers >= 1")
    return values


def sort_flags_results(results: dict, sizes) -> tuple:
    """Split the workers' flag-path records into (cells that ran, rejections).

    Args:
        results: {tree: [records]} of ``run_workers`` on a flags job (each with ``size``).
        sizes: the requested sizes, [("dp" | "world", n)].

    Returns:
        (records that ran, [{"tree", "size", "message"}] of those megatron refused).

    Raises:
        FlagsRejected: every tree refused every size, or some size is refused by every tree
            (the messages, per tree and size).
    """
    ran, rejected = [], []
    for tree, recs in results.items():
        for r in recs:
            if "flags_error" in r:
                rejected.append(dict(tree=tree, size=_size_text(*r["size"]), message=r["flags_error"]))
            else:
                ran.append(r)
    refused_everywhere = [_size_text(kind, n) for kind, n in sizes
                          if all(any(x["tree"] == t and x["size"] == _size_text(kind, n) for x in rejected)
                                 for t in results)]  # fmt: skip
    if not ran or refused_everywhere:
        lines = [f"  {x['tree']} ({x['size']}): {x['message']}" for x in rejected
                 if not ran or x["size"] in refused_everywhere]  # fmt: skip
        raise FlagsRejected("megatron refuses the flags" + (f" at {', '.join(refused_everywhere)}" if ran else "")
                            + " on every tree:\n" + "\n".join(lines))  # fmt: skip
    return ran, rejected


def _size_text(kind: str, n: int) -> str:
    return f"DP {n}" if kind == "dp" else f"world size {n}"


def flags_model_meta(label: str, flags, records: list) -> dict:
    """meta["models"][label] of a flag-path run: title, notes (the flags, the layer spec per
    tree) and the one-line summary (``model_summary``'s, from a record that ran)."""
    specs = {r["tree"]: r.get("layer_spec", "?") for r in records}
    notes = "From pretrain_gpt.py flags: `" + shlex.join(flags) + "`. Layer spec: " + "; ".join(
        f"{t}: {s}" for t, s in specs.items()) + "."  # fmt: skip
    if any("stand-in" in s for s in specs.values()):
        notes += (" Transformer Engine is not installed: its modules' parameters (names, registration order, "
                  "shapes) come from harness/audit/te_standin.py under megatron's own TE wrappers and spec.")  # fmt: skip
    ok = [r for r in records if "param_bytes" in r and not grid.TREES[r["tree"]].layout] or [
        r for r in records if "param_bytes" in r]  # fmt: skip
    summary = ""
    if ok:
        f = ok[0].get("flags", {})
        summary = (_layout_text(ok[0]) + f"stage {ok[0]['pp_stage']}; {f.get('num_layers')} layers in all; "
                   + _params_text(ok[0], f.get("grad_reduce_in_fp32", True)))  # fmt: skip
    return dict(title=f"{label} (pretrain_gpt.py flags)", notes=notes, summary=summary)


def main(argv=None) -> int:
    argv, flags = split_flags(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 usage="%(prog)s [options] [-- <pretrain_gpt.py flags>]")  # fmt: skip
    ap.add_argument("--quick", action="store_true", help="models " + ",".join(grid.QUICK_MODELS)
                    + " at DP " + ",".join(map(str, grid.QUICK_DP_SIZES)))
    ap.add_argument("--trees", default="", help="comma list (harness/audit/grid.py TREES); default: "
                    "every tree, or FLAGS_TREES with flags")
    ap.add_argument("--models", default="", help="comma list (harness/audit/grid.py MODELS)")
    ap.add_argument("--dp-sizes", type=positive_ints, default=None, help="comma list of DP sizes")
    ap.add_argument("--world-size", type=positive_ints, default=None,
                    help="with flags: comma list of world sizes; DP = world / (TP x PP x CP), as megatron derives it")
    ap.add_argument("--label", default="my_model", help="with flags: the model's name in the outputs")
    ap.add_argument("--pp-stage", type=int, default=0, help="with flags: the pipeline stage audited")
    ap.add_argument("--base", choices=(*TREES_OF_BASE, "all"), default=None,
                    help=f"with flags: the megatron-core release you run (its trees only; default {DEFAULT_BASE}; "
                    "all: both bases)")
    ap.add_argument("--render-from", metavar="JSON", default=None,
                    help="no audit run: render real_shapes.{md,png} from a published real_shapes.json, adding "
                    "megatron's step estimate (theoretical_memory) to cells that lack it")
    ap.add_argument("--jobs", type=int, default=2, help="worker processes at once")
    ap.add_argument("--out-dir", default=str(REPO_ROOT / "build" / "audit"))
    ap.add_argument("--publish", action="store_true", help="copy JSON, MD and PNG to docs/bench/")
    args = ap.parse_args(argv)
    # SIGTERM ends the run like Ctrl-C: run_workers' cleanup kills the worker sessions.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if flags is None and (args.world_size or args.label != "my_model" or args.pp_stage or args.base):
        ap.error("--world-size, --label, --pp-stage and --base go with pretrain_gpt.py flags after --")
    try:
        if flags is not None:
            return main_flags(ap, args, flags, argv)
        return main_render(ap, args, argv) if args.render_from else main_grid(ap, args, argv)
    except WorkerError as exc:
        print(f"[audit] {exc}", file=sys.stderr)
        return 2


def main_grid(ap, args, argv) -> int:
    """The built-in models' run of ``main`` (module docstring): 0, or 1 (a check failed)."""
    trees = [t for t in args.trees.split(",") if t] or list(grid.TREES)
    unknown = [t for t in trees if t not in grid.TREES]
    if unknown:
        ap.error(f"unknown trees {unknown}; known: {sorted(grid.TREES)}")
    models = args.models.split(",") if args.models else list(
        grid.QUICK_MODELS if args.quick else grid.MODELS)  # fmt: skip
    bad = [m for m in models if m not in grid.ALL_MODELS]
    if bad:
        ap.error(f"unknown models {bad}; known: {sorted(grid.ALL_MODELS)}")
    dps = args.dp_sizes or list(grid.QUICK_DP_SIZES if args.quick else grid.DP_SIZES)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    results = run_workers(trees, {t: build_cells(models, dps, t) for t in trees}, out_dir / "raw", max(1, args.jobs))
    wall = time.monotonic() - t0
    cells = published_cells([rec for label in trees for rec in results[label]])
    command = shlex.join([".venv/bin/python", "scripts/audit_param_sync.py", *argv])
    meta = run_meta(command, wall, trees, results)
    meta.update(
        models={m: dict(title=grid.ALL_MODELS[m].title, notes=grid.ALL_MODELS[m].notes,
                        summary=model_summary(grid.ALL_MODELS[m], [c for c in cells if c["model"] == m]))
                for m in models},  # fmt: skip
        dp_sizes=dps,
    )
    fails = checks(cells, {(t, m, dp) for t in trees for m in models if audited(t, m) for dp in dps})
    meta["checks_failed"] = fails
    write_outputs({"meta": meta, "cells": cells}, out_dir, args.publish)
    print(f"[audit] {len(cells)} cells, {wall:.0f} s; outputs in {out_dir}", flush=True)
    for f in fails:
        print(f"[audit] CHECK FAILED: {f}", file=sys.stderr)
    return 1 if fails else 0


def run_meta(command: str, wall: float, trees, results: dict) -> dict:
    """The run's meta block: command, date, versions, wall time, method and column texts,
    the trees (title, layout, directory)."""
    import torch

    return dict(
        command=command,
        date=datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        torch=torch.__version__,
        python=platform.python_version(),
        cpus=os.cpu_count(),
        wall_s=round(wall, 1),
        method=METHOD,
        columns=COLUMNS,
        memory_note=MEMORY_NOTE,
        trees={t: dict(title=grid.TREES[t].title, layout=grid.TREES[t].layout, dir=_tree_dir(results[t]))
               for t in trees},  # fmt: skip
    )


def _tree_dir(records: list) -> str:
    """The tree directory the worker ran (``tree_dir`` of its records), relative to the repo."""
    d = records[0].get("tree_dir", "") if records else ""
    return str(Path(d).relative_to(REPO_ROOT)) if d.startswith(str(REPO_ROOT)) else d


def write_outputs(data: dict, out_dir: Path, publish: bool = False) -> None:
    """real_shapes.{json,md,png} in ``out_dir``; with ``publish``, copies in docs/bench/."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "real_shapes.json").write_text(dump_json(data))
    report.write_markdown(data, out_dir / "real_shapes.md")
    report.write_plot(data, out_dir / "real_shapes.png")
    if publish:
        report.DOCS.mkdir(parents=True, exist_ok=True)
        for name in ("real_shapes.json", "real_shapes.md", "real_shapes.png"):
            shutil.copy(out_dir / name, report.DOCS / name)


def main_render(ap, args, argv) -> int:
    """``--render-from JSON``: real_shapes.{json,md,png} in --out-dir (and docs/bench/ with
    --publish) from a published run's JSON, with no audit run: every cell that lacks megatron's
    step estimate gets it from its tree's worker (``--theory-only``: that tree's
    ``report_theoretical_memory`` on the model's flags at that DP), and meta says so
    (``theory_added``). Cells and ``meta["trees"]`` of trees that ``grid.TREES`` no longer
    has are dropped (said on stdout). Every other figure stays the published run's.

    Returns 0, or 2 (the JSON cannot be read, a worker failed)."""
    if args.quick or args.models or args.trees or args.dp_sizes:
        ap.error("--render-from takes the cells of its JSON: no --quick, --models, --trees or --dp-sizes")
    try:
        data = json.loads(Path(args.render_from).read_text())
        meta, cells = data["meta"], data["cells"]
    except (OSError, ValueError, KeyError) as exc:
        print(f"[audit] --render-from {args.render_from}: {exc}", file=sys.stderr)
        return 2
    retired = sorted({c["tree"] for c in cells} - set(grid.TREES))
    if retired:
        data["cells"] = cells = [c for c in cells if c["tree"] in grid.TREES]
        print(f"[audit] dropped the cells of trees no longer in harness/audit/grid.py: {', '.join(retired)}",
              flush=True)  # fmt: skip
    meta["trees"] = {t: m for t, m in meta["trees"].items() if t in grid.TREES}
    todo = [c for c in cells if "theoretical_memory" not in c]
    trees = list(dict.fromkeys(c["tree"] for c in todo))
    t0 = time.monotonic()
    if trees:
        cells_by_tree = {t: ",".join(f"{c['model']}:{c['dp']}" for c in todo if c["tree"] == t) for t in trees}
        results = run_workers(trees, cells_by_tree, Path(args.out_dir) / "raw-theory", max(1, args.jobs),
                              theory_only=True)  # fmt: skip
        got = {(r["tree"], r["model"], r["dp"]): r["theoretical_memory"] for rs in results.values() for r in rs}
        for c in todo:
            c["theoretical_memory"] = got[(c["tree"], c["model"], c["dp"])]
        command = shlex.join([".venv/bin/python", "scripts/audit_param_sync.py", *argv])
        meta["theory_added"] = (
            f"The step estimates were added on {datetime.now(timezone.utc).strftime('%Y-%m-%d %H:%M UTC')} by "
            f"`{command}` ({len(todo)} cells, {time.monotonic() - t0:.0f} s: each tree's worker ran only "
            f"`report_theoretical_memory`); every other figure is the audit run's of {meta['date']}.")  # fmt: skip
    meta["columns"] = COLUMNS
    write_outputs(data, Path(args.out_dir), args.publish)
    print(f"[audit] rendered {len(cells)} cells ({len(todo)} given megatron's step estimate) into {args.out_dir}",
          flush=True)  # fmt: skip
    return 0


def main_flags(ap, args, flags, argv) -> int:
    """The flag path of ``main`` (module docstring): one model from pretrain_gpt.py ``flags``.

    Returns the exit status: 0, 1 (a structural check failed) or 2 (bad input or a worker
    failure; nothing written)."""
    if args.quick or args.models or args.publish or args.render_from:
        ap.error("--quick, --models, --publish and --render-from do not go with pretrain_gpt.py flags")
    if args.trees and args.base:
        ap.error("give --trees or --base, not both")
    if not flags:
        ap.error("no pretrain_gpt.py flags after --")
    if bool(args.dp_sizes) == bool(args.world_size):
        ap.error("give the DP sizes (--dp-sizes 8,64) or the world sizes (--world-size 64), one of the two")
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", args.label):
        ap.error(f"--label {args.label!r}: letters, digits, '_', '.', '-' only")
    if args.pp_stage < 0:
        ap.error("--pp-stage: expected a stage >= 0")
    base = None if args.trees else (args.base or DEFAULT_BASE)
    of_base = FLAGS_TREES if base in (None, "all") else TREES_OF_BASE[base]
    trees = [t for t in args.trees.split(",") if t] or [
        t for t in of_base if not (grid.TREES[t].layout and "--no-use-layer-wise-param-layout" in flags)]
    unknown = [t for t in trees if t not in grid.TREES]
    if unknown:
        ap.error(f"unknown trees {unknown}; known: {sorted(grid.TREES)}")
    sizes = [("dp", n) for n in args.dp_sizes or []] + [("world", n) for n in args.world_size or []]
    # the worker's --flags job (harness/audit/worker.py run_flags)
    job = dict(label=args.label, flags=list(flags), dp_sizes=args.dp_sizes or [], world_sizes=args.world_size or [],
               pp_stage=args.pp_stage)  # fmt: skip
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="audit-flags-") as tmp:
        job_file = Path(tmp) / "job.json"
        job_file.write_text(json.dumps(job))
        try:
            results = run_workers(trees, {t: job_file for t in trees}, Path(tmp) / "raw", max(1, args.jobs))
            ran, rejected = sort_flags_results(results, sizes)
        except FlagsRejected as exc:
            other = [b for b in TREES_OF_BASE if b != base] if base not in (None, "all") else []
            print(f"[audit] {exc}" + (f"\n[audit] megatron-core {base}'s trees only (--base {base}); for "
                  f"another release: --base {other[0]}" if other else ""), file=sys.stderr)  # fmt: skip
            return 2
        wall = time.monotonic() - t0
        out_dir = Path(args.out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        shutil.copytree(Path(tmp) / "raw", out_dir / "raw", dirs_exist_ok=True)
    cells = published_cells(ran)
    trees_ran = [t for t in trees if any(c["tree"] == t for c in cells)]
    command = shlex.join([".venv/bin/python", "scripts/audit_param_sync.py", *argv, "--", *flags])
    meta = run_meta(command, wall, trees_ran, {t: results[t] for t in trees_ran})
    meta["method"] = METHOD.replace(_BUILTIN_MODEL, _FLAGS_MODEL)
    dps = sorted({c["dp"] for c in cells})
    meta.update(models={args.label: flags_model_meta(args.label, flags, ran)}, dp_sizes=dps,
                flags=list(flags), flags_rejected=rejected, base=base)  # fmt: skip
    fails = checks(cells, {(c["tree"], c["model"], c["dp"]) for c in cells})
    meta["checks_failed"] = fails
    meta["series_claims"] = report.series_claims(cells)
    write_outputs({"meta": meta, "cells": cells}, out_dir)
    print(report.flags_text({"meta": meta, "cells": cells}), flush=True)
    per_cell = [c["wall_s"] for c in cells if "wall_s" in c]
    print(f"[audit] {len(cells)} cells, {wall:.0f} s wall; per cell (worker time, model build and every path) "
          f"mean {sum(per_cell) / max(1, len(per_cell)):.1f} s, max {max(per_cell, default=0):.1f} s; "
          f"outputs in {out_dir}", flush=True)  # fmt: skip
    for f in fails:
        print(f"[audit] CHECK FAILED: {f}", file=sys.stderr)
    return 1 if fails else 0

