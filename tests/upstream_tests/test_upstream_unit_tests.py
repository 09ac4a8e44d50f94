"""Megatron-LM's own unit tests of the touched code, on each base's pristine checkout and on it
with the series.

``scripts/test.sh tests/upstream_tests`` runs exactly these. Each (tree, ranks, files) run is one
torchrun of upstream's pytest files in the checkout (``upstream_runner.CHECKOUTS``:
``build/megatron-lm/{core_v0.17.1,patched,core_v0.19.0,patched-0.19}``) on CPU gloo ranks
(``upstream_runner``, ``cpu_gloo_plugin``); the files are ``upstream_runner.FILES_BY_NPROC``
(0.17.1, at 2 and 4 ranks) and ``FILES_019`` (0.19, at 2 ranks). The per-test outcomes go to
``build/upstream_tests/results.json``; ``docs/upstream_tests.md`` has the table.

What is asserted, per base and part:
* the runs really ran upstream's tests: every rank reported, and every file (or selected node
  id) has passing tests on pristine (a broken plugin or an all-skipped file fails here, not
  silently);
* every test that passes on pristine passes with the series, and the two trees hold the same
  tests: the series changes no upstream test (it adds its own in a file of its own,
  test_series_own_tests.py). On 0.17.1 the two ``TestFreeOverlapBuffers`` tests that read
  ``bucket._layerwise_src_buffer`` and ``bucket.layerwise_gather_list`` pass unchanged (the
  series keeps both attributes).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.tiers import tiered
from tests.upstream_tests import upstream_runner as ur

pytestmark = [pytest.mark.slow, pytest.mark.gloo]

_RUNS: dict = {}
_TOUCHED = ("tests/unit_tests/distributed/test_param_and_grad_buffer.py", "tests/unit_tests/test_layer_wise_optimizer.py")
#: The runs, by (base, part): (ranks, files). The default run (CI) takes 0.17.1's "2", the files
#: whose code the series changes (DDP's buffer, the layer-wise optimizer) at 2 ranks, and 0.19's
#: "2"; 0.17.1's other 2-rank files ("2-more") and its 4-rank run ("4") are `extended`
#: (scripts/test.sh --all): about 400 s more on 2 cores.
PARTS = {
    ("0.17.1", "2"): (2, _TOUCHED),
    ("0.17.1", "2-more"): (2, tuple(f for f in ur.FILES_BY_NPROC[2] if f not in _TOUCHED)),
    ("0.17.1", "4"): (4, ur.FILES_BY_NPROC[4]),
    ("0.19", "2"): (2, ur.FILES_019),
}
PART_PARAMS = tiered(PARTS, lambda key: key[1] == "2")


def _run(base: str, part: str) -> tuple:
    """(pristine Run, series Run) of one part, once per session: the two trees' runs side by
    side (each leaves cores idle: start-up, gloo waits; the outcomes do not depend on it), logs
    in ``RESULTS_DIR/<tree>-np<part>``, all runs so far written to results.json. Skips where
    scripts/setup.sh built no checkout of the base (the 0.19 one is optional there)."""
    trees = ur.CHECKOUTS_OF_BASE[base]
    missing = [str(ur.CHECKOUTS[t]) for t in trees if not (ur.CHECKOUTS[t] / ".git").is_dir()]
    if missing:
        pytest.skip(f"{missing} missing (scripts/setup.sh found no core_v{base} source)")
    if (base, part) not in _RUNS:
        nproc, files = PARTS[(base, part)]
        with ThreadPoolExecutor(2) as pool:
            _RUNS[(base, part)] = tuple(pool.map(
                lambda t: ur.run(t, nproc, files, out_dir=ur.RESULTS_DIR / f"{t}-np{part}"), trees))
        ur.write_json([r for pair in _RUNS.values() for r in pair])
    return _RUNS[(base, part)]


def test_the_parts_are_the_whole_matrix():
    """The default run's parts and the extended ones together run every file of FILES_BY_NPROC
    (0.17.1) and FILES_019 (0.19)."""
    got = sorted((b, n, f) for (b, _), (n, files) in PARTS.items() for f in files)
    want = [("0.17.1", n, f) for n, files in ur.FILES_BY_NPROC.items() for f in files]
    assert got == sorted(want + [("0.19", 2, f) for f in ur.FILES_019])


@pytest.mark.parametrize("base, part", PART_PARAMS)
def test_upstream_tests_ran(base, part):
    """On both trees: every rank reported, every selected node id too; no timeout; every
    failure has its message. On pristine, every file has a passing test."""
    files = PARTS[(base, part)][1]
    pristine, series = _run(base, part)
    for run in (pristine, series):
        assert run.results, f"no test reported by any rank; see {run.log}"
        assert run.returncode != 124, f"timed out; see {run.log}"
        failed = {k for k, v in run.results.items() if v == "failed"}
        assert failed <= set(run.fail_reasons), f"failures without a message: {failed - set(run.fail_reasons)}"
        assert not [t for t in files if "::" in t and t not in run.results], ("selected, not reported", run.log)
    counts = pristine.by_file()
    empty = [f for f in ur.files_of(files) if counts.get(f, {}).get("passed", 0) == 0]
    assert not empty, f"no passing upstream test in {empty} on {pristine.nproc} ranks; see {pristine.log}"


@pytest.mark.parametrize("base, part", PART_PARAMS)
def test_the_series_passes_every_test_that_pristine_passes(base, part):
    pristine, series = _run(base, part)
    bad = ur.regressions(pristine, series)
    assert not bad, f"pass on pristine, not with the series ({base}, {part}): {bad}; logs {series.log}"
    assert set(series.results) == set(pristine.results), series.log
