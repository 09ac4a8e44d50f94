"""What the GPU check runs: one ``Run`` per measurement, each with its commands and timeout.

``make_plan(gpus, gpu_name, out)`` is a pure function of the GPU count and name, so that a
dry run on a machine without GPUs shows exactly what a machine with that many would run:

============================  =========  =======  ===========================================
run                           backend    ranks    what
============================  =========  =======  ===========================================
functional_gloo_shared_gpu    gloo       2        default functional case, both ranks on cuda:0
memory_gloo_shared_gpu        gloo       2        CUDA memory, ``param_dominated`` GPT, cuda:0
functional_nccl               nccl       2        default case, cuda:0 and cuda:1 (>= 2 GPUs)
functional_nccl_te            nccl       2        default case with megatron's defaults:
                                                  Transformer Engine, fused wgrad into main_grad
functional_nccl_sync          nccl       2        overlap off: the optimizer's gather (0007)
functional_nccl_eval          nccl       2        eval every 10 steps: forced param syncs
memory_nccl                   nccl       <= 8     CUDA memory, one rank per GPU (>= 2 GPUs)
memory_nccl_equal_shares      nccl       2        equal bucket shares (>= 2 GPUs); requires a
                                                  bucket with equal shares and the patched
                                                  all_gather_into_tensor
============================  =========  =======  ===========================================

Timeouts are seconds of wall time per run (a functional run trains both trees, each with half
the run's timeout less 10 s; a memory run starts one torchrun per tree). They are budgets, not
measurements: no GPU run has been recorded yet, so they leave room for cold starts (CUDA
context, NCCL init, Transformer Engine's first kernels). The plan adds up to at most
``BUDGET_S`` for 1 and for 2 or more GPUs.
"""

from __future__ import annotations

import re
import shlex
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

from harness import launch

#: The functional case every run trains (run_case's default: dist_muon, both overlaps, DP=2).
CASE = "gpt_dp2_bf16_fp32grad_overlap_layerwise"
#: Overlap off: the optimizer's synchronous gather through the grad buffers (patch 0007).
SYNC_CASE = "gpt_dp2_bf16_fp32grad_sync_layerwise"
#: Eval every 10 iterations: forced param syncs with the pre-hooks disabled (patch 0003).
EVAL_CASE = "gpt_dp2_bf16_fp32grad_overlap_layerwise_eval"
TREES = ("upstream", "patched")
MEMORY_WORKER = Path(__file__).resolve().parent / "memory_worker.py"
MEMORY_STEPS = 4
#: Seconds the whole plan may take: 1 GPU, and 2 or more GPUs (the NCCL runs come on top).
BUDGET_S = {1: 480, 2: 1800}
#: Environment for gloo ranks that share cuda:0 (harness.gpu_check.shared_gpu).
SHARED_GPU_ENV = {"MEGATRON_SHARED_GPU": "1"}
#: At most this many NCCL ranks in memory_nccl (one node).
MAX_NCCL_RANKS = 8


@dataclass
class Launch:
    """One torchrun the run starts: which tree, the command line and its environment."""

    tree: str
    argv: List[str]
    env: Dict[str, str]

    def shell(self) -> str:
        """``env VAR=... argv`` for the variables that select tree, runtime and GPU sharing."""
        keys = [*launch.SHOWN_ENV, *SHARED_GPU_ENV]
        assigns = [f"{k}={shlex.quote(self.env[k])}" for k in keys if k in self.env]
        return " ".join(["env", *assigns, shlex.join(self.argv)])


@dataclass
class Run:
    """One measurement of the plan.

    Attributes:
        name: folder name under OUT and key in summary.json.
        kind: "functional" or "memory".
        backend: "gloo" or "nccl".
        nproc: ranks.
        devices: the CUDA device of each rank.
        timeout_s: wall-clock limit of the whole run, seconds.
        launches: the torchrun commands, upstream first.
        golden_file: functional runs: the golden values' file name (in the case folder).
        config: memory runs: the memory_worker configuration.
        case: functional runs: the functional test case.
        runtime_flags: functional runs: the harness's local-layer flags (False: megatron's
            defaults, Transformer Engine and fused wgrad).
    """

    name: str
    kind: str
    backend: str
    nproc: int
    devices: List[str]
    timeout_s: int
    launches: List[Launch] = field(default_factory=list)
    golden_file: Optional[str] = None
    config: Optional[str] = None
    case: Optional[str] = None
    runtime_flags: bool = True

    def as_dict(self) -> dict:
        d = asdict(self)
        d["launches"] = [{"tree": x.tree, "command": x.shell()} for x in self.launches]
        return d


@dataclass
class Plan:
    gpus: int
    gpu_name: str
    out: Path
    runs: List[Run]
    update_golden: bool = False

    @property
    def total_timeout_s(self) -> int:
        return sum(r.timeout_s for r in self.runs)

    @property
    def budget_s(self) -> int:
        return BUDGET_S[min(self.gpus, 2)]

    def as_dict(self) -> dict:
        return {"gpus": self.gpus, "gpu_name": self.gpu_name, "gpu_slug": gpu_slug(self.gpu_name),
                "out": str(self.out), "update_golden": self.update_golden,
                "total_timeout_s": self.total_timeout_s, "budget_s": self.budget_s,
                "runs": [r.as_dict() for r in self.runs]}


def gpu_slug(name: str) -> str:
    """Short lower-case GPU type for file names: "NVIDIA H200" -> "h200",
    "NVIDIA H100 80GB HBM3" -> "h100", "NVIDIA A100-SXM4-80GB" -> "a100".

    Raises:
        ValueError: nothing usable in ``name``.
    """
    words = [w for w in re.split(r"[^a-z0-9]+", name.lower()) if w and w not in ("nvidia", "tesla", "geforce")]
    if not words:
        raise ValueError(f"cannot make a GPU type out of {name!r}")
    return words[0]


def golden_file(gpu_name: str, backend: str, variant: str = "") -> str:
    """Golden values of a case for a GPU type and backend, e.g. ``golden_values_h200_gloo.json``
    (2 ranks on one GPU), ``golden_values_h200_nccl.json``, or with ``variant="te"``
    ``golden_values_h200_nccl_te.json`` (Transformer Engine)."""
    return f"golden_values_{gpu_slug(gpu_name)}_{backend}{'_' + variant if variant else ''}.json"


def functional_launches(run_dir: Path, backend: str, nproc: int, extra_env: Dict[str, str],
                        case_name: str = CASE, runtime_flags: bool = True) -> List[Launch]:
    """The torchrun lines ``run_case.run_case`` starts for ``case_name`` with these overrides
    (``harness.gpu_check.functional`` passes the same ones)."""
    from harness import data
    from tests.functional_tests.python_test_utils import run_case

    case = run_case.load_case(run_case.find_case(case_name))
    model_args = {**case.model_args, **functional_overrides(backend)}
    out = []
    for tree in TREES:
        variables = {
            "DATA_PATH": str(Path(data.DEFAULT_OUT).resolve() / data.DATASET_PREFIX),
            "TENSORBOARD_PATH": str(run_dir / case.name / tree / "tensorboard"),
            "CHECKPOINT_SAVE_PATH": str(run_dir / case.name / tree / "checkpoints"),
            "CHECKPOINT_LOAD_PATH": str(run_dir / case.name / tree / "checkpoints"),
        }
        argv, env = launch.pretrain_command(tree, run_case.expand_args(model_args, variables), nproc,
                                            cpu=False, runtime_flags=runtime_flags,
                                            extra_env={**case.env_vars, **extra_env})
        out.append(Launch(tree, argv, env))
    return out


def functional_overrides(backend: str) -> Dict[str, object]:
    """MODEL_ARGS entries that the GPU check changes: the backend (last on the command line,
    so it wins over the ``--distributed-backend nccl`` that a GPU launch starts with)."""
    return {"--distributed-backend": backend}


def memory_launches(run_dir: Path, backend: str, nproc: int, config: str, extra_env: Dict[str, str]) -> List[Launch]:
    out = []
    for tree in TREES:
        argv, env = launch.torchrun_command(
            MEMORY_WORKER, ["--backend", backend, "--config", config, "--steps", str(MEMORY_STEPS),
                            "--out", str(run_dir / f"{tree}.json")],
            nproc, tree=tree, cpu=False, extra_env=extra_env)
        out.append(Launch(tree, argv, env))
    return out


def make_plan(gpus: int, gpu_name: str, out: Path, update_golden: bool = False) -> Plan:
    """The runs for a machine with ``gpus`` CUDA GPUs named ``gpu_name``.

    Args:
        gpus: >= 1 (a dry run on a machine without GPUs plans for 1).
        gpu_name: ``torch.cuda.get_device_name(0)``, e.g. "NVIDIA H200".
        out: results folder; each run writes under ``out/<run name>``.
        update_golden: functional runs rewrite their golden file (refused unless patched
            equals upstream exactly).

    Raises:
        ValueError: ``gpus`` < 1 or an unusable ``gpu_name``.
    """
    if gpus < 1:
        raise ValueError(f"a plan needs at least 1 GPU, got {gpus}")
    gpu_slug(gpu_name)
    out = Path(out).resolve()
    runs = [
        Run("functional_gloo_shared_gpu", "functional", "gloo", 2, ["cuda:0", "cuda:0"], 210,
            functional_launches(out / "functional_gloo_shared_gpu", "gloo", 2, SHARED_GPU_ENV),
            golden_file=golden_file(gpu_name, "gloo"), case=CASE),
        Run("memory_gloo_shared_gpu", "memory", "gloo", 2, ["cuda:0", "cuda:0"], 180,
            memory_launches(out / "memory_gloo_shared_gpu", "gloo", 2, "param_dominated", SHARED_GPU_ENV),
            config="param_dominated"),
    ]
    if gpus >= 2:
        n = min(gpus, MAX_NCCL_RANKS)
        two = ["cuda:0", "cuda:1"]
        runs += [
            Run("functional_nccl", "functional", "nccl", 2, two, 240,
                functional_launches(out / "functional_nccl", "nccl", 2, {}),
                golden_file=golden_file(gpu_name, "nccl"), case=CASE),
            Run("functional_nccl_te", "functional", "nccl", 2, two, 300,
                functional_launches(out / "functional_nccl_te", "nccl", 2, {}, runtime_flags=False),
                golden_file=golden_file(gpu_name, "nccl", "te"), case=CASE, runtime_flags=False),
            Run("functional_nccl_sync", "functional", "nccl", 2, two, 240,
                functional_launches(out / "functional_nccl_sync", "nccl", 2, {}, SYNC_CASE),
                golden_file=golden_file(gpu_name, "nccl"), case=SYNC_CASE),
            Run("functional_nccl_eval", "functional", "nccl", 2, two, 240,
                functional_launches(out / "functional_nccl_eval", "nccl", 2, {}, EVAL_CASE),
                golden_file=golden_file(gpu_name, "nccl"), case=EVAL_CASE),
            Run("memory_nccl", "memory", "nccl", n, [f"cuda:{i}" for i in range(n)], 150,
                memory_launches(out / "memory_nccl", "nccl", n, "param_dominated", {}),
                config="param_dominated"),
            Run("memory_nccl_equal_shares", "memory", "nccl", 2, ["cuda:0", "cuda:1"], 120,
                memory_launches(out / "memory_nccl_equal_shares", "nccl", 2, "equal_shares", {}),
                config="equal_shares"),
        ]
    plan = Plan(gpus, gpu_name, out, runs, update_golden)
    if plan.total_timeout_s > plan.budget_s:
        raise AssertionError(f"plan timeouts add up to {plan.total_timeout_s} s > {plan.budget_s} s")
    return plan


def functional_command(run: Run, plan: Plan) -> List[str]:
    """The driver process of a functional run (``python -m harness.gpu_check.functional``)."""
    argv = [sys.executable, "-m", "harness.gpu_check.functional", "--backend", run.backend,
            "--case", run.case or CASE, "--golden-file", run.golden_file, "--out", str(plan.out / run.name),
            "--timeout", str(run.timeout_s // 2 - 10)]
    if not run.runtime_flags:
        argv += ["--megatron-defaults"]
    if run.backend == "gloo":
        argv += ["--shared-gpu"]
    if plan.update_golden:
        argv += ["--update-golden"]
    return argv


def format_plan(plan: Plan) -> str:
    """The dry-run text: a header, then per run one ``run NAME key=value ...`` line and one
    ``  launch TREE: env ... python -m torch.distributed.run ...`` line per torchrun."""
    lines = [f"gpu_check plan: {plan.gpus} GPU(s) ({plan.gpu_name}), {len(plan.runs)} runs, "
             f"timeouts {plan.total_timeout_s} s of a {plan.budget_s} s budget, results in {plan.out}"]
    for r in plan.runs:
        fields = [f"kind={r.kind}", f"backend={r.backend}", f"ranks={r.nproc}",
                  f"devices={','.join(r.devices)}", f"timeout_s={r.timeout_s}"]
        if r.golden_file:
            fields.append(f"golden={r.golden_file}")
        if r.config:
            fields.append(f"config={r.config}")
        lines.append(f"run {r.name} " + " ".join(fields))
        if r.kind == "functional":
            lines.append(f"  driver: {shlex.join(functional_command(r, plan))}")
        for x in r.launches:
            lines.append(f"  launch {x.tree}: {x.shell()}")
    return "\n".join(lines)
