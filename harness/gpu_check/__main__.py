"""``scripts/gpu_check.sh`` / ``python -m harness.gpu_check``: plan, run and report the GPU check.

Usage::

    scripts/gpu_check.sh OUT                      # run on this machine's GPUs, results in OUT
    scripts/gpu_check.sh --dry-run OUT            # print the runs; nothing is run or written
    scripts/gpu_check.sh --dry-run --assume-gpus 8 --assume-gpu-name "NVIDIA H100 80GB HBM3" OUT
    scripts/gpu_check.sh --update-golden OUT      # record golden values in OUT/<run>/golden even where some exist

Exit codes: 0 every run passed (a run skipped for a missing package, e.g. Transformer Engine,
neither passes nor fails); 1 a run failed or timed out (OUT/report.txt says which and why); 2 bad
usage or a machine that cannot run the check (no CUDA GPU, trees not generated, OUT not
empty); nothing was run then.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import List, Optional, Sequence

from harness.trees import REPO_ROOT

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
#: The GPU name a dry run assumes when it sees no GPU and none is given.
DEFAULT_GPU_NAME = "NVIDIA H200"


class UsageError(Exception):
    """Bad arguments or a machine that cannot run the check; exit code 2."""


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="scripts/gpu_check.sh",
                                 description="The series on CUDA: pristine vs series trees, functional and memory.",
                                 epilog="Exit codes: " + " ".join(__doc__.split("Exit codes:")[1].split()))
    ap.add_argument("out", type=Path, help="results folder (created; must be absent or empty)")
    ap.add_argument("--dry-run", action="store_true", help="print the runs and their commands; run nothing")
    ap.add_argument("--json", action="store_true", help="with --dry-run: print the plan as JSON")
    ap.add_argument("--assume-gpus", type=int, metavar="N",
                    help="with --dry-run: plan for N GPUs instead of the ones present")
    ap.add_argument("--assume-gpu-name", metavar="NAME", help=f"with --dry-run: GPU name (default: "
                    f"cuda:0's name, else {DEFAULT_GPU_NAME!r})")
    ap.add_argument("--checkout", type=Path, metavar="PATH",
                    help="your own Megatron-LM git checkout (docs/own_tree.md): the functional runs of its "
                    "series' base train PATH as it is and with the series, in scratch clones; the runs "
                    "of the pinned 0.17.1 trees are planned as skipped")
    ap.add_argument("--update-golden", action="store_true",
                    help="record golden values in OUT/<run>/golden even where the checkout has some (refused unless series == pristine; without a golden file for this GPU type they are recorded anyway)")
    return ap


def _check_args(args) -> None:
    if not args.dry_run:
        for flag, value in (("--assume-gpus", args.assume_gpus), ("--assume-gpu-name", args.assume_gpu_name),
                            ("--json", args.json or None)):
            if value is not None:
                raise UsageError(f"{flag} is only for --dry-run (a real run uses the GPUs it finds)")
    if args.assume_gpus is not None and args.assume_gpus < 1:
        raise UsageError(f"--assume-gpus must be >= 1, got {args.assume_gpus}")
    if args.out.exists() and not args.out.is_dir():
        raise UsageError(f"OUT {args.out} exists and is not a folder")
    if not args.dry_run and args.out.is_dir() and any(args.out.iterdir()):
        raise UsageError(f"OUT {args.out} is not empty: give a new folder, so that results of two runs never mix")
    for tree in (REPO_ROOT / "build" / "upstream" / "megatron", REPO_ROOT / "megatron"):
        if not (tree / "core" / "__init__.py").is_file():
            raise UsageError(f"{tree} is missing: run scripts/setup.sh first (the Docker image has it)")


def environment(gpus: int, gpu_name: str) -> dict:
    """What the report's header says about the machine."""
    import torch

    def sh(cmd: List[str]) -> str:
        try:
            return subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError) as exc:
            return f"unavailable ({exc})"

    smi = sh(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"])
    driver = smi.splitlines()[0].split(",")[-1].strip() if smi and "," in smi else "?"
    try:
        from megatron.core import package_info

        mcore = package_info.__version__
    except Exception:  # noqa: BLE001 - reported as unknown
        mcore = "?"
    return {"date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "gpus": gpus, "gpu_name": gpu_name,
            "nvidia_smi": smi, "driver": driver, "torch": torch.__version__, "cuda": torch.version.cuda,
            "python": platform.python_version(), "megatron_core": mcore}


def _run_process(argv: Sequence[str], env: Optional[dict], log: Path, timeout_s: float) -> tuple:
    """Run ``argv`` in its own process group, output to ``log``; (status, returncode, seconds)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    with open(log, "w") as f:
        proc = subprocess.Popen(list(argv), env=env, cwd=REPO_ROOT, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=max(timeout_s, 1))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return "timeout", None, time.monotonic() - t0
    return ("ok" if rc == 0 else "failed"), rc, time.monotonic() - t0


def run_one(run, plan) -> dict:
    """Run one run of ``plan`` (its launches in order, or its functional driver); its status
    dict: name, status ("ok", "failed", "timeout", "skipped"), returncode, seconds, lane."""
    from harness.gpu_check.plan import functional_command

    run_dir = plan.out / run.name
    if run.skip_reason:
        print(f"gpu_check: {run.name}: {run.skip_reason}", flush=True)
        return {"name": run.name, "status": "skipped", "returncode": None, "seconds": 0.0,
                "reason": run.skip_reason, "lane": run.lane}
    print(f"gpu_check: {run.name} ({run.backend}, {run.nproc} ranks on {','.join(run.devices)}, "
          f"timeout {run.timeout_s} s, lane {'exclusive' if run.exclusive else run.lane}) ...", flush=True)
    if run.kind == "functional":
        env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), PYTHONUNBUFFERED="1")
        status, rc, secs = _run_process(functional_command(run, plan), env, run_dir / "driver.log", run.timeout_s)
    else:
        status, rc, secs = "ok", 0, 0.0
        for x in run.launches:
            left = run.timeout_s - secs
            s, code, dt = _run_process(x.argv, x.env, run_dir / f"{x.tree}.log",
                                       min(left, run.timeout_s / len(run.launches) + 15))
            secs += dt
            if s != "ok":
                status, rc = s, code
                break
    print(f"gpu_check: {run.name}: {status} after {secs:.0f} s (logs in {run_dir})", flush=True)
    return {"name": run.name, "status": status, "returncode": rc, "seconds": round(secs, 1), "lane": run.lane}


def execute(plan) -> List[dict]:
    """Run the plan: its exclusive runs one after another, then its lanes side by side (each
    lane's runs in order, ``plan.assign_lanes``). Each run's status goes to OUT/runs.json as
    soon as it ends; the file keeps the plan's order."""
    import threading

    statuses = {}
    lock = threading.Lock()
    order = [r.name for r in plan.runs]

    def record(status: dict) -> None:
        with lock:
            statuses[status["name"]] = status
            done = [statuses[n] for n in order if n in statuses]
            (plan.out / "runs.json").write_text(json.dumps(done, indent=1) + "\n")

    for run in plan.runs:
        if run.exclusive:
            record(run_one(run, plan))
    lanes = {}
    for run in plan.runs:
        if not run.exclusive:
            lanes.setdefault(run.lane, []).append(run)

    def lane_worker(runs) -> None:
        for run in runs:
            record(run_one(run, plan))

    threads = [threading.Thread(target=lane_worker, args=(runs,), daemon=True) for runs in lanes.values()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [statuses[n] for n in order if n in statuses]


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = _parser()
    args = ap.parse_args(argv)
    try:
        _check_args(args)
        gpus, name = None, None
        if not (args.dry_run and args.assume_gpus and args.assume_gpu_name):  # torch takes seconds to import
            import torch

            gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
            name = torch.cuda.get_device_name(0) if gpus else None
        if args.dry_run:
            plan_gpus = args.assume_gpus or max(gpus, 1)
            plan_name = args.assume_gpu_name or name or DEFAULT_GPU_NAME
        else:
            if gpus == 0:
                raise UsageError("no CUDA GPU found (torch.cuda.device_count() is 0); run on a machine with "
                                 "a GPU (docker run --gpus all ...), or use --dry-run to see the plan")
            plan_gpus, plan_name = gpus, name
        from harness.gpu_check import plan as plan_mod

        own = None
        if args.checkout is not None:
            from harness import own_tree

            if args.update_golden:
                raise UsageError("--update-golden with --checkout: golden values come from the pinned releases only")
            try:
                own = own_tree.prepare(args.checkout, log=lambda m: print(m, file=sys.stderr))
            except own_tree.OwnTreeError as exc:
                raise UsageError(str(exc)) from None
        try:
            plan = plan_mod.make_plan(plan_gpus, plan_name, args.out, args.update_golden,
                                      with_te=plan_mod.te_available(), own=own)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
    except UsageError as exc:
        print(f"gpu_check: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if args.dry_run:
        if not gpus and args.assume_gpus is None:
            print(f"gpu_check: no GPU here; planning for {plan_gpus} ({plan_name})", file=sys.stderr)
        print(json.dumps(plan.as_dict(), indent=1) if args.json else plan_mod.format_plan(plan))
        return EXIT_OK

    from harness.gpu_check import report

    plan.out.mkdir(parents=True, exist_ok=True)
    (plan.out / "plan.json").write_text(json.dumps(plan.as_dict(), indent=1) + "\n")
    (plan.out / "environment.json").write_text(json.dumps(environment(plan_gpus, plan_name), indent=1) + "\n")
    execute(plan)
    summary = report.write(plan.out)
    print(report.render(summary), end="")
    return EXIT_OK if summary["ok"] else EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
