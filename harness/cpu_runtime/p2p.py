"""Point-to-point sends keep their memory until they complete, as on NCCL.

Megatron's interleaved pipeline schedule (``core/pipeline_parallel/schedules.py:
forward_backward_pipelining_with_interleaving``, p2p overlap, which 0.17.1 turns on for
every interleaved run: ``--no-overlap-p2p-communication`` is refused at PP=2) posts the
send of a microbatch's output with ``torch.distributed.isend`` and, before that send
is waited on, "pseudo-frees" the output: ``deallocate_output_tensor`` sets
``out.data = torch.empty((1,))``. That swaps the storage of the very tensor the work
handle holds, so nothing references the sent bytes any more.

On GPUs this is safe: ProcessGroupNCCL records its communication stream on the tensor's
storage (``CUDACachingAllocator::recordStream(tensor.storage().data_ptr(), ncclStream)``),
and the caching allocator does not hand that block to another tensor before the send has
run. ProcessGroupGloo only keeps the tensor object in its work, and gloo reads the bytes
when the receiver has posted its receive: the freed block is meanwhile reused by the next
forward's allocations and the next stage receives whatever they wrote. Measured on the
PP 2 x VPP 2 tiny GPT: with 3 or more microbatches per step (so that the schedule has a
steady 1F1B phase; warm-up and cool-down sends are blocking) lm loss is wrong from step 1
and NaN within a few steps; with 2 microbatches every send is blocking and nothing changes.

``install`` wraps ``ProcessGroup.send`` (under ``isend``, ``send`` and
``batch_isend_irecv``): the storages of the sent tensors stay referenced until the work
has completed (gloo marks it so in ``wait()``; checked at every later send) or its handle
is released. Megatron drops one send handle unwaited, the last forward send of a step,
and only when the schedule returns, after that microbatch's grads came back from the
receiver. That is the allocator guarantee NCCL gives; the bytes sent and received are
unchanged. ``in_flight_sends()`` counts what is held.
"""

from __future__ import annotations

import weakref
from typing import Callable, List, Tuple

import torch
import torch.distributed as dist

# Work handle -> storages of its send buffers; an entry goes when the handle is released.
_held: "weakref.WeakKeyDictionary[dist.Work, Tuple[torch.UntypedStorage, ...]]" = weakref.WeakKeyDictionary()


def _release_completed() -> None:
    """Drop the storages of sends whose work has completed."""
    for work in [w for w in list(_held.keys()) if w.is_completed()]:
        _held.pop(work, None)


def send_keeping_storage(real_send: Callable) -> Callable:
    """``ProcessGroup.send(self, tensors, dstRank, tag)`` that holds the tensors' storages.

    Returns:
        A function with ``real_send``'s signature and result (the real ``Work``).
    """

    def send(self, tensors: List[torch.Tensor], *args, **kwargs):
        _release_completed()
        work = real_send(self, tensors, *args, **kwargs)
        if work is not None:
            _held[work] = tuple(t.untyped_storage() for t in tensors)
        return work

    send.__doc__ = real_send.__doc__
    send.__name__ = "send"
    return send


def in_flight_sends() -> int:
    """Number of send work handles whose buffers are still held (not completed, not released)."""
    _release_completed()
    return len(_held)


def install(replace) -> None:
    """Wrap ``torch.distributed.ProcessGroup.send`` through ``replace`` (``patching.replace``)."""
    pg = torch._C._distributed_c10d.ProcessGroup
    replace(pg, "send", send_keeping_storage(pg.__dict__["send"]))


def clear() -> None:
    """Forget every held storage (uninstall)."""
    _held.clear()
