"""harness/fork_ranks.py, the CPU launcher: its ranks see what torchrun's ranks see, and a
failing rank ends the run as under torchrun."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from harness import launch
from harness.trees import REPO_ROOT

WORKER = Path(__file__).with_name("fork_ranks_worker.py")
NPROC = 3

pytestmark = [pytest.mark.gloo]


def _ranks(out: Path, launcher: str, *mode: str, timeout_s: float = 120):
    out.mkdir()
    argv, env = launch.torchrun_command(WORKER, [str(out), *mode], NPROC, tree="series-0.17.1", launcher=launcher)
    proc = subprocess.run(argv, env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout_s)
    facts = [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]
    return proc, facts


@pytest.mark.extended
def test_forked_ranks_see_what_torchrun_ranks_see(tmp_path):
    """Same torchrun variables, argv, sys.path[0] and __main__ on every rank, and a gloo group
    from the environment that all ranks join (all_reduce of 1+2+3)."""
    (t_proc, torchrun), (f_proc, forked) = (_ranks(tmp_path / l, l) for l in ("torchrun", "fork"))
    assert t_proc.returncode == 0 and f_proc.returncode == 0, (t_proc.stderr[-2000:], f_proc.stderr[-2000:])
    assert len(forked) == len(torchrun) == NPROC
    for t, f in zip(torchrun, forked):
        assert f["env"] == t["env"]
        assert f["argv"][0] == t["argv"][0] == str(WORKER) and f["argv"][1:] == [str(tmp_path / "fork")]
        assert f["path0"] == t["path0"] == str(WORKER.parent)
        assert f["name"] == t["name"] == "__main__"
        assert f["all_reduce"] == t["all_reduce"] == 6.0
    assert [f["env"]["RANK"] for f in forked] == ["0", "1", "2"]


def test_a_failing_rank_ends_the_others(tmp_path):
    """Rank 1 exits 3 while ranks 0 and 2 sleep 600 s: the run ends at once (SIGTERM), exit 1,
    and stderr names the rank and its exit code."""
    start = time.monotonic()
    proc, facts = _ranks(tmp_path / "fail", "fork", "fail")
    assert len(facts) == NPROC, proc.stderr[-2000:]
    assert proc.returncode == 1
    assert "fork_ranks: rank 1 " in proc.stderr and "exit code 3" in proc.stderr, proc.stderr[-2000:]
    assert time.monotonic() - start < 60


def test_gpu_runs_are_not_forked():
    with pytest.raises(ValueError, match="launcher"):
        launch.torchrun_command(WORKER, [], 2, tree="series-0.17.1", cpu=False, launcher="fork")
    argv, _ = launch.torchrun_command(WORKER, [], 2, tree="series-0.17.1", cpu=False)
    assert argv[1:3] == ["-m", "torch.distributed.run"]
