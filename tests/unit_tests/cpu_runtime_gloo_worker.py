"""One gloo rank for tests/unit_tests/test_cpu_runtime.py (not collected by pytest).

Run by the test as ``python cpu_runtime_gloo_worker.py OUT_DIR`` with RANK, WORLD_SIZE,
MASTER_ADDR and MASTER_PORT set; installs harness.cpu_runtime, runs every check and writes
``OUT_DIR/rank<R>.json`` with the measured facts. The test asserts on them, so a wrong result
fails there with the rank and case named; an exception here exits non-zero (the test shows
the stderr tail).
"""

from __future__ import annotations

import json
import os
import resource
import sys
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import harness.cpu_runtime as cpu_runtime

# Slot sizes per rank (elements); index 1 is empty, so every world >= 2 has an empty slot.
SIZES = [5, 0, 3, 7]


class CountAllocations(TorchDispatchMode):
    """Counts ops whose output tensor has storage that none of the op's inputs had.

    ``bytes`` is the sum of those new storages' ``nbytes``; ``ops`` names the ops.
    """

    def __init__(self):
        super().__init__()
        self.bytes = 0
        self.ops: List[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = {
            t.untyped_storage().data_ptr()
            for t in tree_flatten((args, kwargs))[0]
            if isinstance(t, torch.Tensor)
        }
        out = func(*args, **kwargs)
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes() > 0:
                if t.untyped_storage().data_ptr() not in inputs:
                    self.bytes += t.untyped_storage().nbytes()
                    self.ops.append(str(func))
        return out


def profiled_alloc_bytes(fn) -> int:
    """Bytes the torch profiler attributes to allocations in this thread during ``fn()``.

    Sum over events of positive self CPU memory (ops and unattributed ``[memory]`` records).
    """
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return sum(max(0, e.self_cpu_memory_usage) for e in prof.events())


def dispatch_alloc(fn) -> Dict[str, object]:
    with CountAllocations() as counter:
        fn()
    return {"bytes": counter.bytes, "ops": counter.ops}


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
    """torch's own all_gather on gloo. Torch-function handling is disabled: with the runtime's
    mode active, torch.distributed.all_gather re-dispatches to the patched module attribute."""
    with torch._C.DisableTorchFunction():
        cpu_runtime._real_all_gather(outs, inp)


def rss_growth(world: int, slot_numel: int) -> Dict[str, Optional[int]]:
    """Peak-RSS growth (bytes) of gathers of ``world`` fp32 slots of ``slot_numel`` each.

    Buffers are touched before measuring and one warm-up gather runs first (gloo sets up
    its transport lazily). Control: gloo's own allgather flattens into a new
    ``world * slot`` buffer, which must show up; it runs last and only once, because
    afterwards malloc reuses that freed, already resident region.
    """
    outs = [torch.zeros(slot_numel) for _ in range(world)]
    inp = torch.ones(slot_numel)
    cpu_runtime.all_gather_by_broadcast(outs, inp)  # warm-up (gloo transport)
    return {
        "sync": peak_rss_growth(lambda: dist.all_gather(outs, inp)),
        "async": peak_rss_growth(lambda: dist.all_gather(outs, inp, async_op=True).wait()),
        "control_gloo_allgather": peak_rss_growth(lambda: gloo_native_all_gather(outs, inp)),
        "slot_bytes": slot_numel * 4,
    }


def rank_values(rank: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    """Deterministic distinct payload of rank ``rank``: 100*rank + 0..n-1 (exact in bf16 for n<8)."""
    return (torch.arange(n, dtype=torch.float32) + 100 * rank).to(dtype)


def main(out_dir: str) -> None:
    cpu_runtime.install(force=True)  # the layer is under test, also on a GPU machine
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    sizes = SIZES[:world]
    facts: Dict[str, object] = {"rank": rank, "world": world, "sizes": sizes}
    facts["rss"] = rss_growth(world, 1 << 20)

    def outputs(dtype, alias_own: bool, inp: torch.Tensor) -> List[torch.Tensor]:
        """Carve slots out of one flat buffer (like grad_data); own slot = inp if alias_own."""
        flat = torch.full((sum(sizes),), -1.0, dtype=dtype)
        slots = list(torch.split(flat, sizes))
        if alias_own:
            slots[rank] = inp
        return slots

    # 1. uneven, sync, bf16 and fp32, own slot aliased (upstream) or separate (patched layout)
    for dtype in (torch.bfloat16, torch.float32):
        for alias_own in (True, False):
            inp = rank_values(rank, sizes[rank], dtype)
            outs = outputs(dtype, alias_own, inp)
            work = dist.all_gather(outs, inp)
            ok = all(torch.equal(o, rank_values(r, sizes[r], dtype)) for r, o in enumerate(outs))
            facts[f"sync_{dtype}_{'alias' if alias_own else 'sep'}"] = {"equal": ok, "work_is_none": work is None}

    # 2. async: two gathers in flight, wait both, then compare
    inp_a = rank_values(rank, sizes[rank], torch.float32)
    inp_b = rank_values(rank, sizes[rank], torch.float32) * -1
    outs_a = outputs(torch.float32, False, inp_a)
    outs_b = outputs(torch.float32, False, inp_b)
    work_a = dist.all_gather(outs_a, inp_a, async_op=True)
    work_b = dist.all_gather(outs_b, inp_b, async_op=True)
    waited = [work_b.wait(), work_a.wait()]
    facts["async"] = {
        "has_wait": hasattr(work_a, "wait"),
        "wait_returned": waited,
        "completed": work_a.is_completed() and work_b.is_completed(),
        "equal_a": all(torch.equal(o, rank_values(r, sizes[r], torch.float32)) for r, o in enumerate(outs_a)),
        "equal_b": all(torch.equal(o, -rank_values(r, sizes[r], torch.float32)) for r, o in enumerate(outs_b)),
    }

    # 3. allocations inside the gather (buffers are made before measuring)
    inp = rank_values(rank, sizes[rank], torch.bfloat16)
    outs = outputs(torch.bfloat16, False, inp)

    def gather_sync():
        dist.all_gather(outs, inp)

    def gather_async():
        dist.all_gather(outs, inp, async_op=True).wait()

    facts["alloc_profiler_sync"] = profiled_alloc_bytes(gather_sync)
    facts["alloc_profiler_async"] = profiled_alloc_bytes(gather_async)
    facts["alloc_dispatch_sync"] = dispatch_alloc(gather_sync)
    facts["alloc_dispatch_async"] = dispatch_alloc(gather_async)
    # Positive controls: the same instruments must see an allocation made next to a gather.
    # (They only see this thread's torch allocations; rss_growth covers gloo's threads.)
    facts["control_profiler_empty"] = profiled_alloc_bytes(lambda: (gather_sync(), torch.empty(1000)))
    facts["control_dispatch_clone"] = dispatch_alloc(lambda: (gather_sync(), torch.ones(1000).clone()))

    # 4. errors carry context
    try:
        dist.all_gather(outs[:-1], inp)
        facts["bad_count_error"] = None
    except ValueError as exc:
        facts["bad_count_error"] = str(exc)

    dist.barrier()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(facts, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
