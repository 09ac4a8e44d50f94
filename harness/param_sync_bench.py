"""Worker of scripts/bench_param_sync.py: measure ONE megatron tree's layer-wise param sync.

The driver starts this module once per (tree, process-group kind), with the tree chosen
by PYTHONPATH (harness.trees.env_for_tree), and merges the JSON it writes:

    # real ranks: one process per DP rank, gloo on CPU (nccl with --device cuda)
    MEGATRON_CPU_RUNTIME=1 python -m torch.distributed.run --standalone \
        --nproc-per-node 2 harness/param_sync_bench.py --mode real --out R.json
    # PyTorch's fake process group: one process simulates rank r of a DP group of size N
    MEGATRON_CPU_RUNTIME=1 python harness/param_sync_bench.py --mode fake \
        --dp-sizes 8,64,512 --ranks 0,mid --out F.json

What is measured, per path and DDP bucket size (real megatron-core objects):

* "async": the forward pre-hook chain. `start_param_sync()` of the first bucket group in
  forward order, then `finish_param_sync()` of every group in forward order, which waits,
  dispatches the next group's all-gather and copies back (DDP with
  overlap_param_gather=True, as --overlap-param-gather builds it).
* "forced": `DistributedDataParallel.start_param_sync(force_sync=True)`, what eval and
  checkpoint save run through disable_forward_pre_hook(param_sync=True).
* "optimizer": `LayerWiseDistributedOptimizer.allgather_params()`, the synchronous gather
  at the end of `step()` when overlap_param_gather is off.

Model: megatron's GPTModel with the local (non-Transformer-Engine) layer spec, bf16 params
and fp32 grad buffers (--bf16 --accumulate-allreduce-grads-in-fp32), untied output layer;
optimizer from get_megatron_muon_optimizer(layer_wise_distributed_optimizer=True). A real
GPTModel rather than a stack of Linear layers because the layer-wise optimizer's sharding
(whole params to ranks, ping-pong by size), Muon's qkv handling and the DDP bucket layout
all key on the real parameter names, shapes and attributes.

Figures per record (see AllocationCounter in harness/alloc_counter.py for the method):
temporary_bytes, alloc_calls and peak_extra_bytes of ONE sync (a TorchDispatchMode sees
every ATen op; gloo/NCCL internal buffers are not tensors and are not counted), wall
seconds of `reps` syncs (after `warmup` untimed ones; under real ranks the per-rep time is
the slowest rank's), and with --device cuda the torch.cuda.max_memory_allocated delta.
Theory (harness/param_sync_theory.py): upstream, NVIDIA/Megatron-LM#3751, series (0).

With the fake process group no data moves: torch.distributed.all_gather on a fake group
is replaced by a check of the slot sizes that writes nothing and allocates nothing (the
fake backend's own allgather copies the input into every output and so rejects uneven
sizes). Bytes and allocator calls are exact there; times are the local work only.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Optional

if __package__ in (None, ""):
    # Run as a file (torchrun): sys.path[0] is harness/, which would expose our modules
    # as top-level names. Drop it; `harness` comes from the repo root, which goes LAST so
    # that the tree chosen by PYTHONPATH (build/upstream or the repo root) keeps its rank.
    # (`python -m harness.param_sync_bench` would put the cwd, i.e. the patched tree,
    # first: check_expected_tree() then refuses a mismatch with $MEGATRON_EXPECT_TREE.)
    if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
        del sys.path[0]
    sys.path.append(str(Path(__file__).resolve().parent.parent))

from harness import cpu_runtime  # noqa: E402

cpu_runtime.install_if_requested()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from harness import param_sync_theory as theory  # noqa: E402
from harness.alloc_counter import AllocationCounter  # noqa: E402
from harness.trees import check_expected_tree  # noqa: E402

PATHS = ("async", "forced", "optimizer")
# GPT shape (small enough for 2 CPU cores): 4 layers, hidden 256, 4 heads, FFN 1024,
# vocab 1024, 128 positions: 3,716,608 params, 7,433,216 bytes in bf16.
GPT_SHAPE = dict(num_layers=4, hidden_size=256, num_attention_heads=4, ffn_hidden_size=1024)
VOCAB = 1024
SEQ = 128
PARAM_DTYPE = torch.bfloat16


# ---------------------------------------------------------------- fake process group
class _DoneWork:
    """Completed work handle for the simulated all_gather."""

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def _install_fake_all_gather() -> None:
    """Route torch.distributed.all_gather on fake groups to a size check (no data moved).

    Raises (from the replacement):
        ValueError: slot count != group size, or this rank's slot size != input size,
            naming the rank, as NCCL's uneven all_gather would fail.
    """
    real = dist.all_gather

    def all_gather(tensor_list, tensor, group=None, async_op=False):
        if dist.get_backend(group) != "fake":
            return real(tensor_list, tensor, group=group, async_op=async_op)
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        if len(tensor_list) != world:
            raise ValueError(f"all_gather: {rank=} got {len(tensor_list)} slots for {world=}")
        if tensor_list[rank].numel() != tensor.numel():
            raise ValueError(
                f"all_gather: {rank=} own slot {tensor_list[rank].numel()} != input {tensor.numel()}"
            )
        return _DoneWork() if async_op else None

    dist.all_gather = all_gather


# ---------------------------------------------------------------- megatron objects
def _megatron():
    """Import megatron-core lazily (after the CPU runtime layer is installed)."""
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.optimizer.muon import get_megatron_muon_optimizer
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig

    return dict(
        ps=parallel_state,
        DDP=DistributedDataParallel,
        DDPConfig=DistributedDataParallelConfig,
        spec=get_gpt_layer_local_spec,
        GPTModel=GPTModel,
        OptimizerConfig=OptimizerConfig,
        muon=get_megatron_muon_optimizer,
        seed=model_parallel_cuda_manual_seed,
        TransformerConfig=TransformerConfig,
    )


class Setup:
    """GPTModel wrapped in megatron DDP plus its LayerWiseDistributedOptimizer.

    Args:
        mc: the dict from _megatron().
        overlap: overlap_param_gather (True: async/forced paths; False: optimizer path).
        bucket_size: DDPConfig.bucket_size in elements; None: DDP's default
            (max(40M, 1M * dp_size): one bucket for this model).
        device: "cpu" or "cuda".
        init: run megatron's weight init (False: torch.empty weights, faster; the
            values do not matter for bytes or time).
    """

    def __init__(self, mc, overlap: bool, bucket_size, device: str, init: bool):
        config = mc["TransformerConfig"](
            **GPT_SHAPE,
            params_dtype=PARAM_DTYPE,
            bf16=True,
            use_cpu_initialization=True,
            perform_initialization=init,
        )
        module = mc["GPTModel"](config, mc["spec"](), vocab_size=VOCAB, max_sequence_length=SEQ)
        module = module.to(dtype=PARAM_DTYPE)
        if device == "cuda":
            module = module.cuda()
        ddp_config = mc["DDPConfig"](
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=True,
            overlap_param_gather=overlap,
            use_distributed_optimizer=False,
            bucket_size=bucket_size,
        )
        self.ddp = mc["DDP"](config, ddp_config, module)
        opt_config = mc["OptimizerConfig"](
            optimizer="muon",
            lr=0.01,
            bf16=True,
            params_dtype=PARAM_DTYPE,
            use_distributed_optimizer=False,
            overlap_param_gather=overlap,
        )
        self.opt = mc["muon"](
            opt_config,
            [self.ddp],
            layer_wise_distributed_optimizer=True,
            use_gloo_process_groups=False,
        )
        self.params = list(self.ddp.module.parameters())
        self.groups = self.ddp.bucket_groups + self.ddp.expert_parallel_bucket_groups
        self.buckets = [b for g in self.groups for b in g.buckets]

    @property
    def forward_order(self):
        """Bucket groups in the order the forward pre-hooks finish them: buckets are
        built in backward order, and next_param_gather_bucket_group points backwards."""
        return list(reversed(self.ddp.bucket_groups))

    def reset(self) -> None:
        """State at the start of a training step: train_step's zero_grad_buffer(), and no
        gather dispatched (finish_grad_sync clears param_gather_dispatched)."""
        self.ddp.zero_grad_buffer()
        for g in self.groups:
            g.param_gather_dispatched = False

    def sync_fn(self, path: str):
        """Zero-argument callable running one sync of `path` (see module docstring)."""
        if path == "async":

            def run():
                order = self.forward_order
                order[0].start_param_sync()
                for g in order:
                    g.finish_param_sync()

            return run
        if path == "forced":
            return lambda: self.ddp.start_param_sync(force_sync=True)
        if path == "optimizer":
            return self.opt.allgather_params
        raise ValueError(f"unknown path {path!r}; expected one of {PATHS}")

    def theory(self, path: str, rank: int) -> dict:
        """Theoretical bytes of one sync of `path` on `rank` (harness/param_sync_theory).

        Returns:
            {theory_upstream_bytes, theory_3751_bytes, theory_series_bytes,
             theory_upstream_peak_bytes}, all bytes.
        """
        if path == "optimizer":
            owners = self.opt.dp_cp_params_list
            up = (
                0
                if owners is None
                else theory.theory_upstream_bytes(owners, rank, PARAM_DTYPE.itemsize)
            )
            # #3751 left allgather_params() as upstream has it.
            return dict(
                theory_upstream_bytes=up,
                theory_3751_bytes=up,
                theory_series_bytes=0,
                theory_upstream_peak_bytes=up,
            )
        per_group = [theory.group_bytes(g, rank) for g in self.forward_order]
        peak = theory.async_chain_peak_bytes(per_group) if path == "async" else max(per_group)
        return dict(
            theory_upstream_bytes=sum(per_group),
            theory_3751_bytes=sum(theory.group_bytes(g, rank, "3751") for g in self.groups),
            theory_series_bytes=0,
            theory_upstream_peak_bytes=peak,
        )

    def owned(self, rank: int) -> set:
        owners = self.opt.dp_cp_params_list
        return set(self.params) if owners is None else set(owners[rank])

    @torch.no_grad()
    def scramble(self, rank: int) -> None:
        """Post-step state with known values: owned params = target, others stale."""
        own = self.owned(rank)
        for i, p in enumerate(self.params):
            p.fill_(float(i % 97) / 8.0 if p in own else -777.0)

    @torch.no_grad()
    def synced(self) -> bool:
        return all(bool((p == float(i % 97) / 8.0).all()) for i, p in enumerate(self.params))


# ---------------------------------------------------------------- measurement
@contextlib.contextmanager
def device_mode_suspended():
    """Suspend the CPU runtime layer's device-mapping TorchFunctionMode (item 1 of
    harness/cpu_runtime/device.py) while measuring.

    The mode intercepts every torch call (a few microseconds each) to rewrite CUDA device
    arguments; it is needed to BUILD megatron objects on CPU, not to run the sync (which
    allocates on the buffers' own device). Left on, it would charge each tree per torch
    call, e.g. upstream's one `torch.empty` per DP rank and bucket, an overhead that no
    GPU run has. The uneven gloo all_gather (item 9) replaces a function, not a mode, and
    stays active. A no-op when the layer is not installed.
    """
    with cpu_runtime.device_mapping_suspended():
        yield


def _sync_device(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def measure(s: Setup, path: str, rank: int, reps: int, warmup: int, device: str, real: bool):
    """One path of one Setup: allocations of one sync, then `reps` timed syncs.

    Returns:
        dict with temporary_bytes, alloc_calls, peak_extra_bytes (bytes/count of one sync),
        cuda_peak_extra_bytes (bytes; None on CPU), times_s (wall seconds per sync, this
        rank), cpu_times_s (CPU seconds of this process, all threads, per sync: less
        sensitive than wall time to other processes on a shared machine),
        params_synced (bool, real ranks; None with the fake group), theory fields.
    """
    run = s.sync_fn(path)
    for _ in range(warmup):
        s.reset()
        run()
    _sync_device(device)
    s.reset()
    if real:
        s.scramble(rank)
    with AllocationCounter() as counter:
        run()
    _sync_device(device)
    synced = s.synced() if real else None
    cuda_peak = None
    if device == "cuda":
        s.reset()
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        run()
        torch.cuda.synchronize()
        cuda_peak = torch.cuda.max_memory_allocated() - base
    times, cpu_times = [], []
    for _ in range(reps):
        s.reset()
        _sync_device(device)
        if real:
            dist.barrier()
        c0, t0 = time.process_time(), time.perf_counter()
        run()
        _sync_device(device)
        times.append(time.perf_counter() - t0)
        cpu_times.append(time.process_time() - c0)
    return dict(
        temporary_bytes=counter.temporary_bytes,
        alloc_calls=counter.alloc_calls,
        peak_extra_bytes=counter.peak_extra_bytes,
        alloc_ops=sorted({name for name, _ in counter.events}),
        cuda_peak_extra_bytes=cuda_peak,
        times_s=times,
        cpu_times_s=cpu_times,
        params_synced=synced,
        **s.theory(path, rank),
    )


def profile(s: Setup, path: str, reps: int, device: str, top: int = 8) -> dict:
    """torch.profiler over `reps` syncs of `path`, each after an unprofiled reset().

    Returns:
        {"ops": [[op name, calls per sync, self CPU seconds per sync], ...], the `top`
         ops by self CPU time (profiler overhead included, so read them relative to
         each other); "sync_s": median profiled wall seconds per sync;
         "zeroing_ablation": ablate_zeroing() (None on upstream);
         "zero_grad_data_s": median seconds of zeroing every bucket's grad_data once
         (what the series' copy-out adds); "grad_data_bytes": their total size}.
    """
    from torch.profiler import ProfilerActivity, profile as tprofile

    run = s.sync_fn(path)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    totals, walls = {}, []
    for _ in range(reps):
        s.reset()
        _sync_device(device)
        with tprofile(activities=activities) as prof:
            t0 = time.perf_counter()
            run()
            _sync_device(device)
            walls.append(time.perf_counter() - t0)
        for e in prof.key_averages():
            calls, self_s = totals.get(e.key, (0, 0.0))
            totals[e.key] = (calls + e.count, self_s + e.self_cpu_time_total / 1e6)
    ops = sorted(
        ([name, calls / reps, self_s / reps] for name, (calls, self_s) in totals.items()),
        key=lambda r: -r[2],
    )
    zero_times = []
    for _ in range(max(reps, 5)):
        _sync_device(device)
        t0 = time.perf_counter()
        for b in s.buckets:
            b.grad_data.zero_()
        _sync_device(device)
        zero_times.append(time.perf_counter() - t0)
    return dict(
        ops=ops[:top],
        zeroing_ablation=ablate_zeroing(s, path, max(reps, 10), device),
        sync_s=statistics.median(walls),
        zero_grad_data_s=statistics.median(zero_times),
        grad_data_bytes=sum(b.grad_data.numel() * b.grad_data.element_size() for b in s.buckets),
    )


def ablate_zeroing(s: Setup, path: str, reps: int, device: str) -> Optional[dict]:
    """Paired timing of the series' sync with and without its copy-out zeroing.

    Alternates normal syncs with syncs in which every bucket's `grad_data.zero_` is
    shadowed by a no-op on that tensor object (an instance attribute; zero_grad_buffer()
    zeroes the buffer's own tensor, so reset() is unaffected). Interleaving in one process
    cancels most of the drift of a shared machine. Only for the measurement: the result
    of a sync without zeroing is wrong for training.

    Returns:
        None on a tree without the series (no `finish_layerwise_gather`), else
        {"with_s", "without_s"}: median process CPU seconds per sync, `reps` syncs each.
    """
    if not hasattr(s.buckets[0], "finish_layerwise_gather"):
        return None
    run = s.sync_fn(path)
    times = {"with_s": [], "without_s": []}
    for i in range(2 * reps):
        key = "with_s" if i % 2 == 0 else "without_s"
        for b in s.buckets:
            if key == "without_s":
                b.grad_data.zero_ = lambda t=b.grad_data: t
            else:
                b.grad_data.__dict__.pop("zero_", None)
        s.reset()
        _sync_device(device)
        c0 = time.process_time()
        run()
        _sync_device(device)
        times[key].append(time.process_time() - c0)
    for b in s.buckets:
        b.grad_data.__dict__.pop("zero_", None)
    return {k: statistics.median(v) for k, v in times.items()}


def cprofile_sync(s: Setup, path: str, reps: int = 3, top: int = 10) -> list:
    """cProfile over `reps` syncs of `path` (each after an unprofiled reset()).

    Returns:
        [[function, calls per sync, own seconds per sync, cumulative seconds per sync],
        ...] for the `top` functions by own time ("tottime"): Python-level cost, which
        torch.profiler's per-op table does not show.
    """
    import cProfile
    import pstats

    run = s.sync_fn(path)
    prof = cProfile.Profile()
    for _ in range(reps):
        s.reset()
        prof.enable()
        run()
        prof.disable()
    stats = pstats.Stats(prof).stats
    rows = []
    for (filename, line, func), (_, ncalls, tottime, cumtime, callers) in stats.items():
        if not callers:
            # A root: the sync closure itself, or a frame whose caller cProfile lost
            # (seen with torch.distributed's decorated get_world_size, charged with
            # more cumulative time than the whole sync); not a cost of its own.
            continue
        where = f"{Path(filename).name}:{line}" if line else filename
        rows.append([f"{func} ({where})", ncalls / reps, tottime / reps, cumtime / reps])
    rows.sort(key=lambda r: -r[2])
    return rows[:top]


def _bucket_arg(text: str):
    return None if text == "default" else int(text)


def run_configs(mc, args, dp_size: int, rank: int, real: bool) -> list:
    """Every (bucket size, path) for the current process group; a list of records."""
    records = []
    for bucket_text in args.bucket_sizes.split(","):
        bucket_size = _bucket_arg(bucket_text)
        setups = {}
        for path in args.paths.split(","):
            overlap = path != "optimizer"
            if overlap not in setups:
                setups[overlap] = Setup(mc, overlap, bucket_size, args.device, init=False)
            s = setups[overlap]
            rec = dict(
                path=path,
                dp_size=dp_size,
                rank=rank,
                device=args.device,
                backend=dist.get_backend(),
                bucket_size=bucket_size,
                num_buckets=len(s.buckets),
                num_bucket_groups=len(s.groups),
                param_bytes=sum(p.numel() * p.element_size() for p in s.params),
                num_params=len(s.params),
                params_owned=len(s.owned(rank)),
                reps=args.reps,
                warmup=args.warmup,
            )
            with device_mode_suspended():
                rec.update(measure(s, path, rank, args.reps, args.warmup, args.device, real))
                if args.profile_path == path and args.profile_reps > 0:
                    rec["profile"] = profile(s, path, args.profile_reps, args.device)
                if f"{dp_size}:{rank}:{bucket_text}:{path}" in args.cprofile.split(","):
                    rec["cprofile"] = cprofile_sync(s, path)
                    rec["zeroing_ablation"] = ablate_zeroing(s, path, 10, args.device)
            records.append(rec)
        del setups
    return records


def _gather_real(records: list) -> list:
    """Rank 0: its own records with per-rep times = max over ranks, and per-rank bytes."""
    world = dist.get_world_size()
    everyone = [None] * world
    dist.all_gather_object(everyone, records)
    if dist.get_rank() != 0:
        return []
    out = []
    for i, rec in enumerate(records):
        peers = [everyone[r][i] for r in range(world)]
        rec = dict(rec)
        rec["rank_times_s"] = [p["times_s"] for p in peers]
        rec["times_s"] = [max(ts) for ts in zip(*rec["rank_times_s"])]
        rec["cpu_times_s"] = [max(ts) for ts in zip(*(p["cpu_times_s"] for p in peers))]
        rec["params_synced"] = all(p["params_synced"] for p in peers)
        for key in ("temporary_bytes", "alloc_calls", "peak_extra_bytes", "theory_upstream_bytes"):
            rec[f"all_ranks_{key}"] = [p[key] for p in peers]
        out.append(rec)
    return out


def main_real(args, mc) -> list:
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend="nccl")
    else:
        dist.init_process_group(backend="gloo")
    mc["ps"].initialize_model_parallel(create_gloo_process_groups=False)
    mc["seed"](1234)
    records = run_configs(mc, args, dist.get_world_size(), dist.get_rank(), real=True)
    records = _gather_real(records)
    dist.barrier()
    mc["ps"].destroy_model_parallel()
    dist.destroy_process_group()
    return records


def main_fake(args, mc) -> list:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    _install_fake_all_gather()
    records = []
    for dp_size in [int(x) for x in args.dp_sizes.split(",")]:
        ranks = []
        for r in args.ranks.split(","):
            ranks.append(dp_size // 2 if r == "mid" else int(r))
        for rank in dict.fromkeys(ranks):
            dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=dp_size)
            mc["ps"].initialize_model_parallel(create_gloo_process_groups=False)
            mc["seed"](1234)
            records += run_configs(mc, args, dp_size, rank, real=False)
            mc["ps"].destroy_model_parallel()
            dist.destroy_process_group()
    return records


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=("real", "fake"), required=True)
    ap.add_argument("--out", required=True, help="JSON list of records (rank 0 writes)")
    ap.add_argument("--tree", default="", help="label stored in each record")
    ap.add_argument("--paths", default=",".join(PATHS))
    ap.add_argument("--bucket-sizes", default="default", help="comma list: default or elements")
    ap.add_argument("--dp-sizes", default="8,64,512", help="fake mode: simulated DP sizes")
    ap.add_argument("--ranks", default="0,mid", help="fake mode: ranks to simulate (mid = dp//2)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--reps", type=int, default=20, help="timed syncs per path")
    ap.add_argument("--warmup", type=int, default=2, help="untimed syncs before counting")
    ap.add_argument("--profile-path", default="", help="path to profile (torch.profiler)")
    ap.add_argument("--profile-reps", type=int, default=5)
    ap.add_argument(
        "--cprofile",
        default="",
        help="comma list of DP:RANK:BUCKET:PATH to profile with cProfile (e.g. 512:0:250000:optimizer)",
    )
    args = ap.parse_args(argv)

    tree_dir = check_expected_tree()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    mc = _megatron()
    records = main_real(args, mc) if args.mode == "real" else main_fake(args, mc)
    if args.mode == "fake" or records:
        for rec in records:
            rec["tree"] = args.tree
            rec["tree_dir"] = tree_dir
            rec["pg"] = "fake" if args.mode == "fake" else "real"
        Path(args.out).write_text(json.dumps(records, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
