"""Tests of harness/launch.py: the one rank command-line builder and the training launch.

Command lines are built with ``torchrun_command`` / ``pretrain_command`` and checked for what
the launcher (harness/fork_ranks.py on CPU, torchrun on GPUs) will do with them; the flags of a
GPU launch go through each base's own parser and model placement. The Megatron flags are the
default functional case's (``default_case_args``: the tiny GPT the harness trains).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from harness import launch
from harness.trees import REPO_ROOT


def default_case_args(tmp_path):
    """The default functional case's Megatron flags (``run_case.DEFAULT_CASE``'s MODEL_ARGS), its
    data and tensorboard paths under ``tmp_path`` (no run here reaches the data)."""
    from tests.functional_tests.python_test_utils import run_case as rc

    case = rc.load_case(rc.find_case(rc.DEFAULT_CASE))
    return rc.expand_args(case.model_args, {"DATA_PATH": str(tmp_path / "data"), "TENSORBOARD_PATH": str(tmp_path / "tb")})


def fork_parts(argv):
    """(nproc, preload list, script, script args) of a harness/fork_ranks.py command line."""
    assert argv[1:3] == [str(launch.FORK_RANKS), "--nproc-per-node"], argv[:3]
    rest = argv[4:]
    preload = rest[1].split(",") if rest[0] == "--preload" else []
    rest = rest[2:] if preload else rest
    return int(argv[3]), preload, rest[0], rest[1:]


def test_a_gpu_launch_drops_an_inherited_cpu_runtime(monkeypatch):
    monkeypatch.setenv("MEGATRON_CPU_RUNTIME", "1")
    argv, env = launch.pretrain_command("pristine-0.17.1", [], 8, cpu=False)
    assert "MEGATRON_CPU_RUNTIME" not in env
    assert argv[1:3] == ["-m", "torch.distributed.run"]  # GPU ranks: torchrun, never forked
    assert argv[argv.index("--distributed-backend") + 1] == "nccl"
    assert argv[argv.index("--nproc-per-node") + 1] == "8"


def test_a_script_keeps_its_arguments_on_the_tree_directory_it_is_given():
    """``tree=DIR`` (a directory holding megatron/, e.g. the pristine tree's parent)."""
    worker = "tests/unit_tests/layerwise_worker.py"
    tree = REPO_ROOT / "build" / "upstream"
    argv, env = launch.torchrun_command(worker, ["--out", "r.json", "--scenarios", "gather"], 2, tree=tree)
    assert fork_parts(argv) == (2, [], str(REPO_ROOT / worker), ["--out", "r.json", "--scenarios", "gather"])
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(tree)
    assert env["MEGATRON_EXPECT_TREE"] == str(tree / "megatron")


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(nproc=0), ValueError, "nproc must be >= 1"),
    (dict(script="no/such/file.py"), FileNotFoundError, "no script at"),
    (dict(tree="no-such-tree"), ValueError, "no-such-tree"),
])  # fmt: skip
def test_bad_input_raises_with_a_message(kwargs, error, message):
    call = {"script": launch.PRETRAIN_SCRIPT, "nproc": 2, "tree": "pristine-0.17.1", **kwargs}
    with pytest.raises(error, match=message):
        launch.torchrun_command(call.pop("script"), [], call.pop("nproc"), **call)


def test_pretrain_command_trains_upstreams_entry_on_the_tree():
    """CPU: forked gloo ranks (harness/fork_ranks.py, the training imports preloaded) run
    upstream's pretrain_gpt.py on the patched tree, backend first, then the CPU runtime's
    flags (local transformer implementation, CPU initialization), the caller's flags last;
    extra_env reaches the ranks."""
    argv, env = launch.pretrain_command("series-0.17.1", ["--seed", "1"], 2, extra_env={"X_LAUNCH_TEST": "1"})
    nproc, preload, script, args = fork_parts(argv)
    assert (nproc, script) == (2, str(REPO_ROOT / "harness" / "upstream_pretrain_gpt.py"))
    assert preload == list(launch.PRETRAIN_PRELOAD)
    assert {"megatron.training", "megatron.core.optimizer.layer_wise_optimizer"} <= set(preload)
    assert args[:2] == ["--distributed-backend", "gloo"] and args[-2:] == ["--seed", "1"]
    flags = args[2:-2]
    assert flags[flags.index("--transformer-impl") + 1] == "local" and "--use-cpu-initialization" in flags
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(REPO_ROOT)
    assert env["MEGATRON_EXPECT_TREE"] == str(REPO_ROOT / "megatron")
    assert (env["MEGATRON_CPU_RUNTIME"], env["X_LAUNCH_TEST"]) == ("1", "1")


def test_pretrain_command_on_gpus_without_runtime_flags():
    """cpu=False: torchrun of the same entry with nccl and no CPU runtime; runtime_flags=False:
    only the backend before the caller's flags."""
    argv, env = launch.pretrain_command("pristine-0.17.1", ["--seed", "1"], 8, cpu=False, runtime_flags=False)
    assert argv[1:] == ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "8",
                        str(REPO_ROOT / "harness" / "upstream_pretrain_gpt.py"),
                        "--distributed-backend", "nccl", "--seed", "1"]  # fmt: skip
    assert "MEGATRON_CPU_RUNTIME" not in env
    assert env["MEGATRON_EXPECT_TREE"] == str(REPO_ROOT / "build" / "upstream" / "megatron")


def test_tree_none_keeps_callers_pythonpath(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/opt/site")
    monkeypatch.delenv("MEGATRON_EXPECT_TREE", raising=False)
    _, env = launch.torchrun_command(launch.PRETRAIN_SCRIPT, [], 1, tree=None, cpu=False)
    assert env["PYTHONPATH"].split(os.pathsep) == ["/opt/site", str(REPO_ROOT)]
    assert "MEGATRON_EXPECT_TREE" not in env and "MEGATRON_CPU_RUNTIME" not in env


def _ticker(ticks: int, then_sleep_s: float):
    code = (f"import time\nfor _ in range({ticks}):\n    print('UNIT done', flush=True)\n    time.sleep(0.1)\n"
            f"time.sleep({then_sleep_s})\n")
    return [sys.executable, "-c", code], dict(os.environ)


def test_run_command_kills_a_stalled_run_by_its_own_pace(tmp_path):
    """Three quick units, then 120 s of silence: killed by the stall rule (a limit from the
    measured pace); without it the command would end normally and raise nothing."""
    argv, env = _ticker(3, 120)
    with pytest.raises(launch.LaunchError, match="made no progress") as info:
        launch.run_command(argv, env, run_dir=tmp_path, timeout_s=None, progress_marker="UNIT done",
                           stall_factor=5.0, stall_floor_s=3.0)
    assert info.value.stderr_path == tmp_path / "stderr.log"


def test_run_command_lets_a_progressing_run_finish(tmp_path):
    argv, env = _ticker(30, 0)
    launch.run_command(argv, env, run_dir=tmp_path, timeout_s=100, progress_marker="UNIT done",
                       stall_factor=5.0, stall_floor_s=3.0)
    assert (tmp_path / "stdout.log").read_text().count("UNIT done") == 30


# ------------------------------------------------ GPU launches: the model builder puts the model on CUDA
# In a child with the tree first on PYTHONPATH: megatron's own parse_args + validate_args on
# the flags a launch passes to pretrain_gpt.py, then the base's own model placement on them.
# 0.19: the model builder's post-build step (megatron/training/models/dist_utils.py:
# prepare_existing_model_chunks_for_distributed_training) with the TransformerConfig that
# pretrain_gpt.py derives (argument_utils.gpt_config_from_args); 0.17.1: training.get_model.
# A probe module records the .cuda() calls (no GPU here; torch.cuda.current_device is 0).
BUILDER_PROBE = r"""
import json, os, sys, types
import torch
os.environ.update(WORLD_SIZE="2", RANK="0", LOCAL_RANK="0")
from megatron.training.arguments import parse_args, validate_args
port = sys.argv[2]
sys.argv = ["pretrain_gpt.py", *json.loads(sys.argv[1])]
args = parse_args()
validate_args(args)
torch.cuda.current_device = lambda: 0
moved = []

class Probe(torch.nn.Module):
    def __init__(self, config=None):
        super().__init__()
        self.config = config
        self.weight = torch.nn.Parameter(torch.zeros(4))

    def cuda(self, device=None):
        moved.append(device)
        return self

try:
    from megatron.training.models.dist_utils import prepare_existing_model_chunks_for_distributed_training
except ImportError:
    prepare_existing_model_chunks_for_distributed_training = None
if prepare_existing_model_chunks_for_distributed_training is not None:
    from megatron.training.argument_utils import gpt_config_from_args
    config = gpt_config_from_args(args).transformer
    rank = types.SimpleNamespace(rank=lambda: 1, size=lambda: 1)
    pg = types.SimpleNamespace(dp=rank, cp=rank, tp=rank, pp=rank, gtp_remat=rank)
    prepare_existing_model_chunks_for_distributed_training(
        [Probe(config)], config, pg, wrap_with_ddp=False, mixed_precision_wrapper=None)
else:
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.training import training
    from megatron.training.arguments import core_transformer_config_from_args
    from megatron.training.global_vars import set_args
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + port, world_size=1, rank=0)
    parallel_state.initialize_model_parallel()
    set_args(args)
    config = core_transformer_config_from_args(args)
    config.use_cpu_initialization = args.use_cpu_initialization
    training.get_model(lambda **kw: Probe(config), wrap_with_ddp=False)
print("RESULT " + json.dumps({"use_cpu_initialization": args.use_cpu_initialization,
                             "config_use_cpu_initialization": config.use_cpu_initialization, "cuda_calls": moved}))
"""


def builder_placement(tree: str, megatron_args, tmp_path) -> dict:
    """What the base's model placement does with the flags ``pretrain_command(tree,
    megatron_args, cpu=False)`` passes (BUILDER_PROBE), as a dict."""
    from harness.trees import env_for_tree

    argv, _ = launch.pretrain_command(tree, megatron_args, 2, cpu=False)
    flags = argv[argv.index(str(launch.PRETRAIN_SCRIPT)) + 1:]
    script = tmp_path / f"probe_{tree}.py"
    script.write_text(BUILDER_PROBE)
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in env_for_tree(tree).items() if k != launch.CPU_RUNTIME_ENV}
    proc = subprocess.run([sys.executable, str(script), json.dumps(flags), str(port)], cwd=REPO_ROOT,
                          env=dict(env, PYTHONWARNINGS="ignore"), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return json.loads(proc.stdout.split("RESULT ", 1)[1].splitlines()[0])


@pytest.mark.parametrize("tree, cpu_init", [("pristine-0.17.1", True), ("pristine-0.19", False)])
def test_a_gpu_launch_puts_the_model_on_cuda_on_either_base(tree, cpu_init, tmp_path):
    """A GPU launch's flags, through megatron's parser, make the base's model placement call
    .cuda(): on 0.19 the launch leaves out --use-cpu-initialization (with it, the builder
    would keep the model on the CPU, and Float16OptimizerWithFloat16Params raise TypeError);
    on 0.17.1 it keeps it (CPU-drawn weights, as the CPU golden values) and get_model moves
    the model anyway."""
    got = builder_placement(tree, default_case_args(tmp_path), tmp_path)
    assert bool(got["use_cpu_initialization"]) is cpu_init and bool(got["config_use_cpu_initialization"]) is cpu_init, got
    assert got["cuda_calls"] == [0], got


def test_the_0_19_builder_keeps_the_model_on_cpu_with_cpu_initialization(tmp_path, monkeypatch):
    """The reason for the rule, on 0.19's own builder: the flags of a GPU launch plus
    --use-cpu-initialization (as RUNTIME_FLAGS passed it before) never move the model."""
    monkeypatch.setattr(launch, "check_gpu_flags", lambda *a: None)
    got = builder_placement("pristine-0.19", [*default_case_args(tmp_path), "--use-cpu-initialization"], tmp_path)
    assert got["config_use_cpu_initialization"] is True and got["cuda_calls"] == [], got


@pytest.mark.parametrize("tree, refused", [("pristine-0.19", True), ("pristine-0.17.1", False)])
def test_cpu_initialization_on_gpus_is_refused_on_0_19_with_the_reason(tree, refused):
    flag = ["--use-cpu-initialization"]
    if refused:
        with pytest.raises(ValueError, match="leaves the model on the CPU.*drop --use-cpu-initialization"):
            launch.pretrain_command(tree, flag, 2, cpu=False)
    else:
        argv, _ = launch.pretrain_command(tree, flag, 2, cpu=False)
        assert argv.count("--use-cpu-initialization") == 2, argv
    argv, _ = launch.pretrain_command(tree, flag, 2)  # CPU: as ever
    assert "--use-cpu-initialization" in argv


def test_pretrain_refuses_wrong_tree():
    """MEGATRON_EXPECT_TREE names the pristine tree while PYTHONPATH gives the patched one."""
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), MEGATRON_EXPECT_TREE=str(REPO_ROOT / "build" / "upstream" / "megatron"),
               MEGATRON_CPU_RUNTIME="force", PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, str(launch.PRETRAIN_SCRIPT)], env=env, cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "RuntimeError: imported megatron from" in proc.stderr and "expected" in proc.stderr


def test_launch_reports_failing_rank(tmp_path):
    """A rank that dies makes run_pretrain raise with the stderr tail (here: a bad flag)."""
    with pytest.raises(launch.LaunchError, match="run failed") as info:
        launch.run_pretrain("series-0.17.1", default_case_args(tmp_path) + ["--num-layers", "not-a-number"], nproc=2,
                            run_dir=tmp_path / "run", timeout_s=120)
    assert "stderr tail" in str(info.value) and "--num-layers" in str(info.value)


def test_every_torchrun_line_comes_from_launch_torchrun_argv(monkeypatch, tmp_path):
    """The torchrun line is spelled once, ``launch.torchrun_argv``: the GPU ranks of
    ``torchrun_command`` and upstream's test runs (``upstream_runner.command``) both take it
    from there, so a change there reaches each (a copy of the line elsewhere would keep the old
    launcher)."""
    from tests.upstream_tests import upstream_runner

    fake = ["PYTHON", "-m", "launcher.under.test", "--nproc-per-node", "3"]
    asked = []

    def torchrun_argv(nproc, python=sys.executable):
        asked.append(int(nproc))
        return list(fake)

    monkeypatch.setattr(launch, "torchrun_argv", torchrun_argv)
    script = tmp_path / "rank.py"
    script.write_text("")
    argv, _ = launch.torchrun_command(script, ["--x"], 3, tree=None, cpu=False)
    assert argv == [*fake, str(script), "--x"]
    argv, _ = upstream_runner.command(tmp_path, ["tests/unit_tests/t.py"], 3, tmp_path)
    assert argv[:5] == fake and argv[5:7] == ["-m", "pytest"] and argv[-1] == "tests/unit_tests/t.py"
    assert asked and set(asked) == {3}  # every builder asked for its own rank count
    # and the real line, for the record
    monkeypatch.undo()
    assert launch.torchrun_argv(4, "py") == ["py", "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4"]
    with pytest.raises(ValueError):
        launch.torchrun_argv(0)
