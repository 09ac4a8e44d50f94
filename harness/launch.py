"""Build rank command lines in one place, and launch training with a timeout.

Every multi-rank run of the harness (training, the unit-test workers, the bench, the GPU
check) gets its command line from ``torchrun_command``, so that they all run the same
launcher with the same environment: torchrun on GPUs; on CPU ``harness/fork_ranks.py``,
which gives each rank torchrun's environment but forks the ranks from one process that
imported torch and megatron once (upstream's tests, ``tests/upstream_tests``, keep torchrun)::

    from harness import launch
    argv, env = launch.torchrun_command("tests/unit_tests/layerwise_worker.py", ["--out", "r.json"],
                                        nproc=2, tree="series-0.17.1")
    wall_s = launch.run_pretrain("series-0.17.1", megatron_args, nproc=2, run_dir="build/runs/x")

where ``megatron_args`` are Megatron's flags, e.g. a functional case's ``MODEL_ARGS``
(``tests/functional_tests/python_test_utils/run_case.py``). ``run_command`` writes the command
line to ``run_dir/command.txt`` (``format_command``), runnable as is from any directory.

On CPU (the default) ranks use gloo and ``harness.cpu_runtime`` (``MEGATRON_CPU_RUNTIME=1``);
on GPUs (``cpu=False``) NCCL. ``RUNTIME_FLAGS`` (local transformer
implementation, CPU initialization, no fused kernels) apply to both, so CPU and GPU
training runs differ only in ``--distributed-backend``, with one exception: a GPU launch on
megatron-core 0.19 or later gets no ``--use-cpu-initialization`` (``runtime_flags_for``), and
refuses it from the caller (``check_gpu_flags``): there the model builder leaves the model on
the CPU with that flag.

Tree selection goes through ``harness.trees.env_for_tree``: PYTHONPATH puts the chosen tree
first and ``MEGATRON_EXPECT_TREE`` makes the rank refuse to run on another one.
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

from harness.trees import REPO_ROOT, env_for_tree

#: Read by ``harness.cpu_runtime.install_if_requested`` in every rank.
CPU_RUNTIME_ENV = "MEGATRON_CPU_RUNTIME"
#: The training entry point that ``pretrain_command`` launches: Megatron-LM's own
#: ``pretrain_gpt.py`` from the checkout, through the thin launcher
#: ``harness/upstream_pretrain_gpt.py`` (CPU runtime layer, tree check, clean rank exit).
PRETRAIN_SCRIPT = Path(__file__).resolve().parent / "upstream_pretrain_gpt.py"
#: The CPU launcher: torchrun's ranks, forked from one process that imported torch once.
FORK_RANKS = Path(__file__).resolve().parent / "fork_ranks.py"
#: ``preload`` of the workers that build megatron-core models, DDP and optimizers themselves
#: (tests/unit_tests/*_worker.py): the fork launcher imports these once per run.
CORE_PRELOAD: Tuple[str, ...] = (
    "megatron.core.distributed", "megatron.core.optimizer", "megatron.core.optimizer.muon",
    "megatron.core.optimizer.layer_wise_optimizer", "megatron.core.models.gpt",
    "megatron.core.models.gpt.gpt_layer_specs",
)
#: ``preload`` of a training rank: ``CORE_PRELOAD``, megatron.training and the megatron.core
#: modules that pretrain_gpt.py, gpt_builders.py and model_provider.py import.
PRETRAIN_PRELOAD: Tuple[str, ...] = CORE_PRELOAD + (
    "megatron.training", "megatron.training.training", "megatron.training.arguments",
    "megatron.core.datasets.blended_megatron_dataset_builder", "megatron.core.datasets.gpt_dataset",
    "megatron.core.tokenizers.utils.build_tokenizer",
)

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

#: megatron-core from which ``--use-cpu-initialization`` keeps the model on the CPU on GPUs.
CPU_INIT_STAYS_ON_CPU_FROM = (0, 19)
CPU_INIT_FLAG = "--use-cpu-initialization"


def megatron_core_version(tree: Union[str, Path]) -> Tuple[int, int]:
    """(major, minor) of the megatron-core tree ``tree`` (a label of ``harness.trees.TREES`` or
    a directory holding megatron/), from its ``megatron/core/package_info.py``.

    Raises:
        ValueError / FileNotFoundError: as ``harness.trees.tree_parent``, or a package_info.py
            without MAJOR, MINOR and PATCH.
    """
    from harness.trees import tree_version

    version = tree_version(tree)
    if version is None:
        raise ValueError(f"{tree}: megatron/core/package_info.py names no MAJOR, MINOR and PATCH")
    return version[:2]


def cpu_init_stays_on_cpu(tree: Union[str, Path]) -> bool:
    """Whether, on ``tree``, ``--use-cpu-initialization`` leaves the model on the CPU on GPUs.

    core_v0.19.0's ``pretrain_gpt.py`` builds the model through
    ``megatron/training/models/dist_utils.py:prepare_existing_model_chunks_for_distributed_training``,
    which calls ``.cuda()`` only when ``use_cpu_initialization`` is off (and neither FSDP2
    nor meta-device init is on); ``Float16OptimizerWithFloat16Params`` then refuses the CPU
    params ("Wrapped parameters must be one of torch.cuda.FloatTensor ..."). core_v0.17.1's
    ``megatron/training/training.py:get_model`` moves the model to CUDA whatever that flag
    says (unless FSDP2 is on too): there it only picks where the weights are drawn, the CPU
    generator, as on CPU runs (so GPU runs start from the weights of the CPU golden values).
    """
    return megatron_core_version(tree) >= CPU_INIT_STAYS_ON_CPU_FROM


def runtime_flags_for(tree: Union[str, Path], cpu: bool) -> Tuple[str, ...]:
    """``RUNTIME_FLAGS`` for a launch on ``tree``: all of them on CPU and on 0.17.1; without
    ``--use-cpu-initialization`` on GPUs where the model would stay on the CPU with it
    (``cpu_init_stays_on_cpu``)."""
    if cpu or not cpu_init_stays_on_cpu(tree):
        return RUNTIME_FLAGS
    return tuple(f for f in RUNTIME_FLAGS if f != CPU_INIT_FLAG)


def check_gpu_flags(tree: Union[str, Path], megatron_args: Sequence[str], cpu: bool) -> None:
    """Refuse ``--use-cpu-initialization`` in a GPU launch on a tree where it leaves the
    model on the CPU (``cpu_init_stays_on_cpu``), with ``--use-torch-fsdp2`` the exception
    (FSDP2 places the params itself).

    Raises:
        ValueError: the message says what the flag does there and what to do.
    """
    args = list(megatron_args)
    if cpu or CPU_INIT_FLAG not in args or "--use-torch-fsdp2" in args or not cpu_init_stays_on_cpu(tree):
        return
    major, minor = megatron_core_version(tree)
    raise ValueError(
        f"{CPU_INIT_FLAG} on GPUs with megatron-core {major}.{minor}: its model builder "
        "(megatron/training/models/dist_utils.py) then leaves the model on the CPU, and the bf16/fp16 "
        "optimizer raises TypeError ('Wrapped parameters must be one of torch.cuda.FloatTensor ...'); "
        f"drop {CPU_INIT_FLAG} (the weights are then initialized on the GPU)")


class LaunchError(RuntimeError):
    """A launched run failed or timed out; the message holds the command and the log tail.

    Attributes:
        stdout_path, stderr_path: the run's logs (``Path``), or None where there are none.
    """

    def __init__(self, message: str, stdout_path: Optional[Path] = None, stderr_path: Optional[Path] = None):
        super().__init__(message)
        self.stdout_path = stdout_path
        self.stderr_path = stderr_path


def torchrun_argv(nproc: int, python: str = sys.executable) -> List[str]:
    """The torchrun launcher, spelled in this one place: ``python -m torch.distributed.run
    --standalone --nproc-per-node N`` (``--standalone``: a free local rendezvous port, so
    concurrent runs do not collide). The script, or ``-m MODULE``, and its arguments follow.

    Used by ``torchrun_command`` and by the runs of upstream's own tests, which launch
    ``-m pytest`` (``tests/upstream_tests/upstream_runner.py:command``).

    Raises:
        ValueError: ``nproc`` < 1.
    """
    if int(nproc) < 1:
        raise ValueError(f"torchrun: nproc must be >= 1, got {nproc!r}")
    return [python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(int(nproc))]


def torchrun_command(
    script: Union[str, Path],
    script_args: Sequence[str] = (),
    nproc: int = 2,
    *,
    tree: Union[str, Path, None] = "series-0.17.1",
    cpu: bool = True,
    extra_env: Optional[Dict[str, str]] = None,
    python: str = sys.executable,
    preload: Sequence[str] = (),
    launcher: Optional[str] = None,
) -> Tuple[List[str], Dict[str, str]]:
    """The one builder of rank command lines: ``nproc`` ranks of ``script`` on one node.

    ``argv`` is, by ``launcher``:

    * ``"torchrun"`` (the default on GPUs): ``python -m torch.distributed.run --standalone
      --nproc-per-node N script *script_args`` (``--standalone``: a free local rendezvous
      port, so concurrent runs do not collide);
    * ``"fork"`` (the default on CPU): ``python harness/fork_ranks.py --nproc-per-node N
      [--preload M,...] script *script_args``: the same ranks, environment and failure
      handling, forked from one process that imported torch (and ``preload``) once, which
      saves each CPU rank about 5 s of CPU at start-up (``harness/fork_ranks.py``).

    The environment selects the megatron tree and the runtime:

    * ``PYTHONPATH`` / ``MEGATRON_EXPECT_TREE``: from ``harness.trees.env_for_tree(tree)``;
      ``tree=None`` keeps the caller's ``PYTHONPATH`` and puts the repo root after it.
    * ``OMP_NUM_THREADS=1`` (ranks share the cores), ``CUDA_DEVICE_MAX_CONNECTIONS=1``
      (what megatron asks for with overlapped communication), ``PYTHONUNBUFFERED=1``
      (rank output reaches the log before a crash).
    * ``MEGATRON_CPU_RUNTIME=1`` when ``cpu`` (gloo ranks, ``harness.cpu_runtime``); removed
      otherwise, so that a GPU run never inherits it.

    Args:
        script: a Python file, run by path. Not ``-m``: that would put the working
            directory (the repo root, which holds the patched megatron/) first on
            ``sys.path``, ahead of the tree that ``PYTHONPATH`` selects.
        script_args: the script's own arguments, appended unchanged.
        nproc: ranks on this node (``--nproc-per-node``), >= 1.
        tree: a label of ``harness.trees`` ("pristine-0.17.1", "series-0.19", ...), a directory
            holding megatron/, or None (see above).
        cpu: CPU runtime layer on (gloo) or off (GPUs).
        extra_env: merged into the environment last.
        python: the interpreter that runs the launcher.
        preload: modules the fork launcher imports before forking, after installing the
            CPU runtime when requested (e.g. ``PRETRAIN_PRELOAD``); ignored by torchrun.
        launcher: "fork", "torchrun", or None (fork on CPU, torchrun on GPUs).

    Returns:
        ``(argv, env)``: pass both to ``subprocess``; ``format_command`` prints them.

    Raises:
        ValueError: ``nproc`` < 1, an unknown tree (``env_for_tree``), an unknown launcher,
            or ``"fork"`` for a GPU run (a forking process must not have initialised CUDA;
            NCCL ranks are torchrun's).
        FileNotFoundError: a tree or ``script`` that does not exist.
    """
    if int(nproc) < 1:
        raise ValueError(f"torchrun_command: nproc must be >= 1, got {nproc!r}")
    launcher = launcher or ("fork" if cpu else "torchrun")
    if launcher not in ("fork", "torchrun") or (launcher == "fork" and not cpu):
        raise ValueError(f"torchrun_command: launcher must be 'torchrun', or 'fork' on CPU; got "
                         f"{launcher!r} with cpu={cpu}")
    script = Path(script).resolve()
    if not script.is_file():
        raise FileNotFoundError(f"torchrun_command: no script at {script}")
    if tree is None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            dict.fromkeys([p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p] + [str(REPO_ROOT)])
        )
    else:
        env = env_for_tree(tree)
    env.update(OMP_NUM_THREADS="1", CUDA_DEVICE_MAX_CONNECTIONS="1", PYTHONUNBUFFERED="1")
    if cpu:
        env[CPU_RUNTIME_ENV] = "1"
    else:
        env.pop(CPU_RUNTIME_ENV, None)
    env.update(extra_env or {})
    if launcher == "fork":
        argv = [python, str(FORK_RANKS), "--nproc-per-node", str(int(nproc)),
                *(["--preload", ",".join(preload)] if preload else [])]
    else:
        argv = torchrun_argv(nproc, python)
    return [*argv, str(script), *map(str, script_args)], env


def pretrain_command(
    tree: Union[str, Path],
    megatron_args: Sequence[str],
    nproc: int = 2,
    *,
    cpu: bool = True,
    runtime_flags: bool = True,
    extra_env: Optional[Dict[str, str]] = None,
) -> Tuple[List[str], Dict[str, str]]:
    """The torchrun command and environment that train upstream's ``pretrain_gpt.py`` on ``tree``.

    ``torchrun_command`` of ``PRETRAIN_SCRIPT`` with ``--distributed-backend``
    (gloo on CPU, nccl on GPUs), then ``runtime_flags_for(tree, cpu)`` (``RUNTIME_FLAGS``,
    on GPUs with megatron-core >= 0.19 without ``--use-cpu-initialization``), then
    ``megatron_args``.

    Args:
        tree: a label of ``harness.trees`` ("pristine-0.17.1", "series-0.17.1", ...), or a
            directory holding a megatron/ tree.
        megatron_args: Megatron flags (e.g. a functional case's), appended last: they win
            over ours where argparse lets the last occurrence win.
        nproc: ranks on this node (``--nproc-per-node``); keep <= 4 on small CPU machines.
        cpu: gloo + ``MEGATRON_CPU_RUNTIME=1``; False: NCCL on GPUs.
        runtime_flags: prepend ``runtime_flags_for(tree, cpu)``.
        extra_env: merged into the environment last.

    Returns:
        ``(argv, env)``, as ``torchrun_command``.

    Raises:
        ValueError / FileNotFoundError: as ``torchrun_command``; ``--use-cpu-initialization``
            in ``megatron_args`` of a GPU launch on megatron-core >= 0.19 (``check_gpu_flags``).
    """
    check_gpu_flags(tree, megatron_args, cpu)
    return torchrun_command(
        PRETRAIN_SCRIPT,
        ["--distributed-backend", "gloo" if cpu else "nccl",
         *(runtime_flags_for(tree, cpu) if runtime_flags else ()), *megatron_args],
        nproc, tree=tree, cpu=cpu, extra_env=extra_env, preload=PRETRAIN_PRELOAD,
    )


#: Environment variables ``format_command`` shows (the rest is inherited unchanged).
SHOWN_ENV: Tuple[str, ...] = ("PYTHONPATH", "MEGATRON_EXPECT_TREE", CPU_RUNTIME_ENV, "OMP_NUM_THREADS",
                              "CUDA_DEVICE_MAX_CONNECTIONS", "PYTHONUNBUFFERED")


def format_command(argv: Sequence[str], env: Dict[str, str]) -> str:
    """One shell line: ``VAR=value ... argv`` for the variables in ``SHOWN_ENV`` that are set."""
    assigns = [f"{k}={shlex.quote(env[k])}" for k in SHOWN_ENV if k in env]
    return " ".join(["env", *assigns, shlex.join(argv)])


def _tail(path: Path, lines: int) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def run_command(
    argv: Sequence[str],
    env: Dict[str, str],
    *,
    run_dir: Union[str, Path],
    timeout_s: Optional[float] = 600,
    what: str = "run",
    tail_lines: int = 40,
    progress_marker: Optional[str] = None,
    stall_factor: float = 5.0,
    stall_floor_s: float = 180.0,
) -> float:
    """Run one command built by ``torchrun_command`` and wait for it, logs in ``run_dir``.

    Args:
        argv, env: from ``torchrun_command`` / ``pretrain_command``.
        run_dir: created if needed; gets ``command.txt`` (``format_command``), ``stdout.log``
            and ``stderr.log``.
        timeout_s: wall-clock limit in seconds (None: none); the whole process group is
            killed after it.
        what: names the run in error messages.
        tail_lines: how many stderr lines a failure message quotes.
        progress_marker: a stdout line containing it marks one finished unit of work. The
            run is then killed when no unit finishes for ``max(stall_floor_s, stall_factor x
            the longest unit so far)`` seconds (the first unit includes start-up): the limit
            follows the measured pace instead of a guess for the whole run.

    Returns:
        Wall time of the job in seconds (start-up included).

    Raises:
        LaunchError: non-zero exit (any rank failed), timeout or stall; the message holds
            the command, the log paths and the last ``tail_lines`` lines of stderr.
    """
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "command.txt").write_text(format_command(argv, env) + "\n")
    stdout_path, stderr_path = run_dir / "stdout.log", run_dir / "stderr.log"
    start = time.monotonic()
    last_unit, longest_unit, offset = start, 0.0, 0

    def fail(why: str) -> LaunchError:
        return LaunchError(
            f"{what} {why}: {shlex.join(argv)}\n"
            f"logs: {stdout_path} {stderr_path}\n--- stderr tail ---\n{_tail(stderr_path, tail_lines)}",
            stdout_path, stderr_path,
        )

    with open(stdout_path, "w") as out, open(stderr_path, "w") as err:
        proc = subprocess.Popen(list(argv), env=env, cwd=REPO_ROOT, stdout=out, stderr=err,
                                start_new_session=True)
        while True:
            try:
                returncode = proc.wait(timeout=0.5)
                break
            except subprocess.TimeoutExpired:
                pass
            now = time.monotonic()
            why = None
            if timeout_s is not None and now - start > timeout_s:
                why = f"timed out after {timeout_s:.0f} s"
            elif progress_marker is not None:
                with open(stdout_path, "rb") as f:
                    f.seek(offset)
                    new = f.read()
                complete = new[: new.rfind(b"\n") + 1]
                offset += len(complete)
                units = complete.decode(errors="replace").count(progress_marker)
                if units:
                    longest_unit = max(longest_unit, (now - last_unit) / units)
                    last_unit = now
                limit = max(stall_floor_s, stall_factor * longest_unit)
                if now - last_unit > limit:
                    why = (f"made no progress for {now - last_unit:.0f} s (limit {limit:.0f} s = "
                           f"max({stall_floor_s:g}, {stall_factor:g} x longest unit {longest_unit:.1f} s))")
            if why:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                raise fail(why) from None
    wall_s = time.monotonic() - start
    if returncode != 0:
        raise fail(f"failed (exit {returncode}) after {wall_s:.1f} s")
    return wall_s


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
    """Run one training job (``pretrain_command``) and wait for it (``run_command``).

    Args:
        tree, megatron_args, nproc, cpu, runtime_flags, extra_env: see
            ``pretrain_command``.
        run_dir, timeout_s, tail_lines: see ``run_command``.

    Returns:
        Wall time of the job in seconds (start-up included).

    Raises:
        LaunchError: any rank failed, or the timeout passed (see ``run_command``).
    """
    argv, env = pretrain_command(tree, megatron_args, nproc, cpu=cpu, runtime_flags=runtime_flags,
                                 extra_env=extra_env)
    return run_command(argv, env, run_dir=run_dir, timeout_s=timeout_s, what=f"{tree} run",
                       tail_lines=tail_lines)
