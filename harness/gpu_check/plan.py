"""What the GPU check runs: one ``Run`` per measurement, each with its commands and timeout.

``make_plan(gpus, gpu_name, out)`` is a pure function of the GPU count and name (and of
whether Transformer Engine is importable), so that a dry run on a machine without GPUs shows
exactly what a machine with that many would run. Runs, by base (the trees of harness.trees:
``pristine-0.17.1`` and ``series-0.17.1``; ``pristine-0.19`` and ``series-0.19``):

=================================  =====  =====  ==============================================
run                                base   ranks  what
=================================  =====  =====  ==============================================
functional_gloo_shared_gpu         0.17.1 2      default case, gloo, both ranks on cuda:0
memory_gloo_shared_gpu             0.17.1 2      CUDA memory, ``param_dominated`` GPT, gloo
functional_nccl                    0.17.1 2      default case on NCCL
functional_nccl_te                 0.17.1 2      default case with megatron's defaults:
                                                 Transformer Engine, fused wgrad into main_grad
                                                 (skipped where transformer_engine is missing)
functional_nccl_sync               0.17.1 2      overlap off: the optimizer's gather (0006)
functional_nccl_eval               0.17.1 2      eval every 10 steps: forced param syncs
memory_nccl                        0.17.1 2..8   CUDA memory, ``param_dominated`` GPT
memory_nccl_equal_shares           0.17.1 2      equal bucket shares; requires a bucket with
                                                 equal shares and all_gather_into_tensor
memory_nccl_llama3_8b_layers       0.17.1 2      Llama-3-8B's shapes, as many layers as fit 2
                                                 ranks on an 80 GB GPU; measured peaks beside
                                                 the real-shape audit's prediction
functional_nccl_019_legacy         0.19   2      0.19's default case (legacy layer-wise path)
functional_nccl_019_sync           0.19   2      0.19, overlap off
functional_nccl_019_moe            0.19   4      0.19, MoE EP 2, alltoall token dispatcher
functional_nccl_019_vpp            0.19   4      0.19, PP 2 with VPP 2
functional_nccl_019_layout         0.19   2      0.19's layout path (model-provider API)
timing_nccl_optimizer_gather       0.17.1 2..8   the optimizer's gather timed: the pristine
                                                 list all_gather vs the series' in-place broadcasts
                                                 (0006), interleaved on one model
=================================  =====  =====  ==============================================

NCCL runs put one rank per GPU where there are enough GPUs; otherwise ranks share GPUs (rank
``i`` on ``cuda:i % gpus``): ``MEGATRON_SHARED_GPU=1`` gives every rank its own
``NCCL_HOSTID`` (``harness.gpu_check.shared_gpu``) and ``NCCL_SOCKET_IFNAME=lo``, so NCCL
connects them through its socket transport. On one GPU every NCCL run is of this kind.

Time: every run has a timeout of its time on one H200 times ``HEADROOM`` (``RUN_TIMES``:
measured where a run was timed there, an estimate otherwise, and the plan says which). Runs
that are independent share the GPU at once: they are spread over ``LANES`` lanes that run
side by side (each lane runs its runs one after another, longest first); runs that need the
GPU's memory alone (``exclusive``) run before the lanes, one at a time. The plan's
``schedule_s`` (exclusive runs plus the longest lane) must fit ``BUDGET_S``: 8 minutes on one
GPU. A functional run trains both trees, each with half the run's timeout less 10 s.
"""

from __future__ import annotations

import importlib.util
import math
import re
import shlex
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from harness import launch
from harness.gpu_check import real_shapes

#: The functional case every run trains (run_case's default: dist_muon, both overlaps, DP=2).
CASE = "gpt_dp2_bf16_fp32grad_overlap_layerwise"
#: Overlap off: the optimizer's synchronous gather, each param broadcast in place (patch 0006).
SYNC_CASE = "gpt_dp2_bf16_fp32grad_sync_layerwise"
#: Eval every 10 iterations: forced param syncs with the pre-hooks disabled (patch 0004).
EVAL_CASE = "gpt_dp2_bf16_fp32grad_overlap_layerwise_eval"
#: The 0.19 base's cases (tests/functional_tests/test_cases/gpt_mcore_0.19/), by run suffix.
CASES_019 = {
    "legacy": "gpt019_dp2_bf16_fp32grad_overlap_legacy",
    "sync": "gpt019_dp2_bf16_fp32grad_sync_legacy",
    "moe": "gpt019_moe_ep2_dp4_bf16_fp32grad_overlap_legacy",
    "vpp": "gpt019_pp2_vpp2_dp2_bf16_fp32grad_overlap_legacy",
    "layout": "gpt019_dp2_bf16_fp32grad_overlap_layout",
}
#: A memory run's two sides -> the tree each runs on (``real_shapes.TREES``); each side writes
#: ``OUT/<run>/<side>.json``.
TREES = real_shapes.TREES
MEMORY_WORKER = Path(__file__).resolve().parent / "memory_worker.py"
GATHER_TIMING_WORKER = Path(__file__).resolve().parent / "gather_timing_worker.py"
#: The optimizer-gather timing (``gather_timing_worker.py``): with a GPU per rank, the whole
#: Llama-3-8B (32 layers, 195 params) at DP = the GPUs (at most ``MAX_NCCL_RANKS``), alone on
#: the GPUs; with ranks sharing one GPU (NCCL's socket transport: real code, meaningless
#: times) the tiny config, beside the other runs. Rounds of one block per path, ABBA; fewer
#: rounds (at least 5) where the warm-up gathers say 20 would take over ``max_seconds`` (a slow
#: interconnect), so that the run ends within its timeout.
GATHER_TIMING = {"multi_gpu": ["--config", "llama3_8b", "--layers", "32"], "one_gpu": ["--config", "llama_tiny"],
                 "rounds": 20, "block": 3, "max_seconds": 30}
MEMORY_STEPS = 4
#: Seconds the schedule may take: 1 GPU, and 2 or more GPUs.
BUDGET_S = {1: 480, 2: 1800}
#: Runs side by side on the GPU(s) (see the module docstring).
LANES = 6
#: Timeout = time x HEADROOM (runs share the GPU and the CPU cores with the other lanes).
HEADROOM = 1.5
#: At most this many NCCL ranks in memory_nccl (one node).
MAX_NCCL_RANKS = 8
#: What a Transformer Engine run reports where transformer_engine does not import.
TE_MISSING = "skipped: Transformer Engine not installed"
#: Seconds each run took on one H200 (2 NCCL ranks on one GPU, alone), or an estimate:
#: (seconds, "measured" or "estimate", basis). Measured: 80 to 87 s per functional run of the
#: 0.17.1 default, sync and eval cases (both trees, 50 iterations each).
RUN_TIMES: Dict[str, Tuple[int, str, str]] = {
    "functional_nccl": (87, "measured", "H200, 2 NCCL ranks on cuda:0, both trees"),
    "functional_nccl_sync": (87, "measured", "H200, 2 NCCL ranks on cuda:0, both trees"),
    "functional_nccl_eval": (87, "measured", "H200, 2 NCCL ranks on cuda:0, both trees"),
    "functional_gloo_shared_gpu": (90, "estimate", "as functional_nccl; gloo stages through host memory"),
    "functional_nccl_te": (100, "estimate", "as functional_nccl plus Transformer Engine's first kernels"),
    "functional_nccl_019_legacy": (87, "estimate", "as 0.17.1's default case (same shapes, 50 iterations)"),
    "functional_nccl_019_sync": (87, "estimate", "as 0.17.1's sync case"),
    "functional_nccl_019_layout": (70, "estimate", "as functional_nccl, 20 iterations"),
    "functional_nccl_019_moe": (110, "estimate", "4 ranks start up on the GPU; 16 iterations"),
    "functional_nccl_019_vpp": (110, "estimate", "4 ranks start up on the GPU; 20 iterations"),
    "memory_gloo_shared_gpu": (60, "estimate", "0.54 B params, 4 steps and 2 syncs per tree"),
    "memory_nccl": (60, "estimate", "as memory_gloo_shared_gpu"),
    "memory_nccl_equal_shares": (45, "estimate", "0.14 B params"),
    "memory_nccl_llama3_8b_layers": (90, "estimate", f"{real_shapes.LAYERS} Llama-3-8B layers, "
                                     "2.8 B params initialized on the GPU, per tree"),
    "timing_nccl_optimizer_gather": (60, "estimate", "Llama-3-8B (8.0 B params) initialized on the GPUs once, "
                                     "then 2 x 62 gathers of 16 GB; on one GPU the tiny model"),
}


def base_missing(case_name: str) -> Optional[str]:
    """Why ``case_name``'s base cannot run here (its trees or its Megatron-LM checkout are not
    built, e.g. in an image built for one base), as a skip reason; None when it can."""
    from harness.trees import tree_parent
    from tests.functional_tests.python_test_utils import run_case

    case = run_case.load_case(run_case.find_case(case_name))
    try:
        for tree in run_case.BASES[case.base].trees.values():
            tree_parent(tree)
    except FileNotFoundError as exc:
        return f"skipped: megatron-core {case.base} is not set up here ({exc})"
    absent = run_case.missing_checkouts([case_name])
    return f"skipped: {absent[0]}" if absent else None


def te_available() -> bool:
    """Whether ``transformer_engine`` is installed (its spec is found; not imported)."""
    return importlib.util.find_spec("transformer_engine") is not None


@dataclass
class Launch:
    """One torchrun the run starts: which tree, the command line and its environment."""

    tree: str
    argv: List[str]
    env: Dict[str, str]

    def shell(self) -> str:
        """``env VAR=... argv`` for the variables that select tree, runtime and GPU sharing."""
        keys = [*launch.SHOWN_ENV, *shared_gpu_env("nccl"), "MEGATRON_LM_CHECKOUT"]
        assigns = [f"{k}={shlex.quote(self.env[k])}" for k in keys if k in self.env]
        return " ".join(["env", *assigns, shlex.join(self.argv)])


@dataclass
class Run:
    """One measurement of the plan.

    Attributes:
        name: folder name under OUT and key in summary.json.
        kind: "functional", "memory" or "timing" (the optimizer-gather timing).
        backend: "gloo" or "nccl".
        nproc: ranks.
        devices: the CUDA device of each rank.
        timeout_s: wall-clock limit of the whole run, seconds.
        launches: the torchrun commands, the pristine tree first.
        golden_file: functional runs: the golden values' file name (in the case folder).
        config: memory runs: the memory_worker configuration.
        case: functional runs: the functional test case.
        runtime_flags: functional runs: the harness's local-layer flags (False: megatron's
            defaults, Transformer Engine and fused wgrad).
        base: the megatron-core base ("0.17.1" or "0.19").
        time_s, time_kind, time_basis: the run's time behind its timeout (``RUN_TIMES``).
        lane: the lane it runs in (``LANES``); -1 for exclusive runs.
        exclusive: runs alone on the GPU(s), before the lanes.
        skip_reason: why the run is not run (it then neither passes nor fails).
        shared_gpu: ranks share GPUs (``MEGATRON_SHARED_GPU=1``).
        prediction: the real-shape audit's prediction (``real_shapes.PREDICTION_FILE``).
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
    base: str = "0.17.1"
    time_s: Optional[int] = None
    time_kind: Optional[str] = None
    time_basis: Optional[str] = None
    lane: int = 0
    exclusive: bool = False
    skip_reason: Optional[str] = None
    shared_gpu: bool = False
    prediction: Optional[dict] = None

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
    #: ``--checkout PATH``: the user's own tree (``harness.own_tree``), None for the pinned trees.
    checkout: Optional[Path] = None

    @property
    def total_timeout_s(self) -> int:
        """All timeouts added up (the time the runs would take one after another)."""
        return sum(r.timeout_s for r in self.runs)

    @property
    def schedule_s(self) -> int:
        """Longest time the schedule may take: exclusive runs, then the longest lane."""
        lanes: Dict[int, int] = {}
        for r in self.runs:
            if not r.exclusive:
                lanes[r.lane] = lanes.get(r.lane, 0) + r.timeout_s
        return sum(r.timeout_s for r in self.runs if r.exclusive) + max(lanes.values(), default=0)

    @property
    def budget_s(self) -> int:
        return BUDGET_S[min(self.gpus, 2)]

    def as_dict(self) -> dict:
        return {"gpus": self.gpus, "gpu_name": self.gpu_name, "gpu_slug": gpu_slug(self.gpu_name),
                "out": str(self.out), "update_golden": self.update_golden,
                "total_timeout_s": self.total_timeout_s, "schedule_s": self.schedule_s, "lanes": LANES,
                "budget_s": self.budget_s, "runs": [r.as_dict() for r in self.runs]}


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
    (2 ranks on one GPU), ``golden_values_h200_nccl.json`` (a rank per GPU),
    ``golden_values_h200_nccl_1gpu.json`` (NCCL ranks sharing one GPU through sockets), or with
    ``variant="te"`` ``golden_values_h200_nccl_te.json`` (Transformer Engine)."""
    return f"golden_values_{gpu_slug(gpu_name)}_{backend}{'_' + variant if variant else ''}.json"


def shared_gpu_env(backend: str) -> Dict[str, str]:
    """Environment of ranks that share GPUs (``harness.gpu_check.shared_gpu``); NCCL's ranks also
    get the loopback interface for its socket transport."""
    return {"MEGATRON_SHARED_GPU": "1", **({"NCCL_SOCKET_IFNAME": "lo"} if backend == "nccl" else {})}


def functional_launches(run_dir: Path, backend: str, nproc: int, extra_env: Dict[str, str],
                        case_name: str = CASE, runtime_flags: bool = True, own=None) -> List[Launch]:
    """The torchrun lines ``run_case.run_case`` starts for ``case_name`` with these overrides
    (``harness.gpu_check.functional`` passes the same ones), on the trees of the case's base, or
    with ``own`` (``harness.own_tree.OwnTree``) on its two clones, each its own checkout."""
    from harness import data
    from tests.functional_tests.python_test_utils import run_case

    case = run_case.load_case(run_case.find_case(case_name))
    base = run_case.BASES[case.base]
    model_args = {**case.model_args, **functional_overrides(backend)}
    out = []
    for variant in run_case.VARIANTS:
        tree, checkout = base.trees[variant], base.checkout
        if own is not None:
            tree = checkout = own.checkouts()[variant]
        variables = {
            "DATA_PATH": str(Path(data.DEFAULT_OUT).resolve() / data.DATASET_PREFIX),
            "TENSORBOARD_PATH": str(run_dir / case.name / variant / "tensorboard"),
            "CHECKPOINT_SAVE_PATH": str(run_dir / case.name / variant / "checkpoints"),
            "CHECKPOINT_LOAD_PATH": str(run_dir / case.name / variant / "checkpoints"),
        }
        argv, env = launch.pretrain_command(tree, run_case.expand_args(model_args, variables), nproc,
                                            cpu=False, runtime_flags=runtime_flags,
                                            extra_env={**case.env_vars, "MEGATRON_LM_CHECKOUT": str(checkout),
                                                       **extra_env})
        out.append(Launch(variant if own is not None else tree, argv, env))
    return out


def functional_overrides(backend: str) -> Dict[str, object]:
    """MODEL_ARGS entries that the GPU check changes: the backend (last on the command line,
    so it wins over the ``--distributed-backend nccl`` that a GPU launch starts with)."""
    return {"--distributed-backend": backend}


def memory_launches(run_dir: Path, backend: str, nproc: int, config: str, extra_env: Dict[str, str]) -> List[Launch]:
    out = []
    for side, tree in TREES.items():
        argv, env = launch.torchrun_command(
            MEMORY_WORKER, ["--backend", backend, "--config", config, "--steps", str(MEMORY_STEPS),
                            "--out", str(run_dir / f"{side}.json")],
            nproc, tree=tree, cpu=False, extra_env=extra_env)
        out.append(Launch(tree, argv, env))
    return out


def gather_timing_launches(run_dir: Path, nproc: int, one_gpu: bool, extra_env: Dict[str, str]) -> List[Launch]:
    """The optimizer-gather timing: one torchrun on the series tree, which times its own
    ``allgather_params`` and the pristine one (compiled from the pristine tree's source)."""
    args = [*GATHER_TIMING["one_gpu" if one_gpu else "multi_gpu"], "--backend", "nccl",
            "--rounds", str(GATHER_TIMING["rounds"]), "--block", str(GATHER_TIMING["block"]),
            "--max-seconds", str(GATHER_TIMING["max_seconds"]),
            "--pristine-tree", TREES["pristine"], "--out", str(run_dir / "gather_timing.json")]
    argv, env = launch.torchrun_command(GATHER_TIMING_WORKER, args, nproc, tree=TREES["series"], cpu=False,
                                        extra_env=extra_env)
    return [Launch(TREES["series"], argv, env)]


def timeout_for(name: str) -> int:
    """``RUN_TIMES[name]`` seconds x ``HEADROOM``, rounded up to 5 s."""
    return int(math.ceil(RUN_TIMES[name][0] * HEADROOM / 5) * 5)


def assign_lanes(runs: List[Run], lanes: int = LANES) -> None:
    """Spread the runs that are not exclusive over ``lanes`` lanes, longest first, each to the
    lane that ends earliest (longest-processing-time first); exclusive runs get lane -1."""
    ends = [0] * lanes
    for r in sorted((r for r in runs if not r.exclusive), key=lambda r: -r.timeout_s):
        i = min(range(lanes), key=lambda k: (ends[k], k))
        r.lane = i
        ends[i] += r.timeout_s
    for r in runs:
        if r.exclusive:
            r.lane = -1


def make_plan(gpus: int, gpu_name: str, out: Path, update_golden: bool = False,
              with_te: Optional[bool] = None, own=None) -> Plan:
    """The runs for a machine with ``gpus`` CUDA GPUs named ``gpu_name``.

    Args:
        gpus: >= 1 (a dry run on a machine without GPUs plans for 1).
        gpu_name: ``torch.cuda.get_device_name(0)``, e.g. "NVIDIA H200".
        out: results folder; each run writes under ``out/<run name>``.
        update_golden: functional runs rewrite their golden file (refused unless the series
            tree's values equal the pristine tree's exactly).
        with_te: whether transformer_engine is installed (None: ``te_available()``); without
            it the TE run is planned with ``skip_reason`` ``TE_MISSING``.
        own: ``--checkout PATH`` (``harness.own_tree.OwnTree``): the functional runs of the
            series' base train PATH as it is and with the series (``own_skip`` says which runs
            do not apply to that tree, and why).

    Raises:
        ValueError: ``gpus`` < 1 or an unusable ``gpu_name``.
        AssertionError: the schedule does not fit ``BUDGET_S`` (a change of the plan's runs).
    """
    if gpus < 1:
        raise ValueError(f"a plan needs at least 1 GPU, got {gpus}")
    gpu_slug(gpu_name)
    with_te = te_available() if with_te is None else with_te
    out = Path(out).resolve()

    def make_run(name: str, kind: str, backend: str, nproc: int, base: str = "0.17.1", case: Optional[str] = None,
                 config: Optional[str] = None, golden_variant: str = "", runtime_flags: bool = True,
                 skip_reason: Optional[str] = None, **kw) -> Run:
        """A run of ``nproc`` ranks: on NCCL one per GPU, sharing GPUs where there are fewer; on
        gloo all on cuda:0. A run of a base that is not set up here (an image built for one
        base: 0.19) or that does not apply to ``own`` is planned as skipped, without launches;
        the 0.17.1 base is the check's own: its absence fails the run."""
        spread = gpus if backend == "nccl" else 1
        shared = nproc > spread
        env = shared_gpu_env(backend) if shared else {}
        why = own_skip(own, kind, base) if own is not None else base_missing(case) if base != "0.17.1" else None
        if why:
            launches = []
        elif kind == "functional":
            launches = functional_launches(out / name, backend, nproc, env, case, runtime_flags, own)
        elif kind == "timing":
            launches = gather_timing_launches(out / name, nproc, gpus == 1, env)
        else:
            launches = memory_launches(out / name, backend, nproc, config, env)
        if kind == "functional":
            variant = "_".join(v for v in ("1gpu" if backend == "nccl" and gpus == 1 else "", golden_variant) if v)
            kw["golden_file"] = golden_file(gpu_name, backend, variant)
        time_s, time_kind, time_basis = RUN_TIMES[name]
        return Run(name, kind, backend, nproc, [f"cuda:{i % spread}" for i in range(nproc)], timeout_for(name),
                   launches, config=config, case=case, runtime_flags=runtime_flags, base=base, time_s=time_s,
                   time_kind=time_kind, time_basis=time_basis, skip_reason=why or skip_reason, shared_gpu=shared, **kw)

    nccl_ranks = min(max(gpus, 2), MAX_NCCL_RANKS)
    runs = [
        make_run("functional_gloo_shared_gpu", "functional", "gloo", 2, case=CASE),
        make_run("memory_gloo_shared_gpu", "memory", "gloo", 2, config="param_dominated"),
        make_run("functional_nccl", "functional", "nccl", 2, case=CASE),
        make_run("functional_nccl_te", "functional", "nccl", 2, case=CASE, runtime_flags=False, golden_variant="te",
                 skip_reason=None if with_te else TE_MISSING),
        make_run("functional_nccl_sync", "functional", "nccl", 2, case=SYNC_CASE),
        make_run("functional_nccl_eval", "functional", "nccl", 2, case=EVAL_CASE),
        make_run("memory_nccl", "memory", "nccl", nccl_ranks, config="param_dominated"),
        make_run("memory_nccl_equal_shares", "memory", "nccl", 2, config="equal_shares"),
        make_run("memory_nccl_llama3_8b_layers", "memory", "nccl", 2, config="llama3_8b_layers", exclusive=True,
                 prediction=real_shapes.load_json(real_shapes.PREDICTION_FILE)),
        # Timed alone where every rank has its GPU; on one GPU the times mean nothing anyway.
        make_run("timing_nccl_optimizer_gather", "timing", "nccl", nccl_ranks, exclusive=gpus > 1),
    ]
    for suffix, case in CASES_019.items():
        nproc = 4 if suffix in ("moe", "vpp") else 2
        runs.append(make_run(f"functional_nccl_019_{suffix}", "functional", "nccl", nproc, base="0.19", case=case))
    assign_lanes(runs)
    plan = Plan(gpus, gpu_name, out, runs, update_golden, own.source if own is not None else None)
    if plan.schedule_s > plan.budget_s:
        raise AssertionError(f"plan schedule takes up to {plan.schedule_s} s > {plan.budget_s} s")
    return plan


def functional_command(run: Run, plan: Plan) -> List[str]:
    """The driver process of a functional run (``python -m harness.gpu_check.functional``)."""
    argv = [sys.executable, "-m", "harness.gpu_check.functional", "--backend", run.backend,
            "--case", run.case or CASE, "--golden-file", run.golden_file, "--out", str(plan.out / run.name),
            "--timeout", str(run.timeout_s // 2 - 10)]
    if not run.runtime_flags:
        argv += ["--megatron-defaults"]
    if run.shared_gpu:
        argv += ["--shared-gpu"]
    if plan.update_golden:
        argv += ["--update-golden"]
    if plan.checkout is not None:
        argv += ["--checkout", str(plan.checkout)]
    return argv


def own_skip(own, kind: str, base: str) -> Optional[str]:
    """Why a run of the plan does not run on ``--checkout PATH``'s tree (None: it does).

    The functional runs of the cases of PATH's series (``own.base``) train PATH as it is and with
    the series. The others measure the pinned 0.17.1 trees: the 0.17.1 cases, and the memory
    runs (the memory worker and the real-shape audit's prediction are made on them)."""
    if kind == "functional" and base == own.base:
        return None
    what = {"functional": f"a megatron-core {base} case",
            "timing": "a timing run of the pinned 0.17.1 trees"}.get(kind, "a memory run of the pinned 0.17.1 trees")
    return (f"skipped: --checkout {own.label} takes patches/{own.series.name} (base {own.base}); "
            f"this is {what}")


def prediction_lines(prediction: Optional[dict]) -> List[str]:
    """The real-shape audit's predicted bytes, one line per tree and window (DP ranks side by
    side), for the dry run and the report."""
    if not prediction:
        return [f"  predicted: none ({real_shapes.PREDICTION_FILE.name} missing: "
                "python -m harness.gpu_check.real_shapes --write)"]
    lines = [f"  predicted by the real-shape audit ({prediction['layers']} layers, DP {prediction['dp']}, "
             f"{prediction['trees']['pristine']['ranks'][0]['param_numel']} params): peak bytes per DP rank "
             f"(+- allocator rounding)"]
    for tree, rec in prediction["trees"].items():
        for window, label in (("sync", "param sync"), ("sync_optimizer", "optimizer gather")):
            cells = [f"rank {r['dp_rank']}: {r['predicted'][window]['bytes']} B "
                     f"(+-{r['predicted'][window]['tolerance_bytes']})" for r in rec["ranks"]]
            lines.append(f"    {tree} {label}: " + ", ".join(cells))
    return lines


def format_plan(plan: Plan) -> str:
    """The dry-run text: a header, then per run one ``run NAME key=value ...`` line and one
    ``  launch TREE: env ... python -m torch.distributed.run ...`` line per torchrun."""
    lines = [f"gpu_check plan: {plan.gpus} GPU(s) ({plan.gpu_name}), {len(plan.runs)} runs, "
             f"schedule {plan.schedule_s} s of a {plan.budget_s} s budget ({LANES} lanes at once, exclusive runs "
             f"first; timeouts add up to {plan.total_timeout_s} s), results in {plan.out}",
             f"timeouts: each run's time on one H200 x {HEADROOM:g} (time=N/measured: timed there; "
             "time=N/estimate: not timed yet)"]
    if any(r.shared_gpu and r.backend == "nccl" for r in plan.runs):
        lines.append("NCCL ranks sharing a GPU: NCCL_HOSTID=<host>-rank<LOCAL_RANK> per rank "
                     "(harness.gpu_check.shared_gpu), NCCL_SOCKET_IFNAME=lo: NCCL's socket transport")
    for r in plan.runs:
        fields = [f"kind={r.kind}", f"base={r.base}", f"backend={r.backend}", f"ranks={r.nproc}",
                  f"devices={','.join(r.devices)}", f"timeout_s={r.timeout_s}", f"time={r.time_s}/{r.time_kind}",
                  f"lane={'exclusive' if r.exclusive else r.lane}"]
        if r.golden_file:
            fields.append(f"golden={r.golden_file}")
        if r.config:
            fields.append(f"config={r.config}")
        lines.append(f"run {r.name} " + " ".join(fields))
        if r.skip_reason:
            lines.append(f"  {r.skip_reason}")
        if r.kind == "functional":
            lines.append(f"  driver: {shlex.join(functional_command(r, plan))}")
        if r.config == "llama3_8b_layers":
            lines.extend(prediction_lines(r.prediction))
        for x in r.launches:
            lines.append(f"  launch {x.tree}: {x.shell()}")
    return "\n".join(lines)
