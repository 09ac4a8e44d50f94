#!/usr/bin/env python3
"""Call upstream layer-wise optimizer tests once per RNG seed, inside one torchrun, per tree.

Upstream's ``test_parameter_updates`` and ``test_overlap_param_gather_parameter_updates``
(``tests/unit_tests/test_layer_wise_optimizer.py``) draw the model init and the grads from
the default generator without seeding it, and compare the layer-wise optimizer's bf16 params
after one step with a non-layer-wise reference's at ``rtol=atol=1e-5``. To tell a rare
rounding difference of the test from a bug of the series, this script imports the test
module from each Megatron-LM checkout (``upstream_runner.CHECKOUTS``) and, in ONE torchrun of
``--nproc`` CPU gloo ranks (``cpu_gloo_plugin``: the same runtime and process groups as the
upstream test runs), calls each test for every seed with ``torch.manual_seed(seed)`` on every
rank just before the call (the fixture's ``Utils.initialize_model_parallel()`` before that,
the plugin's group teardown after).

While a test runs, ``torch.testing.assert_close`` records, per call, the mismatched elements,
the largest difference in bf16 ulps (distance of the bit patterns), the worst element's two
values; it does not raise (so every param of the test is checked), and the test counts as
failed where any call would have raised. ``ChainedOptimizer.step`` records each optimizer's
grad norm (the layer-wise one all-reduces per-rank partial sums of squares over the DP group,
the reference sums all grads on each rank) and the clip coefficient ``1 / (norm + 1e-6)``.

``--share-grad-norm`` is the causal check: the reference optimizer's ``get_grad_norm()``
returns the layer-wise optimizer's norm of the same test call (the layer-wise optimizer steps
first in both tests), so both clip by the same coefficient; where failures then vanish, the
grad-norm summation order is what made the params differ.

Usage (from the repository root)::

    .venv/bin/python scripts/seed_sweep_upstream_test.py --seeds 0:300 --nproc 4
    .venv/bin/python scripts/seed_sweep_upstream_test.py --seeds 17,42 --tree pristine --share-grad-norm

Output: one line per failing (tree, test, seed) and per tree a summary; under
``--out-dir`` (default ``build/seed_sweep/<label>``, label from the options) per tree
``<tree>/rank<R>.json`` (every seed, test, assert_close record and grad norm of that rank)
and ``<tree>/sweep.log`` (the torchrun output), and ``summary.json`` (rank 0's failures per
tree and test, and whether all ranks saw the same failures).

Exit status: 0 no seed failed on any tree, 1 some seed failed (see summary), 2 usage error or
missing checkout, 3 a torchrun exited non-zero or a rank wrote no report (see sweep.log).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_TESTS = ("test_parameter_updates", "test_overlap_param_gather_parameter_updates")
TEST_MODULE = "tests.unit_tests.test_layer_wise_optimizer"


def parse_seeds(spec: str) -> list:
    """``"0:300"`` (range), ``"1,5,9"``, or a mix: ``"0:10,42"``."""
    seeds = []
    for part in spec.split(","):
        part = part.strip()
        if ":" in part:
            lo, hi = part.split(":")
            seeds.extend(range(int(lo), int(hi)))
        elif part:
            seeds.append(int(part))
    return seeds


# --------------------------------------------------------------------------- worker (per rank)


def _ordered_bf16(t):
    """bf16 bit patterns as integers ordered like the values (adjacent bf16 values differ by 1)."""
    import torch

    u = t.contiguous().view(torch.int16).to(torch.int32) & 0xFFFF
    return torch.where(u >= 0x8000, -(u & 0x7FFF), u)


def _compare(actual, expected, rtol, atol) -> dict:
    """What assert_close would say, plus ulp distances, for two same-shape float tensors."""
    import torch

    a, e = actual.detach().float(), expected.detach().float()
    bad = ~torch.isclose(a, e, rtol=rtol, atol=atol)
    rec = {"shape": list(actual.shape), "dtype": str(actual.dtype), "mismatched": int(bad.sum()),
           "numel": actual.numel(), "max_abs": float((a - e).abs().max()) if a.numel() else 0.0}
    if actual.dtype == torch.bfloat16 and expected.dtype == torch.bfloat16:
        ulps = (_ordered_bf16(actual) - _ordered_bf16(expected)).abs()
        rec["max_ulp"] = int(ulps.max()) if ulps.numel() else 0
        rec["elements_off"] = int((ulps > 0).sum())
    if rec["mismatched"]:
        flat = ((a - e).abs() - atol - rtol * e.abs()).flatten()
        i = int(flat.argmax())
        rec["worst_index"] = i
        rec["worst_actual"] = float(a.flatten()[i])
        rec["worst_expected"] = float(e.flatten()[i])
    return rec


def worker(args) -> int:
    checkout = Path(os.environ["MEGATRON_LM_CHECKOUT"]).resolve()
    os.chdir(checkout)
    sys.path.insert(0, str(checkout))  # megatron and tests.unit_tests from the checkout
    import cpu_gloo_plugin  # noqa: F401  (installs the CPU runtime, gloo Utils, group tracking)
    import importlib

    import torch

    from megatron.core.optimizer import optimizer as opt_mod
    from megatron.core.optimizer.layer_wise_optimizer import LayerWiseDistributedOptimizer
    from tests.unit_tests.test_utilities import Utils

    rank = int(os.environ["RANK"])
    Utils.initialize_distributed()
    mod = importlib.import_module(TEST_MODULE)
    names = [n for n, _ in mod.SimpleModel().named_parameters()]

    current = {"calls": [], "norms": [], "shared": None}
    real_assert_close = torch.testing.assert_close

    def recording_assert_close(actual, expected, *a, rtol=None, atol=None, **kw):
        idx = len(current["calls"])
        rec = {"call": idx, "param": names[idx % len(names)], "rtol": rtol, "atol": atol}
        try:
            real_assert_close(actual, expected, *a, rtol=rtol, atol=atol, **kw)
            rec["ok"] = True
        except AssertionError as exc:
            rec["ok"] = False
            rec["message"] = " | ".join(line.strip() for line in str(exc).splitlines() if line.strip())
        if isinstance(actual, torch.Tensor) and isinstance(expected, torch.Tensor) \
                and actual.shape == expected.shape and actual.is_floating_point():
            rec.update(_compare(actual, expected, rtol if rtol is not None else 1.3e-6,
                                atol if atol is not None else 1e-5))
        current["calls"].append(rec)

    real_step = opt_mod.ChainedOptimizer.step
    real_chained_norm = opt_mod.ChainedOptimizer.get_grad_norm
    real_lw_norm = LayerWiseDistributedOptimizer.get_grad_norm

    def recording_step(self):
        out = real_step(self)
        gn = out[1]
        gn = float(gn) if gn is not None else None
        current["norms"].append({
            "optimizer": type(self).__name__, "grad_norm": gn,
            "grad_norm_hex": gn.hex() if gn is not None else None,
            "clip_coeff_fp32_hex": (float(torch.tensor(1.0 / (gn + 1e-6), dtype=torch.float32))
                                    .hex() if gn is not None else None),
        })
        return out

    def lw_norm(self):
        gn = real_lw_norm(self)
        current["shared"] = gn
        return gn

    def ref_norm(self):
        gn = real_chained_norm(self)
        if args.share_grad_norm and type(self) is opt_mod.ChainedOptimizer \
                and current["shared"] is not None:
            current["norms"].append({"optimizer": "reference-own-norm", "grad_norm": float(gn),
                                     "grad_norm_hex": float(gn).hex()})
            return current["shared"]
        return gn

    opt_mod.ChainedOptimizer.step = recording_step
    opt_mod.ChainedOptimizer.get_grad_norm = ref_norm
    LayerWiseDistributedOptimizer.get_grad_norm = lw_norm
    torch.testing.assert_close = recording_assert_close

    out_path = Path(args.out) / f"rank{rank}.json"
    results = []
    t0 = time.monotonic()
    inst = mod.TestLayerWiseOptimizer()
    try:
        for seed in args.seed_list:
            for test in args.tests:
                Utils.initialize_model_parallel()  # the setup_and_teardown fixture
                torch.manual_seed(seed)
                current.update(calls=[], norms=[], shared=None)
                error = None
                try:
                    getattr(inst, test)()
                except AssertionError as exc:  # a plain assert of the test
                    error = f"AssertionError: {exc}"
                finally:
                    Utils.destroy_model_parallel()
                    cpu_gloo_plugin._destroy_created_groups()
                failed = error is not None or any(not c["ok"] for c in current["calls"])
                entry = {"seed": seed, "test": test, "failed": failed, "error": error,
                         "calls": [c for c in current["calls"] if not c["ok"] or c.get("max_ulp")],
                         "n_calls": len(current["calls"]), "norms": current["norms"]}
                results.append(entry)
                if rank == 0 and (failed or seed % 25 == 0):
                    off = [f"{c['param']}: {c['mismatched']}/{c['numel']} mismatched, "
                           f"max {c.get('max_ulp')} ulp" for c in entry["calls"] if not c["ok"]]
                    print(f"[sweep] seed {seed} {test}: {'FAILED ' + '; '.join(off) if failed else 'ok'}"
                          f" ({time.monotonic() - t0:.0f} s)", flush=True)
    finally:
        out_path.write_text(json.dumps({"rank": rank, "results": results}, indent=1) + "\n")
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    return 0


# --------------------------------------------------------------------------- driver


def sweep_command(tree: str, args, out_dir: Path):
    """``(argv, env, checkout)`` of one tree's sweep: torchrun (``harness.launch.torchrun_argv``)
    of this file's ``--worker`` in the tree's checkout, with ``upstream_runner.command``'s env."""
    sys.path.insert(0, str(REPO_ROOT))
    from harness import launch
    from tests.upstream_tests import upstream_runner as ur

    checkout = ur.CHECKOUTS[tree]
    _, env = ur.command(checkout, [], args.nproc, out_dir)
    argv = [*launch.torchrun_argv(args.nproc), str(Path(__file__).resolve()), "--worker", "--out",
            str(out_dir), "--seeds", args.seeds, "--tests", ",".join(args.tests)]
    if args.share_grad_norm:
        argv.append("--share-grad-norm")
    return argv, env, checkout


def run_tree(tree: str, args, out_dir: Path) -> dict:
    out_dir.mkdir(parents=True, exist_ok=True)
    for old in out_dir.glob("rank*.json"):
        old.unlink()
    argv, env, checkout = sweep_command(tree, args, out_dir)
    t0 = time.monotonic()
    with open(out_dir / "sweep.log", "w") as log:
        log.write(shlex.join(argv) + "\n")
        log.flush()
        proc = subprocess.Popen(argv, env=env, cwd=checkout, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        for line in proc.stdout:
            log.write(line)
            if line.startswith("[sweep]"):
                print(f"[{tree}] {line}", end="", flush=True)
        rc = proc.wait()
    reports = [json.loads(p.read_text()) for p in sorted(out_dir.glob("rank*.json"))]
    return {"tree": tree, "returncode": rc, "ranks_reported": len(reports),
            "wall_s": round(time.monotonic() - t0, 1), "reports": reports}


def summarize(run: dict, tests) -> dict:
    reports = run["reports"]
    per_rank_failures = [sorted((r["seed"], r["test"]) for r in rep["results"] if r["failed"])
                         for rep in reports]
    rank0 = reports[0]["results"] if reports else []
    seeds = sorted({r["seed"] for r in rank0})
    out = {"returncode": run["returncode"], "ranks_reported": run["ranks_reported"],
           "wall_s": run["wall_s"], "seeds_tried": len(seeds),
           "seed_range": [seeds[0], seeds[-1]] if seeds else None,
           "ranks_agree": all(f == per_rank_failures[0] for f in per_rank_failures),
           "tests": {}}
    for test in tests:
        rows = [r for r in rank0 if r["test"] == test]
        fails = [r for r in rows if r["failed"]]
        out["tests"][test] = {
            "seeds_run": len(rows),
            "failing_seeds": [r["seed"] for r in fails],
            "failures": [{
                "seed": r["seed"], "error": r["error"],
                "params": [{k: c.get(k) for k in ("param", "mismatched", "numel", "elements_off",
                                                   "max_ulp", "max_abs", "worst_index",
                                                   "worst_actual", "worst_expected")}
                           for c in r["calls"] if not c["ok"]],
                "norms": r["norms"],
            } for r in fails],
            # seeds where params differ by some ulp yet within tolerance
            "seeds_with_ulp_diffs_within_tol": [r["seed"] for r in rows if not r["failed"] and r["calls"]],
            "seeds_grad_norm_differs": [r["seed"] for r in rows if len({n["grad_norm_hex"] for n in
                                        r["norms"] if n["optimizer"] != "reference-own-norm"}) > 1],
        }
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="0:200", help="e.g. 0:300 or 3,17 or 0:10,42 (default 0:200)")
    ap.add_argument("--tests", default=",".join(DEFAULT_TESTS), help="comma-separated test methods")
    ap.add_argument("--tree", action="append", choices=("pristine", "patched"), help="default both")
    ap.add_argument("--nproc", type=int, default=4, help="gloo ranks (default 4)")
    ap.add_argument("--share-grad-norm", action="store_true",
                    help="the reference clips by the layer-wise optimizer's grad norm")
    ap.add_argument("--out-dir", help="default build/seed_sweep/np<N>[-shared-norm]_<seeds>")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.tests = [t for t in args.tests.split(",") if t]
    try:
        args.seed_list = parse_seeds(args.seeds)
    except ValueError:
        ap.error(f"bad --seeds {args.seeds!r}")
    if not args.seed_list or args.nproc < 2:
        ap.error("need at least one seed and --nproc >= 2")
    if args.worker:
        return worker(args)

    sys.path.insert(0, str(REPO_ROOT))
    from tests.upstream_tests import upstream_runner as ur

    trees = args.tree or ["pristine", "patched"]
    for tree in trees:
        if not (ur.CHECKOUTS[tree] / "tests/unit_tests/test_layer_wise_optimizer.py").is_file():
            print(f"{ur.CHECKOUTS[tree]}: missing; run scripts/setup.sh", file=sys.stderr)
            return 2
    label = f"np{args.nproc}{'-shared-norm' if args.share_grad_norm else ''}_{args.seeds.replace(':', '-').replace(',', '_')}"
    out = Path(args.out_dir).resolve() if args.out_dir else REPO_ROOT / "build" / "seed_sweep" / label
    summary = {"command": shlex.join([".venv/bin/python", "scripts/seed_sweep_upstream_test.py",
                                      *(argv if argv is not None else sys.argv[1:])]),
               "nproc": args.nproc, "share_grad_norm": args.share_grad_norm, "trees": {}}
    crashed = False
    for tree in trees:
        run = run_tree(tree, args, out / tree)
        crashed |= run["returncode"] != 0 or run["ranks_reported"] < args.nproc
        summary["trees"][tree] = summarize(run, args.tests)
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    any_fail = False
    for tree, s in summary["trees"].items():
        for test, t in s["tests"].items():
            any_fail |= bool(t["failing_seeds"])
            print(f"[summary] {tree} {test}: {len(t['failing_seeds'])}/{t['seeds_run']} seeds failed "
                  f"{t['failing_seeds']}; grad norms differ at {len(t['seeds_grad_norm_differs'])} seeds")
        print(f"[summary] {tree}: rc {s['returncode']}, {s['ranks_reported']} rank reports, "
              f"ranks agree: {s['ranks_agree']}, {s['wall_s']} s")
    print(f"[summary] {out / 'summary.json'}")
    if crashed:
        return 3
    return 1 if any_fail else 0


if __name__ == "__main__":
    sys.exit(main())
