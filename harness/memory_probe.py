"""How the memory worker (``harness/gpu_check/memory_worker.py``) reads peak memory: the one
device-specific part of its measurement.

A probe measures a region (a training step, one param sync) and named phases inside it,
which may nest (the optimizer gather inside the optimizer step). After the region it holds,
in bytes:

* ``peak``: the most bytes alive at once during the region, above the bytes alive at its
  start;
* ``phase_peaks``: ``{phase: bytes}``, the same within each phase (phases never entered are
  absent); the bytes alive when a phase starts are its floor;
* ``base``: bytes allocated at the start (CUDA only; None on CPU);
* ``reserved``: ``{phase: bytes}`` the caching allocator holds at each phase's end, and
  ``reserved_end`` at the region's end (CUDA only; None on CPU).

``CudaProbe``: ``torch.cuda.memory_allocated``, ``max_memory_allocated`` (reset at each phase
boundary, the maxima carried to the enclosing phases) and ``memory_reserved``, after a
``torch.cuda.synchronize()``. ``CpuProbe``: ``torch.profiler`` memory events
(``harness.bench.counters.ProfiledAllocations``): every allocation made during the region on
every thread of the process, gloo's workers included, phases marked with ``record_function``
(the profiler does not report frees of blocks allocated before the region). ``probe(gpu)``
picks one.
"""

from __future__ import annotations

import bisect
import contextlib
from typing import Dict, List, Optional, Tuple

import torch

_PREFIX = "memory_phase:"


class CudaProbe:
    """Peaks from the CUDA caching allocator's statistics (see the module docstring)."""

    def __init__(self, cuda=torch.cuda):
        self.cuda = cuda  # torch.cuda; tests give a stand-in with the same five functions
        self.base: Optional[int] = None
        self.peak = 0
        self.phase_peaks: Dict[str, int] = {}
        self.reserved: Dict[str, Optional[int]] = {}
        self.reserved_end: Optional[int] = None
        self._open: List[str] = []
        self._max = 0  # absolute bytes

    def _read(self) -> int:
        """Max allocated since the last reset, carried into every open phase and the region."""
        self.cuda.synchronize()
        top = self.cuda.max_memory_allocated()
        self._max = max(self._max, top)
        for name in self._open:
            self.phase_peaks[name] = max(self.phase_peaks.get(name, 0), top)
        return top

    @contextlib.contextmanager
    def region(self):
        self.cuda.synchronize()
        self.base = self.cuda.memory_allocated()
        self.cuda.reset_peak_memory_stats()
        self._max, self._open, self.phase_peaks, self.reserved = self.base, [], {}, {}
        yield self
        self._read()
        self.peak = self._max - self.base
        self.phase_peaks = {k: v - self.base for k, v in self.phase_peaks.items()}
        self.reserved_end = self.cuda.memory_reserved()

    @contextlib.contextmanager
    def phase(self, name: str):
        self._read()
        self.cuda.reset_peak_memory_stats()
        self._open.append(name)
        try:
            yield
        finally:
            self._read()
            self._open.remove(name)
            self.reserved[name] = self.cuda.memory_reserved()


class CpuProbe:
    """Peaks from torch.profiler's memory events (see the module docstring)."""

    base = None
    reserved_end = None

    def __init__(self):
        self.peak = 0
        self.phase_peaks: Dict[str, int] = {}
        self.reserved: Dict[str, Optional[int]] = {}

    @contextlib.contextmanager
    def region(self):
        from harness.bench.counters import ProfiledAllocations

        with ProfiledAllocations() as prof:
            yield self
        spans = _spans(prof)
        self.peak = prof.peak_bytes
        self.phase_peaks = phase_peaks(prof.timeline, spans)
        self.reserved = dict.fromkeys(spans)

    @contextlib.contextmanager
    def phase(self, name: str):
        with torch.profiler.record_function(_PREFIX + name):
            yield


def probe(gpu: bool):
    """A fresh ``CudaProbe`` where ``gpu``, else a ``CpuProbe``."""
    return CudaProbe() if gpu else CpuProbe()


def phase_peaks(timeline: List[Tuple[int, int]], spans: Dict[str, Tuple[int, int]]) -> Dict[str, int]:
    """Peak bytes alive above the region's start within each phase's [start, end] (ns).

    Args:
        timeline: ``[(t_ns, delta bytes)]`` of the region's allocations (+) and frees (-) in
            time order (``ProfiledAllocations.timeline``).
        spans: ``{phase: (start_ns, end_ns)}`` on the profiler's clock; spans may nest.

    Returns:
        ``{phase: peak bytes}``; the level alive when a phase starts is its floor.
    """
    times = [t for t, _ in timeline]
    levels, live = [], 0
    for _, delta in timeline:
        live += delta
        levels.append(live)
    peaks = {}
    for name, (start, end) in spans.items():
        i = bisect.bisect_left(times, start)
        j = bisect.bisect_right(times, end)
        floor = levels[i - 1] if i > 0 else 0
        peaks[name] = max([floor] + levels[i:j])
    return peaks


def _spans(prof) -> Dict[str, Tuple[int, int]]:
    """``{phase: (start_ns, end_ns)}`` of the ``CpuProbe.phase`` marks in the profile."""
    out = {}
    stack = list(prof._prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        stack.extend(node.children)
        if node.name.startswith(_PREFIX):
            out[node.name[len(_PREFIX):]] = (node.start_time_ns, node.end_time_ns)
    return out
