"""``torch.cuda`` and ``torch.accelerator`` stand-ins for a process without a GPU.

``stubs()`` maps ``torch.cuda`` attribute names to replacements: ``is_available`` (True),
``device_count`` (1), ``current_device``/``set_device``/``device`` (one device, index
remembered), ``Stream``/``Event``/``current_stream``/``default_stream``/``set_stream``/
``stream`` (one ordered CPU timeline: every wait is a no-op, events time with
``time.perf_counter`` and ``elapsed_time`` returns milliseconds), ``synchronize``,
``empty_cache``, ``is_current_stream_capturing`` (False) and the memory statistics.
Needed by ``training/initialize.py:_initialize_distributed`` (``device_count() > 0`` gates
``mpu.initialize_model_parallel``), ``core/timers.py``, ``training/training.py:training_log``
and DDP's communication streams.

The memory statistics return **0**: there is no CPU allocator statistic, and this layer
must not invent numbers (measure with ``harness.alloc_counter`` or the torch profiler).

``accelerator_stubs()``: ``torch.accelerator.is_available()`` False and
``current_accelerator()`` None, so ``torch.utils.data.DataLoader`` does not pin memory
(``training/datasets/data_samplers.py`` passes ``pin_memory=True``).

``get_device_capability`` returns ``(0, 0)``, a device with no CUDA compute capability, so
every ``>= 9`` / ``>= 10`` feature probe says no. Needed by upstream main (d98e8a64dd):
``megatron/core/ssm/ops/gdp/common.py`` probes the capability at import time, and
``megatron.training`` imports it (through ``inference/contexts/dynamic_context.py``); the
pinned releases never call it on a CPU run (without the stub it raises "Found no NVIDIA
driver"), so the stub changes nothing there.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Dict, List, Optional

import torch

from harness.cpu_runtime.device import CPU


class Event:
    """Stand-in for ``torch.cuda.Event``: everything is already complete on CPU."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False, **kwargs):
        self._t: Optional[float] = None

    def record(self, stream: Any = None) -> None:
        self._t = time.perf_counter()

    def wait(self, stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end_event: "Event") -> float:
        """Milliseconds from this event's ``record()`` to ``end_event``'s, as CUDA reports."""
        if self._t is None or end_event._t is None:
            raise RuntimeError("cpu_runtime Event.elapsed_time: both events must be recorded first")
        return (end_event._t - self._t) * 1000.0


class Stream:
    """Stand-in for ``torch.cuda.Stream``: one ordered CPU timeline, all waits are no-ops."""

    cuda_stream = 0
    device = CPU

    def __init__(self, device: Any = None, priority: int = 0, **kwargs):
        self.priority = priority

    def wait_stream(self, stream: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: Optional[Event] = None) -> Event:
        event = event if event is not None else Event()
        event.record(self)
        return event

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


_default_stream = Stream()
_current_stream: List[Stream] = [_default_stream]  # one-element box
_current_device: List[int] = [0]


def _set_stream(stream: Any) -> None:
    _current_stream[0] = stream if stream is not None else _default_stream


class _stream_ctx:
    """``torch.cuda.stream(s)``: make ``s`` current for the block.

    An object, not a generator, because megatron enters one such context more than once
    (``param_and_grad_buffer.py:start_grad_sync`` with several distributed-optimizer
    instances), as torch's ``StreamContext`` allows.
    """

    def __init__(self, stream: Any = None):
        self.stream = stream
        self._previous: List[Any] = []

    def __enter__(self):
        self._previous.append(_current_stream[0])
        if self.stream is not None:
            _current_stream[0] = self.stream
        return self.stream

    def __exit__(self, *exc):
        _current_stream[0] = self._previous.pop()
        return False


class _DeviceCtx:
    """``torch.cuda.device(i)``: a no-op context (one CPU "device")."""

    def __init__(self, device: Any = None):
        self.idx = device

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _set_device(device: Any) -> None:
    if isinstance(device, torch.device):
        device = device.index or 0
    elif isinstance(device, str):
        device = torch.device(device).index or 0
    _current_device[0] = int(device)


def _zero(*args, **kwargs) -> int:
    return 0


def noop(*args, **kwargs) -> None:
    return None


def _memory_stats(device: Any = None) -> dict:
    """The keys ``training.py:training_log`` reads, all 0 (no CPU allocator statistics)."""
    keys = ("allocated_bytes.all.current", "allocated_bytes.all.peak", "reserved_bytes.all.current",
            "reserved_bytes.all.peak", "allocation.all.current", "allocation.all.peak")
    return {k: 0 for k in keys}


def stubs() -> Dict[str, Callable]:
    """``torch.cuda`` attribute name -> replacement (see the module docstring)."""
    return {
        "is_available": lambda: True,
        "device_count": lambda: 1,
        "current_device": lambda: _current_device[0],
        "set_device": _set_device,
        "device": _DeviceCtx,
        "Stream": Stream,
        "Event": Event,
        "current_stream": lambda device=None: _current_stream[0],
        "default_stream": lambda device=None: _default_stream,
        "set_stream": _set_stream,
        "stream": _stream_ctx,
        "is_current_stream_capturing": lambda: False,
        "synchronize": noop,
        "empty_cache": noop,
        "memory_stats": _memory_stats,
        "memory_allocated": _zero,
        "max_memory_allocated": _zero,
        "memory_reserved": _zero,
        "max_memory_reserved": _zero,
        "reset_peak_memory_stats": noop,
        "reset_max_memory_allocated": noop,
        "device_memory_used": _zero,
        "get_device_name": lambda device=None: "cpu (harness.cpu_runtime)",
        "get_device_capability": lambda device=None: (0, 0),
    }


def accelerator_stubs() -> Dict[str, Callable]:
    """``torch.accelerator`` attribute name -> replacement: no accelerator."""
    return {"is_available": lambda: False, "current_accelerator": lambda check_available=False: None}


def moe_tensor_to_host(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
    """``megatron/core/transformer/moe/moe_utils.py:maybe_move_tensor_to_cpu`` for tensors
    that stand in for CUDA ones.

    Megatron copies a tensor to the host only when ``tensor.is_cuda``; under this layer every
    tensor is a CPU tensor, so the alltoall token dispatcher's split sizes would stay torch
    tensors, which ``all_to_all_single`` rejects (``TypeError: alltoall_base(): incompatible
    function arguments``). This takes the CUDA branch for every tensor: a host copy (numpy
    with ``as_numpy``, as the dispatcher asks for its ``input_splits``/``output_splits``);
    ``record_stream`` has no stream to record on. Anything else (numpy, None) is returned
    unchanged, as upstream does.
    """
    if not torch.is_tensor(tensor):
        return tensor
    host = tensor.detach().clone()
    return host.numpy() if as_numpy else host
