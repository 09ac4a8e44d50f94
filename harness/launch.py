"""Launch ``harness.pretrain_gpt`` under torchrun for one megatron tree, with a timeout.

The command line and environment are built here so that tests, functional tests and
people run the same thing::

    from harness import launch
    wall_s = launch.run_pretrain("patched", launch.tiny_gpt_args(train_iters=50,
                                 tensorboard_dir="build/runs/x/tb"), nproc=2,
                                 run_dir="build/runs/x")

On CPU (the default) ranks use gloo and ``harness.cpu_runtime`` (``MEGATRON_CPU_RUNTIME=1``);
with ``cpu=False`` they use NCCL on GPUs. Everything else on the command line is the same:
``RUNTIME_FLAGS`` (local transformer implementation, CPU initialization, no fused kernels)
apply to both, so CPU and GPU runs differ only in ``--distributed-backend``.

Tree selection goes through ``harness.trees.env_for_tree``: PYTHONPATH puts the chosen tree
first and ``MEGATRON_EXPECT_TREE`` makes ``pretrain_gpt`` refuse to train on another one.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple, Union

from harness.trees import env_for_tree

#: Flags every harness run gets, on CPU and GPU alike (UPSTREAM_NOTES, "What the CPU prototype
#: needed"): megatron-core's local layers, init on CPU, and none of the fused kernels that only
#: exist for CUDA (persistent layer norm, gradient-accumulation fusion, masked softmax,
#: bias-gelu/swiglu, bias-dropout, rope).
RUNTIME_FLAGS: Tuple[str, ...] = (
    "--transformer-impl", "local",
    "--use-cpu-initialization",
    "--no-persist-layer-norm",
    "--no-gradient-accumulation-fusion",
    "--no-masked-softmax-fusion",
    "--no-bias-gelu-fusion",
    "--no-bias-swiglu-fusion",
    "--no-bias-dropout-fusion",
    "--no-rope-fusion",
)


class LaunchError(RuntimeError):
    """A launched run failed or timed out; the message holds the command and the log tail."""


def tiny_gpt_args(
    train_iters: int = 50,
    *,
    tensorboard_dir: Optional[Union[str, Path]] = None,
    eval_interval: int = 25,
    eval_iters: int = 1,
    seed: int = 1234,
    data: Sequence[str] = ("--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "1024"),
) -> List[str]:
    """Megatron flags of the tiny GPT the harness trains (layer-wise optimizer, both overlaps).

    2 layers, hidden 64, 4 heads, seq 64, micro-batch 2, global batch 8; ``dist_muon`` with
    ``--overlap-param-gather --overlap-grad-reduce``, ``--bf16`` params with fp32 gradient
    accumulation; cosine LR 3e-3 -> 3e-4 after 5 warm-up iterations; tensorboard gets
    'lm loss', 'grad-norm', 'num-zeros', 'params-norm', 'learning-rate' every iteration.

    Args:
        train_iters: iterations (the LR schedule spans them).
        tensorboard_dir: where event files go; None logs no tensorboard.
        eval_interval, eval_iters: validation cadence (eval forces a param sync).
        seed: ``--seed``.
        data: dataset/tokenizer flags; default mock data with a 1024-token NullTokenizer.
            For real text pass e.g. ``["--data-path", prefix, "--split", "949,50,1",
            "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", dir]``.

    Returns:
        Flags (list of str) without backend/runtime flags (``pretrain_command`` adds those).
    """
    args = [
        "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "64", "--max-position-embeddings", "64",
        "--micro-batch-size", "2", "--global-batch-size", "8",
        "--train-iters", str(train_iters),
        "--lr", "3e-3", "--min-lr", "3e-4", "--lr-decay-style", "cosine", "--lr-warmup-iters", "5",
        "--weight-decay", "0.01", "--clip-grad", "1.0",
        "--optimizer", "dist_muon", "--overlap-param-gather", "--overlap-grad-reduce",
        "--bf16", "--accumulate-allreduce-grads-in-fp32",
        "--num-workers", "0", "--seed", str(seed),
        "--eval-interval", str(eval_interval), "--eval-iters", str(eval_iters),
        "--log-interval", "1",
        *data,
    ]
    if tensorboard_dir is not None:
        args += [
            "--tensorboard-dir", str(tensorboard_dir), "--tensorboard-log-interval", "1",
            "--log-params-norm", "--log-num-zeros-in-grad", "--log-timers-to-tensorboard",
        ]
    return args


def pretrain_command(
    tree: Union[str, Path],
    megatron_args: Sequence[str],
    nproc: int = 2,
    *,
    cpu: bool = True,
    runtime_flags: bool = True,
    extra_env: Optional[Dict[str, str]] = None,
) -> Tuple[List[str], Dict[str, str]]:
    """The torchrun command and environment that train ``harness.pretrain_gpt`` on ``tree``.

    Args:
        tree: "upstream" (pristine), "patched", or a directory holding a megatron/ tree.
        megatron_args: Megatron flags (e.g. ``tiny_gpt_args()``), appended last: they win
            over ours where argparse lets the last occurrence win.
        nproc: ranks on this node (``--nproc-per-node``); keep <= 4 on small CPU machines.
        cpu: gloo + ``MEGATRON_CPU_RUNTIME=1``; False: NCCL on GPUs.
        runtime_flags: prepend ``RUNTIME_FLAGS``.
        extra_env: merged into the environment last.

    Returns:
        ``(argv, env)``. torchrun runs ``--standalone`` (a free local rendezvous port), so
        concurrent runs do not collide.

    Raises:
        ValueError / FileNotFoundError: from ``harness.trees.env_for_tree`` (unknown or
            missing tree).
    """
    env = env_for_tree(tree)
    env.update(OMP_NUM_THREADS="1", CUDA_DEVICE_MAX_CONNECTIONS="1", PYTHONUNBUFFERED="1")
    if cpu:
        env["MEGATRON_CPU_RUNTIME"] = "1"
    else:
        env.pop("MEGATRON_CPU_RUNTIME", None)
    env.update(extra_env or {})
    argv = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
        # By path, not "-m harness.pretrain_gpt": "-m" puts the working directory (the
        # repo root, which holds the patched megatron/) first on sys.path, ahead of the
        # tree that PYTHONPATH selects.
        str(Path(__file__).resolve().parent / "pretrain_gpt.py"),
        "--distributed-backend", "gloo" if cpu else "nccl",
        *(RUNTIME_FLAGS if runtime_flags else ()),
        *megatron_args,
    ]
    return argv, env


def _tail(path: Path, lines: int) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def run_pretrain(
    tree: Union[str, Path],
    megatron_args: Sequence[str],
    nproc: int = 2,
    *,
    run_dir: Union[str, Path],
    cpu: bool = True,
    timeout_s: float = 600,
    runtime_flags: bool = True,
    extra_env: Optional[Dict[str, str]] = None,
    tail_lines: int = 40,
) -> float:
    """Run one training job and wait for it.

    Args:
        tree, megatron_args, nproc, cpu, runtime_flags, extra_env: see ``pretrain_command``.
        run_dir: created if needed; gets ``command.txt``, ``stdout.log`` and ``stderr.log``.
        timeout_s: wall-clock limit in seconds; the whole process group is killed after it.
        tail_lines: how many stderr lines a failure message quotes.

    Returns:
        Wall time of the job in seconds (start-up included).

    Raises:
        LaunchError: non-zero exit of torchrun (any rank failed) or timeout; the message holds
            the command, the log paths and the last ``tail_lines`` lines of stderr.
    """
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    argv, env = pretrain_command(tree, megatron_args, nproc, cpu=cpu, runtime_flags=runtime_flags,
                                 extra_env=extra_env)
    cwd = Path(__file__).resolve().parent.parent
    (run_dir / "command.txt").write_text(
        " ".join(f"{k}={shlex.quote(env[k])}" for k in ("PYTHONPATH", "MEGATRON_EXPECT_TREE",
                                                       "MEGATRON_CPU_RUNTIME") if k in env)
        + " " + shlex.join(argv) + "\n"
    )
    stdout_path, stderr_path = run_dir / "stdout.log", run_dir / "stderr.log"
    start = time.monotonic()
    with open(stdout_path, "w") as out, open(stderr_path, "w") as err:
        proc = subprocess.Popen(argv, env=env, cwd=cwd, stdout=out, stderr=err, start_new_session=True)
        try:
            returncode = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise LaunchError(
                f"{tree} run timed out after {timeout_s:.0f} s: {shlex.join(argv)}\n"
                f"logs: {stdout_path} {stderr_path}\n--- stderr tail ---\n{_tail(stderr_path, tail_lines)}"
            ) from None
    wall_s = time.monotonic() - start
    if returncode != 0:
        raise LaunchError(
            f"{tree} run failed (torchrun exit {returncode}) after {wall_s:.1f} s: {shlex.join(argv)}\n"
            f"logs: {stdout_path} {stderr_path}\n--- stderr tail ---\n{_tail(stderr_path, tail_lines)}"
        )
    return wall_s
