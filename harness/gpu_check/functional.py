"""The GPU check's functional run: the default case on both trees, on CUDA, through run_case.

    python -m harness.gpu_check.functional --backend gloo --shared-gpu \
        --golden-file golden_values_h200_gloo.json --out OUT/functional_gloo_shared_gpu

``tests/functional_tests/python_test_utils/run_case.run_case`` trains upstream and patched,
compares them bit for bit and with the golden file, and writes
``OUT/<case>/comparison.json``, the metrics and ``loss_curves.png``. What differs from
``scripts/run_functional_test.sh --device cuda``: the backend may be gloo with both ranks on
``cuda:0`` (``--shared-gpu``: ``MEGATRON_SHARED_GPU=1``), and the golden file is per GPU type
and backend (``plan.golden_file``). ``--update-golden`` records it from this run (refused
unless patched equals upstream exactly). Exit code 0 only for the verdict "identical".
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional, Sequence

from harness.gpu_check import plan


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m harness.gpu_check.functional", description=__doc__.splitlines()[0])
    ap.add_argument("--backend", choices=("gloo", "nccl"), required=True)
    ap.add_argument("--shared-gpu", action="store_true", help="all ranks on cuda:0 (gloo only)")
    ap.add_argument("--golden-file", required=True, help="file name in the case folder")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--timeout", type=float, default=100, help="seconds per training run")
    ap.add_argument("--update-golden", action="store_true")
    args = ap.parse_args(argv)
    if args.shared_gpu and args.backend != "gloo":
        ap.error("--shared-gpu needs --backend gloo (NCCL refuses two ranks on one device)")
    if Path(args.golden_file).name != args.golden_file:
        ap.error(f"--golden-file is a file name in the case folder, got {args.golden_file!r}")

    from tests.functional_tests.python_test_utils import run_case

    folder = run_case.find_case(plan.CASE)
    comparison = run_case.run_case(
        plan.CASE, device="cuda", update_golden=args.update_golden, timeout_s=args.timeout,
        out_root=args.out, golden_path=folder / args.golden_file,
        model_args=plan.functional_overrides(args.backend),
        extra_env=plan.SHARED_GPU_ENV if args.shared_gpu else None,
    )
    return 0 if comparison["verdict"] == "identical" else 1


if __name__ == "__main__":
    sys.exit(main())
