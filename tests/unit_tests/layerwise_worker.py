"""Multi-rank worker for test_layerwise_param_sync.py: real megatron-core objects on gloo.

Run under torchrun, one process per DP rank, with the tree under test first on
PYTHONPATH and MEGATRON_CPU_RUNTIME=1 on CPU (harness.launch.torchrun_command):

    python -m harness.launch --tree patched --nproc 2 script tests/unit_tests/layerwise_worker.py \
        -- --out R.json --scenarios gather,microbatches,...

The model is built the way megatron.training builds it: a MegatronModule wrapped in
megatron.core's DistributedDataParallel (so `param.main_grad` IS a view into the
bucket's `grad_data`, never a clone) and the layer-wise optimizer from
get_megatron_muon_optimizer(..., layer_wise_distributed_optimizer=True).

Each scenario returns a dict of checks. A check is a boolean computed on every rank and
reduced with MIN (all ranks must agree), plus numbers for the report. Rank 0 writes
{scenario: {check: value}} to --out; a scenario that raises on every rank records
{"error": "<type>: <message>"} instead, so that the pristine tree's crashes are data. One
that raises on some ranks only ends the job (exit 1) with the first failing rank's
traceback on stderr (harness.ranks.Outcomes). Rank 0 prints a progress line per scenario.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import logging
import os
import sys
import time

from harness import cpu_runtime

cpu_runtime.install_if_requested()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from harness.alloc_counter import AllocationCounter  # noqa: E402
from harness.bench.theory import theory_upstream_bytes  # noqa: E402
from harness.ranks import Outcomes, exit_rank  # noqa: E402
from harness.trees import check_expected_tree  # noqa: E402

GARBAGE = -777.0  # what non-owned params hold before a gather ("stale")
IN_DIM = 16
# Linear layer widths: uneven param counts, so that per-rank shares differ.
WIDTHS = [IN_DIM, 24, 8, 40, 12, 16]
# Identical layers: the layer-wise optimizer's shares come out equal in a single bucket
# (2 or 4 ranks), as for a GPT's identical transformer layers.
EQUAL_WIDTHS = [IN_DIM] * 5


def _megatron():
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.optimizer.muon import get_megatron_muon_optimizer
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.module import MegatronModule

    return (
        parallel_state,
        DistributedDataParallel,
        DistributedDataParallelConfig,
        OptimizerConfig,
        get_megatron_muon_optimizer,
        TransformerConfig,
        MegatronModule,
    )


(
    parallel_state,
    DDP,
    DDPConfig,
    OptimizerConfig,
    get_megatron_muon_optimizer,
    TransformerConfig,
    MegatronModule,
) = _megatron()


class TinyNet(MegatronModule):
    """Stack of Linear layers (+ optional expert-parallel layer), tanh in between.

    Params: Linear(WIDTHS[i], WIDTHS[i+1]) weights and biases; with `expert=True` one
    more Linear(16, 16) whose params carry `allreduce=False`, which megatron's DDP puts
    in the expert-parallel buffers (reduced over the expert-DP group).
    """

    def __init__(self, config, expert: bool = False, widths=WIDTHS):
        super().__init__(config=config)
        self.layers = torch.nn.ModuleList(
            torch.nn.Linear(a, b) for a, b in zip(widths[:-1], widths[1:])
        )
        self.experts = torch.nn.Linear(widths[-1], widths[-1]) if expert else None
        if self.experts is not None:
            for p in self.experts.parameters():
                p.allreduce = False

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        if self.experts is not None:
            x = self.experts(x)
        return x


class Setup:
    """One DDP-wrapped TinyNet and its LayerWiseDistributedOptimizer."""

    def __init__(
        self, dtype, fp32_grad, overlap, bucket_size=None, expert=False, seed=1234, widths=WIDTHS
    ):
        torch.manual_seed(seed)
        bf16 = dtype == torch.bfloat16
        self.config = TransformerConfig(
            num_layers=1,
            hidden_size=IN_DIM,
            num_attention_heads=1,
            params_dtype=dtype,
            bf16=bf16,
            use_cpu_initialization=True,
        )
        module = TinyNet(self.config, expert=expert, widths=widths)
        if bf16:
            module = module.bfloat16()
        self.dtype = dtype
        ddp_config = DDPConfig(
            grad_reduce_in_fp32=fp32_grad,
            overlap_grad_reduce=True,
            overlap_param_gather=overlap,
            use_distributed_optimizer=False,
            bucket_size=bucket_size,
        )
        self.ddp = DDP(self.config, ddp_config, module)
        opt_config = OptimizerConfig(
            optimizer='muon',
            lr=0.02,
            weight_decay=0.01,
            bf16=bf16,
            params_dtype=dtype,
            use_distributed_optimizer=False,
            overlap_param_gather=overlap,
            clip_grad=1.0,
            log_num_zeros_in_grad=True,
        )
        self.opt = get_megatron_muon_optimizer(
            opt_config, [self.ddp], layer_wise_distributed_optimizer=True
        )
        self.params = list(self.ddp.module.parameters())
        self.index = {p: i for i, p in enumerate(self.params)}
        dp_rank = parallel_state.get_data_parallel_rank()
        owners = self.opt.dp_cp_params_list
        self.owned = (
            set(self.params)
            if owners is None
            else set(owners[dp_rank]) | {p for p in self.params if getattr(p, 'allreduce', True) is False}
        )

    @property
    def bucket_groups(self):
        return self.ddp.bucket_groups + self.ddp.expert_parallel_bucket_groups

    def grad_datas(self):
        return [b.grad_data for g in self.bucket_groups for b in g.buckets]

    def target(self, p, step):
        """Deterministic value of param p after "step" (same on every rank)."""
        gen = torch.Generator().manual_seed(10_000 * step + self.index[p])
        return torch.randn(p.shape, generator=gen).to(self.dtype)

    def simulate_step(self, step, grad_fill=None):
        """State right after an optimizer step: owners hold the new value, others stale.

        grad_fill: if not None, fill grad_data with it (grads the step just consumed).
        """
        with torch.no_grad():
            for p in self.params:
                if p in self.owned:
                    p.copy_(self.target(p, step))
                else:
                    p.fill_(GARBAGE)
            if grad_fill is not None:
                for g in self.grad_datas():
                    g.fill_(grad_fill)

    def params_equal_targets(self, step):
        return all(torch.equal(p.detach(), self.target(p, step)) for p in self.params)

    def set_all_targets(self, step):
        with torch.no_grad():
            for p in self.params:
                p.copy_(self.target(p, step))

    def batch(self, step, mb):
        rank = dist.get_rank()
        gen = torch.Generator().manual_seed(100 + 7 * rank + 1000 * step + 31 * mb)
        return torch.randn(4, IN_DIM, generator=gen).to(self.dtype)

    def forward_backward(self, step, n_microbatches):
        """Megatron's order: forward+backward per microbatch, no_sync for all but the last."""
        for mb in range(n_microbatches):
            ctx = self.ddp.no_sync() if mb < n_microbatches - 1 else contextlib.nullcontext()
            with ctx:
                out = self.ddp(self.batch(step, mb))
                out.float().pow(2).mean().backward()
        self.ddp.finish_grad_sync()

    def main_grads(self):
        return [p.main_grad.detach().clone() for p in self.params]


def all_ranks(flag: bool) -> bool:
    t = torch.tensor([1 if flag else 0], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def max_abs_diff(xs, ys):
    d = max(((x.float() - y.float()).abs().max().item() for x, y in zip(xs, ys)), default=0.0)
    t = torch.tensor([d], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def grads_all_zero(s):
    return all_ranks(all(int(torch.count_nonzero(g)) == 0 for g in s.grad_datas()))


def written_region_zero(s, rest):
    """After a sync into grad_data that held `rest`: in every bucket the grad_data
    elements the gather wrote (its plan's slots and padding) are zero and the others
    still hold `rest`. False on a tree without a gather plan (pristine)."""
    ok = True
    for g in s.bucket_groups:
        for bk in g.buckets:
            if not hasattr(bk, "layerwise_gather_plan"):
                return all_ranks(False)
            plan = bk.layerwise_gather_plan
            if plan is None:  # nothing to gather in this bucket
                ok &= bool(torch.all(bk.grad_data == rest))
                continue
            nbytes = plan.written_numel * bk.params_list[0].dtype.itemsize
            n = -(-nbytes // bk.grad_data.element_size())
            ok &= int(torch.count_nonzero(bk.grad_data[:n])) == 0
            ok &= bool(torch.all(bk.grad_data[n:] == rest))
    return all_ranks(ok)


# ---------------------------------------------------------------------------- scenarios
def sc_gather(dtype, fp32_grad, bucket_size):
    """Forward pre-hooks gather owners' values; grad_data zero before backward; main_grad
    after backward equals the same model with overlap off."""
    a = Setup(dtype, fp32_grad, overlap=True, bucket_size=bucket_size)
    b = Setup(dtype, fp32_grad, overlap=False, bucket_size=bucket_size)
    a.ddp.zero_grad_buffer()
    b.ddp.zero_grad_buffer()
    a.simulate_step(step=1)
    b.set_all_targets(step=1)
    empty_slot_buckets = 0
    for g in a.ddp.bucket_groups:
        for bk in g.buckets:
            if bk.layerwise_param_flat_sizes and 0 in bk.layerwise_param_flat_sizes:
                empty_slot_buckets += 1
    # Forward of microbatch 1 runs every pre-hook; check right after it, before backward.
    out = a.ddp(a.batch(1, 0))
    params_ok = all_ranks(a.params_equal_targets(1))
    grad_zero = grads_all_zero(a)
    out.float().pow(2).mean().backward()
    a.ddp.finish_grad_sync()
    b.forward_backward(1, 1)
    diff = max_abs_diff(a.main_grads(), b.main_grads())
    return {
        "params_equal_owner_values": params_ok,
        "grad_data_zero_after_gather": grad_zero,
        "main_grad_equals_overlap_off": all_ranks(diff == 0.0),
        "main_grad_max_abs_diff": diff,
        "num_buckets": sum(len(g.buckets) for g in a.ddp.bucket_groups),
        "buckets_with_empty_rank_slot": empty_slot_buckets,
    }


def sc_microbatches(dtype, fp32_grad, bucket_size):
    """Grads over 1, 2, 4 microbatches: equal to overlap off (bitwise) and to the sum of
    per-microbatch grads (fp32 rounding tolerance)."""
    res = {}
    for n in (1, 2, 4):
        a = Setup(dtype, fp32_grad, overlap=True, bucket_size=bucket_size)
        b = Setup(dtype, fp32_grad, overlap=False, bucket_size=bucket_size)
        a.ddp.zero_grad_buffer()
        a.simulate_step(step=2)
        a.forward_backward(2, n)
        b.set_all_targets(step=2)
        b.ddp.zero_grad_buffer()
        b.forward_backward(2, n)
        b_accumulated = b.main_grads()
        per_mb_sum = [torch.zeros_like(g, dtype=torch.float64) for g in b.main_grads()]
        for mb in range(n):
            b.ddp.zero_grad_buffer()
            out = b.ddp(b.batch(2, mb))
            out.float().pow(2).mean().backward()
            b.ddp.finish_grad_sync()
            for acc, g in zip(per_mb_sum, b.main_grads()):
                acc += g.double()
        exact = max_abs_diff(a.main_grads(), b_accumulated)
        vs_sum = max_abs_diff([g.double() for g in a.main_grads()], per_mb_sum)
        scale = max(float(x.abs().max()) for x in per_mb_sum)
        res[f"mb{n}_equals_overlap_off"] = all_ranks(exact == 0.0)
        res[f"mb{n}_max_abs_diff"] = exact
        res[f"mb{n}_equals_sum_of_microbatches"] = all_ranks(vs_sum <= 1e-5 * max(scale, 1.0))
        res[f"mb{n}_sum_max_abs_diff"] = vs_sum
    return res


def train_overlap_and_sync(dtype, fp32_grad, bucket_size, steps, expert=False):
    """Train the same model `steps` real optimizer steps twice: with the overlapped
    (pre-hook) gather and with the optimizer's synchronous gather.

    Returns:
        (overlap Setup, its grad norms, sync Setup, its grad norms, max |param diff|).
    """
    runs = {}
    for name, overlap in (("overlap", True), ("sync", False)):
        s = Setup(dtype, fp32_grad, overlap=overlap, bucket_size=bucket_size, expert=expert)
        norms = []
        for step in range(steps):
            s.ddp.zero_grad_buffer()
            s.opt.zero_grad()
            s.forward_backward(step, 2)
            norms.append(float(s.opt.step()[1]))
        if overlap:  # the last update is gathered by the next forward's pre-hooks
            s.ddp.start_param_sync(force_sync=True)
        runs[name] = (s, norms)
    (a, na), (b, nb) = runs["overlap"], runs["sync"]
    diff = max_abs_diff([p.detach() for p in a.params], [p.detach() for p in b.params])
    return a, na, b, nb, diff


def sc_training(dtype, fp32_grad, bucket_size, steps=4):
    """Real optimizer steps: overlapped (pre-hook) gather vs the optimizer's synchronous
    gather; params and grad norms bitwise equal, params equal on every rank."""
    a, na, b, nb, diff = train_overlap_and_sync(dtype, fp32_grad, bucket_size, steps)
    # Every rank must hold the same params after the gather.
    same = True
    for p in a.params:
        ref = p.detach().clone()
        dist.broadcast(ref, src=0)
        same &= torch.equal(ref, p.detach())
    return {
        "params_overlap_equal_sync": all_ranks(diff == 0.0),
        "params_max_abs_diff": diff,
        "grad_norms_equal": all_ranks(na == nb),
        "grad_norms_overlap": na,
        "grad_norms_sync": nb,
        "params_equal_across_ranks": all_ranks(same),
        # Bitwise fingerprints, compared by the test with the pristine tree's run.
        "params_sha256_overlap": params_sha256(a.params),
        "params_sha256_sync": params_sha256(b.params),
    }


def params_sha256(params):
    """sha256 of every param's bytes in order (this rank; ranks hold equal params)."""
    h = hashlib.sha256()
    for p in params:
        h.update(p.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def sc_forced_sync(dtype, fp32_grad, bucket_size):
    """Forced sync (eval / checkpoint): with no gather pending, and with one pending."""
    s = Setup(dtype, fp32_grad, overlap=True, bucket_size=bucket_size)
    res = {}
    # (a) nothing pending: disable_forward_pre_hook(param_sync=True), as at eval.
    s.ddp.zero_grad_buffer()
    s.simulate_step(step=3, grad_fill=0.5)
    s.ddp.disable_forward_pre_hook(param_sync=True)
    res["idle_params_synced"] = all_ranks(s.params_equal_targets(3))
    res["idle_written_region_zero_rest_untouched"] = written_region_zero(s, rest=0.5)
    s.ddp.enable_forward_pre_hook()
    s.ddp.zero_grad_buffer()
    with cpu_runtime.record_collectives() as gathers:
        out = s.ddp(s.batch(3, 0))
    res["no_regather_after_forced_sync"] = all_ranks(len(gathers) == 0)
    res["params_still_synced_after_forward"] = all_ranks(s.params_equal_targets(3))
    out.float().pow(2).mean().backward()
    s.ddp.finish_grad_sync()
    # Next step: the next forward must gather again (not skip a needed gather).
    s.ddp.zero_grad_buffer()
    s.simulate_step(step=4)
    out = s.ddp(s.batch(4, 0))
    res["next_step_gathers_fresh_values"] = all_ranks(s.params_equal_targets(4))
    out.float().pow(2).mean().backward()
    s.ddp.finish_grad_sync()
    # (b) a gather pending: dispatch async, then force.
    s.ddp.zero_grad_buffer()
    s.simulate_step(step=5)
    for g in s.ddp.bucket_groups:
        g.start_param_sync()
    for g in s.ddp.bucket_groups:
        g.start_param_sync(force_sync=True)
    res["pending_params_synced"] = all_ranks(s.params_equal_targets(5))
    res["pending_grad_data_zero"] = grads_all_zero(s)
    with cpu_runtime.record_collectives() as gathers:
        out = s.ddp(s.batch(5, 0))
    res["pending_no_regather_in_forward"] = all_ranks(len(gathers) == 0)
    res["pending_params_synced_after_forward"] = all_ranks(s.params_equal_targets(5))
    return res


def sc_free_overlap_buffers(dtype, fp32_grad, bucket_size):
    """free_overlap_buffers() (checkpoint save) with a gather pending."""
    s = Setup(dtype, fp32_grad, overlap=True, bucket_size=bucket_size)
    s.ddp.zero_grad_buffer()
    s.simulate_step(step=6)
    s.ddp.start_param_sync()  # async dispatch of every bucket group
    s.ddp.free_overlap_buffers()
    res = {
        "params_synced": all_ranks(s.params_equal_targets(6)),
        "grad_data_zero": grads_all_zero(s),
    }
    with cpu_runtime.record_collectives() as gathers:
        s.ddp(s.batch(6, 0))
    res["no_regather_in_forward"] = all_ranks(len(gathers) == 0)
    res["params_synced_after_forward"] = all_ranks(s.params_equal_targets(6))
    return res


def sc_offload(dtype, fp32_grad, bucket_size):
    """offload_grad_buffers() -> forced sync -> restore_grad_buffers(): falls back to a
    temporary receive buffer (warned once per bucket), never writes freed storage."""
    s = Setup(dtype, fp32_grad, overlap=True, bucket_size=bucket_size)
    s.ddp.zero_grad_buffer()
    s.simulate_step(step=7)
    s.ddp.offload_grad_buffers(synchronize=False, empty_cache=False)
    records = []

    class Grab(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    handler = Grab()
    lg = logging.getLogger("megatron.core.distributed.param_and_grad_buffer")
    lg.addHandler(handler)
    try:
        s.ddp.start_param_sync(force_sync=True)
        s.ddp.start_param_sync(force_sync=True)
    finally:
        lg.removeHandler(handler)
    still_freed = all(g.untyped_storage().nbytes() == 0 for g in s.grad_datas())
    synced = s.params_equal_targets(7)
    s.ddp.restore_grad_buffers(synchronize=False)
    n_buckets = sum(
        1
        for g in s.ddp.bucket_groups
        for b in g.buckets
        if b.layerwise_param_flat_sizes and sum(b.layerwise_param_flat_sizes) > 0
    )
    warnings = [r for r in records if "cannot serve as the receive buffer" in r]
    # After restore, a normal step must give the same grads as overlap off.
    b = Setup(dtype, fp32_grad, overlap=False, bucket_size=bucket_size)
    b.set_all_targets(7)
    s.ddp.zero_grad_buffer()
    b.ddp.zero_grad_buffer()
    s.forward_backward(7, 1)
    b.forward_backward(7, 1)
    diff = max_abs_diff(s.main_grads(), b.main_grads())
    return {
        "params_synced": all_ranks(synced),
        "storage_stayed_freed": all_ranks(still_freed),
        "fallback_warned_once_per_bucket": all_ranks(len(warnings) == n_buckets),
        "fallback_warnings": len(warnings),
        "main_grad_after_restore_equals_overlap_off": all_ranks(diff == 0.0),
    }


def _theory_bytes(s, buckets):
    """theory_upstream_bytes summed over `buckets` (per-rank lists set by the optimizer)."""
    rank = parallel_state.get_data_parallel_rank()
    return sum(
        theory_upstream_bytes(bk.layerwise_params_list, rank, bk.params_list[0].dtype.itemsize)
        for bk in buckets
        if bk.layerwise_params_list is not None
    )


def _collective_summary(path, calls):
    """The collective model's numbers for one path (harness.cpu_runtime.collectives)."""
    return {
        f"{path}_nccl_model_temporary_bytes": sum(c.nccl_temporary_bytes for c in calls),
        f"{path}_collective_launches": sum(c.ops for c in calls),
        f"{path}_collective_forms": sorted({c.form for c in calls}),
    }


def sync_bucket_groups(s, path: str) -> None:
    """One layer-wise param sync of every bucket group of `s.ddp`: "async" is the forward
    pre-hook pair (start_param_sync, then finish_param_sync without chaining), "forced"
    is start_param_sync(force_sync=True) as at eval and checkpoint save."""
    for g in s.ddp.bucket_groups:
        if path == "async":
            g.start_param_sync()
            g.finish_param_sync(skip_next_bucket_dispatch=True)
        else:
            g.start_param_sync(force_sync=True)

def sc_alloc(dtype, fp32_grad, bucket_size):
    """Bytes allocated by the layer-wise param sync (TorchDispatchMode counter)."""
    res = {}
    s = Setup(dtype, fp32_grad, overlap=True, bucket_size=bucket_size)
    buckets = [b for g in s.ddp.bucket_groups for b in g.buckets]
    res["theory_upstream_bytes"] = _theory_bytes(s, buckets)
    # Control: the CPU runtime layer's uneven all_gather alone allocates nothing.
    sizes = [3 + r for r in range(dist.get_world_size())]
    buf = torch.zeros(sum(sizes), dtype=dtype)
    slots = list(buf.split(sizes))
    with AllocationCounter() as c:
        dist.all_gather(slots, slots[dist.get_rank()])
        dist.all_gather(slots, slots[dist.get_rank()], async_op=True).wait()
    res["runtime_layer_all_gather_bytes"] = c.temporary_bytes
    for path in ("async", "forced"):
        s.ddp.zero_grad_buffer()
        s.simulate_step(step=8)
        with AllocationCounter() as c, cpu_runtime.record_collectives() as calls:
            sync_bucket_groups(s, path)
        res[f"{path}_bytes"] = c.temporary_bytes
        res[f"{path}_alloc_calls"] = c.alloc_calls
        res.update(_collective_summary(path, calls))
        res[f"{path}_params_synced"] = all_ranks(s.params_equal_targets(8))
        for g in s.ddp.bucket_groups:
            g.param_gather_dispatched = False
    # The optimizer's synchronous path (no overlap).
    o = Setup(dtype, fp32_grad, overlap=False, bucket_size=bucket_size)
    o.simulate_step(step=9)
    with AllocationCounter() as c, cpu_runtime.record_collectives() as calls:
        o.opt.allgather_params()
    res["optimizer_bytes"] = c.temporary_bytes
    res.update(_collective_summary("optimizer", calls))
    res["optimizer_alloc_calls"] = c.alloc_calls
    res["optimizer_params_synced"] = all_ranks(o.params_equal_targets(9))
    owners = o.opt.dp_cp_params_list
    res["theory_upstream_optimizer_bytes"] = (
        0
        if owners is None
        else theory_upstream_bytes(
            owners, parallel_state.get_data_parallel_rank(), o.params[0].dtype.itemsize
        )
    )
    return res


class CollectiveSpy:
    """Records each all_gather / all_gather_into_tensor call: its name and whether its
    output (every slot of a list output) and input lie inside `storages` (untyped
    storages, e.g. the buckets' grad_data). The calls go through unchanged."""

    NAMES = ("all_gather", "all_gather_into_tensor")

    def __init__(self, storages):
        self.ranges = [(s.data_ptr(), s.data_ptr() + s.nbytes()) for s in storages]
        self.calls = []

    def inside(self, t):
        return any(
            lo <= t.data_ptr() and t.data_ptr() + t.numel() * t.element_size() <= hi
            for lo, hi in self.ranges
        )

    def __enter__(self):
        self._orig = {n: getattr(dist, n) for n in self.NAMES}

        def spy(name, orig):
            def fn(output, inp, *a, **k):
                outs = list(output) if isinstance(output, (list, tuple)) else [output]
                # An empty tensor has no address (data_ptr() is 0): nothing to check.
                aliased = all(self.inside(t) for t in outs + [inp] if t.numel())
                self.calls.append((name, aliased))
                return orig(output, inp, *a, **k)

            return fn

        for n, orig in self._orig.items():
            setattr(dist, n, spy(n, orig))
        return self

    def __exit__(self, *exc):
        for n, orig in self._orig.items():
            setattr(dist, n, orig)


def expected_collective(bucket, dp_size):
    """The collective the series' rule gives a bucket (None: nothing to gather), from its
    per-rank shares and grad_data size: equal shares -> all_gather_into_tensor; unequal
    -> padded all_gather_into_tensor when dp x max(share) fits in grad_data viewed as the
    param dtype (these models' padding is far below the (dp - 1) MiB bound), else the
    list all_gather."""
    if dp_size == 1 or bucket.layerwise_params_list is None:
        return None
    shares = [sum(p.numel() for p in ps) for ps in bucket.layerwise_params_list]
    if sum(shares) == 0:
        return None
    if min(shares) == max(shares):
        return "all_gather_into_tensor"
    g = bucket.grad_data
    capacity = g.numel() * g.element_size() // bucket.params_list[0].dtype.itemsize
    return "all_gather_into_tensor" if dp_size * max(shares) <= capacity else "all_gather"


def sc_collectives(dtype, fp32_grad, bucket_size):
    """Which collective each path calls per bucket, and that it writes into grad_data:
    the async (pre-hook) path, the forced sync and the optimizer's synchronous gather, on
    the uneven model and on one of identical layers (equal shares)."""
    res = {}
    dp = parallel_state.get_data_parallel_world_size()
    for model, widths in (("uneven", WIDTHS), ("equal", EQUAL_WIDTHS)):
        for path in ("async", "forced", "optimizer"):
            s = Setup(
                dtype,
                fp32_grad,
                overlap=path != "optimizer",
                bucket_size=bucket_size,
                widths=widths,
            )
            s.ddp.zero_grad_buffer()
            s.simulate_step(step=11)
            buckets = [b for g in s.ddp.bucket_groups for b in g.buckets]
            expected = [e for e in (expected_collective(b, dp) for b in buckets) if e]
            storages = {id(st): st for st in (g.untyped_storage() for g in s.grad_datas())}
            with CollectiveSpy(storages.values()) as spy:
                if path == "optimizer":
                    s.opt.allgather_params()
                else:
                    sync_bucket_groups(s, path)
            key = f"{model}_{path}"
            names = [n for n, _ in spy.calls]
            res[f"{key}_collectives_as_rule"] = all_ranks(names == expected)
            res[f"{key}_outputs_alias_grad_data"] = all_ranks(all(a for _, a in spy.calls))
            res[f"{key}_params_synced"] = all_ranks(s.params_equal_targets(11))
            res[f"{key}_calls"] = names
            res[f"{key}_buckets"] = len(buckets)
    return res


def sc_small_dp(dtype, fp32_grad, bucket_size, expert=False):
    """DP size 1 (run with one rank) or expert-DP size 1 (expert=True, EP = world): the
    optimizer builds, training runs, params match the synchronous path."""
    _, na, _, nb, diff = train_overlap_and_sync(dtype, fp32_grad, bucket_size, 3, expert)
    return {
        "trains": True,
        "params_overlap_equal_sync": all_ranks(diff == 0.0),
        "grad_norms_equal": all_ranks(na == nb),
    }


SCENARIOS = {
    "gather": sc_gather,
    "microbatches": sc_microbatches,
    "training": sc_training,
    "forced_sync": sc_forced_sync,
    "free_overlap_buffers": sc_free_overlap_buffers,
    "offload": sc_offload,
    "alloc": sc_alloc,
    "collectives": sc_collectives,
    "small_dp": sc_small_dp,
    "expert_dp1": lambda *a: sc_small_dp(*a, expert=True),
}

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
#: "<scenario>:<rank>" makes that rank raise at the start of that scenario (tests of the
#: failure handling: the other ranks are then inside the scenario's collectives).
FAIL_ENV = "LAYERWISE_WORKER_FAIL"
#: Rank 0 prints "<PROGRESS> <config>/<scenario> <monotonic s>" after each scenario.
PROGRESS = "[layerwise_worker] done"


def _forced_failure():
    """(scenario, rank) from $LAYERWISE_WORKER_FAIL, or None."""
    value = os.environ.get(FAIL_ENV)
    if not value:
        return None
    name, _, rank = value.partition(":")
    return name, int(rank)


def worker_arg_parser(doc: str, out_help: str, scenarios, default_configs: str) -> argparse.ArgumentParser:
    """The command line shared by the rank workers: --out, --scenarios, --configs."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--out", required=True, help=out_help)
    ap.add_argument("--scenarios", default=",".join(scenarios))
    ap.add_argument("--configs", default=default_configs,
                    help="comma list of <bf16|fp32>-<fp32grad|samegrad>-<many|one> "
                    "(many: about one param per bucket, one: a single bucket)")
    return ap


def main(argv=None):
    ap = worker_arg_parser(__doc__, "JSON results path (written by rank 0)", SCENARIOS,
                           "bf16-fp32grad-many,fp32-fp32grad-one")
    ap.add_argument("--expert-parallel", type=int, default=1)
    args = ap.parse_args(argv)

    dist.init_process_group(backend="gloo")
    tree = check_expected_tree()
    parallel_state.initialize_model_parallel(expert_model_parallel_size=args.expert_parallel)
    results = {"_meta": {"tree": tree, "world_size": dist.get_world_size()}}
    # A scenario that raises on every rank is data (the pristine tree crashes where the
    # series fixes it); one that raises on some ranks only ends the job with that rank's
    # traceback (harness.ranks.Outcomes) instead of hanging in a collective.
    outcomes = Outcomes(prefix="layerwise_worker")
    forced = _forced_failure()
    for cfg in args.configs.split(","):
        dname, gname, bname = cfg.split("-")
        dtype = DTYPES[dname]
        fp32_grad = gname == "fp32grad"
        # "many": ~one param per bucket (also buckets where a rank owns nothing).
        bucket_size = 1 if bname == "many" else None
        for name in args.scenarios.split(","):
            key = f"{cfg}/{name}"
            with outcomes.step(key) as step:
                if forced == (name, dist.get_rank()):
                    raise RuntimeError(f"forced failure of {key} on rank {dist.get_rank()} ({FAIL_ENV})")
                step.result = SCENARIOS[name](dtype, fp32_grad, bucket_size)
            results[key] = step.result
            if dist.get_rank() == 0:
                print(f"{PROGRESS} {key} {time.monotonic():.3f}", flush=True)
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1, sort_keys=True)
    dist.barrier()
    exit_rank(0)


if __name__ == "__main__":
    sys.exit(main())
