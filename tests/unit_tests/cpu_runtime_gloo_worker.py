"""One gloo rank for tests/unit_tests/test_cpu_runtime.py (not collected by pytest).

Run by the test under torchrun (``harness.launch.torchrun_command``) as
``cpu_runtime_gloo_worker.py OUT_DIR``; installs harness.cpu_runtime, runs every check and
writes ``OUT_DIR/rank<R>.json`` with the measured facts. The test asserts on them, so a
wrong result fails there with the rank and case named; an exception here exits non-zero
(the test shows the stderr tail).
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

import harness.cpu_runtime as cpu_runtime
from harness.alloc_counter import AllocationCounter
from harness.cpu_runtime import collectives
from harness.ranks import exit_rank

# Slot sizes per rank (elements); index 1 is empty, so every world >= 2 has an empty slot.
SIZES = [5, 0, 3, 7]
EQUAL_NUMEL = 6


def profiled_alloc_bytes(fn) -> int:
    """Bytes the torch profiler attributes to allocations in this thread during ``fn()``.

    Sum over events of positive self CPU memory (ops and unattributed ``[memory]`` records).
    """
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return sum(max(0, e.self_cpu_memory_usage) for e in prof.events())


def counted(fn) -> Dict[str, object]:
    """Dispatch-level allocations and model records of ``fn()``."""
    with AllocationCounter() as counter, cpu_runtime.record_collectives() as calls:
        fn()
    return {"bytes": counter.temporary_bytes, "ops": [op for op, _ in counter.events],
            "records": [c.as_dict() for c in calls]}


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def peak_rss_growth(fn) -> Optional[int]:
    """Process-wide peak-RSS growth (bytes) during ``fn()``; sees gloo's threads too.

    Resets the kernel's high-water mark (``echo 5 > /proc/self/clear_refs``, Linux >= 4.0),
    runs ``fn`` and returns ``VmHWM - VmRSS(before)``. ``None`` where that is unavailable.
    """
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        before = _status_kb("VmRSS")
    except OSError:
        return None
    fn()
    return (_status_kb("VmHWM") - before) * 1024


def gloo_native_all_gather(outs: List[torch.Tensor], inp: torch.Tensor) -> None:
    """torch's own all_gather on gloo, bypassing the model."""
    with torch._C.DisableTorchFunction():
        collectives._real_all_gather(outs, inp)


def rss_growth(world: int, slot_numel: int) -> Dict[str, Optional[int]]:
    """Peak-RSS growth (bytes) of gathers of ``world`` fp32 slots of ``slot_numel`` each.

    Buffers are touched before measuring and one warm-up gather runs first (gloo sets up
    its transport lazily). ``into_tensor``: the model's all_gather_into_tensor must not
    grow. Control: gloo's own allgather flattens into a new ``world * slot`` buffer, which
    must show up; it runs last and only once, because afterwards malloc reuses that freed,
    already resident region.
    """
    out = torch.zeros(world * slot_numel)
    outs = list(out.split(slot_numel))
    inp = torch.ones(slot_numel)
    dist.all_gather_into_tensor(out, inp)  # warm-up (gloo transport)
    return {
        "into_tensor": peak_rss_growth(lambda: dist.all_gather_into_tensor(out, inp)),
        "into_tensor_async": peak_rss_growth(lambda: dist.all_gather_into_tensor(out, inp, async_op=True).wait()),
        "control_gloo_allgather": peak_rss_growth(lambda: gloo_native_all_gather(outs, inp)),
        "slot_bytes": slot_numel * 4,
    }


def rank_values(rank: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    """Deterministic distinct payload of rank ``rank``: 100*rank + 0..n-1 (exact in bf16 for n<8)."""
    return (torch.arange(n, dtype=torch.float32) + 100 * rank).to(dtype)


def main(out_dir: str) -> None:
    cpu_runtime.install(force=True)  # the layer is under test, also on a GPU machine
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    sizes = SIZES[:world]
    facts: Dict[str, object] = {"rank": rank, "world": world, "sizes": sizes}
    facts["rss"] = rss_growth(world, 1 << 20)

    def slots_of(sizes_, dtype, alias_own: bool, inp: torch.Tensor) -> List[torch.Tensor]:
        """Slots carved out of one flat buffer (like grad_data); own slot = inp if alias_own."""
        flat = torch.full((sum(sizes_),), -1.0, dtype=dtype)
        slots = list(torch.split(flat, sizes_))
        if alias_own:
            slots[rank] = inp
        return slots

    def gathered_right(slots, sizes_, dtype, sign=1) -> bool:
        return all(torch.equal(o, sign * rank_values(r, sizes_[r], dtype)) for r, o in enumerate(slots))

    # 1. list form, unequal and equal sizes, sync; own slot aliased (upstream) or separate.
    for label, sizes_ in (("unequal", sizes), ("equal", [EQUAL_NUMEL] * world)):
        for dtype in (torch.bfloat16, torch.float32):
            for alias_own in (True, False):
                inp = rank_values(rank, sizes_[rank], dtype)
                outs = slots_of(sizes_, dtype, alias_own, inp)
                res = {}
                c = counted(lambda: res.setdefault("work", dist.all_gather(outs, inp)))
                facts[f"list_{label}_{dtype}_{'alias' if alias_own else 'sep'}"] = {
                    "equal": gathered_right(outs, sizes_, dtype), "work_is_none": res["work"] is None,
                    "alloc_bytes": c["bytes"], "records": c["records"],
                }

    # 2. all_gather_into_tensor, sync, input separate or its own chunk of the output.
    for in_place in (False, True):
        dtype = torch.bfloat16
        out = torch.full((world * EQUAL_NUMEL,), -1.0, dtype=dtype)
        inp = rank_values(rank, EQUAL_NUMEL, dtype)
        if in_place:
            out[rank * EQUAL_NUMEL:(rank + 1) * EQUAL_NUMEL] = inp
            inp = out[rank * EQUAL_NUMEL:(rank + 1) * EQUAL_NUMEL]
        c = counted(lambda: dist.all_gather_into_tensor(out, inp))
        facts[f"into_tensor_{'inplace' if in_place else 'sep'}"] = {
            "equal": gathered_right(list(out.split(EQUAL_NUMEL)), [EQUAL_NUMEL] * world, dtype),
            "alloc_bytes": c["bytes"], "records": c["records"],
        }

    # 3. async: two gathers in flight per form, wait both (reverse order), then compare.
    def async_case(make):
        a_out, a_work, a_check = make(1)
        b_out, b_work, b_check = make(-1)
        waited = [b_work.wait(), a_work.wait()]
        return {"wait_returned": waited, "completed": a_work.is_completed() and b_work.is_completed(),
                "equal_a": a_check(), "equal_b": b_check()}

    def make_list(sizes_):
        def make(sign):
            inp = sign * rank_values(rank, sizes_[rank], torch.float32)
            outs = slots_of(sizes_, torch.float32, False, inp)
            work = dist.all_gather(outs, inp, async_op=True)
            return outs, work, lambda: gathered_right(outs, sizes_, torch.float32, sign)
        return make

    def make_into(sign):
        out = torch.zeros(world * EQUAL_NUMEL)
        work = dist.all_gather_into_tensor(out, sign * rank_values(rank, EQUAL_NUMEL, torch.float32),
                                           async_op=True)
        return out, work, lambda: gathered_right(list(out.split(EQUAL_NUMEL)), [EQUAL_NUMEL] * world,
                                                 torch.float32, sign)

    facts["async_unequal"] = async_case(make_list(sizes))
    facts["async_equal"] = async_case(make_list([EQUAL_NUMEL] * world))
    facts["async_into_tensor"] = async_case(make_into)
    # The flat temporary of an async equal-size gather lives until wait(), as on NCCL.
    inp = rank_values(rank, EQUAL_NUMEL, torch.float32)
    outs = slots_of([EQUAL_NUMEL] * world, torch.float32, False, inp)
    with AllocationCounter() as counter:
        work = dist.all_gather(outs, inp, async_op=True)
        live_before_wait = counter.live_bytes
        work.wait()
        import gc

        # wait() returns once gloo marks the broadcasts done; gloo's worker thread drops its
        # own reference to each finished broadcast (a view of the flat temporary) just after
        # that, outside the model. Give it until the deadline, then record what is live.
        deadline = time.monotonic() + 5
        while True:
            gc.collect()
            live_after_wait = counter.live_bytes
            if live_after_wait == 0 or time.monotonic() > deadline:
                break
            time.sleep(0.01)
    facts["async_equal_temporary"] = {"live_before_wait": live_before_wait, "live_after_wait": live_after_wait}

    # 3b. defer_async_completion: each form's output untouched until its own wait(); a work
    #     waited on second completes only then (the order a caller waits in decides).
    def deferred_case(make):
        with collectives.defer_async_completion():
            a_out, a_work, a_check = make(1)
            b_out, b_work, b_check = make(-1)
            done = getattr(a_work, "is_completed", lambda: all(w.is_completed() for w in a_work.works))
            before = [a_check(), b_check(), done()]
            b_work.wait()
            between = [a_check(), b_check()]
            a_work.wait()
            return {"before_wait": before, "after_b": between, "after_both": [a_check(), b_check()]}

    group_sizes = [3, 4, 2, 5][:world]  # every rank receives something

    def make_group(sign):
        slots = slots_of(group_sizes, torch.float32, False, None)
        slots[rank].copy_(sign * rank_values(rank, group_sizes[rank], torch.float32))
        with dist._coalescing_manager(dist.group.WORLD, device=torch.device("cpu"), async_ops=True) as cm:
            for owner, slot in enumerate(slots):
                if slot.numel():
                    dist.broadcast(slot, src=owner, async_op=True)
        return slots, cm, lambda: all(torch.equal(o, sign * rank_values(r, group_sizes[r], torch.float32))
                                      for r, o in enumerate(slots) if r != rank)

    for key, make in (("unequal", make_list(sizes)), ("equal", make_list([EQUAL_NUMEL] * world)),
                      ("into_tensor", make_into), ("broadcast_group", make_group)):
        facts[f"deferred_{key}"] = deferred_case(make)

    # 4. inside _coalescing_manager (megatron's distributed-optimizer path): one
    #    all_gather_into_tensor per bucket, waited through the manager.
    outs_c = [torch.zeros(world * n) for n in (EQUAL_NUMEL, 2)]
    with cpu_runtime.record_collectives() as calls:
        with dist._coalescing_manager(async_ops=True) as cm:
            for out in outs_c:
                n = out.numel() // world
                dist.all_gather_into_tensor(out, rank_values(rank, n, torch.float32), async_op=True)
        cm.wait()
    facts["coalesced"] = {
        "equal": all(gathered_right(list(o.split(o.numel() // world)), [o.numel() // world] * world,
                                    torch.float32) for o in outs_c),
        "records": [c.as_dict() for c in calls],
    }

    # 4b. broadcasts from the non-empty owners only, grouped into one NCCL group by
    #     _coalescing_manager(group, device): the way a caller sends only what exists.
    for async_op in (False, True):
        slots = slots_of(sizes, torch.float32, False, None)
        slots[rank].copy_(rank_values(rank, sizes[rank], torch.float32))
        with cpu_runtime.record_collectives() as calls:
            with dist._coalescing_manager(dist.group.WORLD, device=torch.device("cpu"),
                                          async_ops=async_op) as cm:
                for owner, slot in enumerate(slots):
                    if slot.numel():
                        dist.broadcast(slot, src=owner, async_op=async_op)
            if async_op:
                cm.wait()
        facts[f"broadcast_group_{'async' if async_op else 'sync'}"] = {
            "equal": gathered_right(slots, sizes, torch.float32),
            "records": [c.as_dict() for c in calls],
            "summary": collectives.summarize(calls),
        }
    # A broadcast on its own, and one of zero elements (gloo would abort on it).
    t = rank_values(rank, 4, torch.float32) if rank == 0 else torch.zeros(4)
    with cpu_runtime.record_collectives() as calls:
        dist.broadcast(t, src=0)
        dist.broadcast(torch.empty(0), src=0)
    facts["broadcast_alone"] = {"equal": torch.equal(t, rank_values(0, 4, torch.float32)),
                                "summary": collectives.summarize(calls)}

    # 5. allocations inside the unequal gather, at the allocator level (torch profiler).
    inp = rank_values(rank, sizes[rank], torch.bfloat16)
    outs = slots_of(sizes, torch.bfloat16, False, inp)
    facts["profiler_unequal_sync"] = profiled_alloc_bytes(lambda: dist.all_gather(outs, inp))
    facts["profiler_unequal_async"] = profiled_alloc_bytes(lambda: dist.all_gather(outs, inp, async_op=True).wait())
    inp_e = rank_values(rank, 1000, torch.float32)
    outs_e = slots_of([1000] * world, torch.float32, False, inp_e)
    facts["profiler_equal_sync"] = profiled_alloc_bytes(lambda: dist.all_gather(outs_e, inp_e))

    # 6. errors carry context
    try:
        dist.all_gather(outs[:-1], inp)
        facts["bad_count_error"] = None
    except ValueError as exc:
        facts["bad_count_error"] = str(exc)
    try:
        dist.all_gather_into_tensor(torch.zeros(world * 3 + 1), torch.zeros(3))
        facts["bad_size_error"] = None
    except ValueError as exc:
        facts["bad_size_error"] = str(exc)

    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(facts, f)
    dist.barrier()
    exit_rank(0)


if __name__ == "__main__":
    main(sys.argv[1])
