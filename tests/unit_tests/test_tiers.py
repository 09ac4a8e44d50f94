"""The default run (CI) leaves the sweeps out (tests/tiers.py): this checks that the last
run of the sweeps that passed (``scripts/test.sh --all``, or ``-m extended``: the sweeps
alone) checked the series and mutants as they are now."""

from __future__ import annotations

import json

from harness.trees import REPO_ROOT
from tests.tiers import RECORD, RECORDED, series_fingerprint


def test_the_sweeps_passed_on_this_series():
    """docs/full_run.json, written by a run of the sweeps that passed, holds the sha256 of each
    base's manifest.sha256 and of the mutants as they are in this commit: a change to
    patches/ or tests/mutants/ needs that run again (the sweeps alone: about 35 min on 2 cores)."""
    assert RECORD.is_file(), f"{RECORD} is missing: run scripts/test.sh --all"
    rec = json.loads(RECORD.read_text())
    now = series_fingerprint(REPO_ROOT)
    stale = [k for k in ("series", "mutants") if rec.get(k) != now[k]]
    assert not stale, (
        f"the last run of the sweeps ({rec.get('command')}, {rec.get('date')}) checked other {' and '.join(stale)} "
        f"than this commit's: run scripts/test.sh -m extended; it rewrites {RECORD.relative_to(REPO_ROOT)}"
    )
    assert rec["passed"] > 0 and rec["command"] in RECORDED.values(), rec


def test_the_fingerprint_changes_with_a_patch_byte(tmp_path):
    """The fingerprint reads the bytes: one byte more in a manifest or a mutant changes it."""
    for rel in ("patches/0.17.1/manifest.sha256", "tests/mutants/a/x.patch"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("a\n")
    before = series_fingerprint(tmp_path)
    (tmp_path / "tests/mutants/a/x.patch").write_text("a\n\n")
    after = series_fingerprint(tmp_path)
    assert before["series"] == after["series"] and before["mutants"] != after["mutants"]
    (tmp_path / "patches/0.17.1/manifest.sha256").write_text("b\n")
    assert series_fingerprint(tmp_path)["series"] != before["series"]


def _report(nodeid, when, duration):
    """A test phase's report as the terminal reporter keeps it (xdist's, rebuilt in the
    controller, has the same attributes)."""
    from types import SimpleNamespace

    return SimpleNamespace(nodeid=nodeid, when=when, duration=duration)


def _session(root, markexpr, args=("tests",), keyword="", passed=3, collectonly=False, stats=None):
    from types import SimpleNamespace

    calls = [_report(f"tests/unit_tests/test_a.py::test_{i}", "call", 0.5) for i in range(passed)]
    reporter = SimpleNamespace(stats=stats or {"passed": calls, "skipped": []})
    config = SimpleNamespace(
        option=SimpleNamespace(markexpr=markexpr, keyword=keyword, collectonly=collectonly),
        args=[str(root / a) for a in args],
        rootpath=root,
        pluginmanager=SimpleNamespace(get_plugin=lambda name: reporter),
    )
    return SimpleNamespace(config=config, _full_run_started=None)


def test_only_a_whole_run_of_the_sweeps_that_passed_is_recorded(tmp_path, monkeypatch):
    """record_full_run writes the record for a passing run of all of tests/ under --all's or
    -m extended's selection, and for nothing else: a failure, a path, -k, the default run,
    --collect-only, a run in which no test passed."""
    from tests import tiers

    (tmp_path / "patches/0.17.1").mkdir(parents=True)
    (tmp_path / "patches/0.17.1/manifest.sha256").write_text("m\n")
    record = tmp_path / "full_run.json"
    monkeypatch.setattr(tiers, "RECORD", record)
    for session, status in [
        (_session(tmp_path, tiers.ALL_MARKEXPR), 1),
        (_session(tmp_path, tiers.ALL_MARKEXPR, args=("tests/unit_tests",)), 0),
        (_session(tmp_path, tiers.ALL_MARKEXPR, keyword="patch"), 0),
        (_session(tmp_path, "not extended"), 0),
        (_session(tmp_path, "extended", passed=0, collectonly=True), 0),
        (_session(tmp_path, "extended", passed=0), 0),
    ]:
        tiers.record_full_run(session, status)
        assert not record.exists()
    tiers.record_full_run(_session(tmp_path, "extended"), 0)
    rec = json.loads(record.read_text())
    assert rec["command"] == "scripts/test.sh -m extended" and rec["passed"] == 3
    assert rec["series"] == series_fingerprint(tmp_path)["series"]


def test_the_record_holds_each_files_summed_test_durations(tmp_path, monkeypatch):
    """file_seconds in the record: per test file, the sum of its tests' setup, call and
    teardown durations (s, 1 decimal), whichever outcome category the reporter filed each
    phase under (a passed setup or teardown under "", a call under its outcome), from the
    reports of both xdist workers; warnings, deselected items and collection reports are
    not test phases and count nothing."""
    from types import SimpleNamespace

    from tests import tiers

    (tmp_path / "patches/0.19").mkdir(parents=True)
    (tmp_path / "patches/0.19/manifest.sha256").write_text("m\n")
    monkeypatch.setattr(tiers, "RECORD", tmp_path / "full_run.json")
    a, b = "tests/unit_tests/test_a.py", "tests/upstream_tests/test_b.py"
    stats = {
        "": [_report(f"{a}::t1", "setup", 0.04), _report(f"{a}::t1", "teardown", 0.01),
             _report(f"{b}::C::t[x]", "setup", 2.0), _report(f"{b}::C::t[x]", "teardown", 0.26)],
        "passed": [_report(f"{a}::t1", "call", 1.2), _report(f"{b}::C::t[x]", "call", 60.0),
                   _report(f"{a}::t2", "call", 0.3)],
        "skipped": [_report(f"{a}::t3", "setup", 0.02)],
        "warnings": [SimpleNamespace(nodeid=f"{a}::t1", message="w")],
        "deselected": [SimpleNamespace(nodeid=f"{b}::C::t[y]")],
        "error": [SimpleNamespace(nodeid="tests/c.py", when="collect", duration=9.0)],
    }
    tiers.record_full_run(_session(tmp_path, "extended", stats=stats), 0)
    rec = json.loads(tiers.RECORD.read_text())
    assert rec["file_seconds"] == {a: 1.6, b: 62.3}, rec["file_seconds"]
    assert list(rec["file_seconds"]) == sorted(rec["file_seconds"])
    assert rec["passed"] == 3 and rec["skipped"] == 0
