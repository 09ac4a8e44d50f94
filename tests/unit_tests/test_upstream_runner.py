"""tests/upstream_tests/upstream_runner.py: how rank reports merge, and which failures are
run once more (a gloo connect failure says nothing about the tree; any other failure counts)."""

from __future__ import annotations

from tests.upstream_tests import upstream_runner as ur

T1, T2, T3 = (f"tests/unit_tests/test_x.py::test_{n}" for n in ("mesh", "assert", "both"))
CONNECT = ("RuntimeError: Gloo connectFullMesh failed with [/pytorch/third_party/gloo/gloo/transport/"
           "tcp/pair.cc:547] Connection closed by peer [127.0.0.1]:46224")


def _merged(*reports):
    run = ur.Run(tree="patched", nproc=len(reports), files=["tests/unit_tests/test_x.py"])
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

