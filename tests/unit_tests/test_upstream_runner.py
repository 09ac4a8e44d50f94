"""tests/upstream_tests/upstream_runner.py: how rank reports merge, and which failures are
run once more (a gloo connect failure says nothing about the tree; any other failure counts)."""

from __future__ import annotations

from tests.upstream_tests import upstream_runner as ur

T1, T2, T3 = (f"tests/unit_tests/test_x.py::test_{n}" for n in ("mesh", "assert", "both"))
CONNECT = ("RuntimeError: Gloo connectFullMesh failed with [/pytorch/third_party/gloo/gloo/transport/"
           "tcp/pair.cc:547] Connection closed by peer [127.0.0.1]:46224")


def _merged(*reports):
    run = ur.Run(tree="series-0.17.1", nproc=len(reports), files=["tests/unit_tests/test_x.py"])
    run.results, run.skip_reasons, run.fail_reasons = ur.merge_ranks(reports)
    return run


def test_a_connect_failure_on_one_rank_is_retried_and_an_assertion_is_not():
    rank0 = {"results": {T1: "failed", T2: "failed", T3: "passed"},
             "fail_reasons": {T1: CONNECT, T2: "AssertionError: Parameter fc3.weight differs"}}
    rank1 = {"results": {T1: "passed", T2: "passed", T3: "failed"},
             "fail_reasons": {T3: "AssertionError: assert True == False"}}
    run = _merged(rank0, rank1)
    assert run.results == {T1: "failed", T2: "failed", T3: "failed"}
    assert run.fail_reasons == {T1: CONNECT, T2: rank0["fail_reasons"][T2], T3: rank1["fail_reasons"][T3]}
    assert ur.connect_failures(run) == [T1]


# ------------------------------------------------- tests that exist only with the series
def _recorded(tree, results):
    run = ur.Run(tree=tree, nproc=2, files=["tests/unit_tests/test_x.py"])
    run.results = dict(results)
    return run


def test_a_failing_or_skipped_series_only_test_counts_and_a_passing_one_does_not():
    """A test that exists only with the series (the series' own tests) and fails or skips
    there is reported, though comparing the tests pristine has sees nothing."""
    T4 = "tests/unit_tests/test_x.py::test_caught"
    pristine = _recorded("pristine-0.17.1", {T1: "passed"})
    series = _recorded("series-0.17.1", {T1: "passed", T2: "skipped", T3: "passed", T4: "failed"})
    assert ur.regressions(pristine, series) == []
    assert ur.series_only(pristine, series) == [T2, T3, T4]
    assert ur.new_test_failures(pristine, series) == [f"{T2}: skipped", f"{T4}: failed"]


# ------------------------------------------------------- per-file node-id selection
def test_selected_node_ids_count_under_their_file():
    sel = ur.select("tests/unit_tests/test_y.py", "TestY::test_a[1-2]", "test_b")
    assert sel == ("tests/unit_tests/test_y.py::TestY::test_a[1-2]", "tests/unit_tests/test_y.py::test_b")
    run = ur.Run(tree="pristine", nproc=2, files=["tests/unit_tests/test_x.py", *sel])
    assert ur.files_of(run.files) == ["tests/unit_tests/test_x.py", "tests/unit_tests/test_y.py"]
    run.results = {sel[0]: "passed", sel[1]: "skipped", T1: "failed"}
    assert {f: dict(c) for f, c in run.by_file().items()} == {
        "tests/unit_tests/test_x.py": {"passed": 0, "failed": 1, "skipped": 0},
        "tests/unit_tests/test_y.py": {"passed": 1, "failed": 0, "skipped": 1},
    }
