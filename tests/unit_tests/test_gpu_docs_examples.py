"""Every launcher command in README.md and docs/running_on_gpus.md goes through
scripts/launch_pretrain_gpt.sh --dry-run and megatron.training's own parse_args +
validate_args, with the environment the example gives it.

The examples are read from the ```bash blocks: continuation lines are joined, words split
as a shell would (shlex), ``docker run -e K=V`` / ``export K=V`` / leading ``K=V`` words and
``#SBATCH --nodes / --gpus-per-node`` become the launcher's environment (Slurm's
SLURM_NNODES / SLURM_GPUS_ON_NODE), and the words after ``scripts/launch_pretrain_gpt.sh`` are
its arguments. A Megatron-LM path in an example (or the image's $MEGATRON_LM) becomes a
stand-in checkout of the series tree. ``$(...)`` values (MASTER_ADDR from scontrol) become a
host name. validate_args is told a Hopper GPU (compute capability 9) where it asks.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest

from megatron_argcheck import validate_megatron_args

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", ROOT / "docs" / "running_on_gpus.md"]
LAUNCH = "scripts/launch_pretrain_gpt.sh"
CLEAN = ("NNODES NODE_RANK MASTER_ADDR MASTER_PORT GPUS_PER_NODE MEGATRON_LM TORCHRUN SLURM_NNODES "
         "SLURM_NODEID SLURM_GPUS_ON_NODE SLURM_JOB_NODELIST SLURM_NODELIST CUDA_DEVICE_MAX_CONNECTIONS "
         "CUDA_VISIBLE_DEVICES").split()


def bash_blocks(path: Path):
    return re.findall(r"```bash\n(.*?)```", path.read_text(), re.S)


def examples():
    """(doc name, index, block text, joined command line) for each launcher command."""
    out = []
    for doc in DOCS:
        for block in bash_blocks(doc):
            joined = re.sub(r"\\\n\s*", " ", block)
            for line in joined.splitlines():
                code = line.split(" #", 1)[0]
                if LAUNCH in code and not code.lstrip().startswith("#"):
                    out.append((doc.name, len(out), block, code))
    return out


EXAMPLES = examples()


def launcher_env(block: str, words: list) -> dict:
    env = {}
    for m in re.finditer(r"^#SBATCH --(nodes|gpus-per-node)=(\d+)", block, re.M):
        env["SLURM_NNODES" if m[1] == "nodes" else "SLURM_GPUS_ON_NODE"] = m[2]
    if "SLURM_NNODES" in env:
        env["SLURM_NODEID"] = "0"
    for line in re.sub(r"\\\n\s*", " ", block).splitlines():
        if line.startswith("export "):
            for word in shlex.split(line[len("export "):]):
                key, _, value = word.partition("=")
                env[key] = "head-node" if "$(" in value else value
    for i, w in enumerate(words):
        if w == "-e" and i + 1 < len(words):
            key, _, value = words[i + 1].partition("=")
            env[key] = value
    lead = words[: next(i for i, w in enumerate(words) if w.endswith(LAUNCH))]
    for w in lead:
        if re.fullmatch(r"[A-Z_]+=\S*", w):
            key, _, value = w.partition("=")
            env[key] = value
    return env


@pytest.fixture(scope="module")
def checkout(tmp_path_factory):
    tree = ROOT / "megatron"
    if not (tree / "core" / "__init__.py").is_file():
        pytest.skip("megatron/ not generated; run scripts/setup.sh")
    where = tmp_path_factory.mktemp("mlm") / "Megatron-LM"
    where.mkdir()
    (where / "pretrain_gpt.py").write_text("# stand-in for Megatron-LM's pretrain_gpt.py\n")
    (where / "megatron").symlink_to(tree, target_is_directory=True)
    return where


def test_the_docs_have_launcher_examples():
    docs = {d for d, *_ in EXAMPLES}
    assert docs == {d.name for d in DOCS}, "an example in each document is found (the parser works)"


@pytest.mark.parametrize("doc, index, block, line", EXAMPLES, ids=[f"{d}-{i}" for d, i, *_ in EXAMPLES])
def test_doc_example_passes_the_launcher_and_megatrons_validation(checkout, doc, index, block, line):
    words = shlex.split(line)
    start = next(i for i, w in enumerate(words) if w.endswith(LAUNCH))
    args = words[start + 1:]
    env = launcher_env(block, words)
    if args and not args[0].startswith("-"):
        args[0] = str(checkout)  # the example's own checkout path
    else:
        env["MEGATRON_LM"] = str(checkout)  # the image's $MEGATRON_LM
    args = [a.replace("$SLURM_JOB_ID", "4242") for a in args if a != "--dry-run"]
    run_env = {k: v for k, v in os.environ.items() if k not in CLEAN}
    run_env.update(env)
    run_env.setdefault("GPUS_PER_NODE", "8")  # "all its GPUs" on the example's machine
    proc = subprocess.run(["bash", str(ROOT / LAUNCH), "--dry-run", *args], env=run_env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, f"{doc}: {line}\n{proc.stderr}"
    printed = shlex.split(proc.stdout)
    assigns = {}
    while "=" in printed[0] and not printed[0].startswith("-"):
        key, _, value = printed.pop(0).partition("=")
        assigns[key] = value
    script = next(j for j, w in enumerate(printed) if w.endswith("/pretrain_gpt.py"))
    torchrun = printed[:script]
    world = int(torchrun[torchrun.index("--nnodes") + 1]) * int(torchrun[torchrun.index("--nproc-per-node") + 1])
    (result,) = validate_megatron_args([{"argv": printed[script + 1:], "world_size": world,
                                         "env": assigns, "device_arch": 9,
                                         "attrs": ["optimizer", "tokenizer_type"]}])
    assert result["ok"], f"{doc}: {line}\n{result['error']}\n{result.get('output', '')[-1500:]}"
    assert result["attrs"]["optimizer"] == "dist_muon"
    # What the image installs: no transformers (HuggingFaceTokenizer), no Hub (GPT2BPETokenizer).
    assert result["attrs"]["tokenizer_type"] == "NullTokenizer", f"{doc}: {line}"
