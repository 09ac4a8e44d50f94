"""Upstream's pretrain_gpt.py (``harness.launch.PRETRAIN_SCRIPT``) on 2 CPU gloo ranks: loss falls, repeat runs and save/resume are
bitwise identical to a straight run (per-iteration tensorboard scalars).

Four short runs of the tiny GPT (``launch.tiny_gpt_args``: dist_muon, both overlaps, bf16,
fp32 grad accumulation, dropout on, eval at N/2) on the patched tree, shared by the tests:

    straight   N iterations
    repeat     N iterations again
    first      N-iteration schedule, ``--save`` and exit at N/2 (torch_dist checkpoint)
    resumed    ``--load`` that checkpoint, continue to N
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
def runs(tmp_path_factory) -> Dict[str, Path]:
    """Train the four runs (about 12 s each on 2 idle cores); return their tensorboard dirs."""
    base = tmp_path_factory.mktemp("pretrain_cpu")
    ckpt = base / "ckpt"

    def args(name: str):
        return launch.tiny_gpt_args(N, tensorboard_dir=base / name / "tb", eval_interval=N // 2)

    plan = {
        "straight": args("straight"),
        "repeat": args("repeat"),
        "first": args("first") + ["--save", str(ckpt), "--save-interval", str(N // 2),
                                  "--exit-interval", str(N // 2), "--ckpt-format", "torch_dist"],
        "resumed": args("resumed") + ["--load", str(ckpt), "--ckpt-format", "torch_dist"],
    }
    for name, megatron_args in plan.items():
        launch.run_pretrain(TREE, megatron_args, nproc=2, run_dir=base / name, timeout_s=300)
    return {name: base / name / "tb" for name in plan}


@pytest.mark.slow
@pytest.mark.gloo
def test_every_metric_every_step(runs):
    for tag in METRICS:
        assert sorted(tb_scalars(runs["straight"], tag)) == list(range(1, N + 1)), tag


@pytest.mark.slow
@pytest.mark.gloo
def test_loss_falls(runs):
    loss = tb_scalars(runs["straight"], "lm loss")
    first, last = sum(loss[s] for s in range(1, 4)) / 3, sum(loss[s] for s in range(N - 2, N + 1)) / 3
    assert last < first - 0.5, f"lm loss did not fall: first3 {first:.4f} last3 {last:.4f}"


@pytest.mark.slow
@pytest.mark.gloo
def test_repeat_run_bitwise_equal(runs):
    for tag in METRICS:
        a, b = tb_scalars(runs["straight"], tag), tb_scalars(runs["repeat"], tag)
        diff = {s: (a[s], b.get(s)) for s in a if a[s] != b.get(s)}
        assert len(a) == N and not diff, f"{tag}: repeat run differs at {diff}"


@pytest.mark.slow
@pytest.mark.gloo
def test_save_resume_bitwise_equal(runs):
    for tag in METRICS:
        straight = tb_scalars(runs["straight"], tag)
        first, resumed = tb_scalars(runs["first"], tag), tb_scalars(runs["resumed"], tag)
        assert sorted(first) == list(range(1, N // 2 + 1)), f"{tag}: first half steps {sorted(first)}"
        assert sorted(resumed) == list(range(N // 2 + 1, N + 1)), f"{tag}: resumed steps {sorted(resumed)}"
        joined = {**first, **resumed}
        diff = {s: (straight[s], joined.get(s)) for s in straight if straight[s] != joined.get(s)}
        assert len(straight) == N and not diff, f"{tag}: save/resume differs from straight run at {diff}"


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
