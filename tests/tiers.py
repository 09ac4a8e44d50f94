"""The two tiers of the suite (pytest.ini's ``extended`` marker).

The default run (``scripts/test.sh``, CI) runs every check once on the whole series of each
base; the ``extended`` tier (``scripts/test.sh --all``) adds the sweeps: every prefix of each
series, every mutant, every functional case, the 4-rank upstream run, the audit's grid.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Callable, Iterable, List

import pytest


def tiered(values: Iterable, in_default_run: Callable[[object], bool]) -> List:
    """``values`` (parametrize values: one argument each, or tuples of several) as given where
    ``in_default_run(value)`` holds, else as ``pytest.param`` marked ``extended``."""
    out = []
    for v in values:
        if in_default_run(v):
            out.append(v)
        else:
            out.append(pytest.param(*(v if isinstance(v, tuple) else (v,)), marks=pytest.mark.extended))
    return out


# ---------------------------------------------------------------- the record of the last full run
#: What ``scripts/test.sh --all`` selects (pytest.ini deselects ``extended`` by default).
ALL_MARKEXPR = "extended or not extended"
#: The record of the last full run that passed, written by ``record_full_run`` (conftest.py)
#: and read by tests/unit_tests/test_tiers.py in the default run.
RECORD = Path(__file__).resolve().parents[1] / "docs" / "full_run.json"


def series_fingerprint(root: Path) -> dict:
    """What the sweeps check, by sha256: each base's ``manifest.sha256`` (the sha256 of every
    patch file and of every touched file before and after) and the mutants' patch files.

    Returns: {"series": {base: sha256 hex}, "mutants": sha256 hex over the sorted paths and bytes}.
    """
    series = {
        m.parent.name: hashlib.sha256(m.read_bytes()).hexdigest()
        for m in sorted((root / "patches").glob("*/manifest.sha256"))
    }
    h = hashlib.sha256()
    mutants = root / "tests" / "mutants"
    for p in sorted(mutants.rglob("*.patch")):
        h.update(str(p.relative_to(mutants)).encode() + b"\0" + p.read_bytes() + b"\0")
    return {"series": series, "mutants": h.hexdigest()}


#: The selections whose passing run is recorded: the whole suite, or the sweeps alone.
RECORDED = {ALL_MARKEXPR: "scripts/test.sh --all", "extended": "scripts/test.sh -m extended"}


def file_seconds(reports: Iterable) -> dict:
    """Per test file (the node id up to ``::``), the summed duration of its tests' setup,
    call and teardown phases, in seconds to 1 decimal, by path. ``reports``: the terminal
    reporter's stats, every category together; entries that are not a test phase's report
    (collection reports, warnings, deselected items) are left out. Under pytest-xdist the
    workers' reports reach the controller's reporter, so the sums cover every worker."""
    total: dict = {}
    for r in reports:
        if getattr(r, "when", None) not in ("setup", "call", "teardown"):
            continue
        path = r.nodeid.split("::", 1)[0]
        total[path] = total.get(path, 0.0) + float(r.duration)
    return {path: round(total[path], 1) for path in sorted(total)}


def record_full_run(session, exitstatus: int) -> None:
    """At the end of a run of every test of ``tests/`` selected by one of RECORDED (no path or
    ``-k``, not ``--collect-only``) that passed, write RECORD: the command, the fingerprint,
    the outcome counts, the wall time (s), the UTC date and each test file's summed test
    duration (``file_seconds``). A run in which no test passed (``--collect-only`` exits 0
    having run none) leaves RECORD as it is; so does every other run, the default one
    included (nothing is computed or printed there). Called by conftest.py's
    ``pytest_sessionfinish`` in the controlling process."""
    config = session.config
    if exitstatus != 0 or config.option.markexpr not in RECORDED or config.option.keyword:
        return
    if config.option.collectonly:
        return
    if [Path(a).resolve() for a in config.args] != [Path(config.rootpath, "tests").resolve()]:
        return
    stats = config.pluginmanager.get_plugin("terminalreporter").stats
    count = {k: len([r for r in stats.get(k, []) if getattr(r, "when", "call") == "call"]) for k in ("passed", "skipped")}
    if count["passed"] == 0:
        return
    started = getattr(session, "_full_run_started", None)
    data = {
        "command": RECORDED[config.option.markexpr],
        **series_fingerprint(Path(config.rootpath)),
        **count,
        "wall_s": round(time.time() - started) if started else None,
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "file_seconds": file_seconds(r for reports in stats.values() for r in reports),
    }
    RECORD.write_text(json.dumps(data, indent=1) + "\n")
