"""Multi-rank worker for test_layerwise_param_sync.py: real megatron-core objects on gloo.

Run under torchrun, one process per DP rank, with the tree under test first on
PYTHONPATH and MEGATRON_CPU_RUNTIME=1 on CPU (harness.launch.torchrun_command):

    python -m harness.launch --tree series-0.17.1 --nproc 2 script tests/unit_tests/layerwise_worker.py \
        -- --out R.json --scenarios gather,microbatches,...

The model is built the way megatron.training builds it: a MegatronModule wrapped in
megatron.core's DistributedDataParallel (so `param.main_grad` IS a view into the
bucket's `grad_data`, never a clone) and the layer-wise optimizer from
harness.layerwise_optimizer (get_megatron_muon_optimizer(..., layer_wise_distributed_optimizer=True)
on 0.17.1, get_megatron_optimizer with use_layer_wise_distributed_optimizer on 0.19).

A config is "<dtype>-<grad>-<model>": dtype bf16 or fp32 params; grad fp32grad (fp32
grad_data) or samegrad (grad_data in the param dtype: exactly the receive size); model one
of MODELS (layer widths and DDP bucket size), chosen for the share patterns the
layer-wise optimizer's sharding gives their buckets (see MODELS).

Each scenario returns a dict of checks. A check is a boolean computed on every rank and
reduced with MIN (all ranks must agree), plus numbers for the report. Rank 0 writes
{"<config>/<scenario>": {check: value}} to --out; a scenario that raises on every rank
records {"error": "<type>: <message>"} instead, so that the pristine tree's crashes are
data. One that raises on some ranks only ends the job (exit 1) with the first failing
rank's traceback on stderr (harness.ranks.Outcomes). Rank 0 prints a progress line per
scenario. The "collectives" and "share_patterns" scenarios build their own models
(COLLECTIVE_MODELS; ShareNet) and run once per job, as "models/<scenario>"."""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import itertools
import json
import os
import sys
import time
from typing import NamedTuple, Optional, Tuple

from harness import cpu_runtime

cpu_runtime.install_if_requested()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from harness.alloc_counter import AllocationCounter  # noqa: E402
from harness.cpu_runtime import collectives  # noqa: E402
from harness.layerwise_optimizer import layerwise_muon_optimizer  # noqa: E402
from harness.bench.theory import theory_upstream_bytes  # noqa: E402
from harness.ranks import Outcomes, exit_rank  # noqa: E402
from harness.trees import check_expected_tree  # noqa: E402
from megatron.core import parallel_state  # noqa: E402
from megatron.core.distributed import DistributedDataParallel as DDP  # noqa: E402
from megatron.core.distributed import DistributedDataParallelConfig as DDPConfig  # noqa: E402
from megatron.core.optimizer import OptimizerConfig  # noqa: E402
from megatron.core.transformer import TransformerConfig  # noqa: E402
from megatron.core.transformer.module import MegatronModule  # noqa: E402

GARBAGE = -777.0  # what non-owned params hold before a gather ("stale")
IN_DIM = 16
# Linear layer widths: uneven param counts, so that per-rank shares differ.
WIDTHS = [IN_DIM, 24, 8, 40, 12, 16]
# Identical layers: the layer-wise optimizer's shares come out equal in a single bucket
# (2 or 4 ranks), as for a GPT's identical transformer layers.
EQUAL_WIDTHS = [IN_DIM] * 5
# Found by a search over small chains: with 408-element buckets, at DP 2 one bucket has
# equal shares and the others unequal ones, with single-param and multi-param owners and
# empty owners, never two multi-param owners in one bucket, and equal whole-model shares;
# at DP 4 singles, empties and a bucket with two multi-param owners (printed per bucket by
# sc_gather's report).
MIXED_WIDTHS = [IN_DIM, 16, 16, 24, 16, 24, 16]
#: model name -> (layer widths, DDP bucket size in elements; None: one bucket).
MODELS = {
    "many": (WIDTHS, 1),  # one param per bucket: single-param owners and empty owners only
    "layers": (WIDTHS, 200),  # one bucket per layer (its own bucket group)
    "one": (WIDTHS, None),  # one bucket, every owner holds several params, shares unequal
    "mixed": (MIXED_WIDTHS, 408),
    "equal": (EQUAL_WIDTHS, None),  # one bucket, equal shares at DP 2 and 4
}
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
#: The models the "collectives" scenario checks, every path: each form occurs (equal
#: shares, unequal ones with empty, single-param and multi-param owners), in fp32 grad_data
#: with room to spare and in bf16 grad_data of exactly the receive size.
COLLECTIVE_MODELS = {
    "mixed": "bf16-fp32grad-mixed",
    "one": "bf16-fp32grad-one",
    "one_samegrad": "bf16-samegrad-one",
    "equal": "fp32-fp32grad-equal",
}


class Config(NamedTuple):
    """A parsed "<dtype>-<grad>-<model>" config."""

    name: str
    dtype: torch.dtype
    fp32_grad: bool
    widths: Tuple[int, ...]
    bucket_size: Optional[int]


def parse_config(name: str) -> Config:
    """Raises ValueError (naming the choices) for an unknown part."""
    try:
        dname, gname, model = name.split("-")
        widths, bucket_size = MODELS[model]
        if gname not in ("fp32grad", "samegrad"):
            raise KeyError(gname)
        return Config(name, DTYPES[dname], gname == "fp32grad", tuple(widths), bucket_size)
    except (ValueError, KeyError):
        raise ValueError(
            f"config {name!r}: expected <{'|'.join(DTYPES)}>-<fp32grad|samegrad>-<{'|'.join(MODELS)}>"
        ) from None


def tiny_config(dtype, **kwargs):
    """The TransformerConfig every model here is built with (params of `dtype`, on CPU)."""
    return TransformerConfig(num_layers=1, hidden_size=IN_DIM, num_attention_heads=1, params_dtype=dtype,
                             bf16=dtype == torch.bfloat16, use_cpu_initialization=True, **kwargs)


class TinyNet(MegatronModule):
    """Stack of Linear layers (+ optional expert-parallel layer), tanh in between.

    Params: Linear(widths[i], widths[i+1]) weights and biases; with `expert=True` one
    more Linear(widths[-1], widths[-1]) whose params carry `allreduce=False`, which
    megatron's DDP puts in the expert-parallel buffers (reduced over the expert-DP group).
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
        for layer in self.layers:  # .to(): a no-op unless a layer was kept in another dtype
            x = torch.tanh(layer(x.to(layer.weight.dtype)))
        if self.experts is not None:
            x = self.experts(x)
        return x


class Setup:
    """One DDP-wrapped TinyNet of config `cfg` and its LayerWiseDistributedOptimizer."""

    def __init__(self, cfg: Config, overlap, expert=False, seed=1234, overlap_grad_reduce=True,
                 fp32_last_layer=False, tc_kwargs=None):
        """fp32_last_layer: keep the last Linear in fp32 (two grad buffers, bf16 and fp32
        params) and build DDP with disable_bucketing=True, as megatron.training does for
        every model chunk after the first with VPP: partition_buckets() then puts both
        buffers' buckets into one bucket group. tc_kwargs: more TransformerConfig kwargs
        (e.g. CUDA graph settings)."""
        torch.manual_seed(seed)
        dtype = cfg.dtype
        bf16 = dtype == torch.bfloat16
        self.config = tiny_config(dtype, **(tc_kwargs or {}))
        module = TinyNet(self.config, expert=expert, widths=cfg.widths)
        if bf16:
            module = module.bfloat16()
        if fp32_last_layer:
            module.layers[-1].float()
        self.dtype = dtype
        ddp_config = DDPConfig(
            grad_reduce_in_fp32=cfg.fp32_grad,
            overlap_grad_reduce=overlap_grad_reduce,
            overlap_param_gather=overlap,
            use_distributed_optimizer=False,
            bucket_size=cfg.bucket_size,
        )
        self.ddp = DDP(self.config, ddp_config, module, disable_bucketing=fp32_last_layer)
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
        self.opt = layerwise_muon_optimizer(opt_config, [self.ddp])
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

    @property
    def buckets(self):
        return [b for g in self.bucket_groups for b in g.buckets]

    def grad_datas(self):
        return [b.grad_data for b in self.buckets]

    def target(self, p, step):
        """Deterministic value of param p after "step" (same on every rank)."""
        gen = torch.Generator().manual_seed(10_000 * step + self.index[p])
        return torch.randn(p.shape, generator=gen).to(p.dtype)

    def simulate_step(self, step):
        """State right after an optimizer step: owners hold the new value, others stale."""
        with torch.no_grad():
            for p in self.params:
                if p in self.owned:
                    p.copy_(self.target(p, step))
                else:
                    p.fill_(GARBAGE)

    def params_equal_targets(self, step):
        return all(torch.equal(p.detach(), self.target(p, step)) for p in self.params)

    def synced(self, step):
        """Every param holds its value after `step` on every rank."""
        return all_ranks(self.params_equal_targets(step))

    def storage_freed(self):
        """Every grad_data's storage freed (offload_grad_buffers()) on this rank."""
        return all(g.untyped_storage().nbytes() == 0 for g in self.grad_datas())

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


def overlap_off(cfg, step, n_microbatches=1):
    """The reference of an overlapped run: the same model without overlap, its params at
    their values after `step` everywhere, after zero_grad_buffer() and forward_backward(step,
    n_microbatches)."""
    b = Setup(cfg, overlap=False)
    b.set_all_targets(step)
    b.ddp.zero_grad_buffer()
    b.forward_backward(step, n_microbatches)
    return b


def all_ranks(flag: bool) -> bool:
    t = torch.tensor([1 if flag else 0], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def max_abs_diff(xs, ys):
    d = max(((x.float() - y.float()).abs().max().item() for x, y in zip(xs, ys)), default=0.0)
    t = torch.tensor([d], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def params_diff(a, b):
    """Largest |difference| between the params of Setups a and b over every rank."""
    return max_abs_diff([p.detach() for p in a.params], [p.detach() for p in b.params])


def params_equal_across_ranks(params) -> bool:
    """Whether every rank holds rank 0's value of every param, bitwise (a broadcast from
    rank 0 per param, so every rank must call it with the same params)."""
    same = True
    for p in params:
        ref = p.detach().clone()
        dist.broadcast(ref, src=0)
        same &= torch.equal(ref, p.detach())
    return all_ranks(same)


def grads_all_zero(s):
    return all_ranks(all(int(torch.count_nonzero(g)) == 0 for g in s.grad_datas()))


def wait_for_pending_gathers(s):
    """Wait on the work of every pending layer-wise gather without consuming the bucket
    groups' handles (they stay pending for megatron): the data has landed, as it would on a
    fast network before the next call. Makes scenarios that touch grad_data under a pending
    gather deterministic."""
    for g in s.bucket_groups:
        for work in getattr(g.param_gather_handle, "handles", None) or []:
            work.wait()


# ---------------------------------------------------------------- share patterns (spec)
def shares_of(params_by_rank):
    """Elements each DP rank owns in a bucket (or buffer)."""
    return [sum(p.numel() for p in ps) for ps in params_by_rank]


def gather_nbytes(bk):
    """Bytes of bucket bk's layer-wise gather by the design: every rank's slot, the local
    one included (sum of the shares x the param itemsize), packed in rank order from element
    0 of the receive buffer: grad_data.view(param dtype) on the pre-hook pair over idle
    grad_data (whose copy-out must zero exactly them), else one temporary of this size.
    0 where no rank owns a param of the bucket (or it is not sharded)."""
    return sum(shares_of(bk.layerwise_params_list or [])) * bk.params_list[0].element_size()


def bucket_pattern(params_by_rank):
    """"none", "equal", or "unequal" plus which owner kinds occur, for the coverage report."""
    if not params_by_rank or max(shares_of(params_by_rank)) == 0:
        return {"kind": "none"}
    shares = shares_of(params_by_rank)
    kinds = {len(ps) for ps in params_by_rank}
    return {
        "kind": "equal" if min(shares) == max(shares) else "unequal",
        "empty_owner": 0 in kinds,
        "single_param_owner": 1 in kinds,
        "multi_param_owner": any(k > 1 for k in kinds),
        "multi_param_owners": sum(1 for ps in params_by_rank if len(ps) > 1),
    }


def byte_view(t):
    """t's bytes (a flat uint8 view)."""
    return t.detach().view(-1).view(torch.uint8)


def grad_bytes(s):
    """Copies of every bucket's grad_data as bytes."""
    return [byte_view(g).clone() for g in s.grad_datas()]


def fill_grad_bytes(grad_datas, value=0x11):
    """Every byte of each grad_data = value: nonzero in any dtype view (consumed grads)."""
    for g in grad_datas:
        byte_view(g).fill_(value)


def zeroed_first(grad_data, before, n):
    """The first n bytes of grad_data zero, every byte after them as in `before` (its bytes
    earlier, nonzero everywhere: fill_grad_bytes), on this rank. With n = gather_nbytes, a
    slot left unzeroed, a byte zeroed outside the slots and a slot placed elsewhere all
    fail; with n = 0, grad_data untouched."""
    new = byte_view(grad_data)
    return int(torch.count_nonzero(new[:n])) == 0 and torch.equal(new[n:], before[n:])


def zeroed_exactly_where_written(s, before):
    """zeroed_first(gather_nbytes) for every bucket of s (before: grad_bytes()), on every rank."""
    return all_ranks(all(zeroed_first(bk.grad_data, old, gather_nbytes(bk)) for bk, old in zip(s.buckets, before)))


def grad_data_untouched(s, before):
    """Every grad_data byte as in `before` (grad_bytes()), on every rank."""
    return all_ranks(all(torch.equal(a, b) for a, b in zip(grad_bytes(s), before)))


def gathered(s):
    """(bytes, buckets) of every bucket gather of s that moves anything (gather_nbytes):
    the temporaries the design allocates, one per bucket, where a sync may not receive
    into grad_data."""
    sizes = [n for n in map(gather_nbytes, s.buckets) if n]
    return sum(sizes), len(sizes)


def pattern_report(s):
    return [bucket_pattern(bk.layerwise_params_list) for bk in s.buckets]


# ---------------------------------------------------------------------------- scenarios
def sc_gather(cfg):
    """Forward pre-hooks gather owners' values; grad_data zero before backward; main_grad
    after backward equals the same model with overlap off."""
    a = Setup(cfg, overlap=True)
    a.ddp.zero_grad_buffer()
    a.simulate_step(step=1)
    # Forward of microbatch 1 runs every pre-hook; check right after it, before backward.
    out = a.ddp(a.batch(1, 0))
    params_ok = a.synced(1)
    grad_zero = grads_all_zero(a)
    out.float().pow(2).mean().backward()
    a.ddp.finish_grad_sync()
    diff = max_abs_diff(a.main_grads(), overlap_off(cfg, 1).main_grads())
    patterns = pattern_report(a)
    # The pre-hook pair again, over grad_data holding consumed grads (nonzero bytes).
    a.ddp.zero_grad_buffer()
    a.simulate_step(step=12)
    fill_grad_bytes(a.grad_datas())
    before = grad_bytes(a)
    for g in a.ddp.bucket_groups:
        sync_bucket_group(g, "async")
    zeroed_exactly = zeroed_exactly_where_written(a, before)
    # The pre-hook pair once more, over grads a backward wrote and no zero_grad_buffer()
    # reset (grad_data not idle): it must receive into a temporary per bucket and leave
    # every grad_data byte (so main_grad) as it was.
    a.ddp(a.batch(1, 1)).float().pow(2).mean().backward()
    a.ddp.finish_grad_sync()
    a.simulate_step(step=15)
    before = grad_bytes(a)
    with AllocationCounter() as c:
        for g in a.ddp.bucket_groups:
            sync_bucket_group(g, "async")
    return {
        "params_equal_owner_values": params_ok,
        "grad_data_zero_after_gather": grad_zero,
        "async_zeroed_exactly_where_written": zeroed_exactly,
        "not_idle_grad_data_untouched": grad_data_untouched(a, before),
        "not_idle_params_synced": a.synced(15),
        "not_idle_temporaries_are_the_gathered_size": all_ranks((c.temporary_bytes, c.alloc_calls) == gathered(a)),
        "not_idle_temporary_bytes": c.temporary_bytes,
        "main_grad_equals_overlap_off": all_ranks(diff == 0.0),
        "main_grad_max_abs_diff": diff,
        "num_buckets": len(patterns),
        "bucket_patterns": patterns,
        "buckets_per_group": [len(g.buckets) for g in a.bucket_groups],
    }


def sc_microbatches(cfg):
    """Grads over 1, 2, 4 microbatches: equal to overlap off (bitwise) and to the sum of
    per-microbatch grads (within the rounding of n additions in the grad dtype)."""
    res = {}
    eps = 1e-5 if cfg.fp32_grad or cfg.dtype == torch.float32 else 2 * torch.finfo(cfg.dtype).eps
    for n in (1, 2, 4):
        a = Setup(cfg, overlap=True)
        a.ddp.zero_grad_buffer()
        a.simulate_step(step=2)
        a.forward_backward(2, n)
        b = overlap_off(cfg, 2, n)
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
        res[f"mb{n}_equals_sum_of_microbatches"] = all_ranks(vs_sum <= eps * n * max(scale, 1.0))
        res[f"mb{n}_sum_max_abs_diff"] = vs_sum
    return res


def train(cfg, steps, overlap, expert=False, tweak=None, **setup_kwargs):
    """Train a fresh Setup `steps` real optimizer steps (2 microbatches each), with the
    overlapped (pre-hook) gather or the optimizer's synchronous gather in step().

    Returns:
        (Setup, grad norms, whether every grad_data byte was bitwise what it held before
        step() (the reduced grads) whenever step() returned (sync path only; True with
        overlap), how many nonzero grad elements the steps zeroed on this rank).
    """
    s = Setup(cfg, overlap=overlap, expert=expert, **setup_kwargs)
    if tweak is not None:
        tweak(s)
    norms, untouched, zeroed = [], True, 0
    for step in range(steps):
        s.ddp.zero_grad_buffer()
        s.opt.zero_grad()
        s.forward_backward(step, 2)
        before = None if overlap else [g.clone() for g in s.grad_datas()]
        norms.append(float(s.opt.step()[1]))
        for g, b in zip(s.grad_datas(), before or []):
            untouched &= torch.equal(byte_view(g), byte_view(b))
            zeroed += int(((g == 0) & (b != 0)).sum())
    if overlap:  # the last update is gathered by the next forward's pre-hooks
        s.ddp.start_param_sync(force_sync=True)
    return s, norms, untouched, zeroed


def compared(a, na, b, nb, other="sync"):
    """The record of two trained runs of one model (train()'s Setup and grad norms each):
    the overlapped one `a` and `b` ("sync": the optimizer path; "forced": a forced sync
    after each step). params_overlap_equal_<other> and grad_norms_equal bitwise on every
    rank; the max |param diff|, the norms and each run's params_sha256 (for the test to
    compare with the pristine tree's run)."""
    diff = params_diff(a, b)
    return {
        f"params_overlap_equal_{other}": all_ranks(diff == 0.0),
        "params_max_abs_diff": diff,
        "grad_norms_equal": all_ranks(na == nb),
        "grad_norms_overlap": na,
        f"grad_norms_{other}": nb,
        "params_sha256_overlap": params_sha256(a.params),
        f"params_sha256_{other}": params_sha256(b.params),
    }


def train_overlap_and_sync(cfg, steps, expert=False, tweak=None):
    """train() the same model with the overlapped gather and with the synchronous one.

    Returns:
        (compared() of the two, the overlap Setup, the sync run's grad_data-untouched check
        on every rank, its zeroed count on this rank).
    """
    a, na, _, _ = train(cfg, steps, True, expert, tweak)
    b, nb, untouched, zeroed = train(cfg, steps, False, expert, tweak)
    return compared(a, na, b, nb), a, all_ranks(untouched), zeroed


def sc_training(cfg, steps=4):
    """Real optimizer steps: overlapped (pre-hook) gather vs the optimizer's synchronous
    gather; params and grad norms bitwise equal, params equal on every rank; on the
    synchronous path every grad_data byte (so main_grad) is the reduced grad it held
    before whenever step() returns: the gather never touches grad_data (patch 0006
    broadcasts the params in place; pristine receives into temporaries)."""
    res, a, untouched, zeroed = train_overlap_and_sync(cfg, steps)
    return {
        **res,
        "params_equal_across_ranks": params_equal_across_ranks(a.params),
        "grad_data_untouched_by_step": untouched,
        "main_grad_elements_zeroed_by_step": zeroed,
    }


def params_sha256(params):
    """sha256 of every param's bytes in order (this rank; ranks hold equal params)."""
    h = hashlib.sha256()
    for p in params:
        h.update(p.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def gather_lists_cleared(s):
    """No bucket holds a pending layer-wise gather's receive slots (layerwise_gather_list,
    in the series as in pristine), on every rank."""
    return all_ranks(all(bk.layerwise_gather_list is None for bk in s.buckets))


def sc_forced_sync(cfg):
    """Forced sync (eval / checkpoint) with no gather pending, over idle grad_data that holds
    the bytes of consumed grads. (With a gather pending in idle grad_data, the forced sync
    is a hazard of test_grad_data_guards.py: gather_then_forced_before_step_idle.)"""
    s = Setup(cfg, overlap=True)
    res = {}
    # disable_forward_pre_hook(param_sync=True), as at eval; grad_data holds the grads the
    # step consumed (nonzero bytes). A forced sync never receives into grad_data (a grad
    # may be there): every byte stays.
    s.ddp.zero_grad_buffer()
    s.simulate_step(step=3)
    fill_grad_bytes(s.grad_datas())
    before = grad_bytes(s)
    s.ddp.disable_forward_pre_hook(param_sync=True)
    res["idle_params_synced"] = s.synced(3)
    res["idle_grad_data_untouched"] = grad_data_untouched(s, before)
    res["idle_gather_lists_cleared"] = gather_lists_cleared(s)
    s.ddp.enable_forward_pre_hook()
    s.ddp.zero_grad_buffer()
    with cpu_runtime.record_collectives() as gathers:
        out = s.ddp(s.batch(3, 0))
    res["no_regather_after_forced_sync"] = all_ranks(len(gathers) == 0)
    res["params_still_synced_after_forward"] = s.synced(3)
    out.float().pow(2).mean().backward()
    s.ddp.finish_grad_sync()
    # Next step: the next forward must gather again (not skip a needed gather).
    s.ddp.zero_grad_buffer()
    s.simulate_step(step=4)
    s.ddp(s.batch(4, 0))
    res["next_step_gathers_fresh_values"] = s.synced(4)
    return res


def sc_free_overlap_buffers(cfg):
    """free_overlap_buffers() (checkpoint save) with a gather pending in idle grad_data: it
    must complete it (params synced, grad_data zero, no receive slots left), so that the
    next forward neither gathers again nor keeps stale params."""
    s = Setup(cfg, overlap=True)
    s.ddp.zero_grad_buffer()
    s.simulate_step(step=6)
    s.ddp.start_param_sync()  # async dispatch of every bucket group
    s.ddp.free_overlap_buffers()
    res = {
        "params_synced": s.synced(6),
        "grad_data_zero": grads_all_zero(s),
        "gather_lists_cleared": gather_lists_cleared(s),
    }
    with cpu_runtime.record_collectives() as gathers:
        s.ddp(s.batch(6, 0))
    res["no_regather_in_forward"] = all_ranks(len(gathers) == 0)
    res["params_synced_after_forward"] = s.synced(6)
    return res


def sc_offload(cfg):
    """offload_grad_buffers() -> forced sync -> restore_grad_buffers(): the gather receives
    into a temporary of the gathered size per bucket, never into the freed storage."""
    s = Setup(cfg, overlap=True)

    def forced_twice():
        with AllocationCounter() as c:
            s.ddp.start_param_sync(force_sync=True)
        s.ddp.start_param_sync(force_sync=True)
        return c

    res, c = while_offloaded(s, 7, forced_twice)
    # After restore, a normal step must give the same grads as overlap off.
    s.ddp.zero_grad_buffer()
    s.forward_backward(7, 1)
    diff = max_abs_diff(s.main_grads(), overlap_off(cfg, 7).main_grads())
    return {
        **res,
        "temporary_is_the_gathered_size": all_ranks(c.temporary_bytes == gathered(s)[0]),
        "temporary_bytes": c.temporary_bytes,
        "main_grad_after_restore_equals_overlap_off": all_ranks(diff == 0.0),
    }


def while_offloaded(s, step, sync):
    """simulate_step(step) over zeroed grad_data, offload_grad_buffers(), `sync()` (a param
    sync), restore_grad_buffers(). Returns ({"params_synced", "storage_stayed_freed"} as
    they stood before the restore, on every rank; the freed storage must never be written),
    sync()'s return value)."""
    s.ddp.zero_grad_buffer()
    s.simulate_step(step=step)
    s.ddp.offload_grad_buffers(synchronize=False, empty_cache=False)
    out = sync()
    checks = {"params_synced": s.synced(step), "storage_stayed_freed": all_ranks(s.storage_freed())}
    s.ddp.restore_grad_buffers(synchronize=False)
    return checks, out


def _theory_bytes(buckets):
    """theory_upstream_bytes summed over `buckets` (per-rank lists set by the optimizer)."""
    rank = parallel_state.get_data_parallel_rank()
    return sum(
        theory_upstream_bytes(bk.layerwise_params_list, rank, bk.params_list[0].dtype.itemsize)
        for bk in buckets
        if bk.layerwise_params_list is not None
    )


def sync_bucket_group(g, path: str) -> None:
    """One layer-wise param sync of bucket group g: "async" is the forward pre-hook pair
    (start_param_sync, then finish_param_sync without chaining), "forced" is
    start_param_sync(force_sync=True) as at eval and checkpoint save."""
    if path == "async":
        g.start_param_sync()
        g.finish_param_sync(skip_next_bucket_dispatch=True)
    else:
        g.start_param_sync(force_sync=True)


def sc_alloc(cfg):
    """Per bucket group (async and forced paths) and per step (the optimizer's path): the
    megatron temporaries (TorchDispatchMode counter) and the collective model's numbers
    (ops, zero-size ops, launches, NCCL temporary bytes); and the per-rank shares, so that
    the test can compare the trees bucket by bucket."""
    res = {}
    s = Setup(cfg, overlap=True)
    res["theory_pristine_bytes"] = _theory_bytes(s.buckets)
    res["bucket_shares"] = [
        [shares_of(bk.layerwise_params_list) if bk.layerwise_params_list else None for bk in g.buckets]
        for g in s.ddp.bucket_groups
    ]
    res["bucket_param_counts"] = [
        [[len(ps) for ps in bk.layerwise_params_list] if bk.layerwise_params_list else None
         for bk in g.buckets]
        for g in s.ddp.bucket_groups
    ]
    # Control: the CPU runtime layer's uneven all_gather alone allocates nothing.
    sizes = [3 + r for r in range(dist.get_world_size())]
    buf = torch.zeros(sum(sizes), dtype=cfg.dtype)
    slots = list(buf.split(sizes))
    with AllocationCounter() as c:
        dist.all_gather(slots, slots[dist.get_rank()])
        dist.all_gather(slots, slots[dist.get_rank()], async_op=True).wait()
    res["runtime_layer_all_gather_bytes"] = c.temporary_bytes
    for path in ("async", "forced"):
        s.ddp.zero_grad_buffer()
        s.simulate_step(step=8)
        per_group, total_bytes, total_calls = [], 0, 0
        for g in s.ddp.bucket_groups:
            with AllocationCounter() as c, cpu_runtime.record_collectives() as calls:
                sync_bucket_group(g, path)
            per_group.append(cpu_runtime.summarize(calls))
            total_bytes += c.temporary_bytes
            total_calls += c.alloc_calls
        res[f"{path}_bytes"] = total_bytes
        res[f"{path}_alloc_calls"] = total_calls
        res[f"{path}_per_bucket_group"] = per_group
        res[f"{path}_params_synced"] = s.synced(8)
        for g in s.ddp.bucket_groups:
            g.param_gather_dispatched = False
    # The forced sync's temporaries by the design: one per gathered bucket, of its shares.
    res["gathered_bytes"], res["gathered_buckets"] = gathered(s)
    # The optimizer's synchronous path (no overlap).
    o = Setup(cfg, overlap=False)
    o.simulate_step(step=9)
    with AllocationCounter() as c, cpu_runtime.record_collectives() as calls:
        o.opt.allgather_params()
    res["optimizer_bytes"] = c.temporary_bytes
    res["optimizer_alloc_calls"] = c.alloc_calls
    res["optimizer_step"] = cpu_runtime.summarize(calls)
    res["optimizer_params_synced"] = o.synced(9)
    owners = o.opt.dp_cp_params_list
    res["optimizer_shares"] = None if owners is None else shares_of(owners)
    res["optimizer_params"] = 0 if owners is None else sum(len(ps) for ps in owners)
    res["theory_pristine_optimizer_bytes"] = (
        0
        if owners is None
        else theory_upstream_bytes(
            owners, parallel_state.get_data_parallel_rank(), o.params[0].dtype.itemsize
        )
    )
    return res


# ------------------------------------------------------------------- collectives (spec)
class CollectiveSpy:
    """Records each broadcast and all_gather_into_tensor call (tensor addresses and sizes,
    the storage each lies in, the broadcast root) in order; the calls go through unchanged
    to the collective model, whose records (launch ids) are collected alongside."""

    def __enter__(self):
        self.calls = []
        self._orig = {n: getattr(dist, n) for n in ("broadcast", "all_gather_into_tensor")}
        orig_b, orig_g = self._orig["broadcast"], self._orig["all_gather_into_tensor"]

        def where(t):
            st = t.untyped_storage()
            return t.data_ptr(), t.numel(), t.element_size(), st.data_ptr(), st.nbytes()

        def broadcast(tensor, src=None, group=None, async_op=False, group_src=None):
            self.calls.append(Call("broadcast", *where(tensor), src, None))
            return orig_b(tensor, src, group=group, async_op=async_op, group_src=group_src)

        def all_gather_into_tensor(out, inp, group=None, async_op=False):
            self.calls.append(Call("all_gather_into_tensor", *where(out), None, where(inp)))
            return orig_g(out, inp, group=group, async_op=async_op)

        dist.broadcast, dist.all_gather_into_tensor = broadcast, all_gather_into_tensor
        self._records = cpu_runtime.record_collectives()
        self.records = self._records.__enter__()
        return self

    def __exit__(self, *exc):
        self._records.__exit__(*exc)
        for n, fn in self._orig.items():
            setattr(dist, n, fn)


class Call(NamedTuple):
    """One recorded collective call: its (output) tensor's address, numel, itemsize, the
    storage it lies in (address, bytes), the broadcast root (global rank) and, for
    all_gather_into_tensor, the input's `where` tuple."""

    name: str
    ptr: int
    numel: int
    item: int
    storage_ptr: int
    storage_nbytes: int
    src: Optional[int]
    inp: Optional[tuple]


#: check_gather_calls' checks and coverage counters.
GATHER_CHECKS = ("form", "one_launch", "in_recv", "disjoint", "packed")
GATHER_SEEN = ("into_tensor", "broadcast_slot", "single_param_slot")


def broadcasts_as(calls, group, expect):
    """Whether `calls` are exactly one broadcast per (DP rank, numel) of `expect`, in that
    order, each rooted at that DP rank's global rank and of that numel."""
    want = [("broadcast", dist.get_global_rank(group, r), n) for r, n in expect]
    return [(c.name, c.src, c.numel) for c in calls] == want


def one_launch(calls, records):
    """Every call is one record of the collective model, all of one NCCL group launch."""
    return len(records) == len(calls) and len({r.launch_id for r in records}) == 1


def check_gather_calls(params_by_rank, calls, records, group, grad_data, into_grad_data):
    """The calls of one bucket's layer-wise gather (start_param_sync, patches 0003 and 0005)
    against the design.

    Returns {check: bool} and {counter: int}. "form": no call where no rank owns a param;
    equal shares -> one all_gather_into_tensor of DP x share elements whose input is this
    rank's slot of the output; otherwise broadcasts_as one per rank owning a param, of its
    share (a single-param owner's too: no in-place broadcast on this path); "one_launch";
    "in_recv": every tensor lies in the receive buffer: grad_data's storage when
    `into_grad_data` (the pre-hook pair over idle grad_data), else one temporary of exactly
    the gathered bytes, outside grad_data (forced sync, grad_data not idle); "disjoint":
    slots in rank order, not overlapping; "packed": each slot starts where the previous
    rank's ends, the first at element 0 of the receive buffer (grad_data.view(param dtype)
    or the temporary).
    """
    dp, rank = len(params_by_rank), dist.get_rank(group)
    shares = shares_of(params_by_rank)
    ok = dict.fromkeys(GATHER_CHECKS, True)
    seen = dict.fromkeys(GATHER_SEEN, 0)
    if max(shares) == 0:
        ok["form"] = not calls
        return ok, seen
    ok["one_launch"] = one_launch(calls, records)
    if min(shares) == max(shares):
        if [c.name for c in calls] != ["all_gather_into_tensor"]:
            ok["form"] = False
            return ok, seen
        (c,) = calls
        ok["form"] = c.numel == dp * shares[0] and c.inp[1] == shares[0]
        ok["form"] &= c.inp[0] == c.ptr + rank * shares[0] * c.item  # input: this rank's slot
        want = [0]
        seen["into_tensor"] = 1
    else:
        owners = [r for r in range(dp) if shares[r]]
        ok["form"] = broadcasts_as(calls, group, [(r, shares[r]) for r in owners])
        if not ok["form"]:
            return ok, seen
        want = [sum(shares[:r]) for r in owners]
        seen["broadcast_slot"] = len(owners)
        seen["single_param_slot"] = sum(len(params_by_rank[r]) == 1 for r in owners)
    regions = calls  # the output tensors: all_gather_into_tensor's, or the broadcasts'
    item = regions[0].item
    gd = grad_data.untyped_storage()
    if into_grad_data:
        base = grad_data.data_ptr()  # element 0 of grad_data.view(param dtype)
        lo, hi = gd.data_ptr(), gd.data_ptr() + gd.nbytes()
        ok["in_recv"] = all(lo <= c.ptr and c.ptr + c.numel * c.item <= hi for c in regions)
    else:
        # One temporary holding exactly the packed slots, not grad_data's storage.
        base = regions[0].storage_ptr
        ok["in_recv"] = all(c.storage_ptr == base for c in regions) and base != gd.data_ptr()
        ok["in_recv"] &= regions[0].storage_nbytes == sum(shares) * item
    got = [(c.ptr - base) // item for c in regions]
    ends = [o + c.numel for o, c in zip(got, regions)]
    ok["disjoint"] = all(got[i + 1] >= ends[i] for i in range(len(got) - 1))
    ok["packed"] = got == want and all((c.ptr - base) % item == 0 for c in regions)
    return ok, seen


def spied_sync(g, path, group, params_by_rank):
    """sync_bucket_group(g, path) of a bucket group of one bucket (its per-rank params
    `params_by_rank`) under a CollectiveSpy, checked by check_gather_calls (into grad_data
    on the "async" path). Returns (checks, counters, the spy)."""
    (bk,) = g.buckets
    with CollectiveSpy() as spy:
        sync_bucket_group(g, path)
    ok, seen = check_gather_calls(params_by_rank, spy.calls, spy.records, group, bk.grad_data,
                                  into_grad_data=path == "async")
    return ok, seen, spy


def check_optimizer_calls(params_by_rank, calls, records, group):
    """The calls of the optimizer path's gather (allgather_params(), patch 0006) over one DP
    group against the design: "form": broadcasts_as one per param, in rank order then the
    owner's param order, of the param's numel, none of them zero-size; "one_launch" (or
    no call at all); "in_place": each broadcast's tensor is its param's own storage
    (param.data: no temporary, grad_data untouched)."""
    params = [(r, p) for r, ps in enumerate(params_by_rank) for p in ps]
    ok = {
        "form": broadcasts_as(calls, group, [(r, p.numel()) for r, p in params]) and all(c.numel for c in calls),
        "one_launch": one_launch(calls, records) or not (calls or records),
        "in_place": len(calls) == len(params) and all(
            c.ptr == p.data_ptr() and c.numel == p.numel() for c, (_, p) in zip(calls, params)
        ),
    }
    return ok, {"optimizer_in_place": len(calls)}


def sc_collectives(_cfg=None):
    """Which collectives each path issues, checked against the design on
    COLLECTIVE_MODELS, one bucket group at a time: the pre-hook pair over idle grad_data
    ("async") and the forced sync ("forced") by spied_sync, the optimizer's gather in
    step() ("optimizer") by check_optimizer_calls. Call patterns and addresses only: the
    values gathered are checked by the other scenarios. Keys "<model>_<path>_<check>" (on
    every rank, over every bucket group) and "<model>_<path>_n_<counter>" (summed)."""
    res = {}
    group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    for key_model, name in COLLECTIVE_MODELS.items():
        cfg = parse_config(name)
        for path in ("async", "forced", "optimizer"):
            s = Setup(cfg, overlap=path != "optimizer")
            s.ddp.zero_grad_buffer()
            s.simulate_step(step=11)
            if path == "optimizer":
                with CollectiveSpy() as spy:
                    s.opt.allgather_params()
                found = [check_optimizer_calls(s.opt.dp_cp_params_list, spy.calls, spy.records, group)]
            else:
                found = [spied_sync(g, path, group, g.buckets[0].layerwise_params_list)[:2] for g in s.ddp.bucket_groups]
            for k in found[0][0]:
                res[f"{key_model}_{path}_{k}"] = all_ranks(all(ok[k] for ok, _ in found))
            for k in found[0][1]:
                res[f"{key_model}_{path}_n_{k}"] = sum(seen[k] for _, seen in found)
    return res


class ShareNet(MegatronModule):
    """1-D params of the given numels in one ParameterList: the params of one DDP bucket
    whose per-rank shares sc_share_patterns chooses."""

    def __init__(self, config, numels):
        super().__init__(config=config)
        self.ps = torch.nn.ParameterList(torch.nn.Parameter(torch.zeros(n)) for n in numels)


#: sc_share_patterns' settings: (param dtype, grad_reduce_in_fp32): bf16 params over fp32
#: grad_data (twice their width) and over bf16 grad_data (their width).
SHARE_PATTERN_DTYPES = {"bf16_in_fp32": (torch.bfloat16, True), "bf16_in_bf16": (torch.bfloat16, False)}


def share_patterns(world, most=2):
    """Every pattern of per-rank shares (0 to `most` elements each, not all 0) of `world`
    ranks, in itertools.product order."""
    return [s for s in itertools.product(range(most + 1), repeat=world) if max(s) > 0]


def share_pattern_owners(shares):
    """Per rank, the numels of the params it owns for `shares`: rank 1 owns its share as
    one-element params (a multi-param owner when it is 2), the others as one param."""
    return [[1] * n if r == 1 else ([n] if n else []) for r, n in enumerate(shares)]


def _share_pattern_bucket(shares, dtype, fp32_grad):
    """A DDP (megatron's, built as training builds it: one bucket, main_grad views its
    grad_data) over ShareNet whose bucket's per-rank param lists give `shares`: set through
    the bucket's set_layerwise_params_list(), the call by which the layer-wise optimizer
    hands each bucket its owners. Returns (ddp, bucket group, per-rank params)."""
    config = tiny_config(dtype)
    owners = share_pattern_owners(shares)
    module = ShareNet(config, [n for ns in owners for n in ns]).to(dtype)
    ddp = DDP(config, DDPConfig(grad_reduce_in_fp32=fp32_grad, overlap_grad_reduce=True,
                                overlap_param_gather=True, use_distributed_optimizer=False), module)
    (g,) = ddp.bucket_groups
    (bk,) = g.buckets
    it = iter(module.ps)
    params_by_rank = [[next(it) for _ in ns] for ns in owners]
    bk.set_layerwise_params_list(params_by_rank)
    return ddp, g, params_by_rank


def sc_share_patterns(_cfg=None):
    """Every share pattern of this world's ranks (share_patterns: 0 to 2 elements each;
    run at 3 ranks), through megatron's real bucket group on real gloo ranks, on each
    SHARE_PATTERN_DTYPES setting: the pre-hook pair over idle grad_data holding consumed
    grads, then a forced sync. Per pattern and path: spied_sync's checks, every param its
    owner's value on every rank ("owner_values"), grad_data zero exactly where the
    pre-hook gather wrote and untouched by the forced sync ("grad_data": zeroed_first), the
    forms called and the collective model's summary for the test to compare with the
    design. Keys "<dtypes>/<s0>-<s1>-...:<path>"."""
    res = {}
    rank = dist.get_rank()
    group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    for dname, (dtype, fp32_grad) in SHARE_PATTERN_DTYPES.items():
        for shares in share_patterns(dist.get_world_size()):
            ddp, g, params_by_rank = _share_pattern_bucket(shares, dtype, fp32_grad)
            (bk,) = g.buckets
            params = [p for ps in params_by_rank for p in ps]
            mine = set(params_by_rank[rank])
            for step, path in enumerate(("async", "forced")):
                ddp.zero_grad_buffer()
                seed = 1000 * step + sum(10**i * n for i, n in enumerate(shares))
                gen = torch.Generator().manual_seed(seed)
                targets = [torch.randn(p.shape, generator=gen).to(dtype) for p in params]
                with torch.no_grad():
                    for p, t in zip(params, targets):
                        p.copy_(t if p in mine else torch.full_like(t, GARBAGE))
                fill_grad_bytes([bk.grad_data])
                before = byte_view(bk.grad_data).clone()
                ok, _, spy = spied_sync(g, path, group, params_by_rank)
                n = gather_nbytes(bk) if path == "async" else 0
                ok["owner_values"] = all(torch.equal(p.detach(), t) for p, t in zip(params, targets))
                ok["grad_data"] = zeroed_first(bk.grad_data, before, n)
                key = f"{dname}/{'-'.join(map(str, shares))}:{path}"
                res[key] = {k: all_ranks(v) for k, v in ok.items()}
                res[key]["forms"] = sorted({c.name for c in spy.calls})
                res[key]["summary"] = cpu_runtime.summarize(spy.records)
    return res


def sc_async_without_ddp(cfg):
    """The layer-wise optimizer with --overlap-param-gather (async_allgather) over a model
    chunk that is not megatron's DDP (it carries a ddp_config, as get_megatron_optimizer
    needs, but no bucket groups to gather through). Raises on every rank; the worker
    records the error."""
    layerwise_without_ddp(cfg.dtype, cfg.widths, overlap=True)
    return {"built": True}


def layerwise_without_ddp(dtype, widths, overlap):
    """TinyNet of `widths` in `dtype`, not wrapped in megatron's DDP (it carries the
    ddp_config get_megatron_optimizer needs, no bucket groups), and the layer-wise
    optimizer over it (overlap: --overlap-param-gather). Returns (module, optimizer)."""
    torch.manual_seed(1234)
    module = TinyNet(tiny_config(dtype), widths=widths).to(dtype)
    module.ddp_config = DDPConfig(overlap_param_gather=overlap, use_distributed_optimizer=False)
    opt_config = OptimizerConfig(optimizer='muon', lr=0.02, bf16=dtype == torch.bfloat16, params_dtype=dtype,
                                 use_distributed_optimizer=False, overlap_param_gather=overlap)
    return module, layerwise_muon_optimizer(opt_config, [module])


def _non_contiguous_weight(s):
    """The first layer's weight stored transposed (x.t().contiguous().t(): same values,
    not contiguous), as a param that is not a plain contiguous tensor."""
    w = s.ddp.module.layers[0].weight
    w.data = w.data.t().contiguous().t()
    assert not w.data.is_contiguous()


def _fp8_buffer_param_dtype(s):
    """Every grad buffer's param_dtype set to uint8, as megatron sets it for FP8 params'
    buffers (the params themselves stay bf16/fp32 here)."""
    for b in s.ddp.buffers + s.ddp.expert_parallel_buffers:
        b.param_dtype = torch.uint8


def sc_unusual_params(cfg):
    """Overlapped and optimizer-path training (3 steps) with a non-contiguous param, and
    with uint8 buffer param_dtype: bitwise fingerprints for the test to compare with the
    pristine tree, and overlap == sync."""
    res = {}
    for name, tweak in (("non_contiguous", _non_contiguous_weight), ("uint8_buffer_dtype", _fp8_buffer_param_dtype)):
        res.update({f"{name}_{k}": v for k, v in train_overlap_and_sync(cfg, 3, tweak=tweak)[0].items()})
    return res


def sc_optimizer_offloaded(cfg):
    """The optimizer's gather (LayerWiseDistributedOptimizer.allgather_params(), what step()
    ends with) called while offload_grad_buffers() has freed grad_data: the params are
    gathered (through temporaries) and the freed storage is never written."""
    s = Setup(cfg, overlap=False)
    return while_offloaded(s, 7, s.opt.allgather_params)[0]


def sc_optimizer_without_ddp(cfg):
    """The layer-wise optimizer without --overlap-param-gather over a model chunk that is
    not megatron's DDP: 2 real steps (fp32, grads from loss.backward() in param.grad), the
    params equal on every rank afterwards, and their bitwise fingerprint for the test."""
    module, opt = layerwise_without_ddp(torch.float32, cfg.widths, overlap=False)
    x = torch.randn(4, IN_DIM, generator=torch.Generator().manual_seed(5))
    for _ in range(2):
        opt.zero_grad()
        module(x).pow(2).mean().backward()
        for p in module.parameters():  # the DP all-reduce DDP would do
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()
        opt.step()
    params = list(module.parameters())
    return {"params_equal_across_ranks": params_equal_across_ranks(params), "params_sha256": params_sha256(params)}


def _forced_sync_after_each_step(s):
    """No pre-hooks; every step() followed by start_param_sync(force_sync=True), which
    gathers synchronously on both trees: the race-free reference of the overlapped run."""
    s.ddp.disable_forward_pre_hook(param_sync=False)
    step = s.opt.step

    def step_then_sync():
        out = step()
        s.ddp.start_param_sync(force_sync=True)
        return out

    s.opt.step = step_then_sync


def sc_bucket_group_of_two(cfg):
    """A bucket group of two buckets (Setup(fp32_last_layer=True): a bf16 and an fp32
    bucket, as with disable_bucketing), trained 3 steps with the overlapped gather under
    collectives.defer_async_completion(), where each bucket's gather lands only when its
    own work is waited on, and with a synchronous forced sync after each step instead
    (the optimizer path's gather, 0.17.1's _allgather_helper, cannot gather two dtypes):
    params and grad norms bitwise equal, and fingerprints for the test to compare."""
    with collectives.defer_async_completion():
        a, na, _, _ = train(cfg, 3, True, fp32_last_layer=True)
    b, nb, _, _ = train(cfg, 3, True, tweak=_forced_sync_after_each_step, fp32_last_layer=True)
    return {
        "buckets_per_group": [len(g.buckets) for g in a.bucket_groups],
        "buckets_gathered_per_group": [
            sum(bk.layerwise_params_list is not None for bk in g.buckets) for g in a.bucket_groups
        ],
        **compared(a, na, b, nb, "forced"),
    }


def sc_small_dp(cfg, expert=False):
    """DP size 1 (run with one rank) or expert-DP size 1 (expert=True, EP = world): the
    optimizer builds, training runs, params match the synchronous path; bitwise
    fingerprints of both for the test to compare with pristine's synchronous path
    (sc_small_dp_sync: pristine crashes with --overlap-param-gather there)."""
    return train_overlap_and_sync(cfg, 3, expert)[0]


def sc_small_dp_sync(cfg, expert=False):
    """sc_small_dp's synchronous (optimizer-path) run alone: its params' fingerprint."""
    s, *_ = train(cfg, 3, False, expert)
    return {"params_sha256_sync": params_sha256(s.params)}


# ------------------------------------------------- what every rank must agree on
def _exchange(key, value):
    """Every rank's `value` (JSON), in rank order, through the c10d store: not a
    collective, so it cannot pair with a collective another rank is still in."""
    store = dist.distributed_c10d._get_default_store()
    store.set(f"exchange/{key}/{dist.get_rank()}", json.dumps(value))
    return [json.loads(store.get(f"exchange/{key}/{r}")) for r in range(dist.get_world_size())]


def _collective_signature(records):
    """What a rank's gather calls must share with every other rank's: form, group size,
    dtype, slot sizes and broadcast root of each call (harness.cpu_runtime's records)."""
    return [[r.form, r.world, r.dtype, list(r.slot_numels), r.src] for r in records]


def _private_state(s, state, step):
    """Put this rank's grad buffers into `state` (rank 0 only; the others stay idle):
    "offloaded" (offload_grad_buffers()), "unconsumed_grads" (a forward and backward
    inside no_sync(): grads in grad_data that no step consumed, no collective issued)."""
    if dist.get_rank() != 0:
        return
    if state == "offloaded":
        s.ddp.offload_grad_buffers(synchronize=False, empty_cache=False)
    else:
        with s.ddp.no_sync():
            s.ddp(s.batch(step, 0)).float().pow(2).mean().backward()


def sc_private_state_gather(cfg):
    """The optimizer's gather (LayerWiseDistributedOptimizer.allgather_params(), no
    --overlap-param-gather) called directly while rank 0 holds private state the other
    ranks do not (offloaded grad buffers; grads no step consumed) and the others are idle.
    Per state: each rank's gather calls (their signature, exchanged through the store) are
    the same on every rank, the params equal the owners' values on every rank, and rank
    0's state is untouched (its freed storage stays freed, its grads keep their bytes)."""
    res = {}
    for state in ("offloaded", "unconsumed_grads"):
        s = Setup(cfg, overlap=False)
        s.ddp.zero_grad_buffer()
        s.simulate_step(step=13)
        _private_state(s, state, 13)
        before = None if state == "offloaded" else grad_bytes(s)
        with cpu_runtime.record_collectives() as calls:
            s.opt.allgather_params()
        every = _exchange(f"{cfg.name}/{state}", _collective_signature(calls))
        if dist.get_rank() != 0:
            kept = True
        elif state == "offloaded":
            kept = s.storage_freed()
        else:
            kept = all(torch.equal(a, b) for a, b in zip(grad_bytes(s), before))
        res[f"{state}_same_collective_on_every_rank"] = all(sig == every[0] for sig in every)
        res[f"{state}_params_equal_owner_values"] = s.synced(13)
        res[f"{state}_private_state_kept"] = all_ranks(kept)
        res[f"{state}_forms_by_rank"] = [sorted({c[0] for c in sig}) for sig in every]
        if state == "offloaded":
            s.ddp.restore_grad_buffers(synchronize=False)
    return res


def _plain_ddp_with_adam(cfg):
    """TinyNet in megatron's DDP without the distributed optimizer and megatron's Adam
    (get_megatron_optimizer; torch's AdamW on CPU): no layer-wise bucket, no param gather."""
    from megatron.core.optimizer import get_megatron_optimizer

    torch.manual_seed(1234)
    bf16 = cfg.dtype == torch.bfloat16
    tc = tiny_config(cfg.dtype)
    module = TinyNet(tc, widths=cfg.widths).to(cfg.dtype)
    ddp = DDP(tc, DDPConfig(grad_reduce_in_fp32=cfg.fp32_grad, overlap_grad_reduce=True,
                            use_distributed_optimizer=False, bucket_size=cfg.bucket_size), module)
    opt = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=0.01, bf16=bf16, params_dtype=cfg.dtype,
                        use_distributed_optimizer=False),
        [ddp],
    )
    return ddp, opt


class _BucketGroupCalls:
    """Records the calls of every _ParamAndGradBucketGroup method (by name) while active."""

    def __enter__(self):
        from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBucketGroup as G

        self.cls, self.orig, self.calls = G, {}, []
        for name, fn in vars(G).items():
            if callable(fn) and not name.startswith("__"):
                self.orig[name] = fn

                def spy(*args, _name=name, _fn=fn, **kwargs):
                    self.calls.append(_name)
                    return _fn(*args, **kwargs)

                setattr(G, name, spy)
        return self

    def __exit__(self, *exc):
        for name, fn in self.orig.items():
            setattr(self.cls, name, fn)


#: Bucket-group entry points of the layer-wise param sync (and its completion).
PARAM_SYNC_CALLS = ("free_overlap_buffers", "start_param_sync", "finish_param_sync")


def sc_plain_ddp_zero_grad(cfg):
    """Plain DDP with Adam (_plain_ddp_with_adam), 2 training steps: zero_grad_buffer()
    before each, offload_grad_buffers() and restore_grad_buffers() after them. No
    layer-wise gather can be pending there, so these calls issue no param-sync work: the
    bucket-group methods they call (listed for the test to compare with the pristine
    tree's), none of them a param-sync entry point or named for the layer-wise gather,
    and no gather collective."""
    ddp, opt = _plain_ddp_with_adam(cfg)
    called, gathers = set(), 0
    x = torch.randn(4, IN_DIM, generator=torch.Generator().manual_seed(3 + dist.get_rank()))
    for step in range(2):
        with _BucketGroupCalls() as spy, cpu_runtime.record_collectives() as calls:
            ddp.zero_grad_buffer()
        called |= set(spy.calls)
        gathers += len(calls)
        opt.zero_grad()
        ddp(x.to(cfg.dtype)).float().pow(2).mean().backward()
        ddp.finish_grad_sync()
        opt.step()
    with _BucketGroupCalls() as spy, cpu_runtime.record_collectives() as calls:
        ddp.offload_grad_buffers(synchronize=False, empty_cache=False)
        ddp.restore_grad_buffers(synchronize=False)
    called |= set(spy.calls)
    gathers += len(calls)
    sync_named = sorted(
        c for c in called
        if c in PARAM_SYNC_CALLS or any(w in c for w in ("layerwise", "param_gather", "param_sync"))
    )
    return {
        "bucket_group_methods_called": sorted(called),
        "param_sync_methods_called": sync_named,
        "no_param_sync_work": all_ranks(not sync_named and gathers == 0),
        "gather_collectives": gathers,
    }


def sc_optimizer_two_dtypes(cfg):
    """The optimizer's gather (no --overlap-param-gather) over a model with bf16 and fp32
    params (Setup(fp32_last_layer=True)): after a simulated step every rank holds the
    owners' values; 3 real steps equal, params and grad norms bitwise, the same model
    trained with the overlapped (pre-hook) gather, grad_data untouched by each step() of
    the optimizer path. A rank whose gather raises re-raises
    with the number of gather collectives it issued first, so that an error on every rank
    before any collective is data (harness.ranks.Outcomes), and one on some ranks only
    ends the job."""
    s = Setup(cfg, overlap=False, fp32_last_layer=True)
    s.ddp.zero_grad_buffer()
    s.simulate_step(step=14)
    with cpu_runtime.record_collectives() as calls:
        try:
            s.opt.allgather_params()
        except Exception as exc:
            raise RuntimeError(f"{type(exc).__name__} after {len(calls)} gather collectives: {exc}") from exc
    res = {
        "param_dtypes": sorted({str(p.dtype) for p in s.params}),
        "params_equal_owner_values": s.synced(14),
        "gather_dtypes": sorted({c.dtype for c in calls}),
    }
    a, na, _, _ = train(cfg, 3, True, fp32_last_layer=True)
    b, nb, untouched, _ = train(cfg, 3, False, fp32_last_layer=True)
    diff = params_diff(a, b)
    res.update(
        training_equals_overlapped=all_ranks(diff == 0.0 and na == nb),
        params_equal_across_ranks=params_equal_across_ranks(b.params),
        grad_data_untouched_by_step=all_ranks(untouched),
    )
    return res


def sc_post_param_sync_order(cfg):
    """0.19: _ParamAndGradBucketGroup._post_param_sync() (post-processing of gathered
    params, e.g. MXFP8's) must find every param of its bucket group already holding the
    gathered value, on each path that calls it: the pre-hook pair, a forced sync idle and
    with a gather pending, free_overlap_buffers() and zero_grad_buffer() with a gather
    pending. Per path: calls, and calls that found a param not yet copied back (each
    checked when called, against the step's owner values). 0.17.1 has no _post_param_sync:
    {"skipped": ...}."""
    from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBucketGroup as G

    if not hasattr(G, "_post_param_sync"):
        return {"skipped": "no _post_param_sync in this tree"}
    s = Setup(cfg, overlap=True)
    seen = {"calls": 0, "early": 0, "step": None}
    orig = G._post_param_sync

    def checked(group):
        seen["calls"] += 1
        params = [p for b in group.buckets for p in b.params_list if p in s.index]
        if not all(torch.equal(p.detach(), s.target(p, seen["step"])) for p in params):
            seen["early"] += 1
        return orig(group)

    def start_all():
        for g in s.bucket_groups:
            g.start_param_sync()

    def then(*fns):
        return lambda: [fn() for fn in fns]

    paths = {
        "async": lambda: [sync_bucket_group(g, "async") for g in s.bucket_groups],
        "forced_idle": lambda: s.ddp.start_param_sync(force_sync=True),
        "forced_pending": then(start_all, lambda: s.ddp.start_param_sync(force_sync=True)),
        "free_overlap_buffers": then(start_all, s.ddp.free_overlap_buffers),
        "zero_grad_buffer": then(start_all, lambda: wait_for_pending_gathers(s), s.ddp.zero_grad_buffer),
    }
    res = {}
    G._post_param_sync = checked
    try:
        for i, (name, path) in enumerate(paths.items()):
            s.ddp.zero_grad_buffer()
            for g in s.bucket_groups:
                g.param_gather_dispatched = False
            seen.update(calls=0, early=0, step=20 + i)
            s.simulate_step(step=20 + i)
            path()
            res[f"{name}_calls"] = seen["calls"]
            res[f"{name}_copied_back_before_post_param_sync"] = all_ranks(seen["early"] == 0)
            res[f"{name}_params_synced"] = s.synced(20 + i)
    finally:
        G._post_param_sync = orig
    return res


def cuda_graph_configs():
    """CUDA graph variants of TransformerConfig (kwargs), as this tree spells them:
    "local" (megatron's per-layer graphs), "full_iteration" (one graph of forward and
    backward: 0.19's cuda_graph_impl="full_iteration", 0.17.1's "local" with
    cuda_graph_scope "full_iteration") and "inference_only" (RL: graphs for inference only,
    cuda_graph_scope "full_iteration_inference", which 0.19 turns into "local" with
    inference_cuda_graph_scope "block")."""
    from megatron.core import package_info

    full = (
        {"cuda_graph_impl": "full_iteration"}
        if (package_info.MAJOR, package_info.MINOR) >= (0, 19)
        else {"cuda_graph_impl": "local", "cuda_graph_scope": "full_iteration"}
    )
    return {
        "local": {"cuda_graph_impl": "local"},
        "full_iteration": full,
        "inference_only": {"cuda_graph_impl": "local", "cuda_graph_scope": "full_iteration_inference"},
    }


def sc_local_cuda_graphs(cfg):
    """DDP and the layer-wise optimizer with --overlap-param-gather on a model whose
    TransformerConfig asks for CUDA graphs (cuda_graph_configs(); on CPU nothing is
    captured: the config is what DDP and the optimizer see): per variant, DDP builds and 3
    real steps equal, params and grad norms bitwise, the same run without the CUDA graph
    config, and params equal on every rank, on the series and on pristine."""
    ref, nref, _, _ = train(cfg, 3, True)
    res = {}
    for name, kwargs in cuda_graph_configs().items():
        s, norms, _, _ = train(cfg, 3, True, tc_kwargs=kwargs)
        res[f"{name}_cuda_graph_impl"] = s.config.cuda_graph_impl
        res[f"{name}_built"] = True
        diff = params_diff(s, ref)
        res[f"{name}_trains_equal_without_cuda_graphs"] = all_ranks(diff == 0.0 and norms == nref)
        res[f"{name}_params_equal_across_ranks"] = params_equal_across_ranks(s.params)
    return res


SCENARIOS = {
    "gather": sc_gather,
    "microbatches": sc_microbatches,
    "training": sc_training,
    "forced_sync": sc_forced_sync,
    "free_overlap_buffers": sc_free_overlap_buffers,
    "offload": sc_offload,
    "alloc": sc_alloc,
    "collectives": sc_collectives,
    "share_patterns": sc_share_patterns,
    "async_without_ddp": sc_async_without_ddp,
    "optimizer_without_ddp": sc_optimizer_without_ddp,
    "optimizer_offloaded": sc_optimizer_offloaded,
    "unusual_params": sc_unusual_params,
    "bucket_group_of_two": sc_bucket_group_of_two,
    "small_dp": sc_small_dp,
    "expert_dp1": lambda cfg: sc_small_dp(cfg, expert=True),
    # Run with --tensor-parallel 2 on 2 ranks: dense DP (dp_cp) 1, expert-DP 2.
    "dp1_expert_dp2": lambda cfg: sc_small_dp(cfg, expert=True),
    "small_dp_sync": sc_small_dp_sync,
    "expert_dp1_sync": lambda cfg: sc_small_dp_sync(cfg, expert=True),
    "private_state_gather": sc_private_state_gather,
    "plain_ddp_zero_grad": sc_plain_ddp_zero_grad,
    "optimizer_two_dtypes": sc_optimizer_two_dtypes,
    "post_param_sync_order": sc_post_param_sync_order,
    "local_cuda_graphs": sc_local_cuda_graphs,
}
#: Scenarios that build their own models: run once per job, keyed "models/<scenario>".
MODEL_INDEPENDENT = {"collectives", "share_patterns"}

#: "<scenario>:<rank>" makes that rank raise at the start of that scenario (tests of the
#: failure handling: the other ranks are then inside the scenario's collectives).
FAIL_ENV = "LAYERWISE_WORKER_FAIL"
#: Seconds a rank waits at least for the others' outcome of a scenario (harness.ranks.Outcomes
#: floor_s, default 30): the failure test sets it low so as not to wait out the default.
FLOOR_ENV = "LAYERWISE_WORKER_OUTCOME_FLOOR_S"
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
                    help=f"comma list of <bf16|fp32>-<fp32grad|samegrad>-<{'|'.join(MODELS)}>")
    return ap


def main(argv=None):
    ap = worker_arg_parser(__doc__, "JSON results path (written by rank 0)", SCENARIOS,
                           "bf16-fp32grad-mixed")
    ap.add_argument("--expert-parallel", type=int, default=1)
    ap.add_argument("--tensor-parallel", type=int, default=1)
    args = ap.parse_args(argv)
    configs = [parse_config(c) for c in args.configs.split(",")]
    names = args.scenarios.split(",")
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        raise SystemExit(f"unknown scenarios {unknown}; expected some of {sorted(SCENARIOS)}")

    dist.init_process_group(backend="gloo")
    tree = check_expected_tree()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=args.tensor_parallel,
        expert_model_parallel_size=args.expert_parallel,
        expert_tensor_parallel_size=1 if args.tensor_parallel > 1 else None,
    )
    results = {"_meta": {"tree": tree, "world_size": dist.get_world_size()}}
    # A scenario that raises on every rank is data (the pristine tree crashes where the
    # series fixes it); one that raises on some ranks only ends the job with that rank's
    # traceback (harness.ranks.Outcomes) instead of hanging in a collective.
    outcomes = Outcomes(prefix="layerwise_worker", floor_s=float(os.environ.get(FLOOR_ENV, 30)))
    forced = _forced_failure()
    jobs = [(cfg, n) for cfg in configs for n in names if n not in MODEL_INDEPENDENT]
    jobs += [(None, n) for n in names if n in MODEL_INDEPENDENT]
    for cfg, name in jobs:
        key = f"{cfg.name if cfg else 'models'}/{name}"
        with outcomes.step(key) as step:
            if forced == (name, dist.get_rank()):
                raise RuntimeError(f"forced failure of {key} on rank {dist.get_rank()} ({FAIL_ENV})")
            step.result = SCENARIOS[name](cfg)
        results[key] = step.result
        if step.traceback and isinstance(step.result, dict) and "error" in step.result:
            step.result["where"] = step.traceback.strip().splitlines()[-4:-1]
        if dist.get_rank() == 0:
            print(f"{PROGRESS} {key} {time.monotonic():.3f}", flush=True)
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1, sort_keys=True)
    dist.barrier()
    exit_rank(0)


if __name__ == "__main__":
    sys.exit(main())
