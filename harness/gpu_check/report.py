"""Summary JSON and text report of a GPU check results folder.

The folder, as ``python -m harness.gpu_check`` writes it::

    OUT/plan.json          the plan (plan.Plan.as_dict)
    OUT/environment.json   GPU, driver, torch, Python, megatron-core, date
    OUT/runs.json          per run: status ("ok", "failed", "timeout", "not_run"), returncode, seconds
    OUT/<functional run>/<case>/comparison.json   (run_case; with metrics and loss_curves.png)
    OUT/<memory run>/{pristine,series}.json       (memory_worker, one per side of plan.TREES)
    OUT/summary.json, OUT/report.txt              (this module)

``summarize(out)`` reads it into one dict; ``render(summary)`` is the text report. Bytes are
bytes; the report prints them in MiB/GiB. A memory run passes when both trees finished,
their lm loss is bit for bit equal at every step and the params agree after training, and,
on NCCL, the series' param sync allocated 0 bytes on every rank. On gloo the series sync's
CUDA bytes (which include the NCCL temporaries the collective model allocates) are reported,
not required. The real-shape memory run (config ``llama3_8b_layers``) also fails where a
measured peak of the param sync or the optimizer gather (per tree, per DP rank) differs from
the real-shape audit's prediction by more than the allocator rounding
(``harness.gpu_check.real_shapes.compare``), or where its buckets and shares are not the
audit's. A run with status "skipped" (e.g. Transformer Engine not installed) neither passes
nor fails.

The optimizer-gather timing run (kind ``timing``, ``OUT/<run>/gather_timing.json`` from
``gather_timing_worker.py``) prints the pristine tree's and the series' median time of
``allgather_params()``, the series/pristine ratio with its bootstrap CI, their NCCL operations
and CUDA peaks. It fails only where the worker left no result, where a path did not leave every
param equal to its owner's, or where the series' gather did not run in place (a param that is
not a plain contiguous tensor takes the flatten-and-gather fallback); the time never decides.

NCCL runs whose ranks share one GPU (``shared_gpu``) use NCCL's socket transport: a PASS there
proves the series on NCCL's own code paths (the collectives megatron issues, as NCCL runs and
allocates them, on real CUDA memory and the real caching allocator), not its time or its
intra-node transports (sockets over loopback, not NVLink).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List, Optional

from harness.gpu_check.real_shapes import load_json

#: The two sides compared: the pristine tree and the series tree (a memory run's sides,
#: ``plan.TREES``; the timing run's two gathers, ``gather_timing_worker.PATHS``).
TREES = ("pristine", "series")
#: Results folders written before the sides were named pristine and series hold
#: upstream.json (pristine) and patched.json (series); ``_load_side`` reads either.
OLD_FILES = {"pristine": "upstream.json", "series": "patched.json"}


class ResultsError(ValueError):
    """The folder is not a GPU check results folder (plan.json missing or unreadable)."""


def _load_side(run_dir: Path, side: str) -> Optional[Any]:
    """``run_dir/<side>.json`` (a side of ``TREES``), else its older name (``OLD_FILES``)."""
    path = run_dir / f"{side}.json"
    return load_json(path if path.exists() else run_dir / OLD_FILES[side])


def fmt_bytes(n: Optional[float]) -> str:
    """1536 -> "1.50 KiB"; None -> "n/a"; negative values keep their sign."""
    if n is None:
        return "n/a"
    sign, n = ("-" if n < 0 else ""), abs(n)
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{sign}{n / size:.2f} {unit}"
    return f"{sign}{int(n)} B"


def _max(values: List[Optional[float]]) -> Optional[float]:
    vals = [v for v in values if v is not None]
    return max(vals) if vals else None


def memory_tree(doc: Optional[dict]) -> Optional[dict]:
    """One tree's figures from a memory_worker result: the last step (steady state) and the
    sync alone, each the maximum over ranks; None when the file is missing or holds an error."""
    if not doc or any(r is None or "error" in r for r in doc.get("ranks", [None])):
        return None
    ranks = doc["ranks"]
    last = [r["steps"][-1] for r in ranks]
    r0 = ranks[0]
    return {
        "param_count": r0["param_count"],
        "param_bytes": r0["param_bytes"],
        "buckets": len(r0["buckets"]),
        "buckets_with_equal_shares": sum(b["shares_equal"] for b in r0["buckets"]),
        "forward_peak_extra_bytes": _max([s["forward"]["peak_extra_bytes"] for s in last]),
        "forward_reserved_bytes": _max([s["forward"]["reserved_bytes"] for s in last]),
        "step_peak_extra_bytes": _max([s["step_peak_extra_bytes"] for s in last]),
        "sync_peak_extra_bytes": _max([r["sync"]["peak_extra_bytes"] for r in ranks]),
        "sync_peak_extra_bytes_per_rank": [r["sync"]["peak_extra_bytes"] for r in ranks],
        "sync_gather_calls": r0["sync"]["gather_calls"],
        "optimizer_sync_peak_extra_bytes": _max([r["sync_optimizer"]["peak_extra_bytes"] for r in ranks]),
        "optimizer_sync_peak_extra_bytes_per_rank": [r["sync_optimizer"]["peak_extra_bytes"] for r in ranks],
        "optimizer_sync_gather_calls": r0["sync_optimizer"]["gather_calls"],
        "losses_hex": [s["loss_hex"] for s in r0["steps"]],
        "params_checksums": sorted({r["params_checksum"] for r in ranks}),
        "init_params_checksums": sorted({r.get("init_params_checksum") for r in ranks} - {None}),
        "bucket_layout": [[b["numel"], b["shares"]] for b in r0["buckets"]],
        "devices": [r["device"] for r in ranks],
    }


def summarize_memory(run: dict, run_dir: Path) -> dict:
    trees = {t: memory_tree(_load_side(run_dir, t)) for t in TREES}
    out: Dict[str, Any] = {"trees": trees, "problems": []}
    pr, se = trees["pristine"], trees["series"]
    for t in TREES:
        if trees[t] is None:
            out["problems"].append(f"{t}: no result ({run_dir / (t + '.json')} missing or holds an error)")
    if pr and se:
        diverged = next((i + 1 for i, (a, b) in enumerate(zip(pr["losses_hex"], se["losses_hex"])) if a != b), None)
        if len(pr["losses_hex"]) != len(se["losses_hex"]):
            out["problems"].append(f"step counts differ: pristine {len(pr['losses_hex'])}, series {len(se['losses_hex'])}")
        if diverged is not None:
            out["problems"].append(f"lm loss differs at step {diverged}: pristine {pr['losses_hex'][diverged - 1]}, "
                                   f"series {se['losses_hex'][diverged - 1]}")
        if pr["init_params_checksums"] != se["init_params_checksums"]:
            out["problems"].append(f"the trees start from different weights: pristine {pr['init_params_checksums']}, "
                                   f"series {se['init_params_checksums']} (the worker's seeding)")
        if pr["params_checksums"] != se["params_checksums"] or len(se["params_checksums"]) != 1:
            out["problems"].append(f"params after training differ: pristine {pr['params_checksums']}, "
                                   f"series {se['params_checksums']}")
        out["losses_bitwise_equal"] = diverged is None and len(pr["losses_hex"]) == len(se["losses_hex"])
        for key in ("forward_peak_extra_bytes", "step_peak_extra_bytes", "sync_peak_extra_bytes",
                    "optimizer_sync_peak_extra_bytes"):
            if pr[key] is not None and se[key] is not None:
                out[key.replace("_bytes", "_saved_bytes")] = pr[key] - se[key]
        for path, prefix in (("param sync", ""), ("optimizer gather", "optimizer_")):
            c_pr, c_se = pr[prefix + "sync_gather_calls"], se[prefix + "sync_gather_calls"]
            # The optimizer's gather broadcasts each param in place (series patch 0006): one
            # NCCL call per param, in at most the pristine tree's launches; the param sync's
            # calls are at most the pristine tree's.
            more_ops = c_se["ops"] > c_pr["ops"] and not prefix
            if more_ops or c_se["launches"] > c_pr["launches"] or c_se["zero_size_ops"]:
                out["problems"].append(
                    f"series {path}: {c_se['ops']} NCCL calls ({c_se['zero_size_ops']} zero-size) in "
                    f"{c_se['launches']} launches, pristine {c_pr['ops']} in {c_pr['launches']}")
            sync = se[prefix + "sync_peak_extra_bytes_per_rank"]
            if run["backend"] == "nccl" and any(b != 0 for b in sync):
                out["problems"].append(
                    f"series {path} allocated on NCCL: {[fmt_bytes(b) for b in sync]} per rank")
        if run.get("config") == "equal_shares":
            # What the run is for: a bucket whose shares are equal, gathered by the series with
            # one all_gather_into_tensor. Without both, it proved nothing.
            if not se["buckets_with_equal_shares"]:
                out["problems"].append("equal_shares: no bucket with equal shares (the model config does not "
                                       "make them at this DP size)")
            if not se["sync_gather_calls"]["into_tensor"]:
                out["problems"].append("equal_shares: the series param sync made no all_gather_into_tensor")
        if run.get("config") == "llama3_8b_layers":
            out["prediction"] = compare_prediction(run.get("prediction"), trees)
            out["problems"] += out["prediction"]["problems"]
    out["ok"] = not out["problems"]
    return out


def compare_prediction(prediction: Optional[dict], trees: dict) -> dict:
    """The real-shape run's measured peaks beside the audit's prediction: ``rows`` (tree,
    window, DP rank, predicted, tolerance, measured, problem) and ``problems``: a peak beyond
    the allocator rounding (``real_shapes.compare``), buckets or shares that are not the
    audit's, or no prediction at all."""
    from harness.gpu_check import real_shapes

    out: Dict[str, Any] = {"rows": [], "problems": []}
    if not prediction:
        out["problems"].append("no real-shape prediction in the plan (python -m harness.gpu_check.real_shapes --write)")
        return out
    keys = {"sync": "sync_peak_extra_bytes_per_rank", "sync_optimizer": "optimizer_sync_peak_extra_bytes_per_rank"}
    for tree in TREES:
        got, want = trees.get(tree), prediction["trees"].get(tree)
        if got is None or want is None:
            continue
        layout = [[b["numel"], b["shares"]] for b in want["ranks"][0]["buckets"]]
        if got["bucket_layout"] != layout:
            out["problems"].append(f"{tree}: buckets and shares differ from the audit's model "
                                   f"({len(got['bucket_layout'])} vs {len(layout)} buckets): the comparison is void")
            continue
        for window, key in keys.items():
            for r in want["ranks"]:
                rank = r["dp_rank"]
                measured = got[key][rank] if rank < len(got[key]) else None
                predicted = r["predicted"][window]
                problem = real_shapes.compare(measured, predicted)
                out["rows"].append({"tree": tree, "window": window, "dp_rank": rank, "predicted": predicted["bytes"],
                                    "tolerance": predicted["tolerance_bytes"], "measured": measured, "problem": problem})
                if problem:
                    out["problems"].append(f"{tree} {window} DP rank {rank}: {problem}")
    return out


def summarize_timing(run: dict, run_dir: Path) -> dict:
    """The optimizer-gather timing's entry: the worker's document (``timing``) and problems."""
    doc = load_json(run_dir / "gather_timing.json")
    if doc is None:
        return {"ok": False, "timing": None, "problems": [f"{run_dir / 'gather_timing.json'} missing"]}
    problems = [f"{path}: a param differs from its owner's after the gather"
                for path in TREES if not doc["checks"][path]["synced"]]
    if not doc["series_in_place"]:
        problems.append("series: a param is not a plain contiguous tensor (the flatten-and-gather fallback ran)")
    if not (doc["pristine_uses_list_all_gather"] and doc["series_uses_coalescing_manager"]):
        problems.append("the two gathers are not the pristine list all_gather and the series' grouped broadcasts")
    return {"ok": not problems, "timing": doc, "problems": problems}


def summarize_functional(run: dict, run_dir: Path) -> dict:
    """A functional run's entry: ok for "identical", or for "no_golden" (series == pristine,
    no golden values for this GPU type yet) with the values recorded under ``run_dir/golden``
    (``functional.passed``); ``golden_recorded`` and ``golden_commit_command`` say where and
    how to commit them."""
    from harness.gpu_check.functional import passed
    from harness.gpu_check.plan import CASE

    case = run.get("case") or CASE  # results folders written before runs named their case
    comparison = load_json(run_dir / case / "comparison.json")
    if comparison is None:
        return {"ok": False, "verdict": "no result", "problems": [f"{run_dir / case / 'comparison.json'} missing"]}
    ok = passed(comparison)
    return {
        "ok": ok,
        "golden_recorded": comparison.get("golden_recorded") if ok else None,
        "golden_commit_command": comparison.get("golden_commit_command") if ok else None,
        "verdict": comparison.get("verdict"),
        "verdict_line": comparison.get("verdict_line"),
        "first_divergence": comparison.get("first_divergence"),
        "golden_file": comparison.get("golden_file"),
        "wall_s": comparison.get("wall_s"),
        "problems": [] if ok else list(comparison.get("failures", []))[:5],
    }


def summarize(out: Path) -> dict:
    """Everything the report says, from the results folder ``out`` (see module docstring).

    Raises:
        ResultsError: ``out/plan.json`` is missing or not JSON.
    """
    out = Path(out)
    plan = load_json(out / "plan.json")
    if plan is None:
        raise ResultsError(f"{out} holds no readable plan.json: not a GPU check results folder")
    statuses = {s["name"]: s for s in (load_json(out / "runs.json") or [])}

    runs = []
    for run in plan["runs"]:
        status = statuses.get(run["name"], {"status": "not_run", "returncode": None, "seconds": None})
        entry = {"name": run["name"], "kind": run["kind"], "backend": run["backend"], "nproc": run["nproc"],
                 "devices": run["devices"], "status": status["status"], "returncode": status.get("returncode"),
                 "seconds": status.get("seconds"), "timeout_s": run["timeout_s"]}
        entry.update(base=run.get("base", "0.17.1"), shared_gpu=run.get("shared_gpu", False))
        if status["status"] == "skipped":
            entry.update(ok=None, skipped=True, verdict_line=status.get("reason") or run.get("skip_reason"),
                         problems=[])
            runs.append(entry)
            continue
        if run["kind"] == "memory":
            entry["config"] = run["config"]
            entry.update(summarize_memory(run, out / run["name"]))
        elif run["kind"] == "timing":
            entry.update(summarize_timing(run, out / run["name"]))
        else:
            entry.update(summarize_functional(run, out / run["name"]))
        if status["status"] != "ok":
            entry["ok"] = False
            entry["problems"] = [f"run {status['status']}" + (f" (exit {status['returncode']})"
                                                              if status.get("returncode") not in (None, 0) else ""),
                                 *entry.get("problems", [])]
        runs.append(entry)
    return {
        "environment": load_json(out / "environment.json") or {},
        "gpus": plan["gpus"], "gpu_name": plan["gpu_name"],
        "total_seconds": sum(r["seconds"] or 0 for r in runs),
        "budget_s": plan["budget_s"],
        "runs": runs,
        "skipped": [r["name"] for r in runs if r.get("skipped")],
        "ok": any(not r.get("skipped") for r in runs) and all(r["ok"] for r in runs if not r.get("skipped")),
    }


def _memory_lines(r: dict) -> List[str]:
    pr, se = r["trees"]["pristine"], r["trees"]["series"]
    any_tree = pr or se
    lines = []
    if any_tree:
        lines.append(f"  model: {any_tree['param_count'] / 1e6:.1f} M params, {fmt_bytes(any_tree['param_bytes'])} "
                     f"of bf16 params, {any_tree['buckets']} buckets ({any_tree['buckets_with_equal_shares']} "
                     f"with equal shares)")
    rows = [("forward peak over allocated", "forward_peak_extra_bytes"),
            ("memory reserved after forward", "forward_reserved_bytes"),
            ("step peak over allocated", "step_peak_extra_bytes"),
            ("param sync alone", "sync_peak_extra_bytes"),
            ("optimizer gather alone", "optimizer_sync_peak_extra_bytes")]
    lines.append(f"  {'':32s}{'pristine':>12s}{'series':>12s}{'saved':>12s}")
    for label, key in rows:
        p = pr[key] if pr else None
        s = se[key] if se else None
        saved = None if p is None or s is None else p - s
        lines.append(f"  {label:32s}{fmt_bytes(p):>12s}{fmt_bytes(s):>12s}"
                     f"{(fmt_bytes(saved) if key != 'forward_reserved_bytes' else ''):>12s}")
    for t, tree, key in (("pristine", pr, "sync"), ("series", se, "sync"),
                         ("pristine", pr, "optimizer_sync"), ("series", se, "optimizer_sync")):
        if tree:
            c = tree[key + "_gather_calls"]
            what = "param all-gather per sync" if key == "sync" else "optimizer gather"
            lines.append(f"  {t} {what}: {c['list_equal']} list (equal shares), "
                         f"{c['list_unequal']} list (unequal), {c['into_tensor']} into_tensor, "
                         f"{c['broadcast']} broadcast; {c['ops']} NCCL calls ({c['zero_size_ops']} zero-size) "
                         f"in {c['launches']} launches, {fmt_bytes(c['wire_bytes'])} received; "
                         f"NCCL would allocate {fmt_bytes(c['nccl_temporary_bytes'])}")
    if "losses_bitwise_equal" in r:
        n = len(pr["losses_hex"])
        lines.append(f"  lm loss over {n} steps: {'bitwise equal' if r['losses_bitwise_equal'] else 'DIFFERS'}")
    if r.get("prediction"):
        lines.append("  measured CUDA peak beside the real-shape audit's prediction (per DP rank; +- allocator "
                     "rounding, 512 B per allocation):")
        for row in r["prediction"]["rows"]:
            what = "param sync" if row["window"] == "sync" else "optimizer gather"
            lines.append(f"    {row['tree']} {what} rank {row['dp_rank']}: predicted {row['predicted']} B "
                         f"(+-{row['tolerance']}), measured {row['measured']} B: "
                         f"{'agrees' if not row['problem'] else 'DISAGREES'}")
    return lines


def timing_lines(doc: Optional[dict]) -> List[str]:
    """The optimizer-gather timing's lines (``gather_timing_worker.py``'s document)."""
    if not doc:
        return []
    ms = {p: doc["median_s"][p] * 1e3 for p in TREES}
    r = doc["ratio"]
    ops = doc["nccl_ops"]
    peak = {p: _max(doc["checks"][p]["peak_extra_bytes"]) for p in TREES}
    lines = [f"  optimizer gather (allgather_params), {doc['param_count']} params ({doc['layers']} layers, "
             f"{fmt_bytes(doc['param_bytes'])}) on DP {doc['world']}, {doc['backend']}"
             f"{' ' + doc['nccl'] if doc.get('nccl') else ''}: {doc['rounds']} rounds x {doc['block']} gathers "
             f"per path, interleaved (ABBA), slowest rank"
             f"{' (fewer than the ' + str(doc['rounds_asked']) + ' asked: slow gathers)' if doc.get('rounds_asked', doc['rounds']) > doc['rounds'] else ''}",
             f"    pristine (list all_gather, {ops['pristine']} NCCL ops): median {ms['pristine']:.3f} ms, "
             f"CUDA peak over allocated {fmt_bytes(peak['pristine'])}",
             f"    series (in-place broadcasts, {ops['series']} NCCL ops in one group): median "
             f"{ms['series']:.3f} ms, CUDA peak over allocated {fmt_bytes(peak['series'])}",
             f"    series/pristine time: {r['ratio']:.2f} [{r['ci_lo']:.2f}, {r['ci_hi']:.2f}] "
             f"(median of {r['rounds']} per-round ratios, 95 % bootstrap CI)"]
    if doc.get("shared_gpu") or doc["backend"] != "nccl":
        lines.append("    these times decide nothing: "
                     + ("the ranks share one GPU through NCCL's socket transport (real NCCL code, no NVLink)"
                        if doc["backend"] == "nccl" else "gloo runs every broadcast as its own call"))
    return lines


def render(summary: dict) -> str:
    """The text report: header, one block per run, and the problems that failed a run."""
    env = summary.get("environment", {})
    verdict = "PASS" if summary["ok"] else "FAIL"
    n_ok = sum(bool(r["ok"]) for r in summary["runs"])
    skipped = summary.get("skipped") or []
    recorded = [r for r in summary["runs"] if r.get("golden_recorded")]
    note = (f"; golden values recorded in OUT for {len(recorded)} run(s), commit them (commands below)"
            if recorded else "")
    lines = [
        f"GPU check: {summary['gpus']} x {summary['gpu_name']}; torch {env.get('torch', '?')}, "
        f"megatron-core {env.get('megatron_core', '?')}, driver {env.get('driver', '?')}; {env.get('date_utc', '')}",
        f"{verdict}: {n_ok}/{len(summary['runs']) - len(skipped)} runs ok"
        f"{f', {len(skipped)} skipped' if skipped else ''} in {summary['total_seconds']:.0f} s of run time "
        f"(budget {summary['budget_s']} s for the schedule){note}",
    ]
    if any(r.get("shared_gpu") and r["backend"] == "nccl" for r in summary["runs"]):
        lines.append("NCCL runs on one GPU (ranks share it through NCCL's socket transport): they prove NCCL's code "
                     "paths and its real CUDA memory, not time (sockets, not NVLink).")
    for r in summary["runs"]:
        devices = ",".join(r["devices"])
        seconds = "-" if r["seconds"] is None else f"{r['seconds']:.0f} s"
        lines.append("")
        state = "skipped" if r.get("skipped") else "ok" if r["ok"] else "FAILED"
        lines.append(f"{r['name']}: {state} (megatron-core {r.get('base', '0.17.1')}, {r['backend']}, {r['nproc']} "
                     f"ranks on {devices}; {r['status']}, {seconds})")
        if r.get("skipped"):
            lines.append(f"  {r.get('verdict_line')}")
        elif r["kind"] == "functional":
            lines.append(f"  verdict: {r.get('verdict_line') or r.get('verdict')}")
            if r.get("golden_recorded"):
                lines.append(f"  golden values recorded in OUT: {r['golden_recorded']}")
                lines.append(f"  commit them with: {r['golden_commit_command']}")
            elif r.get("golden_file"):
                lines.append(f"  golden values: {Path(r['golden_file']).name}")
        elif r["kind"] == "timing":
            lines.extend(timing_lines(r.get("timing")))
        else:
            lines.extend(_memory_lines(r))
        for p in r.get("problems", []):
            lines.append(f"  problem: {p}")
    return "\n".join(lines) + "\n"


def write(out: Path) -> dict:
    """``summarize(out)``, written to ``out/summary.json`` and ``out/report.txt``."""
    summary = summarize(out)
    Path(out, "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    Path(out, "report.txt").write_text(render(summary))
    return summary
