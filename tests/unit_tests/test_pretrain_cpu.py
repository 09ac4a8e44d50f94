"""Upstream's pretrain_gpt.py (``harness.launch.PRETRAIN_SCRIPT``) through ``harness.launch`` on 2
CPU gloo ranks: every metric is logged at every step and the loss falls.

One run of the tiny GPT (``launch.tiny_gpt_args``: dist_muon, both overlaps, bf16, fp32
grad accumulation, dropout on, eval at N/2) on the patched tree, shared by the tests.
Bitwise repeatability and save/resume are the functional cases' job: each compares two
trees bit for bit, and the ckpt-resume case compares its resumed steps with the straight
run (tests/functional_tests).
"""

from __future__ import annotations

import glob
import os
import subprocess
import sys
from pathlib import Path
from typing import Dict

import pytest

from harness import launch

ROOT = Path(__file__).resolve().parents[2]
N = 20
TREE = "patched"
METRICS = ("lm loss", "grad-norm", "num-zeros", "params-norm", "learning-rate")


def tb_scalars(tb_dir: Path, tag: str) -> Dict[int, float]:
    """``{iteration: value}`` of one scalar tag over all event files in ``tb_dir``."""
    from tensorboard.backend.event_processing import event_accumulator

    values: Dict[int, float] = {}
    for path in sorted(glob.glob(str(tb_dir / "events.out.tfevents.*"))):
        acc = event_accumulator.EventAccumulator(path, size_guidance={event_accumulator.SCALARS: 0})
        acc.Reload()
        if tag in acc.Tags()["scalars"]:
            values.update({event.step: event.value for event in acc.Scalars(tag)})
    return values


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> Path:
    """Train N iterations (about 12 s on 2 idle cores); return the tensorboard dir."""
    base = tmp_path_factory.mktemp("pretrain_cpu")
    megatron_args = launch.tiny_gpt_args(N, tensorboard_dir=base / "tb", eval_interval=N // 2)
    launch.run_pretrain(TREE, megatron_args, nproc=2, run_dir=base / "run", timeout_s=300)
    return base / "tb"


@pytest.mark.slow
@pytest.mark.gloo
@pytest.mark.smoke
def test_every_metric_every_step(straight):
    """Smoke test (passes on pristine 0.17.1 too; not a check of the series): megatron logs
    every metric at every step of a run on the patched tree."""
    for tag in METRICS:
        assert sorted(tb_scalars(straight, tag)) == list(range(1, N + 1)), tag


@pytest.mark.slow
@pytest.mark.gloo
@pytest.mark.smoke
def test_loss_falls(straight):
    """Smoke test (passes on pristine 0.17.1 too; not a check of the series): the tiny GPT
    learns, lm loss over the last 3 steps at least 0.5 below the first 3."""
    loss = tb_scalars(straight, "lm loss")
    first, last = sum(loss[s] for s in range(1, 4)) / 3, sum(loss[s] for s in range(N - 2, N + 1)) / 3
    assert last < first - 0.5, f"lm loss did not fall: first3 {first:.4f} last3 {last:.4f}"


def test_pretrain_refuses_wrong_tree():
    """MEGATRON_EXPECT_TREE names the pristine tree while PYTHONPATH gives the patched one."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), MEGATRON_EXPECT_TREE=str(ROOT / "build" / "upstream" / "megatron"),
               MEGATRON_CPU_RUNTIME="force", PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, str(launch.PRETRAIN_SCRIPT)], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "RuntimeError: imported megatron from" in proc.stderr and "expected" in proc.stderr


def test_launch_reports_failing_rank(tmp_path):
    """A rank that dies makes run_pretrain raise with the stderr tail (here: a bad flag)."""
    with pytest.raises(launch.LaunchError, match="run failed") as info:
        launch.run_pretrain(TREE, launch.tiny_gpt_args(2) + ["--num-layers", "not-a-number"], nproc=2,
                            run_dir=tmp_path, timeout_s=120)
    assert "stderr tail" in str(info.value) and "--num-layers" in str(info.value)
