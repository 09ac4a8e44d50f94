"""The GPU check's functional run: the default case on both trees, on CUDA, through run_case.

    python -m harness.gpu_check.functional --backend gloo --shared-gpu \
        --golden-file golden_values_h200_gloo.json --out OUT/functional_gloo_shared_gpu

``tests/functional_tests/python_test_utils/run_case.run_case`` trains pristine and series,
compares them bit for bit and with the golden file, and writes
``OUT/<case>/comparison.json``, the metrics and ``loss_curves.png``. What differs from
``scripts/run_functional_test.sh --device cuda``: the backend may be gloo, ranks may share
GPUs (``--shared-gpu``: ``MEGATRON_SHARED_GPU=1``, and for NCCL ``NCCL_SOCKET_IFNAME=lo``
with a ``NCCL_HOSTID`` per rank), and the golden file is per GPU type and backend
(``plan.golden_file``).

Golden values are never written into the checkout (in ``docker run --rm`` it is gone when the
container exits). When the case folder has no golden file for this GPU type and backend, or
with ``--update-golden``, the run is compared with no golden file, and if series equals
pristine bit for bit (``golden_update.update_golden`` refuses otherwise) the values are
recorded in ``OUT/golden/<golden file>``; ``comparison.json`` then names that file
(``golden_recorded``) and the command that commits it (``golden_commit_command``), and the
run passes. Exit code 0 for the verdict "identical", or "no_golden" with values recorded.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path
from typing import Optional, Sequence

from harness.gpu_check import plan


def passed(comparison: dict) -> bool:
    """Whether a functional run's comparison passes: "identical", or "no_golden" (series
    equal to pristine, no golden file yet) with golden values recorded in OUT."""
    return comparison.get("verdict") == "identical" or (
        comparison.get("verdict") == "no_golden" and bool(comparison.get("golden_recorded")))


def commit_command(recorded: Path, out_root: Path, case_folder: Path) -> str:
    """The shell line, run in the checkout, that copies ``recorded`` (a file under the
    results folder ``out_root``, shown as ``OUT/...``) into ``case_folder`` and commits it."""
    from harness.trees import REPO_ROOT

    try:
        dest = case_folder.resolve().relative_to(REPO_ROOT)
    except ValueError:
        dest = case_folder
    try:
        shown = "OUT/" + str(recorded.resolve().relative_to(out_root.resolve()))
    except ValueError:
        shown = str(recorded)
    target = dest / recorded.name
    return (f"cp {shlex.quote(shown)} {shlex.quote(str(dest))}/ && git add {shlex.quote(str(target))} && "
            f"git commit -m {shlex.quote(f'golden values: {recorded.stem} (scripts/gpu_check.sh)')}")


def record_golden(comparison: dict, case_out: Path, golden_out: Path, rules) -> dict:
    """After a "no_golden" verdict: write the golden values of the two runs in ``case_out``
    (``pristine/``, ``series/``) to ``golden_out``; the comparison gains ``golden_recorded``
    (the path) or, where ``golden_update.update_golden`` refuses, a failure and verdict
    "failed". Other verdicts are returned unchanged."""
    from tests.functional_tests.python_test_utils import golden_update
    from tests.functional_tests.python_test_utils import tensorboard_reader as tbr

    if comparison.get("verdict") != "no_golden":
        return comparison
    comparison = dict(comparison)
    try:
        golden_out.parent.mkdir(parents=True, exist_ok=True)
        golden_update.update_golden(golden_out, tbr.load_run_metrics(case_out / "pristine"),
                                    tbr.load_run_metrics(case_out / "series"), rules)
    except (golden_update.GoldenUpdateRefused, OSError, ValueError) as exc:
        comparison["verdict"] = "failed"
        comparison["verdict_line"] = f"failed: golden values not recorded: {exc}"
        comparison["failures"] = [*comparison.get("failures", []), f"golden values not recorded: {exc}"]
        return comparison
    comparison["golden_recorded"] = str(golden_out)
    comparison["verdict_line"] = (f"series == pristine exactly; no golden values for this GPU type yet: "
                                  f"golden values recorded in OUT ({golden_out})")
    return comparison


def main(argv: Optional[Sequence[str]] = None) -> int:
    """CLI (see the module docstring); exit 0 when ``passed``, else 1; 2 on bad arguments."""
    ap = argparse.ArgumentParser(prog="python -m harness.gpu_check.functional", description=__doc__.splitlines()[0])
    ap.add_argument("--backend", choices=("gloo", "nccl"), required=True)
    ap.add_argument("--shared-gpu", action="store_true",
                    help="ranks share the GPUs (MEGATRON_SHARED_GPU=1; with nccl each rank gets its own "
                         "NCCL_HOSTID and NCCL_SOCKET_IFNAME=lo: NCCL's socket transport)")
    ap.add_argument("--golden-file", required=True, help="file name in the case folder")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--timeout", type=float, default=100, help="seconds per training run")
    ap.add_argument("--update-golden", action="store_true",
                    help="record golden values in OUT/golden even where the case folder has some")
    ap.add_argument("--megatron-defaults", action="store_true",
                    help="no harness runtime flags: Transformer Engine, fused wgrad into main_grad, fused kernels")
    ap.add_argument("--case", default=plan.CASE, help="functional test case (default: %(default)s)")
    ap.add_argument("--checkout", type=Path, metavar="PATH",
                    help="train your own Megatron-LM checkout as it is and with the series (harness.own_tree)")
    args = ap.parse_args(argv)
    if Path(args.golden_file).name != args.golden_file:
        ap.error(f"--golden-file is a file name in the case folder, got {args.golden_file!r}")

    from harness import own_tree
    from tests.functional_tests.python_test_utils import run_case, tolerances

    folder = run_case.find_case(args.case)
    repo_golden = folder / args.golden_file
    golden_out = args.out / "golden" / args.golden_file
    # With --update-golden the run is compared with no golden file (the one in OUT does not
    # exist yet), so that the verdict is "no_golden" exactly when series == pristine.
    comparison = run_case.run_case(
        args.case, device="cuda", timeout_s=args.timeout, out_root=args.out,
        golden_path=golden_out if args.update_golden else repo_golden,
        model_args=plan.functional_overrides(args.backend),
        extra_env=plan.shared_gpu_env(args.backend) if args.shared_gpu else None,
        runtime_flags=not args.megatron_defaults,
        own=own_tree.prepare(args.checkout) if args.checkout is not None else None,
    )
    case = run_case.load_case(folder)
    comparison = record_golden(comparison, args.out / case.name, golden_out, tolerances.rules_for(case.metrics))
    if comparison.get("golden_recorded"):
        comparison["golden_commit_command"] = commit_command(golden_out, args.out.parent, folder)
        print(f"  {comparison['verdict_line']}\n  commit them with: {comparison['golden_commit_command']}",
              flush=True)
    (args.out / case.name / "comparison.json").write_text(json.dumps(comparison, indent=1) + "\n")
    return 0 if passed(comparison) else 1


if __name__ == "__main__":
    sys.exit(main())
