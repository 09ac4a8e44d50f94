"""One rank of the GPU check's optimizer-gather timing: the pristine tree's and the series' gather, interleaved.

Without --overlap-param-gather, ``LayerWiseDistributedOptimizer.step()`` ends with
``allgather_params()``. Pristine 0.17.1 flattens each rank's params, gathers them with one list
``torch.distributed.all_gather`` and copies them out; the series (0.17.1 and 0.19 patch 0006)
broadcasts each param in place from its owner, all inside one ``_coalescing_manager`` group.
This worker times both on the same model, in the same process, on the same process group::

    torchrun --nproc-per-node 8 harness/gpu_check/gather_timing_worker.py \
        --backend nccl --layers 32 --rounds 20 --block 3 --out gather_timing.json

The tree under test (PYTHONPATH; the plan runs series-0.17.1) gives the series'
``allgather_params``. The pristine one is the same method's source read from ``--pristine-tree``
(pristine-0.17.1's ``layer_wise_optimizer.py``) and compiled in the series module's
namespace (``pristine_allgather_params``): the pristine code, bound to the same optimizer. The
patch changes nothing else that the method reaches (the 0.17.1 file also gains a guard for
``dp_cp_params_list is None``, DP 1, which this run never has).

Model: megatron's GPTModel with Llama-3-8B's shapes (``harness.gpu_check.real_shapes``:
hidden 4096, FFN 14336, GQA 8 x 128, vocab 128256, untied embeddings, bf16 params, no
biases) with ``--layers`` layers, in DDP (bf16 grads, overlap off) with the layer-wise Muon
optimizer; ``--config llama_tiny`` is the same code at a size for CPU tests. No training step:
the gathers need only the params and the optimizer's ownership lists.

Per path, first one untimed check: every rank fills the params it owns with a value of its
own and the others with -1, runs the gather, and requires every param to hold its owner's
value (``synced``); on CUDA the same gather's ``max_memory_allocated`` over what was
allocated before it (``peak_extra_bytes``). Then ``--rounds`` rounds (fewer, at least
``MIN_ROUNDS``, where the warm-up gathers say they would not end within ``--max-seconds``);
each times one block of ``--block`` gathers per path, the paths in
``harness.bench.stats.abba_order`` (pristine first in even rounds, the series first in odd
ones). Each gather: device synchronize, barrier, then the wall time of the gather up to a
device synchronize; a gather's time is the slowest rank's
(all_reduce MAX after the rounds, so no extra collective runs between timed gathers). Rank 0
writes the per-round block medians, the series/pristine ratio (median of the per-round ratios)
and its bootstrap CI (``stats.ratio_summary``) to ``--out``.

On NCCL nothing of the harness wraps a collective (no recording layer, no coalescing
wrapper): the times are torch's and NCCL's own. Ranks that share one GPU
(``MEGATRON_SHARED_GPU=1``) get their own ``NCCL_HOSTID`` and talk through NCCL's socket
transport: that runs NCCL's real code paths, but the times mean nothing about NVLink (the
report says so). On gloo (CPU tests) the harness's collective model
(``harness.gpu_check.shared_gpu.install_collectives``) runs both paths, each broadcast its
own gloo call: the times there do not decide anything either.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import inspect
import json
import os
import statistics
import sys
import textwrap
import time
import traceback
from pathlib import Path

if __package__ in (None, ""):
    # Run by path: sys.path[0] is this folder; `harness` must come from the repo root, which
    # PYTHONPATH lists after the tree under test.
    if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
        del sys.path[0]

from harness import cpu_runtime  # noqa: E402

cpu_runtime.install_if_requested()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from harness.bench import stats  # noqa: E402
from harness.gpu_check import real_shapes, shared_gpu  # noqa: E402
from harness.trees import check_expected_tree, tree_parent  # noqa: E402

#: The two gathers, keys of every per-path field of the document: the pristine tree's and the series'.
PATHS = ("pristine", "series")
#: The fewest timing rounds ``--max-seconds`` may leave.
MIN_ROUNDS = 5
PARAM_DTYPE = torch.bfloat16
OPTIMIZER_FILE = Path("megatron") / "core" / "optimizer" / "layer_wise_optimizer.py"
#: ``llama3_8b``: Llama-3-8B's shapes (``--layers`` sets the layer count, 32 for the whole
#: model); ``llama_tiny``: the same code at a size for CPU tests.
CONFIGS = {
    "llama3_8b": real_shapes.worker_config(32),
    "llama_tiny": real_shapes.LLAMA_TINY,
}


def _on_gpu() -> bool:
    return torch.cuda.is_available() and not cpu_runtime.is_installed()


def _sync() -> None:
    if _on_gpu():
        torch.cuda.synchronize()


def method_source(path: Path, cls: str = "LayerWiseDistributedOptimizer", name: str = "allgather_params") -> str:
    """The source of ``cls.name`` in the file ``path``, decorators included, dedented."""
    text = path.read_text()
    tree = ast.parse(text)
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
    fn = next(n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == name)
    first = min([fn.lineno] + [d.lineno for d in fn.decorator_list])
    return textwrap.dedent("\n".join(text.splitlines()[first - 1:fn.end_lineno])) + "\n"


def pristine_allgather_params(pristine_tree: str, module):
    """The pristine ``allgather_params``, compiled from ``pristine_tree``'s file in ``module``'s
    namespace (the series' ``layer_wise_optimizer``): (function, its source)."""
    path = tree_parent(pristine_tree) / OPTIMIZER_FILE
    source = method_source(path)
    scope: dict = {}
    exec(compile(source, str(path), "exec"), vars(module), scope)  # noqa: S102 - the pristine tree's own code
    return scope["allgather_params"], source


def sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


class Setup:
    """The model in DDP with its layer-wise optimizer, and both gathers bound to it."""

    def __init__(self, cfg: dict, pristine_tree: str, seed: int = 1234):
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig
        from megatron.core.optimizer import layer_wise_optimizer as lwo
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
        from megatron.core.transformer import TransformerConfig

        from harness.layerwise_optimizer import layerwise_muon_optimizer
        from harness.model import gpt_model

        torch.manual_seed(seed)
        model_parallel_cuda_manual_seed(seed)
        config = TransformerConfig(
            num_layers=cfg["num_layers"], hidden_size=cfg["hidden_size"],
            num_attention_heads=cfg["num_attention_heads"], ffn_hidden_size=cfg["ffn_hidden_size"],
            num_query_groups=cfg["num_query_groups"], kv_channels=cfg["kv_channels"],
            normalization=cfg["normalization"], gated_linear_unit=True, activation_func=torch.nn.functional.silu,
            bias_activation_fusion=False, add_bias_linear=False, params_dtype=PARAM_DTYPE, bf16=True,
            use_cpu_initialization=not _on_gpu(), hidden_dropout=0.0, attention_dropout=0.0,
        )
        module = gpt_model(config, cfg["vocab"], cfg["seq"], block_spec=True, normalization=cfg["normalization"],
                           share_embeddings_and_output_weights=False, position_embedding_type="rope")
        if _on_gpu():
            module = module.cuda()
        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=False, overlap_grad_reduce=False,
                                                   overlap_param_gather=False, use_distributed_optimizer=False)
        self.ddp = DistributedDataParallel(config, ddp_config, module)
        opt_config = OptimizerConfig(optimizer="muon", lr=1e-3, bf16=True, params_dtype=PARAM_DTYPE,
                                     use_distributed_optimizer=False, overlap_param_gather=False)
        self.opt = layerwise_muon_optimizer(opt_config, [self.ddp], use_gloo_process_groups=False)
        if not self.opt.dp_cp_params_list:
            raise RuntimeError("the layer-wise optimizer shards nothing (DP 1?): nothing to gather")
        pristine, self.pristine_source = pristine_allgather_params(pristine_tree, lwo)
        self.series_source = textwrap.dedent(inspect.getsource(type(self.opt).allgather_params))
        self.gathers = {"pristine": pristine.__get__(self.opt), "series": self.opt.allgather_params}

    def owners(self) -> list:
        return self.opt.dp_cp_params_list

    @torch.no_grad()
    def mark(self, rank: int) -> None:
        """Owned params hold their owner's value (``expected``), the others -1."""
        for owner, params in enumerate(self.owners()):
            for i, p in enumerate(params):
                p.data.fill_(self.expected(owner, i) if owner == rank else -1.0)

    @staticmethod
    def expected(owner: int, index: int) -> float:
        return float(1 + (owner * 31 + index) % 200)  # exact in bf16

    @torch.no_grad()
    def synced(self) -> bool:
        return all(bool((p.data == self.expected(owner, i)).all())
                   for owner, params in enumerate(self.owners()) for i, p in enumerate(params))

    def check(self, path: str, rank: int) -> dict:
        """One untimed gather of ``path`` after ``mark``: synced, and its CUDA peak over allocated."""
        self.mark(rank)
        _sync()
        dist.barrier()
        base = torch.cuda.memory_allocated() if _on_gpu() else None
        if _on_gpu():
            torch.cuda.reset_peak_memory_stats()
        self.gathers[path]()
        _sync()
        peak = torch.cuda.max_memory_allocated() - base if _on_gpu() else None
        return {"synced": self.synced(), "peak_extra_bytes": peak}

    def time_block(self, path: str, n: int) -> list:
        out = []
        for _ in range(n):
            _sync()
            dist.barrier()
            t0 = time.perf_counter()
            self.gathers[path]()
            _sync()
            out.append(time.perf_counter() - t0)
        return out


def pristine_nccl_ops(elements: list) -> int:
    """NCCL operations of the pristine tree's list all_gather on ProcessGroupNCCL: one ncclAllGather when
    every rank's share is equal, else one broadcast per rank (a zero-size one included). The
    series issues one broadcast per param. Either way one group launch."""
    return 1 if len(set(elements)) == 1 else len(elements)


def max_over_ranks(values: list) -> list:
    """Each value's maximum over the ranks (one all_reduce)."""
    t = torch.tensor(values, dtype=torch.float64, device="cuda" if _on_gpu() else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def rounds_within(rounds: int, max_seconds, block: int, warm_s: list, least: int = MIN_ROUNDS) -> int:
    """``rounds``, or fewer where a round (``block`` gathers of each path, each as long as its
    warm-up gather ``warm_s``) would not let them end within ``max_seconds``; never fewer than
    ``least``. The same on every rank (``warm_s`` is already the maximum over ranks)."""
    if max_seconds is None:
        return rounds
    per_round = block * sum(warm_s)
    return max(least, min(rounds, int(max_seconds // per_round) if per_round > 0 else rounds))


def run(args) -> dict:
    """Everything rank 0 writes (see the module docstring); every rank returns it."""
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = dict(CONFIGS[args.config])
    if args.layers is not None:
        cfg["num_layers"] = args.layers
    s = Setup(cfg, args.pristine_tree)
    owners = s.owners()
    elements = [sum(p.numel() for p in ps) for ps in owners]
    params = [p for ps in owners for p in ps]
    checks = {path: s.check(path, rank) for path in PATHS}
    warm = [s.time_block(path, 1)[0] for path in PATHS]  # warm-up: NCCL's lazily built state is not a per-gather cost
    rounds = rounds_within(args.rounds, args.max_seconds, args.block, max_over_ranks(warm))
    times = {path: [] for path in PATHS}  # per round, the block's times
    for rnd in range(rounds):
        for path in stats.abba_order(PATHS, rnd):
            times[path].append(s.time_block(path, args.block))
    flat = max_over_ranks([t for path in PATHS for block in times[path] for t in block])
    blocks, i = {}, 0
    for path in PATHS:
        blocks[path] = []
        for block in times[path]:
            blocks[path].append(statistics.median(flat[i:i + len(block)]))
            i += len(block)
    synced = [None] * world
    dist.all_gather_object(synced, {p: checks[p] for p in PATHS})
    itemsize = params[0].element_size()
    ops = {"pristine": pristine_nccl_ops(elements), "series": len(params)}
    return {
        "backend": str(dist.get_backend()), "world": world, "config_name": args.config, "layers": cfg["num_layers"],
        "gpu": torch.cuda.get_device_name(0) if _on_gpu() else None, "torch": torch.__version__,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if _on_gpu() else None,
        "shared_gpu": os.environ.get(shared_gpu.ENV_VAR) == "1",
        "param_count": len(params), "param_numel": sum(elements), "param_bytes": sum(elements) * itemsize,
        "params_per_rank": [len(ps) for ps in owners], "elements_per_rank": elements,
        "received_bytes_per_rank": [(sum(elements) - e) * itemsize for e in elements],
        "nccl_ops": ops, "launches": {"pristine": 1, "series": 1},
        "series_in_place": all(type(p.data) is torch.Tensor and p.is_contiguous() for p in params),
        "pristine_source_sha256": sha(s.pristine_source), "series_source_sha256": sha(s.series_source),
        "pristine_uses_list_all_gather": "torch.distributed.all_gather(gather_list" in s.pristine_source,
        "series_uses_coalescing_manager": "_coalescing_manager" in s.series_source,
        "checks": {p: {"synced": all(r[p]["synced"] for r in synced),
                       "peak_extra_bytes": [r[p]["peak_extra_bytes"] for r in synced]} for p in PATHS},
        "rounds": rounds, "rounds_asked": args.rounds, "block": args.block, "block_median_s": blocks,
        "median_s": {p: statistics.median(blocks[p]) for p in PATHS},
        "ratio": stats.ratio_summary(blocks, "series", "pristine"),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--backend", choices=("gloo", "nccl"), required=True)
    ap.add_argument("--config", choices=sorted(CONFIGS), default="llama3_8b")
    ap.add_argument("--layers", type=int, help="layers of the model (default: the config's)")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--block", type=int, default=3)
    ap.add_argument("--max-seconds", type=float, help="fewer rounds (at least %d) where --rounds would take longer, "
                    "judged by the warm-up gathers" % MIN_ROUNDS)
    ap.add_argument("--pristine-tree", default="pristine-0.17.1", help="the tree whose allgather_params is timed as "
                    "the pristine one (a harness.trees label)")
    args = ap.parse_args(argv)

    if args.backend == "nccl":
        if os.environ.get(shared_gpu.ENV_VAR) == "1":
            shared_gpu.share_device()  # not its collective model, which would wrap every timed call
    else:
        shared_gpu.install_collectives()  # gloo: the collective model runs the uneven list all_gather
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if _on_gpu():
        torch.cuda.set_device(local)
    dist.init_process_group(backend=args.backend)
    rank = dist.get_rank()
    try:
        from megatron.core import parallel_state

        tree = check_expected_tree()
        parallel_state.initialize_model_parallel()
        doc = run(args)
        doc["megatron_core_dir"] = tree
    except Exception:  # noqa: BLE001 - the traceback goes to the run's log
        print(f"gather_timing_worker rank {rank} failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        os._exit(1)  # the other ranks may be inside a collective: torchrun stops them
    if rank == 0:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(doc, indent=1) + "\n")
        r = doc["ratio"]
        print(f"optimizer gather: pristine {doc['median_s']['pristine'] * 1e3:.3f} ms, series "
              f"{doc['median_s']['series'] * 1e3:.3f} ms, series/pristine {r['ratio']:.2f} "
              f"[{r['ci_lo']:.2f}, {r['ci_hi']:.2f}] over {r['rounds']} rounds", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
