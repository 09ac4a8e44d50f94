"""Count tensor allocations made by the PyTorch operators inside a code region.

Used by the unit tests of the series (tests/unit_tests/test_layerwise_param_sync.py)
and by scripts/bench_param_sync.py to measure the temporaries of the layer-wise param
sync. Works the same on CPU and CUDA, in a single process or under torchrun.

How it counts: a ``TorchDispatchMode`` sees every ATen operator call of the current
thread. An output tensor whose storage is not the storage of any input is a fresh
allocation (``aten.empty``, ``aten.cat``, ``aten.clone``, the functional forms of any
op); views, in-place ops and ``out=`` ops return storages of their inputs and are not
counted. For each fresh storage the counter records its ``nbytes`` and the op name, and
tracks the live total with a weak-reference callback on the storage so that it can
report the peak of bytes alive above the start of the region.

What it does not see: allocations made inside a backend's C++ code that never surface
as tensors (e.g. Gloo's transport buffers, NCCL's internal scratch) and work done on
other threads. Neither is a tensor allocated by megatron-core or by the series.
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass
from typing import Any, List, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode


def storage_key(t: torch.Tensor) -> tuple:
    """Identity of a strided tensor's storage: (address, nbytes, device type).

    The address is the data pointer, or for meta tensors (no data) the storage object's
    own address (``_cdata``), which every view of that storage shares.
    """
    st = t.untyped_storage()
    return (_address(t, st), st.nbytes(), t.device.type)


def _address(t: torch.Tensor, st) -> int:
    return st._cdata if t.device.type == "meta" else st.data_ptr()


def _input_storages(args, kwargs) -> set:
    """Addresses (``_address``) of the storages of the tensors among an ATen call's arguments.

    ATen schemas hold tensors directly or in one level of list (``Tensor[]``,
    ``Tensor?[]``), positional or keyword; a plain loop over those is several times
    cheaper than a pytree flatten on every operator.
    """
    keys = set()
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            if value.layout == torch.strided:
                keys.add(_address(value, value.untyped_storage()))
        elif isinstance(value, (list, tuple)):
            for item in value:
                if isinstance(item, torch.Tensor) and item.layout == torch.strided:
                    keys.add(_address(item, item.untyped_storage()))
    return keys


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

    live_bytes: int = 0
    peak_extra_bytes: int = 0

    def __post_init__(self):
        super().__init__()
        self._ops: List[Tuple[Any, int]] = []  # (OpOverload, bytes): named only when read
        self._refs = set()  # weak references to the counted storages, alive until they fire

    @property
    def events(self) -> List[Tuple[str, int]]:
        return [(str(op), nbytes) for op, nbytes in self._ops]

    @property
    def alloc_calls(self) -> int:
        return len(self._ops)

    @property
    def temporary_bytes(self) -> int:
        return sum(b for _, b in self._ops)

    def _freed(self, ref, nbytes: int) -> None:
        self.live_bytes -= nbytes
        self._refs.discard(ref)

    def _account(self, func, storage, nbytes: int) -> None:
        """Record one fresh storage of ``nbytes`` made by ``func`` and watch for its free.
        Subclasses may route some storages elsewhere (e.g. per caller)."""
        self._ops.append((func, nbytes))
        self.live_bytes += nbytes
        self.peak_extra_bytes = max(self.peak_extra_bytes, self.live_bytes)
        # Storage objects are preserved per storage, so the callback fires when the last
        # tensor or view of the storage is gone.
        self._refs.add(weakref.ref(storage, functools.partial(self._freed, nbytes=nbytes)))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # Keys before the call: an out= tensor that the op resizes gets a new storage.
        inputs = _input_storages(args, kwargs)
        out = func(*args, **kwargs)
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if not isinstance(t, torch.Tensor) or t.layout != torch.strided:
                continue
            st = t.untyped_storage()
            nbytes, key = st.nbytes(), _address(t, st)
            if key in inputs or nbytes == 0:
                continue
            inputs.add(key)  # several outputs viewing one new storage count once
            self._account(func, st, nbytes)
        return out
