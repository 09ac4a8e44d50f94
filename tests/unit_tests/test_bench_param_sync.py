"""Tests of scripts/bench_param_sync.py (quick mode) and harness/param_sync_theory.py.

The benchmark runs once per module in --quick mode (real DP 2 on gloo, fake DP 8 and 64,
both trees; about 35 s on 2 cores) into a temporary directory. The tests check the JSON
schema, that the series allocates nothing in every record, and that upstream equals the
theory exactly. No assertion on time: wall times on a shared machine are data, not
pass/fail criteria.
"""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from harness import param_sync_theory as theory
from harness.trees import REPO_ROOT

SCRIPT = REPO_ROOT / "scripts" / "bench_param_sync.py"
TIMEOUT_S = 300
REQUIRED = {
    "tree": str,
    "path": str,
    "dp_size": int,
    "device": str,
    "temporary_bytes": int,
    "alloc_calls": int,
    "peak_extra_bytes": int,
    "median_s": float,
    "min_s": float,
    "max_s": float,
    "rank": int,
    "pg": str,
    "num_buckets": int,
    "theory_upstream_bytes": int,
    "theory_3751_bytes": int,
    "theory_series_bytes": int,
    "theory_upstream_peak_bytes": int,
    "temporary_bytes_ratio": float,
    "time_ratio": float,
    "time_ratio_lo": float,
    "time_ratio_hi": float,
}


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    """Run the benchmark in --quick mode; return (out_dir, parsed JSON)."""
    out = tmp_path_factory.mktemp("bench")
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--out-dir", str(out)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert proc.returncode == 0, f"rc={proc.returncode}\n{(proc.stdout + proc.stderr)[-4000:]}"
    return out, json.loads((out / "param_sync.json").read_text())


pytestmark = [pytest.mark.gloo]


def test_schema_and_coverage(bench):
    """Every record has the issue's fields with the right types; both trees, every path,
    real and fake process groups are present, and each key appears once per tree."""
    _, data = bench
    records = data["records"]
    for r in records:
        for field, typ in REQUIRED.items():
            assert field in r, f"{field} missing in {r['tree']}/{r['path']}/{r['dp_size']}"
            ok = isinstance(r[field], typ) or (typ is float and isinstance(r[field], int))
            assert ok, f"{field}={r[field]!r} is not {typ.__name__}"
        assert r["tree"] in ("upstream", "patched") and r["path"] in (
            "async",
            "forced",
            "optimizer",
        )
        assert r["device"] == "cpu" and r["pg"] in ("real", "fake")
        assert r["min_s"] <= r["median_s"] <= r["max_s"]
    keys = [
        (r["tree"], r["path"], r["dp_size"], r["device"], r["bucket_size"], r["rank"], r["pg"])
        for r in records
    ]
    assert len(keys) == len(set(keys)), "duplicate records"
    assert {(r["tree"], r["path"]) for r in records} == {
        (t, p) for t in ("upstream", "patched") for p in ("async", "forced", "optimizer")
    }
    assert {r["dp_size"] for r in records if r["pg"] == "real"} == {2}
    assert {r["dp_size"] for r in records if r["pg"] == "fake"} == {8, 64}
    assert data["meta"]["command"].startswith(".venv/bin/python scripts/bench_param_sync.py")


def test_patched_allocates_nothing(bench):
    """The series: 0 bytes, 0 allocator calls and 0 peak in every record, on every rank."""
    _, data = bench
    for r in (r for r in data["records"] if r["tree"] == "patched"):
        assert (r["temporary_bytes"], r["alloc_calls"], r["peak_extra_bytes"]) == (0, 0, 0), r
        if r["pg"] == "real":
            assert not any(r["all_ranks_temporary_bytes"]), r["all_ranks_temporary_bytes"]


def test_upstream_equals_theory_exactly(bench):
    """Upstream: bytes == theory on every record (and every real rank), peak == theory,
    and the theory is not trivially 0."""
    _, data = bench
    for r in (r for r in data["records"] if r["tree"] == "upstream"):
        assert r["theory_upstream_bytes"] > 0
        assert r["temporary_bytes"] == r["theory_upstream_bytes"], r
        assert r["peak_extra_bytes"] == r["theory_upstream_peak_bytes"], r
        assert r["theory_3751_bytes"] <= r["theory_upstream_bytes"]
        assert r["theory_match"] and r["temporary_bytes_ratio"] == 0.0
        if r["pg"] == "real":
            assert r["all_ranks_temporary_bytes"] == r["all_ranks_theory_upstream_bytes"]


def test_real_ranks_synced_and_checks_hold(bench):
    """The measured syncs really gathered (params equal on every rank afterwards)."""
    _, data = bench
    assert all(r["params_synced"] for r in data["records"] if r["pg"] == "real")
    assert not any(data["meta"]["checks"].values()), data["meta"]["checks"]


def test_markdown_and_plot(bench):
    out, data = bench
    md = (out / "param_sync.md").read_text()
    assert data["meta"]["command"] in md.split("```")[1]
    assert "| async | 2 |" in md and "param_sync.png" in md
    png = (out / "param_sync.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


# ---------------------------------------------------------------- theory, no megatron
def _p(*numels):
    return [torch.empty(n) for n in numels]


def test_theory_upstream_counts_view_for_single_param():
    """Rank 0 owns two params (flattened: a copy), rank 1 one (a view), rank 2 none."""
    by_rank = [_p(3, 5), _p(7), []]
    assert theory.theory_upstream_bytes(by_rank, 0, 2) == (8 + 7 + 0) * 2
    assert theory.theory_upstream_bytes(by_rank, 1, 2) == (8 + 0) * 2
    assert theory.theory_upstream_bytes(by_rank, 2, 2) == (8 + 7) * 2
    assert theory.theory_3751_bytes(by_rank, 0, 2) == 8 * 2
    assert theory.theory_3751_bytes(by_rank, 1, 2) == 0
    assert theory.theory_upstream_bytes([_p(4)], 0, 2) == 0  # one rank: no gather
    assert theory.theory_upstream_bytes([[], []], 0, 2) == 0  # nobody owns anything


def test_theory_bucket_and_chain_peak():
    bucket = SimpleNamespace(layerwise_params_list=[_p(3, 5), _p(7)], params_list=_p(1))
    assert theory.bucket_bytes(bucket, 0) == (8 + 7) * 4
    assert theory.bucket_bytes(bucket, 0, "3751") == 8 * 4
    assert theory.bucket_bytes(bucket, 0, "series") == 0
    unsharded = SimpleNamespace(layerwise_params_list=None, params_list=_p(1))
    assert theory.bucket_bytes(unsharded, 0) == 0
    with pytest.raises(ValueError):
        theory.bucket_bytes(bucket, 0, "nope")
    assert theory.group_bytes(SimpleNamespace(buckets=[bucket, bucket]), 0) == 2 * 60
    assert theory.async_chain_peak_bytes([5, 1, 9, 2]) == 11
    assert theory.async_chain_peak_bytes([4]) == 4
    assert theory.async_chain_peak_bytes([]) == 0
