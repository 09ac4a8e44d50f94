"""Per-sync counters of the bench: collectives seen at the dispatch level, and every C++
allocation seen by torch.profiler.

* ``SyncCounter`` extends ``harness.alloc_counter.AllocationCounter`` (fresh tensor
  storages of ATen ops) with the ``c10d`` collective ops the same ``TorchDispatchMode``
  sees: ``c10d.allgather_`` (list form), ``c10d._allgather_base_``
  (``all_gather_into_tensor``), ``c10d.broadcast_`` and their coalesced forms. For each it
  records NCCL's launches (calls issued to NCCL), the bytes this rank receives (padding
  included) and, for the list form, what ProcessGroupNCCL allocates
  (``harness.bench.theory.nccl_list_all_gather``). When the CPU runtime layer's collective
  model turns a list ``all_gather`` into other ops before dispatch, the counter sees and
  counts those ops instead.
* ``ProfiledAllocations`` runs ``torch.profiler`` with ``profile_memory=True`` and sums
  the allocator's events on every thread, gloo's worker threads included, which no
  dispatch mode sees.

Units: bytes and counts, per region.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Iterator, List, Optional

import torch

from harness.alloc_counter import AllocationCounter
from harness.bench import theory


_MARKER_BYTES = 64


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@dataclass
class CollectiveCall:
    """One c10d op: `op` (e.g. "c10d.broadcast_"), NCCL `launches`, `wire_bytes`
    received by this rank, `nccl_temporary_bytes` ProcessGroupNCCL allocates for it,
    `shares_equal` (list form: every slot the same size; None for other ops)."""

    op: str
    launches: int
    wire_bytes: int
    nccl_temporary_bytes: int = 0
    shares_equal: Optional[bool] = None


def _rank(pg) -> int:
    """This process's rank in the ProcessGroup a c10d op receives (a ScriptObject)."""
    return torch.distributed.ProcessGroup.unbox(pg).rank()


def _classify(func, args) -> Optional[CollectiveCall]:
    """CollectiveCall of a c10d op from its dispatcher arguments; None for other ops."""
    name = str(func)
    if not name.startswith("c10d."):
        return None
    base = name.split(".")[1]
    if base in ("allgather_", "allgather_coalesced_"):
        outputs, inputs, pg = args[0], args[1], args[2]
        rank = _rank(pg)
        call = CollectiveCall(name, 0, 0, 0, True)
        for outs, inp in zip(outputs, inputs):
            sizes = [o.numel() for o in outs]
            launches, temp = theory.nccl_list_all_gather(sizes, inp.element_size())
            call.launches += launches
            call.nccl_temporary_bytes += temp
            call.wire_bytes += sum(_nbytes(o) for i, o in enumerate(outs) if i != rank)
            call.shares_equal = call.shares_equal and len(set(sizes)) <= 1
        return call
    if base in ("_allgather_base_", "allgather_into_tensor_coalesced_"):
        outs, inps = args[0], args[1]
        if isinstance(outs, torch.Tensor):
            outs, inps = [outs], [inps]
        wire = sum(_nbytes(o) - _nbytes(i) for o, i in zip(outs, inps))
        return CollectiveCall(name, len(outs), wire)
    if base == "broadcast_":
        tensors, pg, root = args[0], args[1], args[2]
        wire = 0 if _rank(pg) == root else sum(_nbytes(t) for t in tensors)
        return CollectiveCall(name, 1, wire)
    if base == "barrier":
        return None
    # Any other collective (all-reduce, reduce-scatter, ...): one launch, bytes unknown.
    return CollectiveCall(name, 1, 0)


@dataclass
class SyncCounter(AllocationCounter):
    """AllocationCounter plus the collectives of the region (see module docstring).

    Attributes (after the ``with`` block): those of AllocationCounter, and
        calls: list of CollectiveCall in issue order;
        collective_launches, wire_bytes, nccl_temporary_bytes: their sums.
    """

    calls: List[CollectiveCall] = field(default_factory=list)

    @property
    def collective_launches(self) -> int:
        return sum(c.launches for c in self.calls)

    @property
    def wire_bytes(self) -> int:
        return sum(c.wire_bytes for c in self.calls)

    @property
    def nccl_temporary_bytes(self) -> int:
        return sum(c.nccl_temporary_bytes for c in self.calls)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        call = _classify(func, args)
        if call is not None:
            self.calls.append(call)
        return super().__torch_dispatch__(func, types, args, kwargs)


def collective_model():
    """The CPU runtime layer's collective model module (harness.cpu_runtime.collectives),
    or None where this checkout has none yet (then SyncCounter's own c10d counts serve)."""
    try:
        from harness.cpu_runtime import collectives
    except ImportError:
        return None
    return collectives if hasattr(collectives, "record_collectives") else None


@contextlib.contextmanager
def model_records() -> Iterator[Optional[list]]:
    """The collective model's records of the block (``record_collectives()``), or None
    when there is no model (see collective_model())."""
    model = collective_model()
    if model is None:
        yield None
        return
    with model.record_collectives() as calls:
        yield calls


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
