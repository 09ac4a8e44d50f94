"""harness.param_sync_recorder: what a training rank records of the layer-wise param sync.

* In one process: the recorder's step regions and call accounting on known allocations.
* On 2 gloo ranks (tests/unit_tests/param_sync_recorder_worker.py, each tree once): the
  recorder wrapped around real megatron bucket groups and the layer-wise optimizer counts
  exactly the pristine tree's theoretical temporaries per step and kind (dense, expert,
  optimizer), ProcessGroupNCCL's flat temporary where the shares are equal, and 0 bytes of
  both on the patched tree, whose gathers still move data.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from harness import param_sync_recorder as psr
from harness.launch import CORE_PRELOAD, LaunchError, run_command, torchrun_command
from tests.functional_tests.python_test_utils import memory_report

WORKER = Path(__file__).with_name("param_sync_recorder_worker.py")


# --------------------------------------------------------------------------- one process


def test_step_region_records_peak_and_calls_with_known_sizes():
    rec = psr.ParamSyncRecorder(backend="gloo")

    def sync(n, inner=None):
        kept = torch.empty(n, dtype=torch.uint8)
        if inner:
            inner()
        return kept

    with rec.training_step(3):
        a = torch.empty(1000, dtype=torch.uint8)
        kept = rec.record_call("dense", sync, 300)
        del a
        # A nested entry-point call counts once, inside the outer one.
        rec.record_call("expert", sync, 200, inner=lambda: rec.record_call("dense", sync, 50))
        del kept
    rec.record_call("dense", sync, 70)  # after the step: a forced sync between steps
    step = rec.steps[3]
    assert step["step_peak_bytes"] == 1300
    assert step["step_alloc_bytes"] == 1000 + 300 + 200 + 50
    assert step["param_sync"]["dense"]["megatron_bytes"] == 300
    assert step["param_sync"]["dense"]["entry_calls"] == 1
    assert step["param_sync"]["expert"]["megatron_bytes"] == 250
    assert step["param_sync"]["expert"]["calls"] == 0  # no collective was called
    assert rec.between_steps == {3: {"param_sync": {"dense": {**psr.empty_totals(), "entry_calls": 1,
                                                              "megatron_bytes": 70, "megatron_alloc_calls": 1}}}}


def test_rank_files_round_trip_and_missing_ranks_are_an_error(tmp_path):
    rec = psr.ParamSyncRecorder(backend="gloo")
    with rec.training_step(1):
        rec.record_call("dense", lambda: torch.empty(64, dtype=torch.uint8))
    rec.write(tmp_path, "tree-x")
    record = json.loads((tmp_path / "rank0.json").read_text())
    assert record["steps"]["1"]["param_sync"]["dense"]["megatron_bytes"] == 64
    summary = memory_report.summarize_records(memory_report.load_rank_records(tmp_path))
    assert summary["steps"]["1"]["megatron_bytes"] == 64 and summary["tree"] == "tree-x"
    record["world"] = 2
    (tmp_path / "rank0.json").write_text(json.dumps(record))
    with pytest.raises(memory_report.MemoryRecordError, match=r"ranks \[1\]"):
        memory_report.load_rank_records(tmp_path)
    with pytest.raises(memory_report.MemoryRecordError, match="no param-sync records"):
        memory_report.load_rank_records(tmp_path / "absent")


# --------------------------------------------------------------------------- 2 gloo ranks


@pytest.fixture(scope="module")
def worker_runs(tmp_path_factory):
    """{tree: {rank: (record, expected)}} of the worker on 2 ranks, each tree once."""
    cache = {}

    def get(tree):
        if tree not in cache:
            out = tmp_path_factory.mktemp(f"recorder_{tree}")
            argv, env = torchrun_command(WORKER, ["--out", str(out)], 2, tree=tree, preload=CORE_PRELOAD)
            try:
                run_command(argv, env, run_dir=out / "logs", timeout_s=300, what=f"recorder worker on {tree}")
            except LaunchError as e:
                raise AssertionError(str(e)) from None
            cache[tree] = {
                r: (json.loads((out / f"rank{r}.json").read_text()),
                    json.loads((out / f"expected{r}.json").read_text()))
                for r in range(2)
            }  # fmt: skip
        return cache[tree]

    return get


def _cells(record, expected):
    """(section, step, kind, recorded totals, expected per-kind dict) of every expected cell."""
    for section in ("steps", "between_steps"):
        for step, exp in expected[section].items():
            for kind, calls in exp.get("entry_calls", {}).items():
                yield section, step, kind, record[section][step]["param_sync"][kind], exp


@pytest.mark.gloo
def test_pristine_bucket_syncs_count_exactly_their_temporaries(worker_runs):
    """Pristine, per rank, step and kind: megatron bytes = the theory from the bucket layout
    (receive tensors for the other ranks + the local flatten), NCCL bytes = the flat
    temporary of the equal-share list gather, entry calls as made (chained starts inside
    their finish count once); no param sync, no record; the step peak of known sizes."""
    for rank, (record, expected) in worker_runs("pristine-0.17.1").items():
        assert expected["params_synced_step_1"] and expected["params_synced_step_2"]
        cells = list(_cells(record, expected))
        assert {kind for _, _, kind, _, _ in cells} == {"dense", "expert", "optimizer"}
        for section, step, kind, got, exp in cells:
            where = f"rank {rank} {section} {step} {kind}"
            assert got["megatron_bytes"] == exp["megatron_bytes"][kind] > 0, (where, got, exp)
            assert got["nccl_temporary_bytes"] == exp["upstream_nccl_bytes"][kind], (where, got, exp)
            assert got["entry_calls"] == exp["entry_calls"][kind], (where, got, exp)
            assert got["group_size"] == 2 and got["wire_bytes"] > 0, (where, got)
        assert record["steps"]["4"]["param_sync"]["dense"]["nccl_temporary_bytes"] > 0
        assert record["steps"]["5"]["param_sync"] == {}
        assert record["steps"]["5"]["step_peak_bytes"] == expected["steps"]["5"]["step_peak_bytes"]
        assert record["steps"]["5"]["step_alloc_bytes"] == expected["steps"]["5"]["step_alloc_bytes"]


@pytest.mark.gloo
def test_patched_bucket_syncs_record_zero_bytes_and_still_gather(worker_runs):
    for rank, (record, expected) in worker_runs("series-0.17.1").items():
        assert expected["params_synced_step_1"] and expected["params_synced_step_2"]
        for section, step, kind, got, exp in _cells(record, expected):
            where = f"rank {rank} {section} {step} {kind}"
            if section == "steps":
                assert got["megatron_bytes"] == 0 and got["megatron_alloc_calls"] == 0, (where, got)
            else:  # the forced sync at eval receives into a temporary per bucket (grad_data may hold grads)
                assert got["megatron_bytes"] > 0, (where, got)
            assert got["nccl_temporary_bytes"] == 0, (where, got)
            assert got["entry_calls"] == exp["entry_calls"][kind], (where, got, exp)
            assert got["calls"] > 0 and got["wire_bytes"] > 0, (where, got)
        # Step 4's only allocations were the pristine sync's: none here.
        assert record["steps"]["4"]["step_peak_bytes"] == 0
