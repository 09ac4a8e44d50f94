"""Megatron-LM's own unit tests of the touched code, on the pristine and the patched checkout.

``scripts/test.sh tests/upstream_tests`` runs exactly these. Each (tree, ranks) pair is one
torchrun of upstream's pytest files in ``build/megatron-lm/{core_v0.17.1,patched}`` on CPU gloo
ranks (``upstream_runner``, ``cpu_gloo_plugin``); the files and rank counts are
``upstream_runner.FILES_BY_NPROC``. The per-test outcomes go to
``build/upstream_tests/results.json``; ``docs/upstream_tests.md`` has the table.

What is asserted:
* the runs really ran upstream's tests: every rank reported, and every file has passing tests
  on pristine (a broken plugin or an all-skipped file fails here, not silently);
* every test that passes on pristine passes on patched, at 2 and at 4 ranks, and the two
  trees hold the same tests: the series changes no upstream test. The two
  ``TestFreeOverlapBuffers`` tests that read ``bucket._layerwise_src_buffer`` and
  ``bucket.layerwise_gather_list`` pass unchanged (the series keeps both attributes).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.tiers import tiered
from tests.upstream_tests import upstream_runner as ur

pytestmark = [pytest.mark.slow, pytest.mark.gloo]

_RUNS: dict = {}
TREES = ("pristine", "patched")
#: The runs of FILES_BY_NPROC, by name: (ranks, files). The default run (CI) takes "2", the
#: files whose code the series changes (DDP's buffer, the layer-wise optimizer) at 2 ranks;
#: the other 2-rank files ("2-more") and the 4-rank run ("4") are `extended` (scripts/test.sh
#: --all): about 400 s more on 2 cores.
_TOUCHED = ("tests/unit_tests/distributed/test_param_and_grad_buffer.py", "tests/unit_tests/test_layer_wise_optimizer.py")
PARTS = {
    "2": (2, _TOUCHED),
    "2-more": (2, tuple(f for f in ur.FILES_BY_NPROC[2] if f not in _TOUCHED)),
    "4": (4, ur.FILES_BY_NPROC[4]),
}
PART_PARAMS = tiered(PARTS, lambda part: part == "2")


def _run_side_by_side(trees, nproc: int, files=None, key=None) -> None:
    """Run ``files`` (default ``FILES_BY_NPROC[nproc]``) on ``trees`` at ``nproc`` ranks,
    side by side (each run leaves cores idle: start-up, gloo waits; the outcomes do not
    depend on it), into ``_RUNS[(tree, key or nproc)]`` (logs in ``RESULTS_DIR/<tree>-np<key>``),
    and write them all to results.json."""
    key = key or nproc

    def one(t):
        return ur.run(t, nproc, files, out_dir=ur.RESULTS_DIR / f"{t}-np{key}")

    with ThreadPoolExecutor(len(trees)) as pool:
        for t, r in zip(trees, pool.map(one, trees)):
            _RUNS[(t, key)] = r
    ur.write_json(list(_RUNS.values()))


def _run(tree: str, part: str) -> ur.Run:
    """One run per (tree, part of PARTS) per session; both trees' runs of a part together."""
    if (tree, part) not in _RUNS:
        nproc, files = PARTS[part]
        _run_side_by_side(TREES, nproc, files, key=part)
    return _RUNS[(tree, part)]


def test_the_parts_are_the_whole_matrix():
    """The default run's part and the extended ones together run every file of FILES_BY_NPROC."""
    got = sorted((n, f) for n, files in PARTS.values() for f in files)
    assert got == sorted((n, f) for n, files in ur.FILES_BY_NPROC.items() for f in files)


@pytest.mark.parametrize("part", PART_PARAMS)
@pytest.mark.parametrize("tree", ["pristine", "patched"])
def test_upstream_tests_ran(tree, part):
    run = _run(tree, part)
    nproc = PARTS[part][0]
    assert run.results, f"no test reported by any rank; see {run.log}"
    counts = run.by_file()
    if tree == "pristine":
        empty = [f for f, c in counts.items() if c["passed"] == 0]
        assert not empty, f"no passing upstream test in {empty} on {nproc} ranks; see {run.log}"
    assert run.returncode != 124, f"timed out; see {run.log}"
    failed = {k for k, v in run.results.items() if v == "failed"}
    assert failed <= set(run.fail_reasons), f"failures without a message: {failed - set(run.fail_reasons)}"


@pytest.mark.parametrize("part", PART_PARAMS)
def test_patched_passes_every_test_that_pristine_passes(part):
    pristine, patched = _run("pristine", part), _run("patched", part)
    bad = ur.regressions(pristine, patched)
    assert not bad, f"pass on pristine, not on patched ({part}): {bad}; logs {patched.log}"
    assert set(patched.results) == set(pristine.results), patched.log


# ------------------------------------------------------------------ the 0.19 base
TREES_019 = ("pristine-0.19", "patched-0.19")


def _run_019(tree: str) -> ur.Run:
    """The 0.19 checkouts (core_v0.19.0, and it + patches/0.19), FILES_019 (whole files and
    node ids of ``ur.select``) at 2 ranks, once per session; skip when setup.sh found no
    core_v0.19.0 source."""
    missing = [t for t in TREES_019 if not (ur.CHECKOUTS[t] / ".git").is_dir()]
    if missing:
        pytest.skip(f"{[str(ur.CHECKOUTS[t]) for t in missing]} missing (scripts/setup.sh found no core_v0.19.0)")
    if (tree, 2) not in _RUNS:
        _run_side_by_side(TREES_019, 2, ur.FILES_019)
    return _RUNS[(tree, 2)]


@pytest.mark.parametrize("tree", ["pristine-0.19", "patched-0.19"])
def test_019_upstream_tests_ran(tree):
    run = _run_019(tree)
    counts = run.by_file()
    assert set(counts) == set(ur.files_of(ur.FILES_019)) and all(c["passed"] > 0 for c in counts.values()), (counts, run.log)
    selected = [t for t in ur.FILES_019 if "::" in t]
    assert not [t for t in selected if t not in run.results], ("selected, not reported", run.log)
    assert run.returncode != 124, f"timed out; see {run.log}"


def test_019_patched_passes_every_test_that_pristine_passes():
    """Upstream's tests at core_v0.19.0, unchanged (the series adds its own tests in a file of
    its own, test_series_own_tests.py): every test that passes on 0.19 passes on 0.19 + the
    series, and none is new."""
    pristine, patched = _run_019("pristine-0.19"), _run_019("patched-0.19")
    assert not ur.regressions(pristine, patched), (ur.regressions(pristine, patched), patched.log)
    assert set(patched.results) == set(pristine.results)
