"""memory_report and the plot's memory panel on recorded param-sync files.

The fixture tests/unit_tests/fixtures/param_sync/<tree>/rank<R>.json holds the rank files of
a real run: the MoE functional case (EP 2 x expert-DP 2 on 4 ranks, dense DP 4) trained for
4 steps with a validation pass after step 2 (a forced sync between steps) and 1 warm-up
iteration, both trees.
Expected numbers are computed here from the rank files, not by the code under test.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from tests.functional_tests.python_test_utils import memory_report, plot

FIXTURE = Path(__file__).with_name("fixtures") / "param_sync"
MIB = 1024 * 1024


def _fixture_summary(tree):
    return memory_report.summarize_records(memory_report.load_rank_records(FIXTURE / tree))


def test_memory_summary_of_the_recorded_fixture():
    """Per step the max over ranks of the kinds' sum; kinds summed over steps and ranks,
    computed here straight from the rank files."""
    raw = {int(p.stem[4:]): json.loads(p.read_text()) for p in (FIXTURE / "upstream").glob("rank*.json")}
    summary = _fixture_summary("upstream")
    assert summary["ranks"] == len(raw) == 4
    for step, row in summary["steps"].items():
        per_rank = [sum(k["megatron_bytes"] for k in r["steps"][step]["param_sync"].values()) for r in raw.values()]
        assert row["megatron_bytes"] == max(per_rank)
        assert row["step_peak_bytes"] == max(r["steps"][step]["step_peak_bytes"] for r in raw.values())
    expert_wire = sum(k["wire_bytes"] for r in raw.values() for sec in ("steps", "between_steps")
                      for s in r[sec].values() for name, k in s["param_sync"].items() if name == "expert")
    assert summary["kinds"]["expert"]["wire_bytes"] == expert_wire > 0
    assert summary["kinds"]["expert"]["group_size"] == 2 and summary["kinds"]["dense"]["group_size"] == 4
    assert summary["between_steps"], "the fixture's validation pass forces a sync between steps"
    patched = _fixture_summary("patched")
    assert memory_report.step_maxima(patched)["megatron_bytes"] == 0
    assert memory_report.step_maxima(summary)["megatron_bytes"] > 0


def test_memory_block_prints_both_trees_in_mib():
    memories = {"upstream": _fixture_summary("upstream"), "patched": _fixture_summary("patched")}
    text = memory_report.format_memory(memories)
    up = memory_report.step_maxima(memories["upstream"])
    row = next(line for line in text.splitlines() if "param sync, megatron tensors" in line)
    assert row.split()[-2:] == [f"{up['megatron_bytes'] / MIB:.3f}", "0.000"]
    peak_row = next(line for line in text.splitlines() if "step peak" in line)
    assert peak_row.split()[-2] == f"{up['step_peak_bytes'] / MIB:.3f}"
    assert "expert param sync on a group of 2 ranks" in text
    dense = memories["upstream"]["kinds"]["dense"]
    assert (f"    upstream: {dense['calls']} c10d calls, {dense['ops']} NCCL operations ({dense['zero_size_ops']} zero-size) "
            f"in {dense['launches']} group launches") in text
    assert "c10d call: one torch.distributed function call" in text
    assert memory_report.format_memory({"upstream": None, "patched": None}) == "memory: no param-sync records"


def test_plot_draws_the_memory_panel_from_the_fixture(tmp_path):
    from tests.functional_tests.python_test_utils.golden_schema import MetricSeries

    memories = {"upstream": _fixture_summary("upstream"), "patched": _fixture_summary("patched")}
    steps = [int(s) for s in memories["upstream"]["steps"]]
    curve = {"lm loss": MetricSeries(min(steps), max(steps), 1, {s: 9.0 - s for s in steps})}
    lines = plot.memory_lines(memories)
    by_key = {(variant, fld): (xs, ys) for variant, fld, xs, ys in lines}
    xs, ys = by_key[("upstream", "megatron_bytes")]
    assert xs == steps
    assert ys == [memories["upstream"]["steps"][str(s)]["megatron_bytes"] / MIB for s in steps]
    assert max(by_key[("patched", "megatron_bytes")][1]) == 0
    assert len(lines) == 4
    fig = plot.build_figure({"upstream": curve, "patched": curve}, memory=memories)
    sync = next(ax for ax in fig.axes if ax.get_title().startswith("layer-wise param sync"))
    labels = [line.get_label() for line in sync.get_lines()]
    # Every row of the printed memory block is drawn, with the maximum the block prints.
    up = memory_report.step_maxima(memories["upstream"])
    assert f"upstream: megatron tensors, per step (max {up['megatron_bytes'] / MIB:.3f})" in labels
    assert f"upstream: NCCL temporaries, forced sync after the step (max {up['between_nccl_temporary_bytes'] / MIB:.3f})" in labels
    assert "patched: megatron tensors, forced sync after the step (max 0.000)" in labels
    path = plot.plot_loss_curves(tmp_path / "p.png", {"upstream": curve, "patched": curve}, memory=memories)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert plot.memory_lines({"upstream": None}) == []


def test_write_run_memory_writes_memory_json(tmp_path):
    shutil.copytree(FIXTURE / "patched", tmp_path / "param_sync")
    summary = memory_report.write_run_memory(tmp_path / "param_sync", tmp_path)
    assert memory_report.load_run_memory(tmp_path) == summary
    assert memory_report.load_run_memory(tmp_path / "nothing") is None


def test_expected_syncs_of_a_case_are_checked_against_the_record():
    summary = _fixture_summary("patched")
    assert memory_report.check_expected_syncs(summary, {"expert": {"group_size": 2}, "dense": {"group_size": 4}}) == []
    (wrong_group,) = memory_report.check_expected_syncs(summary, {"expert": {"group_size": 4}})
    assert "group of 2 ranks, expected 4" in wrong_group
    (absent,) = memory_report.check_expected_syncs(summary, {"optimizer": {"group_size": 4}})
    assert absent.startswith("no optimizer param-sync gather was recorded")
    no_wire = json.loads(json.dumps(summary))
    no_wire["kinds"]["expert"]["wire_bytes"] = 0
    assert memory_report.check_expected_syncs(no_wire, {"expert": {"group_size": 2}})


def test_bad_expect_param_sync_is_a_config_error(tmp_path):
    from tests.functional_tests.python_test_utils import run_case as rc

    src = rc.find_case(rc.DEFAULT_CASE) / "model_config.yaml"
    for bad, match in ((["expert"], "must map a kind"), ({"experts": {"group_size": 2}}, "not in")):
        folder = tmp_path / f"case{len(match)}"
        folder.mkdir()
        doc = yaml.safe_load(src.read_text())
        doc["EXPECT_PARAM_SYNC"] = bad
        (folder / "model_config.yaml").write_text(yaml.safe_dump(doc))
        with pytest.raises(rc.CaseConfigError, match=match):
            rc.load_case(folder)
