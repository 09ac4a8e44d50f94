"""Worker of scripts/bench_param_sync.py: ONE megatron tree's layer-wise param sync.

The driver starts this file once per tree on gloo ranks, with the tree chosen by PYTHONPATH
(harness.launch.torchrun_command): counts, then a timing server.

    python -m torch.distributed.run --standalone --nproc-per-node 2 \
        harness/bench/sync_worker.py --serve 127.0.0.1:PORT --tree LABEL

Cases: model x path (real megatron-core objects, DDP's default bucket size):

* models (MODELS): "gpt_unequal", a whole GPT (embedding, 4 layers, hidden 256, untied
  output layer) whose per-rank shares differ; "gpt_equal", a middle pipeline stage of a GPT
  (16 identical layers, hidden 128, no embedding or output layer): every param size occurs
  a multiple of 16 times, so the layer-wise optimizer's ping-pong sharding gives every DP
  rank of 2, 4 or 8 exactly the same share of each bucket that holds whole layers.
* paths: "async", the forward pre-hook chain (start_param_sync() of the first bucket group
  in forward order, then finish_param_sync() of every group, --overlap-param-gather);
  "forced", DistributedDataParallel.start_param_sync(force_sync=True) (eval, checkpoint
  save); "optimizer", LayerWiseDistributedOptimizer.allgather_params() (the synchronous
  gather at the end of step() without overlap); "control", every grad buffer's reset(): code
  that no tree changes (its source hash is recorded), the negative control of the timing.

Per case and rank, ONE sync is counted: tensor storages the ATen ops allocate
(harness/alloc_counter.py, dispatch level), the collectives issued (the CPU runtime's
record_collectives(): NCCL calls and group launches, bytes received, what ProcessGroupNCCL
would allocate), every C++ allocation seen by torch.profiler (harness/bench/counters.py),
and that every param afterwards holds its owner's value. Shares per bucket come from
bucket.layerwise_params_list. Timing is done in blocks the driver requests (ABBA over trees, harness/bench/stats.py): {"op": "time", "case": i, "n": k}
answers the k per-sync wall times in seconds, each the slowest rank's.
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import json
import os
import socket
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    # Run as a file (torchrun): sys.path[0] is harness/bench. Drop it; the repo root goes
    # LAST so that the tree chosen by PYTHONPATH keeps its rank (check_expected_tree()
    # refuses a mismatch with $MEGATRON_EXPECT_TREE).
    if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
        del sys.path[0]
    sys.path.append(str(Path(__file__).resolve().parents[2]))

from harness import cpu_runtime  # noqa: E402

cpu_runtime.install_if_requested()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from harness.bench import theory  # noqa: E402
from harness.alloc_counter import AllocationCounter  # noqa: E402
from harness.bench.counters import ProfiledAllocations, model_standin_bytes  # noqa: E402
from harness.model import CONTROL, PARAM_DTYPE, PATHS, LayerwiseModel, gpt_model, wrap  # noqa: E402
from harness.trees import check_expected_tree  # noqa: E402

#: name -> (TransformerConfig shape, GPTModel kwargs). Params: gpt_unequal 3,716,608
#: (7.09 MiB bf16); gpt_equal 3,178,496 (6.06 MiB bf16).
MODELS = {
    "gpt_equal": (
        dict(num_layers=16, hidden_size=128, num_attention_heads=4, ffn_hidden_size=512),
        dict(vocab_size=1024, max_sequence_length=128, pre_process=False, post_process=False),
    ),
    "gpt_unequal": (
        dict(num_layers=4, hidden_size=256, num_attention_heads=4, ffn_hidden_size=1024),
        dict(vocab_size=1024, max_sequence_length=128),
    ),
}


# ---------------------------------------------------------------- megatron objects
def _megatron():
    """Import megatron-core lazily (after the CPU runtime layer is installed)."""
    from megatron.core import parallel_state
    from megatron.core.distributed import param_and_grad_buffer as pgb
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig

    return dict(
        ps=parallel_state,
        pgb=pgb,
        seed=model_parallel_cuda_manual_seed,
        TransformerConfig=TransformerConfig,
    )


def control_code_sha(mc) -> str:
    """sha256 of the source of what the "control" path runs: _ParamAndGradBuffer.reset().
    Equal across trees = a valid negative control. (DDP.zero_grad_buffer() and the bucket
    group's reset() are not: the series' guards change them.)"""
    fns = (mc["pgb"]._ParamAndGradBuffer.reset,)
    return hashlib.sha256("".join(inspect.getsource(f) for f in fns).encode()).hexdigest()


class Setup(LayerwiseModel):
    """GPTModel wrapped in megatron DDP plus its LayerWiseDistributedOptimizer
    (``harness.model``: the paths and the state a step starts from).

    Args:
        mc: the dict from _megatron().
        model: a key of MODELS.
        overlap: overlap_param_gather (True: async/forced paths; False: optimizer path).

    DDPConfig.bucket_size is DDP's default (max(40M, 1M * dp_size): one bucket for these models).

    Weights are torch.empty (no init): values do not matter for bytes, NCCL calls or time,
    and scramble()/synced() write and check known values.
    """

    def __init__(self, mc, model: str, overlap: bool):
        shape, gpt_kwargs = MODELS[model]
        config = mc["TransformerConfig"](
            **shape,
            params_dtype=PARAM_DTYPE,
            bf16=True,
            use_cpu_initialization=True,
            perform_initialization=False,
        )
        module = gpt_model(config, **gpt_kwargs)
        self.ddp, self.opt = wrap(config, module, overlap, lr=0.01)
        self._finish_init()

    def shares(self):
        """Per-rank shares (elements, rank order) of what each design gathers at once.

        Returns:
            (per_bucket, whole): for every bucket, the elements of its params that each
            DP rank owns (from the layer-wise optimizer's dp_cp_params_list, so the same on
            every tree whether or not the tree sets bucket.layerwise_params_list); and the
            whole model's per-rank elements (the pristine tree's optimizer path gathers those in one
            all_gather). ([], None) when the optimizer does not shard (DP 1).
        """
        owners = self.opt.dp_cp_params_list
        if owners is None:
            return [], None
        per_bucket = []
        for b in self.buckets:
            in_bucket = set(b.params)
            per_bucket.append([sum(p.numel() for p in own if p in in_bucket) for own in owners])
        return per_bucket, theory.shares(owners)

    def theory(self, path: str, rank: int) -> dict:
        """Theoretical dispatch-level bytes of one sync of `path` on `rank` (theory.py).

        Returns:
            {theory_pristine_bytes, theory_series_bytes, theory_pristine_peak_bytes}, all
            bytes.
        """
        if path == CONTROL:
            return dict(theory_pristine_bytes=0, theory_series_bytes=0, theory_pristine_peak_bytes=0)
        if path == "optimizer":
            owners = self.opt.dp_cp_params_list
            b = 0 if owners is None else theory.theory_upstream_bytes(owners, rank, PARAM_DTYPE.itemsize)
            return dict(theory_pristine_bytes=b, theory_series_bytes=0, theory_pristine_peak_bytes=b)
        per_group = [theory.group_bytes(g, rank) for g in self.forward_order]
        peak = theory.async_chain_peak_bytes(per_group) if path == "async" else max(per_group)
        return dict(theory_pristine_bytes=sum(per_group), theory_series_bytes=0, theory_pristine_peak_bytes=peak)

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
def count_one_sync(s: Setup, path: str, rank: int) -> dict:
    """Counters of one sync of `path` (after a reset() and scramble()).

    Returns:
        temporary_bytes, alloc_calls (dispatch level, bytes: megatron's own tensors, without
        model_standin_bytes, the NCCL temporaries the collective model allocates through
        torch on gloo), peak_extra_bytes (stand-ins included), dispatch_total_bytes, alloc_ops;
        collective_ops (NCCL calls), collective_launches (NCCL group launches),
        zero_size_ops, wire_bytes, nccl_model_temporary_bytes, collectives (one
        [op, NCCL calls, wire bytes, NCCL temporary bytes] per c10d op);
        profiler_alloc_bytes, profiler_alloc_calls, profiler_peak_bytes,
        profiler_caller_thread_bytes (torch.profiler, all threads); params_synced.
    """
    run = s.sync_fn(path)
    s.reset()
    run()  # warm-up: lazily built state (slot views, caches) is not a per-sync cost
    s.reset()
    if path != CONTROL:
        s.scramble(rank)
    with cpu_runtime.record_collectives() as calls, AllocationCounter() as c:
        run()
    # The collective model allocates NCCL's temporaries through torch where it executes
    # the call (gloo); temporary_bytes keeps megatron's own tensors.
    standin = model_standin_bytes(calls, str(dist.get_backend()))
    standin_calls = sum(1 for k in calls if k.nccl_temporary_bytes) if standin else 0
    synced = s.synced() if path != CONTROL else True
    s.reset()
    with ProfiledAllocations() as prof:
        run()
    return dict(
        temporary_bytes=c.temporary_bytes - standin,
        alloc_calls=c.alloc_calls - standin_calls,
        peak_extra_bytes=c.peak_extra_bytes,
        dispatch_total_bytes=c.temporary_bytes,
        model_standin_bytes=standin,
        alloc_ops=sorted({name for name, _ in c.events}),
        collective_ops=sum(k.ops for k in calls),
        collective_launches=cpu_runtime.summarize(calls)["launches"],
        zero_size_ops=sum(k.zero_size_ops for k in calls),
        wire_bytes=sum(k.wire_bytes for k in calls),
        nccl_model_temporary_bytes=sum(k.nccl_temporary_bytes for k in calls),
        collectives=[[k.form, k.ops, k.wire_bytes, k.nccl_temporary_bytes] for k in calls],
        profiler_alloc_bytes=prof.alloc_bytes,
        profiler_alloc_calls=prof.alloc_calls,
        profiler_peak_bytes=prof.peak_bytes,
        profiler_caller_thread_bytes=prof.caller_thread_bytes,
        params_synced=synced,
    )


def time_block(s: Setup, path: str, n: int) -> list:
    """Wall seconds of `n` syncs of `path`, each after an untimed reset() and a barrier."""
    run = s.sync_fn(path)
    times = []
    for _ in range(n):
        if path != CONTROL:
            s.reset()
        dist.barrier()
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return times


def build_cases(mc, dp_size: int, rank: int):
    """Every (model, path) case: ([(Setup, path)], [record]) with counts."""
    cases, records = [], []
    for model in MODELS:
        setups = {}
        for path in PATHS + (CONTROL,):
            overlap = path != "optimizer"
            if overlap not in setups:
                setups[overlap] = Setup(mc, model, overlap)
            s = setups[overlap]
            per_bucket, whole = s.shares()
            rec = dict(
                model=model,
                path=path,
                dp_size=dp_size,
                rank=rank,
                backend=dist.get_backend(),
                num_buckets=len(s.buckets),
                num_bucket_groups=len(s.groups),
                param_bytes=sum(p.numel() * p.element_size() for p in s.params),
                num_params=len(s.params),
                params_owned=len(s.owned(rank)),
                bucket_shares=per_bucket,
                model_shares=whole,
                param_itemsize=PARAM_DTYPE.itemsize,
                control_code_sha=control_code_sha(mc),
                **s.theory(path, rank),
            )
            with cpu_runtime.device_mapping_suspended():
                rec.update(count_one_sync(s, path, rank))
            cases.append((s, path))
            records.append(rec)
    return cases, records


def _merge_ranks(records: list) -> list:
    """Rank 0: its records plus all_ranks_* lists; [] on other ranks."""
    world = dist.get_world_size()
    everyone = [None] * world
    dist.all_gather_object(everyone, records)
    if dist.get_rank() != 0:
        return []
    out = []
    for i, rec in enumerate(records):
        peers = [everyone[r][i] for r in range(world)]
        rec = dict(rec)
        rec["params_synced"] = all(p["params_synced"] for p in peers)
        for key in ("temporary_bytes", "alloc_calls", "peak_extra_bytes", "theory_pristine_bytes",
                    "collective_ops", "wire_bytes", "nccl_model_temporary_bytes",
                    "profiler_alloc_bytes"):  # fmt: skip
            rec[f"all_ranks_{key}"] = [p[key] for p in peers]
        out.append(rec)
    return out


class _Channel:
    """Rank 0's line-delimited JSON connection to the driver (a TCP socket)."""

    def __init__(self, address: str, timeout_s: float):
        host, port = address.rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)), timeout=timeout_s)
        self.sock.settimeout(None)
        self.file = self.sock.makefile("rw")

    def send(self, obj) -> None:
        self.file.write(json.dumps(obj) + "\n")
        self.file.flush()

    def recv(self):
        line = self.file.readline()
        if not line:
            raise ConnectionError("driver closed the connection")
        return json.loads(line)


def serve(cases, channel) -> None:
    """Answer the driver's timing requests until {"op": "quit"} (see module docstring)."""
    rank = dist.get_rank()
    while True:
        box = [channel.recv() if rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        cmd = box[0]
        if cmd["op"] == "quit":
            return
        if cmd["op"] != "time":
            raise ValueError(f"unknown command {cmd!r}")
        s, path = cases[cmd["case"]]
        with cpu_runtime.device_mapping_suspended():
            mine = time_block(s, path, int(cmd["n"]))
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        if rank == 0:
            channel.send({"times_s": [max(ts) for ts in zip(*everyone)]})


def main_real(args, mc, tree_dir: str) -> None:
    dist.init_process_group(backend="gloo")
    mc["ps"].initialize_model_parallel(create_gloo_process_groups=False)
    mc["seed"](1234)
    channel = _Channel(args.serve, 120) if dist.get_rank() == 0 else None
    cases, records = build_cases(mc, dist.get_world_size(), dist.get_rank())
    records = _merge_ranks(records)
    if channel is not None:
        channel.send({"records": [dict(rec, tree=args.tree, tree_dir=tree_dir) for rec in records]})
    serve(cases, channel)
    dist.barrier()
    mc["ps"].destroy_model_parallel()
    dist.destroy_process_group()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--serve", required=True, help="HOST:PORT of the driver: records, then timing")
    ap.add_argument("--tree", required=True, help="label stored in each record")
    args = ap.parse_args(argv)
    tree_dir = check_expected_tree()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    main_real(args, mc=_megatron(), tree_dir=tree_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
