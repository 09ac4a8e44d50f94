"""Run Megatron-LM's own unit tests of the touched code on CPU gloo ranks, per tree.

One run = one ``torchrun --standalone --nproc-per-node N -m pytest -p cpu_gloo_plugin FILES``
inside a Megatron-LM checkout (``scripts/setup.sh`` builds them under ``build/megatron-lm/``):

    pristine-0.17.1  build/megatron-lm/core_v0.17.1   Megatron-LM at tag core_v0.17.1
    series-0.17.1    build/megatron-lm/patched        the same + patches/0.17.1 (git am)
    pristine-0.19    build/megatron-lm/core_v0.19.0   Megatron-LM at tag core_v0.19.0
    series-0.19      build/megatron-lm/patched-0.19   the same + patches/0.19

Each rank reports ``{nodeid: passed | failed | skipped}`` (``cpu_gloo_plugin``);
``merge_ranks`` combines them: failed on any rank -> failed, else passed on any -> passed,
else skipped. A rank that did not finish (crash, timeout) fails every test of the run.
A test that failed because gloo could not connect a new group's ranks
(``GLOO_CONNECT_FAILURE``: a TCP connection between ranks on 127.0.0.1 closed while the mesh
was set up; seen under heavy load, with other gloo jobs beside the run) says nothing about the
tree, but leaves the ranks out of step, and the run would hang to its timeout: the plugin stops
the run there (its item 9), the tests not finished on every rank run once more, and
``Run.retried`` keeps the first failure's message.

``tests/upstream_tests/test_upstream_unit_tests.py`` runs the files of each base on its two
checkouts and asserts on them, writing ``build/upstream_tests/results.json``.
``python -m tests.upstream_tests.upstream_runner --checkout PATH`` runs the tests of your own
tree (``run_own``, docs/own_tree.md). Exit codes: 0 no regression; 1 a regression (a test that
passes on pristine and not with the series, or one only the series has that does not pass);
2 ``--checkout PATH`` refused, nothing run, one line on stderr (``harness.own_tree``: PATH does
not exist, is a file or an empty directory, is not a Megatron-LM git checkout, is dirty, or the
series cannot serve it).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Iterable, List, Sequence

REPO_ROOT = Path(__file__).resolve().parents[2]
PLUGIN_DIR = Path(__file__).resolve().parent
CHECKOUTS = {
    "pristine-0.17.1": REPO_ROOT / "build" / "megatron-lm" / "core_v0.17.1",
    "series-0.17.1": REPO_ROOT / "build" / "megatron-lm" / "patched",
    # The 0.19 base (optional: scripts/setup.sh builds them when the core_v0.19.0 source is found).
    "pristine-0.19": REPO_ROOT / "build" / "megatron-lm" / "core_v0.19.0",
    "series-0.19": REPO_ROOT / "build" / "megatron-lm" / "patched-0.19",
}
#: Each series base's checkouts, as labels of CHECKOUTS: (pristine, series).
CHECKOUTS_OF_BASE = {base: (f"pristine-{base}", f"series-{base}") for base in ("0.17.1", "0.19")}
RESULTS_DIR = REPO_ROOT / "build" / "upstream_tests"

#: Upstream test files of the code the series touches that run on CPU, and the rank counts
#: each runs at. The layer-wise file tests the touched code directly and also runs at 4 ranks
#: (uneven shares, empty slots); the rest run at 2 ranks to keep the suite short (the DDP
#: buffer file gave the same 83 / 0 / 4 at 2 and 4 ranks on both trees).
FILES_BY_NPROC: Dict[int, tuple] = {
    2: (
        "tests/unit_tests/distributed/test_param_and_grad_buffer.py",
        "tests/unit_tests/test_layer_wise_optimizer.py",
        "tests/unit_tests/test_muon_optimizer.py",
        "tests/unit_tests/distributed/test_distributed_data_parallel.py",
        "tests/unit_tests/distributed/test_reduce_scatter_with_fp32_accumulation.py",
    ),
    4: ("tests/unit_tests/test_layer_wise_optimizer.py",),
}


def select(file: str, *tests: str) -> tuple:
    """Node ids that run only ``tests`` of ``file`` (ids below the file, e.g.
    ``"TestX::test_y[1-2]"``). ``run`` takes them like files; ``Run.by_file`` counts them
    under ``file``."""
    return tuple(f"{file}::{t}" for t in tests)


def files_of(entries: Iterable[str]) -> List[str]:
    """The distinct files of ``entries`` (files or node ids), in order."""
    return list(dict.fromkeys(e.split("::", 1)[0] for e in entries))


_LW_CKPT = "TestLayerWiseOptimizer::test_layer_wise_optimizer"
#: The 0.19 base's files (tag core_v0.19.0), at 2 ranks: the DDP buffer tests and the
#: layer-wise optimizer tests (both ``use_param_layout`` values, parametrized upstream), whole;
#: two files by node id (measured 2026-12-02, both trees side by side, a loaded 2-core machine):
#: * ``test_emerging_optimizers.py``: its 2 tests that build a LayerWiseDistributedOptimizer
#:   (legacy path: DDP without a param layout) and step it. The whole file: 80 tests, 40-43 s
#:   wall, 53 / 27 / 0 on both trees; the 27 failures are AdaptiveMuon and SOAP against the
#:   installed emerging-optimizers 0.3.0 (upstream pins v0.2.0), not the touched code.
#: * ``dist_checkpointing/test_layer_wise_optimizer.py``: the 11 tests that pass on pristine
#:   at 2 ranks, all on the legacy path (``dist_opt=False``, ``use_param_layout`` False). The
#:   whole file: 442 tests, 213 s wall and 112 CPU s per tree, 11 / 272 / 159 on both trees:
#:   152 + 45 need 4 or 8 ranks, 56 use the Transformer Engine spec (``TESpecProvider`` is
#:   None), and the 19 save/load tests left (among them 3 of the only layout-path test,
#:   ``test_optimizer_common_state_dict_hybrid``) fail in ``load_state_dict``: without TE or
#:   Apex Adam is ``torch.optim.AdamW``, which needs a ``step`` in the state that upstream's
#:   ``init_state_fn`` does not write (KeyError: 'step'). The layout path is covered by
#:   ``test_layer_wise_optimizer.py`` above.
FILES_019: tuple = (
    "tests/unit_tests/distributed/test_param_and_grad_buffer.py",
    "tests/unit_tests/test_layer_wise_optimizer.py",
    *select(
        "tests/unit_tests/test_emerging_optimizers.py",
        "TestMuonOptimizerMultiRank::test_get_megatron_optimizer_layer_wise",
        "TestMuonOptimizerMultiRank::test_get_megatron_muon_optimizer_backward_compatible",
    ),
    *select(
        "tests/unit_tests/dist_checkpointing/test_layer_wise_optimizer.py",
        "TestLayerWiseOptimizer::test_parameter_sharding",
        *(f"TestLayerWiseOptimizer::test_broadcast_params[{p}]" for p in ("1-1", "1-2", "2-1")),
        *(f"{_LW_CKPT}_{t}[{p}]" for t in ("grad_norm", "count_zeros") for p in ("1-1", "1-2", "2-1")),
        f"{_LW_CKPT}_dp_sizes[4]",
    ),
)
#: Your own tree (``--checkout PATH``, docs/own_tree.md) with the 0.19 series, e.g. upstream
#: main: upstream's DDP and layer-wise tests of that tree at 2 ranks, ``FILES_019`` plus what main
#: added next to them (``test_layer_wise_param_layout.py``) and the DDP file. A file or node id
#: the tree lacks is left out (``own_files``).
FILES_OWN_019: tuple = (
    "tests/unit_tests/distributed/test_param_and_grad_buffer.py",
    "tests/unit_tests/distributed/test_distributed_data_parallel.py",
    "tests/unit_tests/distributed/test_layer_wise_param_layout.py",
    *FILES_019[1:],
)
FILES_OWN = {"0.19": FILES_OWN_019}
#: The series' own tests: each patch of patches/<base>/ adds its tests to this file (upstream's
#: style), so only a tree with the series has it. An own-tree run runs it on the series side.
SERIES_TESTS = "tests/unit_tests/distributed/test_layer_wise_param_gather.py"


def own_files(checkout: Path, series: str) -> List[str]:
    """``FILES_OWN[series]`` that exist in ``checkout``: files by path, node ids by their
    ``def test_...`` in the file (a parametrized id counts when its function is there)."""
    import re

    out = []
    for entry in FILES_OWN.get(series, FILES_OWN_019):
        path, _, node = entry.partition("::")
        f = Path(checkout) / path
        if not f.is_file():
            continue
        name = node.rsplit("::", 1)[-1].split("[", 1)[0]
        if not node or re.search(rf"^\s*def {re.escape(name)}\(", f.read_text(), re.M):
            out.append(entry)
    return out


def own_run_files(upstream: Path, with_series: Path, series: str) -> tuple:
    """``(pristine files, series files)`` of an own-tree run: ``own_files`` of the tree as it
    is on both sides, and on the series side also SERIES_TESTS, which the series adds (it
    must pass there: ``new_test_failures``)."""
    files = own_files(upstream, series)
    extra = [SERIES_TESTS] if (Path(with_series) / SERIES_TESTS).is_file() and SERIES_TESTS not in files else []
    return files, files + extra


def run_own(checkout: Path, nproc: int = 2, timeout_s: float = 1800) -> tuple:
    """Upstream's tests of your own tree (``harness.own_tree``): its HEAD as it is ("pristine")
    and with the series ("series"), the same files (``own_files``) on ``nproc`` ranks, and on
    the series side the series' own tests (``own_run_files``).

    Returns:
        ``(own_tree, pristine Run, series Run)``.
    """
    from harness import own_tree

    tree = own_tree.prepare(checkout)
    files = dict(zip(("pristine", "series"), own_run_files(tree.pristine_clone, tree.series_clone, tree.series.name)))
    out = RESULTS_DIR / f"checkout-{tree.source.name}-{tree.head[:12]}"
    runs = [run(label, nproc, files[label], timeout_s=timeout_s, out_dir=out / f"{label}-np{nproc}", checkout=clone)
            for label, clone in (("pristine", tree.pristine_clone), ("series", tree.series_clone))]
    return (tree, *runs)


def own_table(pristine: "Run", series: "Run") -> str:
    """Markdown: one row per file of an own-tree run (``run_own``)."""
    lines = ["| file | ranks | pristine passed / failed / skipped | series passed / failed / skipped |",
             "|---|---|---|---|"]
    a, b = pristine.by_file(), series.by_file()
    for f in files_of([*pristine.files, *series.files]):
        cells = [f"{c['passed']} / {c['failed']} / {c['skipped']}" if f in files_of(r.files) else "not in the tree"
                 for r, c in ((pristine, a.get(f, Counter())), (series, b.get(f, Counter())))]
        lines.append(f"| `{f.removeprefix('tests/unit_tests/')}` | {pristine.nproc} | {cells[0]} | {cells[1]} |")
    return "\n".join(lines)


#: Upstream files that import the touched modules but are not run, and why.
NOT_RUN = {
    "tests/unit_tests/distributed/test_grad_sync_with_expert_parallel.py": (
        "builds its MoE model with get_gpt_layer_with_transformer_engine_spec: Transformer "
        "Engine is CUDA-only (TESpecProvider is None without it); most parametrizations also "
        "need 4 or 8 ranks"
    ),
    "tests/unit_tests/dist_checkpointing/test_layer_wise_optimizer.py": (
        "0.17.1: runs but takes over 400 s on 2 CPU ranks (torch_dist save/load per "
        "parametrization); the layer-wise checkpoint path is covered by the ckpt-resume "
        "functional case. 0.19: 11 of its 442 tests run (FILES_019); the whole file takes "
        "213 s wall per tree and passes only those 11 on CPU at 2 ranks"
    ),
    "tests/unit_tests/test_emerging_optimizers.py": (
        "0.19: 2 of its 80 tests run (FILES_019), the layer-wise ones; the rest test Muon, "
        "SOAP and Lion updates, not the touched code"
    ),
    "tests/unit_tests/distributed/megatron_fsdp/*": "Megatron-FSDP, not the touched code; CUDA-only",
    "tests/unit_tests/dist_checkpointing/test_optimizer.py": (
        "distributed-optimizer checkpointing (use_distributed_optimizer=True), not the "
        "layer-wise path; minutes per parametrization on CPU"
    ),
    "tests/unit_tests/transformer/test_mup.py": "muP scaling, not the touched code",
}
# Run on both trees but failing on both: test_reduce_scatter_with_fp32_accumulation[False-*]
# expects a bf16 reduce-scatter to differ from an fp32-accumulated one; with 2 ranks each
# element is one bf16 addition, rounded once, equal to the fp32 sum rounded (docs/upstream_tests.md).

#: The message of gloo's failure to connect a new group's ranks (ProcessGroupGloo.cpp).
GLOO_CONNECT_FAILURE = "Gloo connectFullMesh failed"
#: How often ``run`` runs the rest of a run again after GLOO_CONNECT_FAILURE, and the pause
#: before each (s). Under load the same test once failed to connect in the run and in its one
#: retry, 45 s later (2026-12-06, the default run beside the patches' own tests); alone it passed.
RETRIES = 2
RETRY_PAUSE_S = 10

#: The container version upstream's CI runs in (our Dockerfile's NGC 25.12). Upstream skips
#: the layer-wise optimizer tests when NVIDIA_PYTORCH_VERSION <= 25.05 ("LTS").
NVIDIA_PYTORCH_VERSION = "25.12"


@dataclass
class Run:
    """The merged outcome of one torchrun over ``files`` on one tree."""

    tree: str
    nproc: int
    files: List[str]
    results: Dict[str, str] = field(default_factory=dict)  # nodeid -> passed/failed/skipped
    skip_reasons: Dict[str, str] = field(default_factory=dict)
    fail_reasons: Dict[str, str] = field(default_factory=dict)  # nodeid -> crash message
    retried: Dict[str, str] = field(default_factory=dict)  # nodeid -> first failure, retried once
    wall_s: float = 0.0
    cpu_s: float = 0.0  # user + system CPU seconds of all ranks
    returncode: int = 0
    log: str = ""

    def by_file(self) -> Dict[str, Counter]:
        """``{file: Counter(passed=, failed=, skipped=)}`` for every file of the run (node ids
        of ``select`` counted under their file)."""
        out = {f: Counter(passed=0, failed=0, skipped=0) for f in files_of(self.files)}
        for nodeid, outcome in self.results.items():
            out.setdefault(nodeid.split("::", 1)[0], Counter())[outcome] += 1
        return out


def command(checkout: Path, files: Sequence[str], nproc: int, results_dir: Path):
    """``(argv, env)`` of one run: torchrun + pytest + ``cpu_gloo_plugin`` in ``checkout``.

    ``-o addopts=`` drops upstream's ``-x`` (stop at first failure) and ``-s``; every test of
    every file is run and reported. pytest's temporary root is ``results_dir/tmp``:
    upstream's ``tmp_path_dist_ckpt`` keeps checkpoints in one directory per user
    (``<root>/pytest-of-<user>/tmp_dist_ckpt``), which runs side by side would share.
    """
    env = dict(os.environ)
    (results_dir / "tmp").mkdir(parents=True, exist_ok=True)
    env.update(
        PYTHONPATH=os.pathsep.join([str(PLUGIN_DIR), str(REPO_ROOT)]),
        MEGATRON_LM_CHECKOUT=str(checkout),
        UPSTREAM_TESTS_RESULTS=str(results_dir),
        PYTEST_DEBUG_TEMPROOT=str(results_dir / "tmp"),
        NVIDIA_PYTORCH_VERSION=NVIDIA_PYTORCH_VERSION,
        OMP_NUM_THREADS="1",
        CUDA_DEVICE_MAX_CONNECTIONS="1",
        PYTHONUNBUFFERED="1",
    )
    env.pop("MEGATRON_CPU_RUNTIME", None)  # the plugin installs the runtime itself
    from harness import launch  # the one builder of the torchrun line

    argv = [
        *launch.torchrun_argv(nproc), "-m", "pytest", "-p", "cpu_gloo_plugin", "-p", "no:cacheprovider", "-o", "addopts=",
        "-q", "-rfE", "--tb=short", *files,
    ]
    return argv, env


def merge_ranks(rank_reports: Iterable[dict]) -> tuple:
    """Combine per-rank ``{nodeid: outcome}``: failed anywhere > passed anywhere > skipped.

    Returns ``(results, skip_reasons, fail_reasons)``, the reasons of the merged outcomes."""
    results: Dict[str, str] = {}
    reasons: Dict[str, str] = {}
    fails: Dict[str, str] = {}
    rank = {"skipped": 0, "passed": 1, "failed": 2}
    for report in rank_reports:
        for nodeid, outcome in report["results"].items():
            if rank[outcome] > rank.get(results.get(nodeid, "skipped"), 0) or nodeid not in results:
                results[nodeid] = outcome
        reasons.update(report.get("skip_reasons", {}))
        for nodeid, why in report.get("fail_reasons", {}).items():
            fails.setdefault(nodeid, why)
    return results, {k: v for k, v in reasons.items() if results.get(k) == "skipped"}, fails


def _wait(proc: subprocess.Popen, timeout_s: float):
    """``(returncode, rusage)`` of ``proc`` alone (its ranks included), so that runs in
    threads side by side each get their own CPU time; 124 after killing it at the timeout."""
    deadline = time.monotonic() + timeout_s
    killed = False
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            proc.returncode = os.waitstatus_to_exitcode(status)
            return (124 if killed else proc.returncode), usage
        if not killed and time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            killed = True
        time.sleep(0.2)


def run(tree: str, nproc: int, files: Sequence[str] | None = None, timeout_s: float = 900,
        out_dir: Path | None = None, retry: int = RETRIES, checkout: Path | None = None,
        deselect: Iterable[str] = ()) -> Run:
    """Run ``files`` (default ``FILES_BY_NPROC[nproc]``) of ``tree`` on ``nproc`` gloo ranks,
    logs and rank reports in ``out_dir`` (default ``RESULTS_DIR/<tree>-np<nproc>``), leaving
    out the node ids in ``deselect``. When a test fails with ``GLOO_CONNECT_FAILURE`` the run
    stops there (``cpu_gloo_plugin`` item 9); up to ``retry`` times (0 or False: never), that
    test and every test not finished on all ranks run again after RETRY_PAUSE_S (in
    ``out_dir/retry``, ``out_dir/retry/retry``), else they count as failed.
    ``checkout`` replaces ``CHECKOUTS[tree]`` (e.g. a copy of the series checkout with a
    deliberate bug in it); ``tree`` stays the run's label.

    Raises:
        FileNotFoundError: the checkout is missing (run scripts/setup.sh).
    """
    checkout = Path(checkout or CHECKOUTS[tree])
    files = list(files or FILES_BY_NPROC[nproc])
    if not (checkout / ".git").is_dir():
        raise FileNotFoundError(f"{checkout} is missing; run scripts/setup.sh")
    out_dir = out_dir or RESULTS_DIR / f"{tree}-np{nproc}"
    for old in out_dir.glob("rank*.json"):
        old.unlink()
    out_dir.mkdir(parents=True, exist_ok=True)
    argv, env = command(checkout, files, nproc, out_dir)
    if deselect:
        (out_dir / "deselect.json").write_text(json.dumps(sorted(deselect)))
        env["UPSTREAM_TESTS_DESELECT"] = str(out_dir / "deselect.json")
    log_path = out_dir / "pytest.log"
    start = time.monotonic()
    with open(log_path, "w") as log:
        log.write(shlex.join(argv) + "\n")
        log.flush()
        proc = subprocess.Popen(argv, env=env, cwd=checkout, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        returncode, usage = _wait(proc, timeout_s)
    result = Run(tree=tree, nproc=nproc, files=files, returncode=returncode, log=str(log_path))
    result.wall_s = time.monotonic() - start
    result.cpu_s = usage.ru_utime + usage.ru_stime
    reports = []
    for r in range(nproc):
        path = out_dir / f"rank{r}.json"
        if path.is_file():
            reports.append(json.loads(path.read_text()))
    result.results, result.skip_reasons, result.fail_reasons = merge_ranks(reports)
    aborted = any(r.get("aborted") for r in reports)
    if not aborted and (len(reports) < nproc or not all(r.get("finished") for r in reports)):
        # a rank died: nothing it ran can count as passed
        result.results = {k: "failed" for k in result.results} or {f: "failed" for f in files}
        return result
    if aborted:
        unconnected = connect_failures(result)
        done = set.intersection(*(set(r["done"]) for r in reports)) if len(reports) == nproc else set()
        done -= set(unconnected)
        result.results = {k: v if k in done else "failed" for k, v in result.results.items()}
        if not retry:
            return result
        time.sleep(RETRY_PAUSE_S)
        again = run(tree, nproc, files, timeout_s, out_dir / "retry", retry=int(retry) - 1, checkout=checkout,
                    deselect=set(deselect) | done)
        result.retried = {**again.retried, **{k: result.fail_reasons.pop(k) for k in unconnected}}
        result.results.update(again.results)
        result.skip_reasons = {k: v for k, v in {**result.skip_reasons, **again.skip_reasons}.items()
                               if result.results.get(k) == "skipped"}
        result.fail_reasons = {k: v for k, v in {**result.fail_reasons, **again.fail_reasons}.items()
                               if result.results.get(k) == "failed"}
        result.returncode = again.returncode
        result.wall_s, result.cpu_s = result.wall_s + again.wall_s, result.cpu_s + again.cpu_s
    return result


def connect_failures(result: Run) -> List[str]:
    """The failed tests of ``result`` whose failure is ``GLOO_CONNECT_FAILURE`` on some rank."""
    return sorted(k for k, why in result.fail_reasons.items()
                  if GLOO_CONNECT_FAILURE in why and result.results.get(k) == "failed")


def regressions(pristine: Run, series: Run) -> List[str]:
    """Tests that pass on pristine but do not pass on series (nodeid: outcome)."""
    return sorted(
        f"{k}: {series.results.get(k, 'not run')}"
        for k, v in pristine.results.items()
        if v == "passed" and series.results.get(k) != "passed"
    )


def series_only(pristine: Run, series: Run) -> List[str]:
    """Tests that the series run ran and pristine did not: those the series adds (its own tests, SERIES_TESTS)."""
    return sorted(k for k in series.results if k not in pristine.results)


def new_test_failures(pristine: Run, series: Run) -> List[str]:
    """Tests that exist only on series (``series_only``) and do not pass there
    (nodeid: outcome). A skip counts: a regression test that never runs checks nothing."""
    return [f"{k}: {series.results[k]}" for k in series_only(pristine, series)
            if series.results[k] != "passed"]


def write_json(runs: Sequence[Run], path: Path = RESULTS_DIR / "results.json") -> Path:
    """Per test outcome of every run, plus counts and timings, as JSON."""
    data = {
        "runs": [
            {
                "tree": r.tree, "nproc": r.nproc, "files": r.files, "returncode": r.returncode,
                "wall_s": round(r.wall_s, 1), "cpu_s": round(r.cpu_s, 1),
                "counts": {f: dict(c) for f, c in r.by_file().items()},
                "results": dict(sorted(r.results.items())),
                "skip_reasons": dict(sorted(r.skip_reasons.items())),
                "retried": dict(sorted(r.retried.items())),
            }
            for r in runs
        ]
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")
    return path


def main(argv: Sequence[str] | None = None) -> int:
    """``--checkout PATH``: upstream's tests of your own tree, as it is and with the series
    (``run_own``); prints each run, the per-file table and every regression."""
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="exit: 0 no regression; 1 a regression; 2 --checkout PATH refused, nothing run (one line "
        "on stderr: what PATH must be, or why the series cannot serve it)")
    parser.add_argument("--nproc", type=int, default=2, help="rank count (default 2)")
    parser.add_argument("--checkout", type=Path, metavar="PATH", required=True,
                        help="your own Megatron-LM checkout (docs/own_tree.md): its upstream tests of the "
                        "touched code (FILES_OWN) on PATH as it is and with the series, in scratch clones")
    args = parser.parse_args(argv)
    from harness.own_tree import OwnTreeError

    try:
        tree, pri, ser = run_own(args.checkout, args.nproc)
    except OwnTreeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for r in (pri, ser):
        print(f"{r.tree} np{r.nproc}: wall {r.wall_s:.0f} s, cpu {r.cpu_s:.0f} s, exit {r.returncode}, log {r.log}")
    print(f"{tree.label}, megatron-core {tree.version}, patches/{tree.series.name}")
    print(own_table(pri, ser))
    bad = regressions(pri, ser) + [f"(only with the series) {b}" for b in new_test_failures(pri, ser)]
    for k, v in sorted(pri.results.items()):
        if v == "failed":
            print(f"fails on pristine too: {k}: {pri.fail_reasons.get(k, '')[:160]}")
    for b in bad:
        print(f"REGRESSION {b}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
