"""Measure the run-to-run and machine-to-machine variation that the golden tolerance covers.

The golden check (tolerances.GOLDEN_RULES) needs a relative tolerance that passes on any
reviewer's machine yet stays tight enough to flag a real change. This script measures
the spread it has to absorb, on the default case, series tree of its base:

- run to run: the same command twice on this machine;
- machine to machine: the same command with PyTorch's CPU kernels forced to another
  instruction set (ATEN_CPU_CAPABILITY=default / avx2 / avx512, the dispatch that
  differs between reviewers' CPUs) and with oneDNN capped to AVX2 (DNNL_MAX_CPU_ISA),
  which changes the vectorised reduction orders exactly as another CPU would.

Usage:
    .venv/bin/python -m tests.functional_tests.python_test_utils.measure_variation [--iters 40]

Writes build/functional/variation.json: per variation and metric, the max relative
difference from the reference run over all steps (max |a-b| / max(|b|, tiny)).
Runtime: about 25 s per variation on 2 CPU cores (5 variations).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from harness import data

from . import run_case as rc

VARIATIONS = {
    "reference": {},
    "repeat": {},
    "isa_default": {"ATEN_CPU_CAPABILITY": "default"},
    "isa_avx2": {"ATEN_CPU_CAPABILITY": "avx2", "DNNL_MAX_CPU_ISA": "AVX2"},
    "isa_avx512": {"ATEN_CPU_CAPABILITY": "avx512"},
}
METRICS = ("lm loss", "grad-norm", "params-norm", "num-zeros", "load_balancing_loss")


def max_rel_diff(a: dict, b: dict) -> float:
    """max over steps of |a-b| / |b| (steps present in both, non-nan)."""
    worst = 0.0
    for step, vb in b.items():
        va = a.get(step)
        if va is None or math.isnan(va) or math.isnan(vb):
            continue
        worst = max(worst, abs(va - vb) / max(abs(vb), 1e-12))
    return worst


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", default=rc.DEFAULT_CASE)
    ap.add_argument("--out", type=Path, default=rc.OUT_ROOT / "variation.json")
    args = ap.parse_args(argv)
    case = rc.load_case(rc.find_case(args.case))
    artifacts = data.prepare(log=lambda m: None)
    base = rc.BASES[case.base]
    runs = {}
    for name, env in VARIATIONS.items():
        res = rc.run_variant(
            case, base.trees["series"], rc.OUT_ROOT / "variation" / name, str(artifacts.data_prefix),
            "cpu", timeout_s=900, extra_env={"MEGATRON_LM_CHECKOUT": str(base.checkout), **env}, record_memory=False,
        )
        if res.failures:
            raise SystemExit(f"{name}: {res.failures[0]}")
        runs[name] = res.metrics
        print(f"{name:12s} {res.wall_s:5.1f} s", flush=True)
    ref = runs["reference"]
    report = {"case": case.name, "variations": VARIATIONS, "max_rel_diff": {}}
    for name, metrics in runs.items():
        if name == "reference":
            continue
        report["max_rel_diff"][name] = {
            m: max_rel_diff(metrics[m].values, ref[m].values) for m in METRICS if m in ref
        }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report["max_rel_diff"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
