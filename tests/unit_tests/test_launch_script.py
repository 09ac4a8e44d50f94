"""scripts/launch_pretrain_gpt.sh: the command it launches, and its input checks.

The script is run as a user would (subprocess, a clean launcher environment). The printed
--dry-run line is parsed with shlex, and run by a shell against a stand-in torchrun that
records its argv and environment, which must equal what the script itself launches.
Checkouts are stand-ins: a directory with pretrain_gpt.py and a megatron/ link to the
generated patched (megatron/) or pristine (build/upstream/megatron) tree, so
scripts/apply_patches.sh --check sees the real files. The flag set is finally checked by
megatron.training's own parser.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_argcheck import validate_megatron_args

ROOT = Path(__file__).resolve().parents[2]
LAUNCH = ROOT / "scripts" / "launch_pretrain_gpt.sh"
LAUNCH_ENV = (
    "NNODES NODE_RANK MASTER_ADDR MASTER_PORT GPUS_PER_NODE MEGATRON_LM TORCHRUN "
    "SLURM_NNODES SLURM_NODEID SLURM_GPUS_ON_NODE CUDA_DEVICE_MAX_CONNECTIONS CUDA_VISIBLE_DEVICES "
    "SLURM_JOB_NODELIST SLURM_NODELIST"
).split()
SERIES_FLAGS = ["--optimizer", "dist_muon", "--overlap-param-gather", "--overlap-grad-reduce", "--bf16"]


def make_checkout(where: Path, tree: Path) -> Path:
    if not (tree / "core" / "__init__.py").is_file():
        pytest.skip(f"{tree} not generated; run scripts/setup.sh")
    where.mkdir(parents=True)
    (where / "pretrain_gpt.py").write_text("# stand-in for Megatron-LM's pretrain_gpt.py\n")
    (where / "megatron").symlink_to(tree, target_is_directory=True)
    return where


@pytest.fixture(scope="module")
def checkouts(tmp_path_factory):
    base = tmp_path_factory.mktemp("checkouts")
    return {
        # A space in the path exercises the shell quoting of the printed command.
        "patched": make_checkout(base / "Megatron LM patched", ROOT / "megatron"),
        "upstream": make_checkout(base / "upstream", ROOT / "build" / "upstream" / "megatron"),
    }


@pytest.fixture
def fake_torchrun(tmp_path):
    """A torchrun stand-in that writes {"argv": [...], "cdmc": env value} to $FAKE_OUT."""
    path = tmp_path / "bin" / "torchrun"
    path.parent.mkdir()
    path.write_text(
        f"#!{sys.executable}\n"
        "import json, os, sys\n"
        "json.dump({'argv': sys.argv[1:], 'cdmc': os.environ.get('CUDA_DEVICE_MAX_CONNECTIONS')},\n"
        "          open(os.environ['FAKE_OUT'], 'w'))\n"
    )
    path.chmod(0o755)
    return path


def launch(*args, env=None):
    full_env = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV}
    full_env.update({"GPUS_PER_NODE": "1"} if env is None else env)
    return subprocess.run(
        ["bash", str(LAUNCH), *map(str, args)], env=full_env, capture_output=True, text=True, timeout=60
    )


def printed_line(*args, env=None) -> str:
    proc = launch("--dry-run", *args, env=env)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1, f"expected one command line, got:\n{proc.stdout}"
    return lines[0]


def dry_run(*args, env=None):
    """Parse the printed command: (environment assignments, torchrun argv, script argv)."""
    words = shlex.split(printed_line(*args, env=env))
    assigns = {}
    while "=" in words[0] and not words[0].startswith("-"):
        key, value = words.pop(0).split("=", 1)
        assigns[key] = value
    script = next(j for j, w in enumerate(words) if w.endswith("/pretrain_gpt.py"))
    return assigns, words[: script + 1], words[script + 1 :]


def opt(argv, flag):
    """Value after `flag` in argv (the last occurrence, as argparse would take it)."""
    idx = [i for i, w in enumerate(argv) if w == flag]
    assert idx, f"{flag} missing from {argv}"
    return argv[idx[-1] + 1]


def flag_names(argv):
    return [w.split("=", 1)[0] for w in argv if w.startswith("--")]


def test_defaults_single_node_mock_data(checkouts):
    env, torchrun, argv = dry_run(checkouts["patched"])
    assert env == {}
    assert torchrun[0] == "torchrun"
    assert [opt(torchrun, f) for f in ("--nnodes", "--node-rank", "--nproc-per-node")] == ["1", "0", "1"]
    assert (opt(torchrun, "--master-addr"), opt(torchrun, "--master-port")) == ("localhost", "6000")
    assert torchrun[-1] == f"{checkouts['patched']}/pretrain_gpt.py"
    assert argv[: len(SERIES_FLAGS)] == SERIES_FLAGS
    assert "--accumulate-allreduce-grads-in-fp32" not in argv
    assert "--use-distributed-optimizer" not in argv
    assert "--mock-data" in argv and "--data-path" not in argv
    assert opt(argv, "--tokenizer-type") == "NullTokenizer" and opt(argv, "--vocab-size") == "32768"
    assert opt(argv, "--global-batch-size") == opt(argv, "--micro-batch-size") == "2"
    assert len(flag_names(argv)) == len(set(flag_names(argv)))


def test_upstream_flags_pass_through_unchanged_and_in_order(checkouts):
    mine = ["--tensor-model-parallel-size", "2", "--accumulate-allreduce-grads-in-fp32",
            "--num-layers=8", "--data-path", "0.3", "/d/a", "0.7", "/d/b",
            "--vocab-file", "/tok/vocab.json", "--merge-file", "/tok/merges.txt",
            "--micro-batch-size", "4", "--wandb-exp-name", "it's a \"run\" $HOME"]
    env, _, argv = dry_run(checkouts["patched"], *mine, env={"GPUS_PER_NODE": "8"})
    assert argv[-len(mine):] == mine
    added = argv[: -len(mine)]
    # Nothing the user gave is added again; what is added derives from the given flags.
    assert not set(flag_names(added)) & set(flag_names(mine))
    assert "--mock-data" not in argv and opt(added, "--tokenizer-type") == "GPT2BPETokenizer"
    assert opt(added, "--global-batch-size") == "16"  # 8 GPUs / tp 2 = dp 4, x micro-batch 4
    assert env == {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}  # tp > 1: megatron asserts it


def test_a_leading_double_dash_is_optional(checkouts):
    with_sep = dry_run(checkouts["patched"], "--", "--log-interval", "5")
    without = dry_run(checkouts["patched"], "--log-interval", "5")
    assert with_sep == without
    assert opt(without[2], "--log-interval") == "5" and without[2].count("--log-interval") == 1


def test_printed_line_runs_what_the_script_runs(checkouts, fake_torchrun, tmp_path):
    env = {"GPUS_PER_NODE": "2", "TORCHRUN": str(fake_torchrun)}
    args = [checkouts["patched"], "--tensor-model-parallel-size", "2", "--seq-length", "256"]
    line = printed_line(*args, env=env)
    assert shlex.split(line)[0] == "CUDA_DEVICE_MAX_CONNECTIONS=1"
    assert shlex.split(line)[1] == str(fake_torchrun)

    pasted = tmp_path / "pasted.json"
    clean = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV}
    subprocess.run(["bash", "-c", line], env={**clean, "FAKE_OUT": str(pasted)}, check=True, timeout=60)
    launched = tmp_path / "launched.json"
    proc = launch(*args, env={**env, "FAKE_OUT": str(launched)})
    assert proc.returncode == 0, proc.stderr
    assert json.loads(pasted.read_text()) == json.loads(launched.read_text())
    recorded = json.loads(launched.read_text())
    assert recorded["argv"] == shlex.split(line)[2:] and recorded["cdmc"] == "1"

    # A value the caller set is left alone (and not printed).
    env["CUDA_DEVICE_MAX_CONNECTIONS"] = "8"
    assert shlex.split(printed_line(*args, env=env))[0] == str(fake_torchrun)
    launch(*args, env={**env, "FAKE_OUT": str(launched)})
    assert json.loads(launched.read_text())["cdmc"] == "8"


def test_missing_torchrun_is_a_clear_error(checkouts):
    proc = launch(checkouts["patched"], env={"GPUS_PER_NODE": "1", "TORCHRUN": "/nonexistent/torchrun"})
    assert proc.returncode == 2 and "'/nonexistent/torchrun' not found" in proc.stderr


def test_launcher_environment_is_honoured(checkouts):
    env = {"NNODES": "4", "NODE_RANK": "3", "MASTER_ADDR": "node-0.cluster", "MASTER_PORT": "29500",
           "GPUS_PER_NODE": "8", "TORCHRUN": "/opt/bin/torchrun"}
    _, torchrun, argv = dry_run(checkouts["patched"], "--tensor-model-parallel-size", "2", env=env)
    assert torchrun[0] == "/opt/bin/torchrun"
    assert [opt(torchrun, f) for f in ("--nnodes", "--node-rank", "--nproc-per-node", "--master-addr",
                                       "--master-port")] == ["4", "3", "8", "node-0.cluster", "29500"]
    # 32 GPUs / tp 2 = 16 data-parallel ranks x micro-batch 2.
    assert opt(argv, "--global-batch-size") == "32"


def test_slurm_variables_are_the_fallback(checkouts):
    env = {"SLURM_NNODES": "2", "SLURM_NODEID": "1", "SLURM_GPUS_ON_NODE": "4", "MASTER_ADDR": "n0"}
    _, torchrun, _ = dry_run(checkouts["patched"], env=env)
    assert [opt(torchrun, f) for f in ("--nnodes", "--node-rank", "--nproc-per-node")] == ["2", "1", "4"]
    env["NNODES"], env["NODE_RANK"] = "3", "2"  # explicit variables win over Slurm's
    _, torchrun, _ = dry_run(checkouts["patched"], env=env)
    assert [opt(torchrun, f) for f in ("--nnodes", "--node-rank")] == ["3", "2"]


def test_checkout_from_environment_and_hf_tokenizer(checkouts):
    env = {"GPUS_PER_NODE": "1", "MEGATRON_LM": str(checkouts["patched"])}
    _, torchrun, argv = dry_run("--data-path", "/d/x", "--tokenizer-model", "/tok/hf", env=env)
    assert torchrun[-1] == f"{checkouts['patched']}/pretrain_gpt.py"
    assert opt(argv, "--tokenizer-type") == "HuggingFaceTokenizer" and "--vocab-size" not in argv


def test_unpatched_checkout_is_refused_unless_allowed(checkouts):
    proc = launch("--dry-run", checkouts["upstream"])
    assert proc.returncode == 2
    assert "not applied" in proc.stderr and "apply_patches.sh" in proc.stderr
    proc = launch("--dry-run", "--allow-unpatched", checkouts["upstream"])
    assert proc.returncode == 0 and "warning" in proc.stderr


@pytest.mark.parametrize(
    "invented, upstream",
    [
        (["--tp", "2"], "--tensor-model-parallel-size"),
        (["--pp", "2"], "--pipeline-model-parallel-size"),
        (["--fp32-grad-accum"], "--accumulate-allreduce-grads-in-fp32"),
        (["--bf16-grad-reduce"], "--grad-reduce-in-bf16"),
    ],
)
def test_invented_flags_are_refused_with_the_upstream_name(checkouts, invented, upstream):
    proc = launch("--dry-run", checkouts["patched"], *invented)
    assert proc.returncode == 2 and proc.stdout == ""
    assert f"use {upstream}" in proc.stderr


@pytest.mark.parametrize(
    "args, env, message",
    [
        ([], {}, "no Megatron-LM checkout"),
        (["/nonexistent/Megatron-LM"], {}, "does not exist"),
        (["{tmp}"], {}, "no pretrain_gpt.py"),
        (["{patched}", "--mock-data", "--data-path", "/d/x", "--vocab-file", "v", "--merge-file", "m"], {},
         "exclude each other"),
        (["{patched}", "--data-path", "/d/x"], {}, "needs a tokenizer"),
        (["{patched}"], {"NNODES": "two"}, "NNODES must be a positive integer"),
        (["{patched}"], {"NNODES": "2", "NODE_RANK": "2"}, "must be less than NNODES"),
        (["{patched}"], {"MASTER_PORT": "70000"}, "MASTER_PORT"),
        (["{patched}"], {"GPUS_PER_NODE": "0"}, "GPUS_PER_NODE must be a positive integer"),
        (["{patched}", "--global-batch-size", "3"], {}, "must be a multiple"),
        (["{patched}", "--tensor-model-parallel-size", "3"], {"GPUS_PER_NODE": "4"}, "is not divisible by"),
        (["{patched}", "--micro-batch-size", "-1"], {}, "--micro-batch-size must be a positive integer"),
        (["{patched}", "--", "--use-distributed-optimizer"], {}, "forbidden with dist_muon"),
        (["{patched}", "--optimizer", "adam"], {}, "--optimizer dist_muon"),
        (["{patched}", "--fp16"], {}, "Muon does not support fp16"),
        (["{patched}", "--no-overlap-param-gather", "--overlap-param-gather"], {}, "exclude each other"),
        (["{patched}"], {"NNODES": "2"}, "NNODES=2 and no MASTER_ADDR"),
        (["{patched}"], {"SLURM_NNODES": "2", "SLURM_NODEID": "0", "SLURM_JOB_NODELIST": "gpu-[07-08]",
                         "PATH": "/usr/bin:/bin"}, "no scontrol to find the head node"),
        (["{patched}"], {"CUDA_VISIBLE_DEVICES": "", "GPUS_PER_NODE": ""}, "CUDA_VISIBLE_DEVICES is empty"),
        (["{patched}", "stray"], {}, "'stray' is not a flag"),
        (["{patched}", "{patched}"], {}, "is not a flag"),
    ],
)
def test_bad_input_is_one_clear_error(checkouts, tmp_path, args, env, message):
    subst = {"{patched}": str(checkouts["patched"]), "{tmp}": str(tmp_path)}
    proc = launch("--dry-run", *[subst.get(a, a) for a in args], env={"GPUS_PER_NODE": "1", **env})
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert proc.stdout == ""
    assert len(proc.stderr.strip().splitlines()) == 1 and message in proc.stderr, proc.stderr


def test_megatron_parser_accepts_the_built_flags(checkouts):
    """parse_args + validate_args of megatron (patched tree) on what the script would run."""
    attrs = ["optimizer", "overlap_param_gather", "overlap_grad_reduce", "bf16",
             "accumulate_allreduce_grads_in_fp32", "use_distributed_optimizer", "mock_data",
             "data_parallel_size", "global_batch_size", "tokenizer_type", "grad_reduce_in_bf16"]
    multi = {"NNODES": "2", "GPUS_PER_NODE": "4", "MASTER_ADDR": "n0"}
    # tp > 1 would make validate_args ask the GPU for its architecture; pp does not.
    _, _, mock_argv = dry_run(
        checkouts["patched"], "--accumulate-allreduce-grads-in-fp32", "--pipeline-model-parallel-size", "2",
        env=multi)
    _, _, data_argv = dry_run(checkouts["patched"], "--data-path", "/d/x", "--vocab-file", "v",
                              "--merge-file", "m", "--grad-reduce-in-bf16")
    cases = [
        {"argv": mock_argv, "world_size": 8, "attrs": attrs},
        {"argv": data_argv, "world_size": 1, "attrs": attrs},
        # The rules the script guards against, as megatron states them (teeth of this check):
        {"argv": mock_argv + ["--use-distributed-optimizer"], "world_size": 8},
        {"argv": [a for a in data_argv if a != "--overlap-grad-reduce"], "world_size": 1},
    ]
    mock, data, dist_opt, no_grad_overlap = validate_megatron_args(cases)
    assert mock["ok"], mock
    assert mock["attrs"] == {
        "optimizer": "dist_muon", "overlap_param_gather": True, "overlap_grad_reduce": True,
        "bf16": True, "accumulate_allreduce_grads_in_fp32": True, "use_distributed_optimizer": False,
        "mock_data": True, "data_parallel_size": 4, "global_batch_size": 8,
        "tokenizer_type": "NullTokenizer", "grad_reduce_in_bf16": False}
    assert data["ok"], data
    assert data["attrs"]["mock_data"] is False and data["attrs"]["tokenizer_type"] == "GPT2BPETokenizer"
    # --grad-reduce-in-bf16: grad_data in bf16 (megatron's bf16 default is fp32 accumulation).
    assert data["attrs"]["accumulate_allreduce_grads_in_fp32"] is False
    assert data["attrs"]["grad_reduce_in_bf16"] is True
    assert not dist_opt["ok"] and "distributed optimizer" in dist_opt["error"]
    assert not no_grad_overlap["ok"] and "--overlap-grad-reduce" in no_grad_overlap["error"]


def fake_scontrol(tmp_path: Path, hosts) -> str:
    """A PATH whose scontrol prints ``hosts`` (one a line) for ``show hostnames NODELIST``."""
    bin_dir = tmp_path / "slurm-bin"
    bin_dir.mkdir()
    tool = bin_dir / "scontrol"
    tool.write_text("#!/bin/bash\n[[ $1 == show && $2 == hostnames && -n $3 ]] || exit 1\n"
                    + "".join(f"echo {h}\n" for h in hosts))
    tool.chmod(0o755)
    return f"{bin_dir}:{os.environ['PATH']}"


def test_two_slurm_nodes_without_master_addr_rendezvous_at_the_head_node(checkouts, tmp_path):
    env = {"SLURM_NNODES": "2", "SLURM_NODEID": "1", "SLURM_GPUS_ON_NODE": "8",
           "SLURM_JOB_NODELIST": "gpu-[07-08]", "PATH": fake_scontrol(tmp_path, ["gpu-07", "gpu-08"])}
    _, torchrun, _ = dry_run(checkouts["patched"], env=env)
    assert opt(torchrun, "--master-addr") == "gpu-07" and opt(torchrun, "--nnodes") == "2"
    env["MASTER_ADDR"] = "login-given"  # an explicit address wins
    _, torchrun, _ = dry_run(checkouts["patched"], env=env)
    assert opt(torchrun, "--master-addr") == "login-given"


def test_scontrol_that_names_no_host_is_a_clear_error(checkouts, tmp_path):
    env = {"SLURM_NNODES": "2", "SLURM_NODEID": "0", "GPUS_PER_NODE": "8",
           "SLURM_JOB_NODELIST": "gpu-[07-08]", "PATH": fake_scontrol(tmp_path, [])}
    proc = launch("--dry-run", checkouts["patched"], env=env)
    assert proc.returncode == 2 and "gave no host; set MASTER_ADDR" in proc.stderr


def test_the_gpu_count_follows_cuda_visible_devices(checkouts):
    _, torchrun, argv = dry_run(checkouts["patched"], env={"CUDA_VISIBLE_DEVICES": "2,5,7"})
    assert opt(torchrun, "--nproc-per-node") == "3" and opt(argv, "--global-batch-size") == "6"
    _, torchrun, _ = dry_run(checkouts["patched"], env={"CUDA_VISIBLE_DEVICES": "2,5,7", "GPUS_PER_NODE": "2"})
    assert opt(torchrun, "--nproc-per-node") == "2", "GPUS_PER_NODE wins"


def test_dp1_warns_that_the_series_gathers_nothing(checkouts):
    one = launch("--dry-run", checkouts["patched"], env={"GPUS_PER_NODE": "1"})
    two = launch("--dry-run", checkouts["patched"], env={"GPUS_PER_NODE": "2"})
    tp2 = launch("--dry-run", checkouts["patched"], "--tensor-model-parallel-size", "2", env={"GPUS_PER_NODE": "2"})
    assert one.returncode == two.returncode == tp2.returncode == 0
    assert "warning: data-parallel size 1" in one.stderr and "warning: data-parallel size 1" in tp2.stderr
    assert "warning" not in two.stderr


def test_the_optimizer_gather_path_can_be_launched(checkouts):
    """--no-overlap-param-gather: megatron then gathers in the optimizer's step() (patch 0006)."""
    _, _, argv = dry_run(checkouts["patched"], "--no-overlap-param-gather", env={"GPUS_PER_NODE": "2"})
    assert "--overlap-param-gather" not in argv and "--no-overlap-param-gather" not in argv
    (result,) = validate_megatron_args([{"argv": argv, "world_size": 2,
                                         "attrs": ["overlap_param_gather", "optimizer", "data_parallel_size"]}])
    assert result["ok"], result
    assert result["attrs"] == {"overlap_param_gather": False, "optimizer": "dist_muon", "data_parallel_size": 2}


def test_cpu_initialization_is_refused_on_a_0_19_checkout_with_the_reason(checkouts, tmp_path):
    """0.19's model builder keeps the model on the CPU with --use-cpu-initialization (see
    test_launch.py's builder tests); on 0.17.1 get_model moves it, so the flag passes there."""
    c19 = make_checkout(tmp_path / "mlm019", ROOT / "build" / "upstream-0.19" / "megatron")
    proc = launch("--dry-run", "--allow-unpatched", c19, "--use-cpu-initialization")
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr
    assert "megatron-core 0.19: its model builder" in proc.stderr and "drop --use-cpu-initialization" in proc.stderr
    assert "--use-cpu-initialization" in dry_run("--allow-unpatched", c19, "--use-cpu-initialization",
                                                 "--use-torch-fsdp2")[2]
    assert "--use-cpu-initialization" in dry_run(checkouts["patched"], "--use-cpu-initialization")[2]
