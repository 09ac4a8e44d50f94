"""Count tensor allocations made by the PyTorch operators inside a code region.

Used by the unit tests of the series (tests/unit_tests/test_layerwise_param_sync.py)
and by scripts/bench_param_sync.py to measure the temporaries of the layer-wise param
sync. Works the same on CPU and CUDA, in a single process or under torchrun.

How it counts: a ``TorchDispatchMode`` sees every ATen operator call of the current
thread. An output tensor whose storage is not the storage of any input is a fresh
allocation (``aten.empty``, ``aten.cat``, ``aten.clone``, the functional forms of any
op); views, in-place ops and ``out=`` ops return storages of their inputs and are not
counted. For each fresh storage the counter records its ``nbytes`` and the op name, and
tracks the live total with a weakref finalizer on the storage so that it can
report the peak of bytes alive above the start of the region.

What it does not see: allocations made inside a backend's C++ code that never surface
as tensors (e.g. Gloo's transport buffers, NCCL's internal scratch) and work done on
other threads. Neither is a tensor allocated by megatron-core or by the series.

Meta tensors (the storage-free runs of ``harness/bench/real_shapes_worker.py``) all have
data pointer 0; their storages are told apart by the storage object itself
(``storage_key``), so the same rules apply there.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import List, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


def storage_key(t: torch.Tensor) -> tuple:
    """Identity of a strided tensor's storage: (address, nbytes, device type).

    The address is the data pointer, or for meta tensors (no data) the storage object's
    own address (``_cdata``), which every view of that storage shares.
    """
    st = t.untyped_storage()
    address = st._cdata if t.device.type == "meta" else st.data_ptr()
    return (address, st.nbytes(), t.device.type)


def _storages(values) -> set:
    """storage_key of each tensor storage among `values` (pytree leaves)."""
    return {storage_key(v) for v in values if isinstance(v, torch.Tensor) and v.layout == torch.strided}


@dataclass
class AllocationCounter(TorchDispatchMode):
    """Context manager counting fresh tensor storages created by ATen ops.

    Attributes (valid after the ``with`` block, and live inside it):
        events: list of (op name, bytes) per fresh storage, in call order.
        alloc_calls: number of fresh storages (int).
        temporary_bytes: sum of their sizes in bytes (int).
        peak_extra_bytes: peak of bytes alive at once among those storages (int);
            freed storages are subtracted when their last tensor is collected.

    Example::

        with AllocationCounter() as c:
            bucket_group.start_param_sync(); bucket_group.finish_param_sync()
        assert c.temporary_bytes == 0
    """

    events: List[Tuple[str, int]] = field(default_factory=list)
    live_bytes: int = 0
    peak_extra_bytes: int = 0

    def __post_init__(self):
        super().__init__()

    @property
    def alloc_calls(self) -> int:
        return len(self.events)

    @property
    def temporary_bytes(self) -> int:
        return sum(b for _, b in self.events)

    def _freed(self, nbytes: int) -> None:
        self.live_bytes -= nbytes

    def _account(self, func, storage, nbytes: int) -> None:
        """Record one fresh storage of ``nbytes`` made by ``func`` and watch for its free.
        Subclasses may route some storages elsewhere (e.g. per caller)."""
        self.events.append((str(func), nbytes))
        self.live_bytes += nbytes
        self.peak_extra_bytes = max(self.peak_extra_bytes, self.live_bytes)
        # Storage objects are preserved per storage, so this fires when the last
        # tensor or view of the storage is gone.
        weakref.finalize(storage, self._freed, nbytes)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # Keys before the call: an out= tensor that the op resizes gets a new storage.
        inputs = _storages(tree_flatten((args, kwargs))[0])
        out = func(*args, **kwargs)
        seen = set()
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or t.layout != torch.strided:
                continue
            st = t.untyped_storage()
            key = storage_key(t)
            if key in inputs or key in seen or st.nbytes() == 0:
                continue
            seen.add(key)
            self._account(func, st, st.nbytes())
        return out
