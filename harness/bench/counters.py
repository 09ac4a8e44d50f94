"""Per-sync counters of the bench, next to harness.alloc_counter.AllocationCounter (tensor
storages of ATen ops, the dispatch level):

* ``model_standin_bytes``: of the collective model's records
  (``harness.cpu_runtime.record_collectives``: per all-gather, NCCL launches, bytes
  received, what ProcessGroupNCCL allocates), the temporaries the model itself allocated
  through torch, so that the dispatch-level count can be split into megatron's and NCCL's.
* ``ProfiledAllocations`` runs ``torch.profiler`` with ``profile_memory=True`` and sums
  the allocator's events on every thread, gloo's worker threads included, which no
  dispatch mode sees.

Units: bytes and counts, per region.
"""

from __future__ import annotations

import torch

from harness.cpu_runtime import collectives

_MARKER_BYTES = 64


def model_standin_bytes(calls: list, backend: str) -> int:
    """Bytes of NCCL temporaries that the collective model allocated through torch (it
    executes gloo and fake-backend calls itself, so allocation counters see them); 0 for
    calls it passes to torch (NCCL, where c10d allocates them out of sight)."""
    if not any(b in backend for b in collectives.MODEL_BACKENDS):
        return 0
    return sum(c.nccl_temporary_bytes for c in calls)


class ProfiledAllocations:
    """Context manager: torch.profiler memory events of the region, every thread.

    Attributes (after the ``with`` block):
        alloc_bytes: sum of the sizes of all allocations (bytes);
        alloc_calls: their number;
        peak_bytes: most bytes alive at once above the region's start, in time order
            over all threads (bytes);
        caller_thread_bytes: alloc_bytes of allocations made on the thread that entered
            the region (the rest are the backend's own threads, e.g. gloo's workers);
        timeline: [(t_ns, delta_bytes)] in time order, for per-phase peaks.
    """

    def __init__(self, activities=None):
        from torch.profiler import ProfilerActivity, profile

        self._prof = profile(
            activities=activities or [ProfilerActivity.CPU], profile_memory=True
        )
        self.alloc_bytes = self.alloc_calls = self.peak_bytes = self.caller_thread_bytes = 0
        self.timeline = []
        self._marker = None

    def __enter__(self):
        self._prof.__enter__()
        self._marker = torch.empty(_MARKER_BYTES, dtype=torch.uint8)
        # A marker allocation: its thread id (the profiler's own numbering) is the caller's.
        self._marker = None
        return self

    def __exit__(self, *exc):
        self._prof.__exit__(*exc)
        if exc[0] is None:
            self._collect()
        return False

    def _collect(self) -> None:
        from torch._C._profiler import _EventType

        stack = list(self._prof.profiler.kineto_results.experimental_event_tree())
        allocs = []
        while stack:
            node = stack.pop()
            stack.extend(node.children)
            if node.tag == _EventType.Allocation:
                allocs.append(node)
        allocs.sort(key=lambda n: n.start_time_ns)
        # The first two events are the marker's allocation and free.
        marker, allocs = allocs[:2], allocs[2:]
        caller = marker[0].start_tid
        live = 0
        for n in allocs:
            size = n.extra_fields.alloc_size
            self.timeline.append((n.start_time_ns, size))
            live += size
            self.peak_bytes = max(self.peak_bytes, live)
            if size > 0:
                self.alloc_bytes += size
                self.alloc_calls += 1
                if n.start_tid == caller:
                    self.caller_thread_bytes += size
