"""``cpu_gloo_plugin`` and ``upstream_runner``, on tiny test files run as upstream's are.

* Item 8: two tests that draw from the default generator in one pytest session must draw the
  same numbers, those of a fresh ``torch.manual_seed(SEED)``. Without the seeding the second
  draws after the first, and the parameter-update tests' outcomes would again depend on the
  tests run before them.
* Item 9: a test failing with gloo's connect failure on one rank, while the other waits in
  the test's barrier, stops the run there; the runner runs that test and the rest once more.
  Without the stop, rank 0 goes on to the next test while rank 1 is still in the first one.
"""

from __future__ import annotations

import json
import subprocess

import pytest
import torch

from tests.upstream_tests import upstream_runner as ur

pytestmark = [pytest.mark.gloo]

#: cpu_gloo_plugin.SEED (importing the plugin here would install the CPU runtime in this process).
SEED = 0

@pytest.fixture
def checkout():
    """The pristine 0.17.1 checkout: the plugin needs a Megatron-LM checkout to run in."""
    path = ur.CHECKOUTS["pristine-0.17.1"]
    if not (path / "tests" / "unit_tests").is_dir():
        pytest.skip(f"{path} missing (scripts/setup.sh)")
    return path


DRAWS = '''
import json, os, torch
def _draw(name):
    with open(os.path.join(os.environ["TEST_DIR"], name + ".json"), "w") as f:
        json.dump(torch.rand(4).tolist() + torch.randn(2).tolist(), f)
def test_first():
    _draw("first")
def test_second():
    _draw("second")
'''


def test_every_test_is_called_from_the_same_seed(checkout, tmp_path):
    test_file = tmp_path / "test_draws.py"
    test_file.write_text(DRAWS)
    argv, env = ur.command(checkout, [str(test_file)], 1, tmp_path / "results")
    env["TEST_DIR"] = str(tmp_path)
    proc = subprocess.run(argv, env=env, cwd=checkout, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    torch.manual_seed(SEED)
    expected = torch.rand(4).tolist() + torch.randn(2).tolist()
    for name in ("first", "second"):
        assert json.loads((tmp_path / f"{name}.json").read_text()) == expected, name


CONNECT = '''
import os, pathlib, torch
from tests.unit_tests.test_utilities import Utils
MARK = pathlib.Path(os.environ["TEST_DIR"]) / "connect_failures"
def test_1_connect():
    Utils.initialize_distributed()
    failed = len(MARK.read_text()) if MARK.exists() else 0
    if Utils.rank == 0 and failed < int(os.environ["CONNECT_FAILURES"]):
        MARK.write_text("x" * (failed + 1))
        raise RuntimeError("Gloo connectFullMesh failed with [a stand-in for gloo's]")
    torch.distributed.barrier()
def test_2_after():
    Utils.initialize_distributed()
    torch.distributed.barrier()
'''


@pytest.mark.extended
def test_a_gloo_connect_failure_stops_the_run_and_the_rest_runs_again(checkout, tmp_path, monkeypatch):
    test_file = tmp_path / "test_connect.py"
    test_file.write_text(CONNECT)
    monkeypatch.setenv("TEST_DIR", str(tmp_path))
    monkeypatch.setenv("CONNECT_FAILURES", str(ur.RETRIES))  # the test fails in the run and in all but the last retry
    monkeypatch.setattr(ur, "RETRY_PAUSE_S", 0)
    out = tmp_path / "results"
    result = ur.run("pristine-0.17.1", 2, [str(test_file)], timeout_s=300, out_dir=out, checkout=checkout)
    first = json.loads((out / "rank0.json").read_text())
    assert first["aborted"] and not [k for k in first["results"] if k.endswith("::test_2_after")], first
    assert [k.split("::")[-1] for k in result.retried] == ["test_1_connect"], (result.retried, result.log)
    assert {k.split("::")[-1]: v for k, v in result.results.items()} == \
        {"test_1_connect": "passed", "test_2_after": "passed"}, (result.results, result.log)
    assert result.returncode == 0, result.log
