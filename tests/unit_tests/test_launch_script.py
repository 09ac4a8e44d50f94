"""scripts/launch_pretrain_gpt.sh: the command it builds (--dry-run), and its input checks.

The script is run as a user would (subprocess, a clean launcher environment). Checkouts are
stand-ins: a directory with pretrain_gpt.py and a megatron/ link to the generated patched
(megatron/) or pristine (build/upstream/megatron) tree, so scripts/apply_patches.sh --check
sees the real files. The flag set is finally checked by megatron.training's own parser.
"""

from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path

import pytest

from megatron_argcheck import validate_megatron_args

ROOT = Path(__file__).resolve().parents[2]
LAUNCH = ROOT / "scripts" / "launch_pretrain_gpt.sh"
LAUNCH_ENV = (
    "NNODES NODE_RANK MASTER_ADDR MASTER_PORT GPUS_PER_NODE MEGATRON_LM TORCHRUN "
    "SLURM_NNODES SLURM_NODEID SLURM_GPUS_ON_NODE PYTHONPATH"
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


def launch(*args, env=None):
    full_env = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV}
    full_env.update({"GPUS_PER_NODE": "1"} if env is None else env)
    return subprocess.run(
        ["bash", str(LAUNCH), *map(str, args)], env=full_env, capture_output=True, text=True, timeout=60
    )


def dry_run(*args, env=None):
    """Parse the printed command: (environment assignments, torchrun argv, script argv)."""
    proc = launch("--dry-run", *args, env=env)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1, f"expected one command line, got:\n{proc.stdout}"
    words = shlex.split(lines[0])
    assert words[0] == "env"
    i = 1
    assigns = {}
    while "=" in words[i] and not words[i].startswith("-"):
        key, value = words[i].split("=", 1)
        assigns[key] = value
        i += 1
    script = next(j for j, w in enumerate(words) if w.endswith("/pretrain_gpt.py"))
    return assigns, words[i:script + 1], words[script + 1:]


def opt(argv, flag):
    """Value after `flag` in argv (the last occurrence, as argparse would take it)."""
    idx = [i for i, w in enumerate(argv) if w == flag]
    assert idx, f"{flag} missing from {argv}"
    return argv[idx[-1] + 1]


def test_defaults_single_node_mock_data(checkouts):
    env, torchrun, argv = dry_run(checkouts["patched"])
    assert torchrun[0] == "torchrun"
    assert [opt(torchrun, f) for f in ("--nnodes", "--node-rank", "--nproc-per-node")] == ["1", "0", "1"]
    assert (opt(torchrun, "--master-addr"), opt(torchrun, "--master-port")) == ("localhost", "6000")
    assert torchrun[-1] == f"{checkouts['patched']}/pretrain_gpt.py"
    assert env["PYTHONPATH"] == str(checkouts["patched"])
    assert env["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
    assert argv[: len(SERIES_FLAGS)] == SERIES_FLAGS
    assert "--accumulate-allreduce-grads-in-fp32" not in argv
    assert "--use-distributed-optimizer" not in argv
    assert "--mock-data" in argv and "--data-path" not in argv
    assert opt(argv, "--tokenizer-type") == "NullTokenizer" and opt(argv, "--vocab-size") == "32768"
    assert opt(argv, "--global-batch-size") == opt(argv, "--micro-batch-size") == "2"


def test_launcher_environment_is_honoured(checkouts):
    env = {"NNODES": "4", "NODE_RANK": "3", "MASTER_ADDR": "node-0.cluster", "MASTER_PORT": "29500",
           "GPUS_PER_NODE": "8", "TORCHRUN": "/opt/bin/torchrun"}
    _, torchrun, argv = dry_run(checkouts["patched"], "--tp", "2", env=env)
    assert torchrun[0] == "/opt/bin/torchrun"
    assert [opt(torchrun, f) for f in ("--nnodes", "--node-rank", "--nproc-per-node", "--master-addr",
                                       "--master-port")] == ["4", "3", "8", "node-0.cluster", "29500"]
    # 32 GPUs / tp 2 = 16 data-parallel ranks x micro-batch 2.
    assert opt(argv, "--global-batch-size") == "32"
    assert opt(argv, "--tensor-model-parallel-size") == "2"


def test_slurm_variables_are_the_fallback(checkouts):
    env = {"SLURM_NNODES": "2", "SLURM_NODEID": "1", "SLURM_GPUS_ON_NODE": "4", "MASTER_ADDR": "n0"}
    _, torchrun, _ = dry_run(checkouts["patched"], env=env)
    assert [opt(torchrun, f) for f in ("--nnodes", "--node-rank", "--nproc-per-node")] == ["2", "1", "4"]
    env["NNODES"], env["NODE_RANK"] = "3", "2"  # explicit variables win over Slurm's
    _, torchrun, _ = dry_run(checkouts["patched"], env=env)
    assert [opt(torchrun, f) for f in ("--nnodes", "--node-rank")] == ["3", "2"]


def test_checkout_from_environment_and_grad_dtype_options(checkouts):
    env = {"GPUS_PER_NODE": "1", "MEGATRON_LM": str(checkouts["patched"])}
    _, torchrun, argv = dry_run("--fp32-grad-accum", env=env)
    assert torchrun[-1] == f"{checkouts['patched']}/pretrain_gpt.py"
    assert "--accumulate-allreduce-grads-in-fp32" in argv and "--grad-reduce-in-bf16" not in argv
    _, _, argv = dry_run("--bf16-grad-reduce", env=env)
    assert "--grad-reduce-in-bf16" in argv and "--accumulate-allreduce-grads-in-fp32" not in argv


def test_data_paths_and_tokenizers(checkouts):
    _, _, argv = dry_run(checkouts["patched"], "--data-path", "/data/web_text_document",
                         "--vocab-file", "/tok/vocab.json", "--merge-file", "/tok/merges.txt")
    assert "--mock-data" not in argv
    assert opt(argv, "--data-path") == "/data/web_text_document"
    assert opt(argv, "--tokenizer-type") == "GPT2BPETokenizer" and "--vocab-size" not in argv
    assert (opt(argv, "--vocab-file"), opt(argv, "--merge-file"), opt(argv, "--split")) == (
        "/tok/vocab.json", "/tok/merges.txt", "949,50,1")

    _, _, argv = dry_run(checkouts["patched"], "--data-path", "0.3 /d/a", "--data-path", "0.7 /d/b",
                         "--tokenizer-model", "/tok/hf")
    i = argv.index("--data-path")
    assert argv[i + 1:i + 5] == ["0.3", "/d/a", "0.7", "/d/b"]  # a blend, in megatron's word form
    assert opt(argv, "--tokenizer-type") == "HuggingFaceTokenizer"


def test_shell_quoting_and_passthrough(checkouts):
    assert " " in str(checkouts["patched"])
    name = "it's a \"run\" $HOME"
    _, torchrun, argv = dry_run(checkouts["patched"], "--", "--wandb-exp-name", name, "--log-interval", "5")
    assert torchrun[-1] == f"{checkouts['patched']}/pretrain_gpt.py"
    assert argv[-4:] == ["--wandb-exp-name", name, "--log-interval", "5"]  # after ours: they win
    assert opt(argv, "--log-interval") == "5"


def test_unpatched_checkout_is_refused_unless_allowed(checkouts):
    proc = launch("--dry-run", checkouts["upstream"])
    assert proc.returncode == 2
    assert "not applied" in proc.stderr and "apply_patches.sh" in proc.stderr
    proc = launch("--dry-run", "--allow-unpatched", checkouts["upstream"])
    assert proc.returncode == 0 and "warning" in proc.stderr


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
        (["{patched}", "--hidden-size", "100"], {}, "divisible by --num-attention-heads"),
        (["{patched}", "--global-batch-size", "3"], {}, "must be a multiple"),
        (["{patched}", "--tp", "3"], {"GPUS_PER_NODE": "4"}, "not divisible by tp x pp"),
        (["{patched}", "--num-layers", "-1"], {}, "--num-layers must be a positive integer"),
        (["{patched}", "--lr", "fast"], {}, "--lr must be a number"),
        (["{patched}", "--seq-length"], {}, "needs a value"),
        (["{patched}", "--", "--use-distributed-optimizer"], {}, "forbidden with dist_muon"),
        (["{patched}", "--", "--optimizer", "adam"], {}, "fixed to dist_muon"),
        (["{patched}", "--fp32-grad-accum", "--bf16-grad-reduce"], {}, "exclude each other"),
        (["{patched}", "--fp32-grad-accum", "--", "--grad-reduce-in-bf16"], {}, "contradicts"),
        (["{patched}", "--bogus"], {}, "unknown option '--bogus'"),
        (["{patched}", "{patched}"], {}, "more than one checkout"),
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
    _, _, mock_argv = dry_run(checkouts["patched"], "--fp32-grad-accum", "--pp", "2", env=multi)
    _, _, data_argv = dry_run(checkouts["patched"], "--data-path", "/d/x", "--vocab-file", "v",
                              "--merge-file", "m", "--bf16-grad-reduce")
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
    # --bf16-grad-reduce: grad_data in bf16 (megatron's bf16 default is fp32 accumulation).
    assert data["attrs"]["accumulate_allreduce_grads_in_fp32"] is False
    assert data["attrs"]["grad_reduce_in_bf16"] is True
    assert not dist_opt["ok"] and "distributed optimizer" in dist_opt["error"]
    assert not no_grad_overlap["ok"] and "--overlap-grad-reduce" in no_grad_overlap["error"]
